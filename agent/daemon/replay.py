"""Replaying the hooks' spool files: what a producer wrote to disk and could not send.

A spool file (``<producer id>-<random>.spool``, written by ``hooks/_spoolfile.py``) is the
wire's frame stream: the producer's hello, then batches. Its producer holds an ``flock`` on
it while it lives and replays it itself; a file whose lock is free belongs to a process that
has ended, and the agent reads it like a connection: the hello (checked against the file's
owner), then each batch, and unlinks it once every exporter has all of it.

Whoever may write the directory (its group, by design) is not trusted with our reads and
unlinks: names are opened relative to the directory without following a symlink or blocking
on a FIFO, only a regular file with one link is read, and it is unlinked only if the name
still holds that same file. Nor with the agent's time: a file is read in pieces and its frames
taken one at a time (a planted 256 MiB sparse file had the agent read, split and decode it in one
go, holding the event loop for minutes); a run of frames that are not the wire's ends the file
(refused, counted once); and the scans of the whole directory (at start, every few seconds, at a
joined launch's end) give the loop back every few hundred frames (``replay_async``). Only the
replay of one ended producer's own files runs in one go, and only for files no larger than the
hooks write by default.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import stat
from collections.abc import Callable, Generator, Iterator

from infersight.agent.daemon.assemble import Producer, ProducerTableFull
from infersight.agent.daemon.identity import Peer
from infersight.agent.daemon.receive import Receiver
from infersight.agent.daemon.sanitize import decode_frame
from infersight.hooks import _paths, _wire

MAX_PASSED_OVER = 4096  # files remembered as counted already (the oldest forgotten first)
READ_CHUNK = 1 << 20
MAX_MALFORMED_RUN = 64  # frames in a row that are not the wire's: the file is not a spool the hooks wrote
STEP_FRAMES = 256  # frames between two returns of the loop in an asynchronous replay
# The replay of one ended producer's files runs in one go (its events come before its end is decided): up to the
# hooks' default spool size; a larger file (a raised INFERSIGHT_SPOOL_MAX_BYTES, or planted under its prefix) waits
# for the next scan, which gives the loop back as it goes.
SYNC_MAX_BYTES = 64 << 20

Step = Generator[None, None, bool]  # one file's replay: yields between pieces of work, returns whether it was done


def _advance(step: Step) -> bool | None:
    """One piece of a file's replay: None while more is left, else whether the file was done."""
    try:
        next(step)
    except StopIteration as end:
        return bool(end.value)
    return None


def iter_frames(fd: int) -> Iterator[bytes | None]:
    """The payloads of the wire's frames in ``fd``, read a piece at a time; None once for a frame
    longer than the wire allows (the rest of the file is not read)."""
    buf = bytearray()
    while True:
        chunk = os.read(fd, READ_CHUNK)
        if not chunk:
            return
        buf += chunk
        pos = 0
        while len(buf) - pos >= _wire.HEADER.size:
            (n,) = _wire.HEADER.unpack_from(buf, pos)
            if n > _wire.MAX_FRAME_BYTES:
                yield None
                return
            if len(buf) - pos - _wire.HEADER.size < n:
                break
            start = pos + _wire.HEADER.size
            yield bytes(buf[start:start + n])
            pos = start + n
        del buf[:pos]


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
        self._reading: set[str] = set()  # names of files a replay is reading now (it gives the loop back)
        self._passed_over: dict[tuple[int, int], None] = {}  # (device, inode) of files refused: counted once

    def replay(self, directory: str, prefix: str = "") -> int:
        """Replay, in one go, the spool files whose producer has died (its lock is free) and that are no
        larger than SYNC_MAX_BYTES (the rest wait for :meth:`replay_async`); returns files done."""
        done = 0
        for name, dfd in self._names(directory, prefix):
            step = self._replay_one(directory, dfd, name, SYNC_MAX_BYTES)
            while (finished := _advance(step)) is None:
                pass
            done += finished
        return done

    async def replay_async(self, directory: str, prefix: str = "") -> int:
        """:meth:`replay` for a whole directory: any size, the event loop given back every
        STEP_FRAMES frames; returns files done."""
        done = 0
        for name, dfd in self._names(directory, prefix):
            step = self._replay_one(directory, dfd, name, None)
            while (finished := _advance(step)) is None:  # noqa: ASYNC110 - yields the loop, waits on nothing
                await asyncio.sleep(0)
            done += finished
        return done

    def _names(self, directory: str, prefix: str) -> Iterator[tuple[str, int]]:
        """The spool file names in ``directory`` that begin with ``prefix``, each with the directory's fd."""
        try:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            names = sorted(n for n in os.listdir(dfd) if n.endswith(_paths.SPOOL_SUFFIX) and n.startswith(prefix))
            for name in names:
                yield name, dfd
        except OSError:
            return
        finally:
            os.close(dfd)

    def _replay_one(self, directory: str, dfd: int, name: str, max_bytes: int | None) -> Step:
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
            if max_bytes is not None and st.st_size > max_bytes:
                return False  # the next scan reads it, a piece at a time
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # its producer is alive and replays it itself
            if not rx.allowed(st.st_uid, st.st_gid):
                self._refuse(st, path, "owner uid %d is not allowed" % st.st_uid)
                return False
            producer: Producer | None = None
            self._replaying.add(path)
            outstanding = [1]  # batches not yet complete, +1 until all are published
            identity = (st.st_dev, st.st_ino)

            def one_done() -> None:
                outstanding[0] -= 1
                if outstanding[0] == 0:  # every exporter has it: now the file may go
                    self._replaying.discard(path)
                    unlink_if_same(directory, name, identity)

            malformed_run = 0
            self._reading.add(name)
            for k, payload in enumerate(iter_frames(fd), 1):
                if k % STEP_FRAMES == 0:
                    yield
                if payload is None:
                    counters.oversized_frames += 1
                    break
                msg = decode_frame(payload)
                if msg is None or (producer is not None and msg.get("t") != "b"):
                    counters.malformed_frames += 1
                    malformed_run += 1
                    if malformed_run >= MAX_MALFORMED_RUN:
                        self._refuse(st, path, "%d frames in a row are not the wire's: not a spool the hooks "
                                               "wrote" % malformed_run)
                        if producer is None:  # nothing published: the file stays, passed over by later scans
                            self._replaying.discard(path)
                            return False
                        break
                    continue
                malformed_run = 0
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
                outstanding[0] += 1
                rx.process_batch(producer, msg.get("e"), on_done=one_done)
            counters.spool_files_replayed += 1
            if producer is not None:
                self.ended(producer)
            one_done()
            return True
        finally:
            self._reading.discard(name)
            os.close(fd)

    def reading(self, prefix: str) -> bool:
        """Whether a replay is reading a file of ``prefix`` now (its end, then, decides the producer's)."""
        return any(n.startswith(prefix) for n in self._reading)

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
