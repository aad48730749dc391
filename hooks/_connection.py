"""The producer's connection to the agent's socket: checks, hello, sends, acks, reconnects.

Delivery is at-least-once: every frame sent stays in ``outbox`` until the agent acks it
and is sent again, first, after a reconnect. A lost connection is retried with a jittered
exponential backoff (up to ``RECONNECT_MAX_S``); an agent that refuses this producer is
not retried (the client spools instead).

Local users are not trusted: in a per-user fallback location (``/tmp/infersight-<uid>``),
the socket's directory must pass ``_paths.check_socket_dir`` and the peer must run as its
owner, root or us; otherwise this producer tells the socket nothing.

Only the drain thread (or ``close`` holding the client's lock) calls these methods.
"""

from __future__ import annotations

# The C socket type, not the ``socket`` module: same methods, without ~7 ms of imports
# (selectors, enum) on the host's start-up path. Everything the drain thread uses is
# imported here, on the main thread: a first import on a daemon thread can race the
# host's own imports or interpreter shutdown.
import _socket
import os
import stat
import sys
import time
from _collections import deque

from . import _fds, _paths, _wire
from ._env import say

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Deque, Dict, List, Optional, Tuple

    Frame = Tuple[int, int, bytes]  # (last seq, events, frame)

MAX_OUTBOX_BYTES = 16 << 20  # sent and not acked: past this, wait for acks (or spill)
SEND_TIMEOUT_S = 2.0
WAIT_SLICE_S = 0.1  # a wait on the agent (its welcome, room to send) looks at ``abandoned`` this often
RECV_BYTES = 65536
DRAIN_RECVS = 16  # at a disconnect: receives, at most, for the acks already queued (see ``_drain_acks``)
RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 5.0
HELD_RETRY_S = 0.1  # launch holds its agent back: look for its mark again this often


def peer_uid(sock: Any) -> Optional[int]:
    """The connected peer's uid (SO_PEERCRED: pid, uid, gid as native ints), if known."""
    opt = getattr(_socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    raw = sock.getsockopt(_socket.SOL_SOCKET, opt, 12)
    return int.from_bytes(raw[4:8], sys.byteorder)


def connect_failure(path: str, exc: OSError) -> Optional[str]:
    """Why connecting to the socket at ``path`` failed, in one line for the host's stderr; None
    when it only means that no agent is there now (no socket file, nobody listening: spool
    quietly, an agent may start later) or that it is busy (a full backlog: the next try may
    get in). A permission error names the group that would let this user in."""
    import errno

    code = exc.errno
    if isinstance(exc, _socket.timeout) or code in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.EINTR):
        return None  # (a timeout: the backlog full)
    if code is None:  # raised by Python itself (a path too long for AF_UNIX)
        return "cannot connect to %s: %s" % (path, exc)
    why = "cannot connect to %s: %s (%s)" % (path, os.strerror(code), errno.errorcode.get(code, code))
    if code not in (errno.EACCES, errno.EPERM):
        return why
    try:
        return "%s; %s" % (why, _access_hint(path))
    except Exception:  # the hint is a courtesy: never let it cost the hooks
        return why


def _access_hint(path: str) -> str:
    """What lets this user reach the socket: membership of the group of the socket (or of its
    directory, when that is what cannot be searched)."""
    uid = os.geteuid()
    st, where = None, path
    for where in (path, os.path.dirname(os.path.abspath(path))):
        try:
            st = os.stat(where)
            break
        except OSError:
            continue
    if st is None:
        return "check the permissions of %s and its directories for uid %d" % (path, uid)
    try:
        import grp

        group = grp.getgrgid(st.st_gid).gr_name
    except (ImportError, KeyError, OverflowError):
        group = str(st.st_gid)
    try:
        import pwd

        user = pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError, OverflowError):
        user = "USER"
    if st.st_gid == os.getegid() or st.st_gid in os.getgroups():
        return "this process (uid %d) is in the socket's group %s already: check the mode of %s (%04o)" % (
            uid, group, where, stat.S_IMODE(st.st_mode))
    if st.st_gid == 0:  # joining root's group to reach one socket would give this user far more
        return ("the socket belongs to group root (an agent run as root outside its service?): do not add users "
                "to group root; run the agent as its service (systemctl start infersight), whose socket's group "
                "is infersight, then add this user (uid %d) to that group" % uid)
    return "add this user (uid %d) to the socket's group %s, e.g. usermod -aG %s %s, and restart this process" % (
        uid, group, group, user)


