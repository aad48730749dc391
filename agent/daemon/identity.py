"""Who a producer is, by the kernel's word rather than its hello's.

A connection's uid and pid come from ``SO_PEERCRED``; a spool file's uid is its owner. The
hello names a pid and a producer id (``<boot id>-<pid>-<start ticks>`` from the hooks). A
hello is refused when what it claims contradicts the kernel:

- the producer id names another pid than the hello (``<boot>-<pid>-<ticks>`` ids only,
  :data:`HOOKS_ID`; an id of another form can never equal one the hooks made, and no id spells
  another uid's key in the producer table: :data:`PRODUCER_ID`);
- over a connection, the hello's pid is not the peer's own and is not a live process of the
  peer's uid (read from ``/proc/<pid>/status``; one the agent cannot see is not believed);
- the pid is a live process whose start time is the id's, and its uid is not the peer's
  (or the spool file owner's);
- over a connection, the peer's own pid started at another time than the id says.

Root (uid 0) may speak for any process. A peer in another pid namespace (``SO_PEERCRED``
reports pid 0: a sidecar's model server) cannot have its pid checked; its hello is taken as
it comes (any id the grammar allows), and still keyed by its uid. A spool file of a process that
has ended cannot be checked beyond its id's pid; what it holds is kept under its owner's uid, so
it never enters another uid's sequence space (:meth:`Assembler.hello`'s key: no id can spell
another uid's).

The reasons name the hello's id as it came: whoever logs or replies with one makes it a single
bounded line (``infersight.sanitize.log_text``).
"""

from __future__ import annotations

import re
import socket
import struct
from dataclasses import dataclass

UCRED = struct.Struct("3i")
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux; Python has no constant for it
MAX_GROUPS = 256
# A producer id: at most 128 of these characters. No "@": the producer table keys a second uid's
# producer of an id as "<id>@<uid>", which no id may spell (another uid's events had joined it).
PRODUCER_ID = re.compile(r"[0-9A-Za-z._:-]{1,128}\Z")
# As the hooks make it (hooks/_proc.producer_id): the boot id's first 12 hex digits (and an exec's
# "x<hex>"), the pid, its start ticks. ASCII digits only (str.isdigit() takes "²", which int() refuses).
HOOKS_ID = re.compile(r"([0-9A-Za-z._:-]{1,96})-([0-9]{1,10})-([0-9]{1,20})\Z")


@dataclass(frozen=True, slots=True)
class Peer:
    """What the kernel says about the sender: its uid, and its pid (None for a spool file,
    0 when the peer is in a pid namespace the agent cannot see)."""

    uid: int
    pid: int | None


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of a connection's peer via SO_PEERCRED."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size)
    pid, uid, gid = UCRED.unpack(raw)
    return pid, uid, gid


def peer_groups(sock: socket.socket) -> set[int]:
    """The peer's supplementary groups (SO_PEERGROUPS): producers reach the socket through
    membership of the agent's group, which SO_PEERCRED's primary gid does not show."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * MAX_GROUPS)
    except OSError:
        return set()
    n = len(raw) // 4
    return set(struct.unpack("%dI" % n, raw[: 4 * n]))


def id_parts(producer_id: str) -> tuple[int, str] | None:
    """(pid, start ticks) of a hooks-made producer id ``<boot id>-<pid>-<ticks>``; None otherwise."""
    m = HOOKS_ID.match(producer_id)
    return None if m is None else (int(m.group(2)), m.group(3))


def proc_uids(pid: int, proc_root: str = "/proc") -> tuple[int, int] | None:
    """(real, effective) uid of a live process; None when it is gone or hidden from us."""
    try:
        with open("%s/%d/status" % (proc_root, pid), "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    fields = line.split()
                    return int(fields[1]), int(fields[2])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _stat_after_comm(pid: int, proc_root: str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after ``(comm)`` (state first); None when unknown."""
    try:
        with open("%s/%d/stat" % (proc_root, pid), "rb") as f:
            raw = f.read()
        fields = raw[raw.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None
    return fields if len(fields) > 19 else None


def parent_pid(pid: int, proc_root: str = "/proc") -> int | None:
    """Field 4 of ``/proc/<pid>/stat`` (the parent's pid); None when unknown."""
    try:
        with open("%s/%d/stat" % (proc_root, pid), "rb") as f:
            raw = f.read(4096)
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return None


def proc_start_ticks(pid: int, proc_root: str = "/proc") -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time, clock ticks since boot); None when unknown."""
    fields = _stat_after_comm(pid, proc_root)
    return fields[19].decode() if fields is not None else None


def process_start(pid: int, proc_root: str = "/proc") -> str | None:
    """The start ticks of a running process (to tell a reused pid); None when it is gone, or
    has exited and is a zombie."""
    fields = _stat_after_comm(pid, proc_root)
    if fields is None or fields[0] in (b"Z", b"X", b"x"):
        return None
    return fields[19].decode()


def refusal(producer_id: str, claimed_pid: int, peer: Peer, proc_root: str = "/proc") -> str | None:
    """Why a hello claiming ``producer_id`` and ``claimed_pid`` from ``peer`` is refused; None
    when the kernel does not contradict it."""
    if peer.uid == 0:
        return None
    parts = id_parts(producer_id)
    if parts is not None and parts[0] != claimed_pid:
        return "producer id %s names pid %d, the hello pid %d" % (producer_id, parts[0], claimed_pid)
    ticks = parts[1] if parts is not None else None
    if peer.pid == 0:
        return None  # another pid namespace: nothing to compare with
    if peer.pid is not None and claimed_pid == peer.pid:
        started = proc_start_ticks(claimed_pid, proc_root)
        if ticks is not None and ticks != "0" and started is not None and started != ticks:
            return "pid %d started at tick %s, not %s as the producer id says" % (claimed_pid, started, ticks)
        return None
    uids = proc_uids(claimed_pid, proc_root)
    started = proc_start_ticks(claimed_pid, proc_root) if uids is not None else None
    same_process = uids is not None and (ticks is None or ticks in ("0", started))
    if same_process and uids is not None and peer.uid not in uids:
        return "pid %d belongs to uid %d, not to the sender's uid %d" % (claimed_pid, uids[0], peer.uid)
    if peer.pid is not None and not same_process:
        # Over a connection the hello speaks for a process other than the peer: only one
        # the agent can see, of the peer's own uid, is believed.
        return "pid %d is not the peer's (pid %d) and is no process of uid %d that the agent can see" % (
            claimed_pid, peer.pid, peer.uid)
    return None
