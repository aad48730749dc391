"""A hooked process that daemonizes (``os.closerange(3, ...)``) closes the hooks' socket and spool
file; its next files get their numbers. The hooks must never write into, read from or close
those files: they know their descriptors by identity (device, inode), not by number.

Real agent, real hooked process: it logs, closes every descriptor from 3 up, opens files of its
own (which take the hooks' old numbers), writes to them, keeps logging, writes again, and reads
its files back. Its files must hold exactly what it wrote (no agent acks, no spool frames), none
of its writes may fail (EBADF: the hooks closed its file), and every event logged after the
closerange must reach the agent: at once when connected, or from the spool once the agent runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import hook_env, log_records, read_otlp_lines, wait_for

CHILD = """\
import json, os, sys, time
from infersight import hooks
from infersight.hooks import _runtime

mode, files_dir = sys.argv[1], sys.argv[2]
c = _runtime.state().client
for i in range(100):
    hooks.log("fdid%05d before" % i)
hooks.flush(5)
if mode == "agent":
    assert c.conn.sock is not None, "not connected"
else:
    assert c.spool.fd is not None, "no spool file"
os.closerange(3, 4096)  # daemonizing
files = [open(os.path.join(files_dir, "user-%d.txt" % k), "w+b", buffering=0) for k in range(4)]
errors = []
for f in files:
    try:
        f.write(b"USERDATA\\n")
    except OSError as exc:
        errors.append(repr(exc))
for i in range(100, 1100):
    hooks.log("fdid%05d after" % i)
hooks.flush(5)
time.sleep(0.5)
for f in files:
    try:
        f.write(b"MORE\\n")
    except OSError as exc:
        errors.append(repr(exc))
contents = []
for f in files:
    try:
        f.seek(0)
        contents.append(f.read().decode("latin-1"))
    except OSError as exc:  # ESPIPE: the number is the hooks' new socket
        errors.append(repr(exc))
lost = getattr(c.conn, "lost", 0) + getattr(c.spool, "lost_count", 0)
print("RESULT " + json.dumps({"errors": errors, "contents": contents, "lost": lost}), flush=True)
"""


def run_child(mode: str, sock: Path, spool: Path, files: Path) -> dict:  # type: ignore[type-arg]
    files.mkdir()
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(files)], env=hook_env(sock, spool),
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    result: dict = json.loads(line[len("RESULT "):])  # type: ignore[type-arg]
    return result


def check_files(result: dict) -> None:  # type: ignore[type-arg]
    assert result["errors"] == [], result["errors"]  # EBADF: the hooks closed the host's file
    for content in result["contents"]:
        assert content == "USERDATA\nMORE\n", content[:300]  # acks or spool frames in the host's file
    assert result["lost"] >= 1  # the hooks noticed (and counted) the descriptor taken from them


def after_events(out: Path) -> set[str]:
    bodies = {str(r.get("body", {}).get("stringValue", "")) for r in log_records(read_otlp_lines(out))}
    return {b for b in bodies if b.startswith("fdid") and b.endswith(" after")}


def test_closerange_connected(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    result = run_child("agent", agent.sock, agent.spool, tmp_path / "files")
    check_files(result)
    assert wait_for(lambda: len(after_events(agent.out)) == 1000, 30), len(after_events(agent.out))
    # the hooks told the agent (their drops report), which counts it and says it once
    assert wait_for(lambda: agent.status()["counters"]["producer_fds_lost"] >= 1, 20), agent.status()["counters"]
    assert "closed or took over the hooks' descriptors" in agent.log.read_text()


def test_closerange_spooling(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory()  # not started: the hooks spool
    agent.spool.mkdir(parents=True, exist_ok=True)
    result = run_child("spool", agent.sock, agent.spool, tmp_path / "files")
    check_files(result)
    agent.start()  # replays the ended process's spool
    assert wait_for(lambda: len(after_events(agent.out)) == 1000, 30), len(after_events(agent.out))
    # the drops report was spooled with the events: the replay tells the agent too
    assert wait_for(lambda: agent.status()["counters"]["producer_fds_lost"] >= 1, 20), agent.status()["counters"]


FORKER = """\
import os
from infersight import hooks
from infersight.hooks import _fds

_fds.lost = 3  # as if this process's host had taken three of the hooks' descriptors
hooks.log("parent")
hooks.flush(5)
pid = os.fork()
if pid == 0:  # a new producer: it reports its own count (none), not its parent's three again
    hooks.log("child")
    hooks.flush(5)
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_a_forked_child_does_not_report_its_parents_lost_descriptors(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    r = subprocess.run([sys.executable, "-c", FORKER], env=hook_env(agent.sock, agent.spool), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

    def bodies() -> set[str]:
        return {str(x.get("body", {}).get("stringValue", "")) for x in log_records(read_otlp_lines(agent.out))}

    assert wait_for(lambda: {"parent", "child"} <= bodies(), 30), bodies()
    assert wait_for(lambda: agent.status()["counters"]["producer_fds_lost"] >= 3, 20)
    assert agent.status()["counters"]["producer_fds_lost"] == 3
