"""When the OOM classifier loads its rules: site rule files at once (an invalid one is reported
at start, file:line), the builtin rules and the serving-engine rules at first use or warm-up;
the daemon warms them at start, the embedded agent of ``launch`` does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from site_rules import BAD_RULE, SITE_RULE

from infersight.agent.daemon import config as cfg
from infersight.agent.oom import kind as oom_kind
from infersight.agent.oom.extension import OomExtension
from infersight.rules import engine, serving

VLLM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.15 GiB of which 1.06 GiB is free. Of the allocated memory 75.73 GiB is allocated by PyTorch, and "
        "1.55 GiB is reserved by PyTorch but unallocated.")


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the loads of the builtin serving rules and of rule files."""
    n = {"serving": 0, "rule_files": 0}
    real_serving, real_load = serving.load_serving_rules, engine.load_rules

    def load_serving(*a: Any, **k: Any) -> serving.ServingRules:
        n["serving"] += 1
        return real_serving(*a, **k)

    def load_rules(*a: Any, **k: Any) -> engine.RuleSet:
        n["rule_files"] += 1
        return real_load(*a, **k)

    monkeypatch.setattr(serving, "_BUILTIN", None)
    monkeypatch.setattr(serving, "load_serving_rules", load_serving)
    monkeypatch.setattr(engine, "_BUILTIN", None)
    monkeypatch.setattr(engine, "load_rules", load_rules)
    return n


def test_without_site_files_nothing_loads_until_the_first_oom(loads: dict[str, int], tmp_path: Path) -> None:
    c = oom_kind.OomClassifier([tmp_path / "absent", tmp_path])  # no *.toml anywhere
    assert loads == {"serving": 0, "rule_files": 0}
    found = serving.analyse(VLLM, c.serving)
    assert found and found[0].cls in engine.CLASSES
    assert loads == {"serving": 1, "rule_files": 1}  # the builtin rubric, once, shared with the serving rules
    c.warm()
    assert c.classify({"R": 20 << 30, "T": 12 << 30, "F": 0, "A": 0, "P": 0}).rule == "oom.capacity.beyond-device"
    assert loads == {"serving": 1, "rule_files": 1}


def test_site_files_load_and_are_checked_when_built(loads: dict[str, int], tmp_path: Path) -> None:
    (tmp_path / "site.toml").write_text(SITE_RULE)
    c = oom_kind.OomClassifier([tmp_path])
    assert loads["rule_files"] == 1 and loads["serving"] == 0
    (tmp_path / "site.toml").unlink()  # loaded already: the classifier keeps it
    assert c.rules.get("site.bigger-than-device") is not None
    (tmp_path / "zz-bad.toml").write_text(BAD_RULE)
    with pytest.raises(oom_kind.RuleReloadError, match=r"zz-bad\.toml:8"):
        oom_kind.OomClassifier([tmp_path])


def test_an_invalid_site_file_at_start_is_logged_and_the_builtin_rules_run(
        loads: dict[str, int], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "zz-bad.toml").write_text(BAD_RULE)
    conf = cfg.load(None, env={}, flags={"rules.dirs": [str(tmp_path)]})
    with caplog.at_level("ERROR", logger="infersight.agent.oom"):
        ext = OomExtension(conf)
    assert "zz-bad.toml:8" in caplog.text
    c = ext.handlers.classifier
    assert c.dirs == [str(tmp_path)]
    assert c.classify({"R": 1 << 30, "T": 12 << 30, "F": 8 << 30, "A": 0, "P": 0}).rule != "site.bad"


class _Broadcaster:
    def publish(self, items: list[Any]) -> None:
        pass


class _Context:
    def __init__(self, embedded: bool) -> None:
        self.embedded = embedded
        self.broadcaster = _Broadcaster()

    def stderr_relayed(self, info: dict[str, Any]) -> bool:
        return False

    def stderr_relay_started(self, info: dict[str, Any]) -> float | None:
        return 0.0


@pytest.mark.parametrize("embedded", [False, True])
async def test_the_daemon_loads_the_serving_rules_at_start_the_embedded_agent_does_not(
        loads: dict[str, int], embedded: bool) -> None:
    ext = OomExtension(cfg.load(None, env={}, flags={"rules.dirs": []}))
    await ext.start(_Context(embedded))  # type: ignore[arg-type]
    assert loads["serving"] == (0 if embedded else 1)
    ext.warm()  # what launch calls when its stderr relay opens a capture
    assert loads["serving"] == 1


class _FakeAgent:
    def __init__(self) -> None:
        self.taps: list[Any] = []

    def observe(self, tap: Any) -> None:
        self.taps.append(tap)


class _FakeOom:
    def __init__(self) -> None:
        self.warmed = 0

    def warm(self) -> None:
        self.warmed += 1


