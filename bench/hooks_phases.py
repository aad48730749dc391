"""Where the hooks' cost falls in a cold start: the main thread's CPU by phase, side by side.

    python bench/hooks_phases.py [--rounds 20] [--iters 0] [--env NAME:K=V ...]

Each run is the transformers workload of ``launch_overhead.py`` timed from inside the process
with ``time.thread_time()`` (the main thread's CPU, which the machine's other load moves far
less than wall time): ``import torch; from transformers import BertModel``, then
``from_pretrained`` and one forward, then ``--iters`` fixed matmuls. Variants run in rotating
order within each round: ``plain``, ``hooks`` (the bootstrap on PYTHONPATH, no agent: they
spool to a temporary directory), and ``--env NAME:K=V[,K=V]`` adds a copy of ``hooks`` with
those variables (``nosampler:INFERSIGHT_SAMPLER=0``, ``off:INFERSIGHT=0``). Printed: each
phase's median CPU and, per variant, the median of the paired differences to ``plain`` in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from launch_overhead import MAKE_MODEL, clean_env  # bench/ is on sys.path when run as a script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOT = os.path.join(ROOT, "hooks", "bootstrap")
PHASES = ("imports", "load+forward", "matmuls")

WORKLOAD = r"""
import json, sys, time
T = [time.thread_time()]
import torch
from transformers import BertModel
T.append(time.thread_time())
model = BertModel.from_pretrained(sys.argv[1])
with torch.no_grad():
    model(torch.ones(1, 32, dtype=torch.long))
T.append(time.thread_time())
a = torch.randn(256, 256)
for _ in range(int(sys.argv[2])):
    a = torch.tanh(a @ a)
T.append(time.thread_time())
print(json.dumps([T[i + 1] - T[i] for i in range(3)]))
"""


def base_env() -> dict[str, str]:
    """launch_overhead's environment, without a PYTHONPATH or a trace of the caller's."""
    return {k: v for k, v in clean_env().items() if k not in ("PYTHONPATH", "TRACEPARENT")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--iters", type=int, default=0, help="fixed matmuls after the forward (0: none)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME:K=V[,K=V]")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hooks-phases-") as tmp:
        script, model = os.path.join(tmp, "workload.py"), os.path.join(tmp, "model")
        with open(script, "w") as f:
            f.write(WORKLOAD)
        subprocess.run([sys.executable, "-c", MAKE_MODEL, model], check=True, env=base_env(),
                       capture_output=True)
        hooks = {"PYTHONPATH": BOOT, "INFERSIGHT_SOCKET": os.path.join(tmp, "absent.sock"),
                 "INFERSIGHT_SPOOL_DIR": os.path.join(tmp, "spool")}
        variants: dict[str, dict[str, str]] = {"plain": {}, "hooks": hooks}
        for spec in args.env:
            name, _, pairs = spec.partition(":")
            variants[name] = dict(hooks, **dict(p.split("=", 1) for p in pairs.split(",") if "=" in p))
        names = list(variants)
        got: dict[str, list[list[float]]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                p = subprocess.run([sys.executable, script, model, str(args.iters)], env={**base_env(),
                                   **variants[name]}, capture_output=True, text=True, cwd=tmp, check=True)
                got[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
    print("main thread CPU by phase, medians of %d rounds (s): %s" % (args.rounds, ", ".join(PHASES)))
    for name in names:
        print("  %-12s %s" % (name, "  ".join("%.4f" % statistics.median(x[i] for x in got[name])
                                                for i in range(3))))
        if name != "plain":
            print("  %-12s paired difference to plain, median ms: %s" % ("", "  ".join(
                "%+.1f" % (1e3 * statistics.median(a[i] - b[i] for a, b in zip(got[name], got["plain"], strict=True)))
                for i in range(3))))
    print("load average (1 min) at the end %.2f" % os.getloadavg()[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
