"""No agent and a spool that cannot take the events: the served process must neither spin nor
hang at exit, and every lost event is counted once (the count reaches the agent when it is back).

Faults are real: a read-only tmpfs, a full tmpfs (the spool file opens, its first write fails),
a tmpfs that fills mid-frame, and a root-owned directory the process (run as ``nobody``) cannot
write. Mounting needs root (and a kernel that lets us); without it those cases skip, saying so.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BOOTSTRAP, attr, hook_env, log_records, read_otlp_lines, wait_for
from small_fs import tmpfs

EMIT = (
    "import os, time\nfrom infersight import hooks\nfrom infersight.hooks import _runtime\n"
    "assert hooks.active()\nc = _runtime.state().client\n"
    "for i in range(100):\n    hooks.log('e', i=i)\n"
    "time.sleep(1.0)\n"  # the drain thread has met the fault; a spin would show from here on
    "for i in range(100, 150):\n    hooks.log('e', i=i)\n"
    "hooks.flush(2)\ntime.sleep(1.0)\n"
    "emitted = int(repr(c._seq)[6:-1]) - 1\n"  # events numbered so far (startup's included)
    "print('emitted', emitted, 'dropped', c.dropped_buffer + c.dropped_spool,\n"
    "      'alive', c._thread.is_alive(), flush=True)\n"
)


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    with contextlib.ExitStack() as mounted:

        def mount(name: str, options: str) -> Path:
            return mounted.enter_context(tmpfs(tmp_path / name, options))

        yield mount


def fill(directory: Path) -> None:
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


class Run:
    def __init__(self, rc: int, out: str, err: str, cpu_s: float, wall_s: float) -> None:
        self.rc, self.out, self.err, self.cpu_s, self.wall_s = rc, out, err, cpu_s, wall_s


def run_measured(cmd: list[str], env: dict[str, str], tmp: Path, limit_s: float = 90,
                 **kw: object) -> Run:
    """Run to exit; a process still there after ``limit_s`` is hung (a failure, not a speed
    figure). Its own CPU time comes from wait4's resource usage."""
    out, err = tmp / "stdout", tmp / "stderr"
    start = time.monotonic()
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen(cmd, env=env, stdout=o, stderr=e, **kw)  # type: ignore[call-overload]
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() - start > limit_s:
            p.kill()
            os.wait4(p.pid, 0)
            raise AssertionError("the served process hung at exit: %s" % err.read_text()[-2000:])
        time.sleep(0.05)
    p.returncode = os.waitstatus_to_exitcode(status)
    return Run(p.returncode, out.read_text(), err.read_text(), usage.ru_utime + usage.ru_stime,
               time.monotonic() - start)


def check_bounded_and_counted(r: Run) -> None:
    assert r.rc == 0, r.err
    m = re.search(r"emitted (\d+) dropped (\d+) alive (\w+)", r.out)
    assert m, r.out + r.err
    emitted, dropped = int(m.group(1)), int(m.group(2))
    assert emitted >= 150
    assert dropped == emitted, "every event lost is counted, once (%d of %d)" % (dropped, emitted)
    assert m.group(3) == "True", "the drain thread died: later events would vanish uncounted"
    assert r.cpu_s < 0.5 * r.wall_s, "spinning: %.2f s CPU in %.2f s" % (r.cpu_s, r.wall_s)
    assert r.err.count("cannot spool events") == 1, r.err  # said once
    lost = re.search(r"(\d+) event\(s\) lost", r.err)
    assert lost, r.err
    # At exit the count names everything lost: these, and what exit itself emitted (the
    # cold-start root span ends at exit).
    assert emitted < int(lost.group(1)) <= emitted + 3, r.err


def absent_socket(tmp: Path) -> Path:
    return tmp / "no-agent-here" / "agent.sock"


def test_read_only_spool_dir(tmp_path: Path, mount_tmpfs) -> None:  # type: ignore[no-untyped-def]
    ro = mount_tmpfs("ro", "ro,size=64k")
    env = hook_env(absent_socket(tmp_path), ro / "spool", INFERSIGHT_EXIT_FLUSH_S="2")
    r = run_measured([sys.executable, "-c", EMIT], env, tmp_path)
    check_bounded_and_counted(r)
    assert "Read-only file system" in r.err


