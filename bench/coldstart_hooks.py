"""What the cold-start hooks cost the served process, measured side by side in one run.

    python bench/coldstart_hooks.py [--runs 7] [--modules 400]

1. **Import timing**, per import: one hooked process (bootstrap on PYTHONPATH, no agent:
   events go to a throwaway spool) imports fresh tiny modules with the finder in place
   and taken out, alternating rounds of MODULES:
   - as outermost imports (each one is timed: the loader is wrapped);
   - as submodules imported by their package (the finder's fast path: one set lookup
     and a split);
   - as outermost imports inside one ``hooks.stage`` (timed as well: a ``framework_import``
     nested under the stage);
   medians of the rounds, difference per import in microseconds.
2. **The stack sampler**: one process runs the same CPU-bound pure-Python work with the
   sampler thread running and stopped, alternating; ratio of the medians (budget: the
   sampler costs at most 1% of the cold start).
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
BOOT = os.path.join(ROOT, "hooks", "bootstrap")
sys.path.insert(0, os.path.dirname(ROOT))

IMPORTER = """
import importlib, json, sys, time
from infersight import hooks
from infersight.hooks import _coldstart
n, rounds, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
state = _coldstart.state()
assert state.collecting and state.finder in sys.meta_path
finder = state.finder
on, off = [], []
for r in range(rounds):
    for timed in (True, False):
        if not timed:
            sys.meta_path.remove(finder)
        names = ["%s_%s_%d_%d" % (kind, "on" if timed else "off", r, i) for i in range(n)]
        t0 = time.perf_counter()
        if kind == "outermost":
            for name in names:
                importlib.import_module(name)
        elif kind == "instage":
            with hooks.stage("bench_imports"):
                for name in names:
                    importlib.import_module(name)
        else:
            importlib.import_module("pkg_%s_%d" % ("on" if timed else "off", r))
        (on if timed else off).append(time.perf_counter() - t0)
        if not timed:
            sys.meta_path.insert(0, finder)
print(json.dumps({"on": on, "off": off}))
"""


def make_tree(tmp: str, n: int, rounds: int) -> None:
    for r in range(rounds):
        for variant in ("on", "off"):
            for i in range(n):
                for kind in ("outermost", "instage"):
                    with open(os.path.join(tmp, "%s_%s_%d_%d.py" % (kind, variant, r, i)), "w") as f:
                        f.write("X = %d\n" % i)
            pkg = os.path.join(tmp, "pkg_%s_%d" % (variant, r))
            os.makedirs(pkg, exist_ok=True)
            with open(os.path.join(pkg, "__init__.py"), "w") as f:
                f.write("".join("from . import m%d\n" % i for i in range(n)))
            for i in range(n):
                with open(os.path.join(pkg, "m%d.py" % i), "w") as f:
                    f.write("X = %d\n" % i)
    with open(os.path.join(tmp, "importer.py"), "w") as f:
        f.write(IMPORTER)


def env_for(tmp: str) -> dict[str, str]:
    drop = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSIGHT") and k not in drop}
    env.update({"INFERSIGHT_SOCKET": os.path.join(tmp, "absent.sock"),
                "INFERSIGHT_SPOOL_DIR": os.path.join(tmp, "spool"),
                "INFERSIGHT_EXIT_FLUSH_S": "0", "INFERSIGHT_SAMPLER": "0"})
    env["PYTHONPATH"] = BOOT + os.pathsep + tmp
    return env


def bench_imports(runs: int, n: int) -> None:
    """One hooked process imports fresh modules with the finder in place and taken out,
    alternating rounds: the difference is the finder's own cost per import."""
    rounds = max(runs, 3)
    with tempfile.TemporaryDirectory() as tmp:
        make_tree(tmp, n, rounds)
        for kind in ("outermost", "nested", "instage"):
            # a first pass compiles the .pyc files; the second is measured
            for _attempt in range(2):
                p = subprocess.run([sys.executable, os.path.join(tmp, "importer.py"), str(n), str(rounds), kind],
                                   env=env_for(tmp), capture_output=True, text=True, check=True, cwd=tmp)
            out = json.loads(p.stdout.strip().splitlines()[-1])
            on, off = statistics.median(out["on"]), statistics.median(out["off"])
            print("imports (%-9s) %d modules a round: without the finder %.2f ms, with %.2f ms: "
                  "%+.1f us per import (%.2fx)" % (kind, n, off * 1e3, on * 1e3, (on - off) / n * 1e6, on / off))


def work(n: int = 2_000_000) -> int:
    total = 0
    for i in range(n):
        total += (i * 7) % 13
    return total


def bench_sampler(runs: int) -> None:
    """Pairs of the same work with and without the sampler thread, in alternating order.

    Two figures: the sampler thread's own CPU time as a share of the run's wall time (its
    cost to a machine with a core to spare), and the median of the per-pair wall-time
    ratios, which also holds the GIL hand-offs. On a loaded machine the second is noisy
    both ways (a process with two runnable threads gets more of the scheduler's time)."""
    import threading

    from infersight.hooks import _sampler

    main = threading.get_ident()

    def timed(with_sampler: bool) -> tuple[float, float, int]:
        s = None
        if with_sampler:
            s = _sampler.Sampler(main)
            s.start()
        c0, m0 = time.process_time(), time.thread_time()
        t0 = time.perf_counter()
        work()
        dt = time.perf_counter() - t0
        other_cpu = (time.process_time() - c0) - (time.thread_time() - m0)
        if s is not None:
            s.stop()
            return dt, other_cpu, len(s.samples)
        return dt, other_cpu, 0

    work()
    ratios: list[float] = []
    cpu_share: list[float] = []
    base: list[float] = []
    samples = 0
    for i in range(runs * 3):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {flag: timed(flag) for flag in order}
        ratios.append(got[True][0] / got[False][0])
        # the sampler's CPU beyond what other threads (the hooks' client) used without it
        cpu_share.append(max(0.0, got[True][1] - got[False][1]) / got[True][0])
        base.append(got[False][0])
        samples += got[True][2]
    med = statistics.median(ratios)
    print("sampler every %.0f ms: work %.1f ms, %d pairs, %.1f samples a run: its own CPU %.2f%% of the wall time; "
          "wall ratio %.4f (%+.2f%%); budget +1%%" % (
              _sampler.INTERVAL_S * 1e3, statistics.median(base) * 1e3, len(ratios), samples / len(ratios),
              100 * statistics.median(cpu_share), med, 100 * (med - 1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--modules", type=int, default=200)
    args = ap.parse_args()
    bench_imports(args.runs, args.modules)
    bench_sampler(args.runs)


if __name__ == "__main__":
    main()
