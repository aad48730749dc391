"""Span ids come from a per-process pool, drawn from the OS 256 at a time; never the all-zero id."""

from __future__ import annotations

import pytest

from infersight.hooks import _runtime


def _bits(n: int) -> bytes:
    """A draw of all zero bytes but one id."""
    return bytes(n - 8) + bytes.fromhex("0000000000000abc")


def test_an_all_zero_span_id_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runtime, "_random_bytes", _bits)
    monkeypatch.setattr(_runtime, "span_ids", [])
    first = _runtime.draw_span_ids()
    assert [first, *_runtime.span_ids] == ["0000000000000abc"]


def test_a_draw_fills_the_pool_with_distinct_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runtime, "span_ids", [])
    ids = [_runtime.draw_span_ids(), *_runtime.span_ids]
    assert len(ids) == len(set(ids)) == 256
    assert all(len(i) == 16 and int(i, 16) for i in ids)


def test_a_forked_child_drops_the_pool_it_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runtime, "span_ids", [])
    _runtime.draw_span_ids()
    inherited = set(_runtime.span_ids)
    _runtime.reseed()
    assert _runtime.span_ids == []
    assert _runtime.draw_span_ids() not in inherited
