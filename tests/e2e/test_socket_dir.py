"""A squatted socket directory: another local user made the per-user fallback first.

The fallback locations are ``$XDG_RUNTIME_DIR/infersight`` and ``/tmp/infersight-<uid>``; the
tests point ``XDG_RUNTIME_DIR`` at a scratch directory (rather than squat the real /tmp). The
squat is real: a 0777 directory owned by ``nobody``, with ``nobody`` listening on the socket
path. The agent refuses to start there; a producer treats the socket as absent and spools, and
the squatter receives nothing. The same holds when only the peer's uid gives it away.
"""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import hook_env, wait_for

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
def base(open_dir: Path) -> Path:
    """Our XDG_RUNTIME_DIR, open to every user like /tmp."""
    return open_dir


def squat(base: Path) -> Path:
    nobody = pwd.getpwnam("nobody")
    d = base / "infersight"
    d.mkdir()
    os.chown(d, nobody.pw_uid, nobody.pw_gid)
    os.chmod(d, 0o777)
    return d


def agent_config(tmp: Path, sock: Path) -> Path:
    conf = tmp / "infersight.toml"
    conf.write_text('[agent]\nsocket = "%s"\nspool_dir = "%s"\n[exporters.file]\npath = "%s"\n'
                    % (sock, tmp / "spool", tmp / "out.jsonl"))
    return conf


def run_agent(conf: Path, xdg: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, XDG_RUNTIME_DIR=str(xdg))
    try:
        return subprocess.run([sys.executable, "-m", "infersight", "agent", "--config", str(conf)],
                              capture_output=True, text=True, timeout=30, env=env)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("the agent started in a squatted directory: %s" % exc.stderr) from exc


def test_agent_refuses_a_squatted_socket_dir(base: Path, tmp_path: Path) -> None:
    d = squat(base)
    r = run_agent(agent_config(tmp_path, d / "agent.sock"), base)
    assert r.returncode == 2, r.stderr
    assert str(d) in r.stderr and "uid 65534" in r.stderr and "0777" in r.stderr, r.stderr
    assert "Remove it" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (d / "agent.sock").exists()


def test_agent_refuses_a_symlinked_socket_dir(base: Path, tmp_path: Path) -> None:
    real = base / "elsewhere"
    real.mkdir(mode=0o700)
    link = base / "infersight"
    link.symlink_to(real)
    os.lchown(link, pwd.getpwnam("nobody").pw_uid, -1)
    r = run_agent(agent_config(tmp_path, link / "agent.sock"), base)
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
                       env=hook_env(sock, spool, INFERSIGHT_EXIT_FLUSH_S="0.5", XDG_RUNTIME_DIR=str(base)))
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
    d = base / "infersight"
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
                       env=hook_env(path, tmp_path / "spool", INFERSIGHT_EXIT_FLUSH_S="0.5",
                                    XDG_RUNTIME_DIR=str(base)))
    out, _ = listener.communicate(timeout=30)
    assert r.returncode == 0, r.stderr
    assert out.split()[-1] == "0", "the producer sent %s bytes to another user's listener" % out.split()[-1]
    assert "runs as uid 65534" in r.stderr, r.stderr


def test_which_paths_are_checked_and_the_rule(base: Path) -> None:
    """Only the per-user fallbacks are checked; /run/infersight (root's to make) and other
    configured paths (a pod's emptyDir is root-owned 0777) are used as given."""
    env = {"XDG_RUNTIME_DIR": str(base)}
    assert _paths.fallback_owner(str(base / "infersight" / "agent.sock"), env) == os.geteuid()
    assert _paths.fallback_owner("/tmp/infersight-1000/agent.sock", env) == 1000
    assert _paths.fallback_owner("/run/infersight/agent.sock", env) is None
    assert _paths.fallback_owner(str(base / "elsewhere" / "agent.sock"), env) is None
    own = base / "own"
    own.mkdir(mode=0o750)
    _paths.check_socket_dir(str(own), os.getuid())
    group_w = base / "groupw"
    group_w.mkdir()
    os.chmod(group_w, 0o770)
    with pytest.raises(_paths.UnsafeSocketDirError):
        _paths.check_socket_dir(str(group_w), os.getuid())
    theirs = base / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(_paths.UnsafeSocketDirError):
        _paths.check_socket_dir(str(theirs), 12345)


def test_agent_starts_in_a_configured_directory_outside_the_fallbacks(base: Path, tmp_path: Path) -> None:
    """A pod's shared emptyDir is root-owned 0777: a path the operator configured there works."""
    shared = base / "emptydir"
    shared.mkdir()
    os.chmod(shared, 0o777)
    p = subprocess.Popen([sys.executable, "-m", "infersight", "agent", "--config",
                          str(agent_config(tmp_path, shared / "agent.sock"))],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, XDG_RUNTIME_DIR=str(base)))
    try:
        assert wait_for(lambda: (shared / "agent.sock").exists() or p.poll() is not None, 30)
        assert p.poll() is None, p.communicate()[1]
    finally:
        p.terminate()
        p.wait(30)


async def test_a_socket_directory_the_agent_may_not_write_is_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod's model server renamed the agent's socket directory away and made its own: the restarted sidecar's
    bind failed with EACCES and the agent died on a traceback (a crash loop, review finding). It now refuses
    with the directory's owner and mode, as for a squatted one. (The EACCES is injected: root binds anywhere.)"""
    import asyncio

    from infersight.agent.daemon import ingest_server

    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    os.chown(d, 1000, 1000)

    async def refused(*_a: object, **_k: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(asyncio, "start_unix_server", refused)
    listener = ingest_server.Listener(lambda r, w: asyncio.sleep(0), None, None, lambda: 0)  # type: ignore[arg-type]
    with pytest.raises(ingest_server.UnsafeSocketDirError) as err:
        await listener.start(str(d / "agent.sock"), 0o660)
    assert str(d) in str(err.value) and "uid 1000, mode 0700" in str(err.value), err.value
