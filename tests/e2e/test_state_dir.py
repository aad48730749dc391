"""Issue 22.1: the agent's own state lives in ``agent.state_dir``, writable by the agent alone.

Faults injected for real, as root acting for uid ``nobody``: a state directory that is a
symbolic link, one owned by another user, one group-writable; and the attack of the issue: a
member of the hooks' group-writable spool directory plants a symbolic link where the exporters'
disk spool used to live (``<spool_dir>/exporters/<name>``), pointing at a root-owned directory.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from pathlib import Path

import pytest
from conftest import wait_for

from infersight.statefiles import UnsafeStateDirError, ensure_state_dir, open_state_file, refusal

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to plant entries as another user")


@pytest.fixture
def base(open_dir: Path) -> Path:
    return open_dir


def nobody() -> pwd.struct_passwd:
    return pwd.getpwnam("nobody")


def start_with_state_dir(agent_factory, base: Path, state: Path):  # type: ignore[no-untyped-def]
    agent = agent_factory(root=base / "agent")
    text = agent.config.read_text().replace("[agent]\n", '[agent]\nstate_dir = "%s"\n' % state, 1)
    agent.config.write_text(text)
    return agent


@pytest.mark.parametrize("fault", ["symlink", "other_owner"])
def test_the_daemon_refuses_a_state_dir_others_can_write(fault: str, agent_factory, base: Path,  # type: ignore[no-untyped-def]
                                                         monkeypatch) -> None:
    state = base / "state"
    if fault == "symlink":
        real = base / "real"
        real.mkdir(mode=0o700)
        os.symlink(real, state)
        os.lchown(state, nobody().pw_uid, nobody().pw_gid)
    elif fault == "other_owner":
        state.mkdir(mode=0o700)
        os.chown(state, nobody().pw_uid, nobody().pw_gid)
    monkeypatch.delenv("INFERSIGHT_STATE_DIR", raising=False)
    agent = start_with_state_dir(agent_factory, base, state)
    agent.start(wait=False)
    assert agent.proc.wait(30) == 2  # type: ignore[union-attr]
    log = agent.log.read_text()
    assert "unsafe state directory" in log and "agent.state_dir" in log, log
    assert "Traceback" not in log


def test_a_state_dir_under_a_world_writable_parent_starts_with_a_warning(agent_factory, base: Path,  # type: ignore[no-untyped-def]
                                                                         monkeypatch) -> None:
    """A Kubernetes emptyDir is 0777: the agent starts there, says so, and follows no link below it."""
    shared = base / "world-writable"
    shared.mkdir()
    os.chmod(shared, 0o777)
    state = shared / "a" / "state"
    monkeypatch.delenv("INFERSIGHT_STATE_DIR", raising=False)
    agent = start_with_state_dir(agent_factory, base, state).start()
    st = agent.status()
    assert any("writable by others without the sticky bit" in w for w in st["warnings"]), st["warnings"]
    assert "writable by others without the sticky bit" in agent.log.read_text()


def test_a_state_dir_swapped_under_a_shared_parent_is_refused_not_followed(base: Path) -> None:
    shared = base / "world-writable"
    shared.mkdir()
    os.chmod(shared, 0o777)
    state = shared / "a" / "state"
    assert ensure_state_dir(str(state))  # a warning, not a refusal
    fd = open_state_file(str(state), "coldstart-history.jsonl", os.O_WRONLY | os.O_CREAT)
    os.close(fd)
    # A member moves "a" away and puts a link to another directory of the agent's in its place.
    elsewhere = base / "elsewhere"
    (elsewhere / "state").mkdir(parents=True, mode=0o700)
    os.rename(shared / "a", shared / "moved")
    os.symlink(elsewhere, shared / "a")
    with pytest.raises(OSError) as exc:
        open_state_file(str(state), "coldstart-history.jsonl", os.O_WRONLY | os.O_CREAT)
    assert exc.value.errno in (errno.ELOOP, errno.ENOTDIR)
    assert not (elsewhere / "state" / "coldstart-history.jsonl").exists()
    # ... or a directory of their own: refused by its owner.
    os.unlink(shared / "a")
    (shared / "a" / "state").mkdir(parents=True)
    os.chown(shared / "a" / "state", nobody().pw_uid, nobody().pw_gid)
    with pytest.raises(UnsafeStateDirError):
        open_state_file(str(state), "coldstart-history.jsonl", os.O_WRONLY | os.O_CREAT)


def test_a_state_dir_of_the_agents_own_is_fixed_not_refused(agent_factory, base: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    state = base / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    monkeypatch.delenv("INFERSIGHT_STATE_DIR", raising=False)
    agent = start_with_state_dir(agent_factory, base, state).start()
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o755
    assert agent.status()["healthy"] is True
    # Said in the log, and fixed before the cold-start history is read there: it was read first, met the
    # mode ("is unreadable ... starting without it": ETAs from nothing), and the fix went unsaid.
    log = agent.log.read_text()
    assert "was writable by group or others (mode 0777): those bits are removed (now 0755)" in log, log
    assert "unreadable" not in log, log


def test_a_state_dir_another_uid_owns_is_refused_in_plain_words(base: Path) -> None:
    """Root running ``launch`` on a host with the service installed was told /var/lib/infersight "is owned by
    uid 995, not by the agent's uid 0 (or root)"; and :func:`refusal` lets a default skip such a directory."""
    state = base / "service-state"
    state.mkdir(mode=0o750)
    os.chown(state, nobody().pw_uid, nobody().pw_gid)
    why = refusal(str(state))
    assert why == "%s is owned by uid %d, not by root (the agent's uid)" % (state, nobody().pw_uid)
    with pytest.raises(UnsafeStateDirError, match=r"not by root \(the agent's uid\)"):
        ensure_state_dir(str(state))
    other = nobody().pw_uid + 1
    assert refusal(str(state), owner=other) == "%s is owned by uid %d, neither by the agent's uid %d nor by root" % (
        state, nobody().pw_uid, other)
    assert refusal(str(state), owner=nobody().pw_uid) is None
    # Usable as it is, fixable, or absent: no refusal. A link is refused.
    own = base / "own"
    own.mkdir()
    os.chmod(own, 0o770)
    assert refusal(str(own)) is None and refusal(str(base / "absent")) is None
    os.symlink(own, base / "link")
    assert refusal(str(base / "link")) == "%s is a symbolic link" % (base / "link")


