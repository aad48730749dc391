"""What ``infersight launch`` adds to a real cold start, and what ``infersight --help`` costs.

    python bench/launch_overhead.py [--pairs 6] [--work-s 2.0] [--help-runs 20] [--bare-runs 20]
                                    [--server-pairs 4]

Three stacks, each paired side by side (plain and under launch, in rotating order):

- a bare command: ``true`` against ``infersight launch -- true``, wall time to exit (the
  fixed cost of launch: its own start, and its end once CMD exited; budget < 0.15 s);
- a uvicorn server (FastAPI app that imports torch and builds a small model at startup):
  spawn -> first HTTP 200, then SIGTERM -> exit (launch forwards it to CMD's group and
  flushes);
- the transformers workload below.

The workload is a real cold start: ``import torch``, build a small BERT from its saved
safetensors (``BertModel.from_pretrained`` of a model made here from a config with random
weights), one forward, then a fixed amount of CPU work (matmuls; the iteration count is
calibrated once, then the same for every run) -- about 4 s on an idle 2-core machine.
It writes the time it was ready, and exits.

Each round runs the workload plain (``python workload.py``), with the hooks alone (the
bootstrap on PYTHONPATH, no agent: what the hooks cost without launch) and under
``infersight launch -- python workload.py``, in rotating order. Cold start = the
caller's start of the command -> the workload's ready time, so the launcher's own start,
the hooks and the embedded agent competing for the CPU are all counted; launch's flush
after CMD exits is reported apart (``wall``), and so is the CPU time of each command
(launcher, agent and CMD together): on a shared, loaded VM the wall-time ratio is mostly
load noise, while the CPU that launch adds is what a saturated host would pay in wall time.
The workload also writes, at its ready time, its process's CPU (all its threads: the hooks'
included), its main thread's CPU and the main thread's voluntary and involuntary switches
(``/proc/thread-self/status``: a voluntary one is mostly a wait for the GIL that a hooks
thread took); ``getrusage`` gives the switches of every process of the command. Each
variant is then paired with plain of the same round, by each measure: the median of the
paired ratios with a distribution-free interval of that median (order statistics: at least
90% coverage, which takes 6 rounds or more) and whether the interval lies within the
budget, over it, or across it (not resolved). The 1-minute load average before each run is
reported too.
DESIGN budget: ratio <= 1.02; --help < 60 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import NamedTuple

WORKLOAD = r"""
import json, os, sys, time
import torch
from transformers import BertModel
torch.set_num_threads(1)  # the same work whatever the host's load
model = BertModel.from_pretrained(sys.argv[1])
with torch.no_grad():
    model(torch.ones(1, 32, dtype=torch.long))
a = torch.randn(256, 256)
for _ in range(int(sys.argv[2])):
    a = torch.tanh(a @ a)
ready_ns = time.time_ns()
sw = {}
with open("/proc/thread-self/status") as f:  # the main thread's switches: waits for the GIL, mostly
    for line in f:
        if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
            k, v = line.split(":")
            sw[k] = int(v)
with open("/proc/%d/stat" % os.getppid()) as f:  # the parent's CPU (every thread) by this ready time:
    fields = f.read().rsplit(")", 1)[1].split()  # launch's own, when launched
parent_cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
with open(sys.argv[3], "w") as f:
    json.dump({"ready_ns": ready_ns, "main_cpu": time.thread_time(), "proc_cpu": time.process_time(),
               "main_vol": sw.get("voluntary_ctxt_switches", 0),
               "main_invol": sw.get("nonvoluntary_ctxt_switches", 0), "parent_cpu": parent_cpu}, f)
"""

MAKE_MODEL = r"""
import sys
from transformers import BertConfig, BertModel
BertModel(BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                     vocab_size=8000)).save_pretrained(sys.argv[1])
"""

CALIBRATE = r"""
import time, torch
torch.set_num_threads(1)
a = torch.randn(256, 256)
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < 1.0:
    a = torch.tanh(a @ a)
    n += 1
