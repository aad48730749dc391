"""Import cost of the hooks' bootstrap (sitecustomize -> infersight.hooks -> activation).

    python bench/import_cost.py [--runs 15] [--python PY]

Two figures, medians over alternating runs:
- ``python -X importtime``: the cumulative microseconds of the ``sitecustomize`` line;
- wall time of ``python -c pass`` with the bootstrap on PYTHONPATH against without;
- the sitecustomize figure again with the stage rules off (``INFERSIGHT_STAGE_RULES=0``), side by
  side: what reading rules/stages.toml and watching its modules adds to every hooked process.
No agent listens (the socket path does not exist), so the client spools nothing until
an event is emitted: this is the cost every hooked process pays before user code runs.
DESIGN budget: under 20 ms.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOT = os.path.join(ROOT, "hooks", "bootstrap")


def env_for(tmp: str, hooked: bool, stage_rules: bool = True) -> dict[str, str]:
    # PYTHONDONTWRITEBYTECODE would compile every module from source on every start,
    # which is not what an installed interpreter does: measure with .pyc files.
    drop = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSIGHT") and k not in drop}
    env.update({"INFERSIGHT_SOCKET": os.path.join(tmp, "absent.sock"), "INFERSIGHT_SPOOL_DIR": tmp,
                "INFERSIGHT_EXIT_FLUSH_S": "0"})
    if hooked:
        env["PYTHONPATH"] = BOOT
    if not stage_rules:
        env["INFERSIGHT_STAGE_RULES"] = "0"
    return env


def importtime_us(python: str, tmp: str, stage_rules: bool = True) -> int:
    p = subprocess.run([python, "-X", "importtime", "-c", "pass"], env=env_for(tmp, True, stage_rules),
                       capture_output=True, text=True, check=True)
    for line in p.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|\s+sitecustomize$", line)
        if m:
            return int(m.group(1))
    raise SystemExit("no sitecustomize line: is the bootstrap on PYTHONPATH?\n" + p.stderr[-2000:])


def wall_s(python: str, tmp: str, hooked: bool) -> float:
    t0 = time.perf_counter()
    subprocess.run([python, "-c", "pass"], env=env_for(tmp, hooked), check=True)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        importtime_us(args.python, tmp)  # writes the .pyc files
        imp, plain, hooked, no_rules = [], [], [], []
        for _ in range(args.runs):
            imp.append(importtime_us(args.python, tmp))
            no_rules.append(importtime_us(args.python, tmp, stage_rules=False))
            plain.append(wall_s(args.python, tmp, False))
            hooked.append(wall_s(args.python, tmp, True))
    mi, mp, mh = statistics.median(imp), statistics.median(plain), statistics.median(hooked)
    print("python: %s" % args.python)
    print("-X importtime, sitecustomize cumulative: median %.1f ms (min %.1f, max %.1f; budget < 20 ms)"
          % (mi / 1000, min(imp) / 1000, max(imp) / 1000))
    mn = statistics.median(no_rules)
    print("stage rules: sitecustomize median %.1f ms with, %.1f ms without (INFERSIGHT_STAGE_RULES=0): "
          "ratio %.2f" % (mi / 1000, mn / 1000, mi / mn))
    print("python -c pass: without %.1f ms, with bootstrap %.1f ms: ratio %.2f, added %.1f ms"
          % (1000 * mp, 1000 * mh, mh / mp, 1000 * (mh - mp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
