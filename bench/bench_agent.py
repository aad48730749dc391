"""The infersight agent a bench runs against: ``infersight agent`` in its own process (ingest,
assembly, no exporter), with a temporary directory of its own (socket, spool, state, config).

It is stopped and its directory removed however the run ends: by the bench (``stop()``, right
before an ``os._exit`` that skips exit handlers), or at exit after the bench's end, a failure,
Ctrl-C, SIGTERM or SIGHUP (those two then exit normally, so that exit handlers run). Signals
that come while it is set up are held until its stop is registered. Benches import it as
``from bench_agent import ...`` (bench/ is on sys.path when one runs as a script).
"""

from __future__ import annotations

import atexit
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from types import FrameType

AGENT_STOP_S = 10.0  # then SIGKILL
AGENT_START_S = 30.0
SOCK, SPOOL = "a.sock", "spool"  # in its directory


class BenchAgent:
    """A started agent: its socket, spool and process; ``stop`` (once) ends it and removes its directory."""

    def __init__(self, directory: str, proc: subprocess.Popen[bytes], exit_fd: int) -> None:
        self.directory = directory
        self.sock = os.path.join(directory, SOCK)
        self.spool = os.path.join(directory, SPOOL)
        self.proc = proc
        self.pid = proc.pid
        self.exit_fd = exit_fd  # read end of a pipe whose write end only the agent holds: EOF at its exit
        self.stopped = False

    def stop(self) -> None:
        """Stop it (the same instructions in every run: they cancel out of a difference of two runs)."""
        if not self.stopped:
            self.stopped = True
            stop_agent(self.proc, self.exit_fd, self.directory)


def stop_agent(proc: subprocess.Popen[bytes], exit_fd: int, directory: str) -> None:
    """SIGTERM to the agent ``proc``; wait for its exit (SIGKILL after ``AGENT_STOP_S``), reap it,
    remove its ``directory``. One blocking wait for the end of ``exit_fd``, no polling loop (a
    pidfd would do, but valgrind, which counts the cold loops' instructions, has no pidfd_open)."""
    try:
        if proc.poll() is None:
            proc.terminate()
            if not select.select([exit_fd], [], [], AGENT_STOP_S)[0]:
                proc.kill()
            proc.wait()
    finally:
        os.close(exit_fd)
        shutil.rmtree(directory, ignore_errors=True)


def exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    """SIGTERM, SIGHUP: a normal exit, so that the exit handlers (the agent's stop) run."""
    sys.exit(128 + signum)


def start_bench_agent() -> BenchAgent:
    """Start the agent, its stop registered at exit, and wait until it listens. SIGINT, SIGTERM
    and SIGHUP are held until that stop is registered, then act; from then on SIGTERM and
    SIGHUP exit normally, as Ctrl-C does (a signal ignored stays ignored: nohup)."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, exit_on_signal)
    held: list[int] = []
    watched = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) is not signal.SIG_IGN]
    handlers = {s: signal.signal(s, lambda signum, _frame: held.append(signum)) for s in watched}
    try:
        agent = _spawn(tempfile.mkdtemp(prefix="infersight-bench-"))
        atexit.register(agent.stop)  # before the hooks' exit flush (to the agent), which runs first
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if held:
        signal.raise_signal(held[0])
    deadline = time.monotonic() + AGENT_START_S
    while not os.path.exists(agent.sock):
        if agent.proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the agent did not start")
        time.sleep(0.05)
    return agent


def _spawn(directory: str) -> BenchAgent:
    """The agent's process, configured in ``directory`` (removed if it cannot be started)."""
    try:
        sock, spool, conf = (os.path.join(directory, name) for name in (SOCK, SPOOL, "a.toml"))
        with open(conf, "w") as f:
            # Its own state dir: a bench's cold starts must not enter the user's ETA history.
            f.write('[agent]\nsocket = "%s"\nspool_dir = "%s"\nstate_dir = "%s"\n'
                    % (sock, spool, os.path.join(directory, "state")))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSIGHT", "OTEL_"))}
        exit_fd, held_fd = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-m", "infersight", "agent", "--config", conf], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(held_fd,))
        except BaseException:
            os.close(exit_fd)
            raise
        finally:
            os.close(held_fd)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return BenchAgent(directory, proc, exit_fd)
