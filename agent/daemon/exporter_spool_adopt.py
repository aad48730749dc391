"""Adopting the exporter spool an older agent left in the hooks' spool directory.

Agents before 2026-12-01 kept each exporter's disk spool in ``<agent.spool_dir>/exporters/<name>``; this one
keeps it in ``<agent.state_dir>/exporters/<name>`` (:class:`~infersight.agent.daemon.spool.DiskSpool`). What
an older agent spooled for a collector that was down would wait in the old place for good: at start the agent
moves it into the new place, before the spool is opened, so its worker sends it first.

The old place is in a directory the socket's group may write: only a spool the agent itself made there is
adopted (each directory its uid's and not writable by group or others; each file a regular file of its uid with
one link), else a member could have it export records of their making. Each directory is opened without
following a link, and both spools are locked as ``DiskSpool`` locks them (an agent still running on either
is left alone).

It is adopted only into an empty new spool (no segment): two spools' segment numbers would collide, and their
order is no longer known. Each segment is renamed into place (one file system: atomic), else copied under a
temporary name, synced, renamed into place, and only then removed from the old place. A marker file in the new
directory says an adoption is under way: the next start, after a crash, finishes it (a segment in both places,
of one size, was copied whole: the old one goes), so no segment is lost or sent twice. The read position
(``pos``) goes last. What cannot be adopted is said: a warning in the log and in ``status``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import NamedTuple

from infersight.agent.errors import AgentError
from infersight.statefiles import DIR_FLAGS, open_state_dir

OLD_SUBDIR = "exporters"  # under agent.spool_dir: where agents before 2026-12-01 kept exporter spools
MARKER = "adopting"  # in the new spool directory while an adoption is under way (it holds the old path)
COPYING = ".adopting"  # a segment being copied across file systems, under its name with this suffix
POS = "pos"


class Adopted(NamedTuple):
    """What :func:`adopt_old_spool` did: ``done`` to log (None: nothing there), or ``warning`` (not adopted)."""

    done: str | None = None
    warning: str | None = None


class _NotAdoptedError(AgentError):
    """Why a leftover spool is not adopted (the warning's text)."""


def _segments(dfd: int) -> list[str]:
    return sorted((n for n in os.listdir(dfd) if n.endswith(".seg") and n[:-4].isdigit()), key=lambda n: int(n[:-4]))


def _own_dir(parent_fd: int, name: str, path: str) -> int:
    """A descriptor of ``parent/name``: a directory of the agent's uid that neither group nor others may write."""
    fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        os.close(fd)
        raise _NotAdoptedError("%s is not this agent's own directory (owner uid %d, mode %04o; the agent is uid %d): "
                          "its records are not trusted" % (path, st.st_uid, stat.S_IMODE(st.st_mode), os.geteuid()))
    return fd


def _check_file(dfd: int, name: str, path: str) -> os.stat_result:
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if (not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid()
            or stat.S_IMODE(st.st_mode) & 0o022):
        raise _NotAdoptedError("%s/%s is not a file the agent wrote (mode %06o, owner uid %d, %d links): its records "
                          "are not trusted" % (path, name, st.st_mode, st.st_uid, st.st_nlink))
    return st


def _same_dir(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _lock(fd: int, path: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise _NotAdoptedError("%s is in use by another agent" % path) from None


def _copy(old_fd: int, new_fd: int, name: str) -> None:
    """``name`` from the old directory into the new one on another file system: whole, synced, then renamed."""
    tmp = name + COPYING
    try:
        os.unlink(tmp, dir_fd=new_fd)  # a crash's partial copy
    except FileNotFoundError:
        pass
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=old_fd)
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=new_fd)
        try:
            while chunk := os.read(src, 1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(dst, view):]
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    os.rename(tmp, name, src_dir_fd=new_fd, dst_dir_fd=new_fd)
    os.fsync(new_fd)


def _same_content(old_fd: int, new_fd: int, name: str) -> bool:
    """Whether ``name`` holds the same bytes in both directories (a copy a crash left whole)."""
    a = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=old_fd)
    try:
        b = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=new_fd)
        try:
            if os.fstat(a).st_size != os.fstat(b).st_size:
                return False
            while chunk := os.read(a, 1 << 20):
                if os.read(b, len(chunk)) != chunk:
                    return False
            return True
        finally:
            os.close(b)
    finally:
        os.close(a)


