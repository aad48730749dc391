"""Spool files a user's earlier processes left where the agent does not look (stdlib only).

A served process whose user is not yet in the socket's group cannot write the system spool, so
its hooks spool under the user's own state directory (``_paths.private_spool_dir``), which the
agent never reads (and systemd's ProtectHome hides from it). After the operator's documented fix
(``usermod -aG infersight <user>``, a restart of the server) those events stayed there for good.
A later process of the same user that reaches the agent and spools in the system spool moves them
there: each file whose process has ended (its lock is free) is copied under a name the agent
skips, given the same reader ACL the hooks give their own spool files, linked to its name (the
agent then replays it as it replays any ended producer's spool) and removed from the private
directory. It runs once per process, on the drain thread, after the first connect. Its
descriptors are checked by identity before each write and close (:mod:`_fds`): a host that
closes its descriptors meanwhile (``os.closerange``) may have its own files at their numbers.
"""

from __future__ import annotations

import fcntl
import os

from . import _fds, _paths, _spoolfile

MAX_FILES = 64  # files moved by one process (the rest: by the next one)
MAX_BYTES = 64 << 20  # bytes copied by one process: the drain thread sends nothing meanwhile
CHUNK = 1 << 20


def adopt(private: str, shared: str) -> int:
    """Move the spool files of ended processes of this uid from ``private`` into ``shared``, at most
    MAX_FILES files and (past the first file) MAX_BYTES; returns how many. Never raises."""
    try:
        pfd = os.open(private, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    moved = 0
    pid = None
    try:
        pst = os.fstat(pfd)
        pid = (pst.st_dev, pst.st_ino)
        if pst.st_uid != os.getuid():
            return 0
        sfd = os.open(shared, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            sst = os.fstat(sfd)
        except OSError:
            os.close(sfd)
            raise
        try:
            names = sorted(n for n in os.listdir(pfd) if n.endswith(_paths.SPOOL_SUFFIX))
            budget = MAX_BYTES
            for name in names[:MAX_FILES]:
                if not (_fds.same(pfd, pid) and _fds.same(sfd, (sst.st_dev, sst.st_ino))):
                    break  # the host closed them: their numbers may be its files now
                size = _move(pfd, sfd, sst, name, budget if moved else None)
                if size is not None:
                    moved += 1
                    budget -= size
                    if budget <= 0:
                        break
        finally:
            _fds.close_own(sfd, (sst.st_dev, sst.st_ino))
    except OSError:
        pass
    finally:
        if pid is None:
            os.close(pfd)  # (its fstat failed: not checked, as before)
        else:
            _fds.close_own(pfd, pid)
    return moved


def _move(pfd: int, sfd: int, sst: os.stat_result, name: str, budget: int | None) -> int | None:
    """Move one file (its size), or None: not an ended process's file of ours, larger than ``budget``
    (left for the next process), or a failure."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=pfd)
    except OSError:
        return None
    tmp = ".%s.%d.adopt" % (name, os.getpid())  # not *.spool: the agent leaves it alone meanwhile
    out = -1
    oid = fid = None
    try:
        st = os.fstat(fd)
        fid = (st.st_dev, st.st_ino)
        if not (st.st_mode & 0o170000 == 0o100000 and st.st_nlink == 1 and st.st_uid == os.getuid()):
            return None
        if budget is not None and st.st_size > budget:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # its process is alive: it replays the file itself
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=sfd)
        oid = _fds.ident(out)
        _spoolfile.let_directory_owner_read(out, sst.st_uid, sst.st_mode)
        while True:
            if not (_fds.same(fd, fid) and _fds.same(out, oid)):
                raise OSError("a descriptor is no longer ours")
            chunk = os.read(fd, CHUNK)
            if not chunk:
                break
            _spoolfile.write_all(out, chunk)
        if not _fds.same(out, oid):
            raise OSError("a descriptor is no longer ours")
        os.fsync(out)
        os.link(tmp, name, src_dir_fd=sfd, dst_dir_fd=sfd)  # FileExistsError: a name taken, left as is
        os.unlink(name, dir_fd=pfd)
        return st.st_size
    except OSError:
        return None
    finally:
        if out >= 0:
            _fds.close_own(out, oid)
            try:
                os.unlink(tmp, dir_fd=sfd)
            except OSError:
                pass
        _fds.close_own(fd, fid)
