"""No silent loss: every event reaches the file, or is counted."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import attr, hook_env, log_records, read_otlp_lines, wait_for

N = 100_000
EMIT = (
    "import sys\n"
    "from infersight import hooks\n"
    "assert hooks.active()\n"
    "for i in range({n}):\n"
    "    hooks.log('e', i=i)\n"
    "{tail}"
)


def indices(lines: list[dict]) -> list[int]:  # type: ignore[type-arg]
    return [int(attr(r, "i")) for r in log_records(lines) if attr(r, "i") is not None]


def test_100k_events_through_launch_all_arrive(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    script = tmp_path / "emit.py"
    script.write_text(EMIT.format(n=N, tail=""))
    r = subprocess.run([sys.executable, "-m", "infersight", "launch", "--no-console", "--otlp-file", str(out),
                        "--", sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    got = indices(read_otlp_lines(out))
    assert len(got) == N, r.stderr
    assert sorted(got) == list(range(N)), "every event exactly once"
    assert "lost" not in r.stderr and "dropped" not in r.stderr


def test_agent_sigkilled_mid_stream_every_event_accounted(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL the daemon mid-stream, restart it: each event is delivered or counted as lost."""
    agent = agent_factory().start()
    n = 60_000
    script = tmp_path / "emit.py"
    script.write_text(
        "import time\nfrom infersight import hooks\n"
        "for i in range(%d):\n    hooks.log('e', i=i)\n    if i %% 1000 == 0: time.sleep(0.02)\n"
        "hooks.flush(30)\n" % n
    )
    child = subprocess.Popen([sys.executable, str(script)], env=hook_env(agent.sock, agent.spool,
                                                                          INFERSIGHT_EXIT_FLUSH_S="30"))
    assert wait_for(lambda: agent.out.exists() and agent.out.stat().st_size > 200_000, 60)
    agent.kill()
    killed_at = agent.out.stat().st_size
    time.sleep(1.0)  # the producer notices, spools, retries
    agent.start()
    assert child.wait(120) == 0
    assert wait_for(lambda: agent.status()["events_in"] > 0 and agent.status()["producers"] >= 1, 30)
    time.sleep(1.0)
    lost = agent.status()["lost"]
    assert agent.stop() == 0
    got = indices(read_otlp_lines(agent.out))
    unique = set(got)
    assert killed_at > 0
    assert unique | set(range(n)) == set(range(n))
    missing = n - len(unique)
    # Everything is delivered (duplicates allowed: at-least-once) or counted as lost.
    assert missing <= lost, "missing %d, counted lost %d" % (missing, lost)
    assert missing == 0, "acked resend should leave nothing missing (lost counter %d)" % lost


def test_producer_spools_while_agent_is_down_and_agent_replays(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """No agent at all while the process runs: its spool is replayed when the agent starts."""
    agent = agent_factory()
    script = tmp_path / "emit.py"
    script.write_text(EMIT.format(n=5000, tail=""))
    env = hook_env(agent.sock, agent.spool, INFERSIGHT_EXIT_FLUSH_S="0.5")
    assert subprocess.run([sys.executable, str(script)], env=env, timeout=60).returncode == 0
    spooled = list(agent.spool.glob("*.spool"))
    assert len(spooled) == 1 and spooled[0].stat().st_mode & 0o777 == 0o600
    agent.start()
    assert wait_for(lambda: not list(agent.spool.glob("*.spool")), 20)
    assert agent.stop() == 0
    got = indices(read_otlp_lines(agent.out))
    assert sorted(got) == list(range(5000))


def test_an_agent_that_never_answers_loses_nothing_at_exit(tmp_path: Path,
                                                          agent_factory) -> None:  # type: ignore[no-untyped-def]
    """A socket that takes connections in the kernel and never answers (a hung agent): the exit flush waits its
    budget (0.2 s), cuts the drain thread's wait on the agent short and spools the rest; every event is replayed
    once a real agent starts. (How long the exit takes: ``bench/exit_hung_agent.py``; the cut wait itself:
    tests/unit/test_connection_failures.py.)"""
    agent = agent_factory()
    agent.sock.parent.mkdir(parents=True, exist_ok=True)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(agent.sock))
    silent.listen(64)  # accepts into its backlog, never reads, never answers
    script = tmp_path / "emit.py"
    script.write_text(EMIT.format(n=5000, tail=""))
    env = hook_env(agent.sock, agent.spool, INFERSIGHT_EXIT_FLUSH_S="0.2")
    try:
        r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    finally:
        silent.close()
    assert r.returncode == 0, r.stderr
    assert "lost" not in r.stderr, r.stderr
    os.unlink(agent.sock)
    agent.start()
    assert wait_for(lambda: not list(agent.spool.glob("*.spool")), 20)
    assert agent.stop() == 0
    assert sorted(indices(read_otlp_lines(agent.out))) == list(range(5000))


