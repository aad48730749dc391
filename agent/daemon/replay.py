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

from infersight.agent.daemon.assemble import Producer
from infersight.agent.daemon.identity import Peer
from infersight.agent.daemon.receive import Receiver
from infersight.agent.daemon.sanitize import decode_frame
from infersight.hooks import _paths, _wire


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
        except OSError:
            return False  # gone, or a symlink (ELOOP)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                counters.spool_files_refused += 1
                rx.rlog.warn("spool", "not replaying %s: not a regular file with one link", path)
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # its producer is alive and replays it itself
            if not rx.allowed(st.st_uid, st.st_gid):
                counters.spool_files_refused += 1
                rx.rlog.warn("spool", "not replaying %s: owner uid %d is not allowed", path, st.st_uid)
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
                    producer = rx.hello(msg, None, Peer(st.st_uid, None))
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
