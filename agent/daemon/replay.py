"""Replaying the hooks' spool files: what a producer wrote to disk and could not send.

A spool file (``<producer id>-<random>.spool``, written by ``hooks/_spoolfile.py``) is the
wire's frame stream: the producer's hello, then batches. Its producer holds an ``flock`` on
it while it lives and replays it itself; a file whose lock is free belongs to a process that
has ended, and the agent reads it like a connection: the hello (checked against the file's
owner), then each batch, and unlinks it once every exporter has all of it.

Whoever may write the directory (its group, by design) is not trusted with our reads and
unlinks: names are opened relative to the directory without following a symlink or blocking
on a FIFO, only a regular file with one link is read, and it is unlinked only if the name
still holds that same file.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Callable

from infersight.agent.daemon.assemble import Producer, ProducerTableFull
from infersight.agent.daemon.identity import Peer
from infersight.agent.daemon.receive import Receiver
from infersight.agent.daemon.sanitize import decode_frame
from infersight.hooks import _paths, _wire

MAX_PASSED_OVER = 4096  # files remembered as counted already (the oldest forgotten first)


def unlink_if_same(directory: str, name: str, identity: tuple[int, int]) -> None:
    """Unlink ``directory/name`` only if it is still the file we read (device, inode)."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == identity:
            os.unlink(name, dir_fd=dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


class SpoolReplay:
    """``ended(producer)`` runs after a file is read: its process has ended (its lock was
    free), so the ingest closes what it left open, unless it is connected again."""

    def __init__(self, receiver: Receiver, ended: Callable[[Producer], None]) -> None:
        self.receiver = receiver
        self.ended = ended
        self._replaying: set[str] = set()  # files published but not yet exported
        self._passed_over: dict[tuple[int, int], None] = {}  # (device, inode) of files refused: counted once

    def replay(self, directory: str, prefix: str = "") -> int:
        """Replay the spool files whose producer has died (its lock is free); returns files done."""
        try:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return 0
        try:
            names = sorted(n for n in os.listdir(dfd) if n.endswith(_paths.SPOOL_SUFFIX) and n.startswith(prefix))
            return sum(1 for name in names if self._replay_one(directory, dfd, name))
        except OSError:
            return 0
        finally:
            os.close(dfd)

    def _replay_one(self, directory: str, dfd: int, name: str) -> bool:
        path = os.path.join(directory, name)
        if path in self._replaying:
            return False
        rx, counters = self.receiver, self.receiver.counters
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        except PermissionError:
            self._unreadable(directory, dfd, name)
            return False
        except OSError:
            return False  # gone, or a symlink (ELOOP)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                self._refuse(st, path, "not a regular file with one link")
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # its producer is alive and replays it itself
            if not rx.allowed(st.st_uid, st.st_gid):
                self._refuse(st, path, "owner uid %d is not allowed" % st.st_uid)
                return False
            frames = self._read_frames(fd)
            producer: Producer | None = None
            self._replaying.add(path)
            outstanding = [1]  # batches not yet complete, +1 until all are published
            identity = (st.st_dev, st.st_ino)

            def one_done() -> None:
                outstanding[0] -= 1
                if outstanding[0] == 0:  # every exporter has it: now the file may go
                    self._replaying.discard(path)
                    unlink_if_same(directory, name, identity)

            for payload in frames:
                msg = decode_frame(payload)
                if msg is None:
                    counters.malformed_frames += 1
                    continue
                if producer is None:
                    try:
                        producer = rx.hello(msg, None, Peer(st.st_uid, None))
                    except ProducerTableFull as exc:  # nothing published yet: the file waits for a later scan
                        self._replaying.discard(path)
                        rx.rlog.warn("spool-later", "replaying %s later: %s", path, exc)
                        return False
                    if producer is None:
                        break
                    continue
                if msg.get("t") == "b":
                    outstanding[0] += 1
                    rx.process_batch(producer, msg.get("e"), on_done=one_done)
                else:
                    counters.malformed_frames += 1
            counters.spool_files_replayed += 1
            if producer is not None:
                self.ended(producer)
            one_done()
            return True
        finally:
            os.close(fd)

    def _refuse(self, st: os.stat_result, path: str, why: str) -> None:
        """Count and say a file passed over, once per file (every scan finds it again)."""
        if self._first_time(st):
            self.receiver.counters.spool_files_refused += 1
            self.receiver.rlog.warn("spool", "not replaying %s: %s", path, why)

    def _unreadable(self, directory: str, dfd: int, name: str) -> None:
        """A file the agent may not read: spooled by hooks older than the reader ACL (0600, its owner's
        alone), or on a file system without ACLs. Its events stay on disk: say so once, with the fix."""
        path = os.path.join(directory, name)
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return
        if not self._first_time(st):
            return
        self.receiver.counters.spool_files_unreadable += 1
        self.receiver.rlog.warn(
            "spool-unreadable", "cannot replay %s (owner uid %d, mode %04o): this agent (uid %d) may not read it; "
            "hooks of this version grant the spool directory's owner read access (a POSIX ACL): upgrade the "
            "served process's infersight, and check that the file system supports ACLs", path, st.st_uid,
            stat.S_IMODE(st.st_mode), os.geteuid())

    def _first_time(self, st: os.stat_result) -> bool:
        """Whether this file (device, inode) is passed over for the first time; remembered."""
        key = (st.st_dev, st.st_ino)
        if key in self._passed_over:
            return False
        if len(self._passed_over) >= MAX_PASSED_OVER:
            self._passed_over.pop(next(iter(self._passed_over)))
        self._passed_over[key] = None
        return True

    def _read_frames(self, fd: int) -> list[bytes]:
        data = b""
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            data += chunk
        frames, _rest, bad = _wire.split_frames(data)
        if bad:
            self.receiver.counters.oversized_frames += 1
        return frames
