"""The drain thread sleeps while nothing is owed, and sends on a non-blocking socket: each of
its wake-ups and system calls costs the host's busy main thread a GIL switch (issue 23)."""

from __future__ import annotations

import os
import socket
import threading
import time

from infersight.hooks import _client
from infersight.hooks._client import Client
from infersight.hooks._connection import Connection


def test_an_idle_client_does_not_wake(tmp_path) -> None:
    c = Client(str(tmp_path / "absent.sock"), str(tmp_path / "spool"), {"id": "t"})
    try:
        time.sleep(0.05)
        n = c.wakeups
        assert c._idle_wait() == _client.IDLE_LONG_S
        time.sleep(3 * _client.IDLE_WAIT_S)
        assert c.wakeups == n  # was one round per IDLE_WAIT_S
    finally:
        c.close(0.1)


def test_with_the_agent_away_a_spooling_client_wakes_for_its_next_try_only(tmp_path) -> None:
    c = Client(str(tmp_path / "absent.sock"), str(tmp_path / "spool"), {"id": "t"}, batch_delay_s=0.0)
    try:
        c.emit("log", {"m": "x"})
        deadline = time.monotonic() + 5
        while not c.spool.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.spool.pending()  # spooled: the agent is owed it
        # until its next try (the connection's back-off), within [IDLE_WAIT_S, IDLE_LONG_S]
        for retry_in, expected in ((1.5, 1.5), (0.0, _client.IDLE_WAIT_S), (99.0, _client.IDLE_LONG_S)):
            c.conn.retry_in = lambda r=retry_in: r  # type: ignore[method-assign]
            assert c._idle_wait() == expected
    finally:
        c.close(0.1)


def test_gone_after_a_welcome_a_client_owed_nothing_wakes_for_its_next_try(tmp_path) -> None:
    """The agent knew this producer and lost its connection: the producer must be back within the agent's grace
    for a pid it cannot see (liveness.PIDLESS_GRACE_S), so it wakes for its next try even with nothing owed. It
    slept IDLE_LONG_S at a time, and came back at the first wake-up past its backoff: 10 or 15 s, not 12.5."""
    c = Client(str(tmp_path / "absent.sock"), str(tmp_path / "spool"), {"id": "t"})
    try:
        assert not (c.conn.outbox or c.spool.pending() or c._unreported())  # owed nothing
        c.conn.retry_in = lambda: 1.5  # type: ignore[method-assign]
        assert c._idle_wait() == _client.IDLE_LONG_S  # never welcomed: no agent counts its absence
        c.conn.welcomed = True
        assert c._idle_wait() == 1.5
        c.conn.refused = True  # refused: it does not try again
        assert c._idle_wait() == _client.IDLE_LONG_S
    finally:
        c.close(0.1)


