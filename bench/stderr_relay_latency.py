"""From an engine's memory error written to stderr to the capture handed to the agent.

    python bench/stderr_relay_latency.py [N] [--first-oom]

A child writes a real vLLM message to fd 2, notes the time, and keeps running quietly (the
worst case: no EOF ends the capture); the relay of ``launch`` hands the capture to a consumer
that notes the time, and the agent's serving rules classify it. Prints the median and the
worst of N runs, with and without the classification.

``--first-oom``: the first OOM of a launch, whose embedded agent has not loaded its OOM rules
(they load at first use): each run in a fresh interpreter with the rule modules not imported,
as launch's agent has them, side by side with and without the warm-up that launch starts when
the relay opens a capture (the rules load on a thread while the capture runs to its end).
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


FIRST = r"""
import os, sys, threading, time
from infersight.agent.oom.kind import OomClassifier
from infersight.agent.oom.stderr_relay import StderrRelay
CHILD, MSG = sys.argv[3], sys.argv[4]
warm = sys.argv[1] == "1"
assert "infersight.rules.serving" not in sys.modules
devnull = os.open(os.devnull, os.O_WRONLY)
c = OomClassifier([])
relay = StderrRelay(out_fd=devnull)
done = threading.Event()
res = {}
def on_text(text):
    res["at"] = time.time_ns()
    from infersight.rules.serving import analyse
    (f,) = analyse(text, c.serving)
    assert f.cls == "reservation_conflict"
    res["classified"] = time.time_ns()
    done.set()
def on_open():
    threading.Thread(target=c.warm, daemon=True).start()
p = __import__("subprocess").Popen([sys.executable, "-c", CHILD, MSG, sys.argv[2]], stderr=relay.child_fd)
relay.started()
relay.set_consumer(on_text, on_open if warm else None)
done.wait(10)
p.wait()
wrote = int(open(sys.argv[2]).read())
print((res["at"] - wrote) / 1e6, (res["classified"] - wrote) / 1e6)
"""


def first_oom(n: int) -> None:
    runs: dict[str, list[tuple[float, float]]] = {"warm-up on capture": [], "load at first use": []}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # .pyc files, as installed
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "stamp")
        for i in range(n):
            for name, warm in (("warm-up on capture", "1"), ("load at first use", "0"))[:: 1 if i % 2 else -1]:
                out = subprocess.run([sys.executable, "-c", FIRST, warm, stamp, CHILD, MSG], check=True,
                                     capture_output=True, text=True, env=env).stdout.split()
                runs[name].append((float(out[0]), float(out[1])))
    for name, rs in runs.items():
        for i, what in enumerate(("capture handed over", "and classified")):
            xs = [r[i] for r in rs]
            print(f"first OOM, {name:<19} {what:<20} median {statistics.median(xs):6.1f} ms   "
                  f"worst {max(xs):6.1f} ms   ({n} runs)")


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--first-oom"]
    n = int(args[0]) if args else 15
    if "--first-oom" in sys.argv:
        first_oom(n)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    analyse(MSG)  # the rules loaded already (the daemon loads them at start)
    runs = [once(devnull) for _ in range(n)]
    for i, name in enumerate(("capture handed over", "and classified")):
        xs = [r[i] for r in runs]
        print(f"{name:<22} median {statistics.median(xs):6.1f} ms   worst {max(xs):6.1f} ms   ({n} runs)")


if __name__ == "__main__":
    main()
