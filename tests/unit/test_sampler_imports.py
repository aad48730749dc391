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
    ships: list[int] = []
    th = threading.Thread(target=work)
    th.start()
    s = _sampler.Sampler(th.ident or 0, interval_s=0.01, tick=lambda: ticks.append(time.time_ns()),
                         in_import=lambda: importing[0], ship=lambda: ships.append(time.time_ns()))
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
    # The checkpoint keeps TICK_S inside the import: a process SIGKILLed there loses at most
    # about that much of its samples (issue 23, point 2). No two ships closer than half of it.
    in_ships = [t for t in ships if marks["import_start"] <= t < marks["import_end"]]
    assert len(in_ships) > in_import and len(in_ships) >= 6  # 12 on an idle machine
    assert all(b - a >= 0.04e9 for a, b in zip(ships, ships[1:]))
    # no stretch of the import without a ship (a bound for a loaded machine, not a speed)
    edges = [marks["import_start"], *in_ships, marks["import_end"]]
    assert max(b - a for a, b in zip(edges, edges[1:])) < 0.8e9
