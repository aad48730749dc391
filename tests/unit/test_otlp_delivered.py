"""The memory of items that went out while their batch failed (exporters/otlp_delivered.py)."""

from __future__ import annotations

import dataclasses

from otlp_samples import make_logs, make_spans

from infersight.exporters.otlp_delivered import DeliveredItems, item_digest


def test_a_regrouped_retry_skips_exactly_what_went_out():
    mem = DeliveredItems()
    sent, later = make_spans(3), make_spans(2)
    mem.remember(sent, now=0.0)
    send, skipped = mem.split([*later[:1], *sent, *later[1:]], now=1.0)
    assert send == later  # in their order
    assert len(skipped) == len(sent)


def test_items_of_the_same_content_are_counted_not_merged():
    """Two batches' log records of the same content: those of the batch that went out are skipped, the others
    are sent (a set of digests would have skipped all four: a loss)."""
    mem = DeliveredItems()
    mem.remember(make_logs(), now=0.0)
    send, skipped = mem.split([*make_logs(), *make_logs()], now=1.0)
    assert len(send) == 2 and len(skipped) == 2


def test_content_decides_not_ids():
    mem = DeliveredItems()
    span = make_spans(0)[0]
    mem.remember([span], now=0.0)
    other = dataclasses.replace(span, attributes={**span.attributes, "ok": False})  # same ids, other content
    assert item_digest(other) != item_digest(span)
    assert mem.split([other], now=1.0) == ([other], [])


def test_forgotten_after_the_batch_went_out_whole():
    mem = DeliveredItems()
    spans = make_spans(1)
    mem.remember(spans, now=0.0)
    _, skipped = mem.split(spans, now=1.0)
    mem.forget(skipped)
    assert len(mem) == 0
    assert mem.split(spans, now=2.0) == (spans, [])  # a later export of the same items is its own


def test_ttl_and_bound_forget_the_oldest_and_a_failed_retry_keeps_them():
    mem = DeliveredItems(max_items=4, ttl_s=10.0)
    old, new = make_spans(1), make_spans(1)
    mem.remember(old, now=0.0)
    mem.remember(new, now=8.0)
    assert mem.split([*old, *new], now=11.0) == ([*old], [item_digest(it) for it in new])  # old expired
    kept = make_spans(1)
    mem.remember(kept, now=12.0)
    _, skipped = mem.split(kept, now=19.0)
    mem.touch(skipped, now=19.0)  # the retry failed again: kept for another ttl
    assert mem.split(kept, now=25.0)[0] == []
    mem.remember(make_spans(3), now=26.0)  # over the bound: the oldest go first
    assert len(mem) == 4
    assert mem.split(kept, now=26.0)[0] == kept
