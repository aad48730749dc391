"""What the OOM feature reads of NVML, as protocols: the devices feature's ``Nvml`` and its
samples satisfy them (``kind`` classifies with them, ``engine_context`` places an engine's
processes on its devices), and neither module imports the devices feature."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

_T = TypeVar("_T")


class GpuProcessView(Protocol):
    """What an OOM reads of one process on a device (the devices feature's ``GpuProcess``)."""

    @property
    def host_pid(self) -> int: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def used_bytes(self) -> int | None: ...


class DeviceView(Protocol):
    """What an OOM reads of one NVML sample of a device (the devices feature's ``DeviceSample``)."""

    @property
    def uuid(self) -> str | None: ...
    @property
    def memory_total_bytes(self) -> int | None: ...
    @property
    def processes(self) -> Sequence[GpuProcessView] | None: ...


class NvmlLike(Protocol):
    """NVML as the commands hand it in (the devices feature's ``Nvml``)."""

    def sample(self, index: int) -> DeviceView | None: ...

    def device_count(self) -> int: ...


class NvmlGuard(Protocol):
    """Runs NVML reads under the lock that keeps them and nvmlShutdown apart (the device job's
    ``nvml_call``); None once NVML is shut down."""

    def __call__(self, fn: Callable[[], _T]) -> _T | None: ...
