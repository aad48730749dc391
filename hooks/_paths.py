"""Socket and spool locations, as DESIGN defines them (stdlib only)."""

from __future__ import annotations

import os
import stat  # already loaded by os: no import cost

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


class UnsafeSocketDirError(ValueError):
    """The socket's directory could be another local user's: not to be used."""


def check_socket_dir(directory: str, uid: int) -> int:
    """The owner uid of ``directory`` if it is a safe home for the agent's socket; raises
    ``UnsafeSocketDirError`` saying why not (and OSError, e.g. FileNotFoundError, from lstat).

    Safe means: a real directory (``lstat``: not a symbolic link), writable by its owner only,
    and owned by ``uid`` or root, or else placed by root where only root can (its parent is a
    root-owned directory nobody else may write, as for ``/run/infersight`` that tmpfiles.d
    makes for the agent's own user). Anything else could be another local user's squat,
    e.g. ``/tmp/infersight-<uid>`` created 0777 before the agent: the agent refuses to
    start there and the hooks treat the socket as absent. Both sides use this one rule.
    """
    directory = os.path.abspath(directory)
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeSocketDirError("%s is a symbolic link" % directory)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketDirError("%s is not a directory" % directory)
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 or (st.st_uid not in (uid, 0) and not _root_only(os.path.dirname(directory))):
        raise UnsafeSocketDirError(
            "%s is owned by uid %d with mode %04o; it must be owned by uid %d (or root) and not "
            "writable by group or others" % (directory, st.st_uid, mode, uid))
    return st.st_uid


def _root_only(directory: str) -> bool:
    """A root-owned directory that nobody else may write: what is in it, root put there."""
    try:
        st = os.lstat(directory)
    except OSError:
        return False
    return st.st_uid == 0 and not st.st_mode & 0o022 and stat.S_ISDIR(st.st_mode)
