"""Cold-start state had a bound per producer only (8 MiB of pending stages, and a checkpoint beside
it): one uid's 1024 producers (ids are free, closing connections gets round the connection cap) held
about 10 GiB. Now each uid holds at most a quarter of the total; past it only that uid's new state is
refused (counted), and another uid's producer keeps its stages and checkpoint."""

from __future__ import annotations

from typing import Any

from infersight.agent.coldstart.assembly import (
    DEFAULT_MAX_PENDING_BYTES,
    ColdStartAssembly,
    coldstart_assembler,
    state_of,
)
from infersight.agent.daemon.assemble import Assembler, Producer

S = 1_000_000_000
BIG = {"k%03d" % j: "v" * 4000 for j in range(120)}  # about 0.5 MB as span_bytes counts it
SHARE = 16 << 20  # a quarter of the 64 MiB total


def hello(a: Assembler, n: int, uid: int | None) -> Producer:
    return a.hello({"id": "p%d" % n, "pid": 100 + n, "start_ns": S, "trace_id": "%032x" % (n + 1),
                    "root_span_id": "%016x" % (n + 1)}, uid)


def big_stages(a: Assembler, p: Producer, count: int) -> None:
    for k in range(count):
        a.events(p, [[k + 1, 2 * S, "span", {"n": "coldstart.s%d" % k, "id": "%016x" % (k + 7),
                                             "p": p.info["root_span_id"], "s": S, "e": 2 * S, "a": BIG}]])


def cs(a: Assembler) -> ColdStartAssembly:
    h = a.span_handlers[0]
    assert isinstance(h, ColdStartAssembly)
    return h


def held(ps: list[Producer]) -> int:
    return sum(state_of(p).pending_bytes + state_of(p).checkpoint_bytes for p in ps)


def test_one_uids_many_producers_stay_within_its_share_and_another_uid_keeps_its_stages() -> None:
    a = coldstart_assembler("h")
    flood = [hello(a, n, 1003) for n in range(12)]
    for p in flood:
        big_stages(a, p, 18)  # 18 x 0.5 MB: past one producer's own bound, as the review sent
    assert held(flood) <= SHARE, held(flood)  # was 12 x 8 MiB
    victim = hello(a, 100, 1002)
    big_stages(a, victim, 4)
    assert len(state_of(victim).pending) == 4  # another uid's full share takes nothing from it
    st = a.stats()
    assert st["pending_stages_refused_uid_budget"] > 0
    assert st["pending_stages_dropped"] >= st["pending_stages_refused_uid_budget"]
    assert st["pending_bytes"] == held(flood) + state_of(victim).pending_bytes


def test_one_producer_keeps_its_own_bound_and_root_is_aside() -> None:
    a = coldstart_assembler("h")
    own = hello(a, 1, 1003)
    big_stages(a, own, 18)
    assert DEFAULT_MAX_PENDING_BYTES - (1 << 20) < state_of(own).pending_bytes <= DEFAULT_MAX_PENDING_BYTES
    roots = [hello(a, 10 + n, 0) for n in range(4)]
    for p in roots:
        big_stages(a, p, 18)
    assert held(roots) > SHARE  # root's producers have no share
    assert a.stats()["pending_stages_refused_uid_budget"] == 0


def test_checkpoints_count_in_the_share() -> None:
    a = coldstart_assembler("h")
    flood = [hello(a, n, 1003) for n in range(16)]
    for i, p in enumerate(flood):
        for half in range(2):  # 3600 distinct 512-character labels: about 2 MB each producer
            labels = ["%d-%d-%s%04d" % (i, half, "L" * 500, j) for j in range(1800)]
            tick: dict[str, Any] = {"open": [], "t": list(range(1800)), "i": list(range(1800)), "l": labels}
            a.events(p, [[half + 1, 2 * S, "cs_tick", tick]])
    assert held(flood) <= SHARE, held(flood)
    assert a.stats()["coldstart_ticks_refused_uid_budget"] > 0
    victim = hello(a, 100, 1002)
    a.events(victim, [[1, 2 * S, "cs_tick", {"open": [], "t": [1, 2], "i": [0, 0], "l": ["main"]}]])
    assert state_of(victim).checkpoint is not None and len(state_of(victim).checkpoint.times) == 2


def test_the_share_comes_back_when_a_producer_ends_or_is_forgotten() -> None:
    a = coldstart_assembler("h")
    first = [hello(a, n, 1003) for n in range(3)]
    for p in first:
        big_stages(a, p, 18)
    assert held(first) > SHARE - DEFAULT_MAX_PENDING_BYTES  # the third is cut short
    a.producer_lost(first[0])  # its root is closed for it: its state freed
    cs(a).forget(first[1])
    later = hello(a, 50, 1003)
    big_stages(a, later, 8)
    assert len(state_of(later).pending) == 8
