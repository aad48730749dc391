"""``_workers.reports``, polled by the sampler thread every tick, reads the children's directory
again only when it changed (one ``lstat`` otherwise): each system call on that thread costs the
busy main thread a switch to hand the GIL back."""

from __future__ import annotations

import os
import time

import pytest

from infersight.hooks import _workers


def test_an_unchanged_directory_is_not_read_again(tmp_path, monkeypatch) -> None:
    own = _workers.children_dir(str(tmp_path / "spool"), "p1")
    assert _workers.prepare(own)
    assert _workers.report(own, 1, 2, "first_request")
    monkeypatch.setattr(_workers, "RECENT_NS", 0)  # any change is old enough to trust the cache
    monkeypatch.setattr(_workers, "FINE_RECENT_NS", 0)
    n = _workers.reads
    assert _workers.reports(own) == [(1, 2, "first_request")]
    assert _workers.reads == n + 1
    for _ in range(5):
        assert _workers.reports(own) == [(1, 2, "first_request")]
    assert _workers.reads == n + 1  # five polls, no read
    time.sleep(0.01)  # a coarse clock tick: the new name moves the ctime
    child = os.fork()
    if child == 0:
        os._exit(0 if _workers.report(own, 3, 4, "workers") else 1)
    assert os.waitpid(child, 0)[1] == 0
    assert sorted(_workers.reports(own)) == [(1, 2, "first_request"), (3, 4, "workers")]
    assert _workers.reads == n + 2


