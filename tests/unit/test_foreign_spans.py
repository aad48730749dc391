"""Another user's spans that name a victim's trace and root span id join no waterfall of the victim.

A review (a hostile member of the socket group) read the victim's trace id and root span id from the
MQTT ``coldstart`` message and sent, over its own connection, ``coldstart.weights_load`` (45 s) and
``coldstart.compile`` spans under them: ``infersight show`` drew them inside the victim's process
(weights_load 97.4%, covered 100%). A stage now joins a root of the same producer uid alone
(``process.user.id``, the kernel's word), a process's root nests under one of its own user's or under
root's (a root launch or supervisor whose workers run as another user), and what is left out is counted
and said. The agent's own assembly takes another user's root for no worker of the victim either.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from infersight.agent.coldstart.assembly import coldstart_assembler
from infersight.agent.commands.show import show_file
from infersight.agent.report import html
from infersight.agent.report.page import build_from, file_source, scan_files
from infersight.agent.report.scan import Scan, collect
from infersight.agent.report.trace import waterfall_json
from infersight.agent.report.views import waterfalls
from infersight.exporters.otlp_json import traces_request
from infersight.telemetry import ColdStart, Resource, SpanItem

S = 10**9
T0 = 1_800_000_000 * S
TRACE = "ab" * 16
ROOT_ID = "1" * 16
VICTIM, ATTACKER = 1003, 1004


def res(uid: int | None, pid: int, service: str) -> Resource:
    attrs: dict[str, Any] = {"service.name": service, "process.pid": pid, "host.name": "h"}
    if uid is not None:
        attrs["process.user.id"] = uid
    return Resource.of(attrs)


def span(r: Resource, sid: str, parent: str | None, name: str, s: float, e: float, trace: str = TRACE) -> SpanItem:
    attrs: dict[str, Any] = {"infersight.stage": name[len("coldstart."):]} if name.startswith("coldstart.") else {
        "faas.coldstart": True}
    return SpanItem(r, trace, sid, parent, name, T0 + int(s * S), T0 + int(e * S), attrs, [])


def victim_and_attacker() -> list[SpanItem]:
    """The victim's cold start (2 s, one stage of 1 s), and the attacker's spans under its root."""
    v, a = res(VICTIM, 27007, "victim-svc"), res(ATTACKER, 31337, "attacker-svc")
    return [
        span(v, "2" * 16, ROOT_ID, "coldstart.model_build", 0.2, 1.2),
        span(v, ROOT_ID, None, "coldstart", 0.0, 2.0),
        span(a, "a" * 16, ROOT_ID, "coldstart.weights_load", 0.0, 45.0),
        span(a, "b" * 16, ROOT_ID, "coldstart.compile", 0.1, 44.0),
    ]


def test_another_users_stages_are_left_out_of_the_victims_waterfall_and_counted() -> None:
    (fam,) = waterfalls(victim_and_attacker())
    (wf,) = fam.processes
    assert [r.label for r in wf.rows] == ["coldstart", "model_build"]
    assert wf.summary.biggest == [("model_build", 1.0)]
    assert abs(wf.summary.unattributed_s - 1.0) < 1e-9  # 1 s of 2 covered, as the victim's own stages say
    assert wf.foreign == 2
    assert fam.t1_ns == T0 + 2 * S  # the attacker's 45 s do not stretch the victim's axis


def test_a_process_of_another_user_does_not_nest_under_the_victim_but_root_adopts_any_user() -> None:
    v, a, r0 = res(VICTIM, 27007, "victim-svc"), res(ATTACKER, 31337, "attacker-svc"), res(0, 1, "launch-as-root")
    spans = [
        span(v, ROOT_ID, None, "coldstart", 0.0, 2.0),
        span(a, "c" * 16, ROOT_ID, "coldstart", 0.5, 1.0),  # the attacker's "worker" of the victim
        span(a, "d" * 16, "c" * 16, "coldstart.warmup", 0.5, 0.9),
        # a root launch (uid 0) whose CMD runs as the victim (sudo -u): its child root nests under it
        span(r0, "e" * 16, None, "coldstart", 0.0, 3.0, trace="cd" * 16),
        span(v, "f" * 16, "e" * 16, "coldstart", 0.1, 2.5, trace="cd" * 16),
        # and never the other way: a root process's root does not nest under the victim's
        span(r0, "9" * 16, ROOT_ID, "coldstart", 0.2, 0.4),
    ]
    fams = waterfalls(spans)
    tops = {(f.processes[0].root.span_id, f.processes[0].root.resource.get("process.user.id")):
            [w.root.span_id for w in f.processes] for f in fams}
    assert tops == {(ROOT_ID, VICTIM): [ROOT_ID], ("c" * 16, ATTACKER): ["c" * 16],
                    ("e" * 16, 0): ["e" * 16, "f" * 16], ("9" * 16, 0): ["9" * 16]}
    victim = next(f for f in fams if f.processes[0].root.span_id == ROOT_ID).processes[0]
    assert victim.foreign == 2 and not victim.children
    # the compact first pass groups them alike
    sc = Scan()
    for s in spans:
        sc._span(s)
    rows = {(r.top.span_id, r.top.uid): [x.span_id for x in r.flat] for r in sc.families()}
    assert rows == tops


def test_another_users_span_of_the_victims_ids_replaces_nothing() -> None:
    """Ids are the producer's choice: the attacker's root of the victim's very trace and span id,
    read first, is another span; the victim's own root and stage are drawn as they were."""
    v, a = res(VICTIM, 27007, "victim-svc"), res(ATTACKER, 31337, "attacker-svc")
    spans = [span(a, ROOT_ID, None, "coldstart", 0.0, 90.0), span(a, "2" * 16, ROOT_ID, "coldstart.compile", 0, 89),
             span(v, "2" * 16, ROOT_ID, "coldstart.model_build", 0.2, 1.2), span(v, ROOT_ID, None, "coldstart", 0, 2)]
    fams = waterfalls(spans)
    victim = next(w for f in fams for w in f.processes if w.root.resource.get("process.user.id") == VICTIM)
    assert victim.summary.total_s == 2.0 and [r.label for r in victim.rows] == ["coldstart", "model_build"]
    sc = Scan()
    for s in spans:
        sc._span(s)
    assert len(sc.roots) == 2 and sc.span_count() == 4


