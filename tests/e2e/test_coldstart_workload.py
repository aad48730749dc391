"""Cold start under ``infersight launch`` with real torch (CPU): auto-detected stages,
the explicit API, a thread and a forked child. One launch per workload (module scope)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import HERE, LaunchRun, assert_well_formed, launch, stage_name  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

pytestmark = [pytest.mark.slow, pytest.mark.torch]

AUTO_STAGES = {"runtime_init", "framework_import", "weights_load", "graph_compile", "warmup", "ready_wait",
               "first_request"}


@pytest.fixture(scope="module")
def auto(tmp_path_factory: pytest.TempPathFactory) -> LaunchRun:
    tmp = str(tmp_path_factory.mktemp("auto"))
    run = launch(tmp, [sys.executable, os.path.join(HERE, "coldstart_auto.py")], env={"PYTHONWARNINGS": "ignore"})
    assert run.rc == 0, run.output
    return run


def test_every_stage_but_cuda_is_found(auto: LaunchRun) -> None:
    root = auto.root_of(auto.result["pid"])
    names = {stage_name(s) for s in auto.stages(root)}
    assert names >= AUTO_STAGES, AUTO_STAGES - names
    assert not names & {"cuda_init", "weights_to_device"}  # no GPU here
    assert all(s.attributes.get("infersight.stage.custom") is None for s in auto.stages(root))


def test_root_contract(auto: LaunchRun) -> None:
    root = auto.root_of(auto.result["pid"])
    assert root.parent_span_id is None
    assert root.attributes["faas.coldstart"] is True
    assert root.attributes["infersight.coldstart.ended_by"] == "ready"  # listen: readiness is known
    assert root.attributes["infersight.ready.source"] == "listen"
    (ready,) = [s for s in auto.stages(root) if stage_name(s) == "ready_wait"]
    assert root.end_ns == ready.end_ns
    un = root.attributes["infersight.coldstart.unattributed_s"]
    assert isinstance(un, float) and 0 <= un < (root.end_ns - root.start_ns) / 1e9


def test_stages_are_well_formed(auto: LaunchRun) -> None:
    root = auto.root_of(auto.result["pid"])
    assert_well_formed(root, auto.stages(root))


def test_root_covers_the_child_wall_time(auto: LaunchRun) -> None:
    root = auto.root_of(auto.result["pid"])
    assert root.start_ns <= auto.result["t_first_ns"]  # from the spawn, before the workload's first line
    # to its readiness: after every stage begun before it, and before the workload's last line
    before = [s for s in auto.stages(root) if s.start_ns < root.end_ns]
    assert max(s.end_ns for s in before) <= root.end_ns <= auto.result["t_end_ns"]


def test_nesting_and_weights(auto: LaunchRun) -> None:
    root = auto.root_of(auto.result["pid"])
    stages = auto.stages(root)
    by_id = {s.span_id: s for s in stages}
    imports = [s for s in stages if stage_name(s) == "framework_import"]
    assert [s.attributes["infersight.framework"] for s in imports][:1] == ["torch"]
    warm = [s for s in stages if stage_name(s) == "warmup"]
    assert len(warm) == 1 and warm[0].attributes["infersight.warmup.forwards"] == 3
    compiles = [s for s in stages if stage_name(s) == "graph_compile"]
    apis = {s.attributes.get("infersight.compile.api") for s in compiles}
    assert {"torch.jit.trace", "torch.compile"} <= apis
    dynamo = [s for s in compiles if s.attributes.get("infersight.compile.api") == "torch.compile"]
    # torch.compile compiles lazily, inside the first warmup forward
    assert by_id.get(dynamo[0].parent_span_id or "") is warm[0]
    weights = [s for s in stages if stage_name(s) == "weights_load"]
    loads = [s for s in weights if s.attributes["infersight.weights.api"] != "deferred"]
    assert sorted(s.attributes["infersight.weights.api"] for s in loads) == [
        "safetensors.safe_open", "safetensors.torch.load_file", "torch.load"]
    # the two mapped loads are read by the load_state_dict copies that follow them
    deferred = [s for s in weights if s.attributes["infersight.weights.api"] == "deferred"]
    assert [s.attributes["infersight.weights.deferred_by"] for s in deferred] == ["load_state_dict"] * 2
    safe_open = next(s for s in loads if s.attributes["infersight.weights.api"] == "safetensors.safe_open")
    # the copy inside the `with safe_open` block nests in it; the other one follows load_file
    assert sorted(s.parent_span_id for s in deferred) == sorted([root.span_id, safe_open.span_id])
    for w in weights:  # nested loads (load_file -> safe_open) are not counted twice
        assert w in deferred or w.parent_span_id == root.span_id
        assert str(w.attributes["infersight.weights.path"]).startswith(os.sep)
        assert int(w.attributes["infersight.weights.bytes"]) > 100_000
        lazy = w.attributes["infersight.weights.lazy"]
        assert lazy is (w.attributes["infersight.weights.api"] in ("safetensors.safe_open",
                                                                  "safetensors.torch.load_file"))
        # a mapped load reads nothing yet: no throughput; the others' is real
        assert ("infersight.weights.bytes_per_s" in w.attributes) is not lazy
    order = [stage_name(s) for s in sorted(stages, key=lambda s: s.start_ns) if s.parent_span_id == root.span_id]
    assert order.index("ready_wait") < order.index("first_request")
    assert order[0] == "runtime_init"


@pytest.fixture(scope="module")
def explicit(tmp_path_factory: pytest.TempPathFactory) -> LaunchRun:
    tmp = str(tmp_path_factory.mktemp("explicit"))
    run = launch(tmp, [sys.executable, os.path.join(HERE, "coldstart_explicit.py")], env={"PYTHONWARNINGS": "ignore"})
    assert run.rc == 0, run.output
    return run


def test_explicit_api_custom_stages(explicit: LaunchRun) -> None:
    root = explicit.root_of(explicit.result["pid"])
    stages = explicit.stages(root)
    by_name = {stage_name(s): s for s in stages}
    for name in ("build_model", "init_layers", "thread_stage", "spawn_workers"):
        assert by_name[name].attributes["infersight.stage.custom"] is True
    assert "infersight.stage.custom" not in by_name["tokenizer_load"].attributes  # a builtin name now
    assert by_name["build_model"].attributes["layers"] == 2
    assert by_name["init_layers"].parent_span_id == by_name["build_model"].span_id
    assert by_name["thread_stage"].parent_span_id == root.span_id
    assert by_name["ready_wait"].attributes["infersight.ready.source"] == "mark_ready"
    fr = by_name["first_request"]
    # explicit mode: from the first forward after mark_ready() to first_response()
    assert fr.end_ns - fr.start_ns >= 15_000_000
    assert root.end_ns == by_name["ready_wait"].end_ns <= fr.start_ns  # the root ends at mark_ready()
    assert_well_formed(root, stages)


def test_fork_and_threads_neither_lost_nor_duplicated(explicit: LaunchRun) -> None:
    parent = explicit.root_of(explicit.result["pid"])
    child = explicit.root_of(explicit.result["child_pid"])
    assert explicit.result["child_status"] == 0
    ids = [s.span_id for s in explicit.spans]
    assert len(ids) == len(set(ids)), "a span was emitted twice"
    spawn = next(s for s in explicit.stages(parent) if stage_name(s) == "spawn_workers")
    assert child.trace_id == parent.trace_id
    assert child.parent_span_id == spawn.span_id  # the child's root hangs under the stage that forked
    assert child.attributes.get("infersight.process.forked") is True
    child_names = [stage_name(s) for s in explicit.stages(child)]
    assert child_names.count("child_stage") == 1
    assert "warmup" in child_names
    parent_names = [stage_name(s) for s in explicit.stages(parent)]
    assert "child_stage" not in parent_names
    assert parent_names.count("spawn_workers") == 1 and parent_names.count("thread_stage") == 1
    assert_well_formed(child, explicit.stages(child))


def test_a_reentrant_lazy_init_is_one_cuda_init(tmp_path: Path) -> None:
    """torch's _lazy_init calls itself from its queued calls before CUDA counts as initialised: on an H200
    (bench/gpu_check.sh, torch 2.11) that gave a second, empty cuda_init inside the first."""
    run = launch(str(tmp_path), [sys.executable, os.path.join(HERE, "lazy_init_reentrant.py")],
                 env={"PYTHONWARNINGS": "ignore"})
    assert run.rc == 0, run.output
    assert run.result["calls"] == 2  # the stand-in did call the wrapper again from inside
    inits = [s for s in run.stages(run.root_of(run.result["pid"])) if stage_name(s) == "cuda_init"]
    assert len(inits) == 1, [(s.start_ns, s.end_ns) for s in inits]
