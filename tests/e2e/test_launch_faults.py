"""``infersight launch`` under faults: an unwritable output, Ctrl-C on a real terminal, a
launcher killed with SIGKILL, a daemonized grandchild that outlives launch."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import launch_tmpdir, log_records, read_otlp_lines, wait_for
from small_fs import tmpfs

CLI = [sys.executable, "-m", "infersight"]


def launch_env(tmp: Path) -> dict[str, str]:
    """TMPDIR scoped to the test: leftover launch directories stay inside it (not in the /tmp that
    launch takes when a TMPDIR is too deep for its socket's path: shared by parallel tests)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    e["TMPDIR"] = launch_tmpdir(tmp / "t")
    e["INFERSIGHT_MEASURE_STORAGE"] = "0"
    return e


def bodies(path: Path) -> list[str]:
    return [r["body"]["stringValue"] for r in log_records(read_otlp_lines(path)) if "body" in r]


# -- an unwritable --otlp-file -------------------------------------------------------


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "ro", "ro,size=64k") as d:
        yield d


def test_unwritable_otlp_file_is_a_usage_error_before_cmd(tmp_path: Path, read_only_dir: Path) -> None:
    marker = tmp_path / "cmd-ran"
    r = subprocess.run([*CLI, "launch", "--otlp-file", str(read_only_dir / "out.jsonl"), "--",
                        sys.executable, "-c", "open(%r, 'w').write('x')" % str(marker)],
                       capture_output=True, text=True, timeout=60, env=launch_env(tmp_path))
    assert r.returncode == 2, r.stderr
    assert "cannot write the output file" in r.stderr and "Read-only file system" in r.stderr
    assert not marker.exists(), "CMD ran although launch could not write its output"
    assert "wrote" not in r.stderr


def test_default_output_in_unwritable_cwd_moves_and_cmd_runs(tmp_path: Path, read_only_dir: Path) -> None:
    """The default file (not asked for) never keeps CMD from starting: it goes to the state directory
    (tests/e2e/test_launch_output_fallback.py walks the other places as another uid)."""
    env = dict(launch_env(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))
    r = subprocess.run([*CLI, "launch", "--", "true"], capture_output=True, text=True, timeout=60,
                       cwd=read_only_dir, env=env)
    assert r.returncode == 0, r.stderr
    assert "in the working directory (Read-only file system)" in r.stderr, r.stderr
    [f] = list((tmp_path / "state" / "infersight").glob("infersight-*.otlp.jsonl"))
    assert "writing the cold start to %s" % f in r.stderr


# -- Ctrl-C reaches CMD once ---------------------------------------------------------

# Two SIGINTs that arrive before CMD handles the first merge into one (standard signals
# do not queue), so a count alone can miss a duplicate on a busy machine. CMD also says
# whether it leads its own process group, and holds the terminal: that is what makes the
# terminal's ^C reach it once, and what launch's forwarding cannot duplicate.
COUNT_SIGINT = r"""
import os, signal, sys, time
n = [0]
def on_int(*_a):
    n[0] += 1
signal.signal(signal.SIGINT, on_int)
own_group = os.getpgrp() == os.getpid()
holds_tty = os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
print("ready own_group=%s holds_tty=%s" % (own_group, holds_tty), flush=True)
while n[0] == 0:
    time.sleep(0.01)
time.sleep(0.5)  # a duplicate (forwarded) SIGINT lands within microseconds of the first
open(sys.argv[1], "w").write(str(n[0]))
"""


