"""``infersight launch -- CMD``: run CMD with the hooks active and an agent in-process.

The embedded default: a private socket in a private directory (even when a daemon
runs), an OTLP JSON file, the waterfall on the terminal, OTLP export only when an
``OTEL_EXPORTER_OTLP_*ENDPOINT`` is set. Exit status follows CMD (128+N on signal N,
127 when CMD is not found, 2 for launch's own usage or config errors).

``--ready-url URL`` polls URL like a readiness probe (2xx/3xx). The ready time goes to
the child's hooks through a file (``INFERSIGHT_READY_FILE``), so the child's own
``ready_wait`` ends there and its next forward is ``first_request``; the ``listen()``
heuristic is off in the child unless ``INFERSIGHT_READY_ON_LISTEN`` says otherwise.
``--probe URL`` sends one GET after readiness (without ``--ready-url`` it retries until
the server answers) and records the time to the first body byte as an
``infersight.probe`` client span under the child's ``coldstart`` root. For a CMD that
runs no hooked Python, the launcher's own root gets ``ready_wait`` and
``first_request`` stages from these two instead.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from infersight.agent import config as cfg
from infersight.agent import extensions
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
    ready_url: str | None = None
    probe: str | None = None
    ready_timeout_s: float = 3600.0


@dataclass
class ProbeResult:
    """One HTTP GET as the launcher saw it (Unix ns; 0 where it did not happen)."""

    url: str
    start_ns: int = 0
    headers_ns: int = 0
    first_byte_ns: int = 0
    status: int = 0
    error: str = ""


@dataclass
class Readiness:
    ready: ProbeResult | None = None
    probe: ProbeResult | None = None
    attempts: int = 0
    notes: list[str] = field(default_factory=list)


def http_get(url: str, timeout_s: float = 5.0) -> ProbeResult:
    """GET url; time the response headers and the first body byte (blocking; run in a thread)."""
    r = ProbeResult(url)
    u = urllib.parse.urlsplit(url)
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(u.hostname or "127.0.0.1", u.port, timeout=timeout_s)
    path = (u.path or "/") + ("?" + u.query if u.query else "")
    try:
        conn.connect()
        r.start_ns = time.time_ns()
        conn.request("GET", path, headers={"User-Agent": "infersight-launch"})
        resp = conn.getresponse()
        r.headers_ns = time.time_ns()
        r.status = resp.status
        first = resp.read(1)
        r.first_byte_ns = time.time_ns() if first else r.headers_ns
        resp.read()
    except (OSError, http.client.HTTPException) as exc:
        r.error = "%s: %s" % (type(exc).__name__, exc)
    finally:
        conn.close()
    return r


def write_ready_file(path: str, ready_ns: int) -> None:
    """Atomically: the child's hooks poll for this file (a few bytes, local disk)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(str(ready_ns))
    os.replace(tmp, path)


def ok_status(status: int) -> bool:
    return 200 <= status < 400


async def watch_readiness(
    opts: LaunchOptions, ready_file: str | None, proc_done: asyncio.Event, out: TextIO
) -> Readiness:
    """Poll --ready-url, hand the ready time to the child, then send the --probe request."""
    res = Readiness()
    deadline = time.monotonic() + opts.ready_timeout_s
    delay = 0.05

    async def poll(url: str) -> ProbeResult | None:
        nonlocal delay
        while not proc_done.is_set() and time.monotonic() < deadline:
            res.attempts += 1
            r = await asyncio.to_thread(http_get, url)
            if not r.error and (ok_status(r.status) or url == opts.probe):
                return r
            try:
                await asyncio.wait_for(proc_done.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 1.5, 0.5)
        return None

    if opts.ready_url:
        res.ready = await poll(opts.ready_url)
        if res.ready is None:
            res.notes.append("never ready at %s" % opts.ready_url)
            return res
        if ready_file:
            write_ready_file(ready_file, res.ready.headers_ns)
    if opts.probe:
        if opts.ready_url:
            r = await asyncio.to_thread(http_get, opts.probe)
            res.probe = r if not r.error else None
            if r.error:
                res.notes.append("probe %s failed: %s" % (opts.probe, r.error))
        else:
            res.probe = await poll(opts.probe)
    return res


def default_output_path(now: float | None = None) -> str:
    return "infersight-%s.otlp.jsonl" % time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


