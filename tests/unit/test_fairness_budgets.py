"""Issue 22 points 7-9 and issue 21 point 4, on the pure parts (no sockets): hello bounds, the
ETA history key (uid, command shape), per-uid budgets of the warming table and of the
Prometheus series bound. The uid is what the ingest passes from the kernel (SO_PEERCRED, a
spool file's owner): here it is handed to ``Assembler.hello`` as the ingest does."""

from __future__ import annotations

from infersight.agent.coldstart import history as ch
from infersight.agent.coldstart.assembly import coldstart_assembler
from infersight.agent.coldstart.progress import MAX_WARMING_PER_UID, ProgressTracker
from infersight.agent.daemon.assemble import (
    MAX_HELLO_BYTES,
    MAX_RESOURCE_ATTRS,
    MAX_RESOURCE_VALUE,
    Assembler,
)
from infersight.exporters.otlp_json import resource_json, span_json
from infersight.exporters.prometheus_endpoint import SeriesStore
from infersight.telemetry import MetricItem, NumberPoint, Resource

S = 1_000_000_000
# The producers' PIDs here are made up (100 + n): a /proc that does not exist keeps the tracker from keying a
# run by the command line of whatever real process holds that PID on the test machine.
NO_PROC = "/nonexistent-proc"


def hello(a: Assembler, n: int, kernel_uid: int | None, **extra: object):  # type: ignore[no-untyped-def]
    return a.hello({"id": "p%d" % n, "pid": 100 + n, "start_ns": S, "trace_id": "%032x" % (n + 1),
                    "root_span_id": "%016x" % (n + 1), "service_name": "svc", **extra}, kernel_uid)


def stage(a: Assembler, p, seq: int, name: str, s: float, e: float):  # type: ignore[no-untyped-def]
    return a.events(p, [[seq, int(e * S), "span", {"n": "coldstart." + name, "id": "%016x" % (seq + 99),
                                                   "p": p.info["root_span_id"], "s": int(s * S), "e": int(e * S),
                                                   "a": {"infersight.stage": name}}]])


def root(a: Assembler, p, seq: int, e: float):  # type: ignore[no-untyped-def]
    return a.events(p, [[seq, int(e * S), "span", {"n": "coldstart", "id": p.info["root_span_id"],
                                                   "s": p.info["start_ns"], "e": int(e * S)}]])


# -- 22.7: bounded hellos ---------------------------------------------------------------------


def test_a_huge_hello_is_bounded_and_what_is_cut_is_counted() -> None:
    a = coldstart_assembler("h")
    env = ",".join("k%d=%s" % (i, "v" * 100_000) for i in range(1000))  # ~100 MB of resource attributes
    junk = {"x%d" % i: "y" * 10_000 for i in range(500)}
    p = hello(a, 1, 1000, resource_attributes=env, nested={"deep": ["z" * 10**6] * 100}, **junk)
    attrs = p.resource.as_dict()
    assert len(attrs) <= MAX_RESOURCE_ATTRS + 16
    assert all(len(str(v)) <= MAX_RESOURCE_VALUE for k, v in attrs.items() if k.startswith("k"))
    assert sum(len(k) + len(repr(v)) for k, v in p.info.items()) <= MAX_HELLO_BYTES + 2000
    assert p.hello_cut > 0 and a.stats()["hello_cut"] == p.hello_cut
    # One small event stays small in the output (it was 2.6 MiB of OTLP JSON): its resource is bounded.
    items = a.events(p, [[1, 5, "span", {"n": "x", "id": "a" * 16, "s": 1, "e": 2}]])
    assert len(resource_json(items[0].resource)) + len(span_json(items[0])) < 16_000  # type: ignore[arg-type]


def test_the_hello_uid_is_the_kernels_not_the_claimed_one() -> None:
    a = coldstart_assembler("h")
    p = hello(a, 1, 1000, uid=0)  # the hook claims root
    assert p.info["uid"] == 1000 and p.resource.get("process.user.id") == 1000
    q = a.hello({"id": "p2", "pid": 5, "start_ns": 1, "trace_id": "b" * 32, "root_span_id": "c" * 16,
                 "resource_attributes": "process.user.id=0"}, 1001)
    assert q.resource.get("process.user.id") == 1001


def test_one_producer_id_from_two_uids_gets_two_sequence_spaces() -> None:
    a = coldstart_assembler("h")
    victim, forged = hello(a, 1, 1000), hello(a, 1, 1001)
    assert victim is not forged and victim.id == "p1" and forged.id == "p1@1001"
    a.events(forged, [[i, 5, "log", {"body": "forged"}] for i in range(1, 41)])
    a.events(victim, [[i, 5, "log", {"body": "own"}] for i in range(1, 41)])
    assert victim.events == 40 and victim.seq.duplicates == 0
    assert a.stats()["identity_conflicts"] == 1


# -- 22.8 and 21.4: the history key -----------------------------------------------------------


def test_values_do_not_split_the_history_key() -> None:
    base = ["/usr/bin/python3", "serve.py", "--model", "/models/llama", "--port", "8000", "--host", "0.0.0.0"]
    key = ch.service_key("svc", base, uid=1000)
    same = [
        ["python3", "serve.py", "--model", "/models/llama", "--port", "8001", "--host", "10.0.0.7"],
        ["python3", "serve.py", "--model", "/models/llama", "--port=9000", "--host=127.0.0.1"],
        ["python3", "serve.py", "--model", "/models/llama", "--port", "8000", "--host", "0.0.0.0",
         "--log-file", "/var/log/a.log"],
    ]
    for argv in same:
        assert ch.service_key("svc", argv, uid=1000) == key, argv
    assert ch.service_key("svc", [*base[:3], "/models/mistral", *base[4:]], uid=1000) != key, "another model"
    assert ch.service_key("svc", base, uid=1001) != key, "another uid has its own history"
    assert ch.service_key("other", base, uid=1000) != key
    assert key.startswith("svc#u1000#")