def _read_until(fd: int, needle: bytes, sink: list[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in b"".join(sink):
        left = deadline - time.monotonic()
        # (a read that would block past the deadline fails here, not whenever output comes)
        assert left > 0 and select.select([fd], [], [], left)[0], b"".join(sink).decode(errors="replace")
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        sink.append(chunk)


def _read_line(fd: int, prefix: bytes, sink: list[bytes], timeout: float = 60.0) -> bytes:
    """The first whole line of the pty's output that starts with prefix."""
    deadline = time.monotonic() + timeout
    while True:
        for line in b"".join(sink).split(b"\n")[:-1]:
            if line.startswith(prefix):
                return line.rstrip(b"\r")
        assert time.monotonic() < deadline, b"".join(sink).decode(errors="replace")
        chunk = os.read(fd, 4096)
        assert chunk, b"".join(sink).decode(errors="replace")
        sink.append(chunk)


def _controlling_tty() -> None:
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _proc_state(pid: int) -> str:
    try:
        return Path("/proc/%d/stat" % pid).read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _on_pty(tmp_path: Path, count: Path) -> tuple[subprocess.Popen[bytes], int]:
    """launch as a shell runs it: session leader on a real pty, in the foreground."""
    master, slave = pty.openpty()
    p = subprocess.Popen([*CLI, "launch", "--no-console", "--otlp-file", str(tmp_path / "o.jsonl"), "--",
                          sys.executable, "-c", COUNT_SIGINT, str(count)],
                         stdin=slave, stdout=slave, stderr=slave,
                         preexec_fn=_controlling_tty,  # noqa: PLW1509 - no threads yet
                         env=launch_env(tmp_path))
    os.close(slave)
    return p, master


def test_ctrl_c_on_a_terminal_reaches_cmd_once(tmp_path: Path) -> None:
    count = tmp_path / "count"
    p, master = _on_pty(tmp_path, count)
    out: list[bytes] = []
    try:
        assert _read_line(master, b"ready", out) == b"ready own_group=True holds_tty=True"
        os.write(master, b"\x03")  # the terminal's VINTR: SIGINT to its foreground process group
        drain = threading.Thread(target=_read_until, args=(master, b"\0never", out), daemon=True)
        drain.start()
        rc = p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    assert count.read_text() == "1", b"".join(out).decode(errors="replace")
    assert rc == 0


# A minimal job-control shell: session leader on the pty, runs its argv as a foreground job;
# on a stop it takes the terminal back, says so, waits for a line, then does what "fg" does.
MINI_SHELL = r"""
import os, signal, sys
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
foreground = sys.argv.pop(1) == "fg"
pid = os.fork()
if pid == 0:
    os.setpgid(0, 0)
    if foreground:
        os.tcsetpgrp(0, os.getpid())
    signal.signal(signal.SIGTTOU, signal.SIG_DFL)
    os.execv(sys.argv[1], sys.argv[1:])
try:
    os.setpgid(pid, pid)
    if foreground:
        os.tcsetpgrp(0, pid)
except OSError:
    pass
while True:
    _, st = os.waitpid(pid, os.WUNTRACED)
    if os.WIFSTOPPED(st):
        os.tcsetpgrp(0, os.getpgrp())
        print("SHELL: job stopped", flush=True)
        sys.stdin.readline()
        os.tcsetpgrp(0, pid)
        os.killpg(pid, signal.SIGCONT)
        continue
    print("SHELL: job exited %d" % os.waitstatus_to_exitcode(st), flush=True)
    break
"""


def test_ctrl_z_stops_the_job_and_fg_resumes_it(tmp_path: Path) -> None:
    """Job control still works with CMD in its own group: ^Z stops CMD and launch (the shell
    sees its job stopped); fg resumes both, and CMD has the terminal again."""
    count = tmp_path / "count"
    master, slave = pty.openpty()
    # A hold longer than any wait here: the stop must be mirrored while launch holds its agent back.
    p = subprocess.Popen([sys.executable, "-c", MINI_SHELL, "fg", *CLI, "launch", "--no-console", "--agent-hold",
                          "600", "--otlp-file", str(tmp_path / "o.jsonl"), "--", sys.executable, "-c", COUNT_SIGINT,
                          str(count)],
                         stdin=slave, stdout=slave, stderr=slave,
                         preexec_fn=_controlling_tty,  # noqa: PLW1509 - no threads yet
                         env=launch_env(tmp_path))
    os.close(slave)
    out: list[bytes] = []
    try:
        _read_until(master, b"ready", out)
        launch_pid = int(Path("/proc/%d/task/%d/children" % (p.pid, p.pid)).read_text().split()[0])
        cmd_pid = int(Path("/proc/%d/task/%d/children" % (launch_pid, launch_pid)).read_text().split()[0])
        os.write(master, b"\x1a")  # VSUSP: SIGTSTP to the foreground group, CMD's
        _read_until(master, b"SHELL: job stopped", out)
        assert _proc_state(cmd_pid) == "T" and _proc_state(launch_pid) == "T"
        os.write(master, b"fg\n")
        assert wait_for(lambda: _proc_state(cmd_pid) not in ("T", "gone"), 20)
        os.write(master, b"\x03")  # CMD holds the terminal again: ^C reaches it, once
        _read_until(master, b"SHELL: job exited", out)
        rc = p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    assert rc == 0 and b"SHELL: job exited 0" in b"".join(out), b"".join(out).decode(errors="replace")
    assert count.read_text() == "1"


def test_background_job_that_reads_the_terminal_stops_and_fg_resumes_it(tmp_path: Path) -> None:
    """launch started in the background (cmd &): CMD's read of the terminal stops it, launch
    stops with it so the shell sees the job stopped, and fg hands CMD the terminal."""
    master, slave = pty.openpty()
    reader = "import sys; print('got', sys.stdin.readline().strip(), flush=True)"
    p = subprocess.Popen([sys.executable, "-c", MINI_SHELL, "bg", *CLI, "launch", "--no-console", "--agent-hold",
                          "600", "--otlp-file", str(tmp_path / "o.jsonl"), "--", sys.executable, "-c", reader],
                         stdin=slave, stdout=slave, stderr=slave,
                         preexec_fn=_controlling_tty,  # noqa: PLW1509 - no threads yet
                         env=launch_env(tmp_path))
    os.close(slave)
    out: list[bytes] = []
    try:
        _read_until(master, b"SHELL: job stopped", out)
        launch_pid = int(Path("/proc/%d/task/%d/children" % (p.pid, p.pid)).read_text().split()[0])
        cmd_pid = int(Path("/proc/%d/task/%d/children" % (launch_pid, launch_pid)).read_text().split()[0])
        assert _proc_state(cmd_pid) == "T"
        os.write(master, b"fg\n")
        assert wait_for(lambda: _proc_state(cmd_pid) not in ("T", "gone"), 20)
        os.write(master, b"hello\n")
        _read_until(master, b"SHELL: job exited", out)
        rc = p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    text = b"".join(out).decode(errors="replace")
    assert rc == 0 and "got hello" in text and "SHELL: job exited 0" in text, text


@pytest.mark.parametrize("to_group", [False, True], ids=["to-launch", "to-launch-group"])
def test_sigint_to_launch_reaches_cmd_once(tmp_path: Path, to_group: bool) -> None:
    """kill -INT <launch> and kill -INT -<launch's group> (what a terminal or a shell does)."""
    count = tmp_path / "count"
    p = subprocess.Popen([*CLI, "launch", "--no-console", "--otlp-file", str(tmp_path / "o.jsonl"), "--",
                          sys.executable, "-c", COUNT_SIGINT, str(count)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                         env=launch_env(tmp_path))
    assert p.stdout is not None
    assert p.stdout.readline().strip() == b"ready own_group=True holds_tty=False"
    if to_group:
        os.killpg(p.pid, signal.SIGINT)
    else:
        p.send_signal(signal.SIGINT)
    assert p.wait(60) == 0
    assert count.read_text() == "1"


# -- the launcher killed ---------------------------------------------------------------

GRACEFUL = r"""
import os, signal, sys, time
from infersight import hooks
if os.environ.get("QUICK"):  # the same command, run again to pick up what the first left
    sys.exit(0)
def bye(*_a):
    hooks.log("goodbye after the launcher died")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
hooks.log("hello")
print("ready", flush=True)
time.sleep(60)
"""


def test_killed_launcher_takes_cmd_down_and_next_launch_replays(tmp_path: Path) -> None:
    env = launch_env(tmp_path)
    first = tmp_path / "first.jsonl"
    p = subprocess.Popen([*CLI, "launch", "--no-console", "--otlp-file", str(first), "--",
                          sys.executable, "-c", GRACEFUL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == b"ready"
    children = Path("/proc/%d/task/%d/children" % (p.pid, p.pid)).read_text().split()
    assert len(children) == 1
    cmd_pid = int(children[0])
    p.kill()
    p.wait(10)
    # CMD got SIGTERM (the parent-death signal) and went, spooling its last event.
    assert wait_for(lambda: not Path("/proc/%d" % cmd_pid).exists()
                    or "Z" in Path("/proc/%d/stat" % cmd_pid).read_text().split()[2], 20)
    leftovers = list((tmp_path / "t").glob("infersight-launch-*"))
    assert len(leftovers) == 1
    assert "goodbye after the launcher died" not in bodies(first)

    # Issue 22: a launch of another command does not take the leftover into its output; it says so.
    other = tmp_path / "other.jsonl"
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(other), "--", "true"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "goodbye after the launcher died" not in bodies(other)
    assert "an earlier launch of another command left 1 spool file(s)" in r.stderr, r.stderr
    assert len(list((tmp_path / "t").glob("infersight-launch-*"))) == 1, "kept for a launch of that command"

    second = tmp_path / "second.jsonl"
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(second), "--",
                        sys.executable, "-c", GRACEFUL], capture_output=True, text=True, timeout=60,
                       env={**env, "QUICK": "1"})
    assert r.returncode == 0, r.stderr
    assert "goodbye after the launcher died" in bodies(second)
    assert "left by an earlier launch (pid %d)" % p.pid in r.stderr
    assert "lost" not in r.stderr, "events the first launch delivered are not counted as lost"
    assert not list((tmp_path / "t").glob("infersight-launch-*")), "a delivered leftover is removed"


def test_live_launch_directory_is_not_replayed(tmp_path: Path) -> None:
    """Another launch that runs holds its lock: its spool is not ours to take."""
    env = launch_env(tmp_path)
    p = subprocess.Popen([*CLI, "launch", "--no-console", "--otlp-file", str(tmp_path / "a.jsonl"), "--",
                          sys.executable, "-c", GRACEFUL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert p.stdout is not None
    try:
        assert p.stdout.readline().strip() == b"ready"
        r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(tmp_path / "b.jsonl"), "--", "true"],
                           capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0 and "earlier launch" not in r.stderr
    finally:
        p.terminate()
        p.wait(30)
    assert "goodbye after the launcher died" in bodies(tmp_path / "a.jsonl")


# -- a daemonized grandchild -------------------------------------------------------------

DAEMONIZE = r"""
import os, sys, time
from infersight import hooks
if os.environ.get("QUICK"):  # the same command, run again to pick up what the first left
    sys.exit(0)
release = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)  # as a daemon does: launch's caller is not kept waiting on its pipes
        with open(release + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(release + ".tmp", release + ".pid")  # whole, once it is there
        hooks.log("daemon before launch exits")
        hooks.flush(5)
        while not os.path.exists(release):
            time.sleep(0.02)
        hooks.log("daemon after launch exited")
        sys.exit(0)  # the hooks spool at exit: the agent is gone
    os._exit(0)
os.wait()
"""


def test_daemonized_grandchild_events_are_kept_then_replayed(tmp_path: Path) -> None:
    env = launch_env(tmp_path)
    release = tmp_path / "release"
    first = tmp_path / "first.jsonl"
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(first), "--",
                        sys.executable, "-c", DAEMONIZE, str(release)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "still run" in r.stderr and "next launch replays" in r.stderr
    kept = list((tmp_path / "t").glob("infersight-launch-*"))
    assert len(kept) == 1 and (kept[0] / "spool").is_dir()
    pid_file = tmp_path / "release.pid"
    assert wait_for(lambda: pid_file.exists() and pid_file.read_text().isdigit(), 30)
    daemon = int(pid_file.read_text())
    release.write_text("go")
    # The daemon exits after spooling its event into the kept directory. Its spool file exists, unlocked
    # and empty, for a moment before the hooks lock it (O_EXCL, then flock): wait for the daemon's end,
    # not only for an unlocked file (the second launch once replayed that empty file).
    assert wait_for(lambda: not _alive(daemon), 30)
    assert any((kept[0] / "spool").iterdir()) and not _locked_spools(kept[0] / "spool")

    second = tmp_path / "second.jsonl"  # a launch of the same command replays what it left
    r2 = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(second), "--",
                         sys.executable, "-c", DAEMONIZE, str(release)],
                        capture_output=True, text=True, timeout=60, env={**env, "QUICK": "1"})
    assert r2.returncode == 0, r2.stderr
    assert "daemon before launch exits" in bodies(first)
    assert "daemon after launch exited" in bodies(second)
    assert "lost" not in r2.stderr, "events the first launch delivered are not counted as lost"
    assert not kept[0].exists()


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it has ended)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _locked_spools(spool: Path) -> bool:
    for f in spool.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)
    return False


