"""Issue 22: two ordinary users in the socket group, one the victim, one the attacker, against a
root agent. Everything here runs for real: the users are made with ``useradd``, the victim is a
hooked Python process running as the victim, the attacker is a process running as the attacker.

- Identity (22.2): the attacker forges the victim's producer (its pid and producer id) over the
  socket and inside a spool file, and claims pid 1. Each hello is refused and counted; every
  one of the victim's events arrives, none is taken for a duplicate, and its cold start is
  whole (not closed early by the agent for a producer that "left").
- The shared spool directory (22.3): the attacker cannot delete the victim's spool file.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import attr, hook_env, log_records, read_otlp_lines, spans, wait_for
from local_users import socket_group, system_python3
from mosquitto import MOSQUITTO, running_broker

from infersight.hooks import _proc

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to make users and act as them")

GROUP, VICTIM, ATTACKER = "isg22ha", "isv22ha", "isa22ha"
N_EVENTS = 40


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[int, pwd.struct_passwd, pwd.struct_passwd]]:
    """The socket's group and its two members; what this made is removed after the module's tests."""
    with socket_group(GROUP, VICTIM, ATTACKER) as (gid, (victim, attacker)):
        yield gid, victim, attacker


@pytest.fixture
def base(open_dir: Path) -> Path:
    return open_dir


def shared_spool(base: Path, gid: int) -> Path:
    """The hooks' spool directory as the packaged tmpfiles.d line makes it: 3770 root:<group>."""
    spool = base / "spool"
    spool.mkdir()
    os.chown(spool, 0, gid)
    os.chmod(spool, 0o3770)
    return spool


VICTIM_SCRIPT = """
import os, sys, time
from infersight import hooks
assert hooks.active()
go = sys.argv[1]
with hooks.stage("weights_load"):
    print("warming", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)
for i in range(%d):
    hooks.log("victim-event", i=i)
""" % N_EVENTS

ATTACKER_SCRIPT = r"""
import json, os, socket, struct, sys
sock_path, spool, victim_id, victim_pid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

def frame(obj):
    b = json.dumps(obj).encode()
    return struct.pack("!I", len(b)) + b

def hello(pid, pid_id):
    return frame({"t": "hello", "schema": 1, "producer": {
        "id": pid_id, "pid": pid, "start_ns": 1, "trace_id": "e" * 32, "root_span_id": "f" * 16,
        "service_name": "victim-svc"}})

forged = frame({"t": "b", "e": [[i + 1, 5, "log", {"body": "forged", "a": {"i": i}}] for i in range(%d)]})
replies = []
for pid, pid_id in ((victim_pid, victim_id), (1, "forged-pid-1")):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(sock_path)
    s.sendall(hello(pid, pid_id) + forged)
    replies.append(s.recv(4096)[4:].decode())
    s.close()
# The same forgery in a spool file, where the agent replays files whose lock is free.
with open(os.path.join(spool, victim_id + "-00000000000000ff.spool"), "wb") as f:
    f.write(hello(victim_pid, victim_id) + forged)
print(json.dumps(replies), flush=True)
""" % N_EVENTS


