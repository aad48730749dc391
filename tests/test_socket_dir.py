"""A squatted socket directory: another local user made ``/tmp/infersight-<uid>`` first.

The squat is real: a 0777 directory owned by ``nobody``, with ``nobody`` listening on the socket
path. The agent refuses to start there; a producer treats the socket as absent and spools, and
the squatter receives nothing. The same holds when only the peer's uid gives it away.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import hook_env

from infersight.hooks import _paths

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")

# The squatter's listener: accept for a while, report every byte any producer sent.
LISTEN = (
    "import select, socket, sys\n"
    "arg = sys.argv[1]\n"
    "if arg.startswith('fd='):\n"
    "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=int(arg[3:]))\n"
    "else:\n"
    "    s = socket.socket(socket.AF_UNIX)\n    s.bind(arg)\n"
    "s.listen(8)\n"
    "print('listening', flush=True)\n"
    "got = conns = 0\n"
    "while True:\n"  # until the test closes our stdin
    "    ready = select.select([s, sys.stdin], [], [], 60)[0]\n"
    "    if not ready or sys.stdin in ready:\n        break\n"
    "    c, _ = s.accept()\n    conns += 1\n    c.settimeout(1.0)\n"
    "    try:\n        got += len(c.recv(65536))\n    except OSError:\n        pass\n"
    "print('conns', conns, 'bytes', got, flush=True)\n"
)


def system_python() -> str:
    """The venv's interpreter may live where ``nobody`` cannot read: use a system one."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    pytest.skip("no system python3 to run the other user's process")


@pytest.fixture
def base() -> Iterator[Path]:
    """Stands in for /tmp: a directory every user may traverse (pytest's tmp is root's only)."""
    b = Path(tempfile.mkdtemp(prefix="infersight-sockdir-"))
    os.chmod(b, 0o755)
    yield b
    shutil.rmtree(b, ignore_errors=True)


def squat(base: Path) -> Path:
    nobody = pwd.getpwnam("nobody")
    d = base / ("infersight-%d" % os.getuid())
    d.mkdir()
    os.chown(d, nobody.pw_uid, nobody.pw_gid)
    os.chmod(d, 0o777)
    return d


def agent_config(tmp: Path, sock: Path) -> Path:
    conf = tmp / "infersight.toml"
    conf.write_text('[agent]\nsocket = "%s"\nspool_dir = "%s"\n[exporters.file]\npath = "%s"\n'
                    % (sock, tmp / "spool", tmp / "out.jsonl"))
    return conf


def run_agent(conf: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, "-m", "infersight", "agent", "--config", str(conf)],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("the agent started in a squatted directory: %s" % exc.stderr) from exc


def test_agent_refuses_a_squatted_socket_dir(base: Path, tmp_path: Path) -> None:
    d = squat(base)
    r = run_agent(agent_config(tmp_path, d / "agent.sock"))
    assert r.returncode == 2, r.stderr
    assert str(d) in r.stderr and "uid 65534" in r.stderr and "0777" in r.stderr, r.stderr
    assert "Remove it" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (d / "agent.sock").exists()


def test_agent_refuses_a_symlinked_socket_dir(base: Path, tmp_path: Path) -> None:
    real = base / "elsewhere"
    real.mkdir(mode=0o700)
    link = base / ("infersight-%d" % os.getuid())
    link.symlink_to(real)
    os.lchown(link, pwd.getpwnam("nobody").pw_uid, -1)
    r = run_agent(agent_config(tmp_path, link / "agent.sock"))
    assert r.returncode == 2 and "symbolic link" in r.stderr, r.stderr
    assert not (real / "agent.sock").exists()


def test_producer_tells_a_squatter_nothing_and_spools(base: Path, tmp_path: Path) -> None:
    d = squat(base)
    sock = d / "agent.sock"
    nobody = pwd.getpwnam("nobody")
    listener = subprocess.Popen([system_python(), "-c", LISTEN, str(sock)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, user=nobody.pw_uid,
                                group=nobody.pw_gid, extra_groups=[], cwd="/")
    assert listener.stdout is not None and listener.stdin is not None
    assert listener.stdout.readline().strip() == "listening"
    spool = tmp_path / "spool"
    code = "from infersight import hooks\nfor i in range(20):\n    hooks.log('secret', i=i)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=hook_env(sock, spool, INFERSIGHT_EXIT_FLUSH_S="0.5"))
    out, _ = listener.communicate(timeout=30)
    assert r.returncode == 0, r.stderr
    assert out.split()[-4:] == ["conns", "0", "bytes", "0"], out
    assert "not connecting to the agent" in r.stderr and "uid 65534" in r.stderr, r.stderr
    assert r.stderr.count("not connecting") == 1, r.stderr
    [spooled] = list(spool.glob("*.spool"))
    assert b"secret" in spooled.read_bytes()  # kept for a real agent, not lost


def test_producer_checks_the_peer_uid_after_connecting(base: Path, tmp_path: Path) -> None:
    """The directory and socket file look right (root's), but the process listening on it is
    another user's: SO_PEERCRED shows it, and the producer sends nothing."""
    d = base / "run"
    d.mkdir(mode=0o755)
    path = d / "agent.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))  # root binds; nobody listens and accepts
    nobody = pwd.getpwnam("nobody")
    listener = subprocess.Popen([system_python(), "-c", LISTEN, "fd=%d" % s.fileno()], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, user=nobody.pw_uid,
                                group=nobody.pw_gid, extra_groups=[], cwd="/", pass_fds=(s.fileno(),))
    s.close()
    assert listener.stdout is not None and listener.stdin is not None
    assert listener.stdout.readline().strip() == "listening"
    code = "from infersight import hooks\nfor i in range(20):\n    hooks.log('secret', i=i)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=hook_env(path, tmp_path / "spool", INFERSIGHT_EXIT_FLUSH_S="0.5"))
    out, _ = listener.communicate(timeout=30)
    assert r.returncode == 0, r.stderr
    assert out.split()[-1] == "0", "the producer sent %s bytes to another user's listener" % out.split()[-1]
    assert "runs as uid 65534" in r.stderr, r.stderr


def test_the_rule_accepts_what_the_agent_makes(base: Path) -> None:
    """Our own 0700/0750 directories pass; a root-made one in a root-only parent passes for any
    owner (/run/infersight belongs to the agent's user); group/world-writable ones do not."""
    own = base / "own"
    own.mkdir(mode=0o750)
    assert _paths.check_socket_dir(str(own), os.getuid()) == os.getuid()
    service = base / "service"
    service.mkdir(mode=0o750)
    os.chown(service, pwd.getpwnam("nobody").pw_uid, -1)
    assert _paths.check_socket_dir(str(service), 12345) == pwd.getpwnam("nobody").pw_uid
    group_w = base / "groupw"
    group_w.mkdir()
    os.chmod(group_w, 0o770)
    with pytest.raises(_paths.UnsafeSocketDirError):
        _paths.check_socket_dir(str(group_w), os.getuid())
