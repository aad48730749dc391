"""A socket that listens inside a stage rule's call is that call's machinery, never readiness
(``_readiness.check_listening``, ``rule_stage_closed``), even when the call returns while the
sampler thread is reading the kernel's tables, or holds them longer than the 0.1 s the
returning call waits for them (a loaded machine). The races are played step by step with a
FAKE listening watch; the real tables are the e2e test's (test_coldstart_rule_readiness)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hook_fakes import Emitted, collecting

from infersight.hooks import _readiness, _state

RPC = ("tcp", 40423)


class Watch:
    """FAKE ListenWatch: ``listening`` is what the tables show; ``during`` runs while they are read."""

    def __init__(self) -> None:
        self.listening: list[tuple[str, int]] = []
        self.foreign: set[tuple[str, int]] = set()
        self.during: Any = None
        self.absorbs = 0

    def poll(self) -> tuple[str, int] | None:
        if self.during is not None:
            self.during()
        seen = [s for s in self.listening if s not in self.foreign]
        return seen[0] if seen else None

    def absorb(self) -> int:
        self.absorbs += 1
        new = [s for s in self.listening if s not in self.foreign]
        self.foreign.update(new)
        return len(new)


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> tuple[Emitted, Watch]:
    client, st = collecting(monkeypatch)
    st.coldstart.watch_listen = True
    watch = st.coldstart.listen_watch = Watch()
    return client, watch


def ready_spans(client: Emitted) -> list[dict[str, Any]]:
    """The attributes of the ``ready_wait`` spans emitted."""
    return [a for a in client.stage_attrs() if a.get("infersight.stage") == "ready_wait"]


def test_a_call_returning_while_the_tables_are_read_leaves_its_socket_foreign(hooked: tuple[Emitted, Watch]) -> None:
    client, watch = hooked

    def whole_call() -> None:
        # The sampler thread, past its "inside a call?" check, stalls before it reads the
        # tables; meanwhile the main thread runs a whole rule call that listens. The call's
        # absorb cannot take the watch (held by the stalled poll) within its 0.1 s.
        _readiness.rule_stage_opened("b" * 16)
        watch.listening.append(RPC)  # the call's RPC server listens
        _readiness.rule_stage_closed()

    watch.during = whole_call
    _readiness.check_listening()
    watch.during = None
    assert ready_spans(client) == []
    assert RPC in watch.foreign
    _readiness.check_listening()  # the next tick: still not readiness
    assert ready_spans(client) == []
    watch.listening.append(("tcp", 8000))  # the server's own socket
    _readiness.check_listening()
    (ready,) = ready_spans(client)
    assert ready["server.port"] == 8000


def test_a_call_that_cannot_take_the_watch_leaves_the_absorb_to_the_next_poll(hooked: tuple[Emitted, Watch]) -> None:
    client, watch = hooked
    st = _state.current.coldstart
    _readiness.rule_stage_opened("b" * 16)
    watch.listening.append(RPC)
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:  # a poll stalled with the watch (a descheduled sampler thread)
        with st.listen_poll:
            held.set()
            release.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    _readiness.rule_stage_closed()  # waits 0.1 s for the watch, then owes the absorb
    release.set()
    t.join()
    assert st.rule_absorb_owed
    _readiness.check_listening()
    assert ready_spans(client) == [] and RPC in watch.foreign and not st.rule_absorb_owed
    watch.listening.append(("tcp", 8000))
    _readiness.check_listening()
    assert [r["server.port"] for r in ready_spans(client)] == [8000]


class RacingLock:
    """The watch's lock, with ``race`` run once just before a blocking acquire: another
    thread's poll that takes the watch first."""

    def __init__(self, race: Any) -> None:
        self.real = threading.Lock()
        self.race = race

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking and self.race is not None:
            race, self.race = self.race, None
            race()
        return self.real.acquire(blocking, timeout)

    def release(self) -> None:
        self.real.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_a_poll_that_takes_the_watch_before_the_returning_call_absorbs_first(hooked: tuple[Emitted, Watch]) -> None:
    """The call's thread has lowered the count and not yet taken the watch when the sampler
    thread polls: the poll sees no call running, and absorbs what is owed before it looks
    (a loaded CI run saw the RPC socket taken as readiness right as the call returned)."""
    client, watch = hooked
    st = _state.current.coldstart
    _readiness.rule_stage_opened("b" * 16)
    watch.listening.append(RPC)
    st.listen_poll = RacingLock(_readiness.check_listening)  # type: ignore[assignment]
    _readiness.rule_stage_closed()
    assert ready_spans(client) == [] and RPC in watch.foreign and not st.rule_absorb_owed
    assert watch.absorbs == 1, "the poll absorbed; the call's thread found nothing owed"
    watch.listening.append(("tcp", 8000))
    _readiness.check_listening()
    assert [r["server.port"] for r in ready_spans(client)] == [8000]


def test_without_the_owed_absorb_the_race_would_be_readiness(hooked: tuple[Emitted, Watch]) -> None:
    """The check can fail: a call that returns with nothing owed (what the count alone said
    before) leaves its socket for the next poll to take as readiness."""
    client, watch = hooked
    st = _state.current.coldstart
    st.rule_stages_open = 1
    watch.listening.append(RPC)
    st.rule_stages_open = 0  # returned; its absorb not run, and nothing owed
    _readiness.check_listening()
    assert [r["server.port"] for r in ready_spans(client)] == [RPC[1]]
