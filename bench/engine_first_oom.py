"""The first memory error of a serving engine under ``infersight launch``: from the engine's log call to
the classified record in launch's OTLP file.

    python bench/engine_first_oom.py [--runs 8] [--other-pkg DIR]

A stand-in engine (a package named ``vllm`` with the module and class that vLLM's stage rule
``vllm.load_model`` watches, no torch; its import takes 0.2 s, real vLLM's seconds) loads its "weights",
profiles for 0.5 s, then logs vLLM's
"No available memory for the cache blocks" through ``logging`` and stays up (no exit ends anything
early). Two ways to start the same engine, alternating:

- ``engine``: ``python -m vllm.entrypoints.openai.api_server``: a command line that names an engine,
  so launch does not hold its agent back and loads the OOM rules at once;
- ``script``: ``python serve.py`` running the same code: launch holds its agent back until the
  hooks ring its doorbell when ``vllm``'s import ends (before, until the OOM's doorbell: the agent's start, the
  spool's replay and the rules' load came after the OOM);
- ``multiproc``: ``python serve_mp.py``, a server process that starts the same code as an engine core in a
  spawned process (as vLLM's EngineCore and SGLang's scheduler run): the second hooked process ends the hold,
  and the rules load when the core's import of ``vllm`` or its first stage reaches the agent.

``--other-pkg DIR``: one more row, ``--other-mode`` (``script`` by default) again with another tree's
infersight (DIR holds an ``infersight`` package laid out as installed, e.g. from ``git archive``), in the
same rounds.

This process stamps the record when it appears in the file (poll: 1 ms). Prints the median and
worst latency of each. DESIGN's budget: OOM to classified result exported under 100 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNNER = """
import time


class GPUModelRunner:
    def load_model(self):
        time.sleep(0.05)
"""

ENGINE = """
import logging, os, time
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

GPUModelRunner().load_model()
time.sleep(0.5)
t = time.time_ns()
logging.getLogger("vllm.v1.engine.core").error(
    "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
    "initializing the engine.")
open(os.environ["STAMP"], "w").write(str(t))
time.sleep(float(os.environ.get("STAY_S", "3")))
"""


SERVER = """
import multiprocessing as mp


if __name__ == "__main__":
    core = mp.get_context("spawn").Process(target=__import__, args=("engine_core",))
    core.start()
    core.join()
"""


IMPORT_S = 0.2  # the stand-in's import: real vLLM's (torch, transformers...) takes seconds


def lay_out(root: Path) -> None:
    pkg = root / "vllm"
    for sub in ("", "v1", "v1/worker", "entrypoints", "entrypoints/openai"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(f"import time\ntime.sleep({IMPORT_S})\n")
    (pkg / "v1" / "worker" / "gpu_model_runner.py").write_text(RUNNER)
    (pkg / "entrypoints" / "openai" / "api_server.py").write_text(ENGINE)
    (root / "serve.py").write_text(ENGINE)
    (root / "engine_core.py").write_text(ENGINE)
    (root / "serve_mp.py").write_text(SERVER)


def oom_in(path: Path) -> bool:
    try:
        text = path.read_text()
    except OSError:
        return False
    return '"eventName": "oom"' in text or '"eventName":"oom"' in text


def one(root: Path, mode: str, i: int, other: str | None = None, other_mode: str = "script") -> float | None:
    out, stamp = root / f"{mode}{i}.otlp.jsonl", root / f"{mode}{i}.stamp"
    cmds = {"script": ["serve.py"], "multiproc": ["serve_mp.py"]}
    cmd = cmds.get(other_mode if mode == "other" else mode, ["-m", "vllm.entrypoints.openai.api_server"])
    path = os.pathsep.join([other, str(root)]) if mode == "other" and other else str(root)
    env = dict(os.environ, PYTHONPATH=path, STAMP=str(stamp))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    p = subprocess.Popen([sys.executable, "-m", "infersight", "launch", "--no-console", "--otlp-file", str(out),
                          "--", sys.executable, *cmd], cwd=root, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and p.poll() is None:
        if oom_in(out):
            seen = time.time_ns()
            break
        time.sleep(0.001)
    p.wait(60)
    if seen is None or not stamp.exists():
        return None
    return (seen - int(stamp.read_text())) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--other-pkg", default=None)
    ap.add_argument("--other-mode", default="script", choices=("engine", "script", "multiproc"))
    args = ap.parse_args()
    res: dict[str, list[float]] = {"engine": [], "script": [], "multiproc": []}
    if args.other_pkg:
        res["other"] = []
    with tempfile.TemporaryDirectory(prefix="isf-") as d:
        root = Path(d)
        lay_out(root)
        for i in range(args.runs):
            modes = list(res)
            for mode in (modes if i % 2 == 0 else modes[::-1]):
                ms = one(root, mode, i, args.other_pkg, args.other_mode)
                if ms is not None:
                    res[mode].append(ms)
    for mode, xs in res.items():
        if xs:
            print(f"{mode:7} n={len(xs)}  median {statistics.median(xs):7.1f} ms  worst {max(xs):7.1f} ms  "
                  f"all {json.dumps([round(x, 1) for x in sorted(xs)])}")
        else:
            print(f"{mode:7} no record")


if __name__ == "__main__":
    main()
