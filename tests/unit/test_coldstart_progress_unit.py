"""The progress tracker on assembled items (pure: a fake clock, no sockets), and its MQTT encoding."""

from __future__ import annotations

import json

from infersight.agent.coldstart.assembly import coldstart_assembler
from infersight.agent.coldstart.eta import MAX_STAGES
from infersight.agent.coldstart.progress import ProgressTracker, run_of
from infersight.agent.daemon.assemble import Assembler
from infersight.exporters.mqtt_payload import Topics, encode_batch
from infersight.telemetry import ColdStart, ColdStartProgress, Resource

S = 1_000_000_000
# The producers' PIDs here are made up (100 + n): a /proc that does not exist keeps the tracker from keying a
# run by the command line of whatever real process holds that PID on the test machine.
NO_PROC = "/nonexistent-proc"


def hello(a: Assembler, n: int, start_s: float):  # type: ignore[no-untyped-def]
    return a.hello({"id": "p%d" % n, "pid": 100 + n, "start_ns": int(start_s * S), "trace_id": "%032x" % n,
                    "root_span_id": "%016x" % (n + 1), "service_name": "svc"})


def stage(a: Assembler, p, seq: int, name: str, s: float, e: float):  # type: ignore[no-untyped-def]
    root = p.info["root_span_id"]
    return a.events(p, [[seq, int(e * S), "span", {"n": "coldstart." + name, "id": "%016x" % (seq + 99),
                                                   "p": root, "s": int(s * S), "e": int(e * S),
                                                   "a": {"infersight.stage": name}}]])


def root(a: Assembler, p, seq: int, e: float):  # type: ignore[no-untyped-def]
    return a.events(p, [[seq, int(e * S), "span", {"n": "coldstart", "id": p.info["root_span_id"],
                                                   "s": p.info["start_ns"], "e": int(e * S)}]])


def test_two_workers_of_one_service_publish_one_state_then_one_clear(tmp_path) -> None:
    a = coldstart_assembler("h")
    t = ProgressTracker(str(tmp_path / "h.jsonl"), producer_info=lambda pid: a.producers[pid].info, proc_root=NO_PROC)
    # History: one run of the service, as both workers will be keyed (same command line: none).
    p0 = hello(a, 0, 0.0)
    t.observe(stage(a, p0, 1, "model_build", 0.0, 1.0))
    t.observe(stage(a, p0, 2, "weights_load", 1.0, 5.0))
    t.observe(root(a, p0, 3, 6.0))
    assert t.recorded == 1
    assert t.tick(int(6.5 * S)) == []  # it ended before any tick showed it: nothing to clear

    w1, w2 = hello(a, 1, 10.0), hello(a, 2, 10.5)
    t.observe(stage(a, w1, 1, "model_build", 10.0, 11.0))
    t.observe(stage(a, w2, 1, "model_build", 10.5, 11.5))
    ups = t.tick(int(12.0 * S))
    assert len(ups) == 1 and ups[0].service == "svc"
    st = ups[0].state
    assert st is not None and st["processes"] == 2 and st["stage"] == "weights_load"
    assert ups[0].pid == 102  # the later worker has more left
    assert t.tick(int(12.5 * S)) == []  # no change, under a second
    assert len(t.tick(int(13.1 * S))) == 1  # a second later, a refresh

    t.observe(stage(a, w1, 2, "ready_wait", 15.0, 15.1))
    ups = t.tick(int(15.2 * S))
    assert len(ups) == 1 and ups[0].state is not None and ups[0].state["processes"] == 1
    t.observe(stage(a, w2, 2, "ready_wait", 15.5, 15.6))
    ups = t.tick(int(15.7 * S))
    assert [u.state for u in ups] == [None]  # cleared once, for the service
    assert t.tick(int(20 * S)) == []


def test_an_agent_stopping_clears_what_it_showed(tmp_path) -> None:
    a = coldstart_assembler("h")
    t = ProgressTracker(None, producer_info=lambda pid: a.producers[pid].info, proc_root=NO_PROC)
    w = hello(a, 1, 0.0)
    t.observe(stage(a, w, 1, "model_build", 0.0, 1.0))
    assert len(t.tick(int(1.1 * S))) == 1
    assert t.snapshot(int(1.2 * S))[0]["eta_s"] is None  # no history: no ETA, only progress of stages
    t.end_all()
    assert [u.state for u in t.tick(int(1.3 * S))] == [None]