def test_a_recent_change_is_read_every_time(tmp_path, monkeypatch) -> None:
    """A report created but not yet written moves nothing when it is written: while the
    directory changed less than RECENT_NS ago, every poll reads it."""
    own = _workers.children_dir(str(tmp_path / "spool"), "p2")
    assert _workers.prepare(own)
    fd = os.open(os.path.join(own, "123"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    monkeypatch.setattr(_workers, "RECENT_NS", 3600 * 10**9)
    monkeypatch.setattr(_workers, "FINE_RECENT_NS", 3600 * 10**9)
    n = _workers.reads
    assert _workers.reports(own) == []  # created, empty
    os.write(fd, b"5 6 first_request\n")
    os.close(fd)
    assert _workers.reports(own) == [(5, 6, "first_request")]
    assert _workers.reads == n + 2


def test_a_half_written_report_is_not_cached(tmp_path, monkeypatch) -> None:
    own = _workers.children_dir(str(tmp_path / "spool"), "p3")
    assert _workers.prepare(own)
    fd = os.open(os.path.join(own, "124"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    monkeypatch.setattr(_workers, "RECENT_NS", 0)
    monkeypatch.setattr(_workers, "FINE_RECENT_NS", 0)
    assert _workers.reports(own) == []
    os.write(fd, b"7 8 workers\n")
    os.close(fd)
    assert _workers.reports(own) == [(7, 8, "workers")]  # the directory did not change: read again


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_chown_is_a_change(tmp_path, monkeypatch) -> None:
    own = _workers.children_dir(str(tmp_path / "spool"), "p4")
    assert _workers.prepare(own)
    assert _workers.report(own, 1, 2, "first_request")
    monkeypatch.setattr(_workers, "RECENT_NS", 0)
    monkeypatch.setattr(_workers, "FINE_RECENT_NS", 0)
    assert _workers.reports(own) == [(1, 2, "first_request")]
    os.chown(own, 65534, 65534)
    assert _workers.reports(own) == []  # squatted: refused, not served from the cache


def test_the_recency_guard_follows_the_ctime_resolution() -> None:
    """A ctime with digits below the millisecond comes from a file system that keeps them:
    only the kernel's coarse clock tick to wait out. One rounded to the millisecond or more
    (a second, on some file systems) keeps the long guard."""
    assert _workers.recent_ns(1_700_000_000_123_456_789) == _workers.FINE_RECENT_NS
    assert _workers.recent_ns(1_700_000_000_000_000_000) == _workers.RECENT_NS
    assert _workers.recent_ns(1_700_000_000_123_000_000) == _workers.RECENT_NS
    assert _workers.FINE_RECENT_NS < _workers.RECENT_NS


def test_a_directory_made_at_start_is_cached_within_the_first_seconds(tmp_path, monkeypatch) -> None:
    """The children's directory is made when the cold start begins: once its ctime is older
    than the fine guard (a ctime with nanoseconds, as tmpfs and ext4 keep), the sampler's ticks
    in the first seconds lstat it instead of reading it every time."""
    own = _workers.children_dir(str(tmp_path / "spool"), "p5")
    assert _workers.prepare(own)
    ctime = os.lstat(own).st_ctime_ns
    if not ctime % 1_000_000:
        pytest.skip("this file system rounds ctimes to the millisecond or more")
    monkeypatch.setattr(_workers, "FINE_RECENT_NS", 1)
    monkeypatch.setattr(_workers, "RECENT_NS", 3600 * 10**9)  # the old rule would read every time
    n = _workers.reads
    assert _workers.reports(own) == []
    assert _workers.reports(own) == []
    assert _workers.reports(own) == []
    assert _workers.reads == n + 1


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another uid needs root")
def test_a_squatted_children_directory_gives_way_to_a_private_one(tmp_path) -> None:
    """The spool directory is shared with the socket group, and ``children-<uid>`` is easy to guess: a
    member who made it first (0777, theirs) turned off this uid's worker reports for good (the hooks
    rightly refuse it, and the sticky directory keeps them from removing it)."""
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o3770)
    squat = spool / ("children-%d" % os.getuid())
    squat.mkdir(mode=0o777)
    os.chown(squat, 65534, 65534)
    own = _workers.children_dir(str(spool), "boot-1-2")
    assert not own.startswith(str(squat) + os.sep)
    assert _workers.prepare(own), "no directory for the children to report in"
    base = os.path.dirname(own)
    assert os.stat(base).st_uid == os.getuid() and os.stat(base).st_mode & 0o777 == 0o700
    assert _workers.report(own, 1, 2, "first_request")
    assert _workers.reports(own) == [(1, 2, "first_request")]
    _workers.cleanup(own)
    assert not os.path.exists(base), "the private base is removed with the last directory in it"
    # unsquatted, the usual name is used
    other = tmp_path / "spool2"
    other.mkdir(mode=0o3770)
    assert _workers.children_dir(str(other), "boot-1-3") == str(other / ("children-%d" % os.getuid()) / "boot-1-3")


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another uid needs root")
def test_the_private_directory_is_reused_not_made_again_by_every_process(tmp_path) -> None:
    """With children-<uid> squatted, every hooked process made a private directory of its own, and
    nothing removed the ones whose process left it non-empty or never used it: the shared spool grew
    without bound (a review made five with five calls)."""
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o3770)
    squat = spool / ("children-%d" % os.getuid())
    squat.mkdir(mode=0o777)
    os.chown(squat, 65534, 65534)
    dirs = {os.path.dirname(_workers.children_dir(str(spool), "boot-1-%d" % n)) for n in range(5)}
    assert len(dirs) == 1 and len([p for p in spool.iterdir() if p != squat]) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another uid needs root")
def test_a_squat_beside_a_flood_of_names_costs_a_bounded_look(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A member squatted children-<uid> and planted 400k names beside it: every hooked start of the victim's
    listed them all (0.09 -> 0.3 s, a review's measurement). At most MAX_LOOKED names are looked at now; past
    them a new private directory is made (still 0700, the victim's)."""
    monkeypatch.setattr(_workers, "MAX_LOOKED", 64)
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o3770)
    squat = spool / ("children-%d" % os.getuid())
    squat.mkdir(mode=0o777)
    os.chown(squat, 65534, 65534)
    for i in range(500):
        (spool / ("planted-%04d" % i)).touch()
    looked: list[int] = []
    real = os.scandir

    class Counting:
        def __init__(self, path: str) -> None:
            self._it = real(path)

        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *exc: object) -> None:
            self._it.close()

        def __iter__(self):  # type: ignore[no-untyped-def]
            for e in self._it:
                looked.append(1)
                yield e

    monkeypatch.setattr(os, "scandir", Counting)
    made = _workers.children_base(str(spool))
    assert len(looked) <= 65 and made != str(squat)
    st = os.lstat(made)
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700

