"""``launch``'s quick end: CMD exited before the agent side was even imported, and left
nothing for an agent to do.

That is: no hook connected (the private socket's backlog is empty) or spooled, no other
launch directory that may hold spools to replay, no process started under CMD still alive
(it could still report), no ``--ready-url``/``--probe``, and no setting in the environment
beyond the service name and launch's own switches, so the file and the console are the only
sinks. Then the launcher's root (spawn -> CMD's exit) and its cold-start metrics are written
to the file, the waterfall is printed, and launch exits without starting the agent: the same
output as the agent's path, at a fraction of the cost (``infersight launch -- true``).
"""

from __future__ import annotations

import os
import select
import socket
from typing import TextIO

from infersight.agent.coldstart.metrics import ColdStartMetrics
from infersight.agent.commands.launch_base import (
    Child,
    LaunchOptions,
    Private,
    dead_launch_dirs,
    exit_status,
    leftover_command,
    processes_using,
    same_command,
    spool_files,
    temp_root,
)
from infersight.agent.commands.launcher_root import launcher_root
from infersight.exporters.file import FileExporter
from infersight.exporters.waterfall import is_helper, render_waterfall
from infersight.telemetry import Item

# Variables that change nothing the quick end writes (the service name is read where the
# root is made; the others are launch's own switches).
RELAY_CLOSE_S = 0.2  # CMD exited: its stderr closes with it unless a process it started still holds it
NEUTRAL_ENV = frozenset({"OTEL_SERVICE_NAME", "INFERSIGHT_MEASURE_STORAGE", "INFERSIGHT_LOG_LEVEL"})


def settings_in_env(env: dict[str, str] | os._Environ[str]) -> list[str]:
    """Environment settings that the agent's path would apply (exporters, host name...)."""
    return sorted(k for k in env if k.startswith(("INFERSIGHT_", "OTEL_")) and k not in NEUTRAL_ENV)


def eligible(opts: LaunchOptions, private: Private, listen_fd: int, child: Child) -> bool:
    if opts.ready_url or opts.probe or settings_in_env(os.environ):
        return False
    if child.poll() is None:  # (exited: it is reaped now)
        return False
    relay = child.relay
    if relay is not None and not (relay.wait_closed(RELAY_CLOSE_S) and relay.captures == 0):
        return False  # CMD's stderr is still held (a grandchild), or it printed a memory error: the agent's
    readable, _, _ = select.select([listen_fd], [], [], 0)
    if readable:
        return False  # a hook connected: its events wait in the backlog
    if _entries(private.spool) or _leftover_dirs(private.path):
        return False
    return not processes_using(private.sock)  # one that CMD started (a daemon) may still report


def _entries(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _leftover_dirs(own: str) -> bool:
    """A directory of ours that a launch which died left and that the agent's path would act
    on: one of the same command (its spools are replayed, the directory removed), or another
    command's that still holds spool files (reported). Another command's empty leftovers are
    left alone by both paths, so they do not keep launch off its quick end."""
    command = leftover_command(own) or []
    for path, fd in dead_launch_dirs(temp_root(), own, exclusive=False):
        os.close(fd)
        if same_command(leftover_command(path), command) or spool_files(os.path.join(path, "spool")):
            return True
    return False


def run(opts: LaunchOptions, path: str, private: Private, child: Child, spawn_ns: int, out: TextIO) -> int:
    assert child.returncode is not None
    host = socket.gethostname().split(".")[0]
    cs = launcher_root(opts.cmd, child.pid, spawn_ns, child.exit_ns, host)
    items: list[Item] = [cs.root, cs, *ColdStartMetrics().observe(cs, child.exit_ns)]
    sink = FileExporter(path)
    try:
        sink.write_now(items)
    except OSError as exc:
        out.write("infersight: cannot write %s: %s\n" % (os.path.abspath(path), exc.strerror or exc))
    else:
        if opts.console and not is_helper(cs):
            out.write(render_waterfall(cs) + "\n")
        out.write("infersight: wrote %s\n" % os.path.abspath(path))
    out.flush()
    return exit_status(child.returncode)
