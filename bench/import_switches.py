"""How often the hooks' background threads take the CPU from a busy main thread, side by side.

    python bench/import_switches.py [--rounds 6] [--variants plain,hooks,launch] [--env NAME:K=V]

Each run does the import phase of the transformers workload (``import torch; from
transformers import BertModel``) and reports, from inside the process: its wall time, the
main thread's CPU time, its involuntary and voluntary context switches over it
(``/proc/thread-self/status``) and the other threads' switches. A hooks thread that makes a
system call gives the GIL up; when it wants it back, the busy main thread is switched out
(CPython's forced switch) and waits for it: the main thread's voluntary switches count
those waits (a handful plain), and load moves them far less than wall time on a shared
machine. Variants run in rotating order within each round: ``plain``, ``hooks`` (the
bootstrap on PYTHONPATH, no agent: they spool), ``launch`` (``infersight launch -- python
...``). ``--env NAME:K=V`` adds a variant NAME, a copy of ``hooks`` (``launch`` when NAME
starts with it) with the variable set; ``--env old:PYTHONPATH=/tmp/old/hooks/bootstrap``
runs another release's hooks (``git archive REV hooks | tar -x -C /tmp/old``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOT = os.path.join(ROOT, "hooks", "bootstrap")

PROBE = r"""
import json, sys, time

import os

def switches(tid="thread-self"):
    out = [0, 0]
    try:
        with open("/proc/self/task/%s/status" % tid if tid != "thread-self" else "/proc/thread-self/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    out[0] = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    out[1] = int(line.split()[1])
    except OSError:
        pass
    return out

def others():
    me = str(threading.get_native_id())
    return {t: sum(switches(t)) for t in os.listdir("/proc/self/task") if t != me}

import threading
(v0, n0), b0, t0, c0 = switches(), others(), time.perf_counter(), time.thread_time()
import torch
from transformers import BertModel
(v1, n1), b1, t1, c1 = switches(), others(), time.perf_counter(), time.thread_time()
with open(sys.argv[1], "w") as f:
    json.dump({"wall": t1 - t0, "cpu": c1 - c0, "switches": n1 - n0, "vol": v1 - v0,
               "bg": sum(b1.values()) - sum(b0.get(t, 0) for t in b1)}, f)
"""


def clean_env() -> dict[str, str]:
    drop = ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("INFERSIGHT", "OTEL_EXPORTER_OTLP")) and k not in drop}
    env.update(PYTHONWARNINGS="ignore", INFERSIGHT_MEASURE_STORAGE="0", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--variants", default="plain,hooks,launch")
    ap.add_argument("--env", action="append", default=[], metavar="NAME:K=V")
    args = ap.parse_args()
    python = sys.executable
    cli = os.path.join(os.path.dirname(python), "infersight")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="import-switches-") as tmp:
        probe = os.path.join(tmp, "probe.py")
        with open(probe, "w") as f:
            f.write(PROBE)
        out = os.path.join(tmp, "out.json")
        hooks_env = {"PYTHONPATH": BOOT, "INFERSIGHT_SOCKET": os.path.join(tmp, "absent.sock"),
                     "INFERSIGHT_SPOOL_DIR": os.path.join(tmp, "spool")}
        plain_argv = [python, probe, out]
        launch_argv = [cli, "launch", "--no-console", "--otlp-file", os.path.join(tmp, "o.jsonl"), "--", *plain_argv]
        variants: dict[str, tuple[list[str], dict[str, str]]] = {
            "plain": (plain_argv, {}), "hooks": (plain_argv, hooks_env), "launch": (launch_argv, {})}
        chosen = [v for v in args.variants.split(",") if v]
        for spec in args.env:
            name, kv = spec.split(":", 1)
            k, v = kv.split("=", 1)
            base = variants["launch"] if name.startswith("launch") else variants["hooks"]
            prev = variants.get(name, base)
            variants[name] = (prev[0], {**prev[1], k: v})
            if name not in chosen:
                chosen.append(name)
        subprocess.run(plain_argv, env=clean_env(), check=True)  # warm the page cache
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in chosen}
        for i in range(args.rounds):
            order = chosen[i % len(chosen):] + chosen[:i % len(chosen)]
            for name in order:
                argv, env = variants[name]
                subprocess.run(argv, env={**clean_env(), **env}, check=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                with open(out) as f:
                    runs[name].append(json.load(f))
                os.unlink(out)
    print("%-18s %8s %8s %8s %8s %8s   (medians of %d rounds; then main's involuntary switches, all runs)"
          % ("", "wall s", "cpu s", "main inv", "main vol", "threads", args.rounds))
    for name in chosen:
        r = runs[name]
        print("%-18s %8.3f %8.3f %8.0f %8.0f %8.0f   %s" % (
            name, statistics.median(x["wall"] for x in r), statistics.median(x["cpu"] for x in r),
            statistics.median(x["switches"] for x in r), statistics.median(x["vol"] for x in r),
            statistics.median(x["bg"] for x in r), " ".join("%d" % x["switches"] for x in r)))
    if "plain" in runs:
        base = runs["plain"]
        for name in chosen:
            if name == "plain":
                continue
            ratios = sorted(x["wall"] / p["wall"] for x, p in zip(runs[name], base, strict=True))
            print("%-18s wall / plain in the same round: median %.3f (%s)" % (
                name, statistics.median(ratios), " ".join("%.3f" % r for r in ratios)))
    print("load average (1 min) at start %.2f, at end %.2f" % (load0[0], os.getloadavg()[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
