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
(refused, counted once); a batch of more events than the wire allows is refused whole, as over a
connection. The scans of the whole directory (at start, every few seconds, at a joined launch's end)
list it in a thread, consider at most MAX_SCAN_NAMES names each (past that, each owner uid in turn),
and give the loop back every SLICE_S of loop time (or STEP_FRAMES frames): one planted file of 512
frames of 2,048 events had held the loop for over a minute, and 1.5 million planted names 7 s a scan.
A scan's loop time is charged to the file owner's uid (``loop_share.py``, as a connection's frames),
and it reads on only while that uid's batches fit its share of the exporters' queues. Only the replay
of one ended producer's own files runs in one go (its events come before its end is decided), and only
files of its own uid, up to SYNC_TOTAL_BYTES in all (what a process spools at its exit): the rest is read
a piece at a time by a task, and the producer's end waits for it. Five planted 60 MiB files under a
member's own ended producer's prefix had held the loop 79 s, past the service's watchdog.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import pwd
import stat
import time
from collections.abc import Callable, Generator, Iterator
from typing import NamedTuple

from infersight.agent.daemon.assemble import Producer, ProducerTableFull
from infersight.agent.daemon.identity import Peer
from infersight.agent.daemon.loop_share import LoopShare
from infersight.agent.daemon.receive import Receiver
from infersight.agent.daemon.sanitize import decode_frame
from infersight.hooks import _paths, _wire

MAX_PASSED_OVER = 4096  # files remembered as counted already (the oldest forgotten first)
READ_CHUNK = 1 << 20
MAX_MALFORMED_RUN = 64  # frames in a row that are not the wire's: the file is not a spool the hooks wrote
STEP_FRAMES = 256  # frames at most between two returns of the loop in an asynchronous replay
SLICE_S = 0.015  # loop time at most (give or take one frame) between two returns of the loop
GIVE_S = 0.001  # how long it then gives it: a reply that takes a few turns of the loop is not one per slice
MAX_SCAN_NAMES = 1024  # names one scan considers; past it, owner uids take turns and the rest waits
_MAX_ODD = 64  # hard links and the like a large listing reports (one per file), to be counted once
_MAX_UIDS_COUNTED = 256
# The replay of one ended producer's files runs in one go (its events come before its end is decided): up to the
# hooks' default spool size; a larger file (a raised INFERSIGHT_SPOOL_MAX_BYTES, or planted under its prefix) waits
# for the next scan, which gives the loop back as it goes.
SYNC_MAX_BYTES = 64 << 20
SYNC_TOTAL_BYTES = 256 << 10  # what one ended producer's files may hold in all to be read in one go (~65 ms)
LOCKS_TTL_S = 1.0  # how long one read of /proc/locks answers whether an unreadable file's producer lives

Step = Generator[int | None, None, bool]  # one file's replay: yields its owner's uid after each piece of work,
# returns whether it was done


def _advance(step: Step) -> bool | None:
    """One piece of a file's replay: None while more is left, else whether the file was done."""
    try:
        next(step)
    except StopIteration as end:
        return bool(end.value)
    return None


def iter_frames(fd: int, limit: int | None = None) -> Iterator[bytes | None]:
    """The payloads of the wire's frames in ``fd``, read a piece at a time, at most ``limit`` bytes of
    it; None once for a frame longer than the wire allows (the rest of the file is not read)."""
    buf = bytearray()
    left = limit
    while True:
        chunk = os.read(fd, READ_CHUNK if left is None else min(READ_CHUNK, left))
        if not chunk:
            return
        if left is not None:
            left -= len(chunk)
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


class Listing(NamedTuple):
    """What a scan found in the directory (:func:`list_spool`)."""

    names: list[str]  # to consider now, in this order
    total: int  # spool names found
    waiting: dict[int, int]  # per owner uid: names left for later scans (a large directory only)
    odd: list[tuple[str, os.stat_result]]  # a large directory's hard links and non-files: one name per file
    cursors: dict[int, str]  # per owner uid: the last name considered (the next scan goes on after it)


class _Owned:
    """One uid's names in a large directory: the ``limit`` first after its cursor, and the first overall."""

    __slots__ = ("after", "before", "count", "cursor", "limit")

    def __init__(self, cursor: str, limit: int) -> None:
        self.cursor, self.limit, self.count = cursor, limit, 0
        self.after: list[str] = []
        self.before: list[str] = []

    def add(self, name: str) -> None:
        self.count += 1
        kept = self.after if name > self.cursor else self.before
        kept.append(name)
        if len(kept) >= 2 * self.limit:  # amortised: a sort every `limit` names keeps memory bounded
            kept.sort()
            del kept[self.limit:]

    def order(self) -> list[str]:
        return sorted(self.after)[:self.limit] + sorted(self.before)[:self.limit]


def list_spool(directory: str, prefix: str, limit: int, cursors: dict[int, str]) -> Listing:
    """The spool names in ``directory`` that begin with ``prefix``, at most ``limit`` of them (blocking:
    run it in a thread). Within ``limit`` they are listed only, sorted. Past it, each name is looked at
    (``lstat``) and the owner uids take ``limit`` in turn, each from after its cursor on: another user's
    planted names (hard links to their own files: 1.5 million of them) leave a victim's file its turn.
    Memory stays bounded by ``limit`` names per uid, whatever the directory holds."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return Listing([], 0, {}, [], {})
    kept: list[str] = []
    owners: dict[int, _Owned] = {}
    odd: dict[tuple[int, int], tuple[str, os.stat_result]] = {}
    odd_uids: dict[int, int] = {}
    total = 0

    def look(name: str) -> None:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:  # refused anyway: counted once per file
            odd_uids[st.st_uid] = odd_uids.get(st.st_uid, 0) + 1
            if len(odd) < _MAX_ODD:
                odd.setdefault((st.st_dev, st.st_ino), (name, st))
            return
        owned = owners.get(st.st_uid)
        if owned is None:
            owned = owners[st.st_uid] = _Owned(cursors.get(st.st_uid, ""), limit)
        owned.add(name)

    try:
        with os.scandir(dfd) as entries:
            for entry in entries:
                name = entry.name
                if not (name.endswith(_paths.SPOOL_SUFFIX) and name.startswith(prefix)):
                    continue
                total += 1
                if total <= limit:
                    kept.append(name)
                    continue
                if total == limit + 1:  # a large directory: from here on, by owner
                    for k in kept:
                        look(k)
                    kept = []
                look(name)
    except OSError:
        pass
    finally:
        os.close(dfd)
    if total <= limit:
        return Listing(sorted(kept), total, {}, [], {})
    queues = {uid: owners[uid].order() for uid in sorted(owners)}
    names: list[str] = []
    taken: dict[int, int] = dict.fromkeys(queues, 0)
    while len(names) < limit and any(taken[u] < len(q) for u, q in queues.items()):
        for uid, q in queues.items():  # one name of each uid in turn
            if taken[uid] < len(q) and len(names) < limit:
                names.append(q[taken[uid]])
                taken[uid] += 1
    waiting = {uid: owners[uid].count - taken[uid] for uid in queues if owners[uid].count > taken[uid]}
    for uid, n in odd_uids.items():
        waiting[uid] = waiting.get(uid, 0) + n
    new_cursors = {uid: queues[uid][taken[uid] - 1] for uid in queues if taken[uid]}
    return Listing(names, total, waiting, list(odd.values()), new_cursors)


def list_small(dfd: int, prefix: str, limit: int) -> list[str] | None:
    """The spool names that begin with ``prefix``, sorted, if the directory is small (at most ``limit``
    of them among at most 4 x ``limit`` names: a millisecond or two, fine on the loop); else None."""
    names: list[str] = []
    with os.scandir(dfd) as entries:
        for k, entry in enumerate(entries):
            name = entry.name
            if k >= 4 * limit:
                return None
            if name.endswith(_paths.SPOOL_SUFFIX) and name.startswith(prefix):
                if len(names) >= limit:
                    return None
                names.append(name)
    return sorted(names)


def flocked_files(locks: str = "/proc/locks") -> frozenset[tuple[int, int, int]]:
    """(major, minor, inode) of each file someone holds an ``flock`` on; empty when the table cannot be read.
    A line: ``1: FLOCK  ADVISORY  WRITE 4242 08:01:131090 0 EOF`` (device numbers in hex)."""
    held: set[tuple[int, int, int]] = set()
    try:
        with open(locks, "rb") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 6 or fields[1] != b"FLOCK":  # (a waiter's line reads "1: -> FLOCK ...")
                    continue
                try:
                    major, minor, ino = fields[5].split(b":")
                    held.add((int(major, 16), int(minor, 16), int(ino)))
                except ValueError:
                    continue
    except OSError:
        pass
    return frozenset(held)


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


class _Pace:
    """When an asynchronous replay gives the loop back: after SLICE_S of loop time or STEP_FRAMES
    frames, whichever first; then its uid waits for its share of the loop (``loop_share``), and at
    any step while its batches fill their share of the exporters' queues (memory stays bounded)."""

    def __init__(self, owner: SpoolReplay) -> None:
        self.owner = owner
        self.clock = owner.clock
        self.began = self.clock()
        self.steps = 0

    async def step(self, uid: int | None) -> None:
        self.steps += 1
        broadcaster = self.owner.receiver.broadcaster
        full = uid is not None and broadcaster.must_wait(uid)
        spent = self.clock() - self.began
        if spent < SLICE_S and self.steps < STEP_FRAMES and not full:
            return
        share = self.owner.loop_share
        if share is not None and uid is not None:  # charged as a connection's frames are
            share.settle(uid, 0, share.reserve(uid, 0), spent)
        self.owner.gave_back += 1
        await asyncio.sleep(GIVE_S)  # not one turn: a chain of callbacks (a status probe's) runs to its end
        if uid is not None:
            if broadcaster.must_wait(uid):
                await broadcaster.wait_turn(uid)
            if share is not None and share.over(uid):
                await share.wait(uid)
        self.began, self.steps = self.clock(), 0


class SpoolReplay:
    """``ended(producer)`` runs after a file is read: its process has ended (its lock was
    free), so the ingest closes what it left open, unless it is connected again."""

    def __init__(self, receiver: Receiver, ended: Callable[[Producer], None]) -> None:
        self.receiver = receiver
        self.ended = ended
        self.loop_share: LoopShare | None = None  # the connections' (set by the agent): a scan's uid is charged
        self.clock: Callable[[], float] = time.perf_counter
        self.gave_back = 0  # times an asynchronous replay gave the loop back
        self.names_waiting: dict[int, int] = {}  # per owner uid: names the last large scan left for later
        self.last_listing = Listing([], 0, {}, [], {})
        self.list_s = 0.0  # how long the last scan's listing took (a thread's time: the scans are spaced by it)
        self._deferred: set[str] = set()  # prefixes whose files a task looks for (a large directory)
        self._waiting: dict[str, set[str]] = {}  # prefix -> the producers (table keys) whose end waits for that task
        self._later: set[asyncio.Task[None]] = set()
        self._later_lock: asyncio.Lock | None = None  # one deferred listing at a time (each walks the whole directory)
        self._closing = False  # the agent stops: no more deferred replays (the next agent reads the files)
        self._cursors: dict[int, str] = {}
        self._replaying: set[str] = set()  # files published but not yet exported
        self._reading: set[str] = set()  # names of files a replay is reading now (it gives the loop back)
        self._passed_over: dict[tuple[int, int], None] = {}  # (device, inode) of files refused: counted once
        self.too_large = False  # the last file _replay_one looked at was over its bound once locked
        self._locks_read: tuple[float, frozenset[tuple[int, int, int]]] | None = None  # (when, flocked_files())
        # Files of ended producers the agent may not read, now: path -> (owner uid, device, inode). Every scan
        # tries them again (an operator's setfacl or chown lets it replay them); forgotten once read or gone.
        self.unreadable: dict[str, tuple[int, int, int]] = {}

    def replay(self, directory: str, prefix: str = "", owner_uid: int | None = None) -> int:
        """Replay, in one go, the spool files whose producer has died (its lock is free) and that are no
        larger than SYNC_MAX_BYTES (the rest wait for :meth:`replay_async`); returns files done. With a
        ``prefix`` (an ended producer's files), at most SYNC_TOTAL_BYTES in all, and with ``owner_uid`` only
        files of that uid: past the budget a task reads the rest a piece at a time (:meth:`reading` holds the
        producer's end meanwhile); another uid's files wait for the periodic scan, which charges their owner."""
        try:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return 0
        done = 0
        try:
            names = list_small(dfd, prefix, MAX_SCAN_NAMES)
            if names is None:  # a large directory (planted names): never listed whole on the loop if it can wait
                if prefix and self._defer(directory, prefix):
                    return 0
                names = sorted(n for n in os.listdir(dfd) if n.endswith(_paths.SPOOL_SUFFIX) and n.startswith(prefix))
            budget = SYNC_TOTAL_BYTES if prefix else None
            for name in names:
                bound = SYNC_MAX_BYTES
                if budget is not None:
                    try:
                        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    except OSError:
                        continue
                    if owner_uid is not None and st.st_uid != owner_uid:
                        continue  # under another's prefix: the periodic scan reads it, paced, charged to its owner
                    if st.st_size > budget:
                        if self._defer(directory, prefix):
                            break  # the rest a piece at a time; the producer's end waits for it
                    else:
                        bound = min(SYNC_MAX_BYTES, budget)  # (checked again once locked: it may have grown since)
                    budget = max(0, budget - st.st_size)
                self.too_large = False
                step = self._replay_one(directory, dfd, name, bound)
                while (finished := _advance(step)) is None:
                    pass
                done += finished
                if self.too_large and prefix and self._defer(directory, prefix):
                    break  # it grew past the budget: read a piece at a time, the producer's end waiting for it
        except OSError:
            pass
        finally:
            os.close(dfd)
        return done

    async def replay_async(self, directory: str, prefix: str = "") -> int:
        """:meth:`replay` for a whole directory, any size (a large one listed in a thread), at most MAX_SCAN_NAMES names
        considered, the event loop given back as it goes (:class:`_Pace`); returns files done."""
        try:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return 0
        try:
            small = list_small(dfd, prefix, MAX_SCAN_NAMES)
        except OSError:
            small = []
        whole = not prefix  # the periodic scan's: its cursors, what it left waiting, its listing's time
        if small is None:  # a large directory: listed in a thread
            os.close(dfd)
            began = time.monotonic()
            listing = await asyncio.to_thread(list_spool, directory, prefix, MAX_SCAN_NAMES,
                                              dict(self._cursors) if whole else {})
            if whole:
                self.list_s = time.monotonic() - began
            self._listed(directory, listing, whole)
            try:
                dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                return 0
        else:
            if whole:
                self.list_s = 0.0
            listing = Listing(small, len(small), {}, [], self._cursors)
        if whole:
            self._forget_unreadable(directory, dfd)
        done, pace = 0, _Pace(self)
        try:
            for name in listing.names:
                step = self._replay_one(directory, dfd, name, None)
                try:
                    while True:
                        try:
                            uid = next(step)
                        except StopIteration as end:
                            done += bool(end.value)
                            break
                        await pace.step(uid)
                finally:
                    step.close()  # cancelled mid-file: the file is free for a later scan
                await pace.step(None)  # a name's open and checks are work too
        finally:
            os.close(dfd)
        return done

    def _defer(self, directory: str, prefix: str) -> bool:
        """In a large directory (planted names), an ended producer's files are looked for by a task (its listing
        in a thread), not in one go on the loop: :meth:`reading` holds the producer's close until it is done.
        Once the agent stops, none is started: the producer's end is not held, its files wait for the next agent."""
        if self._closing:
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if prefix not in self._deferred:
            self._deferred.add(prefix)
            task = loop.create_task(self._replay_later(directory, prefix), name="agent-spool-replay-ended")
            self._later.add(task)
            task.add_done_callback(self._later_done)
        return True

    def wait_for(self, prefix: str, key: str) -> None:
        """The producer ``key`` ended while a replay reads (or looks for) its files: the deferred replay's end
        closes it, unless a file it names is then still being read (that file's end does)."""
        self._waiting.setdefault(prefix, set()).add(key)
        if prefix not in self._deferred:  # the periodic scan reads it: look again once that file is done
            try:
                asyncio.get_running_loop().call_later(0.2, self._close_waiting, prefix)
            except RuntimeError:
                pass

    async def _replay_later(self, directory: str, prefix: str) -> None:
        if self._later_lock is None:
            self._later_lock = asyncio.Lock()
        try:
            async with self._later_lock:  # many producers ending together: one directory walk at a time
                await self.replay_async(directory, prefix)
        finally:
            self._deferred.discard(prefix)
            self._close_waiting(prefix)

    def _close_waiting(self, prefix: str) -> None:
        """End the producers that waited for ``prefix``'s deferred replay; while another replay still reads a file
        of that prefix (the periodic scan, mid-file: the root is often the last frames), look again shortly."""
        if self._closing:
            self._waiting.pop(prefix, None)
            return
        if any(n.startswith(prefix) for n in self._reading):
            asyncio.get_running_loop().call_later(0.2, self._close_waiting, prefix)
            return
        for key in self._waiting.pop(prefix, ()):
            p = self.receiver.assembler.producers.get(key)  # only those that ended: never another uid's of the id
            if p is not None and not p.gone:
                self.ended(p)

    def _later_done(self, task: asyncio.Task[None]) -> None:
        self._later.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.receiver.rlog.warn("spool-replay", "a replay of an ended producer's spool files failed: %r",
                                    task.exception())

    async def close(self) -> None:
        """The agent stops: no more deferred replays; those running are cancelled (their files stay on disk)."""
        self._closing = True
        later = list(self._later)
        for t in later:
            t.cancel()
        if later:
            await asyncio.gather(*later, return_exceptions=True)

    def _listed(self, directory: str, listing: Listing, whole: bool = True) -> None:
        """Take a scan's listing: cursors, and what a large directory left for later (counted per uid, said); a
        prefix's listing (an ended producer's files) leaves the periodic scan's cursors and counts alone."""
        for name, st in listing.odd:
            self._refuse(st, os.path.join(directory, name), "not a regular file with one link")
        if not whole:
            return
        self.last_listing = listing
        self._cursors = listing.cursors
        if not listing.waiting:
            return
        self.names_waiting = dict(sorted(listing.waiting.items(), key=lambda kv: -kv[1])[:_MAX_UIDS_COUNTED])
        self.receiver.rlog.warn(
            "spool-names", "spool directory %s holds %d spool names, more than the %d a scan considers: %s wait "
            "for later scans", directory, listing.total, MAX_SCAN_NAMES,
            ", ".join("uid %d: %d" % kv for kv in list(self.names_waiting.items())[:8]))

    def _replay_one(self, directory: str, dfd: int, name: str, max_bytes: int | None) -> Step:
        path = os.path.join(directory, name)
        if path in self._replaying:
            return False
        rx, counters = self.receiver, self.receiver.counters
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        except PermissionError:
            self._unreadable(directory, dfd, name)  # (unless its producer lives: it replays the file itself)
            return False
        except OSError:
            self.unreadable.pop(path, None)
            return False  # gone, or a symlink (ELOOP)
        self.unreadable.pop(path, None)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                self._refuse(st, path, "not a regular file with one link")
                return False
            if max_bytes is not None and st.st_size > max_bytes:
                self.too_large = True
                return False  # the next scan reads it, a piece at a time
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # its producer is alive and replays it itself
            # Read only what the file held once locked: its producer has ended, and a descriptor its owner
            # kept without the lock could append for ever (a one-go read of an ended producer's file held the
            # loop 87 s that way). What is appended later is not read: the file goes once exported. Only its
            # owner can append, and a producer's own file is final once its lock is free.
            size = os.fstat(fd).st_size
            if max_bytes is not None and size > max_bytes:
                self.too_large = True
                return False  # grown past the bound since it was looked at: the next scan reads it
            if not rx.allowed(st.st_uid, st.st_gid):
                self._refuse(st, path, "owner uid %d is not allowed" % st.st_uid)
                return False
            producer: Producer | None = None
            self._replaying.add(path)
            outstanding = [1]  # batches not yet complete, +1 until all are published
            identity = (st.st_dev, st.st_ino)
            uid = st.st_uid

            def one_done() -> None:
                outstanding[0] -= 1
                if outstanding[0] == 0:  # every exporter has it: now the file may go
                    self._replaying.discard(path)
                    unlink_if_same(directory, name, identity)

            malformed_run = 0
            self._reading.add(name)
            for payload in iter_frames(fd, size):
                yield uid  # after every piece of work: the caller decides when the loop gets it back
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
                events = msg.get("e")
                if isinstance(events, list) and len(events) > _wire.MAX_BATCH_EVENTS_READ:
                    counters.malformed_frames += 1  # as over a connection: refused whole
                    rx.rlog.warn("frame", "spool file %s holds a batch of %d events (no hook sends more than %d); "
                                 "refused whole", path, len(events), _wire.MAX_BATCH_EVENTS)
                    continue
                outstanding[0] += 1
                rx.process_batch(producer, events, on_done=one_done)
            counters.spool_files_replayed += 1
            if producer is not None:
                self.ended(producer)
            one_done()
            return True
        except GeneratorExit:  # stopped mid-file (a cancelled scan): a later scan reads it again; what this one
            self._replaying.discard(path)  # published is then a duplicate by its sequence numbers, dropped
            raise
        finally:
            self._reading.discard(name)
            os.close(fd)

    def reading(self, prefix: str) -> bool:
        """Whether a replay is reading a file of ``prefix`` now (its end, then, decides the producer's)."""
        return prefix in self._deferred or any(n.startswith(prefix) for n in self._reading)

    def _refuse(self, st: os.stat_result, path: str, why: str) -> None:
        """Count and say a file passed over, once per file (every scan finds it again)."""
        if self._first_time(st):
            self.receiver.counters.spool_files_refused += 1
            self.receiver.rlog.warn("spool", "not replaying %s: %s", path, why)

    def _unreadable(self, directory: str, dfd: int, name: str) -> None:
        """A file the agent may not read: spooled by hooks older than the reader ACL (0600, its owner's
        alone), or on a file system without ACLs. Its events stay on disk: say so once, with the fix. Not
        while its producer lives (it holds the file's lock, as the lock probe of a readable file finds): that
        producer sends the file's events itself once it reaches the agent, and a later scan looks again."""
        path = os.path.join(directory, name)
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return
        if self.flock_held(st):
            return
        self.unreadable[path] = (st.st_uid, st.st_dev, st.st_ino)
        if not self._first_time(st):
            return
        self.receiver.counters.spool_files_unreadable += 1
        self.receiver.rlog.warn(
            "spool-unreadable", "cannot replay %s (owner uid %d, mode %04o): this agent (uid %d) may not read it; "
            "hooks of this version grant the spool directory's owner read access (a POSIX ACL): upgrade the "
            "served process's infersight, and check that the file system supports ACLs", path, st.st_uid,
            stat.S_IMODE(st.st_mode), os.geteuid())

    def _forget_unreadable(self, directory: str, dfd: int) -> None:
        """A scan of ``directory``: forget the unreadable files there that are gone or replaced (a name not
        listed again in a large directory would be remembered for good)."""
        for path, (_uid, dev, ino) in list(self.unreadable.items()):
            if os.path.dirname(path) != directory:
                continue
            try:
                st = os.stat(os.path.basename(path), dir_fd=dfd, follow_symlinks=False)
            except OSError:
                st = None
            if st is None or (st.st_dev, st.st_ino) != (dev, ino):
                del self.unreadable[path]

    def unreadable_warnings(self, scan_s: float) -> list[str]:
        """What ``status`` says of the files the agent may not read now: per directory and owner, how many,
        one of them, and how to let the agent read them (it tries them again on every scan)."""
        if not self.unreadable:
            return []
        groups: dict[tuple[str, int], list[str]] = {}
        for path, (uid, _dev, _ino) in sorted(self.unreadable.items()):
            groups.setdefault((os.path.dirname(path), uid), []).append(path)
        me = os.geteuid()
        try:
            user = pwd.getpwuid(me).pw_name
        except KeyError:
            user = str(me)
        return [
            "%d spool file(s) of uid %d in %s that this agent (uid %d) may not read (spooled by hooks older than "
            "the reader ACL, or on a file system without ACLs), e.g. %s: their events wait there. Let the agent "
            "read them (as root or uid %d: setfacl -m u:%s:r FILE; without ACLs: chmod g+r FILE, which the "
            "directory's group may then read too): it tries them on every scan of the spool directory (every "
            "%.0f s), replays and removes them; and upgrade that uid's served infersight"
            % (len(paths), uid, directory, me, paths[0], uid, user, scan_s)
            for (directory, uid), paths in groups.items()]

    def flock_held(self, st: os.stat_result) -> bool:
        """Whether some process holds an ``flock`` on the file ``st`` (its producer, alive): what the lock probe
        of :meth:`_replay_one` tells, for a file the agent cannot open to probe. From ``/proc/locks``, read at most
        once per LOCKS_TTL_S: the locks of the processes this agent's PID namespace sees (a producer in a pod's
        other namespace is not seen: its file is reported as before)."""
        now = time.monotonic()
        if self._locks_read is None or now - self._locks_read[0] > LOCKS_TTL_S:
            self._locks_read = (now, flocked_files())
        return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in self._locks_read[1]

    def _first_time(self, st: os.stat_result) -> bool:
        """Whether this file (device, inode) is passed over for the first time; remembered."""
        key = (st.st_dev, st.st_ino)
        if key in self._passed_over:
            return False
        if len(self._passed_over) >= MAX_PASSED_OVER:
            self._passed_over.pop(next(iter(self._passed_over)))
        self._passed_over[key] = None
        return True
