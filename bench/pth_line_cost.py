"""What ``hooks install``'s ``.pth`` line costs at every start of the interpreter it is in, the hooks off.

    python bench/pth_line_cost.py [--runs 5000] [--old-rev 3270df5]

site executes the line at each start (``exec`` of the text: compiled each time). With ``INFERSIGHT`` unset
the line also looks for a misspelled switch (``_env.SWITCH_TYPO_WORDS``): one test of each environment
name's first letters. Timed here in-process as site runs it, beside the line of ``--old-rev`` (the one
``git show REV:agent/commands/hooks_install.py`` writes: one ``os.environ`` lookup), in environments of
this process's size and of 100 names, with an INFERSIGHT_* name set for every service (the fleet case),
with an INF name that is no typo (INFERENCE_URL), and with a typo (INFERSIGT=1: the code runs and says
it). A bare ``python -c pass`` start is about 15-20 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import time
import types

from infersight.agent.commands.hooks_install import pth_line

BOOT = "/opt/infersight/lib/python3.11/site-packages/infersight/hooks/bootstrap"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def old_line(rev: str) -> str:
    src = subprocess.run(["git", "-C", ROOT, "show", "%s:agent/commands/hooks_install.py" % rev],
                         capture_output=True, text=True, check=True).stdout
    mod = types.ModuleType("old_hooks_install")
    sys.modules[mod.__name__] = mod  # (its dataclass looks its module up)
    exec(compile(src, "old_hooks_install.py", "exec"), mod.__dict__)
    return str(mod.pth_line(BOOT))


def per_start_us(line: str, runs: int) -> float:
    """``exec(line)`` as site.addpackage runs it (the text, compiled each time); best of 5, in us."""
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(runs):
            exec(line, {})
        best = min(best, (time.perf_counter() - t) / runs * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5000)
    ap.add_argument("--old-rev", default="3270df5", help="the line to compare with (default: the commit before "
                    "the look for a misspelled switch)")
    args = ap.parse_args()
    new, old = pth_line(BOOT), old_line(args.old_rev)
    print("line length: old %d, new %d characters" % (len(old), len(new)))
    os.environ.pop("INFERSIGHT", None)
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("INF")}
    padded = dict(base, **{"BENCH_PAD_%03d" % i: "x" for i in range(max(0, 100 - len(base)))})
    cases = [("this env (%d names)" % len(base), base), ("100 names", padded),
             ("100 names + INFERSIGHT_SOCKET", dict(padded, INFERSIGHT_SOCKET="/run/infersight/agent.sock")),
             ("100 names + INFERENCE_URL", dict(padded, INFERENCE_URL="http://x")),
             ("100 names, INFERSIGHT=0", dict(padded, INFERSIGHT="0")),
             ("100 names + INFERSIGT=1 (said)", dict(padded, INFERSIGT="1"))]
    saved = dict(os.environ)
    try:
        for name, env in cases:
            os.environ.clear()
            os.environ.update(env)
            with contextlib.redirect_stderr(io.StringIO()):
                o, n = per_start_us(old, args.runs), per_start_us(new, args.runs)
            sys.stdout.write("%-32s old %7.1f us   new %7.1f us   (+%.1f)\n" % (name, o, n, n - o))
    finally:
        os.environ.clear()
        os.environ.update(saved)


if __name__ == "__main__":
    main()