# -- a launch directory of another user is never touched -------------------------------------


def test_foreign_or_open_directories_are_not_replayed(tmp_path: Path) -> None:
    env = launch_env(tmp_path)
    planted = tmp_path / "t" / "infersight-launch-planted"
    (planted / "spool").mkdir(parents=True)
    (planted / "launch.lock").write_text("1\n")
    os.chmod(planted, 0o777)  # writable by others: not a directory launch made
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(tmp_path / "o.jsonl"), "--", "true"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "earlier launch" not in r.stderr
    assert planted.exists()


def test_config_error_is_a_usage_error_before_cmd(tmp_path: Path) -> None:
    marker = tmp_path / "cmd-ran"
    env = launch_env(tmp_path)
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_EXPORTER_OTLP_PROTOCOL="bogus")
    r = subprocess.run([*CLI, "launch", "--otlp-file", str(tmp_path / "o.jsonl"), "--",
                        sys.executable, "-c", "open(%r, 'w').write('x')" % str(marker)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "OTEL_EXPORTER_OTLP_PROTOCOL" in r.stderr
    assert not marker.exists()
    assert not list((tmp_path / "t").iterdir()), "the private directory is removed"


def test_a_missing_tmpdir_is_a_usage_error_before_cmd(tmp_path: Path) -> None:
    """(A $TMPDIR too deep for the socket's path is no error: test_launch.py's deep TMPDIR test.)"""
    marker = tmp_path / "cmd-ran"
    env = launch_env(tmp_path)
    env["TMPDIR"] = "/nonexistent-%s" % os.urandom(4).hex()  # (short: a deep one would fall back to /tmp)
    r = subprocess.run([*CLI, "launch", "--otlp-file", str(tmp_path / "o.jsonl"), "--",
                        sys.executable, "-c", "open(%r, 'w').write('x')" % str(marker)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "infersight launch: cannot" in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()


# -- a signal to launch reaches CMD's workers ------------------------------------------

# In "ignore" mode CMD and its worker note SIGTERM in a file and carry on: only a forced
# stop ends them.
NOTE_TERM = (
    "import os, signal, sys, time\n"
    "def noted(*_a):\n"
    "    with open(sys.argv[2], 'a') as f: f.write('term %d\\n' % os.getpid())\n"
    "if sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, noted)\n"
)
SPAWNS_A_WORKER = NOTE_TERM + r"""
import subprocess
worker = subprocess.Popen([sys.executable, "-c", NOTE_TERM + "print('worker up', flush=True)\ntime.sleep(120)\n",
                           *sys.argv[1:]], stdout=subprocess.PIPE)
assert worker.stdout is not None and worker.stdout.readline().strip() == b"worker up"
print("pids", worker.pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        return Path("/proc/%d/stat" % pid).read_text().split()[2] == "Z"  # exited, not yet reaped
    except OSError:
        return True


@pytest.mark.parametrize("mode", ["default", "ignore"])
def test_signal_to_launch_takes_cmd_and_its_workers_down(tmp_path: Path, mode: str) -> None:
    """kill <launch>: CMD and the worker CMD started both end (a worker that ignores SIGTERM
    ends on the second signal, which forces)."""
    p = subprocess.Popen([*CLI, "launch", "--no-console", "--otlp-file", str(tmp_path / "o.jsonl"), "--",
                          sys.executable, "-c", "NOTE_TERM = %r\n" % NOTE_TERM + SPAWNS_A_WORKER, mode,
                          str(tmp_path / "terms")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                         env=launch_env(tmp_path))
    try:
        assert p.stdout is not None
        line = p.stdout.readline().split()
        assert line[:1] == [b"pids"], line
        worker = int(line[1])
        cmd_pid = int(Path("/proc/%d/task/%d/children" % (p.pid, p.pid)).read_text().split()[0])
        assert not _gone(worker) and not _gone(cmd_pid)
        p.send_signal(signal.SIGTERM)
        if mode == "ignore":
            # Both got it (each notes it) and carry on: the second signal forces.
            terms = tmp_path / "terms"
            assert wait_for(lambda: terms.exists() and len(terms.read_text().split("\n")) > 2, 30)
            assert not _gone(worker) and not _gone(cmd_pid)
            p.send_signal(signal.SIGTERM)
        assert wait_for(lambda: _gone(worker) and _gone(cmd_pid), 30), "CMD or its worker outlived launch"
        rc = p.wait(60)
        assert rc == (128 + signal.SIGKILL if mode == "ignore" else 128 + signal.SIGTERM)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
