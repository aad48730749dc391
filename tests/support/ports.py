"""Free TCP ports for the servers tests start (brokers, receivers, agents' endpoints, stacks).

A port found free here is bound a moment later by the server the test starts. ``bind(0)`` hands
out a port of the kernel's ephemeral range, the range every outgoing connection on the machine
draws from too: with the tests in parallel, another worker's client could take the port between
the probe and the server's bind ("Address already in use"). A port below that range is never
given to an outgoing connection; a random one, checked with a bind, makes two workers' picks
meeting unlikely.
"""

from __future__ import annotations

import os
import random
import socket

_RNG = random.Random(int.from_bytes(os.urandom(8), "big"))  # not the global one (hypothesis seeds it)
_LOWEST = 10000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_GIVEN: set[int] = set()  # this process's picks: two servers started together never get one port


def free_port(host: str = "127.0.0.1") -> int:
    top = _ephemeral_start() - 1
    for _ in range(200) if top > _LOWEST + 1000 else ():
        port = _RNG.randint(_LOWEST, top)
        if port in _GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a narrow range: the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])
