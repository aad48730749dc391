"""The launcher's view of CMD: what ``launch`` saw of its cold start (pure, light).

For a CMD that runs no hooked Python, the launcher makes the ``coldstart`` root itself,
from its spawn to readiness (``--ready-url``, or a listening socket the kernel shows CMD's
process tree holds), else to the probe's first byte (``--probe``), else to CMD's exit.
Light on purpose: ``launch``'s quick end writes it without importing the agent
(:mod:`infersight.agent.commands.launch_quick`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from infersight.coldstart_stages import union_ns
from infersight.hooks import _contract
from infersight.telemetry import Attributes, ColdStart, Resource, SpanItem


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
    listening_ns: int = 0  # when CMD's process tree was first seen owning a listening socket
    listening: tuple[str, int | str] | None = None  # ("tcp", port) or ("unix", path)


def launcher_root(
    cmd: list[str], pid: int, spawn_ns: int, end_ns: int, host: str, readiness: Readiness | None = None
) -> ColdStart:
    """The cold start from the launcher's view, for a CMD that runs no hooked Python.

    With --ready-url, or a listening socket the kernel shows CMD's process tree holds, it has
    ``ready_wait`` (spawn -> ready) and ends there; with --probe, ``first_request`` (probe sent
    -> first byte), after the root when readiness was known, else its end is the root's. Without
    either it ends at exit.
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
    ready_ns = 0
    ready_attrs: Attributes = {}
    if ready is not None and ready.headers_ns:
        ready_ns, ready_attrs = ready.headers_ns, {_contract.READY_SOURCE: "ready_url", "url.full": ready.url}
    elif readiness is not None and readiness.listening is not None:  # what the kernel says CMD listens on
        kind, where = readiness.listening
        ready_ns = readiness.listening_ns
        ready_attrs = {_contract.READY_SOURCE: "listening_socket",
                       **({"server.port": where} if kind == "tcp" else
                          {"server.address": where, "network.transport": "unix"})}
    if ready_ns:
        stages.append(SpanItem(res, trace, os.urandom(8).hex(), root_id, "coldstart.ready_wait", spawn_ns, ready_ns,
                               {_contract.STAGE: "ready_wait", **ready_attrs}))
    if probe is not None and probe.first_byte_ns:
        stages.append(SpanItem(
            res, trace, os.urandom(8).hex(), root_id, "coldstart.first_request", probe.start_ns,
            probe.first_byte_ns,
            {_contract.STAGE: "first_request", _contract.FIRST_REQUEST_SOURCE: "probe",
             "url.full": probe.url, "http.response.status_code": probe.status,
             _contract.FIRST_REQUEST_TTFB_S: (probe.first_byte_ns - probe.start_ns) / 1e9},
        ))
        end_ns = probe.first_byte_ns
    attrs: Attributes = {"faas.coldstart": True, "infersight.coldstart.source": "launcher"}
    if ready_ns:
        end_ns = ready_ns
        attrs.update({_contract.ENDED_BY: "ready", _contract.READY_SOURCE: ready_attrs[
            _contract.READY_SOURCE], _contract.READY_S: (end_ns - spawn_ns) / 1e9})
    covered = union_ns([(s.start_ns, s.end_ns) for s in stages], spawn_ns, end_ns)
    attrs[_contract.UNATTRIBUTED_S] = (end_ns - spawn_ns - covered) / 1e9
    root = SpanItem(res, trace, root_id, None, "coldstart", spawn_ns, end_ns, attrs)
    return ColdStart(root, stages)
