"""Spool files of a served process that ran as another uid, replayed by the service's agent (its own uid).

The fleet layout of ``systemd/tmpfiles.d/infersight.conf``: the spool directory is the agent's
(``infersight``), 3770, and every model server's uid is in its group. A hooked process that found no agent
spools there and exits; the agent, started later, must replay the file into its sink. Before, the hooks
made the file 0600 (their uid's alone): the agent could not open it, said nothing and counted nothing, and
the events stayed on disk for good. Now the hooks grant the directory's owner read access with a POSIX ACL,
which no other member of the group gets (another tenant of the host must not read them), and a file the
agent still cannot read (an older hook's) is counted once and named in its log.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from conftest import BOOTSTRAP, attr, log_records, read_otlp_lines, wait_for
from fleet_env import base_env, make_dir, open_base, require_root, shared_python

from infersight.agent.daemon.lifecycle import SPOOL_SCAN_S

REPO = Path(__file__).resolve().parents[2]
SHIPPED_CONFIG = REPO / "systemd" / "infersight.toml"
AGENT_UID, SERVED_UID, OTHER_UID, GROUP_GID = 42911, 42912, 42913, 42910
SPOOLED = "from infersight import hooks\nhooks.log('spooled-while-away', k=7)\n"
READ_IT = ("import sys\ntry:\n    open(sys.argv[1], 'rb').read(1)\n    print('read')\n"
           "except PermissionError:\n    print('denied')\n")


def _layout(base: Path) -> tuple[Path, Path, Path]:
    run = make_dir(base / "run" / "infersight", 0o750, AGENT_UID, GROUP_GID)
    state = make_dir(base / "lib" / "infersight", 0o750, AGENT_UID, GROUP_GID)
    spool = make_dir(state / "spool", 0o3770, AGENT_UID, GROUP_GID)
    os.chmod(base / "run", 0o755)
    os.chmod(base / "lib", 0o755)
    return run / "agent.sock", state, spool


def _agent(python: Path, sock: Path, state: Path, spool: Path, log: Path) -> subprocess.Popen[bytes]:
    env = base_env(INFERSIGHT_SOCKET=str(sock), INFERSIGHT_STATE_DIR=str(state), INFERSIGHT_SPOOL_DIR=str(spool))
    return subprocess.Popen([str(python), "-m", "infersight", "agent", "--config", str(SHIPPED_CONFIG)], env=env,
                            user=AGENT_UID, group=GROUP_GID, extra_groups=[], umask=0o027, cwd="/",
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115


def _status(sock: Path) -> dict:  # type: ignore[type-arg]
    r = subprocess.run([sys.executable, "-m", "infersight", "status", "--socket", str(sock), "--json"],
                       capture_output=True, text=True, timeout=60)
    try:
        return json.loads(r.stdout)  # type: ignore[no-any-return]
    except ValueError:
        return {}


def test_the_agent_replays_a_spool_file_of_another_uid(tmp_path: Path) -> None:
    require_root()
    with open_base("isf-spool-") as base:
        sock, state, spool = _layout(base)
        python = shared_python(base)
        env = base_env(INFERSIGHT_SOCKET=str(sock), INFERSIGHT_SPOOL_DIR=str(spool), INFERSIGHT_EXIT_FLUSH_S="0.2",
                       PYTHONPATH=str(BOOTSTRAP), HOME=str(make_dir(base / "home", 0o777)))
        r = subprocess.run([str(python), "-c", SPOOLED], env=env, user=SERVED_UID, group=SERVED_UID,
                           extra_groups=[GROUP_GID], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "infersight" not in r.stderr, r.stderr  # no agent yet: it spooled quietly
        [f] = list(spool.glob("*.spool"))
        assert f.stat().st_uid == SERVED_UID
        # another tenant in the same group may not read it
        other = subprocess.run([str(python), "-c", READ_IT, str(f)], user=OTHER_UID, group=OTHER_UID,
                               extra_groups=[GROUP_GID], capture_output=True, text=True, timeout=60)
        assert other.stdout.strip() == "denied", other.stdout + other.stderr

        log = tmp_path / "agent.log"
        agent = _agent(python, sock, state, spool, log)
        try:
            default = state / "infersight.otlp.jsonl"

            def replayed() -> bool:
                records = log_records(read_otlp_lines(default)) if default.exists() else []
                return any(rec.get("body", {}).get("stringValue") == "spooled-while-away" and attr(rec, "k") == "7"
                           for rec in records)

            assert wait_for(replayed, 30), log.read_text()
            assert wait_for(lambda: not f.exists(), 30), "a replayed file is removed once exported"
            c = _status(sock)["counters"]
            assert c["spool_files_replayed"] >= 1 and c["spool_files_unreadable"] == 0, c
        finally:
            agent.terminate()
            assert agent.wait(30) == 0, log.read_text()


def test_a_spool_file_the_agent_may_not_read_is_counted_once_and_named(tmp_path: Path) -> None:
    """What hooks without the ACL left (0600, the served uid's alone): counted once, however many scans."""
    require_root()
    with open_base("isf-spool-") as base:
        sock, state, spool = _layout(base)
        python = shared_python(base)
        legacy = spool / "p-legacy-0123456789abcdef.spool"
        legacy.write_bytes(b"")
        os.chown(legacy, SERVED_UID, GROUP_GID)
        os.chmod(legacy, 0o600)
        log = tmp_path / "agent.log"
        agent = _agent(python, sock, state, spool, log)
        try:
            assert wait_for(lambda: _status(sock).get("counters", {}).get("spool_files_unreadable") == 1, 30), \
                log.read_text()
            time.sleep(SPOOL_SCAN_S + 1)  # the agent scans the spool again meanwhile: the file is not counted twice
            assert _status(sock)["counters"]["spool_files_unreadable"] == 1
            text = log.read_text()
            assert "cannot replay %s (owner uid %d" % (legacy, SERVED_UID) in text, text
            assert legacy.exists(), "a file the agent cannot read is left where it is"
        finally:
            agent.terminate()
            assert agent.wait(30) == 0, log.read_text()


def test_a_world_writable_spool_directory_grants_its_owner_nothing(tmp_path: Path) -> None:
    """Anyone may make a directory in a sticky world-writable place (/tmp): its owner is whoever came
    first, so a hook spooling there (INFERSIGHT_SPOOL_DIR=/tmp/...) grants that owner nothing."""
    require_root()
    with open_base("isf-spool-") as base:
        python = shared_python(base)
        squatted = make_dir(base / "squatted", 0o1777, OTHER_UID, OTHER_UID)
        env = base_env(INFERSIGHT_SOCKET=str(base / "none.sock"), INFERSIGHT_SPOOL_DIR=str(squatted),
                       INFERSIGHT_EXIT_FLUSH_S="0.2", PYTHONPATH=str(BOOTSTRAP),
                       HOME=str(make_dir(base / "home", 0o777)))
        r = subprocess.run([str(python), "-c", SPOOLED], env=env, user=SERVED_UID, group=SERVED_UID,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        [f] = list(squatted.glob("*.spool"))
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, "an ACL was added for the directory's owner"
        peek = subprocess.run([str(python), "-c", READ_IT, str(f)], user=OTHER_UID, group=OTHER_UID,
                              capture_output=True, text=True, timeout=60)
        assert peek.stdout.strip() == "denied", peek.stdout + peek.stderr


HOLD_IT = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
           "print('held', flush=True)\nsys.stdin.read()\n")


def _spooled_before_the_acl(base: Path, python: Path, sock: Path, spool: Path) -> Path:
    """A spool file as hooks older than the reader ACL leave it: the served uid's, 0600, no ACL."""
    env = base_env(INFERSIGHT_SOCKET=str(sock), INFERSIGHT_SPOOL_DIR=str(spool), INFERSIGHT_EXIT_FLUSH_S="0.2",
                   PYTHONPATH=str(BOOTSTRAP), HOME=str(make_dir(base / "home", 0o777)))
    r = subprocess.run([str(python), "-c", SPOOLED], env=env, user=SERVED_UID, group=SERVED_UID,
                       extra_groups=[GROUP_GID], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    [f] = list(spool.glob("*.spool"))
    os.removexattr(f, "system.posix_acl_access")
    os.chmod(f, 0o600)
    return f


def test_a_live_producers_unreadable_spool_file_is_not_reported(tmp_path: Path) -> None:
    """A producer still alive holds its file's lock and sends its events itself: the agent's open failing is
    no loss to count or warn of (it did, at start, for a producer on older hooks). Once the producer is gone,
    the file is counted and named."""
    require_root()
    with open_base("isf-spool-") as base:
        sock, state, spool = _layout(base)
        python = shared_python(base)
        f = _spooled_before_the_acl(base, python, sock, spool)
        holder = subprocess.Popen([str(python), "-c", HOLD_IT, str(f)], user=SERVED_UID, group=SERVED_UID,
                                  extra_groups=[GROUP_GID], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        log = tmp_path / "agent.log"
        agent = _agent(python, sock, state, spool, log)
        try:
            assert wait_for(lambda: "counters" in _status(sock), 30), log.read_text()
            time.sleep(2 * SPOOL_SCAN_S + 1)  # the first scan and two periodic ones found the file
            h = _status(sock)
            assert h["counters"]["spool_files_unreadable"] == 0, h["counters"]
            assert not any("may not read" in w for w in h["warnings"]), h["warnings"]
            assert "cannot replay" not in log.read_text()
            assert holder.stdin is not None
            holder.stdin.close()
            assert holder.wait(30) == 0
            assert wait_for(lambda: _status(sock).get("counters", {}).get("spool_files_unreadable") == 1, 30), \
                log.read_text()
            assert "cannot replay %s (owner uid %d" % (f, SERVED_UID) in log.read_text()
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()
            agent.terminate()
            assert agent.wait(30) == 0, log.read_text()


def test_status_warns_of_unreadable_spool_files_until_the_agent_may_read_them(tmp_path: Path) -> None:
    """An ended producer's file the agent may not read: `status` (JSON and text) names how many, whose, where
    and the fix; once the agent may read it (the ACL newer hooks add, as `setfacl -m u:AGENT:r` makes it), a
    later scan replays it, without a restart, and the warning goes."""
    require_root()
    from infersight.hooks._spoolfile import reader_acl

    with open_base("isf-spool-") as base:
        sock, state, spool = _layout(base)
        python = shared_python(base)
        f = _spooled_before_the_acl(base, python, sock, spool)
        log = tmp_path / "agent.log"
        agent = _agent(python, sock, state, spool, log)
        try:
            def warned() -> list[str]:
                return [w for w in _status(sock).get("warnings", []) if "may not read" in w]

            assert wait_for(lambda: bool(warned()), 30), log.read_text()
            [w] = warned()
            assert ("1 spool file(s) of uid %d in %s that this agent (uid %d) may not read" % (SERVED_UID, spool,
                                                                                              AGENT_UID)) in w, w
            assert str(f) in w and "setfacl -m u:%d:r FILE" % AGENT_UID in w, w
            r = subprocess.run([sys.executable, "-m", "infersight", "status", "--socket", str(sock)],
                               capture_output=True, text=True, timeout=60)
            assert "  WARNING 1 spool file(s) of uid %d" % SERVED_UID in r.stdout, r.stdout
            assert f.exists(), "a file the agent cannot read is left where it is"

            os.setxattr(f, "system.posix_acl_access", reader_acl(AGENT_UID))  # setfacl -m u:AGENT_UID:r
            default = state / "infersight.otlp.jsonl"

            def replayed() -> bool:
                records = log_records(read_otlp_lines(default)) if default.exists() else []
                return any(rec.get("body", {}).get("stringValue") == "spooled-while-away" for rec in records)

            assert wait_for(replayed, 30), log.read_text()
            assert wait_for(lambda: not f.exists(), 30), "a replayed file is removed once exported"
            assert wait_for(lambda: not warned(), 30)
            assert _status(sock)["counters"]["spool_files_replayed"] == 1
        finally:
            agent.terminate()
            assert agent.wait(30) == 0, log.read_text()
