"""Another user cannot put spans into a victim's cold start (a review: a hostile member of the socket group).

A real root agent, two real users made with ``useradd`` (the victim and the attacker), each a raw
peer of the wire protocol (docs/wire.md) run as that user. The attacker knows the victim's trace id and
root span id (the MQTT ``coldstart`` message carries them) and sends, over its own connection,
``coldstart.weights_load`` (45 s) and ``coldstart.compile`` under the victim's root, and a ``coldstart``
root of its own there, as if it were the victim's worker. ``infersight show`` on the agent's file had
drawn them inside the victim's process (weights_load 97.4%, covered 100%); now the victim's waterfall
holds its own stages alone, with a line that counts what was left out, and the agent's own root of the
victim takes the attacker's root for no worker (no tree figure).
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import attr, read_otlp_lines, spans, wait_for
from local_users import socket_group, system_python3

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to make users and act as them")

GROUP, VICTIM, ATTACKER = "isgfs1", "isvfs1", "isafs1"
TRACE, ROOT_ID = "5e" * 16, "7a" * 8
S = 10**9

# A raw peer (stdlib only, run by the system Python as its user): hello, then one batch per line of its
# stdin (a JSON list of events, their times relative to its start), each acked before it says "acked N".
PEER = r"""
import json, os, socket, struct, sys, time
sock_path, service, trace, root_id = sys.argv[1:5]
T0 = time.time_ns() - 60 * 10**9
def frame(obj):
    b = json.dumps(obj).encode()
    return struct.pack("!I", len(b)) + b
def read(s):
    head = b""
    while len(head) < 4:
        head += s.recv(4 - len(head)) or sys.exit("closed")
    n, body = struct.unpack("!I", head)[0], b""
    while len(body) < n:
        body += s.recv(n - len(body)) or sys.exit("closed")
    return json.loads(body)
s = socket.socket(socket.AF_UNIX)
s.settimeout(30)
s.connect(sock_path)
s.sendall(frame({"t": "hello", "schema": 1, "producer": {
    "id": "raw-%d" % os.getpid(), "pid": os.getpid(), "start_ns": T0, "trace_id": trace,
    "root_span_id": root_id, "service_name": service, "exe": "python3"}}))
assert read(s)["t"] == "welcome"
seq = 0
for line in sys.stdin:
    events = []
    for ev in json.loads(line):
        seq += 1
        d = dict(ev)
        d["s"], d["e"] = T0 + d["s"], T0 + d["e"]
        events.append([seq, d["e"], "span", d])
    s.sendall(frame({"t": "b", "n": len(events), "l": seq, "e": events}))
    while True:
        msg = read(s)
        if msg.get("t") == "ack" and msg["seq"] >= seq:
            break
    print("acked", seq, flush=True)
"""


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[int, pwd.struct_passwd, pwd.struct_passwd]]:
    """The socket's group and its two members; what this made is removed after the module's tests."""
    with socket_group(GROUP, VICTIM, ATTACKER) as (gid, (victim, attacker)):
        yield gid, victim, attacker


def _peer(python: str, sock: Path, user: pwd.struct_passwd, gid: int, service: str, trace: str,
          root_id: str) -> subprocess.Popen[str]:
    return subprocess.Popen([python, "-c", PEER, str(sock), service, trace, root_id], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                            user=user.pw_uid, group=gid, extra_groups=[gid])


def _batch(p: subprocess.Popen[str], events: list[dict]) -> None:  # type: ignore[type-arg]
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(json.dumps(events) + "\n")
    p.stdin.flush()
    line = p.stdout.readline()
    assert line.startswith("acked"), line + (p.stderr.read() if p.stderr and p.poll() is not None else "")


def _span(name: str, sid: str, parent: str | None, s: float, e: float, trace: str = TRACE) -> dict:  # type: ignore[type-arg]
    d = {"n": name, "id": sid, "tr": trace, "s": int(s * S), "e": int(e * S)}
    if name != "coldstart":
        d["a"] = {"infersight.stage": name[len("coldstart."):]}
    if parent:
        d["p"] = parent
    return d


def test_another_users_spans_join_no_cold_start_of_the_victim(users, open_dir: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    gid, victim, attacker = users
    python = system_python3()
    agent = agent_factory(root=open_dir / "agent")
    agent.config.write_text(agent.config.read_text().replace(
        'spool_dir = "%s"' % agent.spool, 'spool_dir = "%s"\nallowed_gids = [%d]' % (agent.spool, gid)))
    os.chmod(open_dir / "agent", 0o755)
    agent.start()
    os.chown(agent.sock, 0, gid)  # the socket group, as infersight.socket makes it
    v = _peer(python, agent.sock, victim, gid, "victim-svc", TRACE, ROOT_ID)
    a = _peer(python, agent.sock, attacker, gid, "attacker-svc", "ab" * 16, "c" * 16)
    try:
        _batch(v, [_span("coldstart.model_build", "2" * 16, ROOT_ID, 0.2, 1.2)])
        _batch(a, [_span("coldstart.weights_load", "a" * 16, ROOT_ID, 0.0, 45.0),
                   _span("coldstart.compile", "b" * 16, ROOT_ID, 0.1, 44.0),
                   _span("coldstart.warmup", "d" * 16, "c" * 16, 0.0, 44.0),
                   _span("coldstart", "c" * 16, ROOT_ID, 0.0, 45.0)])  # its own root, as the victim's worker
        _batch(v, [_span("coldstart", ROOT_ID, None, 0.0, 2.0)])
    finally:
        for p in (v, a):
            if p.stdin is not None:
                p.stdin.close()
            p.wait(20)
    assert wait_for(lambda: any(s["name"] == "coldstart" and s["spanId"] == ROOT_ID
                                for s in spans(read_otlp_lines(agent.out))), 20)
    (root,) = [s for s in spans(read_otlp_lines(agent.out)) if s["name"] == "coldstart" and s["spanId"] == ROOT_ID]
    assert attr(root, "infersight.coldstart.tree_unattributed_s") is None, "the attacker's root is no worker"
    assert abs(float(attr(root, "infersight.coldstart.unattributed_s")) - 1.0) < 1e-6

    r = subprocess.run([sys.executable, "-m", "infersight", "show", str(agent.out)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    blocks = r.stdout.split("\n\n")
    (mine,) = [b for b in blocks if "victim-svc" in b]
    assert "model_build" in mine
    assert "weights_load" not in mine and "compile" not in mine, mine
    assert "(3 spans of another user's process claimed this trace; left out)" in mine, mine
    assert "weights_load" not in r.stdout  # drawn nowhere: it names no root of its own user
    assert [b for b in blocks if "attacker-svc" in b], r.stdout  # the attacker's own root: its own waterfall
    j = subprocess.run([sys.executable, "-m", "infersight", "show", "--format", "json", str(agent.out)],
                       capture_output=True, text=True, timeout=60)
    (cs,) = [c for c in json.loads(j.stdout)["coldstarts"] if c["service"] == "victim-svc"]
    assert cs["foreign_spans_left_out"] == 3 and [s["stage"] for s in cs["stages"]] == ["model_build"]
    assert cs["total_s"] == 2.0 and cs["parent"] is None
