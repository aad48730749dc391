"""N ``hooks.stage`` calls while a cold start is collected, as in ``emit_vs_span.py``'s first
phase, then exit: for counting the calling thread's instructions per stage, which a busy
machine does not blur as it does times (issue 25). The drain thread is stopped first, so
that when it runs does not change the caller's path (the stages stay queued).

    valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file=cg.10k \\
        python bench/stage_cold_loop.py 10000     # then 30000 into cg.30k
    # (totals of cg.30k-01 - totals of cg.10k-01) / 20000 = instructions per stage

The agent it starts is stopped however the run ends: before the final ``os._exit`` (which
skips exit handlers), or at exit after a failure, Ctrl-C, SIGTERM or SIGHUP.

Run: python bench/stage_cold_loop.py N
"""

from __future__ import annotations

import atexit
import gc
import os
import select
import shutil
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType

from emit_vs_span import N, activate, start_agent_process  # bench/ is on sys.path when run as a script

AGENT_STOP_S = 10.0  # then SIGKILL


def stop_agent(pid: int, directory: str) -> None:
    """SIGTERM to the agent ``pid``; wait for its exit (SIGKILL after ``AGENT_STOP_S``), reap it,
    remove its ``directory``. One blocking wait on a pidfd, no polling loop: the same instructions
    in every run (they cancel out of the difference)."""
    try:
        os.kill(pid, signal.SIGTERM)
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # reaped already
        return
    try:
        if not select.select([fd], [], [], AGENT_STOP_S)[0]:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    finally:
        os.close(fd)
        shutil.rmtree(directory, ignore_errors=True)


def exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    """SIGTERM, SIGHUP: a normal exit, so that the exit handlers (the agent's stop) run."""
    sys.exit(128 + signum)


def start_agent_stopped_at_exit() -> tuple[str, str, Callable[[], None]]:
    """``start_agent_process``, its stop registered at exit, and that stop (it runs once). SIGINT,
    SIGTERM and SIGHUP are held while the agent starts (one then would leave its directory
    behind) and act once its stop is registered; from then on SIGTERM and SIGHUP exit normally,
    as Ctrl-C does (an ignored signal stays ignored: nohup)."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, exit_on_signal)
    held: list[int] = []
    watched = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) is not signal.SIG_IGN]
    handlers = {s: signal.signal(s, lambda signum, _frame: held.append(signum)) for s in watched}
    try:
        sock, spool, agent = start_agent_process()
        stopped: list[bool] = []

        def stop() -> None:
            if not stopped:
                stopped.append(True)
                stop_agent(agent, os.path.dirname(sock))

        atexit.register(stop)  # before the hooks' exit flush, which runs first (to the agent)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if held:
        signal.raise_signal(held[0])
    return sock, spool, stop


def main() -> None:
    n = int(sys.argv[1])
    assert n + 3000 < 2 * N, "more stages than the buffer's calm range holds"
    sock, spool, stop = start_agent_stopped_at_exit()
    activate(sock, spool)
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
    stop()  # (the same instructions in every run: they cancel out)
    os._exit(0)  # no exit handlers: nothing after the loop is counted


if __name__ == "__main__":
    main()