def test_show_and_report_say_what_they_left_out(tmp_path: Path) -> None:
    path = tmp_path / "run.otlp.jsonl"
    path.write_text(traces_request(victim_and_attacker()) + "\n")
    out, err = io.StringIO(), io.StringIO()
    assert show_file(str(path), out, "text", err) == 0, err.getvalue()
    text = out.getvalue()
    assert "victim-svc (pid 27007)" in text
    assert "weights_load" not in text and "compile" not in text, text
    assert "(2 spans of another user's process claimed this trace; left out)" in text, text
    out = io.StringIO()
    assert show_file(str(path), out, "json", err) == 0
    assert '"foreign_spans_left_out": 2' in out.getvalue() and "weights_load" not in out.getvalue()
    sc = scan_files([str(path)], err, "report")
    assert sc is not None
    page = html.render(build_from(file_source([str(path)]), sc), [str(path)])
    assert "2 spans of another user's process claimed this trace; left out." in page
    (fam,) = collect(file_source([str(path)]), sc.families())
    assert waterfall_json([fam])["coldstarts"][0]["foreign_spans_left_out"] == 2


# -- the agent's own assembly ------------------------------------------------------------------------


def _hello(a, n: int, uid: int | None, trace: str, root_id: str, parent: str | None = None):  # type: ignore[no-untyped-def]
    return a.hello({"id": "p%d" % n, "pid": 100 + n, "start_ns": T0, "trace_id": trace, "root_span_id": root_id,
                    "service_name": "svc%d" % n, **({"root_parent": parent} if parent else {})}, uid)


def _send(a, p, seq: int, name: str, sid: str, parent: str | None, s: float, e: float,  # type: ignore[no-untyped-def]
          trace: str = TRACE) -> list[Any]:
    d: dict[str, Any] = {"n": name, "id": sid, "s": T0 + int(s * S), "e": T0 + int(e * S), "tr": trace,
                         "a": {"infersight.stage": name[len("coldstart."):]} if name != "coldstart" else {}}
    if parent:
        d["p"] = parent
    return a.events(p, [[seq, T0 + int(e * S), "span", d]])


def test_the_agent_takes_another_users_root_for_no_worker_of_the_victim() -> None:
    """The attacker's root under the victim's root had counted as the victim's worker: its stages
    (44 s) covered the victim's tree (``tree_unattributed_s``) and the console's tree figure."""
    a = coldstart_assembler("h")
    victim = _hello(a, 1, VICTIM, TRACE, ROOT_ID)
    attacker = _hello(a, 2, ATTACKER, "ef" * 16, "c" * 16)
    _send(a, victim, 1, "coldstart.model_build", "2" * 16, ROOT_ID, 0.2, 1.2)
    _send(a, attacker, 1, "coldstart.compile", "d" * 16, "c" * 16, 0.0, 44.0)
    _send(a, attacker, 2, "coldstart", "c" * 16, ROOT_ID, 0.0, 45.0)  # its root, in the victim's trace
    out = _send(a, victim, 2, "coldstart", ROOT_ID, None, 0.0, 2.0)
    (cs,) = [x for x in out if isinstance(x, ColdStart)]
    assert cs.workers == [] and cs.worker_covered == []
    assert "infersight.coldstart.tree_unattributed_s" not in cs.root.attributes
    assert abs(float(cs.root.attributes["infersight.coldstart.unattributed_s"]) - 1.0) < 1e-9  # type: ignore[arg-type]


def test_the_agent_lets_a_root_supervisor_adopt_its_workers_of_another_user() -> None:
    a = coldstart_assembler("h")
    sup = _hello(a, 1, 0, TRACE, ROOT_ID)
    worker = _hello(a, 2, VICTIM, TRACE, "c" * 16, ROOT_ID)
    _send(a, worker, 1, "coldstart.warmup", "d" * 16, "c" * 16, 0.1, 1.9)
    _send(a, worker, 2, "coldstart", "c" * 16, ROOT_ID, 0.1, 2.0)
    (cs,) = [x for x in _send(a, sup, 1, "coldstart", ROOT_ID, None, 0.0, 2.0) if isinstance(x, ColdStart)]
    assert [w.span_id for w in cs.workers] == ["c" * 16]
    tree = cs.root.attributes["infersight.coldstart.tree_unattributed_s"]
    assert abs(float(tree) - 0.2) < 1e-9  # type: ignore[arg-type]
