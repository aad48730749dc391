"""The progress tracker on assembled items (pure: a fake clock, no sockets), and its MQTT encoding."""

from __future__ import annotations

import json

from infersight.agent.coldstart.progress import ProgressTracker
from infersight.agent.daemon.assemble import Assembler
from infersight.exporters.mqtt_payload import Topics, encode_batch
from infersight.telemetry import ColdStartProgress, Resource

S = 1_000_000_000


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
    a = Assembler("h")
    t = ProgressTracker(str(tmp_path / "h.jsonl"), producer_info=lambda pid: a.producers[pid].info)
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
    a = Assembler("h")
    t = ProgressTracker(None, producer_info=lambda pid: a.producers[pid].info)
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
    a = Assembler("h")
    t = ProgressTracker(None, producer_info=lambda pid: a.producers[pid].info)
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