def test_another_uid_running_the_same_command_does_not_move_your_eta(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = coldstart_assembler("h")
    t = ProgressTracker(str(tmp_path / "h.jsonl"), producer_info=lambda pid: a.producers[pid].info, proc_root=NO_PROC)
    own = hello(a, 1, 1000)
    t.observe(stage(a, own, 1, "weights_load", 1.0, 5.0))
    t.observe(root(a, own, 2, 6.0))
    for n in range(3):  # the attacker: three 5000 s runs of the same service and command
        p = hello(a, 10 + n, 1001)
        t.observe(stage(a, p, 1, "weights_load", 1.0, 4000.0))
        t.observe(root(a, p, 2, 5000.0))
    fresh = hello(a, 2, 1000)
    t.observe(stage(a, fresh, 1, "model_build", 1.0, 1.5))
    row = next(r for r in t.snapshot(int(2 * S)) if r["pid"] == fresh.info["pid"])
    assert row["uid"] == 1000 and row["eta_runs"] == 1 and row["eta_s"] < 10
    (up,) = t.tick(int(2 * S))
    assert up.state is not None and up.state["uid"] in (1000, 1001) and 1000 in up.state["uids"]


# -- 22.9: per-uid budgets ---------------------------------------------------------------------


def test_one_uid_cannot_fill_the_warming_table() -> None:
    a = coldstart_assembler("h")
    t = ProgressTracker(None, producer_info=lambda pid: a.producers[pid].info, proc_root=NO_PROC)
    for n in range(MAX_WARMING_PER_UID + 50):
        t.observe(stage(a, hello(a, n, 1001), 1, "model_build", 1.0, 1.5))
    assert len(t.warming) == MAX_WARMING_PER_UID and t.refused_warming == 50
    victim = hello(a, 100_000, 1000)
    t.observe(stage(a, victim, 1, "model_build", 1.0, 1.5))
    assert victim.id in t.warming, "another uid's cold start is still tracked"
    assert [r["uid"] for r in t.snapshot(int(2 * S))].count(1000) == 1


def _metric(uid: int, i: int) -> MetricItem:
    res = Resource.of({"service.name": "s%d" % uid, "process.user.id": uid})
    return MetricItem(res, "flood", "gauge", "", "", 1, 0, [NumberPoint(1.0, {"i": i})])


def test_one_uid_cannot_take_the_prometheus_series_bound() -> None:
    store = SeriesStore(max_series=1000, target_info=False)
    store.add([_metric(1001, i) for i in range(5000)])
    assert store.series_of_uid[1001] == 250 and store.points_refused_uid_budget == 4750
    assert store.add([_metric(1000, i) for i in range(10)]) == 10, "another uid's series still fit"
    agent_own = MetricItem(Resource.of({"service.name": "infersight-agent"}), "own", "gauge", "", "", 1, 0,
                           [NumberPoint(1.0, {})])
    assert store.add([agent_own]) == 1


def test_metric_names_refused_by_the_series_budget_leave_nothing_behind() -> None:
    """A family used to be made before its first series was admitted: 200,000 distinct names from a uid at
    its series budget grew the agent by 150 MiB while every point was refused."""
    store = SeriesStore(max_series=1000, target_info=False)
    store.add([_metric(1001, i) for i in range(250)])  # the uid's share is full
    res = Resource.of({"service.name": "s", "process.user.id": 1001})
    store.add([MetricItem(res, "name_%d" % i, "gauge", "", "", 1, 0, [NumberPoint(1.0, {})]) for i in range(3000)])
    assert store.points_refused_uid_budget == 3000
    assert len(store._families) == 1  # "flood" only


def test_a_producer_cannot_send_a_metric_in_the_agents_namespace() -> None:
    """Another user's gauge named infersight.request.duration had taken that Prometheus name's type, and the
    agent's request histograms of every other user were dropped from the scrape (type_conflicts)."""
    a = Assembler("h")
    p = hello(a, 1, 1001)
    for i, name in enumerate(("infersight.request.duration", "INFERSIGHT_request.duration", "infersight",
                              "infersight-x"), start=1):
        assert a.events(p, [[i, 5, "metric", {"n": name, "v": 1.0, "k": "gauge"}]]) == []
    assert a.malformed == 4
    kept = a.events(p, [[5, 5, "metric", {"n": "infersightful.queue", "v": 1.0}]])
    assert [m.name for m in kept if isinstance(m, MetricItem)] == ["infersightful.queue"]


def test_one_uid_cannot_push_another_uids_history_out() -> None:
    """The history keeps MAX_KEYS keys, least recently used out first: another user's many
    command lines (each its own key) evict only that user's own keys past its share."""
    from infersight.agent.coldstart.eta import Run

    h = ch.History()
    mine = ch.service_key("svc", ["serve", "model-a"], uid=1000)
    h.add(mine, Run((("weights_load", 1.0, 4.0),), 5.0, "cold", 1.0))
    for n in range(ch.MAX_KEYS + 10):
        h.add(ch.service_key("svc", ["serve", "junk-%d" % n], uid=1001), Run((), 5000.0, "cold", 2.0))
    assert len(h.of(mine)) == 1
    assert sum(1 for k in h.runs if ch.key_uid(k) == 1001) == ch.MAX_KEYS_PER_UID
    assert ch.key_uid(ch.service_key("a#u5", ["x"], uid=7)) == 7 and ch.key_uid(ch.service_key("a", ["x"])) is None
