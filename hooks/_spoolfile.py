"""This process's spool file: where batches wait while the agent is away or falls behind.

The file is the wire's frame stream (:mod:`_wire`): this producer's hello, then batch
frames, appended in order and read back in order (by :class:`~._client.Client` on
reconnect, or by the agent once this process has died and its lock is free).

Local users are not trusted: the file is created fresh (``O_EXCL|O_NOFOLLOW``, an
unguessable name) in a directory opened without following a symlink, locked while we live,
and truncated and unlinked only through our own descriptors. A file someone else removed is
noticed (``vanished``) and what it still held is rescued into a new one.

Descriptors are checked by identity (:mod:`_fds`), not trusted by number: a host that closed
them (``os.closerange``, daemonizing) may have its own files at those numbers by now. Before each
use the file's identity is checked (one ``fstat``, on the drain thread); a descriptor no longer
ours is forgotten without being closed, counted (``lost_count``), and the file is opened again
by its name if it is still the same file, else left for the agent (its lock is free).

Only the drain thread (or ``close`` holding the client's lock) calls these methods.
"""

from __future__ import annotations

import errno  # already loaded at start-up
import fcntl
import os
import stat
import struct  # already loaded by _wire
import time

from . import _fds, _paths, _wire
from ._env import say

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Tuple

    Handles = Tuple[Optional[int], Optional[int], str]  # (file fd, directory fd, name)
    Ident = Tuple[int, int]

# Every descriptor a SpoolFile opened -> its identity: ``close_fds`` and ``unlink_own`` get bare
# numbers (``Handles``) and must not touch one that is the host's now.
_OWNED: Dict[int, Ident] = {}

RETRY_S = 5.0  # after an error, batches are dropped (and counted) this long before a retry
READ_BYTES = 1 << 20  # what one replay step reads


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until done; a short write that cannot finish raises OSError."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError("short write")
        view = view[n:]


# POSIX ACLs in the kernel's extended-attribute form (linux/posix_acl_xattr.h: little-endian version 2, then
# (tag, permissions, id) entries in tag order).
_ACL_XATTR = "system.posix_acl_access"
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_NO_ID = 0xFFFFFFFF


def reader_acl(uid: int) -> bytes:
    """An access ACL: the owner reads and writes, ``uid`` reads, nobody else has anything."""
    entries = ((_ACL_USER_OBJ, 6, _ACL_NO_ID), (_ACL_USER, 4, uid), (_ACL_GROUP_OBJ, 0, _ACL_NO_ID),
               (_ACL_MASK, 4, _ACL_NO_ID), (_ACL_OTHER, 0, _ACL_NO_ID))
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


OVERFLOW_UID = 65534  # how an owner outside this user namespace reads: nobody's, never granted


def let_directory_owner_read(fd: int, dir_uid: int, dir_mode: int) -> str:
    """The shared spool directory belongs to the agent's user (tmpfiles.d makes it infersight's, 3770): our
    file (0600, ours) must be readable by that user, or the agent cannot replay it once we have died; and by
    that user alone, not by the other members of the directory's group (other tenants of the host). A POSIX
    ACL says exactly that. Nothing to do when the directory is ours or root's (root reads anyway), and
    nothing granted where anyone may have made the directory (writable by others, as a sticky /tmp is:
    its owner is then whoever came first) or where its owner is unmapped. Returns why it could not be done
    ("" when done or not needed)."""
    if dir_uid in (os.geteuid(), 0, OVERFLOW_UID) or dir_mode & stat.S_IWOTH:
        return ""
    try:
        os.setxattr(fd, _ACL_XATTR, reader_acl(dir_uid))
    except (OSError, AttributeError) as exc:  # AttributeError: no os.setxattr (not Linux)
        return getattr(exc, "strerror", None) or str(exc)
    return ""


def _own(fd: int, ident: Ident) -> None:
    _OWNED[fd] = ident


def _mine(fd: Optional[int]) -> bool:
    """``fd`` is a descriptor a SpoolFile opened and it is still that one (one ``fstat``)."""
    return fd is not None and _fds.same(fd, _OWNED.get(fd))


def close_fds(handles: Handles) -> None:
    """Close the file's and the directory's descriptors, each only if still ours (a number the
    host reused is left to it, and counted)."""
    for d in handles[:2]:
        if d is not None:
            _fds.close_own(d, _OWNED.pop(d, None))


def unlink_own(fd: int, dfd: Optional[int], name: str) -> None:
    """Unlink ``name`` in the directory we opened, only if it is still our file: whoever
    else can write there may have swapped a symlink or another file in since (and both
    descriptors must still be ours, not host files that took their numbers)."""
    if dfd is None or not (_mine(fd) and _mine(dfd)):
        return
    try:
        mine, now = os.fstat(fd), os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
            os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