def _coldstart(ended_by: str) -> Any:
    from infersight.hooks import _contract
    from infersight.telemetry import ColdStart, Resource, SpanItem

    res = Resource.of({"service.name": "svc"})
    root = SpanItem(res, "a" * 32, "b" * 16, None, "coldstart", 1, 2, {_contract.ENDED_BY: ended_by})
    return ColdStart(root, [])


def _embedded() -> tuple[Any, _FakeOom, Any]:
    """launch's embedded agent over a fake agent and OOM extension: (it, the extension, the tap it observes with)."""
    from infersight.agent.commands.launch_agent import EmbeddedAgent

    agent, oom = _FakeAgent(), _FakeOom()
    emb = EmbeddedAgent(agent, None, oom)  # type: ignore[arg-type]
    (tap,) = agent.taps
    return emb, oom, tap


def _span(name: str, attributes: dict[str, Any]) -> Any:
    from infersight.telemetry import Resource, SpanItem

    return SpanItem(Resource.of({"service.name": "svc"}), "a" * 32, "c" * 16, "b" * 16, name, 1, 2, attributes)


def _stage(rule: str) -> Any:
    from infersight.hooks import _contract

    return _span("coldstart.weights_load", {_contract.STAGE_RULE: rule, "infersight.stage.target": "m:f"})


def _imports(*packages: str) -> Any:
    return _span("coldstart.framework_import",
                 {"infersight.import.packages": list(packages), "infersight.framework": packages[0]})


async def test_launch_loads_the_oom_rules_once_a_process_serves_not_when_it_exits() -> None:
    emb, oom, tap = _embedded()
    tap([_coldstart("exit"), _coldstart("producer_lost")])
    assert emb._oom_warm is None and oom.warmed == 0
    tap([_coldstart("ready")])
    assert emb._oom_warm is not None
    emb._oom_warm.join(5)
    assert oom.warmed == 1
    tap([_coldstart("first_request")])
    emb.prepare_oom()  # a capture of CMD's stderr opened: loaded already
    assert oom.warmed == 1


async def test_launch_loads_the_oom_rules_when_a_serving_engine_s_stage_ends() -> None:
    # an engine's memory errors come while it starts (its KV cache is sized after the weights load)
    emb, oom, tap = _embedded()
    tap([_stage("accelerate.load_checkpoint"), _stage("ray.serve.run"), _stage("")])  # not an engine's stage
    assert emb._oom_warm is None and oom.warmed == 0
    tap([_stage("vllm.load_model")])
    assert emb._oom_warm is not None
    emb._oom_warm.join(5)
    assert oom.warmed == 1
    tap([_stage("sglang.load_model")])
    assert oom.warmed == 1


async def test_launch_loads_the_oom_rules_when_a_serving_engine_s_package_is_imported() -> None:
    # before the engine's first stage ends: an OOM in vllm.load_model (weights larger than the device) comes first
    emb, oom, tap = _embedded()
    tap([_imports("torch 1.90 s", "transformers 0.80 s"), _imports("vllm_client 0.30 s")])  # no engine
    assert emb._oom_warm is None and oom.warmed == 0
    tap([_imports("torch 1.90 s", "vllm 3.21 s")])
    assert emb._oom_warm is not None
    emb._oom_warm.join(5)
    assert oom.warmed == 1