def test_full_buffer_drops_are_counted(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """A producer with a tiny spool and no agent drops events, and says how many."""
    agent = agent_factory()
    script = tmp_path / "emit.py"
    script.write_text(EMIT.format(n=20000, tail=""))
    env = hook_env(agent.sock, agent.spool, INFERSIGHT_EXIT_FLUSH_S="0.5", INFERSIGHT_SPOOL_MAX_BYTES="100000")
    assert subprocess.run([sys.executable, str(script)], env=env, timeout=60).returncode == 0
    agent.start()
    assert wait_for(lambda: not list(agent.spool.glob("*.spool")), 20)
    time.sleep(0.5)
    st = agent.status()
    assert agent.stop() == 0
    got = set(indices(read_otlp_lines(agent.out)))
    assert 0 < len(got) < 20000
    missing = 20000 - len(got)
    assert st["lost"] + st["dropped_by_producers"] >= missing
    assert st["lost"] >= missing, "gaps in the sequence numbers count every dropped event"
    assert os.path.exists(agent.out)


def test_live_producer_replays_a_large_spool_within_its_memory_bound(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """The agent is away while a live process spools more than the in-memory outbox may hold;
    when the agent appears, the process replays it all, in order, without loading it all."""
    agent = agent_factory()
    go = tmp_path / "agent-is-up"
    script = tmp_path / "emit.py"
    script.write_text(
        "import os, sys, time\n"
        "from infersight import hooks\nfrom infersight.hooks import _connection, _runtime\n"
        "_connection.MAX_OUTBOX_BYTES = 64 * 1024\n"
        "c = _runtime.state().client\npeak = [0]\norig = c.conn.send\n"
        "def send(*a):\n    orig(*a)\n    peak[0] = max(peak[0], c.conn.outbox_bytes)\n"
        "c.conn.send = send\n"
        "for i in range(20000):\n    hooks.log('e', i=i)\n"
        "hooks.flush(10)\n"
        "assert c.spool.size > 4 * _connection.MAX_OUTBOX_BYTES, c.spool.size\n"
        "print('spooled', flush=True)\n"
        "while not os.path.exists(%r):\n    time.sleep(0.02)\n"
        "deadline = time.time() + 60\n"
        "while (c.spool.pending() or c.conn.sock is None) and time.time() < deadline:\n"
        "    time.sleep(0.05)\n"
        # the replay is sent; an idle process reads its acks only when asked (a flush) or at exit
        "print('flushed', hooks.flush(10), flush=True)\n"
        "print('peak', peak[0], flush=True)\n" % str(go)
    )
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env=hook_env(agent.sock, agent.spool))
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "spooled"
    agent.start()
    go.write_text("")
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0
    assert "flushed True" in out, out
    peak = int(out.split()[-1])
    assert peak <= 64 * 1024 + (1 << 20), "replay stays within the outbox bound (plus one read)"
    assert agent.stop() == 0
    assert sorted(indices(read_otlp_lines(agent.out))) == list(range(20000))
