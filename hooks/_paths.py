"""Where the hooks and the agent meet, as DESIGN defines them (stdlib only; docs/wire.md).

The agent's socket and the rule its directory must pass, the spool directory and the names
of the spool files in it, and the storage ceiling cache the agent writes and the hooks read.
Both sides take every location from here.
"""

from __future__ import annotations

import os
import stat  # already loaded by os: no import cost

from . import _env

SYSTEM_SOCKET_DIR = "/run/infersight"
SYSTEM_SPOOL_DIR = "/var/lib/infersight/spool"
SPOOL_SUFFIX = ".spool"  # a producer's spool file: ``<producer id>-<16 hex digits>.spool``


def spool_file_name(producer_id: str, token: str) -> str:
    """The name of a spool file of ``producer_id``; ``token``: random, so nobody can plant a file there first."""
    return "%s-%s%s" % (producer_id, token, SPOOL_SUFFIX)


def spool_prefix(producer_id: str) -> str:
    """What the names of ``producer_id``'s spool files begin with (the agent replays by it)."""
    return producer_id + "-"


def socket_path(env: os._Environ[str] | dict[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    explicit: str | None = _env.get("INFERSIGHT_SOCKET", env)
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
    explicit: str | None = _env.get("INFERSIGHT_SPOOL_DIR", env)
    if explicit:
        return explicit
    if os.access(SYSTEM_SPOOL_DIR, os.W_OK):
        return SYSTEM_SPOOL_DIR
    return private_spool_dir(env)


def private_spool_dir(env: os._Environ[str] | dict[str, str] | None = None) -> str:
    """Where a user's hooks spool when the system spool is not theirs to write (not yet in the
    socket's group): the agent does not read it; a later process of this user that can write the
    system spool moves what ended processes left there (``_spool_adopt``)."""
    env = os.environ if env is None else env
    state = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "infersight", "spool")


def storage_ceiling_file(env: os._Environ[str] | dict[str, str] | None = None) -> str:
    """The agent's cache of storage read ceilings per device, which the hooks read:
    ``$XDG_CACHE_HOME/infersight/storage_ceiling.json`` (default ``~/.cache``)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "infersight", "storage_ceiling.json")


class HooksError(Exception):
    """Base of the exceptions of infersight.hooks (which imports nothing else of ours)."""


class UnsafeSocketDirError(HooksError, ValueError):
    """The socket's directory could be another local user's: not to be used."""


def fallback_owner(socket_path: str, env: os._Environ[str] | dict[str, str] | None = None) -> int | None:
    """The uid that must own the socket's directory when it is a per-user fallback location,
    ``$XDG_RUNTIME_DIR/infersight`` or ``/tmp/infersight-<uid>`` (derived or configured): there,
    another local user could have made the directory first. None elsewhere: ``/run/infersight``
    only root can make, and any other configured path is the operator's choice (e.g. a
    Kubernetes emptyDir shared by the pod's containers), used as given."""
    env = os.environ if env is None else env
    directory = os.path.dirname(os.path.abspath(socket_path))
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and directory == os.path.join(os.path.abspath(runtime), "infersight"):
        return os.geteuid()
    parent, name = os.path.split(directory)
    if parent == "/tmp" and name.startswith("infersight-") and name[len("infersight-"):].isdigit():
        return int(name[len("infersight-"):])
    return None


def check_socket_dir(directory: str, owner: int) -> None:
    """Raise ``UnsafeSocketDirError`` unless ``directory`` is a real directory (``lstat``: not a
    symbolic link) owned by ``owner`` or root and writable by its owner only (and OSError, e.g.
    FileNotFoundError, from lstat). Agent and hooks both apply this one rule."""
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeSocketDirError("%s is a symbolic link" % directory)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketDirError("%s is not a directory" % directory)
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022 or st.st_uid not in (owner, 0):
        raise UnsafeSocketDirError(
            "%s is owned by uid %d with mode %04o; it must be owned by uid %d (or root) and not "
            "writable by group or others" % (directory, st.st_uid, mode, owner))