def child_env(
    base: dict[str, str], sock: str, spool: str, spawn_ns: int, ready_file: str | None = None
) -> dict[str, str]:
    env = dict(base)
    if ready_file:
        env["INFERSIGHT_READY_FILE"] = ready_file
        env.setdefault("INFERSIGHT_READY_ON_LISTEN", "0")  # the URL is the authority
    env["INFERSIGHT_SOCKET"] = sock
    env["INFERSIGHT_SPOOL_DIR"] = spool
    env["INFERSIGHT_LAUNCH_SPAWN_NS"] = str(spawn_ns)
    env.pop("INFERSIGHT", None)
    boot = _bootstrap_dir()
    env["PYTHONPATH"] = boot + (os.pathsep + base["PYTHONPATH"] if base.get("PYTHONPATH") else "")
    return env


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def launcher_root(
    cmd: list[str], pid: int, spawn_ns: int, end_ns: int, host: str, readiness: Readiness | None = None
) -> ColdStart:
    """The cold start from the launcher's view, for a CMD that runs no hooked Python.

    With --ready-url/--probe it has ``ready_wait`` (spawn -> ready) and ``first_request``
    (probe sent -> first byte) stages, and ends at the probe's first byte.
    """
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
    trace, root_id = os.urandom(16).hex(), os.urandom(8).hex()
    stages: list[SpanItem] = []
    ready = readiness.ready if readiness else None
    probe = readiness.probe if readiness else None
    if ready is not None and ready.headers_ns:
        stages.append(SpanItem(
            res, trace, os.urandom(8).hex(), root_id, "coldstart.ready_wait", spawn_ns, ready.headers_ns,
            {"infersight.stage": "ready_wait", "infersight.ready.source": "ready_url", "url.full": ready.url},
        ))
        end_ns = ready.headers_ns
    if probe is not None and probe.first_byte_ns:
        stages.append(SpanItem(
            res, trace, os.urandom(8).hex(), root_id, "coldstart.first_request", probe.start_ns,
            probe.first_byte_ns,
            {"infersight.stage": "first_request", "infersight.first_request.source": "probe",
             "url.full": probe.url, "http.response.status_code": probe.status,
             "infersight.first_request.ttfb_s": (probe.first_byte_ns - probe.start_ns) / 1e9},
        ))
        end_ns = probe.first_byte_ns
    covered = sum(s.end_ns - s.start_ns for s in stages)
    root = SpanItem(
        res, trace, root_id, None, "coldstart", spawn_ns, end_ns,
        {
            "faas.coldstart": True,
            "infersight.coldstart.source": "launcher",
            "infersight.coldstart.unattributed_s": (end_ns - spawn_ns - covered) / 1e9,
        },
    )
    return ColdStart(root, stages)


def probe_span(probe: ProbeResult, trace_id: str, parent: str, resource: Resource) -> SpanItem:
    """The launcher's probe request, a client span under the child's cold-start root."""
    return SpanItem(
        resource, trace_id, os.urandom(8).hex(), parent, "infersight.probe", probe.start_ns, probe.first_byte_ns,
        {
            "http.request.method": "GET",
            "url.full": probe.url,
            "http.response.status_code": probe.status,
            "infersight.probe.headers_s": (probe.headers_ns - probe.start_ns) / 1e9,
            "infersight.probe.ttfb_s": (probe.first_byte_ns - probe.start_ns) / 1e9,
        },
        error=None if ok_status(probe.status) else "HTTP %d" % probe.status,
    )