@pytest.mark.parametrize(("argv", "engine"), [
    (["vllm", "serve", "Qwen/Qwen3-8B"], "vllm"),
    (["/opt/venv/bin/vllm", "serve", "m"], "vllm"),
    (["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"],
     "vllm.entrypoints.openai.api_server"),
    (["python3.11", "-u", "-m", "sglang.launch_server", "--model-path", "m"], "sglang.launch_server"),
    (["/usr/local/bin/text-generation-launcher", "--model-id", "m"], "text-generation-launcher"),
    (["text-generation-server", "serve", "m"], "text-generation-server"),
    (["llama-server", "-m", "model.gguf"], "llama-server"),
    (["lmdeploy", "serve", "api_server", "m"], "lmdeploy"),
    (["vllm", "bench", "serve"], None),  # a client, not the engine
    (["ollama", "pull", "llama3"], None),
    (["python", "-m", "sglang.bench_serving"], None),
    (["python", "train.py", "-m", "vllm.yaml"], None),  # the script's own -m
    (["python", "serve.py"], None),
    (["python", "-m", "uvicorn", "app:app"], None),
    (["./vllm.py"], None),
    ([], None),
    # behind wrappers: the command they run
    (["env", "CUDA_VISIBLE_DEVICES=0", "-u", "HF_TOKEN", "vllm", "serve", "m"], "vllm"),
    (["/usr/bin/env", "-i", "PATH=/usr/bin", "python3", "-m", "sglang.launch_server"], "sglang.launch_server"),
    (["uv", "run", "--with", "vllm", "--python", "3.12", "vllm", "serve", "m"], "vllm"),
    (["uv", "run", "--", "python", "-m", "vllm.entrypoints.openai.api_server"], "vllm.entrypoints.openai.api_server"),
    (["uvx", "--from", "vllm==0.11", "vllm", "serve", "m"], "vllm"),
    (["conda", "run", "-n", "serve", "--no-capture-output", "text-generation-launcher"], "text-generation-launcher"),
    (["poetry", "run", "lmdeploy", "serve", "api_server", "m"], "lmdeploy"),
    (["sudo", "-u", "svc", "-E", "nohup", "nice", "-n", "5", "llama-server", "-m", "x.gguf"], "llama-server"),
    (["numactl", "--cpunodebind=0", "-m", "0", "taskset-less", "vllm", "serve"], None),  # an unknown program
    (["numactl", "--cpunodebind=0", "-m", "0", "vllm", "serve", "m"], "vllm"),
    (["mpirun", "-n", "4", "--allow-run-as-root", "--mca", "btl", "^openib", "trtllm-serve", "m"], "trtllm-serve"),
    (["bash", "-c", "pip install -q x && HF_HOME=/m exec vllm serve m --port 8000"], "vllm"),
    (["/bin/sh", "-ec", "set -x; python3 -m sglang.launch_server --model-path m"], "sglang.launch_server"),
    (["bash", "-o", "pipefail", "-lc", "ollama serve | tee log"], "ollama"),
    (["bash", "--login", "-c", "cd /app && exec python3 -m vllm.entrypoints.openai.api_server 2>&1"],
     "vllm.entrypoints.openai.api_server"),
    (["timeout", "-k", "10", "2h", "taskset", "-c", "0-7", "vllm", "serve", "m"], "vllm"),
    (["taskset", "0x3", "llama-server"], "llama-server"),
    # wrappers of things that are no engine
    (["env", "VLLM=1", "python", "serve.py"], None),
    (["uv", "run", "vllm", "bench", "serve"], None),
    (["uv", "pip", "install", "vllm"], None),
    (["bash", "-c", "echo vllm serve"], None),  # the words are an argument
    (["bash", "serve.sh", "-c", "vllm serve"], None),  # a script file: its arguments are its own
    (["bash", "-c", "unbalanced 'quote"], None),
    (["sudo", "-u"], None),
    (["env"], None),
    (["timeout", "vllm"], None),  # vllm is the duration here: nothing runs
    # a pod's multi-line script, and shell keywords before a command
    (["sh", "-c", "set -e\ncd /app\nvllm serve m --port 8000\n"], "vllm"),
    (["bash", "-c", "if [ -n \"$X\" ]; then exec python3 -m sglang.launch_server --model-path m; fi"],
     "sglang.launch_server"),
    (["sh", "-c", "echo 'a\nvllm serve'"], None),  # a newline inside quotes is the argument's
    # an engine package's tools are no server
    (["python", "-m", "vllm", "collect-env"], None),
    (["python", "-m", "vllm", "serve", "m"], "vllm"),
    (["python", "-m", "lmdeploy", "lite", "auto_awq", "m"], None),
    (["python", "-m", "lmdeploy.serve.openai.api_server", "m"], "lmdeploy.serve.openai.api_server"),
    (["python", "-m", "tensorrt_llm.commands.build", "--checkpoint_dir", "c"], None),
    (["python", "-m", "sglang.check_env"], None),
    (["python", "-c", "-m", "vllm"], None),  # code
    (["text-generation-server", "download-weights", "m"], None),
    (["python", "-m", "llama_cpp.server", "--model", "m.gguf"], "llama_cpp.server"),
    (["bash", "+o", "history", "-c", "llama-server -m m.gguf"], "llama-server"),
    (["python", "-m", "vllm.entrypoints.cli.main", "bench", "serve"], None),
    (["python", "-m", "vllm.entrypoints.cli.main", "serve", "m"], "vllm.entrypoints.cli.main"),
])

def test_a_command_line_that_starts_a_serving_engine_is_told(argv: list[str], engine: str | None) -> None:
    from infersight.agent.commands.engine_cmdline import engine_command

    assert engine_command(argv) == engine


@pytest.mark.parametrize("argv", [
    ["bash", *["-o", "x"] * 2000, "-c", "vllm serve m"],  # no recursion to run out of
    ["python", None], ["bash", None], ["python", b"-u"], [None], ["env", *["A=1"] * 100000, "vllm", "serve"],
])
def test_a_command_line_that_cannot_be_read_is_no_engine_and_raises_nothing(argv: list[object]) -> None:
    from infersight.agent.commands.engine_cmdline import engine_command

    assert engine_command(argv) in (None, "vllm")
