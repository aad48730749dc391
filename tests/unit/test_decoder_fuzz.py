"""Property tests: random input never crashes the decoder, and every bad event is counted."""

from __future__ import annotations

import json
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from infersight.agent.coldstart.assembly import coldstart_assembler
from infersight.agent.coldstart.metrics import ColdStartMetrics
from infersight.agent.daemon.broadcast import Broadcaster
from infersight.agent.daemon.health import Counters
from infersight.agent.daemon.ingest import Ingest
from infersight.hooks import _wire

HELLO = {"id": "p1", "pid": 1, "start_ns": 1, "trace_id": "a" * 32, "root_span_id": "b" * 16}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
    max_leaves=8,
)


def make() -> tuple[Ingest, Counters]:
    counters = Counters()
    assembler = coldstart_assembler("h", observers=[ColdStartMetrics().observe])  # as the cold-start extension does
    ingest = Ingest(assembler, Broadcaster([]), counters, {0}, {0}, dict)
    return ingest, counters


@given(st.binary(max_size=4096))
@settings(max_examples=300)
def test_random_bytes_never_crash_framing(data: bytes) -> None:
    frames, _rest, _bad = _wire.split_frames(data)
    for f in frames:
        _wire.decode_payload(f)


@given(st.lists(json_values, max_size=20))
@settings(max_examples=120, deadline=None)
def test_every_bad_event_is_counted(events: list) -> None:  # type: ignore[type-arg]
    ingest, counters = make()
    producer = ingest.assembler.hello(HELLO)
    ingest.process_batch(producer, events, deque(), lambda: None)
    # Every element is either accepted, a duplicate, or counted malformed.
    assert counters.events_in + counters.malformed_events + counters.duplicates == len(events)


@given(st.lists(st.tuples(st.integers(1, 50), st.sampled_from(["span", "log", "metric", "drops", "x"]),
                          st.dictionaries(st.sampled_from(["n", "v", "id", "s", "body", "a", "k"]), json_values),
                          ), max_size=20))
@settings(max_examples=120, deadline=None)
def test_structured_garbage_is_counted_not_raised(evs: list) -> None:  # type: ignore[type-arg]
    ingest, counters = make()
    producer = ingest.assembler.hello(HELLO)
    batch = [[seq, 1000, kind, data] for seq, kind, data in evs]
    ingest.process_batch(producer, json.loads(json.dumps(batch)), deque(), lambda: None)
    assert counters.events_in + counters.malformed_events + counters.duplicates == len(batch)


def test_valid_events_become_items() -> None:
    ingest, counters = make()
    p = ingest.assembler.hello(HELLO)
    items = ingest.assembler.events(p, [
        [1, 10, "log", {"body": "hello", "sev": "WARN", "a": {"k": 1}}],
        [2, 20, "metric", {"n": "m", "v": 2.5}],
        [3, 30, "span", {"n": "coldstart.warmup", "id": "c" * 16, "p": "b" * 16, "s": 25,
                         "a": {"infersight.stage": "warmup"}}],
        [4, 40, "span", {"n": "coldstart", "id": "b" * 16, "s": 5}],
        [5, 41, "span", {"n": "bad", "id": "xyz", "s": 5}],
    ])
    assert p.malformed == 1
    kinds = [type(i).__name__ for i in items]
    assert kinds[:5] == ["LogItem", "MetricItem", "SpanItem", "SpanItem", "ColdStart"]
    # A finished cold start also yields its fleet metrics (duration histogram, count).
    assert kinds[5:] and all(k == "MetricItem" for k in kinds[5:])
    assert {i.name for i in items[5:]} >= {"infersight.coldstart.duration"}  # type: ignore[union-attr]
    root = items[3]
    # 35 ns of root, 5 covered by warmup: 30 ns unattributed.
    assert abs(root.attributes["infersight.coldstart.unattributed_s"] - 30e-9) < 1e-15  # type: ignore[union-attr]


def test_wrong_schema_is_refused_clearly() -> None:
    ingest, counters = make()
    assert ingest.hello({"t": "hello", "schema": 99, "producer": HELLO}) is None
    assert counters.refused_schema == 1


def test_an_unattributed_span_never_counts_as_covered() -> None:
    ingest, _counters = make()
    p = ingest.assembler.hello(HELLO)
    items = ingest.assembler.events(p, [
        [1, 30, "span", {"n": "coldstart.warmup", "id": "c" * 16, "p": "b" * 16, "s": 10, "e": 20,
                         "a": {"infersight.stage": "warmup"}}],
        [2, 31, "span", {"n": "coldstart.unattributed", "id": "d" * 16, "p": "b" * 16, "s": 20, "e": 30,
                         "a": {"infersight.stage": "unattributed", "infersight.unattributed.top": ["m:f 100%"]}}],
        [3, 40, "span", {"n": "coldstart", "id": "b" * 16, "s": 0, "e": 40}],
    ])
    root = next(i for i in items if getattr(i, "name", "") == "coldstart")
    # 40 ns of root, 10 covered by warmup: 30 ns unattributed, the explained gap included.
    assert abs(root.attributes["infersight.coldstart.unattributed_s"] - 30e-9) < 1e-15  # type: ignore[union-attr]
