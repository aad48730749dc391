"""A served process whose user may not reach the agent's socket says so, once, and spools.

As root: a real agent runs with the socket group's gid (its socket 0660, in a directory of that
group: 0750 as tmpfiles.d makes ``/run/infersight``, or 0755 with only the socket closed), and a
hooked process runs as another uid that is not in the group. Its connects fail with EACCES; the
hook must say so on stderr in one line that names the socket, the error and the group to join,
however often it retries, keep the events in its spool and leave the process's exit status alone.
Before the fix the failure was swallowed: nothing said, and the spool went to a per-user place
the system agent never reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BOOTSTRAP, AgentProcess, wait_for
from fleet_env import base_env, make_dir, open_base, require_root, shared_python, system_python

SERVED_UID, GROUP_GID = 42912, 42910  # the model server's uid (in no group of ours), group infersight

# Emits, then waits (as events, not time) until the hook has failed to connect at least four
# times: one line must cover every retry. Then it exits normally.
SERVED = """\
import sys, time
from infersight import hooks
from infersight.hooks import _runtime
c = _runtime.state().client
assert c is not None, "the hooks are not active"
for i in range(50):
    hooks.log("kept", i=i)
deadline = time.monotonic() + 60  # a bound, not a speed
while c.conn._backoff < 0.8 or c.conn.up:
    if time.monotonic() > deadline:
        sys.exit("no four connect attempts")
    hooks.flush(0.05)
