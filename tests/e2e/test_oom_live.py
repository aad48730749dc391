"""Live OOMs: the allocator hooks in the served process, the agent's oom/mem handlers, reload.

No GPU here. The hook side runs against ``fake_torch.FakeTorch`` (a FAKE torch module that
implements only the calls hooks/_alloc.py makes) and a FAKE client that records events.
NVML is a FAKE too (``FakeNvml`` below, returning real ``DeviceSample`` values). The
end-to-end tests use real hooked child processes, a real agent and the real file exporter.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import fake_torch
import pytest
from conftest import BOOTSTRAP, AgentProcess, attr, hook_env, log_records, read_otlp_lines, spans, wait_for
from fake_torch import GIB, FakeTorch, OutOfMemoryError, nested_stats
from site_rules import BAD_RULE, SITE_RULE

from infersight.agent.commands.compose import build_exporters
from infersight.agent.daemon import config as cfg
from infersight.agent.daemon.assemble import Assembler, Producer
from infersight.agent.daemon.lifecycle import Agent
from infersight.agent.devices.nvml import DeviceSample, GpuProcess
from infersight.agent.oom import kind as oom_kind
from infersight.agent.oom.extension import OomExtension
from infersight.hooks import _alloc, _runtime, _state
from infersight.telemetry import LogItem, MetricItem, Origin, Resource, SpanItem

SUPPORT = Path(__file__).resolve().parents[1] / "support"
EXAMPLES = SUPPORT / "data" / "oom_examples.jsonl"  # vendored: see tests/support/data/README.md
SPAN = "ab" * 8
TRACE = "cd" * 16
ROOT = "ef" * 8
MIB = 1 << 20


def example(ex_id: str) -> dict[str, Any]:
    with open(EXAMPLES, encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if d["id"] == ex_id:
                return d
    raise KeyError(ex_id)


# -- hook side: FAKE torch, FAKE client ---------------------------------------------------------


class FakeClient:
    """FAKE hook client: records what _runtime.emit would queue."""

    def __init__(self) -> None:
        self.enabled = True
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.raise_on_emit = False
        self.hurried_after: list[int] = []  # len(events) at each hurry(): what was sent at once

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        if self.raise_on_emit:
            raise RuntimeError("FAKE client failure")
        json.dumps(data)  # what goes on the wire must be JSON
        self.events.append((kind, data))

    def hurry(self) -> None:
        self.hurried_after.append(len(self.events))

    def urgent(self) -> None:  # hurry, and ring the agent's doorbell once sent (the real client)
        self.hurry()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [d for k, d in self.events if k == kind]


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Fresh hook state with a FAKE client; excepthooks restored afterwards."""
    client = FakeClient()
    monkeypatch.setenv("INFERSIGHT_MEM_INTERVAL_S", "0")
    monkeypatch.delenv("INFERSIGHT_MEMORY_HISTORY", raising=False)
    saved = (sys.excepthook, threading.excepthook)
    st = _state.HookState()  # not failed, no root ended
    st.runtime.client = client
    st.runtime.trace_id = TRACE
    st.runtime.root_span_id = ROOT
    monkeypatch.setattr(_state, "current", st)
    yield client
    st = _alloc.state()
    st.stop = True
    st.wake.set()
    sys.excepthook, threading.excepthook = saved


def test_observer_emits_a_well_formed_oom_event(hooked: FakeClient) -> None:
    fake = FakeTorch(total=16 * GIB)
    fake.stats = nested_stats(allocated=9 * GIB, reserved=12 * GIB, inactive_split=3 * GIB, device_alloc=7, ooms=1)
    fake.segments = [  # synthetic segments with the structure of memory_snapshot()
        {"device": 0, "total_size": 4 * GIB, "segment_type": "large", "segment_pool_id": (0, 0),
         "blocks": [{"size": 3 * GIB, "state": "active_allocated"}, {"size": GIB, "state": "inactive"}]},
        {"device": 0, "total_size": 2 * MIB, "segment_type": "small", "segment_pool_id": (0, 0),
         "blocks": [{"size": 2 * MIB, "state": "inactive"}]},
    ]
    _alloc.state().torch = fake
    assert _alloc.start_allocator_hooks()
    assert len(fake.observers) == 1
    assert _alloc.status()["observer"]
    token = _runtime.current_span.set(SPAN)
    try:
        with pytest.raises(OutOfMemoryError):  # the OOM itself, not anything of ours
            fake.oom(alloc=2 * GIB, free=512 * MIB)
    finally:
        _runtime.current_span.reset(token)
    (ev,) = hooked.of("oom")
    assert ev["source"] == "observer"
    assert ev["sp"] == SPAN
    # sent at once, not after the batch delay (the agent's quiet-producer gate adds up to 80 ms)
    assert hooked.hurried_after == [len(hooked.events)]
    assert (ev["dev"], ev["req"], ev["total"], ev["free"]) == (0, 2 * GIB, 16 * GIB, 512 * MIB)
    assert "allowed" not in ev
    assert ev["fraction"] == 1.0
    assert ev["backend"] == "native"
    assert ev["stats"]["allocated"] == 9 * GIB
    assert ev["stats"]["reserved"] == 12 * GIB
    assert ev["uuid"] == "GPU-12345678-aaaa-bbbb-cccc-1234567890ab"
    snap = ev["snap"]
    assert snap["segments"] == 2
    assert snap["top"] == [3 * GIB]
    assert snap["inactive_split"] == GIB
    assert snap["pools"]["large"]["largest_free"] == GIB
    assert snap["pools"]["small"]["largest_free"] == 2 * MIB


