"""N fresh module imports while a cold start is collected, then exit: for counting the calling
thread's instructions per import (callgrind), as ``stage_cold_loop.py`` does per stage. The
modules are written and compiled first, in another process (``prepare``), so that the counted
run only imports them.

    python bench/import_cold_loop.py prepare DIR 30000
    valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file=cg.top.10k \\
        python bench/import_cold_loop.py DIR 10000 top     # then 30000 into cg.top.30k
    # (totals of cg.top.30k-01 - totals of cg.top.10k-01) / 20000 = instructions per import

The last argument says where the imports run: ``top`` (outermost imports outside any stage),
``stage`` (the same inside one ``hooks.stage``: a ``framework_import`` nested under it) or
``off`` (the import finder taken out: the import system's own cost). The finder's cost per
import is a variant's figure less ``off``'s. The garbage collector is off while they run.

The agent it starts is stopped, and its directory removed, however the run ends: before the
final ``os._exit`` (which skips exit handlers), or at exit after a failure, Ctrl-C, SIGTERM or
SIGHUP (``bench_agent``).

Run: python bench/import_cold_loop.py DIR N top|stage|off
"""

from __future__ import annotations

import compileall
import gc
import importlib
import os
import sys
import time

from bench_agent import start_bench_agent  # bench/ is on sys.path when run as a script
from emit_vs_span import activate


def prepare(directory: str, n: int) -> None:
    os.makedirs(directory, exist_ok=True)
    for i in range(n):
        with open(os.path.join(directory, "icl_%d.py" % i), "w") as f:
            f.write("X = %d\n" % i)
    compileall.compile_dir(directory, quiet=1)


def main() -> None:
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2], int(sys.argv[3]))
        return
    directory, n, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    assert where in ("top", "stage", "off"), where
    agent = start_bench_agent()
    activate(agent.sock, agent.spool)
    from infersight import hooks
    from infersight.hooks import _coldstart, _runtime

    _coldstart.install(time.time_ns())
    st = _coldstart.state()
    assert st.collecting
    assert st.finder is not None, "no import timing"
    sys.path.insert(0, directory)
    names = ["icl_%d" % i for i in range(n + 100)]
    for name in names[n:]:  # warm: the finder's and the import system's paths taken once
        importlib.import_module(name)
    client = _runtime.state().client
    assert client is not None
    assert client.flush(60)
    client._stop = True  # the drain thread ends; the client stays enabled
    client._wake.set()
    client._thread.join(10)
    if where == "off":
        sys.meta_path.remove(st.finder)
    gc.collect()
    gc.disable()  # where a collection falls differs with N and would blur the difference by ~10k per import
    imp = importlib.import_module
    if where == "stage":
        with hooks.stage("bench_imports"):
            for name in names[:n]:
                imp(name)
    else:
        for name in names[:n]:
            imp(name)
    assert st.collecting
    agent.stop()  # (the same instructions in every run: they cancel out)
    os._exit(0)  # no exit handlers: nothing after the loop is counted


if __name__ == "__main__":
    main()