def test_the_default_state_dir_skips_the_services_owned_by_another_uid(base: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Root's ``launch`` chose /var/lib/infersight (root can write it), then refused it (the service user owns
    it): no cold-start history, ever, and two warnings on every run. The default now passes over it."""
    from infersight.agent.daemon.config import _default_state_dir

    monkeypatch.setenv("XDG_STATE_HOME", str(base / "xdg"))
    system = base / "var-lib-infersight"
    system.mkdir(mode=0o750)
    assert _default_state_dir(str(system)) == str(system)  # root's own: used
    os.chown(system, nobody().pw_uid, nobody().pw_gid)
    assert _default_state_dir(str(system)) == str(base / "xdg" / "infersight")


def test_files_in_the_state_dir_are_opened_without_following_links(base: Path) -> None:
    state = base / "state"
    ensure_state_dir(str(state))
    target = base / "root-only"
    target.write_bytes(b"root's own\n")
    os.mkdir(state / "exporters", 0o700)
    os.symlink(base, state / "exporters" / "otlp")  # a link at a directory component
    os.symlink(target, state / "coldstart-history.jsonl")  # and at the file itself
    for rel in ("exporters/otlp/000000000001.seg", "coldstart-history.jsonl"):
        with pytest.raises(OSError) as exc:
            open_state_file(str(state), rel, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        assert exc.value.errno in (errno.ELOOP, errno.ENOTDIR), rel
    assert target.read_bytes() == b"root's own\n"
    with pytest.raises(UnsafeStateDirError):
        open_state_file(str(state), "../escape", os.O_RDONLY)


def test_the_exporters_spool_is_not_in_the_hooks_spool_dir(agent_factory, base: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The issue's attack: a group member plants ``<spool_dir>/exporters/otlp`` as a link to a
    root-owned directory holding a root-owned file. The agent spools for its unreachable OTLP
    peer into its own state directory; nothing is written through the planted link."""
    spool = base / "spool"
    spool.mkdir()
    os.chown(spool, 0, nobody().pw_gid)
    os.chmod(spool, 0o2770)
    private = base / "private"
    private.mkdir(mode=0o700)
    victim = private / "000000000001.seg"
    victim.write_bytes(b"root's own\n")
    os.chmod(victim, 0o600)
    (spool / "exporters").mkdir()
    os.chown(spool / "exporters", nobody().pw_uid, nobody().pw_gid)
    os.symlink(private, spool / "exporters" / "otlp")
    os.lchown(spool / "exporters" / "otlp", nobody().pw_uid, nobody().pw_gid)
    state = base / "state"
    monkeypatch.setenv("INFERSIGHT_STATE_DIR", str(state))
    agent = agent_factory('[exporters.otlp]\nendpoint = "http://127.0.0.1:9"\nprotocol = "http/protobuf"\n'
                          'timeout_s = 0.2\n', root=base / "agent")
    agent.config.write_text(agent.config.read_text().replace('spool_dir = "%s"' % agent.spool,
                                                             'spool_dir = "%s"' % spool))
    agent.start()

    def otlp() -> dict:  # type: ignore[type-arg]
        return next(e for e in agent.status()["exporters"] if e["name"] == "otlp")

    assert wait_for(lambda: otlp()["spooled_items_pending"] > 0, 30), otlp()
    assert victim.read_bytes() == b"root's own\n" and sorted(os.listdir(private)) == ["000000000001.seg"]
    assert list((state / "exporters" / "otlp").glob("*.seg")), "spooled in the agent's own state directory"
    assert stat.S_IMODE(os.stat(state).st_mode) & 0o022 == 0


