"""An agent restart in the middle of a cold start writes every span once.

The hook reads the agent's acks lazily (not before each send of a busy cold start), so when the
agent goes away, acks it sent for frames it had already exported may still wait, unread, in the
hooked process's socket. The next send fails (EPIPE); if the connection is closed without
reading them, the reconnect resends those frames to the new agent, which knows nothing of them
and exports their spans a second time (``coldstart.<stage>`` twice in the file, with one span
id, and ``show`` doubled its share).

Real agent, real hooked process, the agent stopped (SIGTERM) or killed (SIGKILL) and started
again on the same socket and file. The race is made deterministic in the hooked process, with
events, not times: once its first stage is sent it holds the client's lock (the drain thread
cannot read acks, as while it is busy sending), waits until the agent's ack for that frame is
queued in its socket (``MSG_PEEK``: left unread), lets the test restart the agent, queues the
next stage and only then lets the drain thread go, whose first act is that failing send.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import hook_env, read_otlp_lines, spans, wait_for

CHILD = """\
import os, select, sys, time
import _socket
from infersight import hooks
from infersight.hooks import _runtime, _wire

acked_mark, restarted_mark = sys.argv[1], sys.argv[2]
c = _runtime.state().client
conn = c.conn
deadline = time.monotonic() + 60  # a bound, not a speed

def waiting(what):
    if time.monotonic() > deadline:
        sys.exit("timed out waiting for " + what)
    time.sleep(0.005)

with hooks.stage("first_part"):
    time.sleep(0.02)
while not (conn.up and conn.outbox and conn.sent_frames):
    waiting("the first frame to be sent")
c._lock.acquire()  # the drain thread reads no acks from here on
sock, last = conn.sock, conn.outbox[-1][0]
assert sock is not None and conn.acked < last, (conn.acked, last)
queued = 0
while queued < last:  # the agent's ack for every frame sent, queued and unread
    select.select([sock], [], [], 0.2)
    try:
        data = sock.recv(1 << 16, _socket.MSG_PEEK)
    except BlockingIOError:
        data = b""
    frames, _rest, _bad = _wire.split_frames(data)
    queued = max([m["seq"] for m in map(_wire.decode_reply, frames) if m and m.get("t") == "ack"] + [0])
    if queued < last:
        waiting("the agent's ack")
print("acked unread", queued, "outbox", len(conn.outbox), flush=True)
open(acked_mark, "w").close()
while not os.path.exists(restarted_mark):
    waiting("the agent's restart")
with hooks.stage("second_part"):  # queued while the lock is held: the next pump sends it first
    time.sleep(0.02)
c._lock.release()
while conn.sock is sock:
    waiting("the send to fail")
print("old connection closed; acked", conn.acked, flush=True)
hooks.mark_ready()
while not hooks.flush(0.5):  # reconnect (backing off), resend what was not acked
    waiting("the flush")
print("flushed", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_an_agent_restart_mid_coldstart_exports_each_span_once(tmp_path: Path, agent_factory, sig: int) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    acked, restarted = tmp_path / "acked", tmp_path / "restarted"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.Popen([sys.executable, str(script), str(acked), str(restarted)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=hook_env(agent.sock, agent.spool))
    try:
        assert wait_for(lambda: acked.exists() or child.poll() is not None, 60)
        assert acked.exists(), child.communicate(timeout=10)[0]
        assert wait_for(lambda: any(s["name"] == "coldstart.first_part" for s in spans(read_otlp_lines(agent.out))),
                        10), "the acked stage is in the file before the restart"
        agent.stop(sig)
        agent.start()
        restarted.write_text("")
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert child.returncode == 0, out
    assert "old connection closed" in out and "flushed" in out, out

    def names() -> list[str]:
        return [s["name"] for s in spans(read_otlp_lines(agent.out))]

    assert wait_for(lambda: "coldstart" in names(), 30), agent.log.read_text()
    assert agent.stop() == 0
    got = spans(read_otlp_lines(agent.out))
    count = collections.Counter((s["traceId"], s["spanId"]) for s in got)
    twice = sorted({s["name"] for s in got if count[(s["traceId"], s["spanId"])] > 1})
    assert not twice, "spans written twice: %s\n%s" % (twice, out)
    by_name = collections.Counter(s["name"] for s in got)
    assert by_name["coldstart.first_part"] == 1 and by_name["coldstart.second_part"] == 1, by_name
    assert by_name["coldstart"] == 1, by_name