def _move(old_fd: int, new_fd: int, name: str, path: str) -> str:
    """Move one file; 'renamed', 'copied' or 'resumed' (a crash had copied it whole: the old one goes)."""
    try:
        there = os.stat(name, dir_fd=new_fd, follow_symlinks=False)
    except FileNotFoundError:
        there = None
    if there is not None and name != POS:
        if not _same_content(old_fd, new_fd, name):
            raise _NotAdoptedError("%s/%s is also in the new spool, and differs: the new spool went on since an "
                              "adoption stopped" % (path, name))
        os.unlink(name, dir_fd=old_fd)
        return "resumed"
    try:
        os.rename(name, name, src_dir_fd=old_fd, dst_dir_fd=new_fd)
        return "renamed"
    except OSError as exc:
        if exc.errno != errno.EXDEV:  # another file system: copied
            raise
    _copy(old_fd, new_fd, name)
    os.unlink(name, dir_fd=old_fd)
    return "copied"


def adopt_old_spool(spool_dir: str, state_dir: str, subdir: str, name: str) -> Adopted:
    """Move exporter ``name``'s spool from ``<spool_dir>/exporters/<name>`` into ``<state_dir>/<subdir>`` (see
    the module's docstring). Never raises: what it cannot do is its warning."""
    old_path = os.path.join(spool_dir, OLD_SUBDIR, name)
    new_path = os.path.join(state_dir, subdir)
    if not os.path.lexists(old_path):
        return Adopted()
    fds: list[int] = []
    try:
        try:
            top = os.open(spool_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fds.append(top)
            fds.append(_own_dir(top, OLD_SUBDIR, os.path.join(spool_dir, OLD_SUBDIR)))
            old_fd = _own_dir(fds[-1], name, old_path)
            fds.append(old_fd)
            if _same_dir(old_fd, new_path):  # agent.spool_dir is agent.state_dir: the spool is where it belongs
                return Adopted()
            _lock(old_fd, old_path)
            segments = _segments(old_fd)
            has_pos = os.path.lexists(os.path.join(old_path, POS))
            if not segments and not has_pos:
                return Adopted()
            for seg in segments:
                _check_file(old_fd, seg, old_path)
            if has_pos:
                _check_file(old_fd, POS, old_path)
            new_fd = open_state_dir(state_dir, subdir)
            fds.append(new_fd)
            _lock(new_fd, new_path)
            resuming = os.path.lexists(os.path.join(new_path, MARKER))
            if not segments and not resuming:
                return Adopted()  # a delivered spool's read position alone: nothing to adopt
            if _segments(new_fd) and not resuming:
                raise _NotAdoptedError(
                    "the new spool %s holds records too; once this agent has delivered them (status: spooled=0), "
                    "stop it, move %s/*.seg and %s/pos into %s, and start it" % (new_path, old_path, old_path,
                                                                                new_path))
            marker = os.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=new_fd)
            try:
                os.write(marker, old_path.encode())
                os.fsync(marker)
            finally:
                os.close(marker)
            os.fsync(new_fd)
            how = {_move(old_fd, new_fd, seg, old_path) for seg in segments} or {"resumed"}
            if has_pos:
                _move(old_fd, new_fd, POS, old_path)
            else:  # a position the new spool kept for its own segments must not apply to these
                try:
                    os.unlink(POS, dir_fd=new_fd)
                except FileNotFoundError:
                    pass
            os.fsync(new_fd)
            os.unlink(MARKER, dir_fd=new_fd)
        except _NotAdoptedError as why:
            return Adopted(warning="an older agent's spool of exporter %s is not adopted: %s. Its records wait "
                           "there, undelivered" % (name, why))
        except OSError as exc:
            return Adopted(warning="cannot adopt an older agent's spool of exporter %s from %s into %s: %s. Its "
                           "records wait there, undelivered (a restart tries again; or, as the agent's user, "
                           "move %s/*.seg and pos into %s while the agent is stopped)"
                           % (name, old_path, new_path, exc, old_path, new_path))
        for leftover, parent in ((name, fds[1]), (OLD_SUBDIR, fds[0])):  # empty now: gone too, if nothing else
            try:
                os.rmdir(leftover, dir_fd=parent)
            except OSError:
                break
        return Adopted(done="adopted %d segment(s) of an older agent's spool of exporter %s: %s from %s into %s"
                       % (len(segments), name, "/".join(sorted(how)), old_path, new_path))
    finally:
        for fd in reversed(fds):
            os.close(fd)