def test_two_agents_never_share_one_exporter_spool(base: Path) -> None:
    """Two agents configured with one state directory would corrupt each other's spools: the
    second one to open a spool is refused, with the reason."""
    from infersight.agent.daemon.spool import DiskSpool, SpoolInUseError

    state = base / "state"
    ensure_state_dir(str(state))
    first = DiskSpool("exporters/otlp", state_dir=str(state))
    with pytest.raises(SpoolInUseError, match="in use by another agent"):
        DiskSpool("exporters/otlp", state_dir=str(state))
    first.close()
    DiskSpool("exporters/otlp", state_dir=str(state)).close()


async def test_the_default_file_rotates_in_the_state_dir_and_follows_no_link(base: Path) -> None:
    """The daemon's default OTLP file is the agent's own state: opened and rotated through the
    checked directory; a link planted at its name is refused, not written through."""
    from infersight.exporters.file import FileExporter
    from infersight.telemetry import LogItem, Resource

    state = base / "state"
    ensure_state_dir(str(state))
    res = Resource.of({"service.name": "s"})
    batch = [LogItem(res, 1, 9, "INFO", "x" * 200, {})]
    exp = FileExporter(str(state / "infersight.otlp.jsonl"), max_bytes=300, backups=2, state_dir=str(state))
    await exp.start()
    for _ in range(4):
        await exp.export(batch)
    await exp.shutdown()
    assert exp.rotations >= 2
    assert sorted(p.name for p in state.iterdir()) == [
        "infersight.otlp.jsonl", "infersight.otlp.jsonl.1", "infersight.otlp.jsonl.2"]
    target = base / "root-only"
    target.write_bytes(b"root's own\n")
    (state / "infersight.otlp.jsonl").unlink()
    os.symlink(target, state / "infersight.otlp.jsonl")
    again = FileExporter(str(state / "infersight.otlp.jsonl"), state_dir=str(state))
    with pytest.raises(OSError) as exc:
        await again.start()
    assert exc.value.errno == errno.ELOOP
    assert target.read_bytes() == b"root's own\n"


