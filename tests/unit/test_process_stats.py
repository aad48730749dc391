"""The agent's own CPU seconds and RSS (``process.cpu.time``, ``process.memory.usage``)."""

from __future__ import annotations

import os
import resource

import psutil

from infersight.agent.daemon.health import ProcessStats


def test_cpu_and_rss_are_this_process_s() -> None:
    stats = ProcessStats()
    cpu0, rss = stats.sample()
    sum(range(3_000_000))  # some CPU
    cpu1, _ = stats.sample()
    assert cpu1 > cpu0 > 0
    ref = psutil.Process(os.getpid()).memory_info().rss
    assert abs(rss - ref) < max(ref // 10, 8 << 20)
    assert rss <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + (8 << 20)


def test_without_proc_it_falls_back_to_psutil() -> None:
    stats = ProcessStats()
    stats._statm = False
    _, rss = stats.sample()
    assert abs(rss - psutil.Process(os.getpid()).memory_info().rss) < (8 << 20)
