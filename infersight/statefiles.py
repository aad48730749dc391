"""The agent's own state directory (``agent.state_dir``): checked, and opened without links.

Exporter disk spools, the cold-start history and the default OTLP file live there. Only the
agent may write it: the directory is a real directory (not a symbolic link) owned by the
agent's uid (or root) with no write bit for group or others. Every file in it is opened
relative to a descriptor of that checked directory, each component with ``O_NOFOLLOW``, so
a link planted anywhere below is refused (ELOOP), never followed.

Use :func:`open_state_file` to open a file there (any module: it is stdlib only), and
:func:`ensure_state_dir` once at start.
"""

from __future__ import annotations

import logging
import os
import stat

from infersight.errors import InfersightError

log = logging.getLogger("infersight.statefiles")

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeStateDirError(InfersightError, OSError):
    """The state directory could be written by someone other than the agent."""


def _problem(st: os.stat_result, path: str, owner: int) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "%s is a symbolic link" % path
    if not stat.S_ISDIR(st.st_mode):
        return "%s is not a directory" % path
    if st.st_uid not in (owner, 0):
        if owner == 0:
            return "%s is owned by uid %d, not by root (the agent's uid)" % (path, st.st_uid)
        return "%s is owned by uid %d, neither by the agent's uid %d nor by root" % (path, st.st_uid, owner)
    if stat.S_IMODE(st.st_mode) & 0o022:
        return "%s is writable by group or others (mode %04o)" % (path, stat.S_IMODE(st.st_mode))
    return None


def chmod_dir(path: str, mode: int, seen: os.stat_result) -> None:
    """Set ``mode`` on the directory ``path`` that ``os.lstat`` returned as ``seen``, never
    through a link: through a descriptor opened with ``O_NOFOLLOW`` (``os.chmod`` with
    ``follow_symlinks=False`` raises NotImplementedError where glibc is older than 2.32, as
    on Debian 11, Ubuntu 20.04 or RHEL 8). Raises OSError, also when what is there now is
    not the directory that was looked at."""
    fd = os.open(path, DIR_FLAGS)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino):
            raise OSError("%s was replaced while being checked" % path)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _shared_ancestor(path: str) -> str | None:
    """The highest ancestor of ``path`` that others may write without the sticky bit (they
    could rename what lies below it and put their own in its place), or None."""
    ancestors = []
    parent = os.path.dirname(path)
    while parent and parent != path:
        ancestors.append(parent)
        path, parent = parent, os.path.dirname(parent)
    for anc in reversed(ancestors):  # from the root down
        st = os.stat(anc)
        if stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX:
            return anc
    return None


def refusal(path: str, owner: int | None = None) -> str | None:
    """Why :func:`ensure_state_dir` would refuse the existing ``path`` (a symbolic link, not a
    directory, another owner), or None: it is usable as it is, fixable (a mode of the agent's own
    to tighten) or absent. A default location is chosen with it (``/var/lib/infersight`` is
    writable by root, but a service's, owned by its user, is not root's state directory)."""
    owner = os.geteuid() if owner is None else owner
    try:
        st = os.lstat(path)
    except OSError:
        return None
    why = _problem(st, os.path.abspath(path), owner)
    return None if why is None or _fixable(st, owner) else why


def _fixable(st: os.stat_result, owner: int) -> bool:
    """A directory of ours (``lstat``'s: never a link): a wrong mode is ours to fix, not a refusal."""
    return st.st_uid == owner and stat.S_ISDIR(st.st_mode)


def ensure_state_dir(path: str, owner: int | None = None) -> list[str]:
    """Make ``path`` (0700) if absent, and check it: raise :class:`UnsafeStateDirError` when
    another user could write it. A directory of ours that is group- or world-writable is
    fixed (its write bits for group and others are removed, logged): the agent's own mistake, say
    an older version's mode, is not a reason to stop. A symbolic link or another owner is refused.

    An ancestor that others may write without the sticky bit (a Kubernetes ``emptyDir`` is
    0777) is not refused but returned as a warning: every later open walks the components
    below it with ``O_NOFOLLOW`` and checks the directory it reaches, so a member who swaps
    the directory can make the agent's writes fail (counted), never redirect them."""
    owner = os.geteuid() if owner is None else owner
    path = os.path.abspath(path)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise UnsafeStateDirError(exc.errno, "cannot make the state directory %s: %s" % (path, exc.strerror)) from exc
    why = _problem(st, path, owner)
    if why is not None and _fixable(st, owner):
        fixed = stat.S_IMODE(st.st_mode) & ~0o022
        try:
            chmod_dir(path, fixed, st)
        except OSError as exc:
            raise UnsafeStateDirError(exc.errno, "cannot fix the mode of %s: %s" % (path, exc)) from exc
        why = _problem(os.lstat(path), path, owner)
        if why is None:
            log.warning("state directory %s was writable by group or others (mode %04o): those bits are "
                        "removed (now %04o)", path, stat.S_IMODE(st.st_mode), fixed)
    if why is not None:
        raise UnsafeStateDirError(why)
    shared = _shared_ancestor(path)
    if shared is None:
        return []
    return ["%s (above the state directory %s) is writable by others without the sticky bit: a member "
            "could move the state directory away and stop the agent recording; no link there is "
            "followed" % (shared, path)]


