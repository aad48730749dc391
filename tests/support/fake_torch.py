"""A FAKE torch for CPU tests of hooks/_alloc.py. It is NOT PyTorch.

It implements only the calls that ``_alloc`` makes (``torch.cuda.is_initialized``,
``get_allocator_backend``, ``memory_stats_as_nested_dict``, ``memory_snapshot``,
``get_device_properties``, ``torch._C._cuda_attach_out_of_memory_observer``,
``torch._C._cuda_getMemoryFraction``), with numbers set by the test. ``oom(...)`` plays
what PyTorch's caching allocator does on an OOM: call every attached observer with
``(device, alloc, allowed_or_total, device_free)``, then raise ``OutOfMemoryError``.
"""

from __future__ import annotations

import types
from typing import Any

GIB = 1 << 30


class OutOfMemoryError(RuntimeError):
    """FAKE stand-in for torch.OutOfMemoryError."""


class FakeTorch(types.SimpleNamespace):
    def __init__(self, total: int = 16 * GIB, backend: str = "native", initialized: bool = True) -> None:
        self.initialized = initialized
        self.backend = backend
        self.total = total
        self.fraction = 1.0
        self.observers: list[Any] = []
        self.stats: dict[str, Any] = nested_stats()
        self.segments: list[dict[str, Any]] = []
        self.raise_in_stats = False
        fake = self
        cuda = types.SimpleNamespace(
            OutOfMemoryError=OutOfMemoryError,
            is_initialized=lambda: fake.initialized,
            get_allocator_backend=lambda: fake.backend,
            device_count=lambda: 1,
            get_device_properties=lambda d: types.SimpleNamespace(
                total_memory=fake.total, uuid="12345678-aaaa-bbbb-cccc-1234567890ab"
            ),
            memory_stats_as_nested_dict=fake._stats,
            memory_snapshot=lambda include_traces=True: list(fake.segments),
            memory=types.SimpleNamespace(),
        )
        c = types.SimpleNamespace(
            _cuda_attach_out_of_memory_observer=self.observers.append,
            _cuda_getMemoryFraction=lambda d: fake.fraction,
        )
        super().__init__(cuda=cuda, _C=c, OutOfMemoryError=OutOfMemoryError, __name__="torch")

    def _stats(self, dev: int) -> dict[str, Any]:
        if self.raise_in_stats:
            raise RuntimeError("FAKE: memory_stats failed")
        return self.stats

    def oom(self, alloc: int, free: int, text: str = "", dev: int = 0) -> None:
        """What the native allocator does on an OOM: observers, then the exception."""
        third = int(self.total * self.fraction) if self.fraction < 1.0 else self.total
        for obs in self.observers:
            obs(dev, alloc, third, free)
        raise OutOfMemoryError(text or "CUDA out of memory. Tried to allocate %d bytes." % alloc)


def nested_stats(
    allocated: int = 0, reserved: int = 0, active: int | None = None, inactive_split: int = 0,
    retries: int = 0, device_alloc: int = 0, device_free: int = 0, ooms: int = 0,
) -> dict[str, Any]:
    """memory_stats_as_nested_dict's shape for the keys _alloc reads."""
    act = allocated if active is None else active
    return {
        "allocated_bytes": {"all": {"current": allocated, "peak": allocated}},
        "reserved_bytes": {"all": {"current": reserved, "peak": reserved}},
        "active_bytes": {"all": {"current": act, "peak": act}},
        "inactive_split_bytes": {"all": {"current": inactive_split, "peak": inactive_split}},
        "num_alloc_retries": retries,
        "num_device_alloc": device_alloc,
        "num_device_free": device_free,
        "num_ooms": ooms,
    }
