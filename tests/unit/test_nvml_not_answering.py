"""NVML calls that do not return (a driver that stopped answering), in-process: what waits for them
and what does not. NVML is a FAKE here (a ``sample`` that blocks on an event); the real agent
against the FAKE C library is ``tests/e2e/test_devices_nvml_hang.py``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

from infersight.agent.daemon.assemble import Assembler
from infersight.agent.daemon.offloop import in_daemon_thread, within
from infersight.agent.devices import job as job_mod
from infersight.agent.devices.job import DeviceJob
from infersight.agent.devices.nvml import DeviceSample
from infersight.agent.oom import kind as oom_kind
from infersight.telemetry import Item, LogItem

GIB = 1 << 30


class BlockedNvml:
    """FAKE NVML whose every sample blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def device_count(self) -> int:
        return 1

    def sample(self, index: int) -> DeviceSample | None:
        self.entered.set()
        self.release.wait(30)
        return DeviceSample(time_ns=time.time_ns(), index=index, uuid="GPU-aaaa", name="FAKE GPU",
                            memory_total_bytes=80 * GIB, processes=())


async def _published(items: list[Item], timeout_s: float = 10.0) -> None:
    """Until the OOM finished off the event loop published its items (at most ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not items and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def test_an_oom_goes_out_without_an_nvml_read_that_does_not_return(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oom_kind, "NVML_READ_WAIT_S", 0.3)
    nvml = BlockedNvml()
    published: list[Item] = []
    h = oom_kind.OomHandlers(oom_kind.OomClassifier([]), nvml, publish=published.extend)
    asm = Assembler("host", {"oom": h.oom, "mem": h.mem})
    p = asm.hello({"id": "p-1", "pid": 4242, "start_ns": 1, "trace_id": "cd" * 16, "root_span_id": "ef" * 8})
    event = {"source": "observer", "dev": 0, "req": 4 * GIB, "total": 80 * GIB, "free": GIB,
             "stats": {"allocated": 10 * GIB, "reserved": 10 * GIB}, "uuid": "GPU-aaaa"}
    try:
        asm.events(p, [[1, 10, "oom", event]])  # needs NVML's per-process view: finished off the loop
        await _published(published)
        (log,) = [i for i in published if isinstance(i, LogItem)]
        assert nvml.entered.is_set()  # the read began, and did not return
        assert not log.attributes.get("infersight.oom.nvml")  # classified without NVML's view
        assert h.nvml_late == 1
    finally:
        nvml.release.set()


def test_other_reads_give_up_while_nvml_is_not_answering(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_mod, "NVML_LOCK_WAIT_S", 0.1)
    job = DeviceJob(nvml=None, enabled=False)
    calls: list[int] = []
    assert job.nvml_call(lambda: calls.append(1) or 7) == 7
    job.hung_since = time.monotonic()  # a sample is out and has not returned
    assert job.nvml_call(lambda: calls.append(2)) is None
    job.hung_since = None
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(30)

    holder = threading.Thread(target=lambda: job.nvml_call(hold))
    holder.start()
    try:
        assert holding.wait(30)
        assert job.nvml_call(lambda: calls.append(3)) is None  # the read in progress held the lock past the wait
    finally:
        release.set()
        holder.join()
    loop = asyncio.new_event_loop()
    try:
        job._init = loop.create_future()  # nvmlInit is out: a read would wait on it
        assert job.nvml_call(lambda: calls.append(4)) is None
    finally:
        job._init = None
        loop.close()
    assert calls == [1] and job.reads_given_up == 3
    health = job.health()
    assert health["hung_s"] is None and health["hangs"] == 0


async def test_a_late_sample_is_waited_for_once_and_its_return_ends_the_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml: Any = BlockedNvml()
    nvml.sample_all = lambda: [nvml.sample(0)]
    job = DeviceJob(nvml=nvml)
    job.sample_wait_s = 0.2
    started: list[int] = []
    real = job._sample

    def counted() -> list[DeviceSample]:
        started.append(1)
        return real()

    monkeypatch.setattr(job, "_sample", counted)
    assert await job._sample_within() == []  # late: the interval goes on without
    assert job.hung_since is not None and job.hangs == 1
    health = job.health()
    assert health["available"] is False and health["reason"] == job_mod.HUNG_REASON and health["hung_s"] > 0
    waits: list[float] = []
    real_within = job_mod.within

    async def recorded(fut: Any, timeout_s: float) -> Any:
        waits.append(timeout_s)
        return await real_within(fut, timeout_s)

    monkeypatch.setattr(job_mod, "within", recorded)
    assert await job._sample_within() == []  # still out: no second call beside it, and no second wait for it
    assert len(started) == 1 and job.hangs == 1 and waits == [0.0]
    nvml.release.set()
    fut = job._sampling
    assert fut is not None
    await asyncio.wait({fut}, timeout=30)
    (s,) = await job._sample_within()  # the late one is taken: the hang is over
    assert s.uuid == "GPU-aaaa" and job.hung_since is None and len(started) == 1
    assert job.health()["reason"] is None


async def test_an_event_watcher_that_starts_late_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its start timed out: the thread it starts once it returns must not run unwatched (status said no watcher,
    and nvmlShutdown would free its event set under it)."""
    from infersight.agent.devices.nvml import NvmlStatus

    release = threading.Event()
    made: list[Any] = []

    class SlowWatcher:  # FAKE XidWatcher: a start that takes longer than the job waits
        def __init__(self, *_a: object) -> None:
            self.stop_called = threading.Event()
            made.append(self)

        def start(self) -> bool:
            release.wait(30)
            return True

        def request_stop(self) -> None:
            self.stop_called.set()

    class ReadyNvml:  # FAKE NVML: answers its start
        def status(self) -> NvmlStatus:
            return NvmlStatus(True, driver_version="0.0.fake", device_count=1)

    monkeypatch.setattr(job_mod, "XidWatcher", SlowWatcher)
    job = DeviceJob(nvml=ReadyNvml())  # type: ignore[arg-type]
    job.sample_wait_s = 0.2
    try:
        await job._start_nvml(None)  # type: ignore[arg-type]
        assert job.status is not None and job.status.available and job.watcher is None
        (w,) = made
        assert w.stop_called.is_set()
    finally:
        release.set()
