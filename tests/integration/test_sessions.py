"""The agent's side of a joined launch (agent/daemon/sessions.py): what a subscription gets.

The real assembler and a real socket pair carry the frames; the producers are hellos as the
hooks send them. Only the session's producers, only the subscriber's uid (root sees all), only
the kinds asked for; frames always under the wire's limit; a subscriber that does not read
loses items, counted, and never holds the agent up.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

from infersight.agent.daemon import itemcodec, sessions
from infersight.agent.daemon.assemble import Assembler
from infersight.hooks import _wire
from infersight.telemetry import LogItem

SESSION = "ab" * 16


def hello(asm: Assembler, pid: int, uid: int, session: str) -> Any:
    return asm.hello({"id": "boot-%d-1" % pid, "pid": pid, "start_ns": 1, "trace_id": "%032x" % pid,
                      "root_span_id": "%016x" % pid, "session": session}, uid=uid)  # uid: the kernel's word


def log_of(producer: Any, body: str) -> LogItem:
    return LogItem(producer.resource, 1, 9, "INFO", body, {}, None, None, None, None)


def read_frames(sock: socket.socket) -> list[dict[str, Any]]:
    sock.setblocking(False)
    buf = b""
    try:
        while True:
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
    except BlockingIOError:
        pass
    frames, rest, bad = _wire.split_frames(buf)
    assert not rest and not bad
    return [m for m in (_wire.decode_payload(f) for f in frames) if m is not None]


async def subscriber(sess: sessions.Sessions, uid: int, kinds: list[str]) -> tuple[socket.socket, Any]:
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=theirs)
    before = len(sess)
    task = asyncio.create_task(sess.serve({"t": "subscribe", "session": SESSION, "kinds": kinds}, uid, reader, writer))
    while len(sess) == before:
        await asyncio.sleep(0)
    return ours, task


def test_only_the_sessions_producers_of_the_subscribers_uid() -> None:
    async def main() -> tuple[list[str], list[str]]:
        asm = Assembler("host")
        mine = hello(asm, 101, 1000, SESSION)
        other_session = hello(asm, 102, 1000, "cd" * 16)
        other_uid = hello(asm, 103, 2000, SESSION)  # claims the token, is another user
        sess = sessions.Sessions(asm, lambda: {"pid": 1}, lambda _pid: False, lambda: 0)
        sock_user, t1 = await subscriber(sess, 1000, ["log"])
        sock_root, t2 = await subscriber(sess, 0, ["log"])
        sess.tap([log_of(mine, "mine"), log_of(other_session, "not this run"), log_of(other_uid, "other user")])
        await asyncio.sleep(0.05)
        got = {}
        for name, s in (("user", sock_user), ("root", sock_root)):
            frames = read_frames(s)
            assert frames[0]["t"] == "subscribed"
            got[name] = [itemcodec.from_dict(d).body for f in frames[1:] for d in f["i"]]  # type: ignore[union-attr]
            s.close()
        await asyncio.gather(t1, t2, return_exceptions=True)
        return got["user"], got["root"]

    user, root = asyncio.run(main())
    assert user == ["mine"]
    assert sorted(root) == ["mine", "other user"]


def test_kinds_filter_and_malformed_subscriptions_are_refused() -> None:
    async def main() -> list[dict[str, Any]]:
        asm = Assembler("host")
        sess = sessions.Sessions(asm, dict, lambda _pid: False, lambda: 0)
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=theirs)
        await sess.serve({"t": "subscribe", "session": "short", "kinds": ["log"]}, 0, reader, writer)
        frames = read_frames(ours)
        ours.close()
        return frames

    frames = asyncio.run(main())
    assert frames[0]["t"] == "refuse"


def test_frames_stay_under_the_wire_limit() -> None:
    asm = Assembler("host")
    p = hello(asm, 101, 0, SESSION)
    items = [log_of(p, "x" * 5000) for _ in range(400)]  # ~2 MB encoded
    frames = sessions.item_frames(items)
    assert len(frames) > 2
    assert all(len(f) <= _wire.MAX_FRAME_BYTES for f in frames)
    decoded = [d for f in frames for d in _wire.decode_payload(f[_wire.HEADER.size:])["i"]]  # type: ignore[index]
    assert len(decoded) == 400


def test_a_subscriber_that_does_not_read_loses_items_counted() -> None:
    async def main() -> tuple[int, int]:
        asm = Assembler("host")
        p = hello(asm, 101, 0, SESSION)
        sess = sessions.Sessions(asm, dict, lambda _pid: False, lambda: 0)
        ours, task = await subscriber(sess, 0, ["log"])
        sub = sess.subscribers[SESSION][0]
        batch = [log_of(p, "y" * 10_000) for _ in range(100)]  # ~1 MB per batch, nobody reads
        for _ in range(30):
            sess.tap(batch)
        dropped, sent = sub.dropped, sub.sent
        ours.close()
        await asyncio.gather(task, return_exceptions=True)
        return dropped, sent

    dropped, sent = asyncio.run(main())
    assert dropped > 0 and sent > 0
    assert dropped + sent == 3000


def test_a_second_uid_presenting_a_producers_id_is_not_taken_for_it() -> None:
    """Another uid that says the same producer id (a dead process's spool, a peer in another pid
    namespace) gets its own entry (``<id>@<uid>``) but items with the same service.instance.id:
    they must not reach the session of the producer whose id it borrowed, root's included."""

    async def main() -> tuple[list[str], list[str]]:
        asm = Assembler("host")
        mine = hello(asm, 101, 1000, SESSION)
        borrowed = hello(asm, 101, 2000, "cd" * 16)  # the same id, from uid 2000, another session
        assert borrowed.id != mine.id and borrowed.resource.get("service.instance.id") == "boot-101-1"
        sess = sessions.Sessions(asm, dict, lambda _pid: False, lambda: 0)
        sock_user, t1 = await subscriber(sess, 1000, ["log"])
        sock_root, t2 = await subscriber(sess, 0, ["log"])
        sess.tap([log_of(mine, "mine"), log_of(borrowed, "injected")])
        await asyncio.sleep(0.05)
        got = {}
        for name, s in (("user", sock_user), ("root", sock_root)):
            frames = read_frames(s)
            got[name] = [itemcodec.from_dict(d).body for f in frames[1:] for d in f["i"]]  # type: ignore[union-attr]
            s.close()
        await asyncio.gather(t1, t2, return_exceptions=True)
        return got["user"], got["root"]

    user, root = asyncio.run(main())
    assert user == ["mine"]
    assert root == ["mine"]