def test_an_attacker_cannot_take_over_the_victims_producer(users, base: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    gid, victim, attacker = users
    python = system_python3()
    spool = shared_spool(base, gid)
    agent = agent_factory(root=base / "agent")
    agent.config.write_text(agent.config.read_text()
                            .replace('spool_dir = "%s"' % agent.spool, 'spool_dir = "%s"\nallowed_gids = [%d]'
                                     % (spool, gid)))
    os.chmod(base / "agent", 0o755)
    agent.start()
    os.chown(agent.sock, 0, gid)  # the socket group, as infersight.socket makes it
    go = base / "go"
    script = base / "victim.py"
    script.write_text(VICTIM_SCRIPT)
    env = hook_env(agent.sock, spool, OTEL_SERVICE_NAME="victim-svc", INFERSIGHT_EXIT_FLUSH_S="5")
    env.pop("INFERSIGHT_STATE_DIR", None)
    proc = subprocess.Popen([python, str(script), str(go)], env=env, cwd="/", stdout=subprocess.PIPE, text=True,
                            user=victim.pw_uid, group=gid, extra_groups=[gid])
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "warming"
        assert wait_for(lambda: agent.status()["producers"] >= 1, 20), "the victim connected"
        victim_id = _proc.producer_id(proc.pid)
        r = subprocess.run([python, "-c", ATTACKER_SCRIPT, str(agent.sock), str(spool), victim_id, str(proc.pid)],
                           capture_output=True, text=True, timeout=30, cwd="/",
                           user=attacker.pw_uid, group=gid, extra_groups=[gid])
        assert r.returncode == 0, r.stderr
        replies = json.loads(r.stdout)
        assert all('"refuse"' in x and "identity refused" in x for x in replies), replies
        # The forged spool file is replayed at the next scan (every 5 s): refused too.
        assert wait_for(lambda: agent.status()["counters"]["refused_identity"] >= 3, 30), agent.status()["counters"]
        go.touch()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()

    def victim_records() -> list[dict]:  # type: ignore[type-arg]
        return [r for r in log_records(read_otlp_lines(agent.out)) if r["body"].get("stringValue") == "victim-event"]

    assert wait_for(lambda: len(victim_records()) >= N_EVENTS, 30), len(victim_records())
    got = sorted(int(attr(r, "i")) for r in victim_records())
    assert got == list(range(N_EVENTS)), "every victim event arrives, once"
    lines = read_otlp_lines(agent.out)
    assert not [r for r in log_records(lines) if r["body"].get("stringValue") == "forged"], "no forged event"
    st = agent.status()
    assert st["counters"]["duplicates"] == 0 and st["lost"] == 0
    assert st["counters"]["refused_identity"] == 3
    assert wait_for(lambda: [s for s in spans(read_otlp_lines(agent.out)) if s["name"] == "coldstart"], 20)
    roots = [s for s in spans(read_otlp_lines(agent.out)) if s["name"] == "coldstart"]
    assert len(roots) == 1, roots
    root = roots[0]
    assert attr(root, "infersight.coldstart.ended_by") != "producer_lost", "the victim's own root"
    stage = next(s for s in spans(read_otlp_lines(agent.out)) if s["name"] == "coldstart.weights_load")
    assert int(root["endTimeUnixNano"]) >= int(stage["endTimeUnixNano"]), "the cold start covers its stage"


def test_the_attacker_cannot_delete_the_victims_spool_file(users, base: Path) -> None:  # type: ignore[no-untyped-def]
    """The sticky bit on the shared spool directory (3770): only a file's owner (or the
    directory's, or root) may remove it."""
    gid, victim, attacker = users
    python = system_python3()
    spool = shared_spool(base, gid)
    f = spool / "victim-1-2-0123456789abcdef.spool"
    f.write_bytes(b"x")
    os.chown(f, victim.pw_uid, gid)
    os.chmod(f, 0o600)
    code = ("import os, sys\ntry:\n    os.unlink(sys.argv[1])\n    print('deleted')\n"
            "except OSError as e:\n    print(e.errno)\n")
    r = subprocess.run([python, "-c", code, str(f)], capture_output=True, text=True, timeout=20, cwd="/",
                       user=attacker.pw_uid, group=gid, extra_groups=[gid])
    assert r.stdout.strip() == "1", r.stdout + r.stderr  # EPERM
    assert f.exists()


SPOOLING_VICTIM = """
import os, sys, time
from infersight import hooks
assert hooks.active()
for i in range(20):
    hooks.log("victim-event", i=i)
assert hooks.flush(10)
print("spooled", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
for i in range(20, 40):
    hooks.log("victim-event", i=i)
"""


def test_a_removed_spool_file_is_rescued_by_its_hook_and_counted(users, base: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """In a spool directory without the sticky bit (an older install's 2770), the attacker
    removes the victim's spool file while the agent is away. The victim's hook notices at its
    next write, rescues what the file held (still readable through its descriptor) into a new
    file and reports the removal: every event arrives and the agent counts it."""
    gid, victim, attacker = users
    python = system_python3()
    spool = base / "spool"
    spool.mkdir()
    os.chown(spool, 0, gid)
    os.chmod(spool, 0o2770)
    agent = agent_factory(root=base / "agent")
    agent.config.write_text(agent.config.read_text()
                            .replace('spool_dir = "%s"' % agent.spool, 'spool_dir = "%s"\nallowed_gids = [%d]'
                                     % (spool, gid)))
    go = base / "go"
    script = base / "victim.py"
    script.write_text(SPOOLING_VICTIM)
    env = hook_env(agent.sock, spool, INFERSIGHT_EXIT_FLUSH_S="0.5")  # no agent yet: the hook spools
    env.pop("INFERSIGHT_STATE_DIR", None)
    proc = subprocess.Popen([python, str(script), str(go)], env=env, cwd="/", stdout=subprocess.PIPE, text=True,
                            user=victim.pw_uid, group=gid, extra_groups=[gid])
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "spooled"
        code = ("import os, sys\nd = sys.argv[1]\nnames = [n for n in os.listdir(d) if n.endswith('.spool')]\n"
                "for n in names:\n    os.unlink(os.path.join(d, n))\nprint(len(names))\n")
        r = subprocess.run([python, "-c", code, str(spool)], capture_output=True, text=True, timeout=20, cwd="/",
                           user=attacker.pw_uid, group=gid, extra_groups=[gid])
        assert r.stdout.strip() == "1", r.stdout + r.stderr  # 2770: a member may remove another's file
        go.touch()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    agent.start()

    def victim_events() -> list[int]:
        return sorted(int(attr(r, "i")) for r in log_records(read_otlp_lines(agent.out))
                      if r["body"].get("stringValue") == "victim-event")

    assert wait_for(lambda: len(victim_events()) >= 40, 30), victim_events()
    assert victim_events() == list(range(40)), "nothing the removed file held is lost"
    assert wait_for(lambda: agent.status()["counters"]["spool_files_vanished"] == 1, 20), agent.status()["counters"]


FLOOD_SCRIPT = r"""
import socket, sys, time
sock_path, n = sys.argv[1], int(sys.argv[2])
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock_path)
    held.append(s)
print("holding", flush=True)
time.sleep(60)
"""


def test_one_uid_cannot_take_every_connection(users, base: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """A member who opens connections and sends nothing holds at most a quarter of them: the
    victim's hooks still get in, and the agent counts what it turned away by uid."""
    gid, victim, attacker = users
    python = system_python3()
    agent = agent_factory(root=base / "agent")
    agent.config.write_text(agent.config.read_text().replace(
        "[agent]\n", "[agent]\nmax_connections = 8\nallowed_gids = [%d]\n" % gid, 1))
    os.chmod(base / "agent", 0o755)
    agent.start()
    os.chown(agent.sock, 0, gid)
    script = base / "flood.py"
    script.write_text(FLOOD_SCRIPT)
    flood = subprocess.Popen([python, str(script), str(agent.sock), "12"], stdout=subprocess.PIPE, text=True,
                             user=attacker.pw_uid, group=gid, extra_groups=[gid])
    try:
        assert flood.stdout is not None and flood.stdout.readline().strip() == "holding"
        assert wait_for(lambda: agent.status()["counters"]["over_uid_budget"] >= 1, 30)
        hello = ("import json, socket, struct, sys, os\n"
                 "s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1])\n"
                 "b = json.dumps({'t': 'hello', 'schema': 1, 'producer': {'id': 'v-%d' % os.getpid(),"
                 " 'pid': os.getpid(), 'start_ns': 1, 'trace_id': 'a' * 32, 'root_span_id': 'b' * 16}}).encode()\n"
                 "s.sendall(struct.pack('!I', len(b)) + b)\n"
                 "print(s.recv(4096)[4:].decode())\n")
        r = subprocess.run([python, "-c", hello, str(agent.sock)], capture_output=True, text=True, timeout=30,
                           user=victim.pw_uid, group=gid, extra_groups=[gid])
        assert '"welcome"' in r.stdout, (r.stdout, r.stderr)
    finally:
        flood.kill()
        flood.wait()


STREAM_SCRIPT = r"""
import json, os, socket, struct, sys, time
sock_path, conns, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
WIDE = {"body": "x", "a": {"k%d" % j: "v" * 6 for j in range(100)}}

def batch(seq):
    if kind == "wide":  # the costliest batches the wire allows to decode and assemble: 1 MiB frames
        return [[seq + i, 5, "log", WIDE] for i in range(600)]
    # 512 log records, each its own MQTT message
    return [[seq + i, time.time_ns(), "log", {"body": "flood", "name": "oom", "sev": "ERROR"}] for i in range(512)]

def frame(obj):
    b = json.dumps(obj).encode()
    return struct.pack("!I", len(b)) + b

for c in range(conns):
    if os.fork() == 0:
        s = socket.socket(socket.AF_UNIX); s.connect(sock_path)
        s.sendall(frame({"t": "hello", "schema": 1, "producer": {"id": "flood-%d" % os.getpid(),
                         "pid": os.getpid(), "start_ns": 1, "trace_id": "c" * 32, "root_span_id": "d" * 16}}))
        seq = 1
        try:
            while True:
                events = batch(seq)
                seq += len(events)
                s.sendall(frame({"t": "b", "e": events}))
                s.setblocking(False)
                try:
                    while s.recv(65536):  # the acks
                        pass
                except BlockingIOError:
                    pass
                s.setblocking(True)
        except OSError:
            os._exit(0)
print("sending", flush=True)
time.sleep(120)
"""


def group_agent(agent_factory, base: Path, gid: int, extra_toml: str = ""):  # type: ignore[no-untyped-def]
    """A root agent whose socket is the group's (0660 root:gid), as the packaged units make it."""
    agent = agent_factory(extra_toml, root=base / "agent")
    agent.config.write_text(agent.config.read_text().replace("[agent]\n", "[agent]\nallowed_gids = [%d]\n" % gid, 1))
    os.chmod(base / "agent", 0o755)
    agent.start()
    os.chown(agent.sock, 0, gid)
    return agent


def start_flood(python: str, base: Path, agent, attacker: pwd.struct_passwd, gid: int,  # type: ignore[no-untyped-def]
                kind: str) -> subprocess.Popen[str]:
    """Four connections of the attacker streaming ``kind`` batches (STREAM_SCRIPT) until killed."""
    script = base / ("stream_%s.py" % kind)
    script.write_text(STREAM_SCRIPT)
    flood = subprocess.Popen([python, str(script), str(agent.sock), "4", kind], stdout=subprocess.PIPE, text=True,
                             user=attacker.pw_uid, group=gid, extra_groups=[gid], start_new_session=True)
    assert flood.stdout is not None and flood.stdout.readline().strip() == "sending"
    return flood


def run_victim(python: str, base: Path, agent, victim: pwd.struct_passwd, gid: int) -> None:  # type: ignore[no-untyped-def]
    """The victim's hooked process logs N_EVENTS at once and exits (its hooks flush at exit)."""
    go = base / "go"
    go.touch()
    script = base / "victim.py"
    script.write_text(VICTIM_SCRIPT)
    env = hook_env(agent.sock, base / "spool", OTEL_SERVICE_NAME="victim-svc", INFERSIGHT_EXIT_FLUSH_S="30")
    env.pop("INFERSIGHT_STATE_DIR", None)
    r = subprocess.run([python, str(script), str(go)], env=env, cwd="/", capture_output=True, text=True, timeout=90,
                       user=victim.pw_uid, group=gid, extra_groups=[gid])
    assert r.returncode == 0, r.stderr


def victim_events(agent) -> list[int]:  # type: ignore[no-untyped-def]
    """The victim's events in the agent's output (read_otlp_lines' complete lines, rotations included),
    parsing only the lines that name them: the wide flood leaves ~100 MB of records there, and a full
    parse took ~5 s a read. A record with that body has the name verbatim in its line (JSON escapes
    no character of it)."""
    lines = []
    for p in sorted(agent.out.parent.glob(agent.out.name + "*")):
        with open(p, "rb") as f:
            lines += [json.loads(line) for line in f if line.endswith(b"\n") and b"victim-event" in line]
    return sorted(int(attr(r, "i")) for r in log_records(lines) if r["body"].get("stringValue") == "victim-event")




def test_a_uid_streaming_costly_frames_gets_its_share_of_the_loop_while_another_sends(  # type: ignore[no-untyped-def]
        users, base: Path, agent_factory) -> None:
    """The attacker's producers stream the costliest frames the wire allows on four connections. Alone,
    it is never paced (no one waits for it). Once the victim's hooks send too, the attacker's frames wait
    for its share of the event loop (loop_share.py; `bench/loop_share.py` has the latencies), and every
    event of the victim arrives."""
    gid, victim, attacker = users
    python = system_python3()
    agent = group_agent(agent_factory, base, gid)
    flood = start_flood(python, base, agent, attacker, gid, "wide")
    try:
        assert wait_for(lambda: agent.status()["counters"]["events_in"] >= 10_000, 60)
        assert agent.status()["counters"]["frames_paced"] == 0, "a lone uid is not paced"
        run_victim(python, base, agent, victim, gid)
        assert wait_for(lambda: agent.status()["counters"]["frames_paced"] >= 1, 30), agent.status()["counters"]
    finally:
        os.killpg(flood.pid, 9)
        flood.wait()
    assert wait_for(lambda: len(victim_events(agent)) >= N_EVENTS, 30), len(victim_events(agent))
    assert victim_events(agent) == list(range(N_EVENTS))
    assert agent.status()["healthy"] is True


@pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto not installed")
def test_a_uid_flooding_a_slow_sink_holds_only_its_own_producers(  # type: ignore[no-untyped-def]
        users, base: Path, agent_factory) -> None:
    """The attacker floods log records toward MQTT (one message each), faster than the broker takes
    them. Its batches once filled the exporter's one queue, and every producer was held until it
    drained (the victim's acks took 6-8 s). Now the attacker waits once its batches fill a quarter of
    the queue (`frames_waited_queue_share`), the queue never fills for everyone, and the victim's
    batches wait in their own lane: every event of the victim's hooks reaches the broker and the file."""
    gid, victim, attacker = users
    python = system_python3()
    with running_broker(base / "mosquitto") as broker:
        agent = group_agent(agent_factory, base, gid, f'[exporters.mqtt]\nurl = "{broker.url}"\n')
        flood = start_flood(python, base, agent, attacker, gid, "records")
        try:
            assert wait_for(lambda: agent.status()["counters"]["frames_waited_queue_share"] >= 1, 60), \
                agent.status()["counters"]
            run_victim(python, base, agent, victim, gid)
            # While the flood goes on: the victim is not held behind it.
            assert wait_for(lambda: len(victim_events(agent)) >= N_EVENTS, 60), len(victim_events(agent))
            assert flood.poll() is None, "the flood was still running"
            st = agent.status()
            assert not any(w["pushbacks"] for w in st["exporters"]), "no queue filled for everyone"
        finally:
            os.killpg(flood.pid, 9)
            flood.wait()
    assert victim_events(agent) == list(range(N_EVENTS))