def test_a_send_larger_than_the_socket_buffer_waits_for_room() -> None:
    """Non-blocking, one ``send`` takes what fits; the rest waits for room as a blocking
    socket's ``sendall`` did, and arrives whole and in order."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    a.settimeout(0.0)
    conn = Connection("/nonexistent", {"id": "t"})
    conn.sock = a
    data = os.urandom(1 << 20)
    got = bytearray()

    def reader() -> None:
        while len(got) < len(data):
            time.sleep(0.001)
            got.extend(b.recv(1 << 16))

    t = threading.Thread(target=reader)
    t.start()
    conn.send(1, 1, data)
    t.join(10)
    assert bytes(got) == data and conn.up and conn.sent_frames == 1
    assert a.gettimeout() == 0.0  # non-blocking again
    a.close()
    b.close()


def test_acks_are_read_without_a_timeout_switch() -> None:
    from infersight.hooks import _wire

    a, b = socket.socketpair()
    a.settimeout(0.0)
    conn = Connection("/nonexistent", {"id": "t"})
    conn.sock = a
    conn.send(7, 1, b"x")
    conn.read_acks()  # nothing yet: not an error
    assert conn.up and conn.outbox
    payload = b'{"t":"ack","seq":7}'
    b.sendall(_wire.HEADER.pack(len(payload)) + payload)
    conn.read_acks()
    assert conn.acked == 7 and not conn.outbox and a.gettimeout() == 0.0
    a.close()
    b.close()


def _parked_client(tmp_path):  # type: ignore[no-untyped-def]
    """A client whose drain thread has stopped, its connection a socketpair: the test pumps."""
    c = Client(str(tmp_path / "absent.sock"), str(tmp_path / "spool"), {"id": "t"}, batch_delay_s=0.0)
    c._stop = True
    c._wake.set()
    c._thread.join(5)
    c._stop = False
    a, b = socket.socketpair()
    a.settimeout(0.0)
    c.conn.sock = a
    reads: list[bool] = []
    orig = c.conn.read_acks

    def counted(block: bool = False) -> None:
        reads.append(block)
        orig(block)

    c.conn.read_acks = counted  # type: ignore[method-assign]
    return c, b, reads


def test_acks_are_read_when_they_matter_not_before_every_send(tmp_path) -> None:
    from infersight.hooks import _wire

    c, agent, reads = _parked_client(tmp_path)
    try:
        c.emit("log", {"m": "1"})
        c._pump()
        assert c.conn.sent_frames == 1 and reads == []  # sent, no receive for acks not there yet
        payload = b'{"t":"ack","seq":1}'
        agent.sendall(_wire.HEADER.pack(len(payload)) + payload)
        c.emit("log", {"m": "2"})
        c._pump()
        assert c.conn.sent_frames == 2 and reads == [] and len(c.conn.outbox) == 2
        c._pump()  # nothing to send: the idle wake-up reads them
        assert reads == [False] and c.conn.acked == 1 and len(c.conn.outbox) == 1
        c._flushing = 1
        c.emit("log", {"m": "3"})
        c._pump()
        assert reads == [False, False]  # a flush reads at every pump
        c._flushing = 0
        # frames unacked, nothing else owed: the thread comes back for them, after ACK_WAIT_S
        # (longer than the cold start's checkpoint period: no wake-up between two of them)
        assert c._idle_wait() == _client.ACK_WAIT_S
        assert _client.IDLE_WAIT_S < _client.ACK_WAIT_S < _client.IDLE_LONG_S
    finally:
        c.conn.sock = None
        agent.close()


def test_a_flush_does_not_wait_for_acks_from_an_agent_that_went_away(tmp_path) -> None:
    """Nothing reads the socket for nothing any more, so a dead agent shows at the next send
    (EPIPE): that frame is unacked for good. A flush (at exit: then the spool takes it) says
    so at once instead of waiting out its time for an ack that cannot come."""
    c, agent, _reads = _parked_client(tmp_path)
    agent.close()  # the agent is gone
    c.emit("log", {"m": "after"})
    c._pump()
    assert not c.conn.up and len(c.conn.outbox) == 1
    hurries: list[int] = []
    c.hurry = lambda: hurries.append(1)  # type: ignore[method-assign]
    assert c.flush(0.5) is False
    assert hurries == []  # no round of waiting for the ack


def test_counting_what_is_left_at_exit_survives_a_deque_the_drain_thread_changes(tmp_path) -> None:
    """At exit, with the drain thread stuck in I/O, close() counts what it leaves behind while
    that thread may still take from the buffer: copying a deque another thread changes raises
    RuntimeError ('deque mutated during iteration'), which disabled the hooks and lost the rest."""
    from collections import deque

    class Mutating(deque):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("deque mutated during iteration")

    c = Client(str(tmp_path / "absent.sock"), str(tmp_path / "spool"), {"id": "t"})
    try:
        c._buf = Mutating([(1, 0, "log", {}), (2, 0, "log", {})])  # type: ignore[assignment]
        assert c._left_behind() == 2  # an estimate, not an exception
    finally:
        c._buf = deque()  # type: ignore[assignment]
        c.close(0.1)


def test_at_exit_acks_already_queued_keep_their_frames_out_of_the_spool(tmp_path) -> None:
    """The flush at exit gives up at its deadline; acks that came after its last pump are
    read before the unacked frames go to the spool, or the agent replays (and exports) them
    a second time."""
    from infersight.hooks import _wire

    c, peer, _reads = _parked_client(tmp_path)
    c.conn.send(7, 1, b"frame seven")
    c.conn.send(8, 1, b"frame eight")
    payload = b'{"t":"ack","seq":7}'
    peer.sendall(_wire.HEADER.pack(len(payload)) + payload)
    with c._lock:
        c._spool_leftovers()
    spooled = b"".join(f.read_bytes() for f in (tmp_path / "spool").rglob("*") if f.is_file())
    assert b"frame eight" in spooled, "the unacked frame is kept"
    assert b"frame seven" not in spooled, "the acked frame is not replayed"
    peer.close()