def test_fraction_cap_is_reported_as_allowed(hooked: FakeClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    fake = FakeTorch(total=16 * GIB)
    fake.fraction = 0.5
    _alloc.state().torch = fake
    _alloc.start_allocator_hooks()
    with pytest.raises(OutOfMemoryError):
        fake.oom(alloc=GIB, free=10 * GIB)
    (ev,) = hooked.of("oom")
    assert ev["allowed"] == 8 * GIB
    assert ev["total"] == 16 * GIB
    assert ev["fraction"] == 0.5
    assert ev["alloc_conf"] == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def test_observer_never_raises_into_the_oom(hooked: FakeClient) -> None:
    fake = FakeTorch()
    fake.raise_in_stats = True

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("FAKE failure")

    fake.cuda.get_device_properties = broken
    fake.cuda.memory_snapshot = broken
    _alloc.state().torch = fake
    _alloc.start_allocator_hooks()
    with pytest.raises(OutOfMemoryError):
        fake.oom(alloc=GIB, free=0)
    (ev,) = hooked.of("oom")
    assert "stats" not in ev
    assert "snap" not in ev
    assert ev["req"] == GIB
    hooked.raise_on_emit = True  # even the client failing stays inside the observer
    with pytest.raises(OutOfMemoryError):
        fake.oom(alloc=GIB, free=0)
    _alloc.state().torch = None  # and a torch that went away
    assert fake.observers[0](0, 1, 2, 3) is None


def test_starts_only_after_cuda_init_and_only_on_native(hooked: FakeClient) -> None:
    fake = FakeTorch(initialized=False)
    _alloc.state().torch = fake
    assert not _alloc.start_allocator_hooks()
    assert not fake.observers
    other = FakeTorch(backend="cudaMallocAsync")
    _alloc.state().torch = other
    assert _alloc.start_allocator_hooks()
    assert not other.observers
    assert "cudaMallocAsync" in _alloc.status()["reason"]


def test_install_waits_for_cuda_then_attaches(hooked: FakeClient) -> None:
    fake = FakeTorch(initialized=False)
    _alloc.install(fake)
    time.sleep(0.05)
    assert not fake.observers  # never initialises CUDA itself
    fake.initialized = True
    _alloc.notify_cuda_ready()
    assert wait_for(lambda: len(fake.observers) == 1, 5)
    assert sys.excepthook is _alloc._sys_excepthook
    assert threading.excepthook is _alloc._thread_excepthook


def test_a_torch_built_without_cuda_gets_the_excepthooks_and_no_thread(hooked: FakeClient) -> None:
    """A CPU-only build (torch.version.cuda and .hip None) can never initialise CUDA: no thread
    polls for it (its wake-ups would take the GIL from the busy main thread for the process's
    life). A build with either, or a torch without ``version``, still gets the thread."""
    cpu = FakeTorch(initialized=False)
    cpu.version = types.SimpleNamespace(cuda=None, hip=None)  # type: ignore[attr-defined]
    _alloc.install(cpu)
    assert _alloc.state().thread is None
    assert sys.excepthook is _alloc._sys_excepthook
    assert not _alloc.cuda_possible(cpu)
    assert _alloc.cuda_possible(types.SimpleNamespace(version=types.SimpleNamespace(cuda="12.4", hip=None)))
    assert _alloc.cuda_possible(types.SimpleNamespace(version=types.SimpleNamespace(cuda=None, hip="6.2")))
    assert _alloc.cuda_possible(FakeTorch())  # no torch.version: unknown, polled as before


def test_excepthook_reports_the_oom_text_once_and_chains(hooked: FakeClient) -> None:
    seen: list[Any] = []
    sys.excepthook = lambda tp, v, tb: seen.append(v)
    _alloc.state().torch = FakeTorch()
    _alloc._install_excepthooks()
    text = example("oom-002")["text"]
    exc = OutOfMemoryError(text)
    sys.excepthook(OutOfMemoryError, exc, None)
    sys.excepthook(OutOfMemoryError, exc, None)  # the same exception again: not twice
    sys.excepthook(ValueError, ValueError("not an OOM"), None)
    assert len(seen) == 3  # the previous hook still runs every time
    (ev,) = hooked.of("oom")
    assert ev["source"] == "exception"
    assert ev["text"] == text
    assert ev["sp"] == ROOT
    assert hooked.hurried_after == [1]  # the report is sent at once


def test_thread_excepthook_reports_and_chains(hooked: FakeClient) -> None:
    seen: list[Any] = []
    threading.excepthook = lambda args: seen.append(args.exc_type)
    _alloc.state().torch = FakeTorch()
    _alloc._install_excepthooks()

    def work() -> None:
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [OutOfMemoryError]
    (ev,) = hooked.of("oom")
    assert ev["text"].startswith("CUDA out of memory")


def test_report_oom_links_the_span_and_finds_wrapped_ooms(hooked: FakeClient) -> None:
    _alloc.state().torch = FakeTorch()
    token = _runtime.current_span.set(SPAN)
    try:
        try:
            try:
                raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            except OutOfMemoryError as inner:
                raise ValueError("request failed") from inner
        except ValueError as outer:
            first = _alloc.report_oom()  # the one being handled, found through __cause__
            again = _alloc.report_oom(outer)  # already reported
        assert first
        assert not again
        assert not _alloc.report_oom(ValueError("no OOM"))
        assert not _alloc.report_oom(None)
    finally:
        _runtime.current_span.reset(token)
    (ev,) = hooked.of("oom")
    assert ev["sp"] == SPAN
    assert ev["source"] == "report"
    assert ev["type"] == "OutOfMemoryError"


def test_exception_after_unwinding_links_to_the_observer_span(hooked: FakeClient) -> None:
    fake = FakeTorch()
    _alloc.state().torch = fake
    _alloc.start_allocator_hooks()
    _alloc._install_excepthooks()
    sys_prev: list[Any] = []
    _alloc.state().prev_sys_hook = lambda *a: sys_prev.append(a)
    token = _runtime.current_span.set(SPAN)
    try:
        with pytest.raises(OutOfMemoryError) as info:
            fake.oom(alloc=GIB, free=0)
    finally:
        _runtime.current_span.reset(token)  # the stage ended while the OOM unwound
    sys.excepthook(OutOfMemoryError, info.value, None)
    obs, exc = hooked.of("oom")
    assert obs["source"] == "observer"
    assert exc["source"] == "exception"
    assert obs["sp"] == exc["sp"] == SPAN
    assert len(sys_prev) == 1


def test_sampler_emits_deltas_and_segment_events(hooked: FakeClient, monkeypatch: pytest.MonkeyPatch) -> None:
    _state.current.main_span = SPAN  # the main thread is in stage SPAN (the fixture's fresh state)
    fake = FakeTorch()
    s = _alloc.Sampler(fake, large_bytes=GIB)
    fake.stats = nested_stats()
    assert s.sample() == 0  # a device this process never used
    fake.stats = nested_stats(allocated=2 * GIB, reserved=3 * GIB, device_alloc=2)
    assert s.sample() == 1
    assert s.sample() == 0  # nothing changed, nothing sent
    fake.stats = nested_stats(allocated=GIB, reserved=GIB, device_alloc=2, device_free=1, retries=1)
    assert s.sample() == 1
    first, second = hooked.of("mem")
    assert first["sp"] == SPAN
    assert first["s"]["reserved"] == 3 * GIB
    assert first["uuid"].startswith("GPU-")
    assert {e["n"] for e in first["ev"]} == {"segment_alloc", "large_alloc"}
    seg = next(e for e in first["ev"] if e["n"] == "segment_alloc")
    assert seg == {"n": "segment_alloc", "count": 2, "bytes": 3 * GIB}
    assert [e["n"] for e in second["ev"]] == ["segment_free", "alloc_retry"]
    assert second["ev"][0]["bytes"] == 2 * GIB


def test_snapshot_summary_is_bounded() -> None:
    # Synthetic: more segments than the summary looks at.
    segs = [{"total_size": 2 * MIB, "segment_type": "large", "blocks": [{"size": 2 * MIB, "state": "inactive"}]}
            for _ in range(_alloc.MAX_SEGMENTS + 10)]
    out = _alloc.snapshot_summary(segs)
    assert out["segments"] == _alloc.MAX_SEGMENTS
    assert out["truncated"]
    assert out["inactive_split"] == 0


# -- agent side, in-process: Assembler + handlers --------------------------------------------


class FakeNvml:
    """FAKE NVML: one device whose process list the test sets (real DeviceSample values)."""

    def __init__(self, uuid: str, total: int, procs: list[tuple[int, int]]) -> None:
        self.uuid, self.total, self.procs = uuid, total, procs

    def device_count(self) -> int:
        return 1

    def sample(self, index: int) -> DeviceSample | None:
        return DeviceSample(
            time_ns=time.time_ns(), index=index, uuid=self.uuid, name="FAKE GPU", memory_total_bytes=self.total,
            processes=tuple(GpuProcess(pid, used, pid, "python") for pid, used in self.procs),
        )


def _producer(asm: Assembler, pid: int = 4242) -> Any:
    return asm.hello({"id": "p-%d" % pid, "pid": pid, "start_ns": 1, "trace_id": TRACE, "root_span_id": ROOT})


def _handlers(nvml: Any = None) -> tuple[oom_kind.OomHandlers, Assembler]:
    h = oom_kind.OomHandlers(oom_kind.OomClassifier([]), nvml)
    return h, Assembler("host", {"oom": h.oom, "mem": h.mem})


def _observer_event(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"source": "observer", "dev": 0, "req": 4 * GIB, "total": 80 * GIB, "free": GIB,
                         "stats": {"allocated": 10 * GIB, "reserved": 10 * GIB}, "sp": SPAN,
                         "uuid": "GPU-aaaa"}
    d.update(over)
    return d


def test_nvml_other_tenants_make_a_reservation_conflict() -> None:
    nvml = FakeNvml("GPU-aaaa", 80 * GIB, [(4242, 10 * GIB + 600 * MIB), (999, 68 * GIB)])
    h, asm = _handlers(nvml)
    p = _producer(asm)
    items = asm.events(p, [[1, 10, "oom", _observer_event()]])
    (log,) = [i for i in items if isinstance(i, LogItem)]
    assert log.severity_text == "ERROR"
    assert log.event_name == "oom"
    assert log.span_id == SPAN
    assert log.attributes["infersight.oom.class"] == "reservation_conflict"
    assert log.attributes["infersight.oom.rule"] == "oom.reservation.tenants"
    assert log.attributes["infersight.oom.O_bytes"] == 68 * GIB
    assert log.attributes["infersight.oom.nvml"] is True
    assert log.attributes["hw.id"] == "GPU-aaaa"
    assert "reservation_conflict" in log.body
    (ev,) = p.span_events[SPAN]
    assert ev.name == "infersight.oom"
    assert ev.attributes["infersight.oom.class"] == "reservation_conflict"
    (count,) = [i for i in items if isinstance(i, MetricItem)]
    assert count.name == "infersight.oom.count"
    assert count.kind == "sum"


def test_observer_and_exception_count_once_but_two_ooms_count_twice() -> None:
    h, asm = _handlers()
    p = _producer(asm)
    text = ("CUDA out of memory. Tried to allocate 4.00 GiB. "
            "GPU 0 has a total capacity of 80.00 GiB of which 1.00 GiB is free.")
    batch = [
        [1, 10, "oom", _observer_event()],
        [2, 20, "oom", {"source": "exception", "text": text, "sp": ROOT}],
        [3, 30, "oom", {"source": "report", "text": text, "sp": ROOT}],  # reported twice
        [4, 40, "oom", _observer_event()],  # a second, real OOM
    ]
    items = asm.events(p, batch)
    logs = [i for i in items if isinstance(i, LogItem)]
    assert len(logs) == 2
    assert h.duplicates == 2
    assert p.malformed == 0
    last = [i for i in items if isinstance(i, MetricItem)][-1]
    assert [(pt.attributes["infersight.oom.class"], pt.value) for pt in last.points] == [("reservation_conflict", 2)]


def test_exception_text_alone_is_classified() -> None:
    ex = example("oom-002")
    h, asm = _handlers()
    p = _producer(asm)
    items = asm.events(p, [[1, 10, "oom", {"source": "exception", "text": ex["text"], "sp": SPAN}]])
    (log,) = [i for i in items if isinstance(i, LogItem)]
    assert log.attributes["infersight.oom.class"] == ex["label"] == "fragmentation"
    assert log.attributes["infersight.oom.R_bytes"] == ex["numbers"]["R"]


def test_malformed_oom_and_mem_events_are_counted() -> None:
    h, asm = _handlers()
    p = _producer(asm)
    asm.events(p, [[1, 1, "oom", {"req": "lots"}], [2, 2, "mem", {"s": {}}], [3, 3, "mem", {"dev": 0, "ev": [1]}]])
    assert p.malformed == 3


def test_mem_metrics_and_span_events() -> None:
    h, asm = _handlers()
    p = _producer(asm)
    st = {"reserved": 3 * GIB, "allocated": 2 * GIB, "retries": 1, "device_alloc": 2, "device_free": 0}
    ev = [{"n": "segment_alloc", "count": 2, "bytes": 3 * GIB}, {"n": "large_alloc", "count": 1, "bytes": 2 * GIB}]
    items = asm.events(p, [[1, 10, "mem", {"dev": 0, "uuid": "GPU-aaaa", "s": st, "sp": SPAN, "ev": ev}]])
    by_name = {i.name: i for i in items if isinstance(i, MetricItem)}
    assert by_name["infersight.memory.reserved"].kind == "gauge"
    assert by_name["infersight.memory.reserved"].unit == "By"
    assert by_name["infersight.memory.alloc_retries"].kind == "sum"
    assert by_name["infersight.memory.device_allocs"].points[0].attributes["hw.id"] == "GPU-aaaa"
    # The stage span arrives afterwards and carries the events.
    out = asm.events(p, [[2, 20, "span", {"n": "coldstart.warmup", "id": SPAN, "s": 5, "e": 20}]])
    (span,) = [i for i in out if isinstance(i, SpanItem)]
    assert [e.name for e in span.events] == ["infersight.memory.segment_alloc", "infersight.memory.large_alloc"]
    # A reset of PyTorch's counters restarts the sum.
    st2 = dict(st, retries=0)
    items = asm.events(p, [[3, 30, "mem", {"dev": 0, "s": st2}]])
    retries = next(i for i in items if isinstance(i, MetricItem) and i.name == "infersight.memory.alloc_retries")
    assert retries.start_ns == 30


def test_classifier_reload_keeps_old_rules_on_an_invalid_file(tmp_path: Path) -> None:
    d = tmp_path / "rules"
    d.mkdir()
    (d / "site.toml").write_text(SITE_RULE)
    c = oom_kind.OomClassifier([d])
    assert c.rules.get("site.bigger-than-device") is not None
    (d / "zz-bad.toml").write_text(BAD_RULE)
    with pytest.raises(ValueError, match=r"zz-bad\.toml:8"):
        c.reload(dirs=[d])
    assert c.rules.get("site.bigger-than-device") is not None


# -- end to end: hooked child processes, an in-process agent, the file exporter ------------

CHILD_REPORT = """
import json, sys
from infersight import hooks
from infersight.hooks import _alloc

class OutOfMemoryError(RuntimeError):  # FAKE stand-in for torch.OutOfMemoryError
    pass

text = json.loads(sys.argv[1])
with hooks.stage("warmup"):
    try:
        raise OutOfMemoryError(text)
    except OutOfMemoryError as exc:
        assert _alloc.report_oom(exc)
"""

CHILD_OBSERVER = """
import json, sys, time
from infersight import hooks
from infersight.hooks import _alloc
from fake_torch import FakeTorch, OutOfMemoryError, nested_stats  # FAKE torch

ex = json.loads(sys.argv[1])
n = ex["numbers"]
fake = FakeTorch(total=n["T"])
fake.stats = nested_stats(allocated=n["A"], reserved=n["P"])
_alloc.install(fake)
deadline = time.time() + 10
while not fake.observers and time.time() < deadline:
    time.sleep(0.005)
with hooks.stage("warmup"):
    fake.oom(alloc=n["R"], free=n["F"], text=ex["text"])  # uncaught: sys.excepthook reports it
"""


def _records(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    lines = read_otlp_lines(path)
    metrics = [
        m for req in lines for rm in req.get("resourceMetrics", []) for sm in rm["scopeMetrics"] for m in sm["metrics"]
    ]
    return log_records(lines), spans(lines), metrics


async def _run_child(code: str, arg: str, sock: Path, spool: Path) -> tuple[int, str]:
    env = hook_env(sock, spool, PYTHONPATH=os.pathsep.join([str(BOOTSTRAP), str(SUPPORT)]),
                   INFERSIGHT_MEM_INTERVAL_S="0")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, arg, env=env,
                                                stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, err.decode()


def _embedded_agent(tmp_path: Path) -> tuple[Agent, OomExtension, Path, Path, Path]:
    """An embedded agent with the OOM extension writing OTLP JSON to a file under ``tmp_path`` (not started):
    the agent, its extension, the file, its socket and its spool directory."""
    out = tmp_path / "out.otlp.jsonl"
    sock, spool = tmp_path / "a.sock", tmp_path / "spool"
    conf = cfg.load(None, env={}, flags={"agent.socket": str(sock), "agent.spool_dir": str(spool),
                                         "exporters.file.path": str(out), "rules.dirs": [],
                                         "agent.health_interval_s": 3600.0})
    oom = OomExtension(conf)
    return Agent(conf, build_exporters(conf, env={}), [oom], embedded=True), oom, out, sock, spool


async def test_end_to_end_oom_in_warmup(tmp_path: Path) -> None:
    agent, oom, out, sock, spool = _embedded_agent(tmp_path)
    handlers = oom.handlers
    await agent.start()
    try:
        ex = example("oom-002")
        rc, err = await _run_child(CHILD_REPORT, json.dumps(ex["text"]), sock, spool)
        assert rc == 0, err
        rc, err = await _run_child(CHILD_OBSERVER, json.dumps(ex), sock, spool)
        assert rc == 1
        assert "OutOfMemoryError" in err
        await agent.ingest.wait_connections_closed(10)
    finally:
        await agent.shutdown(10)
    logs, sps, metrics = _records(out)
    ooms = [r for r in logs if r.get("eventName") == "oom"]
    assert len(ooms) == 2
    assert handlers.duplicates == 1
    for rec in ooms:
        assert rec["severityText"] == "ERROR"
        assert attr(rec, "infersight.oom.class") == "fragmentation"
        assert attr(rec, "infersight.oom.rule") == "oom.fragmentation"
    assert {attr(r, "infersight.oom.source") for r in ooms} == {"report", "observer"}
    warmups = [s for s in sps if s["name"] == "coldstart.warmup"]
    assert len(warmups) == 2
    for w in warmups:
        (ev,) = [e for e in w.get("events", []) if e["name"] == "infersight.oom"]
        assert attr(ev, "infersight.oom.class") == "fragmentation"
        assert any(r["spanId"] == w["spanId"] for r in ooms)
    counts = [m for m in metrics if m["name"] == "infersight.oom.count"]
    assert len(counts) == 2
    for m in counts:
        (pt,) = m["sum"]["dataPoints"]
        assert attr(pt, "infersight.oom.class") == "fragmentation"
        assert int(pt.get("asInt", pt.get("asDouble"))) == 1


# -- SIGHUP: a real agent process --------------------------------------------------------------




def test_sighup_reload_keeps_old_rules_on_an_invalid_file(tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    a = AgentProcess(tmp_path, '[rules]\ndirs = ["%s"]\n' % rules).start()
    text = example("oom-072")["text"]  # 55.57 GiB asked of a 12 GiB device

    def classify_once() -> str:
        before = len([r for r in log_records(read_otlp_lines(a.out)) if r.get("eventName") == "oom"]) \
            if a.out.exists() else 0
        r = subprocess.run([sys.executable, "-c", CHILD_REPORT, json.dumps(text)],
                           env=hook_env(a.sock, a.spool), capture_output=True, timeout=30, check=False)
        assert r.returncode == 0, r.stderr
        got: list[dict[str, Any]] = []

        def arrived() -> bool:
            got[:] = [r for r in log_records(read_otlp_lines(a.out)) if r.get("eventName") == "oom"] \
                if a.out.exists() else []
            return len(got) > before

        assert wait_for(arrived, 30)  # (a loaded CI machine took over 10 s once)
        return str(attr(got[-1], "infersight.oom.rule"))

    try:
        assert classify_once() == "oom.capacity.beyond-device"  # 55.57 GiB of a 12 GiB device
        (rules / "site.toml").write_text(SITE_RULE)
        a.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        assert wait_for(lambda: a.status()["counters"]["reloads"] == 1, 10)
        assert classify_once() == "site.bigger-than-device"
        (rules / "zz-bad.toml").write_text(BAD_RULE)
        a.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        assert wait_for(lambda: a.status()["counters"]["reload_failures"] == 1, 10)
        assert classify_once() == "site.bigger-than-device"  # the old rules keep classifying
        assert wait_for(lambda: "zz-bad.toml:8" in a.log.read_text(), 5), a.log.read_text()
    finally:
        assert a.stop() == 0
    assert "reload failed" in a.log.read_text()
    assert fake_torch.__doc__
    assert "FAKE" in fake_torch.__doc__


async def test_oom_reads_nvml_off_the_event_loop_under_the_device_lock() -> None:
    """The handler used to call NVML on the event loop, without the lock that keeps
    sampling and nvmlShutdown apart."""
    from nvml_calls import NvmlCalls

    calls = NvmlCalls()
    published: list[Any] = []
    nvml = calls.watch(FakeNvml("GPU-aaaa", 80 * GIB, [(4242, 10 * GIB + 600 * MIB), (999, 68 * GIB)]))
    h = oom_kind.OomHandlers(oom_kind.OomClassifier([]), nvml, publish=published.extend, nvml_guard=calls.guard)
    asm = Assembler("host", {"oom": h.oom, "mem": h.mem})
    p = _producer(asm)
    items = asm.events(p, [[1, 10, "oom", _observer_event()]])
    assert not [i for i in items if isinstance(i, LogItem)], "finished later, off the loop"
    await h.wait_later(10)
    (log,) = [i for i in published if isinstance(i, LogItem)]
    assert log.attributes["infersight.oom.class"] == "reservation_conflict"
    assert log.attributes["infersight.oom.nvml"] is True
    assert calls.off_this_thread_under_the_lock(), calls.seen


H200_TEXT = ("CUDA out of memory. Tried to allocate 141.40 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
             "139.29 GiB is free. Including non-PyTorch memory, this process has 518.00 MiB memory in use. Of the "
             "allocated memory 0 bytes is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.")


@pytest.mark.parametrize("order", ["observer first", "text first"])
def test_an_uncaught_oom_is_one_record_whichever_copy_comes_first(order: str) -> None:
    """An uncaught OOM under launch reaches the agent as the observer's event, the exception's text and launch's
    stderr copy; on an H200 (bench/gpu_check_engines.py torch_uncaught) the text came first once and two records
    went out. The next OOM, of another size, is its own."""
    h, asm = _handlers()
    p = _producer(asm)
    observer = [1, 10, "oom", _observer_event(req=151829610496, total=150109880320, free=149557477376)]
    text = [2, 11, "oom", {"source": "stderr", "text": H200_TEXT}]
    exc = [3, 12, "oom", {"source": "exception", "text": H200_TEXT, "sp": SPAN}]
    batches = [[observer], [text], [exc]] if order == "observer first" else [[text], [observer], [exc]]
    logs = [i for b in batches for i in asm.events(p, b) if isinstance(i, LogItem)]
    assert len(logs) == 1 and logs[0].attributes["infersight.oom.class"] == "capacity"
    assert h.duplicates == 2
    other = _observer_event(req=151829610496 // 2, total=150109880320, free=1 << 30)
    assert [i for i in asm.events(p, [[4, 20, "oom", other]]) if isinstance(i, LogItem)]


@pytest.mark.parametrize("order", ["observer first", "text first"])
def test_launchs_stand_in_and_the_hooked_process_report_one_oom(order: str) -> None:
    """launch's stderr copy comes as its stand-in for CMD (no uid) when the hooked process's hello was not read yet
    (seen on an H200: two records); the hooks' observer event comes as CMD's own producer: one OOM of one pid.
    Two producers of the agent's socket with the same pid (two containers) and no stand-in stay two."""
    h, asm = _handlers()
    h.relayed = lambda p: True  # launch's own agent (the daemon shares nothing across producers)
    hooked = asm.hello({"id": "p-4242", "pid": 4242, "start_ns": 1, "trace_id": TRACE, "root_span_id": ROOT,
                        "launched": True}, uid=1000)
    stand_in = Producer("launch-stderr-4242", {"pid": 4242, "launched": True}, Resource.of({}))
    observer = (hooked, [1, 10, "oom", _observer_event(req=151829610496, total=150109880320, free=149557477376)])
    text = (stand_in, [2, 11, "oom", {"source": "stderr", "text": H200_TEXT}])
    sends = [observer, text] if order == "observer first" else [text, observer]
    logs = [i for who, ev in sends for i in h_events(h, asm, who, ev) if isinstance(i, LogItem)]
    assert len(logs) == 1 and h.duplicates == 1
    h, asm = _handlers()
    one = asm.hello({"id": "a-1", "pid": 1, "start_ns": 1, "trace_id": TRACE, "root_span_id": ROOT}, uid=1000)
    two = asm.hello({"id": "b-1", "pid": 1, "start_ns": 1, "trace_id": TRACE, "root_span_id": ROOT}, uid=1000)
    logs = [i for who, ev in [(one, text[1]), (two, observer[1])] for i in asm.events(who, [ev])
            if isinstance(i, LogItem)]
    assert len(logs) == 2


def test_a_text_copy_older_than_two_seconds_is_another_oom_for_a_later_observer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The observer-after-text match holds on the agent's clock for TEXT_BEFORE_OBSERVER_S: launch's stderr copy of a
    worker's OOM (attributed to CMD), then CMD's own OOM of the same size 10 s later, are two OOMs."""
    clock = [1000.0]
    fake_time = types.SimpleNamespace(monotonic=lambda: clock[0], monotonic_ns=lambda: int(clock[0] * 1e9),
                                      time_ns=time.time_ns, time=time.time)
    monkeypatch.setattr(oom_kind, "time", fake_time)  # the agent's clock, stepped by the test
    h, asm = _handlers()
    p = _producer(asm)
    text = [1, 10, "oom", {"source": "stderr", "text": H200_TEXT}]
    assert [i for i in asm.events(p, [text]) if isinstance(i, LogItem)]
    clock[0] += 10.0
    later = [2, 11, "oom", _observer_event(req=151829610496, total=150109880320, free=149557477376)]
    assert [i for i in asm.events(p, [later]) if isinstance(i, LogItem)], "folded into an older OOM"
    assert h.duplicates == 0


def h_events(h: oom_kind.OomHandlers, asm: Assembler, who: Any, ev: list[Any]) -> list[Any]:
    """An event of ``who``: a hooked producer's through the assembler, launch's stand-in straight to the handler
    (launch injects its stderr copies so)."""
    if who.uid is None:
        out: list[Any] = []
        h.oom(who, Origin(who.id, 0), ev[1], ev[3], out)
        return out
    return asm.events(who, [ev])


def test_an_undecided_oom_carries_a_reason_on_every_sink() -> None:
    h, asm = _handlers()
    p = _producer(asm)
    items = asm.events(p, [[1, 10, "oom", {"source": "observer", "dev": 0, "req": 4 * GIB, "sp": SPAN}]])
    (log,) = [i for i in items if isinstance(i, LogItem)]
    assert log.attributes["infersight.oom.class"] == "unknown"
    assert "missing" in str(log.attributes["infersight.oom.reason"])
    (ev,) = p.span_events[SPAN]
    assert ev.attributes["infersight.oom.reason"] == log.attributes["infersight.oom.reason"]
    assert log.attributes["infersight.oom.engine"] == "pytorch"


def test_an_engine_error_of_another_uid_does_not_hide_yours() -> None:
    """The same engine text from a process and its child is one OOM (a worker logs it, its parent
    re-raises it); from another uid it is that user's own OOM: a neighbour who sends the text first
    must not make the victim's count as a duplicate."""
    h, asm = _handlers()
    text = "Not enough memory. Please try to increase --mem-fraction-static."

    def producer(pid: int, uid: int, ppid: int = 1) -> Any:
        return asm.hello({"id": "p-%d" % pid, "pid": pid, "ppid": ppid, "start_ns": 1, "trace_id": TRACE,
                          "root_span_id": ROOT}, uid=uid)

    attacker, victim, victims_worker = producer(7001, 2000), producer(7002, 1000), producer(7003, 1000, ppid=7002)
    got = []
    for seq, p in enumerate((attacker, victim, victims_worker), 1):
        items = asm.events(p, [[seq, 10 + seq, "oom", {"source": "log", "text": text}]])
        got.append([i.resource.get("process.user.id") for i in items if isinstance(i, LogItem)])
    assert got == [[2000], [1000], []]
    assert h.duplicates == 1


OTHER_TRACE = "c" * 32


@pytest.mark.parametrize("case", ["second service or a restart", "sibling worker", "other container, same pid"])
def test_the_same_engine_error_from_an_unrelated_process_of_the_uid_is_its_own_oom(case: str) -> None:
    """Two services of one uid (one vLLM per GPU under the ``llm`` user), a crash-looping service's next
    run, or a supervisor's restarted worker: each process that is not the other or its ancestor has an OOM
    of its own, counted and on every sink, however alike the texts. Pids of another pid namespace (each
    container's own pid 7) are compared within one trace only."""
    h, asm = _handlers()
    text = "Not enough memory. Please try to increase --mem-fraction-static."
    first = {"id": "p-a", "pid": 7101, "ppid": 1, "start_ns": 1, "trace_id": TRACE, "root_span_id": ROOT}
    second = {"id": "p-b", "pid": 7102, "ppid": 1, "start_ns": 2, "trace_id": OTHER_TRACE, "root_span_id": ROOT}
    start = 10
    if case == "sibling worker":
        first["ppid"] = second["ppid"] = 7100  # one master's workers: its trace; the restarted one's OOM 5 s later
        second["trace_id"] = TRACE
        start = 5_000_000_000
    elif case == "other container, same pid":
        second["pid"] = first["pid"]
    got = []
    for seq, info in enumerate((first, second), 1):
        p = asm.hello(dict(info), uid=1000)
        items = asm.events(p, [[seq, (seq - 1) * start + 11, "oom", {"source": "log", "text": text}]])
        got.append(len([i for i in items if isinstance(i, LogItem)]))
    assert got == [1, 1], case
    assert h.duplicates == 0


def test_the_same_engine_error_from_two_ranks_at_once_is_one_oom() -> None:
    """The tensor-parallel workers of one engine (children of one parent, in its trace) log the same error within
    a second of each other: one failure, one OOM (each rank's copy was its own before)."""
    h, asm = _handlers()
    text = "Not enough memory. Please try to increase --mem-fraction-static."
    got = []
    for seq, pid in enumerate((7101, 7102, 7103), 1):
        p = asm.hello({"id": "p-%d" % pid, "pid": pid, "ppid": 7100, "start_ns": 1, "trace_id": TRACE,
                       "root_span_id": ROOT}, uid=1000)
        items = asm.events(p, [[seq, 10 + seq * 200_000_000, "oom", {"source": "log", "text": text}]])
        got.append(len([i for i in items if isinstance(i, LogItem)]))
    assert got == [1, 0, 0]
    assert h.duplicates == 2


def test_the_same_error_from_one_producer_without_a_pid_is_one_oom() -> None:
    """A joined launch's stand-in for an unhooked CMD has no pid where launch is in another PID namespace (the
    pod) or CMD was reaped: each copy of the same llama.cpp error was its own OOM (a review's finding). One
    producer is one process: the same message again from it is a duplicate."""
    from infersight.agent.daemon.assemble import Producer

    h, _asm = _handlers()
    stand_in = Producer("launch-stderr-x", {"id": "launch-stderr-x", "pid": None, "launched": True, "uid": 1000},
                        Resource.of({"service.name": "llama-server", "process.user.id": 1000}))
    stand_in.uid = 1000
    text = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 1024.00 MiB on device 0: cudaMalloc failed: "
            "out of memory")
    out: list[Any] = []
    for k in range(3):
        h.oom(stand_in, Origin(stand_in.id, 0), 10 + k, {"source": "stderr", "text": text}, out)
    assert len([i for i in out if isinstance(i, LogItem)]) == 1 and h.duplicates == 2


@pytest.mark.parametrize("stderr_first", [True, False])
def test_a_root_launchs_stderr_copy_and_its_engines_own_copy_as_another_user_are_one_oom(stderr_first: bool) -> None:
    """``sudo launch -- runuser -u svc vllm ...``: the stderr copy comes as a producer of uid 0 standing for CMD,
    the engine's own copy as uid svc's producer; the two were two OOMs (a review's finding). One launch's (the
    same session token), one of them root's: one OOM. Another user's process with the same text is not folded."""
    from infersight.agent.daemon.assemble import Producer

    h, asm = _handlers()
    session = "ab" * 16
    engine = asm.hello({"id": "p-7201", "pid": 7201, "ppid": 1, "start_ns": 1, "trace_id": TRACE,
                        "root_span_id": ROOT, "launched": True, "session": session}, uid=1000)
    stand_in = Producer("launch-stderr-y", {"id": "launch-stderr-y", "pid": None, "launched": True, "uid": 0,
                                            "session": session}, Resource.of({"process.user.id": 0}))
    stand_in.uid = 0
    stranger = asm.hello({"id": "p-7301", "pid": 7301, "ppid": 1, "start_ns": 1, "trace_id": "c" * 32,
                          "root_span_id": ROOT, "session": "cd" * 16}, uid=2000)
    text = "Not enough memory. Please try to increase --mem-fraction-static."
    out: list[Any] = []
    order = [(stand_in, "stderr"), (engine, "log")]
    for k, (p, source) in enumerate(order if stderr_first else order[::-1]):
        h.oom(p, Origin(p.id, 0), 10 + k, {"source": source, "text": text}, out)
    h.oom(stranger, Origin(stranger.id, 0), 20, {"source": "log", "text": text}, out)
    assert len([i for i in out if isinstance(i, LogItem)]) == 2 and h.duplicates == 1  # ours once, the stranger's


def test_two_hooked_engines_of_one_root_launch_one_of_them_roots_keep_their_own_ooms() -> None:
    """The fold above is for a root launch's stand-in only: two hooked engines of one launch, one running as root
    and one as another user, that log the same message are two failures (a review's counter-case)."""
    h, asm = _handlers()
    session = "ab" * 16
    svc = asm.hello({"id": "p-7201", "pid": 7201, "ppid": 1, "start_ns": 1, "trace_id": TRACE,
                     "root_span_id": ROOT, "launched": True, "session": session}, uid=1000)
    root = asm.hello({"id": "p-7301", "pid": 7301, "ppid": 1, "start_ns": 1, "trace_id": "c" * 32,
                      "root_span_id": ROOT, "launched": True, "session": session}, uid=0)
    text = "Not enough memory. Please try to increase --mem-fraction-static."
    out: list[Any] = []
    for k, p in enumerate((svc, root)):
        h.oom(p, Origin(p.id, 0), 10 + k * 20_000_000_000, {"source": "log", "text": text}, out)
    assert len([i for i in out if isinstance(i, LogItem)]) == 2 and h.duplicates == 0


TGI_ROUTER = ("2024-06-01T10:00:00.000000Z ERROR warmup{max_input_length=4095 max_prefill_tokens=4096}:warmup: "
              "text_generation_client: router/client/src/lib.rs:46: Server error: Not enough memory to handle 4096 "
              "prefill tokens. You need to decrease `--max-batch-prefill-tokens`")
RANK_OOM = ("[rank{r}]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU {r} has a total "
            "capacity of 79.10 GiB of which 1.00 GiB is free. Including non-PyTorch memory, this process has 78.09 GiB "
            "memory in use. Of the allocated memory 77.00 GiB is allocated by PyTorch, and 100.00 MiB is reserved by "
            "PyTorch but unallocated.")
LLAMA_KV = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 16384.00 MiB on device 0: cudaMalloc failed: out "
            "of memory\nllama_kv_cache_init: failed to allocate buffer for kv cache")


@pytest.mark.parametrize("source", ["stderr", "log"])
@pytest.mark.parametrize("case", ["pytorch then engine", "engine then pytorch", "two ranks on two devices"])
def test_every_memory_error_of_one_capture_goes_out(case: str, source: str) -> None:
    """One stderr capture (or log record) may hold several memory errors: a shard's PyTorch OOM and the router's
    own, two ranks' OOMs on two devices. Each goes out, as ``classify`` finds them; before, the live path sent only
    the first finding's kind (a review: TGI's error after a PyTorch OOM, and the second device, were lost)."""
    texts = {
        "pytorch then engine": (H200_TEXT.join(("torch.OutOfMemoryError: ", "\n")) + TGI_ROUTER, ("oom.", "tgi.")),
        "engine then pytorch": (LLAMA_KV + "\ntorch.OutOfMemoryError: " + H200_TEXT, ("llama.cpp.", "oom.")),
        "two ranks on two devices": (RANK_OOM.format(r=0) + "\n" + RANK_OOM.format(r=1), ("oom.", "oom.")),
    }
    text, rules = texts[case]
    h, asm = _handlers()
    p = _producer(asm)
    logs = [i for i in asm.events(p, [[1, 10, "oom", {"source": source, "text": text}]]) if isinstance(i, LogItem)]
    assert len(logs) == 2, [lg.body for lg in logs]
    got = sorted(str(lg.attributes["infersight.oom.rule"]) for lg in logs)
    assert all(g.startswith(r) for g, r in zip(got, sorted(rules))), got
    if case == "two ranks on two devices":
        assert [("on cuda:0:" in lg.body, "on cuda:1:" in lg.body) for lg in logs] == [(True, False), (False, True)]
    # the same capture again (a second copy of the stream): nothing new
    assert not [i for i in asm.events(p, [[2, 11, "oom", {"source": source, "text": text}]]) if isinstance(i, LogItem)]


def test_an_exceptions_text_is_one_error() -> None:
    """An exception's text (its cause chain included) is one failure: its first finding only."""
    h, asm = _handlers()
    p = _producer(asm)
    text = H200_TEXT.join(("torch.OutOfMemoryError: ", "\n")) + TGI_ROUTER
    logs = [i for i in asm.events(p, [[1, 10, "oom", {"source": "exception", "text": text, "sp": SPAN}]])
            if isinstance(i, LogItem)]
    assert len(logs) == 1


def test_an_engine_records_reason_ends_as_a_sentence_before_its_remedy() -> None:
    """The one-line body ran a reason into its remedy ("...on a device Capture the complete message...")."""
    assert oom_kind._sentence("no NVML device showed the engine") == "no NVML device showed the engine. "
    assert oom_kind._sentence("the pool's limit was printed.  ") == "the pool's limit was printed. "
    assert oom_kind._sentence(None) == oom_kind._sentence("") == ""


@pytest.mark.parametrize("stderr_first", [True, False])
def test_a_same_uid_launchs_stand_in_copy_and_the_hooks_copy_are_one_oom(stderr_first: bool) -> None:
    """After an agent restart, launch re-subscribed and sent CMD's stderr capture before CMD's hooks said hello
    again: the session's stand-in (no pid) and the hooks' spooled copy, same uid, were two or three OOMs (a review
    of the pod restarted the sidecar)."""
    h, asm = _handlers()
    session = "ab" * 16
    server = asm.hello({"id": "p-13", "pid": 13, "ppid": 1, "start_ns": 1, "trace_id": TRACE,
                        "root_span_id": ROOT, "launched": True, "session": session}, uid=1000)
    stand_in = Producer("launch-stderr-z", {"id": "launch-stderr-z", "pid": None, "launched": True, "uid": 1000,
                                            "session": session}, Resource.of({"process.user.id": 1000}))
    stand_in.uid = 1000
    text = "torch.OutOfMemoryError: " + H200_TEXT
    out: list[Any] = []
    order = [(stand_in, "stderr"), (server, "report")]
    for k, (p, source) in enumerate(order if stderr_first else order[::-1]):
        h.oom(p, Origin(p.id, 0), 10 + k, {"source": source, "text": text}, out)
    assert len([i for i in out if isinstance(i, LogItem)]) == 1 and h.duplicates == 1
