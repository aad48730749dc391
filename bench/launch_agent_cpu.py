"""The CPU that ``infersight launch``'s own process spends (its embedded agent) during a cold start.

    python bench/launch_agent_cpu.py [--runs 8] [--work-n 300] [--before TREE]

``infersight launch --no-console -- python -c "[sum(range(10**6)) for _ in range(N)]"``
(CMD runs with the hooks, so the agent receives a real cold start), run in a wrapper that
writes, at launch's exit, ``getrusage`` of launch's own process (all its threads: the
cheap half, the agent side's import, the agent) and of its children (CMD). The launch
process's CPU is what competes with CMD's start on a busy host.

``--before TREE``: the same launch from another source tree (``git archive REV | tar -x -C
TREE``), run in alternating order with this tree's, in the same run: before/after side by
side. TREE's packages are put first on ``sys.path`` by a folder of links that maps them into
the ``infersight`` namespace as the editable install does for this tree.
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

WRAP = r"""
import json, resource, sys, time
from infersight.agent.cli import main
t0 = time.perf_counter()
try:
    rc = main(sys.argv[2:])
finally:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(sys.argv[1], "w") as f:
        json.dump({"self": s.ru_utime + s.ru_stime, "cmd": c.ru_utime + c.ru_stime,
                   "wall": time.perf_counter() - t0}, f)
sys.exit(rc)
"""

PACKAGES = {"agent": "agent", "exporters": "exporters", "hooks": "hooks", "rules": "rules"}


def link_tree(tree: str, into: str) -> str:
    """A folder whose ``infersight`` package is TREE's (infersight/ plus agent, exporters,
    hooks, rules as its subpackages, as pyproject's package-dir maps them)."""
    pkg = os.path.join(into, "infersight")
    os.makedirs(pkg)
    for name in os.listdir(os.path.join(tree, "infersight")):
        os.symlink(os.path.join(tree, "infersight", name), os.path.join(pkg, name))
    for sub, folder in PACKAGES.items():
        os.symlink(os.path.join(tree, folder), os.path.join(pkg, sub))
    return into


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("INFERSIGHT", "OTEL_", "PYTHONPATH")) and k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONWARNINGS="ignore", INFERSIGHT_MEASURE_STORAGE="0")
    return env


def one(wrap: str, out: str, otlp: str, work_n: int, pythonpath: str | None) -> dict[str, float]:
    env = clean_env()
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-c", "[sum(range(10**6)) for _ in range(%d)]" % work_n]
    subprocess.run([sys.executable, wrap, out, "launch", "--agent", "embedded", "--no-console", "--otlp-file", otlp,
                    "--", *cmd], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        r: dict[str, float] = json.load(f)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8, help="runs of each variant (alternating)")
    ap.add_argument("--work-n", type=int, default=300, help="CMD's work: N x sum(range(10**6)) (300: ~4 s here)")
    ap.add_argument("--before", metavar="TREE", help="another source tree to compare, side by side")
    args = ap.parse_args()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="launch-cpu-") as tmp:
        wrap = os.path.join(tmp, "wrap.py")
        with open(wrap, "w") as f:
            f.write(WRAP)
        variants: list[tuple[str, str | None]] = [("this tree", None)]
        if args.before:
            variants.insert(0, ("before", link_tree(os.path.abspath(args.before), os.path.join(tmp, "before"))))
        results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in variants}
        for _name, path in variants:  # warm .pyc files and the page cache
            one(wrap, os.path.join(tmp, "r.json"), os.path.join(tmp, "o.jsonl"), 10, path)
        t0 = time.monotonic()
        for i in range(args.runs):
            for name, path in variants if i % 2 == 0 else variants[::-1]:
                results[name].append(one(wrap, os.path.join(tmp, "r.json"), os.path.join(tmp, "o.jsonl"),
                                         args.work_n, path))
        load1 = os.getloadavg()
    for name, rs in results.items():
        print("%-10s launch process CPU median %.3f s (min %.3f, max %.3f); CMD CPU median %.3f s; wall median %.3f s"
              % (name, statistics.median(r["self"] for r in rs), min(r["self"] for r in rs),
                 max(r["self"] for r in rs), statistics.median(r["cmd"] for r in rs),
                 statistics.median(r["wall"] for r in rs)))
        print("           launch CPU / CMD CPU: median %.3f" % statistics.median(r["self"] / r["cmd"] for r in rs))
    if args.before:
        pairs = [a["self"] / b["self"] for a, b in zip(results["this tree"], results["before"], strict=True)]
        print("this tree / before, launch process CPU: median of %d paired ratios %.3f (%s)"
              % (len(pairs), statistics.median(pairs), " ".join("%.2f" % p for p in pairs)))
    print("%d runs in %.0f s; load average (1 min) at start %.2f, at end %.2f"
          % (sum(len(r) for r in results.values()), time.monotonic() - t0, load0[0], load1[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