def _readiness_lines(rd: Readiness, spawn_ns: int) -> list[str]:
    lines = []
    if rd.ready is not None:
        lines.append("infersight: ready at %s after %.3f s (%d attempt(s))"
                     % (rd.ready.url, (rd.ready.headers_ns - spawn_ns) / 1e9, rd.attempts))
    if rd.probe is not None and rd.probe.first_byte_ns:
        p = rd.probe
        lines.append("infersight: probe GET %s: HTTP %d, first byte %.3f s after sending, %.3f s after spawn"
                     % (p.url, p.status, (p.first_byte_ns - p.start_ns) / 1e9, (p.first_byte_ns - spawn_ns) / 1e9))
    lines.extend("infersight: " + n for n in rd.notes)
    return lines


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
    agent = Agent(conf, build_exporters(conf, console_stream=out, embedded=True), embedded=True,
                  exporter_spool_root=os.path.join(private, "exporter-spool"))
    extensions.install(agent, conf)  # request latency, NVML devices, live OOM classification
    try:
        await agent.start()
        ready_file = os.path.join(private, "ready") if opts.ready_url else None
        spawn_ns = time.time_ns()
        try:
            proc = await asyncio.create_subprocess_exec(
                *opts.cmd, env=child_env(dict(os.environ), sock, spool, spawn_ns, ready_file)
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
        proc_done = asyncio.Event()
        watcher = None
        if opts.ready_url or opts.probe:
            watcher = asyncio.create_task(watch_readiness(opts, ready_file, proc_done, out))
        returncode = await proc.wait()
        end_ns = time.time_ns()
        proc_done.set()
        readiness = Readiness()
        if watcher is not None:
            try:
                readiness = await asyncio.wait_for(watcher, 10.0)
            except (asyncio.TimeoutError, OSError) as exc:
                readiness.notes.append("readiness watch: %s" % (exc or type(exc).__name__))
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        # The child's hooks flushed at exit; let the agent read what is in flight.
        await agent.ingest.wait_connections_closed(opts.flush_timeout_s)
        agent.ingest.replay_spools(spool)
        launched = [p for p in agent.assembler.producers.values() if p.info.get("launched")]
        if not launched:
            cs = launcher_root(opts.cmd, proc.pid, spawn_ns, end_ns, agent.host_name, readiness)
            agent.router.publish([cs.root, *cs.stages, cs])
        elif readiness.probe is not None and readiness.probe.first_byte_ns:
            p0 = launched[0]
            agent.router.publish([probe_span(readiness.probe, p0.info["trace_id"], p0.info["root_span_id"],
                                             p0.resource)])
        await _wait_for_brokers(agent)
        ok = await agent.shutdown(opts.flush_timeout_s)
        for line in _readiness_lines(readiness, spawn_ns):
            out.write(line + "\n")
        _report(agent, path, ok, out)
        _storage_note(path, out)
        return exit_status(returncode)
    finally:
        shutil.rmtree(private, ignore_errors=True)


async def _wait_for_brokers(agent: Agent) -> None:
    """MQTT at exit: wait a bounded time (exporters.mqtt.exit_wait_s) for the broker."""
    from infersight.exporters import mqtt

    for w in agent.workers:
        if isinstance(w.exporter, mqtt.MqttExporter):
            await mqtt.wait_delivered(w.exporter, w)


def _quiet_logging() -> None:
    """Agent warnings as one-line notes on stderr; an absent NVML is no news on a workstation
    (``infersight doctor`` reports it)."""
    logger = logging.getLogger("infersight")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("infersight: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("INFERSIGHT_LOG_LEVEL", "WARNING").upper())
        logger.propagate = False
    logging.getLogger("infersight.agent.nvml").setLevel(logging.ERROR)
    logging.getLogger("infersight.agent.devices_job").setLevel(logging.ERROR)


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


def _storage_note(path: str, out: TextIO) -> None:
    """Measure the storage ceiling once for weights files that had none (cached per device)."""
    if os.environ.get("INFERSIGHT_MEASURE_STORAGE", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    from infersight.agent import storage_ceiling

    seen: dict[str, float] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if "infersight.weights.path" not in line or "ceiling_ratio" in line:
                    continue
                for span in _weights_spans(json.loads(line)):
                    wpath, rate = span
                    if wpath and wpath not in seen:
                        seen[wpath] = rate
    except (OSError, ValueError):
        return
    for wpath, rate in seen.items():
        entry = storage_ceiling.ensure_for_file(wpath)
        if entry is None:
            continue
        ceiling = float(entry["bytes_per_s"])
        out.write(
            "infersight: storage ceiling of device %s (%s read of %s): %.0f MiB/s; %s loaded at %.0f MiB/s (%.0f%%)\n"
            % (entry["device"], entry["method"], storage_ceiling.human(int(entry["sample_bytes"])),
               ceiling / 2**20, os.path.basename(wpath), rate / 2**20, 100.0 * rate / ceiling)
        )


def _weights_spans(req: dict[str, object]) -> list[tuple[str, float]]:
    found: list[tuple[str, float]] = []
    for rs in req.get("resourceSpans", []) or []:  # type: ignore[attr-defined]
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                attrs = {kv["key"]: kv.get("value", {}) for kv in s.get("attributes", [])}
                p = attrs.get("infersight.weights.path", {}).get("stringValue")
                r = attrs.get("infersight.weights.bytes_per_s", {})
                rate = float(r.get("doubleValue", r.get("intValue", 0)) or 0)
                if p and rate > 0:
                    found.append((str(p), rate))
    return found


def run(opts: LaunchOptions, out: TextIO | None = None) -> int:
    cmd = list(opts.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        (out or sys.stderr).write("infersight launch: missing command: infersight launch -- CMD...\n")
        return EXIT_USAGE
    opts.cmd = cmd
    _quiet_logging()
    try:
        return asyncio.run(_run(opts, out or sys.stderr))
    except cfg.ConfigError as exc:
        (out or sys.stderr).write("infersight launch: %s\n" % exc)
        return EXIT_USAGE