def _chmod_of_old_glibc(real):  # type: ignore[no-untyped-def]
    """``os.chmod`` as CPython behaves on glibc < 2.32 (Debian 11, Ubuntu 20.04, RHEL 8):
    ``follow_symlinks=False`` is not supported there (a stand-in for that platform)."""

    def chmod(path, mode, *, dir_fd=None, follow_symlinks=True):  # type: ignore[no-untyped-def]
        if not follow_symlinks:
            raise NotImplementedError("chmod: follow_symlinks unavailable on this platform")
        return real(path, mode, dir_fd=dir_fd, follow_symlinks=follow_symlinks)

    return chmod


def test_modes_are_fixed_without_lchmod(base: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The agent's own group-writable state dir is fixed, and the hooks' spool dir gets its
    sticky bit, where the C library has no chmod that refuses links."""
    from infersight.agent.daemon.lifecycle import check_hooks_spool_dir

    state, spool = base / "state", base / "spool"
    state.mkdir()
    spool.mkdir()
    os.chmod(state, 0o770)
    os.chmod(spool, 0o2770)
    monkeypatch.setattr(os, "chmod", _chmod_of_old_glibc(os.chmod))
    assert ensure_state_dir(str(state)) == []
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o750
    assert check_hooks_spool_dir(str(spool)) is True
    assert stat.S_IMODE(os.stat(spool).st_mode) == 0o3770


def test_a_missing_hooks_spool_dir_is_made_shared_and_sticky(base: Path) -> None:
    """The pod's spool volume is an emptyDir (2777, no sticky bit), where the hooks refuse to spool: the
    agent makes the configured subdirectory 3770 at start; nothing is made where the parent is missing."""
    from infersight.agent.daemon.lifecycle import check_hooks_spool_dir

    volume = base / "volume"
    volume.mkdir()
    os.chmod(volume, 0o2777)
    spool = volume / "hooks"
    assert check_hooks_spool_dir(str(spool)) is True
    st = os.lstat(spool)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o3770 and st.st_uid == os.geteuid()
    assert check_hooks_spool_dir(str(base / "absent" / "hooks")) is True
    assert not (base / "absent").exists()
    # a user's own state directory is no shared place: nothing is made there (its group may be shared)
    own = base / "own"
    own.mkdir(mode=0o750)
    os.chmod(own, 0o750)
    assert check_hooks_spool_dir(str(own / "spool")) is True
    assert not (own / "spool").exists()


def test_a_spool_dir_a_hook_made_before_the_agent_is_said_not_lost_silently(base: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A pod whose model server started before the sidecar (the .pth bootstrap, no native sidecar): its hook made
    the spool directory its own (2700), the agent could not read it, and the first run's spool was never replayed
    with nothing said (review finding). The agent says so, with the fix. (The agent's uid is played: root reads
    any directory.)"""
    from infersight.agent.daemon.lifecycle import foreign_spool_dir

    spool = base / "hooks"
    spool.mkdir()
    os.chmod(spool, 0o2700)
    os.chown(spool, 1000, 1000)
    assert foreign_spool_dir(str(spool)) is None  # root: it reads it
    monkeypatch.setattr(os, "geteuid", lambda: 10001)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    why = foreign_spool_dir(str(spool))
    assert why is not None and str(spool) in why and "uid 1000 (mode 2700)" in why and "remove it" in why
    assert foreign_spool_dir(str(base / "absent")) is None
