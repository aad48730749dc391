"""A producer in another PID namespace (a sidecar's model server without ``shareProcessNamespace``:
``SO_PEERCRED`` gives the agent pid 0) says in its hello the pid its container gave it. The same number
in the agent's /proc is some other process: the agent must not read it as the producer's, neither for
routing (is it alive? which network namespace's listeners?) nor for the cold-start history's key (its
command line). ``Agent.visible_pid`` says which PID /proc shows a producer under.

The /proc trees here are FAKE directories, standing for the agent's namespace."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from infersight.agent.coldstart.assembly import coldstart_assembler
from infersight.agent.coldstart.progress import ProgressTracker
from infersight.agent.daemon.identity import proc_start_ticks
from infersight.agent.daemon.lifecycle import Agent
from infersight.agent.routing import hints
from infersight.agent.routing.table import RoutingTable
from infersight.telemetry import Origin, Resource, SpanItem

S = 1_000_000_000
CONTAINER_PID = 7  # the model server's pid in its own container


def _hello(a, producer_id: str, peer_pid: int | None, pid: int = CONTAINER_PID):  # type: ignore[no-untyped-def]
    p = a.hello({"id": producer_id, "pid": pid, "start_ns": S, "trace_id": "a" * 32,
                 "root_span_id": "b" * 16, "service_name": "svc", "argv0": "serve.py"}, 1000)
    p.peer_pid = peer_pid  # as the receiver sets it from SO_PEERCRED (None: a spool file's hello)
    return p


def test_the_agent_names_no_pid_for_a_producer_in_another_pid_namespace() -> None:
    a = coldstart_assembler("h")
    agent = SimpleNamespace(assembler=a)
    _hello(a, "sidecar", 0)
    _hello(a, "host", CONTAINER_PID)
    # A spool file's hello names no peer (a pod's spool is shared across PID namespaces): its pid is this
    # agent's only where a live process here started when its id says (this test's own process, here).
    me, ticks = os.getpid(), proc_start_ticks(os.getpid())
    _hello(a, "boot-%d-%s" % (me, ticks), None, pid=me)
    _hello(a, "boot-%d-%d" % (me, int(str(ticks)) + 1), None, pid=me)  # another process of that pid: not here
    _hello(a, "replayed", None)  # no start in its id: nothing to check it by
    assert Agent.visible_pid(agent, "sidecar") is None  # type: ignore[arg-type]
    assert Agent.visible_pid(agent, "host") == CONTAINER_PID  # type: ignore[arg-type]
    assert Agent.visible_pid(agent, "boot-%d-%s" % (me, ticks)) == me  # type: ignore[arg-type]
    assert Agent.visible_pid(agent, "boot-%d-%d" % (me, int(str(ticks)) + 1)) is None  # type: ignore[arg-type]
    assert Agent.visible_pid(agent, "replayed") is None  # type: ignore[arg-type]
    assert Agent.visible_pid(agent, "unknown") is None  # type: ignore[arg-type]


def _stage(a, p, seq: int, name: str, s: float, e: float):  # type: ignore[no-untyped-def]
    return a.events(p, [[seq, int(e * S), "span", {"n": "coldstart." + name, "id": "%016x" % (seq + 99),
                                                   "p": p.info["root_span_id"], "s": int(s * S), "e": int(e * S),
                                                   "a": {"infersight.stage": name}}]])


def test_the_history_key_does_not_take_another_processs_command_line(tmp_path: Path) -> None:
    """In the agent's /proc, pid 7 is one of its own container's processes (FAKE): the sidecar's
    server is keyed by its hello's argv0, the host's process by its /proc command line."""
    proc = tmp_path / "proc"
    (proc / str(CONTAINER_PID)).mkdir(parents=True)
    (proc / str(CONTAINER_PID) / "cmdline").write_bytes(b"/usr/bin/someone-else\0--flag\0")
    a = coldstart_assembler("h")
    agent = SimpleNamespace(assembler=a)
    t = ProgressTracker(None, producer_info=lambda pid: a.producers[pid].info if pid in a.producers else None,
                        proc_root=str(proc))
    t.visible_pid = lambda producer: Agent.visible_pid(agent, producer)  # type: ignore[arg-type]
    sidecar, host = _hello(a, "sidecar", 0), _hello(a, "host", CONTAINER_PID)
    t.observe(_stage(a, sidecar, 1, "model_build", 1.0, 2.0))
    t.observe(_stage(a, host, 1, "model_build", 1.0, 2.0))
    keys = {producer: w.key for producer, w in t.warming.items()}
    assert keys["sidecar"] != keys["host"]
    t.visible_pid = None  # as before: the hello's pid read in this /proc, for both
    t.warming.clear()
    t.observe(_stage(a, sidecar, 2, "weights_load", 2.0, 3.0))
    t.observe(_stage(a, host, 2, "weights_load", 2.0, 3.0))
    assert t.warming["sidecar"].key == t.warming["host"].key == keys["host"]  # someone else's command line


def _span(producer: str, name: str, t: float, **attrs: object) -> SpanItem:
    res = Resource.of({"service.name": "llm", "process.pid": CONTAINER_PID, "process.user.id": 1000})
    return SpanItem(res, "0" * 32, "1" * 16, "2" * 16, name, int((t - 1) * 1e9), int(t * 1e9),
                    {"infersight.stage": name.split(".", 1)[1], **attrs}, [], None, Origin(producer, 1))


def test_routing_does_not_judge_a_sidecars_server_by_the_process_its_pid_names_here() -> None:
    """Pid 7 here is a process that ends: the sidecar's server, whose container calls itself pid 7, is
    not taken for ended (its port vacated); its pid in ``status`` stays the one its hello said."""
    ended: set[int] = {CONTAINER_PID}
    seen: list[int] = []

    def alive(pid: int, start: str | None) -> bool:
        seen.append(pid)
        return pid <= 0 or pid not in ended

    table = RoutingTable(list, lambda _uid: {}, alive=alive, clock=lambda: 100.0,
                         visible_pid=lambda producer: None)
    table.observe([_span("sidecar", "coldstart.runtime_init", 95.0),
                   _span("sidecar", "coldstart.ready_wait", 100.0, **{"server.port": 8000})])
    table.refresh()
    assert CONTAINER_PID not in seen
    assert table.reply(8000) != hints.UNKNOWN_REPLY and table.ports.get(8000) == "sidecar"
    assert [s["pid"] for s in table.snapshot()] == [CONTAINER_PID]
    # the same table without the agent's word (the resource's pid, read here): taken for ended
    before = RoutingTable(list, lambda _uid: {}, alive=alive, clock=lambda: 100.0)
    before.observe([_span("sidecar", "coldstart.runtime_init", 95.0),
                    _span("sidecar", "coldstart.ready_wait", 100.0, **{"server.port": 8000})])
    before.refresh()
    assert before.ports.get(8000) is None


def _claim(producer: str, uid: int) -> list[SpanItem]:
    res = Resource.of({"service.name": "llm", "process.pid": CONTAINER_PID, "process.user.id": uid})
    return [SpanItem(res, "0" * 32, "1" * 16, "2" * 16, name, int((t - 1) * 1e9), int(t * 1e9),
                     {"infersight.stage": name.split(".", 1)[1], **attrs}, [], None, Origin(producer, 1))
            for name, t, attrs in (("coldstart.runtime_init", 95.0, {}),
                                   ("coldstart.ready_wait", 100.0, {"server.port": 8000}))]


def test_a_producer_this_agent_cannot_see_takes_no_port_another_uid_holds() -> None:
    """Its listeners cannot be read, so its claim is taken as said, but never over a holder of another uid
    (a review found the unseen pid let any claim through)."""
    table = RoutingTable(list, lambda _uid: {}, clock=lambda: 100.0, visible_pid=lambda producer: None)
    table.observe(_claim("server", 1000))
    assert table.ports.get(8000) == "server"
    table.observe(_claim("stranger", 2000))
    assert table.ports.get(8000) == "server" and table.port_claims_refused == 1