print("tried", flush=True)
"""


def _root_agent_in(base: Path, dir_mode: int, group: int) -> AgentProcess:
    """A real agent as root with gid ``group``, its socket in ``base``/run/infersight (``dir_mode``, root:GROUP_GID,
    as tmpfiles.d makes it). The caller waits for it and stops it."""
    make_dir(base / "run", 0o755)
    run = make_dir(base / "run" / "infersight", dir_mode, 0, GROUP_GID)
    agent = AgentProcess(make_dir(base / "agent", 0o700))
    agent.sock = run / "agent.sock"
    agent.config.write_text(agent.config.read_text().replace(
        'socket = "%s"' % (agent.root / "agent.sock"), 'socket = "%s"' % agent.sock))
    env = dict(os.environ)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    agent.proc = subprocess.Popen([sys.executable, "-m", "infersight", "agent", "--config", str(agent.config)],
                                  stdout=open(agent.log, "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                  env=env, group=group, extra_groups=[])
    return agent


@pytest.mark.parametrize("dir_mode", [0o750, 0o755], ids=["dir-0750", "socket-only"])
def test_a_user_outside_the_socket_group_is_told_once_and_spools(tmp_path: Path, dir_mode: int) -> None:
    require_root()
    python = system_python()  # the test's own interpreter may be under a 0700 /root
    with open_base("isf-acl-") as base:
        # Root, with the socket group as its gid: the socket is made 0660 root:GROUP_GID.
        agent = _root_agent_in(base, dir_mode, group=GROUP_GID)
        try:
            assert wait_for(agent._listening, 30), agent.log.read_text()
            st = agent.sock.stat()
            assert st.st_gid == GROUP_GID and st.st_mode & 0o777 == 0o660, oct(st.st_mode)

            home = make_dir(base / "home", 0o700, SERVED_UID, SERVED_UID)
            spool = make_dir(base / "spool", 0o700, SERVED_UID, SERVED_UID)
            (home / "served.py").write_text(SERVED)
            served_env = base_env(INFERSIGHT="1", PYTHONPATH=str(BOOTSTRAP), INFERSIGHT_SOCKET=str(agent.sock),
                                  INFERSIGHT_SPOOL_DIR=str(spool), INFERSIGHT_EXIT_FLUSH_S="0.5", HOME=str(home))
            r = subprocess.run([python, str(home / "served.py")], env=served_env, cwd=str(home),
                               user=SERVED_UID, group=SERVED_UID, extra_groups=[],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr
            assert r.stdout.strip() == "tried", r.stdout + r.stderr
            said = [line for line in r.stderr.splitlines() if line.startswith("infersight:")]
            assert len(said) == 1, r.stderr
            (line,) = said
            assert str(agent.sock) in line and "Permission denied" in line, line
            assert "uid %d" % SERVED_UID in line and "usermod -aG %d" % GROUP_GID in line, line
            assert "spooling instead" in line, line
            assert r.stderr.strip() == line, "nothing else on stderr: %r" % r.stderr
            spooled = list(spool.glob("*.spool"))
            assert spooled and any(b"kept" in p.read_bytes() for p in spooled), "the events were spooled"
            assert agent.status()["producers"] == 0  # it never got in
        finally:
            agent.stop()


MEMBER = """\
from infersight import hooks
hooks.log("member")
assert hooks.flush(10), "not delivered"
"""


def test_an_agent_run_as_root_gives_its_socket_the_directorys_group() -> None:
    """The operator runs the agent as root in the foreground (``/run/infersight`` made by tmpfiles.d, group
    infersight), not as its service: its socket used to be root:root, and a member of group infersight got
    EACCES and the hint to join group root. The socket now takes the directory's group, as the socket unit's
    SocketGroup= does, and the member's events arrive."""
    require_root()
    python = system_python()
    with open_base("isf-root-") as base:
        agent = _root_agent_in(base, 0o750, group=0)  # root's own group
        try:
            assert wait_for(agent._listening, 30), agent.log.read_text()
            st = agent.sock.stat()
            assert st.st_gid == GROUP_GID and st.st_mode & 0o777 == 0o660, (st.st_gid, oct(st.st_mode))
            home = make_dir(base / "home", 0o700, SERVED_UID, SERVED_UID)
            spool = make_dir(base / "spool", 0o700, SERVED_UID, SERVED_UID)
            (home / "member.py").write_text(MEMBER)
            served_env = base_env(INFERSIGHT="1", PYTHONPATH=str(BOOTSTRAP), INFERSIGHT_SOCKET=str(agent.sock),
                                  INFERSIGHT_SPOOL_DIR=str(spool), HOME=str(home))
            r = subprocess.run([python, str(home / "member.py")], env=served_env, cwd=str(home),
                               user=SERVED_UID, group=SERVED_UID, extra_groups=[GROUP_GID],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0 and "infersight:" not in r.stderr, r.stdout + r.stderr
            assert wait_for(lambda: agent.status()["producers"] >= 1, 20), agent.status()
        finally:
            agent.stop()


def test_launch_outside_the_socket_group_says_which_group_not_that_no_agent_listens() -> None:
    """``/run/infersight`` is 0750 group infersight: to a user outside the group the socket is hidden, and
    launch said "no agent listens ... (no socket)" while the service ran (a review). It says which group
    to join instead, and runs its own agent."""
    require_root()
    if os.path.exists("/run/infersight"):
        pytest.skip("/run/infersight exists here: launch's default socket is that one")
    with open_base("isf-lnch-") as base:
        agent = _root_agent_in(base, 0o750, group=GROUP_GID)
        try:
            assert wait_for(agent._listening, 30), agent.log.read_text()
            python = shared_python(base)
            home = make_dir(base / "home", 0o700, SERVED_UID, SERVED_UID)
            env = base_env(XDG_RUNTIME_DIR=str(base / "run"), HOME=str(home), TMPDIR=str(home),
                           INFERSIGHT_MEASURE_STORAGE="0")
            r = subprocess.run([str(python), "-m", "infersight", "launch", "--", str(python), "-c", "pass"],
                               env=env, cwd=str(home), user=SERVED_UID, group=SERVED_UID, extra_groups=[],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr
            assert "no socket" not in r.stderr, r.stderr
            assert "usermod -aG %d" % GROUP_GID in r.stderr and "running an embedded agent" in r.stderr, r.stderr
        finally:
            agent.stop()
