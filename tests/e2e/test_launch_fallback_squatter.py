"""``launch`` and ``status`` at a per-user fallback socket another local user could have made first.

With no ``/run/infersight`` the default socket is ``$XDG_RUNTIME_DIR/infersight/agent.sock`` or
``/tmp/infersight-<uid>/agent.sock``. Another user who makes that directory first and listens there
with a fake agent must get nothing of the victim's run (its argv, its stderr) and must not speak on
the victim's terminal (a forged "healthy", escape sequences): launch applies the hooks' rule (the
directory's owner and mode, the peer's uid from the kernel) before it sends a byte, and runs an
embedded agent instead. (A red-team review: launch sent CMD's argv with ``--api-key=...`` to the
squatter, printed its escapes raw and wrote no local file; ``status`` said "healthy", exit 0.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from short_tmp import short_tmpdir

# A fake agent: answers every frame with a forged "subscribed"/status reply full of escapes and
# records how many bytes it received. Run as a process of its own so that it can drop to another uid.
FAKE_AGENT = r"""
import json, os, socket, struct, sys
path, record, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
srv = socket.socket(socket.AF_UNIX)
srv.bind(path)
os.chmod(path, 0o777)
if uid >= 0:  # before listen(): SO_PEERCRED gives the listener's credentials at listen()
    os.setgid(uid); os.setuid(uid)
srv.listen(8)
open(record + ".ready", "w").close()
got = 0
while True:
    c, _ = srv.accept()
    c.settimeout(2)
    try:
        data = c.recv(65536)
    except OSError:
        data = b""
    got += len(data)
    with open(record, "w") as f:
        f.write(str(got))
    body = json.dumps({"t": "subscribed", "schema": 1, "pid": 1, "version": "\x1b[2J\x1b]0;owned\x07x",
                       "healthy": True, "sinks": ["otlp https://collector.example\x1b[31m"],
                       "warnings": ["\x1b[2Jforged"]}).encode()
    try:
        c.sendall(struct.pack(">I", len(body)) + body)
    except OSError:
        pass
    c.close()
"""


@contextmanager
def fake_agent(sock: Path, record: Path, uid: int = -1) -> Iterator[None]:
    p = subprocess.Popen([sys.executable, "-c", FAKE_AGENT, str(sock), str(record), str(uid)])
    try:
        deadline = time.monotonic() + 20
        while not Path(str(record) + ".ready").exists():
            assert p.poll() is None and time.monotonic() < deadline, "the fake agent did not start"
            time.sleep(0.02)
        yield
    finally:
        p.kill()
        p.wait()


def _env(run: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSIGHT")}
    env["XDG_RUNTIME_DIR"] = str(run)
    env["TMPDIR"] = str(run)  # launch's private directory: no other run's leftovers
    return env


def _received(record: Path) -> int:
    return int(record.read_text()) if record.exists() else 0


def _launch(tmp_path: Path, run: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infersight", "launch", "--", sys.executable, "-c", "print('served')",
                           "--api-key=SECRET123"], cwd=tmp_path, env=_env(run), capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = Path(short_tmpdir(str(tmp_path), "isq-"))  # a socket path must be short (removed after the test)
    os.chmod(d, 0o755)  # the fake agent may run as another uid
    return d


def _skip_if_system_socket() -> None:
    if os.path.isdir("/run/infersight"):
        pytest.skip("/run/infersight exists: the fallback is not the default socket here")


def test_launch_sends_nothing_to_an_agent_in_a_directory_anybody_could_have_made(tmp_path: Path, run_dir: Path) -> None:
    _skip_if_system_socket()
    (run_dir / "infersight").mkdir()
    os.chmod(run_dir / "infersight", 0o777)  # what another user's mkdir -m 777 leaves
    record = tmp_path / "received"
    with fake_agent(run_dir / "infersight" / "agent.sock", record):
        r = _launch(tmp_path, run_dir)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert _received(record) == 0, "launch sent the squatter %d byte(s)" % _received(record)
    assert "not trusting the process at" in out and "running an embedded agent" in out, out
    assert "\x1b" not in out, out
    assert list(tmp_path.glob("infersight-*.otlp.jsonl")), "no local file written: " + out


def test_launch_sends_nothing_to_another_uids_agent_in_a_sound_directory(tmp_path: Path, run_dir: Path) -> None:
    """A directory that passes the rule (root's, 0755) but an agent that runs as uid 65534: neither this user
    (root) nor the directory's owner."""
    _skip_if_system_socket()
    if os.geteuid() != 0:
        pytest.skip("needs root to run the fake agent as another uid")
    (run_dir / "infersight").mkdir(mode=0o755)
    (run_dir / "rec").mkdir(mode=0o777)
    os.chmod(run_dir / "rec", 0o777)  # the fake agent, as uid 65534, writes what it got here
    record = run_dir / "rec" / "received"
    with fake_agent(run_dir / "infersight" / "agent.sock", record, uid=65534):
        r = _launch(tmp_path, run_dir)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert _received(record) == 0, "launch sent another uid's agent %d byte(s): %s" % (_received(record), out)
    assert "runs as uid 65534, not as this user or root" in out, out
    assert "\x1b" not in out, out


def test_status_does_not_report_a_squatters_health(tmp_path: Path, run_dir: Path) -> None:
    _skip_if_system_socket()
    (run_dir / "infersight").mkdir()
    os.chmod(run_dir / "infersight", 0o777)
    record = tmp_path / "received"
    with fake_agent(run_dir / "infersight" / "agent.sock", record):
        r = subprocess.run([sys.executable, "-m", "infersight", "status"], env=_env(run_dir), capture_output=True,
                           text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "not trusting the process at" in out and "healthy" not in out.replace("UNHEALTHY", ""), out
    assert "\x1b" not in out, out
    assert _received(record) == 0


def test_an_agent_of_the_operators_choosing_is_joined_but_its_escapes_are_not_printed(tmp_path: Path,
                                                                                       run_dir: Path) -> None:
    """``--agent PATH`` is the user's choice, trusted as given; what it says still reaches the terminal plain."""
    record = tmp_path / "received"
    sock = run_dir / "agent.sock"
    with fake_agent(sock, record):
        r = subprocess.run([sys.executable, "-m", "infersight", "launch", "--agent", str(sock), "--agent-hold", "0",
                            "--", sys.executable, "-c", "print('served')"], cwd=tmp_path, env=_env(run_dir),
                           capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert _received(record) > 0, out  # joined: it got the subscription
    assert "collector.example" in out, out
    assert "\x1b" not in out, out
