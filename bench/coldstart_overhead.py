"""Hooks' added cold-start time: the same workload with hooks against without.

    python bench/coldstart_overhead.py [--runs 5] [--workload examples/demo_serve.py]

Cold start = the workload's spawn -> the moment its first request was served (the
workload prints "demo: served" then exits; we take the process's exit). Without hooks
the workload runs directly; with hooks it runs under ``infersight launch`` and we take
the child's own spawn -> exit from the ``coldstart`` root start and a marker file, so
the embedded agent's own start and flush are not counted. Runs alternate, medians are
compared. DESIGN budget: at most 2% added.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRAPPER = r"""
import json, os, runpy, sys, time
out = sys.argv.pop(1)
script = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    with open(out, "w") as f:
        json.dump({"t_end_ns": time.time_ns()}, f)
"""


def run_plain(python: str, workload: list[str], tmp: str) -> float:
    out = os.path.join(tmp, "plain.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSIGHT") and k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONWARNINGS"] = "ignore"
    t0 = time.time_ns()
    subprocess.run([python, "-c", WRAPPER, out, *workload], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        return (json.load(f)["t_end_ns"] - t0) / 1e9


def run_hooked(python: str, workload: list[str], tmp: str) -> float:
    out = os.path.join(tmp, "hooked.json")
    otlp = os.path.join(tmp, "hooked.otlp.jsonl")
    if os.path.exists(otlp):
        os.unlink(otlp)
    env = dict(os.environ, PYTHONWARNINGS="ignore", INFERSIGHT_MEASURE_STORAGE="0")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # installed interpreters have .pyc files
    cli = os.path.join(os.path.dirname(python), "infersight")
    subprocess.run([cli, "launch", "--no-console", "--otlp-file", otlp, "--", python, "-c", WRAPPER, out,
                    *workload], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start = None
    with open(otlp) as f:
        for line in f:
            for rs in json.loads(line).get("resourceSpans", []):
                for ss in rs["scopeSpans"]:
                    for s in ss["spans"]:
                        if s["name"] == "coldstart":
                            start = int(s["startTimeUnixNano"])
    with open(out) as f:
        end = json.load(f)["t_end_ns"]
    assert start is not None, "no coldstart root"
    return (end - start) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--workload", default=os.path.join(ROOT, "examples", "demo_serve.py"))
    args, rest = ap.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "weights")
        os.makedirs(weights)
        workload = [args.workload, *(rest or ["--weights-dir", weights])]
        run_plain(args.python, workload, tmp)  # writes the weights, warms the page cache
        run_hooked(args.python, workload, tmp)  # writes the hooks' .pyc files
        plain, hooked = [], []
        for i in range(args.runs):
            for kind in ((0, 1) if i % 2 == 0 else (1, 0)):
                if kind == 0:
                    plain.append(run_plain(args.python, workload, tmp))
                else:
                    hooked.append(run_hooked(args.python, workload, tmp))
    mp, mh = statistics.median(plain), statistics.median(hooked)
    print("workload: %s" % " ".join(workload[:1]))
    print("runs: %d each, interleaved" % args.runs)
    print("without hooks: median %.3f s  (%s)" % (mp, ", ".join("%.3f" % x for x in plain)))
    print("with hooks:    median %.3f s  (%s)" % (mh, ", ".join("%.3f" % x for x in hooked)))
    print("ratio with/without: %.4f  (added %+.1f%%, %+.0f ms; budget <= 2%%)"
          % (mh / mp, 100.0 * (mh / mp - 1), 1000 * (mh - mp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