def test_full_spool_disk_hello_write_fails(tmp_path: Path, mount_tmpfs) -> None:  # type: ignore[no-untyped-def]
    """The spool file can be created but not written: no partial file is left behind."""
    full = mount_tmpfs("full", "size=64k")
    fill(full)
    env = hook_env(absent_socket(tmp_path), full, INFERSIGHT_EXIT_FLUSH_S="2")
    r = run_measured([sys.executable, "-c", EMIT], env, tmp_path)
    check_bounded_and_counted(r)
    assert "No space left on device" in r.err
    assert not list(full.glob("*.spool"))


def test_unwritable_spool_dir_as_another_user(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run the served process as nobody")
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
    if python is None:
        pytest.skip("no system python3 for the unprivileged process")
    nobody = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="infersight-unwritable-"))
    try:
        os.chmod(base, 0o755)
        spool = base / "root-owned"
        spool.mkdir(mode=0o755)
        env = hook_env(absent_socket(base), spool, INFERSIGHT_EXIT_FLUSH_S="2", HOME=str(base))
        as_nobody = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": [], "cwd": "/"}
        probe = subprocess.run([python, "-c", "from infersight import hooks; print(hooks.active())"],
                               env=env, capture_output=True, text=True, timeout=60, **as_nobody)  # type: ignore[call-overload]
        if probe.stdout.strip() != "True":
            pytest.skip("nobody cannot load the hooks from this checkout (%s)" % BOOTSTRAP)
        r = run_measured([python, "-c", EMIT], env, tmp_path, **as_nobody)
        check_bounded_and_counted(r)
        assert "Permission denied" in r.err
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_spool_fills_mid_frame_then_the_agent_gets_every_event_or_its_count(  # type: ignore[no-untyped-def]
        tmp_path: Path, mount_tmpfs, agent_factory) -> None:
    """The spool disk fills partway through a frame (a short write). What was spooled stays
    readable, the rest is counted; when the agent comes back the live process replays the spool
    and reports the count: delivered + counted is exactly what was emitted."""
    small = mount_tmpfs("small", "size=64k")
    agent = agent_factory()
    go, done = tmp_path / "go", tmp_path / "done"
    script = tmp_path / "emit.py"
    script.write_text(
        "import os, time\nfrom infersight import hooks\nfrom infersight.hooks import _runtime\n"
        "c = _runtime.state().client\n"
        "hooks.mark_ready()\n"  # its cold start is over: no sampler checkpoints (cs_tick) join the count
        "for b in range(30):\n"
        "    for i in range(10):\n        hooks.log('e', i=b * 10 + i, pad='x' * 1000)\n"
        "    time.sleep(0.03)\n"
        "hooks.flush(5)\n"
        "print('emitted', int(repr(c._seq)[6:-1]) - 1, 'dropped', c.dropped_spool, flush=True)\n"
        "while not os.path.exists(%r):\n    time.sleep(0.02)\n"
        "deadline = time.time() + 60\n"
        "while (c.conn.sock is None or c.spool.fd is not None or c.conn.outbox or c._buf) and time.time() < deadline:\n"
        "    time.sleep(0.02)\n"
        "print('delivered', flush=True)\n"
        "while not os.path.exists(%r):\n    time.sleep(0.02)\n" % (str(go), str(done))
    )
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=hook_env(agent.sock, small))
    assert child.stdout is not None
    m = re.match(r"emitted (\d+) dropped (\d+)", child.stdout.readline())
    assert m
    emitted, dropped = int(m.group(1)), int(m.group(2))
    assert 0 < dropped < 300, "the fault must drop some events and spool others"
    agent.start()
    go.write_text("")
    assert child.stdout.readline().strip() == "delivered"
    assert wait_for(lambda: agent.status()["dropped_by_producers"] == dropped, 20), agent.status()
    st = agent.status()
    done.write_text("")
    _out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert st["lost"] == dropped, "the gaps in the sequence are exactly the counted events"
    assert st["counters"]["malformed_frames"] == 0, "a short write left a broken frame in the spool"
    assert err.count("cannot spool events") == 1, err
    assert agent.stop() == 0
    got = [int(attr(r, "i")) for r in log_records(read_otlp_lines(agent.out)) if attr(r, "i") is not None]
    assert len(set(got)) == 300 - dropped, (len(set(got)), dropped, emitted)
