"""The launcher's view of CMD: what ``launch`` saw of its cold start (pure, light).

For a CMD that runs no hooked Python, the launcher makes the ``coldstart`` root itself,
from its spawn to CMD's exit (or to readiness and the probe's first byte, with
``--ready-url``/``--probe``). Light on purpose: ``launch``'s quick end writes it without
importing the agent (:mod:`infersight.agent.commands.launch_quick`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from infersight.telemetry import ColdStart, Resource, SpanItem


@dataclass
class ProbeResult:
    """One HTTP GET as the launcher saw it (Unix ns; 0 where it did not happen)."""

    url: str
    connect_ns: int = 0  # before connecting: the server's work on this request follows
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