def test_a_producer_whose_id_another_uid_took_first_still_reaches_its_session() -> None:
    """The other way round: another uid said the id first (a file planted in the spool, read before the real
    producer's hello), so the real producer is kept as ``<id>@<uid>``; its items went to no session, since the
    lookup found the other uid's entry under the plain id."""

    async def main() -> list[str]:
        asm = Assembler("host")
        hello(asm, 101, 2000, "cd" * 16)  # the squatter, first
        mine = hello(asm, 101, 1000, SESSION)
        assert mine.id == "boot-101-1@1000"
        sess = sessions.Sessions(asm, dict, lambda _pid: False, lambda: 0)
        sock_user, t1 = await subscriber(sess, 1000, ["log"])
        sess.tap([log_of(mine, "mine")])
        await asyncio.sleep(0.05)
        frames = read_frames(sock_user)
        sock_user.close()
        await asyncio.gather(t1, return_exceptions=True)
        return [itemcodec.from_dict(d).body for f in frames[1:] for d in f["i"]]  # type: ignore[union-attr]

    assert asyncio.run(main()) == ["mine"]


def test_one_uid_cannot_take_every_subscription() -> None:
    """A user that opens subscriptions and never ends them is refused past its own share; the
    next user (and root) still subscribe."""

    async def main() -> tuple[list[str], list[str]]:
        asm = Assembler("host")
        sess = sessions.Sessions(asm, dict, lambda _pid: False, lambda: 0)
        held = [await subscriber(sess, 1000, ["log"]) for _ in range(sessions.MAX_SUBSCRIBERS_PER_UID)]
        replies = []
        for uid in (1000, 2000, 0):
            ours, theirs = socket.socketpair()
            reader, writer = await asyncio.open_unix_connection(sock=theirs)
            task = asyncio.create_task(sess.serve({"t": "subscribe", "session": SESSION, "kinds": ["log"]},
                                                  uid, reader, writer))
            await asyncio.sleep(0.05)
            replies.append(read_frames(ours)[0]["t"])
            ours.close()
            held.append((ours, task))
        for s, _ in held:
            s.close()
        await asyncio.gather(*(t for _, t in held), return_exceptions=True)
        return replies[:1], replies[1:]

    first, others = asyncio.run(main())
    assert first == ["refuse"]
    assert others == ["subscribed", "subscribed"]


# -- stderr captures (a joined launch's relay) ---------------------------------------------------------------


async def capturing(sess: sessions.Sessions, uid: int, peer_pid: int = 0,
                    relay: bool = True, **extra: Any) -> tuple[socket.socket, Any]:
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=theirs)
    before = len(sess)
    msg = {"t": "subscribe", "session": SESSION, "kinds": ["log"], "relay": relay, **extra}
    task = asyncio.create_task(sess.serve(msg, uid, reader, writer, peer_pid))
    while len(sess) == before:
        await asyncio.sleep(0)
    return ours, task


