"""``infersight launch -- CMD``: run CMD with the hooks active and an agent in-process.

The embedded default: a private socket in a private directory (even when a daemon
runs), an OTLP JSON file, the waterfall on the terminal, OTLP export only when an
``OTEL_EXPORTER_OTLP_*ENDPOINT`` is set. Exit status follows CMD (128+N on signal N,
127 when CMD is not found, 2 for launch's own usage or config errors).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from infersight.agent import config as cfg
from infersight.agent.daemon import Agent
from infersight.agent.model import ColdStart, Resource, SpanItem
from infersight.agent.sinks import build_exporters
from infersight.hooks import _bootstrap_dir

EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
EXIT_USAGE = 2


@dataclass
class LaunchOptions:
    cmd: list[str]
    otlp_file: str | None = None
    console: bool = True
    flush_timeout_s: float = 10.0


def default_output_path(now: float | None = None) -> str:
    return "infersight-%s.otlp.jsonl" % time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


def child_env(base: dict[str, str], sock: str, spool: str, spawn_ns: int) -> dict[str, str]:
    env = dict(base)
    env["INFERSIGHT_SOCKET"] = sock
    env["INFERSIGHT_SPOOL_DIR"] = spool
    env["INFERSIGHT_LAUNCH_SPAWN_NS"] = str(spawn_ns)
    env.pop("INFERSIGHT", None)
    boot = _bootstrap_dir()
    env["PYTHONPATH"] = boot + (os.pathsep + base["PYTHONPATH"] if base.get("PYTHONPATH") else "")
    return env


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def launcher_root(cmd: list[str], pid: int, spawn_ns: int, end_ns: int, host: str) -> ColdStart:
    """The cold start from the launcher's view, for a CMD that runs no hooked Python."""
    service = os.environ.get("OTEL_SERVICE_NAME") or "unknown_service:%s" % os.path.basename(cmd[0])
    res = Resource.of(
        {
            "service.name": service,
            "host.name": host,
            "process.pid": pid,
            "process.executable.name": os.path.basename(cmd[0]),
            "telemetry.sdk.name": "infersight",
        }
    )
    root = SpanItem(
        res, os.urandom(16).hex(), os.urandom(8).hex(), None, "coldstart", spawn_ns, end_ns,
        {
            "faas.coldstart": True,
            "infersight.coldstart.source": "launcher",
            "infersight.coldstart.unattributed_s": (end_ns - spawn_ns) / 1e9,
        },
    )
    return ColdStart(root, [])


async def _run(opts: LaunchOptions, out: TextIO) -> int:
    private = tempfile.mkdtemp(prefix="infersight-launch-")
    os.chmod(private, 0o700)
    sock = os.path.join(private, "agent.sock")
    spool = os.path.join(private, "spool")
    path = opts.otlp_file or default_output_path()
    conf = cfg.load(
        None,
        flags={
            "agent.socket": sock,
            "agent.socket_mode": 0o600,
            "agent.spool_dir": spool,
            "agent.allowed_uids": [os.getuid()],
            "agent.allowed_gids": [os.getgid()],
            "exporters.file.path": path,
            "exporters.console.enabled": opts.console,
        },
    )
    agent = Agent(conf, build_exporters(conf, console_stream=out), embedded=True,
                  exporter_spool_root=os.path.join(private, "exporter-spool"))
    try:
        await agent.start()
        spawn_ns = time.time_ns()
        try:
            proc = await asyncio.create_subprocess_exec(
                *opts.cmd, env=child_env(dict(os.environ), sock, spool, spawn_ns)
            )
        except FileNotFoundError:
            out.write("infersight: command not found: %s\n" % opts.cmd[0])
            await agent.shutdown(opts.flush_timeout_s)
            return EXIT_NOT_FOUND
        except PermissionError:
            out.write("infersight: permission denied: %s\n" % opts.cmd[0])
            await agent.shutdown(opts.flush_timeout_s)
            return EXIT_NOT_EXECUTABLE
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _forward(proc, sig))
        returncode = await proc.wait()
        end_ns = time.time_ns()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        # The child's hooks flushed at exit; let the agent read what is in flight.
        await agent.ingest.wait_connections_closed(opts.flush_timeout_s)
        agent.ingest.replay_spools(spool)
        if not any(p.info.get("launched") for p in agent.assembler.producers.values()):
            cs = launcher_root(opts.cmd, proc.pid, spawn_ns, end_ns, agent.host_name)
            agent.router.publish([cs.root, cs])
        ok = await agent.shutdown(opts.flush_timeout_s)
        _report(agent, path, ok, out)
        return exit_status(returncode)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _forward(proc: asyncio.subprocess.Process, sig: int) -> Callable[[], None]:
    def handler() -> None:
        if proc.returncode is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass

    return handler


def _report(agent: Agent, path: str, ok: bool, out: TextIO) -> None:
    h = agent.health()
    out.write("infersight: wrote %s\n" % os.path.abspath(path))
    problems = []
    if h["lost"]:
        problems.append("%d event(s) lost" % h["lost"])
    if h["dropped_by_producers"]:
        problems.append("%d event(s) dropped by hooks" % h["dropped_by_producers"])
    for w in agent.workers:
        st = w.state()
        left = int(st["spooled_items_pending"]) + int(st["dropped_items"])
        if left:
            problems.append("%d item(s) not delivered to %s (%s)" % (left, w.name, st["last_error"] or "peer away"))
    if not ok:
        problems.append("flush hit its time limit")
    if problems:
        out.write("infersight: " + "; ".join(problems) + "\n")
    out.flush()


def run(opts: LaunchOptions, out: TextIO | None = None) -> int:
    cmd = list(opts.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        (out or sys.stderr).write("infersight launch: missing command: infersight launch -- CMD...\n")
        return EXIT_USAGE
    opts.cmd = cmd
    try:
        return asyncio.run(_run(opts, out or sys.stderr))
    except cfg.ConfigError as exc:
        (out or sys.stderr).write("infersight launch: %s\n" % exc)
        return EXIT_USAGE