def test_mqtt_keeps_only_the_newest_retained_state_per_topic_in_a_batch() -> None:
    r = Resource.of({"service.name": "svc"})
    batch = [ColdStartProgress(r, "svc", 1, 1, {"stage": "model_build"}),
             ColdStartProgress(r, "other", 2, 2, {"stage": "warmup"}),
             ColdStartProgress(r, "svc", 1, 3, {"stage": "weights_load"}),
             ColdStartProgress(r, "other", 2, 4, None)]
    msgs, skipped = encode_batch(batch, Topics.of("infersight", "h"))
    assert skipped == 0
    assert [(m.topic, m.retain) for m in msgs] == [("infersight/h/coldstart/svc/progress", True),
                                                   ("infersight/h/coldstart/other/progress", True)]
    assert json.loads(msgs[0].payload)["stage"] == "weights_load"
    assert msgs[1].payload == b""


def weights(a: Assembler, p, seq: int, s: float, e: float, path: str, ratio: float):  # type: ignore[no-untyped-def]
    return a.events(p, [[seq, int(e * S), "span", {
        "n": "coldstart.weights_load", "id": "%016x" % (seq + 199), "p": p.info["root_span_id"],
        "s": int(s * S), "e": int(e * S),
        "a": {"infersight.stage": "weights_load", "infersight.weights.path": path,
              "infersight.weights.page_cache_ratio": ratio}}]])


