"""The event loop's share per uid (agent/daemon/loop_share.py), on a clock the test moves."""

from __future__ import annotations

import asyncio

import pytest

from infersight.agent.daemon.health import Counters
from infersight.agent.daemon.loop_share import ACTIVE_S, BURST_S, HEADROOM, LoopShare

ATTACKER, VICTIM = 1001, 1002


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def share() -> tuple[LoopShare, Clock]:
    clock = Clock()
    return LoopShare(Counters(), clock), clock


def frame(s: LoopShare, uid: int, n: int, cost: float) -> None:
    s.settle(uid, n, s.reserve(uid, n), cost)


def test_a_lone_uid_is_never_paced() -> None:
    s, clock = share()
    for _ in range(50):
        frame(s, ATTACKER, 1 << 20, 0.1)
        clock.now += 0.01
    assert not s.over(ATTACKER)


def test_with_a_second_uid_sending_the_heavy_one_is_paced_and_the_light_one_is_not() -> None:
    s, clock = share()
    frame(s, VICTIM, 100, 0.0001)
    for _ in range(3):
        frame(s, ATTACKER, 1 << 20, 0.1)
    assert s.over(ATTACKER)
    assert not s.over(VICTIM)


def test_debt_decays_at_the_uids_share_of_the_loop() -> None:
    s, clock = share()
    frame(s, VICTIM, 100, 0.0)
    frame(s, ATTACKER, 1 << 20, 0.3)
    rate = (1 - HEADROOM) / 2
    clock.now += (0.3 - BURST_S) / rate - 0.01  # just short of back within the burst
    assert s.over(ATTACKER)
    clock.now += 0.02
    assert not s.over(ATTACKER)


def test_once_the_other_uid_is_quiet_for_active_s_the_heavy_one_goes_on() -> None:
    s, clock = share()
    frame(s, VICTIM, 100, 0.0)
    frame(s, ATTACKER, 1 << 20, 5.0)
    assert s.over(ATTACKER)
    clock.now += ACTIVE_S + 0.2
    frame(s, ATTACKER, 10, 0.0)  # only the attacker has sent since
    clock.now += 0.2
    assert not s.over(ATTACKER)


def test_root_is_not_paced_but_competes() -> None:
    s, clock = share()
    for _ in range(5):
        frame(s, 0, 1 << 20, 0.2)
    frame(s, ATTACKER, 1 << 20, 0.2)
    assert not s.over(0)
    assert s.over(ATTACKER)  # root is the other uid sending


def test_the_estimate_is_reserved_before_the_frame_so_connections_waking_together_do_not_all_pass() -> None:
    s, clock = share()
    frame(s, VICTIM, 100, 0.0)
    for _ in range(4):  # the attacker's cost per byte is learned: 0.1 s a MiB
        frame(s, ATTACKER, 1 << 20, 0.1)
    clock.now += 10  # its debt is gone; both still send
    frame(s, VICTIM, 100, 0.0)
    frame(s, ATTACKER, 10, 0.0)
    clock.now += 0.2
    assert not s.over(ATTACKER)
    s.reserve(ATTACKER, 1 << 20)  # a first connection takes its turn; the others test again
    assert s.over(ATTACKER)


def test_settling_corrects_a_wrong_estimate_both_ways() -> None:
    s, clock = share()
    frame(s, VICTIM, 100, 0.0)
    est = s.reserve(ATTACKER, 1000)
    assert est == 0.0  # nothing learned yet
    s.settle(ATTACKER, 1000, est, 0.5)  # a cheap-looking frame that was dear
    assert s.uses[ATTACKER].debt == pytest.approx(0.5)
    est = s.reserve(ATTACKER, 1000)
    s.settle(ATTACKER, 1000, est, 0.0)  # dear-looking, cheap: the reservation is given back
    assert s.uses[ATTACKER].debt == pytest.approx(0.5)


async def test_wait_ends_when_the_debt_has_decayed_and_is_counted() -> None:
    loop = asyncio.get_running_loop()
    s = LoopShare(Counters(), loop.time)
    frame(s, VICTIM, 100, 0.0)
    frame(s, ATTACKER, 1 << 20, BURST_S + 0.04)  # 40 ms over: 100 ms at 0.4 of the loop
    assert s.over(ATTACKER)
    started = loop.time()
    await asyncio.wait_for(s.wait(ATTACKER), 30)
    assert not s.over(ATTACKER)
    assert loop.time() - started >= 0.04 / ((1 - HEADROOM) / 2) - 0.01
    assert s.counters.frames_paced == 1


def test_the_table_forgets_quiet_uids_when_it_grows() -> None:
    s, clock = share()
    for uid in range(1000, 1400):
        frame(s, uid, 10, 0.0)
    clock.now += ACTIVE_S + 1
    frame(s, VICTIM, 10, 0.0)
    s.over(VICTIM)
    s.rate(clock.now)
    assert len(s.uses) <= 2


def test_the_agents_cpu_beyond_the_loop_time_is_laid_on_the_frames() -> None:
    clock, cpu = Clock(), [0.0]
    s = LoopShare(Counters(), clock, lambda: cpu[0])
    frame(s, VICTIM, 100, 0.0)
    for _ in range(5):  # 0.1 s of loop time a frame, and the exporters' 0.2 s more in threads
        clock.now += 0.11
        cpu[0] += 0.3
        frame(s, ATTACKER, 1 << 20, 0.1)
    assert 1.5 < s.scale <= 3.0
    before = s.uses[ATTACKER].debt
    frame(s, ATTACKER, 1 << 20, 0.1)
    assert s.uses[ATTACKER].debt - before > 0.1  # charged more than its loop time


def test_a_quiet_agents_housekeeping_does_not_inflate_the_factor() -> None:
    clock, cpu = Clock(), [0.0]
    s = LoopShare(Counters(), clock, lambda: cpu[0])
    for _ in range(10):  # tiny frames; the agent's timers and device sampling take the CPU
        clock.now += 0.2
        cpu[0] += 0.05
        frame(s, VICTIM, 100, 0.0001)
    assert s.scale == 1.0


def test_only_the_heaviest_uid_bears_the_scale() -> None:
    """CPU no frame is charged for (another user's status probes) raised one global factor for every
    uid: a victim using 15% of the loop was charged 60% against its 40% share, and paced."""
    clock, cpu = Clock(), [0.0]
    s = LoopShare(Counters(), clock, lambda: cpu[0])
    for _ in range(10):  # the attacker takes most of the loop; the agent burns 4x what frames are charged
        clock.now += 0.11
        cpu[0] += 0.4
        frame(s, ATTACKER, 1 << 20, 0.08)
        frame(s, VICTIM, 1000, 0.02)
    assert s.scale > 2 and s.heaviest == ATTACKER
    before = s.uses[VICTIM].debt
    frame(s, VICTIM, 1000, 0.02)
    assert s.uses[VICTIM].debt - before == pytest.approx(0.02, abs=0.005), "the victim pays its own loop time"
    before = s.uses[ATTACKER].debt
    frame(s, ATTACKER, 1 << 20, 0.08)
    assert s.uses[ATTACKER].debt - before > 0.15


def test_many_quiet_uids_do_not_shrink_a_busy_ones_share_below_half() -> None:
    s, clock = share()
    for uid in range(2000, 2008):  # eight quiet neighbours send a little
        frame(s, uid, 100, 0.0)
    frame(s, ATTACKER, 1 << 20, 0.0)
    clock.now += 0.2
    assert s.rate(clock.now) == pytest.approx((1 - HEADROOM) / 2)