def test_a_call_that_never_returns_does_not_keep_the_process_from_exiting() -> None:
    """asyncio.to_thread's pool threads are joined at exit: a call stuck in a driver kept the agent alive."""
    code = textwrap.dedent("""
        import asyncio, threading
        from infersight.agent.daemon.offloop import in_daemon_thread, within

        async def main():
            done, _ = await within(in_daemon_thread(threading.Event().wait, "stuck"), 0.1)
            print("done" if done else "late")

        asyncio.run(main())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert (r.returncode, r.stdout.strip()) == (0, "late"), r.stderr


async def test_a_daemon_call_hands_back_its_result_and_its_exception() -> None:
    assert await within(in_daemon_thread(lambda: 42, "t"), 5) == (True, 42)

    def fails() -> None:
        raise OSError("driver")

    with pytest.raises(OSError, match="driver"):
        await within(in_daemon_thread(fails, "t"), 5)


class TotalOnlyNvml:
    """FAKE NVML that answers with the device's total and no process of this producer (a container's PIDs)."""

    def device_count(self) -> int:
        return 1

    def sample(self, index: int) -> DeviceSample | None:
        return DeviceSample(time_ns=time.time_ns(), index=index, uuid="GPU-aaaa", name="FAKE GPU",
                            memory_total_bytes=80 * GIB, processes=())


async def test_the_devices_total_from_nvml_is_kept_though_the_process_is_not_placed() -> None:
    """The read off the loop works on a copy of the OOM's numbers; what it found (the total) is kept when it came
    back in time, whether or not this process was among NVML's (a 90 GiB request on an 80 GiB device)."""
    published: list[Item] = []
    h = oom_kind.OomHandlers(oom_kind.OomClassifier([]), TotalOnlyNvml(), publish=published.extend)
    asm = Assembler("host", {"oom": h.oom, "mem": h.mem})
    p = asm.hello({"id": "p-1", "pid": 4242, "start_ns": 1, "trace_id": "cd" * 16, "root_span_id": "ef" * 8})
    event = {"source": "observer", "dev": 0, "req": 90 * GIB, "free": GIB, "uuid": "GPU-aaaa",
             "stats": {"allocated": 0, "reserved": 0}}
    asm.events(p, [[1, 10, "oom", event]])
    await _published(published)
    (log,) = [i for i in published if isinstance(i, LogItem)]
    assert log.attributes["infersight.oom.T_bytes"] == 80 * GIB
    assert log.attributes["infersight.oom.class"] == "capacity"
    assert h.nvml_late == 0


async def test_calls_out_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """One OS thread per call: while calls do not return (a storm of OOMs, NVML hung), at most MAX_CALLS_OUT are
    out; the next is refused at once (its OOM goes out without NVML), and a returned call frees its place."""
    from infersight.agent.daemon import offloop

    monkeypatch.setattr(offloop, "MAX_CALLS_OUT", offloop._out[0] + 3)  # (calls another test left out count)
    release = threading.Event()
    stuck = [in_daemon_thread(lambda: release.wait(30), "t", capped=True) for _ in range(3)]
    try:
        with pytest.raises(offloop.TooManyCallsError):
            await within(in_daemon_thread(lambda: 1, "t", capped=True), 5)
        assert await within(in_daemon_thread(lambda: 3, "t"), 5) == (True, 3)  # an uncapped call (the job's) runs
    finally:
        release.set()
    for f in stuck:
        assert await within(f, 30) == (True, True)
    assert await within(in_daemon_thread(lambda: 2, "t", capped=True), 5) == (True, 2)
