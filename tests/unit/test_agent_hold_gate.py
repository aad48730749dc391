"""launch_hold: launch holds its embedded agent back while CMD starts (real processes, real
sockets), and the hooks' side of it (the mark beside the socket)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from infersight.agent.commands import launch_hold
from infersight.agent.commands.launch_base import Child
from infersight.hooks import _connection, _wire


class Cmd:
    """A real CMD (a subprocess) and launch's private directory with its listening socket."""

    def __init__(self, tmp: Path, code: str) -> None:
        self.dir = str(tmp)
        os.makedirs(os.path.join(self.dir, "spool"), exist_ok=True)
        self.sock_path = os.path.join(self.dir, "agent.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.sock_path)
        self.listener.listen(64)
        self.spawn_ns = time.time_ns()
        popen = subprocess.Popen([sys.executable, "-c", code])
        self.child = Child(popen, None)

    def hold(self, hold_s: float = 20.0) -> launch_hold.Held:
        return launch_hold.hold(self.child, self.listener.fileno(), self.spawn_ns, self.dir, hold_s)

    def close(self) -> None:
        if self.child.popen.poll() is None:
            self.child.popen.kill()
        self.child.popen.wait()
        self.listener.close()


@pytest.fixture
def cmds(tmp_path: Path):  # type: ignore[no-untyped-def]
    made: list[Cmd] = []

    def make(code: str) -> Cmd:
        c = Cmd(tmp_path / ("l%d" % len(made)), code)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def ring_later(path: str, delay_s: float, frame: bytes = _wire.URGENT_FRAME, after: threading.Event | None = None,
               sent: threading.Event | None = None) -> threading.Thread:
    """Send ``frame`` on a fresh connection ``delay_s`` from now (from ``after``, when given: another thread's
    step that must come first whatever the load), then set ``sent``."""
    def ring() -> None:
        if after is not None:
            after.wait(30)
        time.sleep(delay_s)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(frame)
        if sent is not None:
            sent.set()
        if frame != _wire.URGENT_FRAME:
            time.sleep(1.0)  # a producer's connection stays open
        s.close()

    t = threading.Thread(target=ring)
    t.start()
    return t


def test_the_hold_ends_when_cmd_exits_and_leaves_no_mark(cmds) -> None:  # type: ignore[no-untyped-def]
    c = cmds("import time; time.sleep(0.3)")
    held = c.hold()
    assert held.why == "exited"
    assert c.child.exit_ns >= c.spawn_ns
    assert held.connections == [] and not held.hooked
    assert not os.path.exists(launch_hold.mark_path(c.dir))


def test_the_mark_lies_beside_the_socket_while_held_and_a_doorbell_ends_the_hold(cmds) -> None:  # type: ignore[no-untyped-def]
    c = cmds("import time; time.sleep(30)")
    seen: list[bool] = []
    looked = threading.Event()

    def look() -> None:  # while the hold waits (the doorbell rings only after this look, whatever the load)
        deadline = time.monotonic() + 30
        while not os.path.exists(launch_hold.mark_path(c.dir)) and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(os.path.exists(launch_hold.mark_path(c.dir)))
        looked.set()

    t = threading.Thread(target=look)
    t.start()
    ringer = ring_later(c.sock_path, 0.0, after=looked)
    held = c.hold()
    ringer.join()
    t.join()
    assert held.why == "doorbell"  # (not the deadline, nor CMD's exit: it still runs)
    assert c.child.popen.poll() is None
    assert seen == [True]
    assert held.connections == []  # the doorbell is closed: it did its work
    assert not os.path.exists(launch_hold.mark_path(c.dir))


def test_an_engine_s_import_ends_the_hold_as_its_own_reason(cmds) -> None:  # type: ignore[no-untyped-def]
    # a process of CMD imported vllm (hooks._activate): the agent starts while CMD still starts, so launch
    # starts it niced and loads the OOM rules (launch.STILL_STARTING, launch_session)
    from infersight.agent.commands.launch import STILL_STARTING

    c = cmds("import time; time.sleep(30)")
    ringer = ring_later(c.sock_path, 0.3, _wire.ENGINE_FRAME)
    held = c.hold()
    ringer.join()
    assert held.why == "engine" and "engine" in STILL_STARTING
    assert held.connections == [] and c.child.popen.poll() is None
    assert not os.path.exists(launch_hold.mark_path(c.dir))


def test_the_hold_ends_at_its_deadline(cmds) -> None:  # type: ignore[no-untyped-def]
    c = cmds("import time; time.sleep(30)")
    held = c.hold(hold_s=0.4)
    assert held.why == "deadline"
    assert time.time_ns() - c.spawn_ns >= 0.4e9
    assert c.child.popen.poll() is None


def test_a_connection_that_says_hello_is_kept_for_the_agent_unread(cmds) -> None:  # type: ignore[no-untyped-def]
    c = cmds("import time; time.sleep(30)")
    hello = _wire.encode_frame({"t": "hello", "schema": 1})
    said_hello = threading.Event()
    producer = ring_later(c.sock_path, 0.2, hello, sent=said_hello)
    doorbell = ring_later(c.sock_path, 0.4, after=said_hello)  # after the hello, however late its thread ran
    held = c.hold()
    producer.join()
    doorbell.join()
    assert held.why == "doorbell" and held.hooked
    assert len(held.connections) == 1
    held.connections[0].setblocking(True)
    assert held.connections[0].recv(len(hello) + 10) == hello  # every byte still there for the agent
    held.connections[0].close()


def test_an_unhooked_cmd_that_listens_ends_the_hold_with_its_time(cmds) -> None:  # type: ignore[no-untyped-def]
    c = cmds("import socket, time; time.sleep(0.5); s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen();"
             " time.sleep(30)")
    held = c.hold()
    assert held.why == "listening"
    assert held.listening is not None and held.listening[0] == "tcp"
    assert held.listening_ns - c.spawn_ns >= 0.45e9  # found when it listened, not at once
    assert held.listening_ns <= time.time_ns()


def test_a_spooling_hooked_process_stops_the_listen_watch(cmds) -> None:  # type: ignore[no-untyped-def]
    c = cmds("import socket, time; time.sleep(0.6); s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen();"
             " time.sleep(30)")
    Path(c.dir, "spool", "children-0").mkdir()  # a supervisor's workers' directory: no producer
    Path(c.dir, "spool", "producer.spool").write_bytes(b"")  # what a held hooked process writes
    held = c.hold(hold_s=1.5)
    assert held.hooked
    assert held.why == "deadline"  # its own hooks say when it is ready, not launch's watch
    assert held.listening is None


def test_a_memory_error_on_cmds_stderr_ends_the_hold(cmds) -> None:  # type: ignore[no-untyped-def]
    c = cmds("import time; time.sleep(30)")

    class Relay:
        memory_error_seen = False

    relay = Relay()
    c.child.relay = relay  # type: ignore[assignment]
    threading.Timer(0.3, lambda: setattr(relay, "memory_error_seen", True)).start()
    held = c.hold()
    assert held.why == "stderr"


# -- the hooks' side ----------------------------------------------------------------------


def test_a_launched_producer_does_not_connect_while_the_mark_is_there(tmp_path: Path) -> None:
    path = str(tmp_path / "agent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    listener.settimeout(0.2)
    mark = tmp_path / _wire.AGENT_HELD_MARK
    mark.write_text("1")
    conn = _connection.Connection(path, {"launched": True, "pid": os.getpid()})
    assert conn.held()
    assert conn.connect() is False
    assert not conn.up and conn.held_back
    assert 0 < conn.retry_in() <= _connection.HELD_RETRY_S  # it looks again soon
    with pytest.raises(socket.timeout):
        listener.accept()  # it did not even connect: no wait for a welcome that cannot come
    worker = _connection.Connection(path, {"pid": os.getpid()})  # a process CMD started: held too
    assert worker.held()
    elsewhere = _connection.Connection(str(tmp_path / "d" / "agent.sock"), {"pid": os.getpid()})
    assert not elsewhere.held()  # the mark is only launch's, beside its own socket
    mark.unlink()
    assert not conn.held()
    conn.ring()  # the doorbell rings whatever the mark says
    s, _ = listener.accept()
    s.settimeout(1.0)
    assert s.recv(64) == _wire.URGENT_FRAME
    s.close()
    listener.close()


def test_what_a_connection_wants_is_told_from_its_first_bytes() -> None:
    hello = _wire.hello_frame({"id": "p", "pid": 1})
    assert launch_hold.what_it_wants(_wire.URGENT_FRAME) == "doorbell"
    assert launch_hold.what_it_wants(hello[:launch_hold.PEEK]) == "hello"
    assert launch_hold.what_it_wants(_wire.STATUS_FRAME) == "request"
    assert launch_hold.what_it_wants(b"") == "closed"
    assert launch_hold.what_it_wants(_wire.URGENT_FRAME[:7]) is None  # too few bytes yet
    assert launch_hold.what_it_wants(_wire.ENGINE_FRAME[:launch_hold.PEEK]) == "engine"
    assert launch_hold.what_it_wants(_wire.ENGINE_FRAME[:7]) is None
    assert launch_hold.what_it_wants(hello[:9]) is None
    assert launch_hold.what_it_wants(b"\x00\x00\x00\x05garbage!!!!!!!!!!!!") == "request"


def test_a_status_request_ends_the_hold_and_a_trickling_peer_does_not_spin(cmds, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import select as real_select

    turns = [0]

    class CountingSelect:  # the hold's own select, counted: a readable peer it cannot read yet would spin it
        @staticmethod
        def select(*args: Any) -> Any:
            turns[0] += 1
            return real_select.select(*args)

    monkeypatch.setattr(launch_hold, "select", CountingSelect)
    c = cmds("import time; time.sleep(30)")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(c.sock_path)
    s.sendall(_wire.URGENT_FRAME[:3])  # a peer that sends three bytes and stalls
    status = ring_later(c.sock_path, 0.8, _wire.STATUS_FRAME)
    began = time.monotonic()
    held = c.hold()
    took = time.monotonic() - began  # 0.8 s, or more where the ringing thread ran late
    status.join()
    assert held.why == "request"
    assert len(held.connections) == 2  # the status request and the stalled peer, for the agent
    assert turns[0] <= took / launch_hold.LISTEN_POLL_S * 3  # a turn per poll, not one per readable wake-up
    for conn in held.connections:
        conn.close()
    s.close()


def test_no_hold_where_the_mark_cannot_be_written(cmds, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    c = cmds("import time; time.sleep(30)")
    held = launch_hold.hold(c.child, c.listener.fileno(), c.spawn_ns, str(tmp_path / "gone" / "dir"))
    assert held.why == "no mark"  # the hooks would not spool: they must find an agent at once
    assert c.child.popen.poll() is None  # returned at once, not at CMD's exit


def test_a_second_hooked_process_ends_the_hold(cmds) -> None:  # type: ignore[no-untyped-def]
    c = cmds("import time; time.sleep(30)")
    spool = Path(c.dir, "spool")
    (spool / "supervisor.spool").write_bytes(b"")
    threading.Timer(0.4, lambda: (spool / "worker.spool").write_bytes(b"")).start()
    held = c.hold()
    assert held.why == "workers" and held.hooked  # a supervisor's workers report through the agent


def test_a_process_that_spools_in_bulk_ends_the_hold(cmds) -> None:  # type: ignore[no-untyped-def]
    c = cmds("import time; time.sleep(30)")
    big = Path(c.dir, "spool", "producer.spool")
    big.write_bytes(b"")
    threading.Timer(0.4, lambda: big.write_bytes(b"x" * (launch_hold.MAX_SPOOLED_BYTES + 1))).start()
    held = c.hold()
    assert held.why == "spooling"  # the agent takes a burst live: a spool is slower to write and replay
