"""The ETA predictor and the cold-start history file, as pure functions and a real file."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from infersight.agent.coldstart import history as ch
from infersight.agent.coldstart.eta import Run, expected_order, predict


def run(total: float, cache: str = "weights=warm,compile=none", gap: float = 0.0, **stages: float) -> Run:
    """A run whose stages follow each other, ``gap`` seconds of uncovered time before each."""
    out, t = [], 0.0
    for name, d in stages.items():
        t += gap + d
        out.append((name, d, t))
    return Run(tuple(out), total, cache)


HISTORY = [
    run(10.0, gap=0.2, framework_import=2.0, model_build=1.0, weights_load=4.0, warmup=2.0),
    run(11.0, gap=0.2, framework_import=2.2, model_build=1.1, weights_load=4.5, warmup=2.2),
    run(9.5, gap=0.2, framework_import=1.9, model_build=0.9, weights_load=3.8, warmup=1.9),
]


def test_no_history_gives_progress_without_eta() -> None:
    est = predict([], [("framework_import", 2.0)], 3.0)
    assert est.eta_s is None and est.progress is None and est.runs == 0
    assert est.elapsed_s == 3.0


def test_expected_order_uses_milestones() -> None:
    assert expected_order(HISTORY) == ["framework_import#0", "model_build#0", "weights_load#0", "warmup#0"]


def test_mid_stage_prediction_counts_what_is_left_after_the_last_milestone() -> None:
    # Imports and build ended at 3.4 s, as in the median run (pace 1); now 1.0 s later.
    est = predict(HISTORY, [("framework_import", 2.2), ("model_build", 3.4)], 4.4)
    assert est.stage == "weights_load"
    assert est.runs == 3
    assert est.eta_s == pytest.approx(10.0 - 3.4 - 1.0, rel=1e-6)  # median(total - end(model_build)) - 1.0
    assert est.progress == pytest.approx(4.4 / (4.4 + est.eta_s))
    assert est.spread_s == pytest.approx(1.5)


def test_a_slow_run_is_predicted_slower() -> None:
    fast = predict(HISTORY, [("framework_import", 2.2), ("model_build", 3.4)], 3.4)
    slow = predict(HISTORY, [("framework_import", 3.3), ("model_build", 5.1)], 5.1)  # 1.5x slower
    assert slow.eta_s == pytest.approx(1.5 * fast.eta_s, rel=1e-6)  # type: ignore[operator]


def test_an_early_tiny_milestone_does_not_set_the_pace() -> None:
    runs = [run(20.0, runtime_init=0.1, framework_import=10.0, warmup=9.9) for _ in range(3)]
    est = predict(runs, [("runtime_init", 0.3)], 0.3)  # 3x "slower" over 0.1 s of a 20 s run
    assert est.eta_s == pytest.approx(20.0 - 0.1)


def test_one_run_is_enough_and_says_so() -> None:
    est = predict(HISTORY[:1], [], 0.5)
    assert est.runs == 1 and est.spread_s is None
    assert est.stage == "framework_import"
    assert est.eta_s == pytest.approx(9.5)


def test_a_run_past_its_time_keeps_a_floor() -> None:
    est = predict(HISTORY, [("framework_import", 2.2), ("model_build", 3.4), ("weights_load", 7.6)], 30.0)
    assert est.stage == "warmup"
    assert est.eta_s == pytest.approx(0.25)
    assert est.progress is not None and est.progress < 1


def test_outliers_do_not_move_the_median() -> None:
    noisy = [*HISTORY, run(300.0, gap=0.2, framework_import=2.0, model_build=1.0, weights_load=290.0, warmup=2.0)]
    calm = predict(HISTORY, [("framework_import", 2.2)], 2.2)
    est = predict(noisy, [("framework_import", 2.2)], 2.2)
    assert est.eta_s is not None and calm.eta_s is not None
    assert est.eta_s < 1.2 * calm.eta_s  # the 290 s weights load is one run of four


def test_changed_stage_order_uses_the_furthest_known_milestone() -> None:
    reordered = [run(8.0, weights_load=4.0, framework_import=2.0, warmup=2.0) for _ in range(3)]
    assert expected_order(reordered) == ["weights_load#0", "framework_import#0", "warmup#0"]
    # This run did imports first (ended at 2.0 s), history did them second (ended at 6.0 s):
    # the furthest milestone it shares is framework_import; the pace is clipped, not 0.33.
    est = predict(reordered, [("framework_import", 2.0)], 2.0)
    assert est.stage == "weights_load"
    assert est.eta_s == pytest.approx(0.67 * 2.0, rel=1e-6)


def test_repeated_stages_are_separate_milestones() -> None:
    runs = [Run((("framework_import", 1.0, 1.0), ("model_build", 1.0, 2.0), ("framework_import", 1.0, 3.0)), 5.0)
            for _ in range(2)]
    assert expected_order(runs) == ["framework_import#0", "model_build#0", "framework_import#1"]
    est = predict(runs, [("framework_import", 1.0), ("model_build", 2.0), ("framework_import", 3.0)], 3.0)
    assert est.stage is None and est.eta_s == pytest.approx(2.0)


def test_cache_state_selects_runs() -> None:
    cold = [run(40.0, "weights=cold,compile=none", weights_load=36.0, warmup=4.0) for _ in range(3)]
    warm = [run(8.0, weights_load=4.0, warmup=4.0) for _ in range(3)]
    est_cold = predict(cold + warm, [], 0.0, cache="weights=cold")
    est_warm = predict(cold + warm, [], 0.0, cache="weights=warm,compile=none")
    assert est_cold.same_cache and est_warm.same_cache
    assert est_cold.eta_s == pytest.approx(40.0) and est_warm.eta_s == pytest.approx(8.0)
    other = predict(warm, [], 0.0, cache="weights=cold,compile=hit")
    assert other.runs == 3 and not other.same_cache


# -- the history file --------------------------------------------------------------------


def test_service_key_is_stable_and_separates_commands() -> None:
    a = ch.service_key("svc", ["python", "serve.py"], ["/m/b.safetensors", "/m/a.safetensors"])
    assert a == ch.service_key("svc", ["python", "serve.py"], ["/m/a.safetensors", "/m/b.safetensors"])
    assert a != ch.service_key("svc", ["python", "train.py"])
    # Issue 21.4: a value (a port) does not split the history; the uid does (issue 22.8).
    assert ch.service_key("svc", ["python", "serve.py"]) == ch.service_key("svc", ["python", "serve.py", "--port", "9"])
    assert ch.service_key("svc", ["python", "serve.py"], uid=1) != ch.service_key("svc", ["python", "serve.py"], uid=2)
    assert a.startswith("svc#") and len(a) == len("svc#") + 12


def test_cache_state_from_ratio() -> None:
    assert ch.cache_state(0.95, "hit") == "weights=warm,compile=hit"
    assert ch.cache_state(0.1, None) == "weights=cold,compile=none"
    assert ch.cache_state(None, "miss") == "weights=none,compile=miss"


def test_history_is_bounded_per_key_and_in_keys(tmp_path) -> None:
    path = str(tmp_path / ch.FILE_NAME)
    h = ch.History()
    for i in range(ch.MAX_RUNS + 7):
        h.add("k", run(float(i + 1), weights_load=1.0))
    for i in range(ch.MAX_KEYS + 3):
        h.add("other-%d" % i, run(1.0))
    ch.save(path, h)
    back = ch.load(path)
    assert "k" not in back.runs  # the least recently used key went first
    assert len(back.runs) == ch.MAX_KEYS
    h2 = ch.History()
    for i in range(ch.MAX_RUNS + 7):
        h2.add("k", run(float(i + 1)))
    assert [r.total_s for r in h2.of("k")] == [float(i + 1) for i in range(7, ch.MAX_RUNS + 7)]


def test_corrupt_lines_are_skipped_and_counted(tmp_path) -> None:
    path = tmp_path / ch.FILE_NAME
    good = json.dumps(ch.run_to_json("k", run(3.0, weights_load=2.0)))
    path.write_text("\n".join([good, "{not json", '{"key": "k"}', '{"key":"k","total_s":-1,"stages":[]}',
                               '["a list"]', good[: len(good) // 2], good]) + "\n")
    h = ch.load(str(path))
    assert h.corrupt_lines == 5
    assert [r.total_s for r in h.of("k")] == [3.0, 3.0]


def test_save_is_atomic_and_leaves_no_temp(tmp_path) -> None:
    path = str(tmp_path / "state" / ch.FILE_NAME)
    ch.record(path, "k", run(1.0))
    before = Path(path).read_text()
    h = ch.load(path)
    h.add("k", run(2.0))

    # A save that fails half-way (an unserialisable value) must leave the old file whole.
    class Boom(ch.History):
        def lines(self) -> list[str]:
            raise OSError("disk gone")

    with pytest.raises(OSError):
        ch.save(path, Boom(h.runs))
    assert Path(path).read_text() == before
    assert os.listdir(os.path.dirname(path)) == [ch.FILE_NAME]


def test_concurrent_writers_never_leave_a_torn_file(tmp_path) -> None:
    path = str(tmp_path / ch.FILE_NAME)
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(20):
                ch.record(path, "w%d" % n, run(float(i + 1)))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    h = ch.load(path)
    assert h.corrupt_lines == 0  # last writer wins, but every line of the file is whole
    assert h.runs


def test_a_planted_symlink_is_not_followed(tmp_path) -> None:
    target = tmp_path / "secret"
    target.write_text(json.dumps(ch.run_to_json("k", run(1.0))) + "\n")
    link = tmp_path / ch.FILE_NAME
    link.symlink_to(target)
    h = ch.load(str(link))
    assert h.runs == {} and h.corrupt_lines == 1


def test_runs_are_appended_and_the_file_is_compacted(tmp_path) -> None:
    path = str(tmp_path / ch.FILE_NAME)
    for i in range(ch.MAX_RUNS):
        ch.record(path, "k", run(float(i + 1)))
    assert len(Path(path).read_text().splitlines()) == ch.MAX_RUNS  # appended, nothing to compact yet
    for i in range(ch.MAX_RUNS + 70):
        ch.record(path, "k", run(float(100 + i)))
    lines = Path(path).read_text().splitlines()
    assert len(lines) <= 2 * ch.MAX_RUNS + 64  # compacted on the way: bounded on disk
    h = ch.load(path)
    assert h.corrupt_lines == 0
    assert [r.total_s for r in h.of("k")] == [float(100 + i) for i in range(70, ch.MAX_RUNS + 70)]


def test_a_torn_append_is_one_corrupt_line(tmp_path) -> None:
    path = tmp_path / ch.FILE_NAME
    ch.record(str(path), "k", run(1.0))
    with open(path, "a") as f:
        f.write('{"key":"k","total_s":')  # a crash mid-append
    ch.append(str(path), "k", run(2.0))
    h = ch.load(str(path))
    assert h.corrupt_lines == 1 and [r.total_s for r in h.of("k")] == [1.0, 2.0]  # only the torn line is lost


def test_a_stage_this_run_skipped_is_not_expected_next() -> None:
    """A tiny import run (just over the hooks' 2 ms) in most runs of history, not in this one: the expected stage
    stayed framework_import while the run loaded its weights (a full test run, twice)."""
    history = [run(1.2, framework_import=0.003, model_build=0.3, weights_load=0.6) for _ in range(3)]
    est = predict(history, [("model_build", 0.31)], 0.5)
    assert est.stage == "weights_load"
    assert predict(history, [], 0.001).stage == "framework_import"  # not passed yet: still expected
