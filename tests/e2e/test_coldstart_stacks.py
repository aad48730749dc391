"""Real serving stacks under ``infersight launch``, with no infersight call in them: at least
95% of each cold start is covered by named stages (unattributed gaps do not count), the
stages they should show are there, helpers are marked and print nothing, and a CPU build
shows no ``cuda_init``. Models are tiny, built from configs with random weights and saved
locally once per session (``workloads/stack_models.py``); nothing is downloaded."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import HERE, LaunchRun, launch, stage_name  # noqa: E402

from infersight.agent.commands.show import coldstarts  # noqa: E402
from infersight.coldstart_stages import tree_coverage  # noqa: E402
from infersight.exporters.waterfall import coverage, is_helper  # noqa: E402
from infersight.telemetry import ColdStart  # noqa: E402

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

pytestmark = [pytest.mark.slow, pytest.mark.torch]

MIN_COVERAGE = 0.95
STACKS = os.path.join(HERE, "stacks.py")
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
       "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("stack_models"))
    env = dict(os.environ, **ENV)
    env.pop("PYTHONPATH", None)
    subprocess.run([sys.executable, os.path.join(HERE, "stack_models.py"), out], check=True, env=env,
                   capture_output=True, timeout=600)
    return out


def run_stack(tmp: str, argv: list[str], *flags: str, env: dict[str, str] | None = None) -> LaunchRun:
    r = launch(tmp, argv, *flags, result=False, env={**ENV, **(env or {})})
    assert r.rc == 0, r.output[-4000:]
    return r


def served(r: LaunchRun) -> list[ColdStart]:
    """The cold starts of the processes that are not helpers."""
    return [cs for cs in coldstarts(r.spans) if not is_helper(cs)]


def main_coldstart(r: LaunchRun) -> ColdStart:
    roots = [cs for cs in served(r) if cs.root.parent_span_id is None]
    assert len(roots) == 1, [cs.root for cs in roots]
    return roots[0]


def names(cs: ColdStart) -> set[str]:
    return {stage_name(s) for s in cs.stages}


def check_common(r: LaunchRun, cs: ColdStart, figure: Callable[[ColdStart], float] = coverage) -> None:
    """Coverage, no false cuda_init, helpers marked and silent (one waterfall per served process)."""
    cov = figure(cs)
    gaps = [(stage_name(s), (s.end_ns - s.start_ns) / 1e9, s.attributes.get("infersight.unattributed.top"))
            for s in cs.stages if stage_name(s) == "unattributed"]
    assert cov >= MIN_COVERAGE, "coverage %.1f%%, gaps %r" % (100 * cov, gaps)
    for c in coldstarts(r.spans):
        assert "cuda_init" not in names(c), "a cuda_init on a CPU-only build"
    assert r.output.count("infersight cold start:") == len(served(r))
    for c in coldstarts(r.spans):
        if is_helper(c):
            assert c.root.attributes["infersight.process.role"] == "helper"


def test_pipeline(models: str, tmp_path) -> None:
    r = run_stack(str(tmp_path), [sys.executable, STACKS, "pipeline", models])
    cs = main_coldstart(r)
    check_common(r, cs)
    assert {"framework_import", "model_build", "tokenizer_load", "warmup"} <= names(cs)
    imports = [s for s in cs.stages if stage_name(s) == "framework_import"]
    packages = {p.split()[0] for s in imports for p in s.attributes["infersight.import.packages"]}
    assert {"torch", "transformers"} <= packages


def test_causal_lm_generate(models: str, tmp_path) -> None:
    r = run_stack(str(tmp_path), [sys.executable, STACKS, "causal_lm", models])
    cs = main_coldstart(r)
    check_common(r, cs)
    assert {"model_build", "tokenizer_load", "warmup"} <= names(cs)
    build = next(s for s in cs.stages if stage_name(s) == "model_build")
    assert build.attributes["infersight.model.class"] == "GPT2LMHeadModel"
    assert build.attributes["infersight.model.parameters"] > 0


def test_meta_device_load_file_assign(models: str, tmp_path) -> None:
    r = run_stack(str(tmp_path), [sys.executable, STACKS, "meta_load_file", models])
    cs = main_coldstart(r)
    check_common(r, cs)
    build = [s for s in cs.stages if stage_name(s) == "model_build"]
    assert build and build[0].attributes.get("infersight.model.meta") is True
    assert "weights_load" in names(cs)


def test_random_init_torch_load_mmap(models: str, tmp_path) -> None:
    r = run_stack(str(tmp_path), [sys.executable, STACKS, "torch_load_mmap", models])
    cs = main_coldstart(r)
    check_common(r, cs)
    build = [s for s in cs.stages if stage_name(s) == "model_build"]
    assert build and not build[0].attributes.get("infersight.model.meta")
    assert "weights_load" in names(cs)


def test_torchscript_and_tokenizers(models: str, tmp_path) -> None:
    r = run_stack(str(tmp_path), [sys.executable, STACKS, "torchscript", models])
    cs = main_coldstart(r)
    check_common(r, cs)  # the stack probes CUDA (current_device) on a CPU build: no cuda_init
    apis = {s.attributes.get("infersight.weights.api") for s in cs.stages if stage_name(s) == "weights_load"}
    assert "torch.jit.load" in apis
    toks = [s for s in cs.stages if stage_name(s) == "tokenizer_load"]  # the native Tokenizer.from_file
    assert [s.attributes.get("infersight.tokenizer.api") for s in toks] == ["tokenizers.Tokenizer.from_file"]


def test_fastapi_uvicorn(models: str, tmp_path) -> None:
    from conftest import free_port

    port = free_port()
    # a readiness probe, as deployments have: the time until launch's first successful poll is
    # ready_wait; without it, the server idles from listen() to launch's next retry (up to 0.5 s)
    r = run_stack(str(tmp_path), [sys.executable, STACKS, "fastapi", models, str(port)],
                  "--ready-url", "http://127.0.0.1:%d/health" % port, "--probe", "http://127.0.0.1:%d/" % port)
    cs = main_coldstart(r)
    check_common(r, cs)
    assert {"framework_import", "model_build", "tokenizer_load", "ready_wait", "first_request"} <= names(cs)
    assert cs.root.attributes["infersight.coldstart.ended_by"] == "ready"  # the probe came after readiness
    assert cs.root.attributes["infersight.ready.source"] == "ready_url"


def poke_until_served(port: int, stop: threading.Event) -> None:
    """A client that asks every 20 ms until the server answers (launch --probe backs off to
    0.5 s, which would leave the ready worker idle that long)."""
    while not stop.is_set():
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/" % port, timeout=60) as resp:
                resp.read()
            return
        except OSError:
            stop.wait(0.02)


@pytest.mark.parametrize("loop", [["--loop", "asyncio"], ["--loop", "uvloop"]], ids=["asyncio", "uvloop"])
def test_uvicorn_two_workers(models: str, tmp_path, loop: list[str]) -> None:
    """On both loops: under uvloop the socket is opened in C, and readiness comes from the
    kernel's listening sockets."""
    if loop[1] == "uvloop":
        pytest.importorskip("uvloop")
    from conftest import free_port

    port = free_port()
    stop = threading.Event()
    client = threading.Thread(target=poke_until_served, args=(port, stop), daemon=True)
    client.start()
    try:
        r = run_stack(str(tmp_path), [sys.executable, "-m", "uvicorn", "stack_app:app", "--app-dir", HERE,
                                      "--workers", "2", "--port", str(port), "--log-level", "warning", *loop],
                      env={"STACK_MODELS": models, "STACK_STOP_PARENT": "1"})
    finally:
        stop.set()
        client.join(10)
    sup = main_coldstart(r)
    assert sup.root.attributes["infersight.coldstart.ended_by"] == "workers", r.output
    assert len(sup.workers) >= 1
    # the worker that served; the other may be killed while still starting (SIGTERM before
    # uvicorn's handlers): its root, closed by the agent (producer_lost), nests here too
    workers = {w.span_id for w in sup.workers}
    serving = next(cs for cs in served(r) if cs.root.span_id in workers and "first_request" in names(cs))
    assert serving.root.attributes["infersight.coldstart.ended_by"] == "ready"  # the worker listened
    assert {"model_build", "tokenizer_load", "first_request"} <= names(serving)
    check_common(r, sup, tree_coverage)  # the supervisor's wait is its workers' cold start: the tree's figure
    cov = coverage(serving)
    assert cov >= MIN_COVERAGE, "serving worker coverage %.1f%%" % (100 * cov)


def test_torch_compile_inductor(models: str, tmp_path) -> None:
    cache = str(tmp_path / "inductor-cache")
    r = run_stack(str(tmp_path), [sys.executable, STACKS, "compile", models],
                  env={"TORCHINDUCTOR_CACHE_DIR": cache})
    cs = main_coldstart(r)
    check_common(r, cs)
    compiles = [s for s in cs.stages if stage_name(s) == "graph_compile"]
    assert compiles
    assert {s.attributes.get("infersight.compile.backend") for s in compiles} == {"inductor"}
    assert compiles[0].attributes["infersight.compile.cache"] == "miss"  # a fresh cache dir
    # the same program again: inductor's FX graph cache answers
    second = tmp_path / "again"
    second.mkdir()
    r2 = run_stack(str(second), [sys.executable, STACKS, "compile", models],
                   env={"TORCHINDUCTOR_CACHE_DIR": cache})
    again = [s for s in main_coldstart(r2).stages if stage_name(s) == "graph_compile"]
    assert again[0].attributes["infersight.compile.cache"] in ("hit", "mixed")
