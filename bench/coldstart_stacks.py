"""Real serving stacks: how much of their cold start is named, and what launch adds.

    python bench/coldstart_stacks.py [--runs 3] [--size medium] [--stacks a,b] [--compile]

Models come from ``tests/support/workloads/stack_models.py`` (random weights, saved locally;
``medium`` is a ~41M-parameter BERT and GPT-2 like the stacks in issue 11). For each stack,
alternating in one run:

- **plain**: ``python stacks.py STACK`` (no hooks);
- **launched**: ``infersight launch -- python stacks.py STACK``;
- **no sampler**: launched with ``INFERSIGHT_SAMPLER=0``;
- **hooks only**: the bootstrap on PYTHONPATH, no launcher and no agent (events go to a
  throwaway spool): what the hooks alone add, apart from the launcher's own start.

Printed per stack: medians of the wall times (spawn to exit), the hooks' overhead
(hooks only / plain), launch's (launched / plain), the sampler's (launched / no sampler), the coverage of the served
process's cold start by named stages (unattributed gaps excluded) and the biggest gap
with the sampler's top. Servers (``fastapi``, ``workers``) get one GET from this script,
retried until it answers, in every variant.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = os.path.join(ROOT, "tests", "support", "workloads")
STACKS_PY = os.path.join(WORKLOADS, "stacks.py")
INFERSIGHT = os.path.join(os.path.dirname(sys.executable), "infersight")
sys.path.insert(0, os.path.dirname(ROOT))

from infersight.agent.commands.show import coldstarts, spans_from_lines  # noqa: E402
from infersight.coldstart_stages import tree_coverage  # noqa: E402
from infersight.exporters.waterfall import is_helper  # noqa: E402

DEFAULT = ["pipeline", "causal_lm", "meta_load_file", "torch_load_mmap", "torchscript", "fastapi", "workers"]
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
       "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def argv_for(stack: str, models: str, port: int) -> tuple[list[str], dict[str, str]]:
    if stack == "fastapi":
        return [sys.executable, STACKS_PY, "fastapi", models, str(port)], {}
    if stack == "workers":
        return ([sys.executable, "-m", "uvicorn", "stack_app:app", "--app-dir", WORKLOADS, "--workers", "2",
                 "--port", str(port), "--log-level", "warning"],
                {"STACK_MODELS": models, "STACK_STOP_PARENT": "1"})
    return [sys.executable, STACKS_PY, stack, models], {}


def poke(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    """GET / until the server answers (or the process is gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/")
            conn.getresponse().read()
            conn.close()
            return
        except OSError:
            time.sleep(0.05)


def run_once(stack: str, models: str, variant: str, tmp: str) -> tuple[float, float | None, str]:
    port = free_port()
    argv, extra = argv_for(stack, models, port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSIGHT") and k != "PYTHONPATH"}
    env.update(ENV)
    env.update(extra)
    env["XDG_CACHE_HOME"] = os.path.join(tmp, "cache")
    env["INFERSIGHT_MEASURE_STORAGE"] = "0"
    otlp = os.path.join(tmp, "%s-%s-%d.otlp.jsonl" % (stack, variant, time.monotonic_ns()))
    if variant == "hooks_only":
        env.update({"PYTHONPATH": os.path.join(ROOT, "hooks", "bootstrap"), "INFERSIGHT_EXIT_FLUSH_S": "0",
                    "INFERSIGHT_SOCKET": os.path.join(tmp, "absent.sock"),
                    "INFERSIGHT_SPOOL_DIR": os.path.join(tmp, "spool-%d" % time.monotonic_ns())})
    elif variant != "plain":
        argv = [INFERSIGHT, "launch", "--no-console", "--otlp-file", otlp, "--", *argv]
        if variant == "no_sampler":
            env["INFERSIGHT_SAMPLER"] = "0"
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if stack in ("fastapi", "workers"):
        poke(port, proc)
    rc = proc.wait(timeout=900)
    wall = time.monotonic() - t0
    if rc != 0:
        raise SystemExit("%s (%s) exited with %d" % (stack, variant, rc))
    if variant in ("plain", "hooks_only"):
        return wall, None, ""
    with open(otlp, encoding="utf-8") as f:
        spans = spans_from_lines(f.readlines())
    served = [cs for cs in coldstarts(spans) if not is_helper(cs)]
    main = next(cs for cs in served if cs.root.parent_span_id is None)
    gaps = sorted((s for s in main.stages if s.attributes.get("infersight.stage") == "unattributed"),
                  key=lambda s: s.start_ns - s.end_ns)
    gap = ""
    if gaps:
        g = gaps[0]
        gap = "%.3f s: %s" % ((g.end_ns - g.start_ns) / 1e9, ", ".join(
            g.attributes.get("infersight.unattributed.top") or ["no samples"]))  # type: ignore[arg-type]
    # a process's own figure; a supervisor's is its tree's (its workers' named stages)
    covs = [tree_coverage(cs) for cs in served if cs.root.parent_span_id is None or cs.root.attributes.get(
        "infersight.coldstart.ended_by") == "first_request"]
    return wall, min(covs), gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", choices=("tiny", "medium"), default="medium")
    ap.add_argument("--stacks", default=",".join(DEFAULT))
    ap.add_argument("--compile", action="store_true", help="add the torch.compile stack (minutes on a small CPU)")
    ap.add_argument("--models", help="reuse a models directory built by stack_models.py")
    args = ap.parse_args()
    stacks = [s for s in args.stacks.split(",") if s] + (["compile"] if args.compile else [])
    with tempfile.TemporaryDirectory() as tmp:
        models = args.models or os.path.join(tmp, "models")
        if not args.models:
            t0 = time.monotonic()
            env = dict(os.environ, **ENV)
            env.pop("PYTHONPATH", None)
            subprocess.run([sys.executable, os.path.join(WORKLOADS, "stack_models.py"), models, args.size],
                           check=True, env=env, capture_output=True)
            print("built %s models in %.1f s" % (args.size, time.monotonic() - t0))
        print("%-16s %8s %8s %8s %8s %7s %7s %7s %8s  %s" % (
            "stack", "plain s", "hooks s", "launch s", "no-smp s", "hooks", "launch", "sampler", "coverage",
            "biggest gap (sampler top)"))
        results = {}
        for stack in stacks:
            walls: dict[str, list[float]] = {"plain": [], "hooks_only": [], "launched": [], "no_sampler": []}
            covs: list[float] = []
            gap = ""
            run_once(stack, models, "plain", tmp)  # page cache and .pyc files warm for every variant
            for _ in range(args.runs):
                for variant in ("plain", "hooks_only", "launched", "no_sampler"):
                    wall, cov, g = run_once(stack, models, variant, tmp)
                    walls[variant].append(wall)
                    if variant == "launched" and cov is not None:
                        covs.append(cov)
                        gap = g or gap
            p, hk, lch, ns = (statistics.median(walls[v]) for v in ("plain", "hooks_only", "launched", "no_sampler"))
            cov = statistics.median(covs)
            results[stack] = {"plain_s": p, "hooks_only_s": hk, "launched_s": lch, "no_sampler_s": ns,
                              "coverage": cov}
            print("%-16s %8.3f %8.3f %8.3f %8.3f %+6.1f%% %+6.1f%% %+6.1f%% %7.1f%%  %s" % (
                stack, p, hk, lch, ns, 100 * (hk / p - 1), 100 * (lch / p - 1), 100 * (lch / ns - 1), 100 * cov,
                gap[:100]))
        print(json.dumps(results))


if __name__ == "__main__":
    main()
