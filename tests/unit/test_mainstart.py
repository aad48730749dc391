"""``_mainstart``: which frame is the main program's first, and a watch that takes itself out
(on the program's first frame, after its budget of callbacks, never over another profiler)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
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


def note(seen: list) -> Callable[[int, bool], None]:  # type: ignore[type-arg]
    return lambda t_ns, started: seen.append((t_ns, started))


def test_the_program_frame_ends_the_watch(no_profile) -> None:
    seen: list[tuple[int, bool]] = []
    assert _mainstart.watch(note(seen))
    assert _mainstart.waiting()
    exec(compile("x = 1\n", "<program>", "exec"), {"__name__": "__main__"})
    assert len(seen) == 1 and seen[0][0] > 0 and seen[0][1] is True
    assert sys.getprofile() is None and not _mainstart.waiting()


def test_it_gives_up_after_its_budget(no_profile, monkeypatch) -> None:
    monkeypatch.setattr(_mainstart, "MAX_EVENTS", 50)
    seen: list[tuple[int, bool]] = []
    assert _mainstart.watch(note(seen))
    for _ in range(100):
        len([])  # C calls: profile events
    assert sys.getprofile() is None and not _mainstart.waiting()
    exec(compile("x = 1\n", "<program>", "exec"), {"__name__": "__main__"})
    assert len(seen) == 1 and seen[0][1] is False  # the give-up, once; the later program frame: nothing


def test_a_failure_inside_the_watch_never_reaches_the_program(no_profile, monkeypatch) -> None:
    def broken(frame) -> bool:  # type: ignore[no-untyped-def]
        raise RuntimeError("odd frame")

    monkeypatch.setattr(_mainstart, "is_program_start", broken)
    seen: list[tuple[int, bool]] = []
    assert _mainstart.watch(note(seen))
    def python_call() -> None:
        return None

    python_call()  # a Python call: would raise RuntimeError here if the callback let it out
    assert sys.getprofile() is None and not _mainstart.waiting() and seen == []


def test_never_over_another_profiler_nor_off_the_main_thread(no_profile) -> None:
    def other(frame, event, arg) -> None:  # type: ignore[no-untyped-def]
        return None

    sys.setprofile(other)
    try:
        assert not _mainstart.watch(lambda t, started: None)
        assert sys.getprofile() is other
    finally:
        sys.setprofile(None)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(_mainstart.watch(lambda t, started: None)))
    t.start()
    t.join()
    assert got == [False]


def test_a_displaced_watch_is_not_waiting(no_profile) -> None:
    """A profiler set after the watch: imports are timed again (``waiting`` is False), and no
    call comes."""
    seen: list[tuple[int, bool]] = []
    assert _mainstart.watch(note(seen))
    sys.setprofile(lambda frame, event, arg: None)
    assert not _mainstart.waiting()
    sys.setprofile(None)
    exec(compile("x = 1\n", "<program>", "exec"), {"__name__": "__main__"})
    assert seen == []


def test_runtime_init_goes_out_once_to_the_give_up_at_the_roots_end(monkeypatch) -> None:
    """The give-up only notes its time (it may come inside the hooks' own locked code); the
    root's end then emits runtime_init to it, once, marked as not having seen the program."""
    from hook_fakes import collecting

    from infersight.hooks import _coldstart, _recorder

    client, st = collecting(monkeypatch)
    st.coldstart.boot_ns = 10
    st.coldstart.init_pending.append(1_000)
    _coldstart._program_started(5_000, False)
    assert client.events == []  # nothing emitted inside the callback
    _recorder.end_runtime_init(0)  # the root's end
    _recorder.end_runtime_init(0)
    _coldstart._program_started(9_000, True)
    spans = [d for kind, d in client.events if kind == "span"]
    assert len(spans) == 1, spans
    (span,) = spans
    assert (span["s"], span["e"]) == (1, 5_000)
    assert span["a"]["infersight.runtime_init.program_start_seen"] is False
    assert span["a"]["infersight.runtime_init.after_hooks_s"] == 4_000 / 1e9


def test_a_watch_put_back_after_it_was_displaced_stays_over(no_profile) -> None:
    """A profiler that saved the watch, replaced it and puts it back (save-and-restore) once the
    program runs: the watch, found displaced by an import on its thread, is over. Put back, it
    takes itself out at its next call and says nothing; imports are timed (``waiting`` False)."""
    seen: list[tuple[int, bool]] = []
    assert _mainstart.watch(note(seen))
    saved = sys.getprofile()
    sys.setprofile(lambda frame, event, arg: None)
    assert not _mainstart.waiting()  # an import on the main thread asks: displaced, so over
    sys.setprofile(saved)  # the profiler restores what it found
    assert not _mainstart.waiting()
    exec(compile("x = 1\n", "<program>", "exec"), {"__name__": "__main__"})
    assert seen == [] and sys.getprofile() is None


def test_the_roots_end_ends_a_displaced_watch(no_profile, monkeypatch) -> None:
    """The root ended with the watch displaced (no import asked meanwhile): runtime_init goes out to
    the hooks' set-up, and the watch put back later takes itself out without a call."""
    from hook_fakes import collecting

    from infersight.hooks import _recorder

    client, st = collecting(monkeypatch)
    st.coldstart.boot_ns = 10
    st.coldstart.init_pending.append(1_000)
    seen: list[tuple[int, bool]] = []
    assert _mainstart.watch(note(seen))
    saved = sys.getprofile()
    sys.setprofile(None)
    _recorder.end_runtime_init(0)  # the root's end
    sys.setprofile(saved)
    exec(compile("x = 1\n", "<program>", "exec"), {"__name__": "__main__"})
    assert seen == [] and sys.getprofile() is None
    spans = [d for kind, d in client.events if kind == "span"]
    assert [(s["s"], s["e"]) for s in spans] == [(1, 1_000)]


@pytest.mark.parametrize(("gave_up", "end", "seen_attr"), [([], 1_000, None), ([5_000], 5_000, False)])
def test_a_checkpoint_carries_runtime_init_while_it_waits(monkeypatch, gave_up, end, seen_attr) -> None:
    """A process killed before its program's first frame (or with a watch that gave up or was
    displaced) never reaches the root's end: every checkpoint carries runtime_init as the root's end
    would emit it now, under the span id it will have, so the agent can close the root with it."""
    from hook_fakes import collecting

    from infersight.hooks import _checkpoint, _recorder

    client, st = collecting(monkeypatch)
    cs = st.coldstart
    cs.boot_ns = 10
    cs.init_span = "b" * 16
    cs.init_pending.append(1_000)
    cs.init_gave_up.extend(gave_up)
    (stage,) = [s for s in _checkpoint.open_stages() if s[0] == "runtime_init"]
    name, span, parent, start, stop, attrs = stage
    assert (span, parent, start, stop) == ("b" * 16, "a" * 16, 1, end)
    assert attrs.get("infersight.runtime_init.program_start_seen") is seen_attr
    _recorder.end_runtime_init(0)  # then emitted: the same span, the same extent
    (emitted,) = [d for kind, d in client.events if kind == "span"]
    assert (emitted["s"], emitted["e"]) == (start, stop) and emitted["id"] == span
    assert [s for s in _checkpoint.open_stages() if s[0] == "runtime_init"] == []


def test_a_paused_watch_still_waits_and_comes_back_unless_a_profiler_took_its_place(no_profile) -> None:
    """The bootstrap pauses the watch while the environment's own sitecustomize runs: still waiting (its
    imports are start-up), no profile calls meanwhile, and back after; a profiler set meanwhile displaced it."""
    seen: list[tuple[int, bool]] = []
    assert _mainstart.watch(note(seen))
    assert _mainstart.pause() and sys.getprofile() is None and _mainstart.waiting()
    assert not _mainstart.pause()  # once
    _mainstart.resume()
    assert _mainstart.waiting() and sys.getprofile() is not None
    assert _mainstart.pause()

    def other(frame, event, arg) -> None:  # type: ignore[no-untyped-def]
        return None

    sys.setprofile(other)  # the environment's sitecustomize sets a profiler
    _mainstart.resume()
    assert sys.getprofile() is other and not _mainstart.waiting()
    sys.setprofile(None)
    exec(compile("x = 1\n", "<program>", "exec"), {"__name__": "__main__"})
    assert seen == []


def test_a_paused_watch_waits_only_on_its_own_thread(no_profile) -> None:
    """A thread the environment's sitecustomize starts (an APM agent's) times its imports while the watch is
    paused: only the main thread is before its program's first line."""
    assert _mainstart.watch(note([]))
    assert _mainstart.pause()
    try:
        got: list[bool] = []
        t = threading.Thread(target=lambda: got.append(_mainstart.waiting()))
        t.start()
        t.join()
        assert got == [False] and _mainstart.waiting()
    finally:
        _mainstart.resume()
