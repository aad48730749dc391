"""Minimal sd_notify(3) client: readiness, status and watchdog pings to systemd.

Standard library only. Every function is a no-op when ``NOTIFY_SOCKET`` is unset
(not started by systemd with ``Type=notify``) and none of them ever raises.
"""

from __future__ import annotations

import os
import socket
import time

__all__ = ["notify", "ready", "reloading", "status", "stopping", "watchdog", "watchdog_interval_s"]


def notify(*fields: str) -> bool:
    """Send ``KEY=VALUE`` fields as one datagram; True if systemd got it."""
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr or addr[0] not in "/@" or not fields:
        return False
    target = "\0" + addr[1:] if addr[0] == "@" else addr  # '@' = abstract namespace
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
