"""Minimal sd_notify(3) client: readiness, status and watchdog pings to systemd.

Standard library only. Every function is a no-op when ``NOTIFY_SOCKET`` is unset
(not started by systemd with ``Type=notify``) and none of them ever raises.
"""

from __future__ import annotations

import os
import socket
import time

__all__ = ["Notifier", "notify", "ready", "reloading", "status", "stopping", "watchdog", "watchdog_interval_s"]


def _target(addr: str) -> str | None:
    if not addr or addr[0] not in "/@":
        return None
    return "\0" + addr[1:] if addr[0] == "@" else addr  # '@' = abstract namespace


class Notifier:
    """One datagram socket, opened once and kept: pings still go out when the process has
    run out of file descriptors, and a full receive queue drops a message instead of
    blocking the event loop (non-blocking send). A no-op without ``NOTIFY_SOCKET``."""

    def __init__(self, addr: str | None = None) -> None:
        self.target = _target(os.environ.get("NOTIFY_SOCKET", "") if addr is None else addr)
        self.sock: socket.socket | None = None
        if self.target is not None:
            try:
                kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                self.sock = socket.socket(socket.AF_UNIX, kind)
            except OSError:
                self.sock = None  # falls back to a socket per message

    def send(self, *fields: str) -> bool:
        if self.target is None or not fields:
            return False
        if self.sock is None:
            return notify(*fields)
        try:
            self.sock.sendto("\n".join(fields).encode("utf-8", "replace"), self.target)
        except (OSError, ValueError):
            return False
        return True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def notify(*fields: str) -> bool:
    """Send ``KEY=VALUE`` fields as one datagram; True if systemd got it."""
    target = _target(os.environ.get("NOTIFY_SOCKET", ""))
    if target is None or not fields:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(0.5)  # a full receive queue must not stall the event loop long
            sock.sendto("\n".join(fields).encode("utf-8", "replace"), target)
    except (OSError, ValueError):
        return False
    return True


def ready(status_text: str | None = None) -> bool:
    return notify("READY=1", *(() if status_text is None else (f"STATUS={status_text}",)))


def status(text: str) -> bool:
    return notify(f"STATUS={text}")


def watchdog() -> bool:
    return notify("WATCHDOG=1")


def stopping(status_text: str | None = None) -> bool:
    return notify("STOPPING=1", *(() if status_text is None else (f"STATUS={status_text}",)))


def reloading() -> bool:
    """Announce a reload; send ``ready()`` when it is done (Type=notify-reload too)."""
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify("RELOADING=1", f"MONOTONIC_USEC={usec}")


def watchdog_interval_s() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None if not asked.

    As sd_watchdog_enabled(3): honours WATCHDOG_USEC, and WATCHDOG_PID if set.
    """
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
        pid = os.environ.get("WATCHDOG_PID")
        if pid is not None and pid != "" and int(pid) != os.getpid():
            return None
    except ValueError:
        return None
    return usec / 2e6 if usec > 0 else None
