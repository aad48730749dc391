"""What the watch for the main program's first frame costs (``hooks/_mainstart.py``), side by side.

    python bench/mainstart_watch.py [--calls 200000]

1. A loop of small Python calls with and without the watch's profile function (its budget set out
   of reach): the cost of one callback, and the ratio. Each call is four callbacks (call, c_call,
   c_return, return).
2. How many callbacks the watch sees between a ``sitecustomize`` (where the bootstrap runs) and
   the program's first frame, for a script and for ``-m``, in this interpreter: counted by a
   profile function of the same shape in a child interpreter; times the cost of one, the time
   the watch adds to a start. (The ``.pth`` line starts it earlier: the site's later ``.pth``
   files count too.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from infersight.hooks import _mainstart

COUNTER = """\
import sys
n = [0]
def profile(frame, event, arg):
    name, module = frame.f_code.co_name, frame.f_globals.get("__name__")
    if event == "call" and ((name, module) in (("<module>", "__main__"), ("_run_module_as_main", "runpy"))):
        sys.setprofile(None)
        sys.stderr.write("CALLBACKS %d\\n" % n[0])
        return
    n[0] += 1
sys.setprofile(profile)
"""


def small() -> int:
    return len(())


def loop(n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        small()
    return time.perf_counter() - t


def callback_ns(calls: int) -> tuple[float, float]:
    """(ns per callback, loop time with / without) best of 5."""
    bare = min(loop(calls) for _ in range(5))
    budget = _mainstart.MAX_EVENTS
    _mainstart.MAX_EVENTS = 10**12
    try:
        watched = []
        for _ in range(5):
            assert _mainstart.watch(lambda t_ns, seen: None)
            watched.append(loop(calls))
            _mainstart._stop(_mainstart._profile[0])
    finally:
        _mainstart.MAX_EVENTS = budget
    w = min(watched)
    return (w - bare) / (calls * 4) * 1e9, w / bare


def callbacks_to_start(argv: list[str], site_dir: str) -> int:
    env = dict(os.environ, PYTHONPATH=site_dir, INFERSIGHT="0")
    p = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=60,
                       input="{}", check=False)
    for line in p.stderr.splitlines():
        if line.startswith("CALLBACKS "):
            return int(line.split()[1])
    raise RuntimeError("no count: %s" % p.stderr[-500:])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200_000)
    args = ap.parse_args()
    ns, ratio = callback_ns(args.calls)
    print("one callback: %.0f ns (a loop of small calls: %.2fx as long while watched)" % (ns, ratio))
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "sitecustomize.py"), "w") as f:
            f.write(COUNTER)
        script = os.path.join(d, "main.py")
        with open(script, "w") as f:
            f.write("x = 1\n")
        for name, argv in (("a script", [script]), ("-m json.tool", ["-m", "json.tool"])):
            n = callbacks_to_start(argv, d)
            print("%-14s %6d callbacks before its first frame: %.2f ms added" % (name, n, n * ns / 1e6))
    print("budget: %d callbacks, %.1f ms at most" % (_mainstart.MAX_EVENTS, _mainstart.MAX_EVENTS * ns / 1e6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
