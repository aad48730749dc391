"""A HAProxy agent-check request as HAProxy's ``agent-send "<port>\\n"`` makes it: the agent's reply line."""

from __future__ import annotations

import socket


def ask(port: int, instance_port: int) -> str:
    """Ask the agent-check server on 127.0.0.1:``port`` about ``instance_port``; its whole reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"%d\n" % instance_port)
        data = b""
        while chunk := s.recv(256):
            data += chunk
    return data.decode()
