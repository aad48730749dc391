"""The spool directory is shared (2770, group infersight): its other writers are not trusted.

Faults injected for real: symlinks, FIFOs and hard links planted by uid ``nobody`` (the entry is
chowned with ``lchown``, as if ``nobody`` had made it), in a directory ``nobody`` may write.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import attr, hook_env, log_records, read_otlp_lines, wait_for

from infersight.hooks import _proc

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to plant entries as another user")

SECRET = b"root's own data, mode 0600\n"


@pytest.fixture
def shared() -> Iterator[Path]:
    """A base dir others can traverse, with a spool dir group ``nobody`` may write (2770)."""
    base = Path(tempfile.mkdtemp(prefix="infersight-spoolsec-"))
    os.chmod(base, 0o755)
    spool = base / "spool"
    spool.mkdir()
    os.chown(spool, 0, pwd.getpwnam("nobody").pw_gid)
    os.chmod(spool, 0o2770)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def victim(base: Path) -> Path:
    private = base / "private"
    private.mkdir(mode=0o700, exist_ok=True)
    v = private / "root-only"
    v.write_bytes(SECRET)
    os.chmod(v, 0o600)
    return v


def plant(link: Path, make: str, target: Path | None = None) -> None:
    """Make ``link`` (a symlink, FIFO or hard link) and hand it to ``nobody``."""
    nobody = pwd.getpwnam("nobody")
    if make == "symlink":
        assert target is not None
        os.symlink(target, link)
    elif make == "fifo":
        os.mkfifo(link, 0o666)
    else:
        assert target is not None
        os.link(target, link)
        return  # a hard link shares the target's owner: chowning it would chown the target
    os.lchown(link, nobody.pw_uid, nobody.pw_gid)


def emit_script(tmp: Path, n: int, go: Path) -> Path:
    script = tmp / "emit.py"
    script.write_text(
        "import os, time\nfrom infersight import hooks\nassert hooks.active()\n"
        "while not os.path.exists(%r):\n    time.sleep(0.01)\n"
        "for i in range(%d):\n    hooks.log('e', i=i)\n" % (str(go), n)
    )
    return script


def test_hook_spool_never_follows_a_symlink_planted_at_its_name(shared: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """A group member plants a symlink where a root producer's spool file will be (the old name
    was predictable: boot id, pid, start ticks). The root-owned 0600 target stays intact, and the
    events are spooled to a fresh file and replayed."""
    spool, target, go = shared / "spool", victim(shared), shared / "go"
    env = hook_env(shared / "no-agent" / "agent.sock", spool, INFERSIGHT_EXIT_FLUSH_S="0.3")
    child = subprocess.Popen([sys.executable, str(emit_script(shared, 50, go))], env=env,
                             stderr=subprocess.PIPE, text=True)
    predicted = spool / ("%s.spool" % _proc.producer_id(child.pid))
    plant(predicted, "symlink", target)
    go.write_text("")
    _out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert target.read_bytes() == SECRET, "the hook wrote through a planted symlink"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert predicted.is_symlink() and os.readlink(predicted) == str(target)
    files = [p for p in spool.glob("*.spool") if not p.is_symlink()]
    assert len(files) == 1, files
    st = files[0].lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
    # The agent replays the real file, and leaves the planted link (and its target) alone.
    agent = agent_factory(root=shared).start()
    assert wait_for(lambda: not files[0].exists(), 20)
    assert agent.stop() == 0
    got = sorted(int(attr(r, "i")) for r in log_records(read_otlp_lines(agent.out)) if attr(r, "i") is not None)
    assert got == list(range(50))
    assert predicted.is_symlink() and target.read_bytes() == SECRET


def test_hook_unlinks_only_its_own_spool_file(shared: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """After a replay the hook removes its spool file through its own descriptors: a symlink
    swapped in at the name meanwhile is not what gets unlinked, and nothing is written through it."""
    spool, target, go = shared / "spool", victim(shared), shared / "agent-is-up"
    agent = agent_factory(root=shared)
    script = shared / "live.py"
    script.write_text(
        "import os, time\nfrom infersight import hooks\nfrom infersight.hooks import _runtime\n"
        "c = _runtime.state().client\n"
        "for i in range(300):\n    hooks.log('e', i=i)\n"
        "hooks.flush(10)\nprint('spooled', flush=True)\n"
        "while not os.path.exists(%r):\n    time.sleep(0.02)\n"
        "deadline = time.time() + 60\n"
        "while (c.conn.sock is None or c.spool.fd is not None) and time.time() < deadline:\n"
        "    time.sleep(0.02)\n"
        # the replay is sent and its file closed; an idle process reads its acks only when asked
        "print('replayed', c.conn.sock is not None and c.spool.fd is None, hooks.flush(10), flush=True)\n" % str(go)
    )
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env=hook_env(agent.sock, spool))
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "spooled"
    [own] = list(spool.glob("*.spool"))
    moved = spool / "moved-away"
    os.rename(own, moved)  # what a group member may do in a 2770 directory
    plant(own, "symlink", target)
    agent.start()
    go.write_text("")
    out, _ = child.communicate(timeout=90)
    assert child.returncode == 0 and out.split()[-2:] == ["True", "True"], out
    assert own.is_symlink(), "the hook unlinked a name that was no longer its file"
    assert target.read_bytes() == SECRET
    assert moved.stat().st_size == 0  # truncated through the hook's own descriptor
    time.sleep(0.5)
    assert agent.stop() == 0
    got = {int(attr(r, "i")) for r in log_records(read_otlp_lines(agent.out)) if attr(r, "i") is not None}
    assert got == set(range(300))


def test_agent_replay_skips_planted_symlinks_fifos_and_hard_links(shared: Path, agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Entries planted in the spool directory are neither followed nor read: a FIFO would block
    the agent's event loop on open, a symlink or a second link would feed it another file."""
    spool = shared / "spool"
    # Two genuine root-owned spool files, kept outside the spool directory.
    elsewhere = shared / "private"
    elsewhere.mkdir(mode=0o700)
    genuine = []
    for k in range(2):
        d = tmp_path / ("s%d" % k)
        env = hook_env(tmp_path / "no-agent.sock", d, INFERSIGHT_EXIT_FLUSH_S="0.2")
        code = "from infersight import hooks\nhooks.log('outside', k=%d)\n" % k
        assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0
        [f] = list(d.glob("*.spool"))
        genuine.append(Path(shutil.move(str(f), elsewhere / f.name)))
    sizes = [g.stat().st_size for g in genuine]
    plant(spool / "a.spool", "symlink", genuine[0])
    plant(spool / "b.spool", "fifo")
    plant(spool / "c.spool", "hardlink", genuine[1])
    agent = agent_factory(root=shared).start()
    assert wait_for(lambda: agent.status().get("producers") is not None, 10)
    status = agent.status()  # answered: the FIFO did not block the event loop
    assert status["counters"]["spool_files_refused"] >= 2
    assert agent.stop() == 0
    assert (spool / "a.spool").is_symlink() and (spool / "b.spool").exists() and (spool / "c.spool").exists()
    assert [g.stat().st_size for g in genuine] == sizes
    assert not [r for r in log_records(read_otlp_lines(agent.out)) if attr(r, "k") is not None]


@pytest.mark.parametrize("kind", ["symlink", "world-writable"])
def test_hook_refuses_a_spool_dir_that_is_a_planted_symlink_or_world_writable(shared: Path, kind: str) -> None:
    """The spool directory itself: a symlink planted by nobody (to a root-only directory) is not
    followed, and a 0777 directory without the sticky bit is not used. The events are counted."""
    target = shared / "private"
    target.mkdir(mode=0o700)
    spool = shared / "spool" / "producer"
    if kind == "symlink":
        plant(spool, "symlink", target)
    else:
        spool.mkdir()
        os.chown(spool, pwd.getpwnam("nobody").pw_uid, -1)
        os.chmod(spool, 0o777)
    code = "from infersight import hooks\nfor i in range(10):\n    hooks.log('e', i=i)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=hook_env(shared / "no-agent" / "agent.sock", spool, INFERSIGHT_EXIT_FLUSH_S="0.3"))
    assert r.returncode == 0, r.stderr
    assert not list(target.iterdir()) and not list(spool.glob("*.spool")), "spooled through a planted entry"
    assert ("symbolic link" if kind == "symlink" else "writable by everyone") in r.stderr, r.stderr
    assert "event(s) lost" in r.stderr