def capture_frame(text: str, pid: int | None, **extra: Any) -> bytes:
    return _wire.encode_frame({"t": "stderr", "pid": pid, "text": text, **extra})


def run_captures(uid: int, frames: list[bytes], peer_pid: int = 0, relay: bool = True,
                 producers: tuple[tuple[int, int], ...] = ()) -> tuple[list[tuple[Any, str]], dict[str, Any]]:
    """The captures the agent's classifier got (producer, text), and the ``ended`` frame."""
    got: list[tuple[Any, str]] = []

    async def main() -> dict[str, Any]:
        asm = Assembler("host")
        for pid, puid in producers:
            hello(asm, pid, puid, SESSION)
        sess = sessions.Sessions(asm, lambda: {"pid": 1}, lambda _pid: False, lambda: asyncio.sleep(0, 0),
                                 capture=lambda p, text: got.append((p, text)))
        sock, task = await capturing(sess, uid, peer_pid, relay)
        sock.sendall(b"".join(frames) + _wire.encode_frame({"t": "end", "timeout_s": 0}))
        await asyncio.wait_for(task, 5)
        frames_back = read_frames(sock)
        sock.close()
        assert frames_back[0]["t"] == "subscribed" and frames_back[0]["captures"] is True
        assert not sess._stand_ins, "the stand-ins go with their subscription"
        return frames_back[-1]

    return got, asyncio.run(main())


def test_a_capture_is_the_sessions_producer_of_that_pid_of_the_subscribers_uid() -> None:
    got, ended = run_captures(1000, [capture_frame("out of memory", 101), capture_frame("out of memory", 103)],
                              producers=((101, 1000), (103, 2000)))
    (p1, text), (p2, _) = got
    assert text == "out of memory" and p1.info["pid"] == 101 and p1.uid == 1000  # CMD's own producer
    # pid 103 is another user's producer that claims this session: a stand-in of the subscriber's uid, not it
    assert p2.uid == 1000 and p2.id.startswith("launch-stderr-") and p2.info["pid"] is None
    assert p2.resource.get("process.user.id") == 1000 and p2.resource.get("process.pid") is None
    assert ended["t"] == "ended" and ended["captures"] == 2 and ended["captures_dropped"] == 0


def test_a_stand_in_keeps_a_pid_only_for_the_subscribers_own_child() -> None:
    import os
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        got, _ = run_captures(os.getuid(), [capture_frame("x", child.pid, argv=["/opt/llama-server", "-c", "4096"],
                                                          service="llama\x1b[31m")],
                              peer_pid=os.getpid())
        got_other, _ = run_captures(os.getuid(), [capture_frame("x", child.pid)], peer_pid=1)  # not pid 1's child
    finally:
        child.kill()
        child.wait()
    (p, _), = got
    assert p.info["pid"] == child.pid and p.resource.get("process.pid") == child.pid
    assert p.resource.get("process.executable.name") == "llama-server" and p.info["argv"][1:] == ["-c", "4096"]
    assert p.resource.get("service.name") == "llama\ufffd[31m"  # another user's string, made plain once
    (q, _), = got_other
    assert q.info["pid"] is None and q.resource.get("process.pid") is None


def test_captures_over_the_rate_or_malformed_are_counted_not_classified() -> None:
    frames = [capture_frame("line %d \x1b[31mred\x1b[0m" % i, 101) for i in range(sessions.CAPTURE_BURST + 10)]
    frames += [capture_frame("", 101), _wire.encode_frame({"t": "stderr", "pid": "101", "text": "x"})]
    got, ended = run_captures(1000, frames, producers=((101, 1000),))
    assert sessions.CAPTURE_BURST <= len(got) < sessions.CAPTURE_BURST + 10
    assert got[0][1] == "line 0 red"  # the engine's colours go before the rules read it
    assert ended["captures"] == len(got) and ended["captures_dropped"] == len(frames) - len(got)


def test_a_subscription_without_a_relay_sends_no_captures() -> None:
    got, ended = run_captures(1000, [capture_frame("out of memory", 101)], relay=False, producers=((101, 1000),))
    assert got == [] and ended["captures_dropped"] == 1


def test_a_routing_hint_passing_the_tap_is_no_sessions_and_breaks_nothing() -> None:
    """The agent's routing hints pass every tap: the session tap raised on them (an assertion) for as long as any
    launch was subscribed and any instance ramped, logging a traceback each time (review finding)."""
    from infersight.telemetry import RoutingHint

    async def main() -> list[str]:
        asm = Assembler("host")
        mine = hello(asm, 101, 1000, SESSION)
        sess = sessions.Sessions(asm, lambda: {"pid": 1}, lambda _pid: False, lambda: 0)
        sock, task = await subscriber(sess, 1000, list(sessions.KINDS))
        hint = RoutingHint(mine.resource, "llm", 8000, 1, None)
        sess.tap([hint, log_of(mine, "mine")])
        await asyncio.sleep(0.05)
        frames = read_frames(sock)
        sock.close()
        await asyncio.gather(task, return_exceptions=True)
        return [itemcodec.from_dict(d).body for f in frames[1:] for d in f["i"]]  # type: ignore[union-attr]

    assert asyncio.run(main()) == ["mine"]


