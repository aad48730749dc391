"""What the cold-start hooks cost the served process, measured side by side in one run.

    python bench/coldstart_hooks.py [--runs 7] [--modules 400]

1. **Import timing**, per import: fresh processes import MODULES tiny modules, hooked
   (bootstrap on PYTHONPATH, no agent: events go to a throwaway spool) against plain:
   - as outermost imports (each one is timed: the loader is wrapped);
   - as submodules imported by their package (the finder's fast path: one set lookup
     and a split);
   medians of the in-process import time, difference per import in microseconds.
2. **The stack sampler**: one process runs the same CPU-bound pure-Python work with the
   sampler thread running and stopped, alternating; ratio of the medians (budget: the
   sampler costs at most 1% of the cold start).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOT = os.path.join(ROOT, "hooks", "bootstrap")
sys.path.insert(0, os.path.dirname(ROOT))

IMPORTER = """
import importlib, sys, time
n, kind = int(sys.argv[1]), sys.argv[2]
t0 = time.perf_counter()
if kind == "outermost":
    for i in range(n):
        importlib.import_module("top%d" % i)
else:
    import nested_pkg
t1 = time.perf_counter()
print(t1 - t0)
"""


def make_tree(tmp: str, n: int) -> None:
    for i in range(n):
        with open(os.path.join(tmp, "top%d.py" % i), "w") as f:
            f.write("X = %d\n" % i)
    pkg = os.path.join(tmp, "nested_pkg")
    os.makedirs(pkg, exist_ok=True)
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write("".join("from . import m%d\n" % i for i in range(n)))
    for i in range(n):
        with open(os.path.join(pkg, "m%d.py" % i), "w") as f:
            f.write("X = %d\n" % i)
    with open(os.path.join(tmp, "importer.py"), "w") as f:
        f.write(IMPORTER)


def env_for(tmp: str, hooked: bool) -> dict[str, str]:
    drop = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSIGHT") and k not in drop}
    env.update({"INFERSIGHT_SOCKET": os.path.join(tmp, "absent.sock"),
                "INFERSIGHT_SPOOL_DIR": os.path.join(tmp, "spool"),
                "INFERSIGHT_EXIT_FLUSH_S": "0", "INFERSIGHT_SAMPLER": "0"})
    env["PYTHONPATH"] = (BOOT + os.pathsep + tmp) if hooked else tmp
    return env


def import_seconds(tmp: str, n: int, kind: str, hooked: bool) -> float:
    p = subprocess.run([sys.executable, os.path.join(tmp, "importer.py"), str(n), kind], env=env_for(tmp, hooked),
                       capture_output=True, text=True, check=True, cwd=tmp)
    return float(p.stdout.strip().splitlines()[-1])


def bench_imports(runs: int, n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        make_tree(tmp, n)
        for kind in ("outermost", "nested"):  # compile the .pyc files first
            import_seconds(tmp, n, kind, False)
        for kind in ("outermost", "nested"):
            plain, hooked = [], []
            for _ in range(runs):
                plain.append(import_seconds(tmp, n, kind, False))
                hooked.append(import_seconds(tmp, n, kind, True))
            p, h = statistics.median(plain), statistics.median(hooked)
            print("imports (%-9s) %d modules: plain %.2f ms, hooked %.2f ms: %+.1f us per import (%.2fx)" % (
                kind, n, p * 1e3, h * 1e3, (h - p) / n * 1e6, h / p))


def work(n: int = 200_000) -> int:
    total = 0
    for i in range(n):
        total += (i * 7) % 13
    return total


def bench_sampler(runs: int) -> None:
    import threading

    from infersight.hooks import _sampler

    main = threading.get_ident()
    on: list[float] = []
    off: list[float] = []
    work()
    for _ in range(runs * 3):
        t0 = time.perf_counter()
        work()
        off.append(time.perf_counter() - t0)
        s = _sampler.Sampler(main)
        s.start()
        time.sleep(0.02)  # the thread is up and sampling
        t0 = time.perf_counter()
        work()
        on.append(time.perf_counter() - t0)
        s.stop()
        n_samples = len(s.samples)
    a, b = statistics.median(off), statistics.median(on)
    print("sampler every %.0f ms: work %.1f ms without, %.1f ms with: %+.2f%% (budget +1%%); %d samples in the last run"
          % (_sampler.INTERVAL_S * 1e3, a * 1e3, b * 1e3, 100 * (b / a - 1), n_samples))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--modules", type=int, default=400)
    args = ap.parse_args()
    bench_imports(args.runs, args.modules)
    bench_sampler(args.runs)


if __name__ == "__main__":
    main()
