"""CPU a quiet served process spends in the hooks: 100 events/s, batched vs one frame per event.

Goal (issue 13): a served process at 100 ev/s spends under 1% of a core in the hook.

Each run is a real served process: a paced loop that logs RATE events/s for SECONDS, with
the hooks active and shipping to a real agent (another process). It serves: readiness and
its first response are marked first, so its cold start has ended, as in a server at steady
state. A fourth variant runs the same loop inside a cold start that never ends, where the
cold-start stack sampler (100 samples/s, at most an hour) adds its own cost. It measures its own CPU
(every thread: caller and drain thread) over the loop. The same loop with the hooks
inactive is the baseline; hook CPU = run - baseline. Three variants run in turns, REPEAT
times, in one run: baseline, batched (the default: 512 events or 50 ms), and per-event
(INFERSIGHT_BATCH_EVENTS=1, how the hook sent before batching). The agent's CPU over each
run is printed too. Figures are medians; the ratio is per-event / batched, side by side.

Run: python bench/hook_cpu.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from emit_vs_span import start_agent_process  # bench/ is on sys.path when run as a script

RATE = 100
SECONDS = 4.0
REPEAT = 3

CHILD = r'''
import resource, sys, time
from infersight import hooks
rate, seconds, served = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "served"
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
if served:  # it serves: its cold start (and the cold-start stack sampler) has ended
    hooks.mark_ready()
    hooks.first_response()
hooks.log("warm", i=-1)
hooks.flush(5)
c0, t0 = cpu(), time.monotonic()
n = int(rate * seconds)
for i in range(n):
    hooks.log("request done", route="/v1/infer", status=200, i=i)
    delay = t0 + (i + 1) / rate - time.monotonic()
    if delay > 0:
        time.sleep(delay)
hooks.flush(10)
print(cpu() - c0, time.monotonic() - t0, n)
'''

BOOTSTRAP = str(Path(__file__).resolve().parent.parent / "hooks" / "bootstrap")


def agent_cpu_s(pid: int) -> float:
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(script: str, env: dict[str, str], agent_pid: int, phase: str) -> tuple[float, float]:
    """(process CPU % of a core, agent CPU % of a core) over one paced run."""
    a0 = agent_cpu_s(agent_pid)
    out = subprocess.run([sys.executable, script, str(RATE), str(SECONDS), phase], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    a1 = agent_cpu_s(agent_pid)
    cpu, wall = float(out[0]), float(out[1])
    return 100 * cpu / wall, 100 * (a1 - a0) / wall


def main() -> None:
    sock, spool, agent_pid = start_agent_process()
    d = tempfile.mkdtemp()
    script = os.path.join(d, "served.py")
    Path(script).write_text(CHILD)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSIGHT", "OTEL_", "TRACEPARENT"))}
    hooked = dict(base, INFERSIGHT="1", INFERSIGHT_SOCKET=sock, INFERSIGHT_SPOOL_DIR=spool,
                  PYTHONPATH=BOOTSTRAP + os.pathsep + base.get("PYTHONPATH", ""))
    variants = {
        "off": (base, "served"),
        "batched": (hooked, "served"),
        "per_event": (dict(hooked, INFERSIGHT_BATCH_EVENTS="1"), "served"),
        "batched_in_cold_start": (hooked, "cold_start"),
    }
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for _ in range(REPEAT):
        for name, (env, phase) in variants.items():
            got[name].append(run(script, env, agent_pid, phase))
    med = {k: statistics.median(x[0] for x in v) for k, v in got.items()}
    agent = {k: statistics.median(x[1] for x in v) for k, v in got.items()}
    hook_batched = max(med["batched"] - med["off"], 0.0)
    hook_per_event = max(med["per_event"] - med["off"], 0.0)
    print(json.dumps({
        "rate_ev_s": RATE,
        "process_cpu_pct_off": round(med["off"], 3),
        "hook_cpu_pct_batched": round(hook_batched, 3),
        "hook_cpu_pct_per_event": round(hook_per_event, 3),
        "ratio_per_event_over_batched": round(hook_per_event / hook_batched, 1) if hook_batched else None,
        "hook_cpu_pct_batched_in_cold_start": round(max(med["batched_in_cold_start"] - med["off"], 0.0), 3),
        "agent_cpu_pct_batched": round(agent["batched"], 3),
        "agent_cpu_pct_per_event": round(agent["per_event"], 3),
        "goal": "hook < 1% of a core at 100 ev/s",
        "python": sys.version.split()[0],
    }))


if __name__ == "__main__":
    main()
