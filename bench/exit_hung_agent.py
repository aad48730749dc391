"""How long a hooked process's exit takes past INFERSIGHT_EXIT_FLUSH_S when the agent hangs.

    python bench/exit_hung_agent.py [ROUNDS] [--budget S]

A child emits 5,000 events and exits, its exit flush budget ``--budget`` (default 0.2 s). It runs
in turns against (a) a socket that accepts connections into its backlog and never answers (a hung
agent) and (b) no agent at all (the hooks spool at once). For each, the time from the child's last
atexit handler before the hooks' exit flush to the process's end, as its parent sees it; prints the
medians and the ratio of the hung case's exit to the budget (before the exit's waits on the agent
were cut short, 2.02 s for a budget of 0.2: 10x; after, 0.32 s: 1.6x).
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = (
    "import atexit, time\n"
    "from infersight import hooks\n"
    "for i in range(5000):\n"
    "    hooks.log('e', i=i)\n"
    "atexit.register(lambda: print(time.monotonic(), flush=True))\n"  # runs just before the hooks' exit flush
)


def exit_s(sock: Path, spool: Path, budget: float) -> float:
    env = dict(os.environ, INFERSIGHT_SOCKET=str(sock), INFERSIGHT_SPOOL_DIR=str(spool),
               INFERSIGHT_EXIT_FLUSH_S=str(budget), PYTHONPATH=str(ROOT / "hooks" / "bootstrap"))
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60, check=True)
    return time.monotonic() - float(r.stdout.split()[-1])


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    rounds = int(args[0]) if args else 5
    budget = float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 0.2
    with tempfile.TemporaryDirectory() as d:
        hung_sock = Path(d) / "hung.sock"
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.bind(str(hung_sock))
        silent.listen(1024)  # accepts into its backlog, never reads, never answers
        hung, none = [], []
        try:
            for k in range(rounds):
                hung.append(exit_s(hung_sock, Path(d) / ("spool-h%d" % k), budget))
                none.append(exit_s(Path(d) / "absent.sock", Path(d) / ("spool-n%d" % k), budget))
        finally:
            silent.close()
    h, n = statistics.median(hung), statistics.median(none)
    print("exit flush budget %.2f s, %d rounds" % (budget, rounds))
    print("hung agent: exit %.3f s (%.3f s past the budget), worst %.3f s" % (h, h - budget, max(hung)))
    print("no agent:   exit %.3f s, worst %.3f s" % (n, max(none)))
    print("hung exit / budget: %.2fx" % (h / budget))


if __name__ == "__main__":
    main()
