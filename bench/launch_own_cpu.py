"""What ``infersight launch``'s own process costs in CPU, apart from CMD's: paired against
another package tree's launch.

    python bench/launch_own_cpu.py [--pairs 16] [--work-s 1.5] [--other-launch PACKAGE_DIR]

CMD is a hooked Python process that burns ``--work-s`` seconds of CPU and exits; it notes its
own CPU at its end and its parent's (launch's, ``/proc/PPID/stat``) at the same moment, its
"ready" time. Launch's whole-life CPU is the command's CPU (``getrusage`` of the children:
launch and CMD) less CMD's own, so neither the host's speed nor CMD's work moves it much; the
cold-start bench (``launch_overhead.py``), whose CMD is a 5-7 s transformers start, cannot
resolve a few tens of milliseconds of launch's CPU under the pairs' spread. Both launches run
as ``python -m infersight`` (the other with ``PYTHONPATH=PACKAGE_DIR``: a tree laid out as
installed, e.g. a ``git archive`` of an older revision, see ``launch_overhead.py --help``), in
alternating order, from a temporary directory (``-m`` puts the working directory first on
``sys.path``: a checkout's ``infersight/`` there would shadow ``PYTHONPATH``). Prints the
medians and quartiles of both and of the paired differences.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile

CMD = """
import os, sys, time
t = time.process_time()
while time.process_time() - t < float(sys.argv[2]):
    pass
with open("/proc/%d/stat" % os.getppid()) as f:
    fl = f.read().rsplit(")", 1)[1].split()
with open(sys.argv[1], "w") as f:
    f.write("%f %f" % (time.process_time(), (int(fl[11]) + int(fl[12])) / os.sysconf("SC_CLK_TCK")))
"""


def quartiles(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return "%+.3f/%+.3f/%+.3f" % (q[0], q[1], q[2])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--work-s", type=float, default=1.5, help="CPU seconds CMD burns before it exits")
    ap.add_argument("--other-launch", metavar="PACKAGE_DIR", help="the launch to pair with (else: none)")
    args = ap.parse_args()
    py = sys.executable
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("INFERSIGHT", "OTEL_EXPORTER_OTLP")) and k != "PYTHONDONTWRITEBYTECODE"}
    env["INFERSIGHT_MEASURE_STORAGE"] = "0"
    variants: dict[str, dict[str, str]] = {"launch": {}}
    if args.other_launch:
        variants["other launch"] = {"PYTHONPATH": args.other_launch}
    whole: dict[str, list[float]] = {k: [] for k in variants}
    at_ready: dict[str, list[float]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory(prefix="launch-own-") as tmp:
        script, marker, otlp = (os.path.join(tmp, n) for n in ("cmd.py", "marker", "o.jsonl"))
        with open(script, "w") as f:
            f.write(CMD)
        names = list(variants)
        for i in range(args.pairs + 1):  # the first round warms the page cache and .pyc files
            for name in names if i % 2 else names[::-1]:
                r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                subprocess.run([py, "-m", "infersight", "launch", "--no-console", "--otlp-file", otlp, "--", py,
                                script, marker, str(args.work_s)], env={**env, **variants[name]}, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
                r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                with open(marker) as f:
                    cmd_cpu, parent = (float(x) for x in f.read().split())
                if i:
                    whole[name].append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime - cmd_cpu)
                    at_ready[name].append(parent)
    print("CMD: a hooked Python process burning %.1f s of CPU; %d pairs" % (args.work_s, args.pairs))
    for name in names:
        print("%-13s whole life (command's CPU less CMD's): median %.3f s, quartiles %s; by CMD's end "
              "(/proc/PPID/stat, 10 ms ticks): median %.3f s" % (name, statistics.median(whole[name]),
                                                                 quartiles(whole[name]),
                                                                 statistics.median(at_ready[name])))
    if args.other_launch:
        d = [a - b for a, b in zip(whole["launch"], whole["other launch"], strict=True)]
        r = [a - b for a, b in zip(at_ready["launch"], at_ready["other launch"], strict=True)]
        print("launch - other launch, paired: whole life median %+.3f s (quartiles %s); by CMD's end median "
              "%+.3f s (quartiles %s)" % (statistics.median(d), quartiles(d), statistics.median(r), quartiles(r)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
