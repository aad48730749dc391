"""Hook batch frames stay within the wire's bound, and values the host hands the hooks are made safe.

A frame over ``MAX_FRAME_BYTES`` is refused by the agent (the connection closes, the frame is resent at every
reconnect and every later event waits behind it); one value JSON cannot hold spoiled the whole batch and
disabled the drain thread. Here: frames are built by size, an event no frame can hold is dropped and counted
alone, and ``hooks.log``/``metric``/``emit`` convert what they are given on the caller's thread.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from infersight.hooks import _client, _wire


def _events(n: int, size: int, start: int = 1) -> list[Any]:
    return [(start + i, 1000 + i, "log", {"body": "x" * size, "sev": "INFO", "a": {}}) for i in range(n)]


def _payloads(frames: list[tuple[list[Any], bytes]]) -> list[dict[str, Any]]:
    out = []
    for events, frame in frames:
        assert _wire.frame_size(frame[:4]) == len(frame) - 4
        assert len(frame) - 4 <= _wire.MAX_FRAME_BYTES
        obj = json.loads(frame[4:])
        assert obj["n"] == len(obj["e"]) == len(events)
        assert obj["l"] == events[-1][0] == obj["e"][-1][0]
        assert _wire.batch_header(frame[4:]) == {"t": "b", "n": obj["n"], "l": obj["l"]}
        out.append(obj)
    return out


def test_big_events_are_split_into_frames_within_the_bound() -> None:
    """512 events of 4 KB (a 2 MB batch): several frames, each within the bound, all events in order."""
    events = _events(512, 4000)
    assert len(_wire.encode_batch(events)) > _wire.MAX_FRAME_BYTES  # what was sent before
    frames, bad = _wire.encode_batches(events)
    assert bad == []
    assert len(frames) >= 2
    seqs = [e[0] for obj in _payloads(frames) for e in obj["e"]]
    assert seqs == list(range(1, 513))


def test_small_batch_is_one_frame_as_before() -> None:
    events = _events(10, 10)
    frames, bad = _wire.encode_batches(events)
    assert bad == [] and len(frames) == 1 and frames[0][1] == _wire.encode_batch(events)


def test_an_event_too_large_alone_is_dropped_and_the_rest_sent() -> None:
    events = _events(3, 10) + [(4, 1, "span", {"n": "s", "a": {"big": "y" * (2 << 20)}})] + _events(3, 10, 5)
    frames, bad = _wire.encode_batches(events)
    assert [(ev[0], why) for ev, why, _ in bad] == [(4, "oversize")]
    assert [e[0] for obj in _payloads(frames) for e in obj["e"]] == [1, 2, 3, 5, 6, 7]


class _Raises:
    def __str__(self) -> str:
        raise RuntimeError("boom")

    __repr__ = __str__


def _cycle() -> dict[str, Any]:
    d: dict[str, Any] = {}
    d["self"] = d
    return d


def _deep() -> list[Any]:
    top: list[Any] = []
    cur = top
    for _ in range(100_000):
        nxt: list[Any] = []
        cur.append(nxt)
        cur = nxt
    return top


BAD = {
    "tuplekey": lambda: {(1, 2): 3},
    "cycle": _cycle,
    "deep": _deep,
    "bigint": lambda: 10**5000,
    "obj": _Raises,
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_event_in_a_batch_is_dropped_alone(case: str) -> None:
    """The drain thread's encoding falls back to event by event: the others go out."""
    if case == "bigint" and not hasattr(__import__("sys"), "get_int_max_str_digits"):
        pytest.skip("Python < 3.11 encodes any integer")
    events = _events(2, 10) + [(3, 1, "span", {"n": "s", "a": {"x": BAD[case]()}})] + _events(2, 10, 4)
    frames, bad = _wire.encode_batches(events)
    assert [ev[0] for ev, _why, _detail in bad] == [3]
    assert [e[0] for obj in _payloads(frames) for e in obj["e"]] == [1, 2, 4, 5]


@pytest.mark.parametrize("case", sorted(BAD))
def test_safe_value_makes_each_bad_case_encodable(case: str) -> None:
    v = _wire.safe_value({"x": BAD[case]()})
    text = _wire._dumps(v)  # the hooks' encoder takes it
    assert len(text) < 64 << 10
    assert isinstance(json.loads(text), dict)


