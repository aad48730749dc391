"""Socket and spool locations, as DESIGN defines them (stdlib only)."""

from __future__ import annotations

import os

SYSTEM_SOCKET_DIR = "/run/infersight"
SYSTEM_SPOOL_DIR = "/var/lib/infersight/spool"


def socket_path(env: os._Environ[str] | dict[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    explicit = env.get("INFERSIGHT_SOCKET")
    if explicit:
        return explicit
    if os.path.isdir(SYSTEM_SOCKET_DIR):
        return os.path.join(SYSTEM_SOCKET_DIR, "agent.sock")
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "infersight", "agent.sock")
    return "/tmp/infersight-%d/agent.sock" % os.getuid()


def spool_dir(env: os._Environ[str] | dict[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    explicit = env.get("INFERSIGHT_SPOOL_DIR")
    if explicit:
        return explicit
    if os.access(SYSTEM_SPOOL_DIR, os.W_OK):
        return SYSTEM_SPOOL_DIR
    state = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "infersight", "spool")
