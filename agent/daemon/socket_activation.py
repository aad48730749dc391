"""sd_listen_fds(3) in Python: take listening sockets passed by systemd.

``listen_fds()`` returns the sockets inherited from a ``.socket`` unit (fd 3
onward) when ``LISTEN_PID`` names this process, and unsets ``LISTEN_PID``,
``LISTEN_FDS`` and ``LISTEN_FDNAMES`` as ``sd_listen_fds(unset_environment=1)``
does, so that children do not take them too. Never raises.
"""

from __future__ import annotations

import os
import socket

__all__ = ["SD_LISTEN_FDS_START", "listen_fds", "listen_fds_with_names"]

SD_LISTEN_FDS_START = 3
_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def listen_fds_with_names(unset_environment: bool = True) -> list[tuple[str, socket.socket]]:
    """``(name, socket)`` pairs; the name is from LISTEN_FDNAMES, else ``"unknown"``."""
    env = {k: os.environ.get(k) for k in _VARS}
    if unset_environment:
        for k in _VARS:
            os.environ.pop(k, None)
    try:
        if int(env["LISTEN_PID"] or "") != os.getpid():
            return []
        count = int(env["LISTEN_FDS"] or "")
    except ValueError:
        return []
    names = (env["LISTEN_FDNAMES"] or "").split(":")
    result: list[tuple[str, socket.socket]] = []
    for i, fd in enumerate(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + max(count, 0))):
        try:
            os.set_inheritable(fd, False)  # FD_CLOEXEC, as sd_listen_fds does
            sock = socket.socket(fileno=fd)  # family/type/proto read from the fd
        except OSError:
            continue  # not a socket (a FIFO or closed fd): skip it
        name = names[i] if i < len(names) and names[i] else "unknown"
        result.append((name, sock))
    return result


def listen_fds(unset_environment: bool = True) -> list[socket.socket]:
    """The inherited listening sockets in fd order; ``[]`` when not socket-activated."""
    return [sock for _, sock in listen_fds_with_names(unset_environment)]
