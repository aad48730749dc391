"""From an engine's memory error written to stderr to the capture handed to the agent.

    python bench/stderr_relay_latency.py [N]

A child writes a real vLLM message to fd 2, notes the time, and keeps running quietly (the
worst case: no EOF ends the capture); the relay of ``launch`` hands the capture to a consumer
that notes the time, and the agent's serving rules classify it. Prints the median and the
worst of N runs, with and without the classification.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from infersight.agent.oom.stderr_relay import StderrRelay
from infersight.rules.serving import analyse

MSG = ("ValueError: Free memory on device (0.49/79.32 GiB) on startup is less than desired GPU memory "
       "utilization (0.6, 47.59 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")
CHILD = """
import os, sys, time
os.write(2, (sys.argv[1] + "\\n").encode())
open(sys.argv[2], "w").write(str(time.time_ns()))
time.sleep(1.0)
"""


def once(devnull: int) -> tuple[float, float]:
    relay = StderrRelay(out_fd=devnull)
    got: list[tuple[int, str]] = []
    with tempfile.NamedTemporaryFile(delete=False) as f:
        stamp = f.name
    p = subprocess.Popen([sys.executable, "-c", CHILD, MSG, stamp], stderr=relay.child_fd)
    relay.started()
    relay.set_consumer(lambda text: got.append((time.time_ns(), text)))
    p.wait()
    relay.wait_closed(5)
    with open(stamp) as fh:
        wrote = int(fh.read())
    os.unlink(stamp)
    at, text = got[0]
    t0 = time.perf_counter_ns()
    (f,) = analyse(text)
    assert f.cls == "reservation_conflict"
    classify_ns = time.perf_counter_ns() - t0
    return (at - wrote) / 1e6, (at - wrote + classify_ns) / 1e6


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    devnull = os.open(os.devnull, os.O_WRONLY)
    analyse(MSG)  # the agent loads (and checks) its rules at start, not at the first OOM
    runs = [once(devnull) for _ in range(n)]
    for i, name in enumerate(("capture handed over", "and classified")):
        xs = [r[i] for r in runs]
        print(f"{name:<22} median {statistics.median(xs):6.1f} ms   worst {max(xs):6.1f} ms   ({n} runs)")


if __name__ == "__main__":
    main()
