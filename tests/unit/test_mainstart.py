"""``_mainstart``: which frame is the main program's first, and a watch that takes itself out
(on the program's first frame, after its budget of callbacks, never over another profiler)."""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import pytest

from infersight.hooks import _mainstart


def frame(co_name: str, module: str) -> SimpleNamespace:
    return SimpleNamespace(f_code=SimpleNamespace(co_name=co_name), f_globals={"__name__": module})


@pytest.mark.parametrize(("co_name", "module", "first"), [
    ("<module>", "__main__", True),              # a script, -c, stdin
    ("_run_module_as_main", "runpy", True),      # -m, a zip application, a directory
    ("<module>", "json", False),                 # an import's body
    ("main", "__main__", False),                 # a function of the script
    ("_run_module_as_main", "mypkg", False),
])
def test_program_start(co_name: str, module: str, first: bool) -> None:
    assert _mainstart.is_program_start(frame(co_name, module)) is first


@pytest.fixture
def no_profile():
    assert sys.getprofile() is None
    yield
    sys.setprofile(None)
    _mainstart._profile[0] = None


def test_the_program_frame_ends_the_watch(no_profile) -> None:
    seen: list[int] = []
    assert _mainstart.watch(seen.append)
    assert _mainstart.waiting()
    exec(compile("x = 1\n", "<program>", "exec"), {"__name__": "__main__"})
    assert len(seen) == 1 and seen[0] > 0
    assert sys.getprofile() is None and not _mainstart.waiting()


def test_it_gives_up_after_its_budget(no_profile, monkeypatch) -> None:
    monkeypatch.setattr(_mainstart, "MAX_EVENTS", 50)
    seen: list[int] = []
    assert _mainstart.watch(seen.append)
    for _ in range(100):
        len([])  # C calls: profile events
    assert sys.getprofile() is None and not _mainstart.waiting()
    exec(compile("x = 1\n", "<program>", "exec"), {"__name__": "__main__"})
    assert seen == []


def test_never_over_another_profiler_nor_off_the_main_thread(no_profile) -> None:
    def other(frame, event, arg) -> None:  # type: ignore[no-untyped-def]
        return None

    sys.setprofile(other)
    try:
        assert not _mainstart.watch(lambda t: None)
        assert sys.getprofile() is other
    finally:
        sys.setprofile(None)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(_mainstart.watch(lambda t: None)))
    t.start()
    t.join()
    assert got == [False]


def test_a_displaced_watch_is_not_waiting(no_profile) -> None:
    """A profiler set after the watch: imports are timed again (``waiting`` is False), and no
    call comes."""
    seen: list[int] = []
    assert _mainstart.watch(seen.append)
    sys.setprofile(lambda frame, event, arg: None)
    assert not _mainstart.waiting()
    sys.setprofile(None)
    exec(compile("x = 1\n", "<program>", "exec"), {"__name__": "__main__"})
    assert seen == []
