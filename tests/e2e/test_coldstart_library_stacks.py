"""Real library stacks whose slow calls only the shipped stage rules name (rules/stages.toml),
run under ``infersight launch`` with no infersight call in them: accelerate's
``load_checkpoint_and_dispatch`` over sharded safetensors, a PEFT LoRA loaded and merged
(``merge_and_unload``), a diffusers pipeline behind FastAPI. Each must show its rules' stages
(every shipped rule with a ``run`` example for that stack: the examples CI runs) and be at
least 95% covered by named stages (a share of the process's own cold start, not a timing).
Models are built from configs with random weights (``workloads/library_stacks.py build``)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import HERE, LaunchRun, launch, stage_name  # noqa: E402

from infersight.agent.commands.show import coldstarts  # noqa: E402
from infersight.exporters.waterfall import coverage, is_helper  # noqa: E402
from infersight.rules.stage_rules import builtin_stage_rules_path, load_stage_rules  # noqa: E402
from infersight.telemetry import ColdStart  # noqa: E402

for _lib in ("torch", "transformers", "accelerate", "peft", "diffusers", "fastapi", "uvicorn"):
    pytest.importorskip(_lib)

pytestmark = [pytest.mark.slow, pytest.mark.torch]

MIN_COVERAGE = 0.95
STACKS = os.path.join(HERE, "library_stacks.py")
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
       "TOKENIZERS_PARALLELISM": "false", "DIFFUSERS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
RULES = load_stage_rules([builtin_stage_rules_path()]).rules


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("library_models"))
    env = dict(os.environ, **ENV)
    env.pop("PYTHONPATH", None)
    subprocess.run([sys.executable, STACKS, "build", out], check=True, env=env, capture_output=True, timeout=600)
    return out


def main_coldstart(r: LaunchRun) -> ColdStart:
    roots = [cs for cs in coldstarts(r.spans) if not is_helper(cs) and cs.root.parent_span_id is None]
    assert len(roots) == 1, [cs.root for cs in roots]
    return roots[0]


def check(r: LaunchRun, mode: str) -> ColdStart:
    """Every rule whose example runs ``mode`` fired, and named stages cover 95% of the cold start."""
    assert r.rc == 0, r.output[-4000:]
    cs = main_coldstart(r)
    fired = {s.attributes.get("infersight.stage.rule") for s in cs.stages}
    expected = {rule.id for rule in RULES if any(e.kind == "run" and e.value == mode for e in rule.examples)}
    assert expected, "no shipped rule has a run example %r" % mode
    assert expected <= fired, (expected - fired, r.output[-3000:])
    cov = coverage(cs)
    gaps = [((s.end_ns - s.start_ns) / 1e9, s.attributes.get("infersight.unattributed.top"))
            for s in cs.stages if stage_name(s) == "unattributed"]
    assert cov >= MIN_COVERAGE, "coverage %.1f%%, gaps %r\n%s" % (100 * cov, gaps, r.output[-3000:])
    assert "stage_rules.missing" not in str(cs.root.attributes), cs.root.attributes  # every target found
    return cs


def rule_spans(cs: ColdStart, rule: str) -> list:
    return [s for s in cs.stages if s.attributes.get("infersight.stage.rule") == rule]


def test_accelerate_load_checkpoint_and_dispatch_sharded(models: str, tmp_path) -> None:
    r = launch(str(tmp_path), [sys.executable, STACKS, "accelerate", models], result=False, env=ENV)
    cs = check(r, "accelerate")
    (load,) = rule_spans(cs, "accelerate.load_checkpoint")
    assert stage_name(load) == "weights_load"
    assert load.attributes["infersight.stage.target"] == "accelerate.utils.modeling:load_checkpoint_in_model"
    # the shard reads the builtin hooks see nest inside the placement the rule names
    shards = [s for s in cs.stages if s.parent_span_id == load.span_id and stage_name(s) == "weights_load"]
    assert len({s.attributes.get("infersight.weights.path") for s in shards}) == 6, shards
    assert stage_name(rule_spans(cs, "accelerate.dispatch_model")[0]) == "weights_to_device"


def test_peft_lora_merge_and_unload(models: str, tmp_path) -> None:
    r = launch(str(tmp_path), [sys.executable, STACKS, "peft", models], result=False, env=ENV)
    cs = check(r, "peft")
    (merge,) = rule_spans(cs, "peft.merge_and_unload")
    assert stage_name(merge) == "model_build"
    (adapter,) = rule_spans(cs, "peft.load_adapter")
    assert adapter.end_ns <= merge.start_ns
    reads = [s for s in cs.stages if s.parent_span_id == adapter.span_id and stage_name(s) == "weights_load"]
    assert reads, cs.stages  # the adapter's file reads nest in its load
    # launch's waterfall draws them under the adapter's own row (they were under the base model's weights_load
    # row, the row before them in start order, the adapter's load grouped with the base model's build)
    lines = r.output.splitlines()
    at = next((i for i, ln in enumerate(lines) if ln.startswith("  model_build ") and "peft.load_adapter" in ln), None)
    assert at is not None, r.output[-3000:]
    nested = list(itertools.takewhile(lambda ln: ln.startswith("    "), lines[at + 1:]))
    assert any(ln.lstrip().startswith("weights_load") for ln in nested), r.output[-3000:]


def test_diffusers_pipeline_behind_fastapi(models: str, tmp_path) -> None:
    from conftest import free_port

    port = free_port()
    r = launch(str(tmp_path), [sys.executable, STACKS, "diffusers", models, str(port)],
               "--ready-url", "http://127.0.0.1:%d/health" % port, "--probe", "http://127.0.0.1:%d/" % port,
               result=False, env=ENV)
    cs = check(r, "diffusers")
    (pipe,) = rule_spans(cs, "diffusers.pipeline_load")
    assert stage_name(pipe) == "pipeline_load" and pipe.attributes["infersight.stage.custom"] is True
    inside = {stage_name(s) for s in cs.stages if s.parent_span_id == pipe.span_id}
    assert "weights_load" in inside  # the unet's safetensors read, under the pipeline's load