def test_safe_value_bounds() -> None:
    cut = _wire.safe_value("z" * 10_000)
    kept = cut.index("...")
    assert cut == "z" * kept + "...[cut %d chars]" % (10_000 - kept) and len(cut) <= _wire.MAX_STR
    assert _wire.safe_value(2**70) == str(2**70)
    assert _wire.safe_value({1: (1, 2), None: {3}}) == {"1": [1, 2], "None": [3]}
    assert len(_wire.safe_value(list(range(10_000)))) == _wire.MAX_ITEMS
    big = {str(i): "w" * 4000 for i in range(128)}  # 512 Ki characters: cut near 64 Ki
    assert len(_wire._dumps(_wire.safe_value(big))) < 80 << 10
    flat = {"a": 1, "b": "s", "c": 2.5, "d": None, "e": True}
    assert _wire.safe_value(flat) == flat


def _make_client(tmp_path: Path) -> _client.Client:
    return _client.Client(str(tmp_path / "no-agent.sock"), str(tmp_path / "spool"), {"id": "t-1-1", "pid": 1},
                          batch_delay_s=3600)


def test_client_spools_only_frames_within_the_bound_and_counts_the_drop(tmp_path: Path, capfd: Any) -> None:
    """No agent: batches go to the spool. Every frame written there fits the bound; an event too large
    and an event that cannot be encoded are dropped, counted with the buffer's drops (reported to the
    agent), one stderr line per reason; the drain thread stays up."""
    (tmp_path / "spool").mkdir()
    c = _make_client(tmp_path)
    try:
        for i in range(600):
            c.emit("log", {"body": "b" * 4000, "sev": "INFO", "a": {"i": i}})
        c.emit("span", {"n": "s", "a": {"big": "y" * (2 << 20)}})
        c.emit("span", {"n": "s", "a": {"bad": _Raises()}})
        c.emit("span", {"n": "s", "a": {"bad": _Raises()}})
        c.emit("log", {"body": "after", "sev": "INFO", "a": {}})
        assert c.flush(10)
        assert c._thread.is_alive() and c.enabled
        assert c.unencodable == 3 and c.dropped_buffer == 3
        assert c._unreported()  # the count goes to the agent in a drops event
    finally:
        c.close()
    err = capfd.readouterr().err
    assert err.count("could not be sent") == 2, err  # oversize, RuntimeError: once each
    files = list((tmp_path / "spool").glob("*.spool"))
    assert files
    seqs: list[int] = []
    drops: list[Any] = []
    for f in files:
        data = f.read_bytes()
        pos = 0
        while pos < len(data):
            n = _wire.frame_size(data[pos:pos + 4])
            assert n <= _wire.MAX_FRAME_BYTES
            obj = json.loads(data[pos + 4:pos + 4 + n])
            pos += 4 + n
            for ev in obj.get("e", []):
                seqs.append(ev[0])
                if ev[2] == "drops":
                    drops.append(ev[3])
    assert 601 not in seqs and 602 not in seqs and 603 not in seqs
    assert set(range(1, 601)) <= set(seqs) and 604 in seqs
    assert drops and drops[-1]["buffer"] == 3


def test_hooks_log_converts_bad_values_on_the_callers_thread(monkeypatch: Any) -> None:
    """``hooks.log``/``metric``/``emit`` hand the buffer JSON-safe, bounded values."""
    from infersight import hooks
    from infersight.hooks import _runtime, _state

    got: list[tuple[str, Any]] = []

    class Fake:
        enabled = True

        def emit(self, kind: str, data: Any) -> None:
            got.append((kind, data))

    monkeypatch.setattr(_state.current.runtime, "client", Fake())
    for case in sorted(BAD):
        hooks.log("m", attr=BAD[case]())
        hooks.metric("m.bad", 1.0, attr=BAD[case]())
        hooks.emit("log", {"body": "x", "a": {"attr": BAD[case]()}})
    hooks.log("b" * 2_000_000, sev_obj=_Raises())
    hooks.metric(_Raises(), 10**5000)  # type: ignore[arg-type]
    flat = {"i": 1, "s": "short"}
    hooks.log("plain", **flat)
    assert got[-1][1]["a"] is not None and got[-1][1]["a"] == flat
    assert len(got) == 3 * len(BAD) + 3
    for _kind, data in got:
        text = _wire._dumps(data)
        assert len(text) < 128 << 10
        json.loads(text)
    big = [d for k, d in got if k == "log" and d["body"].startswith("bbb")][0]
    assert len(big["body"]) <= _wire.MAX_STR and big["body"].endswith("chars]")
    assert not _runtime.state().failed
    assert threading.current_thread() is threading.main_thread()
