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
        wait = c._idle_wait()
        assert _client.IDLE_WAIT_S <= wait <= _client.IDLE_LONG_S
        assert abs(wait - max(_client.IDLE_WAIT_S, c.conn.retry_in())) < 0.05
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