class SpoolFile:
    """At most one open file at a time; a new one is made when a batch needs it."""

    def __init__(self, directory: str, producer: Dict[str, Any], max_bytes: int) -> None:
        self.directory = directory
        self.producer = producer  # shared with the connection: its hello is this file's head
        self.max_bytes = max_bytes
        self.fd: Optional[int] = None
        self.dir_fd: Optional[int] = None
        self.name = ""
        self.size = 0  # bytes written
        self.read = 0  # bytes sent back to the agent (or copied elsewhere)
        self.head = 0  # the hello: what the agent must read before our frames
        self.retry_at = 0.0  # monotonic: no writes before this, after an error
        self.error = ""  # why the last write or open failed
        self.vanished_count = 0  # our file was removed by someone else (its frames were rescued)
        self.acl_warned = False  # said once: the directory's owner (the agent) cannot be let read our file
        self.ident: Optional[Ident] = None  # the file's identity (st_dev, st_ino), while open
        self.dir_ident: Optional[Ident] = None
        self.lost_count = 0  # our descriptors found closed or reused by the host (os.closerange)
        self.reopened_count = 0  # ... of which the file was opened again by its name

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name) if self.name else ""

    def pending(self) -> bool:
        """Frames written and not yet sent back."""
        return self.read < self.size

    def usable(self) -> bool:
        return time.monotonic() >= self.retry_at

    def fits(self, nbytes: int) -> bool:
        return self.size + nbytes <= self.max_bytes

    def _failed(self, why: str) -> None:
        """Drop (and count) spooled batches for a while, rather than retry on every batch."""
        self.error = why
        self.retry_at = time.monotonic() + RETRY_S

    def open(self, acked: int) -> bool:
        """Create a fresh file, unless one is open: never an existing file, never through a
        symlink. ``acked``: what an agent already has, written into the file's hello so that
        the agent that replays it after our death (another launch, say) does not count those
        events as lost."""
        if time.monotonic() < self.retry_at:
            return False
        if self.fd is not None:
            return True
        # Unguessable, so nobody can plant anything at the name first.
        name = _paths.spool_file_name(self.producer["id"], os.urandom(8).hex())
        dfd = fd = None
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            dst = os.fstat(dfd)
            dir_ident = (dst.st_dev, dst.st_ino)
            _own(dfd, dir_ident)
            mode = dst.st_mode
            if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
                raise OSError("the directory is writable by everyone (mode %04o)" % stat.S_IMODE(mode))
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND,
                         0o600, dir_fd=dfd)
            ident = _fds.ident(fd)
            _own(fd, ident)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while we live
            unreadable = let_directory_owner_read(fd, dst.st_uid, mode)
            if unreadable and not self.acl_warned:
                self.acl_warned = True
                say("the spool file in %s cannot be made readable by its owner, uid %d (the agent): %s; if this "
                    "process dies before the agent is back, what it spooled is not replayed"
                    % (self.directory, dst.st_uid, unreadable))
            hello = _wire.hello_frame(self.producer, acked)
            write_all(fd, hello)
        except OSError as exc:
            if fd is not None:
                unlink_own(fd, dfd, name)
            close_fds((fd, dfd, name))
            link = exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(self.directory)
            why = "a symbolic link, not followed" if link else exc.strerror or str(exc)
            self._failed("%s: %s" % (self.directory, why))
            return False
        if not _mine(fd):  # the host closed it while we wrote the hello: never ours to use
            close_fds((fd, dfd, name))
            self._failed("%s: the spool file was closed by the host" % self.directory)
            return False
        self.fd, self.dir_fd, self.name = fd, dfd, name
        self.ident, self.dir_ident = ident, dir_ident
        self.size = self.read = self.head = len(hello)
        return True

    def _check(self) -> Optional[os.stat_result]:
        """The open file's status, read through a descriptor verified to be still ours (one
        ``fstat``); None when no file is open, or ours was lost (``_lost``: reopened by name
        when it can be, and then checked again)."""
        fd = self.fd
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == self.ident:
                return st
        except OSError:
            pass
        if self._lost():
            try:
                return os.fstat(self.fd)  # type: ignore[arg-type]
            except OSError:
                pass
        return None

    def _lost(self) -> bool:
        """The host closed our descriptors (their numbers may be its own files now): forget them
        without closing them, count it, and open the same file again by its name (still our
        file: same device and inode; locked again), keeping our place in it. True when
        reopened; else the file is left where it is, unlocked: the agent replays it."""
        fd, dfd, name, ident, dir_ident = self.fd, self.dir_fd, self.name, self.ident, self.dir_ident
        if fd is not None and not _mine(fd):
            _OWNED.pop(fd, None)
        if dfd is not None and not _mine(dfd):
            _OWNED.pop(dfd, None)
            dfd = None  # not ours either: open the directory again
        self.fd = self.dir_fd = None
        self.ident = self.dir_ident = None
        self.lost_count += 1
        _fds.lost += 1
        made: List[Tuple[int, Ident]] = []  # opened here, closed again on failure
        try:
            if dfd is None:
                d = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                made.append((d, _fds.ident(d)))
                if made[-1][1] != dir_ident:
                    raise OSError("another directory")
                dfd = d
            f = os.open(name, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
            made.append((f, _fds.ident(f)))
            if made[-1][1] != ident:
                raise OSError("another file")
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken: the agent replays it already
            if os.fstat(f).st_size < self.size:
                raise OSError("cut short")
        except (OSError, ValueError):
            for d, did in made:
                _fds.close_own(d, did)
            if dfd is not None and all(dfd != d for d, _ in made):
                close_fds((None, dfd, ""))
            self.name = ""
            self.size = self.read = self.head = 0
            return False
        for d, did in made:
            _own(d, did)
        self.fd, self.dir_fd, self.ident, self.dir_ident = f, dfd, ident, dir_ident
        self.reopened_count += 1
        return True

    def vanished(self) -> bool:
        """Our file has no name any more: someone removed it (the directory's owner, root,
        or a group member where the directory lacks its sticky bit). Checks, too, that our
        descriptor is still ours (``_check``): the one ``fstat`` of a write."""
        st = self._check()
        return st is not None and st.st_nlink == 0

    def rescue(self, acked: int) -> None:
        """Its unsent frames are still readable through our descriptor: copy them into a
        fresh file (with its own hello) and count the removal."""
        rest = self.unread()
        close_fds(self.detach())
        self.vanished_count += 1
        say("the spool file was removed by someone else; %d byte(s) of events rescued into a new one" % len(rest))
        if rest and self.open(acked):
            fd = self.fd
            assert fd is not None
            try:
                write_all(fd, rest)
                self.size += len(rest)
            except OSError:
                self.abandon()

    def write(self, frame: bytes, acked: int) -> str:
        """Append frames; "" when written, else why they were not (the caller counts them lost)."""
        if self.vanished():
            self.rescue(acked)
        full = "the spool is full (%d bytes)" % self.max_bytes
        if not self.fits(len(frame)) or not self.open(acked):
            return self.error if not self.usable() else full
        fd = self.fd
        assert fd is not None
        if not self.fits(len(frame)):  # the hello took the room
            return full
        try:
            write_all(fd, frame)
        except OSError as exc:
            self._failed("%s: %s" % (self.path, exc.strerror or exc))
            try:  # a partial frame would garble every frame after it: cut it off
                os.ftruncate(fd, self.size)
            except OSError:
                self.abandon()
            return self.error
        self.size += len(frame)
        return ""

    def next_frames(self) -> Optional[List[bytes]]:
        """The next unread frames (payloads, whole), at least one while any is pending; None
        when the file cannot be read here (it is then abandoned: the agent replays it later).
        :meth:`consumed` moves past each one once it is sent."""
        if self._check() is None:
            return [] if self.fd is None and not self.pending() else None
        fd = self.fd
        assert fd is not None
        try:
            data = os.pread(fd, min(READ_BYTES, self.size - self.read), self.read)
            frames, _rest, _bad = _wire.split_frames(data)
            if not frames:
                # A frame larger than one read: read exactly that frame.
                (n,) = _wire.HEADER.unpack_from(data, 0)
                frames = [os.pread(fd, n, self.read + _wire.HEADER.size)]
        except (OSError, struct.error):
            self.abandon()
            return None
        return frames

    def consumed(self, payload: bytes) -> None:
        self.read += _wire.HEADER.size + len(payload)

    def unread(self) -> bytes:
        """The frames not sent back yet (empty when unreadable)."""
        if self._check() is None or self.fd is None:
            return b""
        try:
            return os.pread(self.fd, self.size - self.read, self.read)
        except OSError:
            return b""

    def detach(self) -> Handles:
        """Forget the open file, handing its descriptors and name to the caller."""
        handles = (self.fd, self.dir_fd, self.name)
        self.fd = self.dir_fd = None
        self.ident = self.dir_ident = None
        self.name = ""
        self.size = self.read = 0
        return handles

    def discard(self) -> None:
        """Fully delivered: truncate and unlink it, through our descriptors."""
        self._check()  # (lost: reopened by name when it can be, so that it is emptied and removed)
        fd, dfd, name = self.detach()
        if fd is None:
            return
        try:
            if _mine(fd):
                os.ftruncate(fd, 0)
                unlink_own(fd, dfd, name)
        except OSError:
            pass
        finally:
            close_fds((fd, dfd, name))

    def abandon(self) -> None:
        """Stop using the file but keep it: closing it frees its lock, so the agent replays
        what it holds. A later batch starts a new file."""
        close_fds(self.detach())

    def close(self) -> None:
        """Close it as it is (at exit: the lock goes, the agent may replay it now)."""
        if self.fd is not None:
            close_fds(self.detach())

    def close_inherited(self) -> None:
        """In a forked child: close our copies of the parent's descriptors, nothing more."""
        close_fds((self.fd, self.dir_fd, ""))
        self.fd = self.dir_fd = None
        self.ident = self.dir_ident = None