class Connection:
    def __init__(self, socket_path: str, producer: Dict[str, Any]) -> None:
        self.socket_path = socket_path
        self.producer = producer  # what the hello says (the client may update it)
        self.owner = _paths.fallback_owner(socket_path)  # None: a path used as given
        self._sock: Optional[Any] = None  # a _socket.socket, once welcomed (``sock``)
        self._ident: Optional[Tuple[int, int]] = None  # its identity (_fds): its number may become the host's
        self.lost = 0  # our socket found closed or reused by the host (os.closerange): dropped, reconnected
        self.refused = False  # the agent refused this producer: do not retry
        self.welcomed = False  # an agent welcomed this producer once: it knows it, and counts its absence
        self.outbox: Deque[Frame] = deque()
        self.outbox_bytes = 0
        self.acked = 0  # the last sequence number the agent acked
        self.sent_events = 0
        self.sent_frames = 0
        self.urgent_rings = 0
        self._rx = b""
        self._next_attempt = 0.0
        self._backoff = RECONNECT_MIN_S
        self._warned = ""
        self.held_back = False  # launch held its agent back when this last tried to connect
        # Set by the exit (``Client.close``) once its flush is over: a wait on an agent that does not answer
        # ends within WAIT_SLICE_S, so that the drain thread frees the lock and the exit spools what is left
        # within its budget (each wait held the exit up to SEND_TIMEOUT_S).
        self.abandoned = False

    @property
    def sock(self) -> Optional[Any]:
        return self._sock

    @sock.setter
    def sock(self, sock: Optional[Any]) -> None:
        """Setting the socket records its identity (``own`` checks it before each use)."""
        self._sock = sock
        self._ident = None if sock is None else _fds.sock_ident(sock)

    @property
    def up(self) -> bool:
        return self._sock is not None

    def held(self) -> bool:
        """``launch`` holds its agent back while CMD starts (its mark lies beside the socket:
        launch's private directory, which only its user can write): spool, do not connect
        (no welcome could come); ring at readiness or an OOM. Every process under CMD."""
        try:
            return os.path.exists(os.path.join(os.path.dirname(self.socket_path), _wire.AGENT_HELD_MARK))
        except (OSError, ValueError):
            return False

    def congested(self) -> bool:
        return self.outbox_bytes >= MAX_OUTBOX_BYTES

    # -- connecting ------------------------------------------------------------------

    def connect(self) -> bool:
        """Connect unless connected, refused or backing off; True when connected now. After
        the welcome, what the last connection did not get acked is sent again, in order."""
        if self.sock is not None:
            return True
        now = time.monotonic()
        if self.refused or now < self._next_attempt:
            return False
        if self.held():
            self.held_back = True
            self._next_attempt = now + HELD_RETRY_S
            return False
        uids = self._agent_uids()
        if uids is None:
            self._schedule_retry(now)
            return False
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        ident = _fds.sock_ident(sock)
        sock.settimeout(SEND_TIMEOUT_S)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            _fds.close_sock(sock, ident)
            self._schedule_retry(now)
            why = connect_failure(self.socket_path, exc)
            if why:
                self._warn(why)  # once per reason: the next tries fail alike
            return False
        try:
            peer = peer_uid(sock)
            if uids and peer is not None and peer not in uids:
                # The path was swapped after our checks: not the agent, tell it nothing.
                self._warn("the peer at %s runs as uid %d" % (self.socket_path, peer))
                raise OSError("untrusted peer")
            sock.sendall(_wire.hello_frame(self.producer, self.acked))
            reply = self._recv_reply(sock)
            if not _fds.same(sock.fileno(), ident):  # the host closed it meanwhile (a welcome read from its file?)
                raise OSError("the socket is no longer ours")
        except OSError:
            _fds.close_sock(sock, ident)
            self._schedule_retry(now)
            return False
        if reply is None or reply.get("t") != "welcome":
            _fds.close_sock(sock, ident)
            err = (reply or {}).get("error", "no welcome from agent")
            if reply is not None and reply.get("t") == "refuse":
                self.refused = True
                say("agent refused this producer: %s; spooling instead" % err)
            self._schedule_retry(now)
            return False
        self._sock, self._ident = sock, ident
        self.welcomed = True
        self.held_back = False
        self._backoff = RECONNECT_MIN_S
        self._rx = b""
        for _last, _n, frame in list(self.outbox):
            try:
                self._send_sliced(sock, memoryview(frame))
            except OSError:
                self.disconnect()
                return False
        try:
            sock.settimeout(0.0)  # connected: non-blocking from now on (see _sendall)
        except OSError:
            self.disconnect()
            return False
        return True

    def _agent_uids(self) -> Optional[Tuple[int, ...]]:
        """The uids the agent may run as (empty: not checked, a path the operator chose), or
        None when the socket is to be taken as absent: missing, or in an unsafe directory."""
        owner = self.owner
        if owner is None:
            return ()
        uid = os.geteuid()
        try:
            _paths.check_socket_dir(os.path.dirname(os.path.abspath(self.socket_path)), owner)
            st = os.lstat(self.socket_path)
        except FileNotFoundError:
            return None  # no agent (yet): quietly spool
        except (OSError, ValueError) as exc:
            self._warn(str(exc))
            return None
        uids = (uid, 0, owner)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in uids:
            self._warn("%s is not a socket of uid %s" % (self.socket_path, " or ".join(
                str(u) for u in sorted(set(uids)))))
            return None
        return uids

    def _warn(self, why: str) -> None:
        if why != self._warned:
            self._warned = why
            say("not connecting to the agent: %s; spooling instead" % why)

    def retry_in(self) -> float:
        """Seconds until ``connect`` tries again (0: now)."""
        return max(0.0, self._next_attempt - time.monotonic())

    def _schedule_retry(self, now: float) -> None:
        jitter = int.from_bytes(os.urandom(2), "big") / 65536.0
        self._next_attempt = now + self._backoff * (0.5 + jitter)
        self._backoff = min(self._backoff * 2, RECONNECT_MAX_S)

    def _recv_reply(self, sock: Any) -> Optional[Dict[str, Any]]:
        buf = b""
        deadline = time.monotonic() + SEND_TIMEOUT_S
        sock.settimeout(WAIT_SLICE_S)
        while True:
            frames, rest, bad = _wire.split_frames(buf)
            if bad:
                return None
            if frames:
                self._rx = rest
                return _wire.decode_reply(frames[0])
            if buf and not self._may_wait(deadline):  # a welcome that trickles in: the same bound
                raise _socket.timeout("timed out")
            try:
                chunk = sock.recv(65536)
            except _socket.timeout:  # (an OSError: the caller gives the connection up)
                if not self._may_wait(deadline):
                    raise
                continue
            if not chunk:
                return None
            buf += chunk

    def own(self) -> bool:
        """Connected, on a socket still ours (one ``fstat``). A host that closed its descriptors
        (``os.closerange``, daemonizing) closed ours, and its next file may have its number: then
        the socket is dropped without closing that number (``_lose``); False."""
        sock = self.sock
        if sock is None:
            return False
        try:
            fd = sock.fileno()
        except (OSError, ValueError):
            fd = -1
        if _fds.same(fd, self._ident):
            return True
        self._lose()
        return False

    def _lose(self) -> None:
        """Our socket is gone (closed by the host, its number perhaps reused): forget it without
        closing anything, count it, and reconnect at once (the agent is not known to be away).
        Unacked frames stay in the outbox and are sent again after the welcome."""
        sock, self._sock, self._ident = self._sock, None, None
        _fds.close_sock(sock, None)  # never ours now: detached, not closed
        self.lost += 1
        self._rx = b""
        self._backoff = RECONNECT_MIN_S
        self._next_attempt = 0.0

    def disconnect(self, drain: bool = True) -> None:
        """Close the connection (a failed send, the agent gone) and back off. First, ``drain``:
        take the acks it already holds (``_drain_acks``), so that a reconnect resends only what
        was not acked. A socket no longer ours is dropped, never closed (``own``)."""
        if self.sock is not None:
            if not self.own():
                return  # lost: reconnect at once, no backoff (the agent did not go away)
            if drain:
                self._drain_acks(self.sock)
            _fds.close_sock(self.sock, self._ident)
        self._sock, self._ident = None, None
        self._schedule_retry(time.monotonic())

    def _drain_acks(self, sock: Any) -> None:
        """Read, without waiting, what the agent sent before it went away. Acks are read lazily
        (``read_acks``), so a dead agent's last ones may still be queued here: a Unix stream
        socket keeps what the peer sent readable after the peer closed or was killed (then EOF,
        or ECONNRESET when it left data of ours unread). Without them, the new agent would get
        frames the old one had already exported, and write their spans twice. At most
        DRAIN_RECVS receives; any error ends it."""
        try:
            sock.settimeout(0.0)
            for _ in range(DRAIN_RECVS):
                chunk = sock.recv(RECV_BYTES)
                if not chunk:
                    return
                self._rx += chunk
                frames, self._rx, bad = _wire.split_frames(self._rx)
                self._take_acks(frames)
                if bad:
                    return
        except OSError:  # BlockingIOError: nothing more; ECONNRESET: after the data, as EOF
            return

    def _take_acks(self, frames: List[bytes]) -> None:
        for payload in frames:
            msg = _wire.decode_reply(payload)
            if msg and msg.get("t") == "ack" and isinstance(msg.get("seq"), int):
                self._on_ack(msg["seq"])

    def close(self) -> None:
        """Close the socket, if it is still ours (else only forget it)."""
        sock, ident = self._sock, self._ident
        self._sock, self._ident = None, None
        if sock is not None and not _fds.close_sock(sock, ident):
            self.lost += 1

    def close_inherited(self) -> None:
        """In a forked child: close our copy of the parent's socket (if the number is still
        that socket's), nothing more."""
        if self.sock is not None:
            _fds.close_sock(self.sock, self._ident)

    # -- sending ---------------------------------------------------------------------

    def _sendall(self, data: bytes) -> None:
        """Send all of ``data`` on the connected, non-blocking socket (raises OSError). The
        drain thread's every system call gives the GIL up, which costs a busy main thread a
        switch to get it back: one ``send`` when the socket takes it all (nearly always), and
        only otherwise a wait of up to SEND_TIMEOUT_S for room, as a blocking socket would
        (a timeout on the socket would add a ``poll`` before every send and receive, and
        switching it on and off an ``ioctl`` each way)."""
        sock = self.sock
        assert sock is not None
        try:
            n = sock.send(data)
        except BlockingIOError:
            n = 0
        if n >= len(data):
            return
        try:
            self._send_sliced(sock, memoryview(data)[n:])
        finally:
            sock.settimeout(0.0)

    def _send_sliced(self, sock: Any, view: memoryview) -> None:
        """Send all of ``view``, waiting for room up to SEND_TIMEOUT_S in WAIT_SLICE_S slices (as a blocking send
        with that timeout would), and no longer once ``abandoned``; raises OSError (the frame is cut: the caller
        disconnects, and it goes again). Leaves the socket's timeout at WAIT_SLICE_S."""
        deadline = time.monotonic() + SEND_TIMEOUT_S
        sock.settimeout(WAIT_SLICE_S)
        while view:
            try:
                view = view[sock.send(view):]
            except _socket.timeout:
                if not self._may_wait(deadline):
                    raise
                continue
            if view and not self._may_wait(deadline):  # an agent that takes a little at a time: the same bound
                raise _socket.timeout("timed out")

    def _may_wait(self, deadline: float) -> bool:
        """Whether a wait on the agent goes on: before ``deadline``, and while the exit has not abandoned it."""
        return not self.abandoned and time.monotonic() < deadline

    def send(self, last_seq: int, n_events: int, frame: bytes) -> None:
        """Send one frame; it stays in the outbox until acked (a failure disconnects)."""
        self.outbox.append((last_seq, n_events, frame))
        self.outbox_bytes += len(frame)
        if not self.own():  # one fstat: never send into the host's file (lost: sent after the reconnect)
            return
        try:
            self._sendall(frame)
            self.sent_events += n_events
            self.sent_frames += 1
        except OSError:
            self.disconnect()  # (a lost socket: dropped, not closed; the outbox goes again)

    def send_group(self, group: List[Frame]) -> None:
        """Send frames in one write; each stays in the outbox until acked."""
        if len(group) == 1:
            self.send(*group[0])
            return
        for entry in group:
            self.outbox.append(entry)
            self.outbox_bytes += len(entry[2])
        if not self.own():  # (see ``send``)
            return
        try:
            self._sendall(b"".join(entry[2] for entry in group))
            self.sent_events += sum(entry[1] for entry in group)
            self.sent_frames += len(group)
        except OSError:
            self.disconnect()

    def take_outbox(self) -> List[Frame]:
        """Every unacked frame, forgotten here (at exit: they go to the spool)."""
        frames = list(self.outbox)
        self.outbox.clear()
        self.outbox_bytes = 0
        return frames

    def ring(self, frame: bytes = _wire.URGENT_FRAME) -> None:
        """The doorbell: a non-blocking connect and send of ``frame`` (``URGENT_FRAME``, or
        ``ENGINE_FRAME`` for a held launch) on a fresh connection; any failure is ignored (the
        report itself is on its way regardless)."""
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        ident = _fds.sock_ident(sock)
        try:
            sock.setblocking(False)
            sock.connect(self.socket_path)
            if _fds.same(sock.fileno(), ident):
                sock.send(frame)
                self.urgent_rings += 1
        except OSError:
            pass
        finally:
            _fds.close_sock(sock, ident)

    # -- acks ------------------------------------------------------------------------

    def read_acks(self, block: bool = False) -> None:
        """Read what the agent sent (acks); ``block``: wait up to half a second for one. The
        socket is non-blocking: one ``recv`` when what is waiting fits in it."""
        sock = self.sock
        if sock is None or not self.own():  # one fstat: never read the host's file
            return
        try:
            if block:
                sock.settimeout(0.5)
            while True:
                try:
                    chunk = sock.recv(RECV_BYTES)
                except (BlockingIOError, _socket.timeout):  # _socket.timeout: not TimeoutError on 3.9
                    break
                if not chunk:
                    self.disconnect()
                    return
                self._rx += chunk
                frames, self._rx, bad = _wire.split_frames(self._rx)
                self._take_acks(frames)
                if bad:
                    self.disconnect(drain=False)  # the stream is broken: nothing more to read in it
                    return
                if block or len(chunk) < RECV_BYTES:
                    break  # a short read took all there was: no second recv to hear "nothing"
        except OSError:
            self.disconnect()
            return
        finally:
            if block and self.sock is not None:
                try:
                    self.sock.settimeout(0.0)
                except OSError:
                    self.disconnect()

    def wait_room(self) -> bool:
        """When the outbox is full, wait briefly for acks; True when there is room now."""
        if self.congested():
            self.read_acks(block=True)
        return not self.congested()

    def _on_ack(self, seq: int) -> None:
        self.acked = max(self.acked, seq)
        while self.outbox and self.outbox[0][0] <= seq:
            _last, _n, frame = self.outbox.popleft()
            self.outbox_bytes -= len(frame)
