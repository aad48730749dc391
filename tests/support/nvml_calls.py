"""FAKE NVML helper: records, for every ``sample()`` of a fake NVML, which thread called it and
whether the device job's lock (the guard handed to the OOM handlers) was held."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class NvmlCalls:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, bool]] = []

    def guard(self, fn: Callable[[], Any]) -> Any:
        """What the device job's ``nvml_call`` does: the read under its lock."""
        with self.lock:
            return fn()

    def watch(self, nvml: Any) -> Any:
        """``nvml`` with its ``sample`` recording each call (the same object)."""
        sample = nvml.sample

        def recorded(index: int) -> Any:
            self.seen.append((threading.current_thread().name, self.lock.locked()))
            return sample(index)

        nvml.sample = recorded
        return nvml

    def off_this_thread_under_the_lock(self) -> bool:
        here = threading.current_thread().name
        return bool(self.seen) and all(name != here and held for name, held in self.seen)