def test_only_a_launch_of_the_producers_own_uid_or_root_makes_its_errors_wait_for_a_stderr_copy() -> None:
    """Another uid that learnt a session's token (a root launch whose CMD drops to a service user can read
    its own environ) must not make that user's undecided errors wait, nor end their wait (review finding)."""

    async def main() -> tuple[bool, bool, bool]:
        asm = Assembler("host")
        victim = hello(asm, 101, 1000, SESSION)
        sess = sessions.Sessions(asm, lambda: {"pid": 1}, lambda _pid: False, lambda: 0)
        s1, t1 = await capturing(sess, 2000)  # another uid, with the token
        other = sess.relays(victim.info)
        s2, t2 = await capturing(sess, 1000)  # the producer's own uid
        own = sess.relays(victim.info)
        s1.close()
        s2.close()
        await asyncio.gather(t1, t2, return_exceptions=True)
        s3, t3 = await capturing(sess, 0)  # root's
        root = sess.relays(victim.info)
        s3.close()
        await asyncio.gather(t3, return_exceptions=True)
        return other, own, root

    assert asyncio.run(main()) == (False, True, True)


def test_a_console_subscription_gets_only_the_log_records_it_shows() -> None:
    """A joined launch without --otlp-file subscribes to log records for its OOM lines only: every other record
    of its CMD (``hooks.log``) was streamed back for nothing (review finding). An older launch, which names no
    events, still gets them all."""

    async def main(events: list[str] | None) -> list[str]:
        asm = Assembler("host")
        mine = hello(asm, 101, 1000, SESSION)
        sess = sessions.Sessions(asm, lambda: {"pid": 1}, lambda _pid: False, lambda: 0)
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=theirs)
        msg: dict[str, Any] = {"t": "subscribe", "session": SESSION, "kinds": ["log"]}
        if events is not None:
            msg["log_events"] = events
        task = asyncio.create_task(sess.serve(msg, 1000, reader, writer))
        while not len(sess):
            await asyncio.sleep(0)
        oom = LogItem(mine.resource, 1, 17, "ERROR", "OOM [vllm]: ...", {}, None, None, "oom", None)
        sess.tap([log_of(mine, "a user's record"), oom])
        await asyncio.sleep(0.05)
        frames = read_frames(ours)
        ours.close()
        await asyncio.gather(task, return_exceptions=True)
        return [itemcodec.from_dict(d).body for f in frames[1:] for d in f["i"]]  # type: ignore[union-attr]

    assert asyncio.run(main(["oom"])) == ["OOM [vllm]: ..."]
    assert asyncio.run(main(None)) == ["a user's record", "OOM [vllm]: ..."]


def test_a_relay_that_launch_starts_after_cmd_is_pending_until_it_says_relaying() -> None:
    """launch subscribes, spawns CMD, and only then runs the loop that forwards its relay's captures (seconds on a
    busy host): its subscription says ``relay_pending`` and the agent takes the relay as started only at its
    ``relaying`` frame. An older launch (no ``relay_pending``) relays from its subscription; no launch: 0.0."""

    async def main() -> tuple[Any, ...]:
        asm = Assembler("host")
        cmd = hello(asm, 101, 1000, SESSION)
        sess = sessions.Sessions(asm, lambda: {"pid": 1}, lambda _pid: False, lambda: 0)
        nobody = sess.relay_started(cmd.info)
        sock, task = await capturing(sess, 1000, relay_pending=True)
        pending = sess.relay_started(cmd.info)
        before = time.monotonic()
        sock.sendall(_wire.encode_frame({"t": "relaying"}))
        deadline = time.monotonic() + 5
        while sess.relay_started(cmd.info) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        started = sess.relay_started(cmd.info)
        sock.close()
        await asyncio.gather(task, return_exceptions=True)
        old_sock, old_task = await capturing(sess, 1000)  # an older launch's subscription
        old = sess.relay_started(cmd.info)
        old_sock.close()
        await asyncio.gather(old_task, return_exceptions=True)
        return nobody, pending, before, started, old

    nobody, pending, before, started, old = asyncio.run(main())
    assert nobody == 0.0 and pending is None
    assert started is not None and started >= before
    assert old is not None and 0.0 < old <= time.monotonic()