print(n / (time.perf_counter() - t0))
"""


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("INFERSIGHT", "OTEL_EXPORTER_OTLP")) and k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONWARNINGS="ignore", INFERSIGHT_MEASURE_STORAGE="0", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    return env


def spawn_ns(otlp: str) -> int:
    """The launched workload's spawn time: its ``coldstart`` root starts there."""
    with open(otlp) as f:
        for line in f:
            for rs in json.loads(line).get("resourceSpans", []):
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        if span["name"] == "coldstart":
                            return int(span["startTimeUnixNano"])
    return 0


class Run(NamedTuple):
    cold: float  # the caller's start of the command -> the workload's ready time, s
    wall: float  # ... -> the command's exit (launch's flush included), s
    pre: float  # launch's own time before CMD's spawn, s (0 when plain)
    cpu: float  # user+sys of the whole command to its exit (launcher, agent, CMD), s
    cmd_cpu: float  # CMD's process to its ready time (all its threads), s
    main_cpu: float  # CMD's main thread to its ready time, s
    main_vol: int  # CMD's main thread's voluntary switches to its ready time (GIL waits, I/O)
    main_invol: int  # ... and involuntary ones (preempted: the load)
    tree_vol: int  # voluntary switches of every process of the command (getrusage)
    tree_invol: int
    load: float  # 1-minute load average just before the run
    launcher_cpu: float  # the parent's CPU by CMD's ready time, s: launch's own process when launched


def one_run(argv: list[str], marker: str, otlp: str | None = None, env: dict[str, str] | None = None) -> Run:
    for path in (marker, otlp):
        if path and os.path.exists(path):
            os.unlink(path)
    load = os.getloadavg()[0]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time_ns()
    # In the marker's directory: `python -m infersight` puts its working directory first on
    # sys.path, and a checkout's infersight/ there would shadow --other-launch's PYTHONPATH.
    subprocess.run(argv, check=True, env={**clean_env(), **(env or {})}, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, cwd=os.path.dirname(marker))
    wall = (time.time_ns() - t0) / 1e9
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    with open(marker) as f:
        m = json.load(f)
    pre = (spawn_ns(otlp) - t0) / 1e9 if otlp else 0.0
    return Run((m["ready_ns"] - t0) / 1e9, wall, pre, cpu, m["proc_cpu"], m["main_cpu"], m["main_vol"],
               m["main_invol"], r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw, load,
               float(m.get("parent_cpu", -1.0)))


def median_ci(xs: list[float], level: float = 0.9) -> tuple[float, float, float]:
    """A distribution-free confidence interval of the median (order statistics, binomial):
    the narrowest pair (x_k, x_n-k+1) whose coverage is still at least ``level``, and its
    coverage; the extremes when n is too small for it (coverage under ``level``)."""
    xs = sorted(xs)
    n = len(xs)
    from math import comb

    def below(k: int) -> float:  # P(Binomial(n, 1/2) < k)
        return float(sum(comb(n, i) for i in range(k))) / float(2 ** n)

    k = 1
    while k + 1 <= n // 2 and 1 - 2 * below(k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], 1 - 2 * below(k)


def paired(name: str, num: list[float], den: list[float], budget: float | None = None) -> str:
    """Median of the paired ratios num/den, its 90% interval and quartiles, and the ratio of
    the medians; with a budget, whether the interval resolves it."""
    ratios = [a / b for a, b in zip(num, den, strict=True) if b]
    if not ratios:
        return "%s: -" % name
    lo, hi, cover = median_ci(ratios)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    verdict = ""
    if budget is not None and cover < 0.9:
        verdict = "; too few pairs for a 90%% interval (%.0f%%)" % (100 * cover)
    elif budget is not None:
        verdict = ("; within %.2f (shown)" % budget if hi <= budget else
                   "; over %.2f (shown)" % budget if lo > budget else "; %.2f not resolved" % budget)
    return ("%-40s median %.3f, CI %.3f-%.3f, quartiles %.3f-%.3f, range %.3f-%.3f, ratio of medians "
            "%.3f%s" % (name, statistics.median(ratios), lo, hi, q[0], q[2], min(ratios), max(ratios),
                        statistics.median(num) / statistics.median(den) if statistics.median(den) else 0.0,
                        verdict))