def test_a_cold_page_cache_is_predicted_from_cold_runs(tmp_path) -> None:
    """Before its weights are read, a new run's cache state is probed (mincore) on the files
    the last run of its key read; an evicted file selects the cold history."""
    import os

    model = tmp_path / "model.safetensors"
    model.write_bytes(os.urandom(1 << 20))
    a = coldstart_assembler("h")
    t = ProgressTracker(None, producer_info=lambda pid: a.producers[pid].info, proc_root=NO_PROC)
    for n, (ratio, load_s) in enumerate([(0.0, 20.0), (1.0, 2.0)]):  # one cold run, one warm run
        p = hello(a, n, 100.0 * n)
        t.observe(stage(a, p, 1, "model_build", 100.0 * n, 100.0 * n + 1))
        t.observe(weights(a, p, 2, 100.0 * n + 1, 100.0 * n + 1 + load_s, str(model), ratio))
        t.observe(root(a, p, 3, 100.0 * n + 2 + load_s))
    assert t.recorded == 2

    def eta_of_new_run(n: int) -> tuple[str | None, float]:
        p = hello(a, n, 1000.0 * n)
        t.observe(stage(a, p, 1, "model_build", 1000.0 * n, 1000.0 * n + 1))
        w = t.warming[p.id]
        est = t.estimate(w, int((1000.0 * n + 1) * S))
        assert est.eta_s is not None
        return w.cache, est.eta_s

    with open(model, "rb") as f:  # read: the file is in the page cache
        f.read()
    cache, eta = eta_of_new_run(5)
    assert cache == "weights=warm" and eta < 5
    fd = os.open(model, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    cache, eta = eta_of_new_run(6)
    assert cache == "weights=cold" and eta > 15


def test_stages_after_readiness_do_not_restart_a_cold_start(tmp_path) -> None:
    """A worker that opens a stage per request once it is serving: its service must not show
    as warming again (a gateway would stop routing to it), nor start a run of its own."""
    a = coldstart_assembler("h")
    t = ProgressTracker(str(tmp_path / "h.jsonl"), producer_info=lambda pid: a.producers[pid].info, proc_root=NO_PROC)
    w = hello(a, 1, 0.0)
    t.observe(stage(a, w, 1, "model_build", 0.0, 1.0))
    assert [u.state is not None for u in t.tick(int(1.1 * S))] == [True]
    t.observe(stage(a, w, 2, "ready_wait", 1.0, 2.0))
    t.observe(root(a, w, 3, 2.5))
    assert [u.state for u in t.tick(int(2.6 * S))] == [None]
    for seq in range(4, 40):  # per-request stages, after the cold start
        t.observe(stage(a, w, seq, "preprocess", seq, seq + 0.01))
    assert t.warming == {} and t.snapshot(int(41 * S)) == []
    assert t.tick(int(41 * S)) == []
    assert t.recorded == 1


def test_a_cold_start_with_many_stages_is_tracked_and_recorded_bounded(tmp_path) -> None:
    """Thousands of stages before readiness: the live state, each run in history and so each
    estimate stay bounded (the first MAX_STAGES stages), and the ETA still comes from them."""
    a = coldstart_assembler("h")
    t = ProgressTracker(str(tmp_path / "h.jsonl"), producer_info=lambda pid: a.producers[pid].info, proc_root=NO_PROC)
    n = 3 * MAX_STAGES
    cold_starts: list[ColdStart] = []
    for run in range(2):
        p = hello(a, run, 10_000.0 * run)
        for i in range(n):
            t.observe(stage(a, p, i + 1, "shard", 10_000.0 * run + i, 10_000.0 * run + i + 1))
        if run == 1:
            assert len(t.warming[p.id].ended) == MAX_STAGES
            est = t.estimate(t.warming[p.id], int((10_000.0 + n) * S))
            assert est.eta_s is not None and est.runs == 1
        out = root(a, p, n + 1, 10_000.0 * run + n + 1)
        cold_starts += [x for x in out if isinstance(x, ColdStart)]
        t.observe(out)
    assert t.recorded == 2
    assert len(cold_starts[0].stages) == n  # the summary itself keeps every stage
    assert len(run_of(cold_starts[0]).stages) == MAX_STAGES
    (key,) = t.history.runs
    assert [len(r.stages) for r in t.history.of(key)] == [MAX_STAGES, MAX_STAGES]
    # An older history file with longer runs is read bounded too.
    long_line = json.dumps({"key": "k", "total_s": 9.0, "stages": [["s", 0.001, 0.001 * i] for i in range(n)]})
    (tmp_path / "old.jsonl").write_text(long_line + "\n")
    old = ProgressTracker(str(tmp_path / "old.jsonl"))
    assert [len(r.stages) for r in old.history.of("k")] == [MAX_STAGES]


def test_a_producer_whose_root_ended_before_the_agent_started_is_not_warming() -> None:
    """An agent restarted while a worker serves: the worker's hello says its root went out
    (to the agent before), so its per-request stages do not show the service as warming, and
    its death does not make up a root that would enter the history as a cold start as long
    as its life."""
    a = coldstart_assembler("h")
    t = ProgressTracker(None, producer_info=lambda pid: a.producers[pid].info, proc_root=NO_PROC)
    w = a.hello({"id": "p1", "pid": 101, "start_ns": 0, "trace_id": "%032x" % 1, "root_span_id": "%016x" % 2,
                 "service_name": "svc", "root_ended": True})
    for seq in range(1, 20):
        t.observe(stage(a, w, seq, "preprocess", 100.0 + seq, 100.0 + seq + 0.01))
    assert t.warming == {} and t.tick(int(200 * S)) == []
    assert a.producer_lost(w) == [] and t.recorded == 0


def test_a_serving_producer_stays_remembered_while_others_finish(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The memory of finished cold starts is bounded; a producer that keeps opening stages
    is the last one forgotten, not the first."""
    import infersight.agent.coldstart.progress as progress

    monkeypatch.setattr(progress, "MAX_DONE", 4)
    a = coldstart_assembler("h")
    t = ProgressTracker(None, producer_info=lambda pid: a.producers[pid].info, proc_root=NO_PROC)
    server = hello(a, 0, 0.0)
    t.observe(stage(a, server, 1, "model_build", 0.0, 1.0))
    t.observe(root(a, server, 2, 2.0))
    seq = 3
    for n in range(1, 10):  # short-lived helpers finish their cold starts one after another
        h = hello(a, n, 10.0 * n)
        t.observe(stage(a, h, 1, "model_build", 10.0 * n, 10.0 * n + 1))
        t.observe(root(a, h, 2, 10.0 * n + 2))
        t.observe(stage(a, server, seq, "preprocess", 10.0 * n + 3, 10.0 * n + 4))  # it keeps serving
        seq += 1
    assert len(t.done) == 4 and server.id in t.done
    assert server.id not in t.warming


def test_a_live_cold_start_keeps_its_first_stages_by_start_as_history_does(tmp_path) -> None:
    """Past MAX_STAGES, the live run and the recorded run hold the same stages: the first by
    start time, whatever order they end in."""
    a = coldstart_assembler("h")
    t = ProgressTracker(None, producer_info=lambda pid: a.producers[pid].info, proc_root=NO_PROC)
    p = hello(a, 1, 0.0)
    n = MAX_STAGES + 10
    for i in range(1, n):
        t.observe(stage(a, p, i + 1, "short", float(i), i + 0.5))
    t.observe(stage(a, p, 1, "long", 0.0, 10_000.0))  # started first; a span arrives when it ends
    live = [s for _start, s, _end in t.warming[p.id].ended]
    out = root(a, p, n + 1, 10_001.0)
    (cs,) = [x for x in out if isinstance(x, ColdStart)]
    assert live == [s for s, _d, _e in run_of(cs).stages]
    assert live[0] == "long" and len(live) == MAX_STAGES
