"""What one look at the kernel's listening sockets costs (``hooks/_listening.py``), side by side.

    python bench/listen_watch_cost.py [--connections 2000] [--polls 300]

Opens --connections idle loopback TCP connections (what a busy host has in its tables), then
times ``ListenWatch.poll`` through sock_diag netlink (LISTEN filtered in the kernel) and
through the /proc/self/net/tcp{,6} and unix files, best of 5 runs of --polls each. The
sampler thread looks every 100 ms during a cold start: the share of a core is printed for that.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from infersight.hooks import _listening


def cost_us(netlink: bool, polls: int, ignore: int) -> float:
    """A poll that finds nothing (the steady state while a server starts): our own listener is
    one that was listening before (as a socket the process inherited)."""
    w = _listening.ListenWatch(lambda: ["self"], netlink=netlink, inherited=[ignore])
    assert w.poll() is None
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(polls):
            w.poll()
        best = min(best, (time.perf_counter() - t) / polls)
    return best * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--polls", type=int, default=300)
    args = ap.parse_args()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4096)
    held = []
    for _ in range(args.connections):
        c = socket.create_connection(server.getsockname())
        held.append(c)
        held.append(server.accept()[0])
    inode = os.fstat(server.fileno()).st_ino
    nl, proc = cost_us(True, args.polls, inode), cost_us(False, max(10, args.polls // 10), inode)
    print("%d loopback connections open (%d sockets)" % (args.connections, len(held)))
    print("one poll: sock_diag netlink %.0f us, /proc files %.0f us: ratio %.1fx" % (nl, proc, proc / nl))
    print("every 100 ms during a cold start: %.2f%% of a core (netlink), %.2f%% (/proc)" % (nl / 1e3, proc / 1e3))
    for s in held:
        s.close()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
