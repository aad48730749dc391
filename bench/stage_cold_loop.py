"""N ``hooks.stage`` calls while a cold start is collected, as in ``emit_vs_span.py``'s first
phase, then exit: for counting the calling thread's instructions per stage, which a busy
machine does not blur as it does times (issue 25). The drain thread is stopped first, so
that when it runs does not change the caller's path (the stages stay queued).

    valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file=cg.10k \\
        python bench/stage_cold_loop.py 10000     # then 30000 into cg.30k
    # (totals of cg.30k-01 - totals of cg.10k-01) / 20000 = instructions per stage

The agent it starts is stopped, and its directory removed, however the run ends: before the
final ``os._exit`` (which skips exit handlers), or at exit after a failure, Ctrl-C, SIGTERM or
SIGHUP (``bench_agent``).

Run: python bench/stage_cold_loop.py N
"""

from __future__ import annotations

import gc
import os
import sys
import time

from bench_agent import start_bench_agent  # bench/ is on sys.path when run as a script
from emit_vs_span import N, activate


def main() -> None:
    n = int(sys.argv[1])
    assert n + 3000 < 2 * N, "more stages than the buffer's calm range holds"
    agent = start_bench_agent()
    activate(agent.sock, agent.spool)
    from infersight import hooks
    from infersight.hooks import _coldstart, _runtime

    _coldstart.install(time.time_ns())
    st = _coldstart.state()
    assert st.collecting
    assert st.sampler is not None, "no stack sampler"
    assert st.finder is not None, "no import timing"

    def stages(k: int) -> None:
        s = hooks.stage
        for _i in range(k):
            with s("tokenizer_load", model="resnet50"):
                pass

    stages(3000)  # warm: specialized bytecode, span ids drawn
    client = _runtime.state().client
    assert client is not None
    assert client.flush(60)
    client._stop = True  # the drain thread ends; the client stays enabled
    client._wake.set()
    client._thread.join(10)
    gc.collect()
    stages(n)
    assert st.collecting
    agent.stop()  # (the same instructions in every run: they cancel out)
    os._exit(0)  # no exit handlers: nothing after the loop is counted


if __name__ == "__main__":
    main()
