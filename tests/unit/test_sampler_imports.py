"""The cold-start sampler inside an import (issue 23): the import run covers that time, so its
samples explain no gap; each wake-up takes the GIL from the busy main thread, so a long import
is sampled ever more sparsely (down to one wake-up per TICK_S) and ticks every IMPORT_TICK_S;
out of it, the base interval and TICK_S again."""

from __future__ import annotations

import importlib
import threading
import time

import pytest

from infersight.hooks import _sampler


def test_the_cold_starts_sampler_reads_the_import_timings_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """What 'inside an import' means: the main thread's stack of the import timing (the time
    its run covers), not any frame of the import machinery (a plugin's ``exec_module`` is
    untimed: its gap is sampled at the full rate)."""
    from infersight.hooks import _coldstart, _state

    hs = _state.HookState()
    hs.main_ident = threading.get_ident()
    monkeypatch.setattr(_state, "current", hs)
    started: list[_sampler.Sampler] = []

    def start(self: _sampler.Sampler) -> None:  # no thread: the signal only
        started.append(self)

    monkeypatch.setattr(_sampler.Sampler, "start", start)
    _coldstart._start_sampler()
    s = started[0]
    assert s.in_import is not None and s.in_import() is False
    hs.imports.main.stack.append("torch")  # _imports pushed the package being executed
    assert s.in_import() is True


def test_a_long_import_is_sampled_sparsely_and_still_ticks(tmp_path, monkeypatch) -> None:
    (tmp_path / "probe_mod_slow.py").write_text("import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1.2:\n"
                                                "    time.sleep(0.001)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    marks: dict[str, int] = {}
    importing = [False]  # the import timing's stack for that thread, as _coldstart gives it

    def work() -> None:
        marks["import_start"] = time.time_ns()
        importing[0] = True
        importlib.import_module("probe_mod_slow")
        importing[0] = False
        marks["import_end"] = time.time_ns()
        t = time.monotonic()
        while time.monotonic() - t < 0.4:
            time.sleep(0.001)
        marks["end"] = time.time_ns()

    ticks: list[int] = []
    th = threading.Thread(target=work)
    th.start()
    s = _sampler.Sampler(th.ident or 0, interval_s=0.01, tick=lambda: ticks.append(time.time_ns()),
                         in_import=lambda: importing[0])
    s.start()
    th.join()
    s.stop()
    inside = [t for t, _lab in s.samples if marks["import_start"] <= t < marks["import_end"]]
    after = [t for t, _lab in s.samples if marks["import_end"] <= t < marks["end"]]
    assert s.slowed > 0
    assert len(inside) <= 25  # 120 at the base interval
    assert len(after) >= 15  # the base interval again (40 on an idle machine)
    assert len(after) * 1.2 > len(inside) * 0.4  # per second: sparser inside than after
    in_import = sum(1 for t in ticks if marks["import_start"] <= t < marks["import_end"])
    # every IMPORT_TICK_S (0.3 s; at least 0.25 s apart, whatever the load): 12 at TICK_S
    assert 2 <= in_import <= 1.2 / (_sampler.IMPORT_TICK_S - 0.05) + 1
    after_ticks = sum(1 for t in ticks if marks["import_end"] <= t < marks["end"])
    assert after_ticks >= 2  # every TICK_S again (4 on an idle machine)


class _VirtualClock:
    """Stands in for the sampler's ``time`` module: ``sleep`` advances the clock at once, so
    the cadence is the code's, not the machine's."""

    def __init__(self) -> None:
        self.t = 0.0

    def sleep(self, dt: float) -> None:
        self.t += dt

    def monotonic(self) -> float:
        return self.t

    def time_ns(self) -> int:
        return int(self.t * 1e9)


def test_the_checkpoint_keeps_its_tick_inside_an_import_and_the_readiness_tick_slows(monkeypatch) -> None:
    """Inside an import the readiness and supervisor tick runs every IMPORT_TICK_S, but the
    checkpoint (``ship``) keeps TICK_S: a process SIGKILLed there loses at most about that much
    of its samples (issue 23, point 2). Driven by a virtual clock, on this thread."""
    clock = _VirtualClock()
    monkeypatch.setattr(_sampler, "time", clock)
    ticks: list[float] = []
    ships: list[float] = []
    s = _sampler.Sampler(threading.get_ident(), interval_s=0.01, tick=lambda: ticks.append(clock.t),
                         ship=lambda: ships.append(clock.t))

    def importing() -> bool:  # 0-1.2 s inside an import, then out of it until 1.6 s
        if clock.t >= 1.6:
            s.stop()
        return clock.t < 1.2

    s.in_import = importing
    s._run()
    in_ships = [t for t in ships if t < 1.2]
    in_ticks = [t for t in ticks if t < 1.2]
    assert len(in_ships) >= 10  # every TICK_S (0.1 s) inside the import, once the interval has grown
    assert all(b - a <= 2 * _sampler.TICK_S for a, b in zip([0.0, *in_ships], in_ships))
    assert all(b - a >= _sampler.TICK_S / 2 for a, b in zip(ships, ships[1:]))  # never more often
    assert len(in_ticks) <= 1.2 / (_sampler.IMPORT_TICK_S - _sampler.TICK_S / 2) + 1  # the slow tick
    assert len([t for t in ticks if 1.2 <= t < 1.6]) >= 3  # every TICK_S again out of the import
    assert s.ships == len(ships) and s.ticks == len(ticks)