def _open_checked_path(state_dir: str) -> int:
    """A descriptor of ``state_dir``: links are followed only above the highest ancestor that
    others may write (the administrator's), never at or below it."""
    path = os.path.abspath(state_dir)
    shared = _shared_ancestor(path)
    if shared is None:
        return os.open(path, DIR_FLAGS)
    fd = os.open(shared, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in os.path.relpath(path, shared).split("/"):
            nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_state_dir(state_dir: str, subdir: str = "", *, create: bool = True) -> int:
    """A descriptor of ``state_dir`` (checked: see :func:`ensure_state_dir`'s rule) or of
    ``subdir`` below it, each component opened with ``O_NOFOLLOW`` (made 0700 when absent
    and ``create``). The caller closes it. Raises OSError (ELOOP for a link)."""
    fd = _open_checked_path(state_dir)
    try:
        why = _problem(os.fstat(fd), state_dir, os.geteuid())
        if why is not None:
            raise UnsafeStateDirError(why)
        for part in [p for p in subdir.split("/") if p not in ("", ".")]:
            if part == "..":
                raise UnsafeStateDirError("%r leaves the state directory" % subdir)
            if create:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
                raise UnsafeStateDirError("%s/%s is not the agent's own directory" % (state_dir, subdir))
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_state_file(state_dir: str, relpath: str, flags: int, mode: int = 0o600) -> int:
    """Open ``state_dir/relpath`` without following a link at any component below the
    checked ``state_dir``; directories on the way are made (0700) when ``flags`` has
    ``O_CREAT``. Returns the descriptor (``O_CLOEXEC``); raises OSError."""
    subdir, name = os.path.split(relpath)
    if not name or name in (".", ".."):
        raise UnsafeStateDirError("%r names no file" % relpath)
    dfd = open_state_dir(state_dir, subdir, create=bool(flags & os.O_CREAT))
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
    finally:
        os.close(dfd)


# Files this process made for itself, exclusively (launch's default output, named by the time, in a working
# directory others may write): opened again never through a link, and only while each is still a regular file of
# this user, whatever was planted in its place meanwhile.
OWN_FILES: set[str] = set()
OWN_FILE_TRIES = 4


def create_own_file(path: str, mode: int = 0o666) -> str:
    """Create ``path`` (or, when that name is taken, ``path`` with a random suffix before its extension), exclusively
    and not through a link; returns the name made, noted in ``OWN_FILES``. OSError when none could be made.
    A name another user planted (a link to the victim's notes, a FIFO that hung launch, a file of theirs it would
    have written into) is never opened."""
    head, ext = os.path.splitext(path)
    if head.endswith(".otlp"):  # infersight-<time>.otlp.jsonl: the suffix before .otlp
        head, ext = head[: -len(".otlp")], ".otlp" + ext
    for attempt in range(OWN_FILE_TRIES):
        candidate = path if attempt == 0 else "%s-%s%s" % (head, os.urandom(3).hex(), ext)
        try:
            os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode))
        except FileExistsError:
            if attempt == OWN_FILE_TRIES - 1:
                raise
            continue
        OWN_FILES.add(os.path.abspath(candidate))
        return candidate
    raise FileExistsError(path)  # not reached


def check_own_file(fd: int, path: str) -> None:
    """Raise OSError unless ``fd`` (opened with O_NOFOLLOW) is a regular file of this user: the name this process
    made was replaced meanwhile (``create_own_file``)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError("%s was replaced by another user's %s since this run made it" % (
            path, "file" if stat.S_ISREG(st.st_mode) else "non-file"))