def bare_times(cli: str, runs: int, tmp: str) -> tuple[list[float], list[float], list[float]]:
    """``true`` and ``infersight launch -- true``, interleaved: wall seconds to exit, and the
    CPU seconds of each launch (on a loaded host, wall time is mostly waiting for a core)."""
    otlp = os.path.join(tmp, "bare.jsonl")
    plain: list[float] = []
    launched: list[float] = []
    cpu: list[float] = []
    for i in range(runs):
        pair = [(["true"], plain), ([cli, "launch", "--no-console", "--otlp-file", otlp, "--", "true"], launched)]
        for argv, into in pair if i % 2 == 0 else pair[::-1]:
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run(argv, check=True, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            into.append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            if into is launched:
                cpu.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
    return plain, launched, cpu


SERVER = r"""
import torch
from fastapi import FastAPI
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
with torch.no_grad():
    model(torch.zeros(1, 256))
app = FastAPI()

@app.get("/")
def root() -> dict:
    return {"ok": True}
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_run(argv: list[str], port: int, env: dict[str, str] | None = None) -> tuple[float, float]:
    """(spawn -> first HTTP 200 s, SIGTERM -> exit s) of a server command."""
    import signal
    import urllib.request

    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env={**clean_env(), **(env or {})}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/" % port, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.01)
            if p.poll() is not None:
                raise RuntimeError("server exited before it was ready: %s" % argv)
        ready = time.perf_counter() - t0
        t1 = time.perf_counter()
        p.send_signal(signal.SIGTERM)
        p.wait(60)
        return ready, time.perf_counter() - t1
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


Runs = list[tuple[float, float]]


def server_times(cli: str, python: str, pairs: int, tmp: str) -> tuple[Runs, Runs, Runs]:
    """The server plain, with the hooks alone (no agent: they spool) and under launch, rotating."""
    from infersight.agent.commands.launch import bootstrap_dir

    with open(os.path.join(tmp, "bench_server.py"), "w") as f:
        f.write(SERVER)
    otlp = os.path.join(tmp, "server.jsonl")
    hooks_env = {"PYTHONPATH": bootstrap_dir(), "INFERSIGHT_SOCKET": os.path.join(tmp, "absent.sock"),
                 "INFERSIGHT_SPOOL_DIR": os.path.join(tmp, "server-spool")}
    plain: Runs = []
    hooked: Runs = []
    launched: Runs = []
    for i in range(pairs + 1):  # the first round warms the page cache: not counted
        port = _free_port()
        server = [python, "-m", "uvicorn", "bench_server:app", "--app-dir", tmp, "--port", str(port),
                  "--log-level", "warning"]
        variants: list[tuple[list[str], dict[str, str] | None, Runs]] = [
            (server, None, plain), (server, hooks_env, hooked),
            ([cli, "launch", "--no-console", "--otlp-file", otlp, "--", *server], None, launched)]
        for argv, env, into in variants[i % 3:] + variants[:i % 3]:
            r = server_run(argv, port, env)
            if i:
                into.append(r)
    return plain, hooked, launched


def help_times(cli: str, python: str, runs: int) -> tuple[list[float], list[float]]:
    """`infersight --help` and a bare `python -c pass`, interleaved (ms)."""
    helps: list[float] = []
    bare: list[float] = []
    for _ in range(runs):
        for argv, into in (([cli, "--help"], helps), ([python, "-c", "pass"], bare)):
            t0 = time.perf_counter()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
            into.append((time.perf_counter() - t0) * 1e3)
    return helps, bare


def report(plain: list[Run], hooked: list[Run], launched: list[Run], other: list[Run], other_name: str | None,
           iters: int, work_s: float, other_launch: list[Run] | None = None) -> None:
    """The transformers rounds: medians per variant, then each variant against plain, paired by
    round, by every measure (wall time, and the CPU and switch counts that load moves less)."""
    cols = [("plain", plain), ("hooks only", hooked), ("launch", launched)]
    if other:
        cols.append(("other hooks", other))
    if other_launch:
        cols.append(("other launch", other_launch))
    print("workload: import torch + BertModel.from_pretrained (4 layers) + forward + %d matmuls (%.1f s work), "
          "%d rounds" % (iters, work_s, len(plain)))
    print("%-38s" % "" + "".join("%12s" % c for c, _v in cols))
    rows: list[tuple[str, Callable[[Run], float], str]] = [
        ("cold start, median s", lambda r: r.cold, "%12.3f"),
        ("wall to exit, median s", lambda r: r.wall, "%12.3f"),
        ("CPU of the whole command, median s", lambda r: r.cpu, "%12.3f"),
        ("CMD's CPU to ready, median s", lambda r: r.cmd_cpu, "%12.3f"),
        ("CMD main thread CPU to ready, s", lambda r: r.main_cpu, "%12.3f"),
        ("main thread voluntary switches", lambda r: r.main_vol, "%12.0f"),
        ("main thread involuntary switches", lambda r: r.main_invol, "%12.0f"),
        ("switches, whole command (vol)", lambda r: r.tree_vol, "%12.0f"),
        ("switches, whole command (invol)", lambda r: r.tree_invol, "%12.0f"),
    ]
    for label, get, fmt in rows:
        print("%-38s" % label + "".join(fmt % statistics.median(get(r) for r in v) for _c, v in cols))
    pre = statistics.median(r.pre for r in launched)
    p_cold = statistics.median(r.cold for r in plain)
    print("launcher's own cost before CMD starts: %.0f ms = %.1f%% of the plain cold start" % (pre * 1e3,
                                                                                           100 * pre / p_cold))
    for cname, v in cols:
        own = [r.launcher_cpu for r in v if r.launcher_cpu >= 0]
        if own and "launch" in cname:  # plain and hooks only: the parent is this bench
            print("%s's own process, CPU by CMD's ready time (/proc/PPID/stat, 10 ms ticks): median %.3f s "
                  "(%.1f%% of plain CMD's CPU to ready), range %.3f-%.3f s"
                  % (cname, statistics.median(own), 100 * statistics.median(own) / statistics.median(
                      r.cmd_cpu for r in plain), min(own), max(own)))
    if other_launch:
        diffs = [a.launcher_cpu - b.launcher_cpu for a, b in zip(launched, other_launch, strict=True)]
        lo, hi, _cover = median_ci(diffs)
        print("launch's own CPU by ready minus other launch's, paired by round: median %+.3f s, CI %+.3f to %+.3f s"
              % (statistics.median(diffs), lo, hi))
    loads = [r.load for _c, v in cols for r in v]
    if other_launch:
        print("other launch's own cost before CMD starts: %.0f ms (`python -m infersight`)"
              % (statistics.median(r.pre for r in other_launch) * 1e3))
    print("load average (1 min) before each run: %.2f-%.2f (median %.2f)" % (min(loads), max(loads),
                                                                             statistics.median(loads)))
    print("paired by round (CI: a distribution-free interval of the median with at least 90% coverage, from "
          "order statistics; budget <= 1.02):")
    measures: list[tuple[str, Callable[[Run], float]]] = [
        ("cold start", lambda r: r.cold), ("CPU, whole command", lambda r: r.cpu),
        ("CMD's CPU to ready", lambda r: r.cmd_cpu), ("CMD main thread CPU", lambda r: r.main_cpu)]
    for name, v in cols[1:]:
        for mname, get in measures:
            print("  " + paired("%s/plain %s" % (name, mname), [get(r) for r in v], [get(r) for r in plain], 1.02))
        print("  %s: main thread voluntary switches over plain, median of pairs %+.0f"
              % (name, statistics.median(r.main_vol - p.main_vol for r, p in zip(v, plain, strict=True))))
    # The budget "launch itself" (DESIGN): what launch adds over the same hooks without it.
    for mname, get in measures[:1] + measures[2:]:
        print("  " + paired("launch/hooks only %s" % mname, [get(r) for r in launched], [get(r) for r in hooked],
                            1.02))
    # Measured directly: launch's wall time before the spawn plus all of its CPU by CMD's ready time
    # (which holds that start again: counted twice, so a bound) is the most it can take from CMD.
    own = [r.pre + r.launcher_cpu for r in launched if r.launcher_cpu >= 0]
    if own:
        p_cold = statistics.median(r.cold for r in plain)
        print("  launch itself, measured directly: (its time before the spawn + its own process's CPU by CMD's "
              "ready time) / plain cold start: median %.1f%%, largest %.1f%% (budget 2%%)"
              % (100 * statistics.median(own) / p_cold, 100 * max(own) / p_cold))
    print("  per pair, launch/plain cold start: %s" % " ".join(
        "%.3f" % (lr.cold / pr.cold) for pr, lr in zip(plain, launched, strict=True)))
    print("  per pair, hooks/plain cold start:  %s" % " ".join(
        "%.3f" % (hr.cold / pr.cold) for pr, hr in zip(plain, hooked, strict=True)))
    if other:
        print("other hooks: %s" % other_name)
        for mname, get in measures[:2] + measures[3:]:
            print("  " + paired("hooks/other hooks %s" % mname, [get(r) for r in hooked], [get(r) for r in other]))
    if other_launch:
        print("launch / other launch, paired by round:")
        for mname, get in measures:
            print("  " + paired("launch/other launch %s" % mname, [get(r) for r in launched],
                                [get(r) for r in other_launch]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=6, help="rounds (each: plain, hooks only, launch)")
    ap.add_argument("--work-s", type=float, default=2.0, help="CPU work after the model load (calibrated once)")
    ap.add_argument("--help-runs", type=int, default=20)
    ap.add_argument("--bare-runs", type=int, default=20, help="pairs of `true` / `launch -- true`")
    ap.add_argument("--server-pairs", type=int, default=4, help="pairs of the uvicorn server (0: skip)")
    ap.add_argument("--skip-transformers", action="store_true", help="only the bare command and the server")
    ap.add_argument("--other-hooks", metavar="BOOTSTRAP_DIR",
                    help="a fourth transformers variant: the hooks alone from another bootstrap directory, "
                         "e.g. an older release's (git archive REV hooks | tar -x -C /tmp/old; then "
                         "/tmp/old/hooks/bootstrap): before/after, paired in the same rounds")
    ap.add_argument("--other-launch", metavar="PACKAGE_DIR",
                    help="a fifth transformers variant: `python -m infersight launch` of another tree, its hooks "
                         "included, from PYTHONPATH=PACKAGE_DIR (a directory holding an `infersight` package laid "
                         "out as installed: the tree's infersight/ with agent, hooks, exporters and rules inside)")
    args = ap.parse_args()
    python = sys.executable
    cli = os.path.join(os.path.dirname(python), "infersight")
    load0 = os.getloadavg()
    iters = 0
    with tempfile.TemporaryDirectory(prefix="launch-bench-") as tmp:
        subprocess.run([cli, "launch", "--no-console", "--otlp-file", os.path.join(tmp, "w.jsonl"), "--", "true"],
                       check=True, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # warm
        bare_plain, bare_launch, bare_cpu = bare_times(cli, args.bare_runs, tmp)
        diffs = [b - a for a, b in zip(bare_plain, bare_launch, strict=True)]
        if diffs:  # --bare-runs 0: not measured
            print("bare command: `true` median %.3f s, `launch -- true` median %.3f s: launch adds %.3f s "
                  "(median of %d pairs, min %.3f s; budget < 0.15 s); launch's CPU median %.3f s"
                  % (statistics.median(bare_plain), statistics.median(bare_launch), statistics.median(diffs),
                     len(diffs), min(diffs), statistics.median(bare_cpu)))
        if args.server_pairs:
            sp, sh, sl = server_times(cli, python, args.server_pairs, tmp)
            ready_ratios = [b[0] / a[0] for a, b in zip(sp, sl, strict=True)]
            over_hooks = [b[0] / a[0] for a, b in zip(sh, sl, strict=True)]
            print("uvicorn server (FastAPI + torch model at startup), %d rounds (plain, hooks only, launch):" % len(sp))
            print("  spawn -> first HTTP 200: medians plain %.3f s, hooks only %.3f s, launch %.3f s; launch/plain "
                  "median %.3f (pairs: %s); launch/hooks only median %.3f; budget <= 1.02"
                  % (statistics.median(r[0] for r in sp), statistics.median(r[0] for r in sh),
                     statistics.median(r[0] for r in sl), statistics.median(ready_ratios),
                     " ".join("%.3f" % r for r in ready_ratios), statistics.median(over_hooks)))
            print("  SIGTERM -> exit: plain median %.3f s, launch median %.3f s (launch forwards it to CMD's group, "
                  "then writes the file)" % (statistics.median(r[1] for r in sp), statistics.median(r[1] for r in sl)))
        if args.skip_transformers:
            print("load average (1 min) at start %.2f, at end %.2f" % (load0[0], os.getloadavg()[0]))
            return 0
        model = os.path.join(tmp, "bert")
        subprocess.run([python, "-c", MAKE_MODEL, model], check=True, env=clean_env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rate = float(subprocess.run([python, "-c", CALIBRATE], check=True, capture_output=True, text=True,
                                    env=clean_env()).stdout)
        iters = max(1, int(rate * args.work_s))
        script = os.path.join(tmp, "workload.py")
        with open(script, "w") as f:
            f.write(WORKLOAD)
        marker = os.path.join(tmp, "ready.json")
        plain_argv = [python, script, model, str(iters), marker]
        otlp = os.path.join(tmp, "o.jsonl")
        launch_argv = [cli, "launch", "--no-console", "--otlp-file", otlp, "--", *plain_argv]
        # The hooks alone, without launch: bootstrap on PYTHONPATH, no agent (they spool).
        from infersight.agent.commands.launch import bootstrap_dir

        hooks_env = {"PYTHONPATH": bootstrap_dir(), "INFERSIGHT_SOCKET": os.path.join(tmp, "absent.sock"),
                     "INFERSIGHT_SPOOL_DIR": os.path.join(tmp, "hook-spool")}
        one_run(plain_argv, marker)  # warm the page cache and .pyc files for all
        plain: list[Run] = []
        hooked: list[Run] = []
        launched: list[Run] = []
        other: list[Run] = []
        other_launch: list[Run] = []
        variants = [(plain_argv, None, None, plain), (plain_argv, None, hooks_env, hooked),
                    (launch_argv, otlp, None, launched)]
        if args.other_hooks:
            variants.append((plain_argv, None, {**hooks_env, "PYTHONPATH": args.other_hooks}, other))
        if args.other_launch:
            other_launch_argv = [python, "-m", "infersight", "launch", "--no-console", "--otlp-file", otlp, "--",
                                 *plain_argv]
            variants.append((other_launch_argv, otlp, {"PYTHONPATH": args.other_launch}, other_launch))
        n = len(variants)
        for i in range(args.pairs):
            for argv, out, env, into in variants[i % n:] + variants[:i % n]:
                into.append(one_run(argv, marker, out, env))
        helps, bare = help_times(cli, python, args.help_runs)

    if plain:
        report(plain, hooked, launched, other, args.other_hooks, iters, args.work_s, other_launch)
    if helps:  # --help-runs 0: not measured
        print("infersight --help: median %.1f ms (python -c pass: %.1f ms; --help adds %.1f ms); budget < 60 ms"
              % (statistics.median(helps), statistics.median(bare), statistics.median(helps) - statistics.median(bare)))
    print("load average (1 min) at start %.2f, at end %.2f" % (load0[0], os.getloadavg()[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
