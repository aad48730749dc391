"""The bytes of large frames being read: a share per uid, a total, waits that end and waits that fail."""

from __future__ import annotations

import asyncio

from infersight.agent.daemon.frame_budget import SMALL_FRAME_BYTES, FrameBudget, FrameShare
from infersight.agent.daemon.health import Counters

MIB = 1 << 20
WAIT = 30.0  # a wait that must end by a give_back, never by its timeout (a loaded machine is slow)


def budget(total: int = 8 * MIB, per_uid: int = 2 * MIB) -> FrameBudget:
    return FrameBudget(Counters(), total=total, per_uid=per_uid)


def test_only_frames_beyond_the_streams_own_buffering_take_from_it() -> None:
    assert not FrameShare.needs(SMALL_FRAME_BYTES)
    assert FrameShare.needs(SMALL_FRAME_BYTES + 1)


async def test_a_uid_past_its_share_waits_and_another_uid_does_not() -> None:
    b = budget()
    assert await b.take(1001, MIB, WAIT) and await b.take(1001, MIB, WAIT)  # the attacker's share is full
    victim = asyncio.ensure_future(b.take(1002, MIB, WAIT))
    attacker = asyncio.ensure_future(b.take(1001, MIB, WAIT))
    await asyncio.sleep(0.05)
    assert victim.done() and victim.result()  # another uid's frame is read at once
    assert not attacker.done()  # the attacker's third frame waits for its own first two
    b.give_back(1001, MIB)
    assert await asyncio.wait_for(attacker, WAIT)
    assert b.by_uid == {1001: 2 * MIB, 1002: MIB} and b.in_flight == 3 * MIB
    assert b.counters.frames_waited_budget == 1 and b.counters.over_frame_budget == 0


async def test_a_wait_past_the_timeout_is_refused_and_counted() -> None:
    b = budget()
    await b.take(1001, 2 * MIB, WAIT)
    assert not await b.take(1001, MIB, 0.05)
    assert b.counters.frames_waited_budget == 1 and b.counters.over_frame_budget == 1
    assert b.in_flight == 2 * MIB  # the refused frame took nothing


async def test_the_total_bounds_every_uid_together_and_root_has_no_share() -> None:
    b = budget(total=4 * MIB, per_uid=2 * MIB)
    assert await b.take(0, 3 * MIB, WAIT)  # root: past a uid's share, within the total
    assert await b.take(1001, MIB, WAIT)
    assert not await b.take(1002, MIB, 0.05)  # the total is full
    b.give_back(0, 3 * MIB)
    assert await b.take(1002, MIB, 0.05)
    assert b.in_flight == 2 * MIB and 0 not in b.by_uid


async def test_every_waiter_tests_again_at_a_give_back() -> None:
    b = budget(total=2 * MIB, per_uid=2 * MIB)
    await b.take(1001, 2 * MIB, WAIT)
    big = asyncio.ensure_future(b.take(1002, 2 * MIB, WAIT))
    small = asyncio.ensure_future(b.take(1003, MIB, WAIT))
    await asyncio.sleep(0.01)
    b.give_back(1001, MIB)  # room for the small frame only
    assert await asyncio.wait_for(small, WAIT)
    await asyncio.sleep(0.01)
    assert not big.done()
    b.give_back(1001, MIB)
    b.give_back(1003, MIB)
    assert await asyncio.wait_for(big, WAIT)
    assert b.by_uid == {1002: 2 * MIB}


async def test_a_share_says_when_its_wait_failed() -> None:
    b = budget(per_uid=MIB)
    refused: list[int] = []
    share = FrameShare(b, 1001, lambda: 0.05, refused.append)
    assert await share.take(MIB)
    assert not await share.take(MIB)
    assert refused == [1001]
    share.give_back(MIB)
    assert b.in_flight == 0 and b.by_uid == {}
