"""The device job: NVML sampling, request histograms and slow-device verdicts in the agent.

The devices extension (:mod:`infersight.agent.devices.extension`) runs it beside ingest,
with the request statistics the commands hand it (the requests extension's, seen through
:class:`~infersight.latency.RequestWindows`). Each interval
(``nvml.interval_s``, default 1 s) the job

- samples every NVML device on a worker thread and publishes ``device_metrics`` (``hw.*`` and
  ``infersight.device.*``), keeping the samples of the verdict window per device. Live
  exporters (Prometheus) get every sample; the recorded ones (file, OTLP, MQTT) get drifting
  gauges every ``nvml.export_interval_s`` (default 10 s), state and counter points when they
  change, and every series at a heartbeat of 6 intervals
  (:class:`~infersight.agent.devices.metrics.RecordedSamples`);
- turns NVML device events (a lost GPU while sampling; Xid and ECC events from the
  :class:`~infersight.agent.devices.nvml.XidWatcher` thread) into ``LogItem``\\ s, event name ``device``;
- publishes the request histograms that changed.

Every ``devices.evaluate_interval_s`` (default 10 s) it runs
:func:`~infersight.agent.devices.heterogeneity.evaluate` over the request windows (per uid) and
the devices' NVML windows, with the previous verdicts (hysteresis), publishes
``infersight.device.coefficient`` per series, marks ``hw.state="degraded"`` the devices one uid
finds slow and none finds ok (:func:`degraded_devices`), and logs a ``device`` event when a series
turns slow, changes cause, or recovers. Without NVML (no driver, or ``nvml.enabled = false``) it keeps why in
:attr:`DeviceJob.unavailable_reason`, publishes it as the health metric
``infersight.nvml.available`` (value 0) on each heartbeat of the agent and at its close,
and keeps evaluating requests without device samples.

A driver that stops answering (NVML calls block for minutes on a GPU that fell off the bus) stops
nothing else: an interval waits for its sample at most ``sample_wait_s`` and goes on without one,
no new sample starts while that call is out, the OOM feature's reads give up at once
(:meth:`DeviceJob.nvml_call`), and the close skips ``nvmlShutdown``. Until the call returns,
``status`` and the health metric say NVML is not answering (``status``: for how long).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from infersight.agent.daemon.extension import AgentContext
from infersight.agent.daemon.offloop import in_daemon_thread, within
from infersight.agent.devices.metrics import RecordedSamples, device_metrics, hw_id, nvml_unavailable
from infersight.agent.devices.nvml import (
    DeviceEvent,
    DeviceSample,
    HwState,
    Nvml,
    NvmlStatus,
    XidWatcher,
    health_state,
    kept_in_window,
)
from infersight.latency import DEFAULT_WINDOW_S, NvmlDevice, RequestWindows, SeriesKey
from infersight.metricspec import declared
from infersight.rules.device_rules import DeviceThresholds
from infersight.telemetry import Attributes, Item, LogItem, MetricItem, NumberPoint

if TYPE_CHECKING:  # the verdicts' module is imported at the first evaluation (10 s after start, by default)
    from infersight.agent.devices.heterogeneity import DeviceVerdict, WindowState

T = TypeVar("T")
log = logging.getLogger(__name__)

COEFFICIENT = "infersight.device.coefficient"
COEFFICIENT_SPEC = declared(COEFFICIENT, "gauge", "1",
                            "Device P99 / median P99 of its peers (same model, request class, device kind)")
DISABLED_REASON = "disabled by configuration (nvml.enabled = false)"
MAX_WINDOW_SAMPLES = 3600
RAYLET = "raylet"  # the comm of Ray's node manager, the parent of every worker of a Ray node
SAMPLE_WAIT_S = 5.0  # an interval waits this long for its sample (at least two intervals) before going on without
NVML_LOCK_WAIT_S = 2.0  # another NVML read waits this long for the one in progress, then gives up (None)
_NOT_ANSWERING = "a driver that stopped answering: look for Xid errors in the kernel log, and at nvidia-smi"
HUNG_REASON = ("an NVML call has not returned (%s); device samples wait for it, request verdicts go on"
               % _NOT_ANSWERING)
INIT_PENDING_REASON = "NVML has not answered nvmlInit (%s); sampling starts when it does" % _NOT_ANSWERING
# Severity of each DeviceEvent kind.
_EVENT_SEVERITY = {"gpu_lost": "ERROR", "ecc_double_bit": "ERROR", "xid": "WARN", "ecc_single_bit": "WARN"}
_SEVERITY_NUMBER = {"INFO": 9, "WARN": 13, "ERROR": 17}


# -- the job ---------------------------------------------------------------------------------


def _event_log(agent: Any, ev: DeviceEvent) -> LogItem:
    sev = _EVENT_SEVERITY.get(ev.kind, "WARN")
    attrs: Attributes = {"infersight.device.event": ev.kind}
    if ev.uuid:
        attrs["hw.id"] = ev.uuid
        attrs["hw.type"] = "gpu"
    if ev.index is not None:
        attrs["infersight.device.index"] = ev.index
    if ev.code is not None:
        attrs["infersight.device.xid" if ev.kind == "xid" else "infersight.nvml.return_code"] = ev.code
    return LogItem(agent.resource, ev.time_ns, _SEVERITY_NUMBER[sev], sev, ev.message, attrs, event_name="device")


def _series_attrs(key: SeriesKey, name_of: Callable[[int | None, str], str | None]) -> Attributes:
    attrs: Attributes = {}
    if key.device.startswith(("GPU-", "MIG-")):
        attrs["hw.type"] = "gpu"
        attrs["hw.id"] = key.device
        name = name_of(key.uid, key.device)
        if name:
            attrs["hw.name"] = name
    else:
        attrs["infersight.device"] = key.device
    if key.model:
        attrs["infersight.model"] = key.model
        attrs["gen_ai.request.model"] = key.model
    attrs["infersight.request.class"] = key.request_class
    if key.uid is not None:
        attrs["process.user.id"] = key.uid  # whose requests: verdicts are per uid
    return attrs


def degraded_devices(verdicts: Iterable[DeviceVerdict]) -> dict[str, float]:
    """Devices some uid's requests find slow (the device-wide state: ``hw.state``,
    ``slow_devices``): device -> its largest coefficient. Another uid's ``ok`` does not hide it
    (a neighbour's claimed fast requests on your GPU would): each slow verdict is logged with the
    uid whose requests found it, and routing weighs an instance by its own uid's verdicts only
    (``slow_devices_of``)."""
    slow: dict[str, float] = {}
    for v in verdicts:
        if v.verdict == "slow":
            slow[v.key.device] = max(slow.get(v.key.device, 0.0), v.coefficient or 0.0)
    return slow


class DeviceJob:
    """State of one running device job. :meth:`run` is the job the agent runs beside ingest."""

    def __init__(
        self,
        *,
        interval_s: float = 1.0,
        nvml: Nvml | None = None,
        enabled: bool = True,
        export_interval_s: float = 10.0,
        proc_root: str = "/proc",
        thresholds: DeviceThresholds | Callable[[], DeviceThresholds] | None = None,
        requests: RequestWindows | None = None,
        evaluate_interval_s: float = 10.0,
        window_s: float = DEFAULT_WINDOW_S,
    ) -> None:
        self.interval_s = interval_s
        self.recorded = RecordedSamples(export_interval_s)
        self.enabled = enabled
        self.nvml = nvml if nvml is not None else (Nvml(proc_root=proc_root) if enabled else None)
        # A callable: the thresholds load at their first use (the shipped rule file: its TOML
        # parse and tomllib's import are not paid while a launched command starts).
        self._thresholds: DeviceThresholds | None = None
        self._load_thresholds: Callable[[], DeviceThresholds] | None = None
        if callable(thresholds):
            self._load_thresholds = thresholds
        else:
            self._thresholds = thresholds or DeviceThresholds()
        self.requests = requests  # None: device samples and events only, no verdicts
        self.evaluate_interval_s = evaluate_interval_s
        self.window_s = window_s
        self.status: NvmlStatus | None = None
        self.unavailable_reason: str | None = None  # why device sampling is off, once known
        self.watcher: XidWatcher | None = None
        self.samples: dict[str, deque[DeviceSample]] = {}  # hw.id -> the window's samples
        self.names: dict[str, str | None] = {}
        self.states: dict[str, HwState] = {}  # hw.id -> "degraded" for slow devices
        # hw.id -> the sampler's own state where it is not ok (failed: lost; degraded: uncorrected ECC errors or
        # a failed row remap), as of the last sample (kept while NVML does not answer)
        self.sampled_states: dict[str, HwState] = {}
        self.verdicts: dict[SeriesKey, DeviceVerdict] = {}
        self._last: dict[SeriesKey, tuple[str, str | None]] = {}
        self._watch_events: deque[DeviceEvent] = deque(maxlen=4096)
        self._agent: Any = None
        self._closed = False
        self._close_lock = threading.Lock()
        self._nvml_lock = threading.Lock()  # sampling and nvmlShutdown never overlap
        self._start_ns = time.time_ns()
        self.tick_errors = 0
        self.sample_wait_s = max(SAMPLE_WAIT_S, 2 * interval_s)
        self._sampling: asyncio.Future[list[DeviceSample]] | None = None  # the sample in a worker thread
        self.hung_since: float | None = None  # monotonic: since when a sample has not returned
        self.hangs = 0  # times NVML stopped answering
        self._init: asyncio.Future[NvmlStatus] | None = None  # nvmlInit, while it has not returned
        self._init_since = 0.0
        self.reads_given_up = 0  # NVML reads of other features that did not wait for a hung or busy NVML

    @property
    def thresholds(self) -> DeviceThresholds:
        t = self._thresholds
        if t is None:
            assert self._load_thresholds is not None
            t = self._thresholds = self._load_thresholds()  # two threads may both load: the same value
        return t

    @thresholds.setter
    def thresholds(self, value: DeviceThresholds) -> None:
        self._thresholds = value

    # -- health ------------------------------------------------------------------------

    def slow_devices(self) -> dict[str, float]:
        """Devices slow now (:func:`degraded_devices`): device (hw.id, else ``cuda:N``/``cpu``)
        -> its largest coefficient (P99 / peers'); routing lowers their instances' weights."""
        return degraded_devices(self.verdicts.values())

    def slow_devices_of(self, uid: int | None) -> dict[str, float]:
        """The devices ``uid``'s own requests find slow (only its verdicts): what routing
        should weigh that uid's instances by."""
        return degraded_devices(v for v in self.verdicts.values() if v.key.uid == uid)

    def health(self) -> dict[str, Any]:
        """What ``infersight status --json`` shows under ``nvml``."""
        st = self.status
        reason = DISABLED_REASON if not self.enabled else (st.reason if st is not None else None)
        hung = self.hung_reason()
        since = self.hung_since
        return {
            "available": bool(st is not None and st.available and hung is None),
            "reason": hung or reason or self.unavailable_reason,
            "hung_s": None if since is None else round(time.monotonic() - since, 1),
            "hangs": self.hangs,
            "driver_version": st.driver_version if st is not None else None,
            "devices": st.device_count if st is not None else 0,
            "xid_watcher": bool(self.watcher is not None and self.watcher.running),
            "slow_devices": sorted(k for k, v in self.states.items() if v == "degraded"),
            "failed_devices": sorted(k for k, v in self.sampled_states.items() if v == "failed"),  # lost
            "degraded_devices": sorted(k for k, v in self.sampled_states.items() if v == "degraded"),  # ECC
            "slow_coefficient": self.thresholds.slow_coefficient,  # which device rules are in force
        }

    def hung_reason(self) -> str | None:
        """Why samples stopped, while an NVML call has not returned; else None. The same words all along (the
        health metric's reason is a label: how long is ``status``'s ``hung_s``)."""
        return None if self.hung_since is None else HUNG_REASON

    def health_metrics(self) -> list[MetricItem]:
        """The agent's health metric of device sampling: ``infersight.nvml.available`` while
        it is off or not answering (none while NVML answers, or before it was asked)."""
        reason = self.unavailable_reason or self.hung_reason()
        if self._agent is None or reason is None:
            return []
        return [nvml_unavailable(self._agent.resource, reason, self._start_ns, time.time_ns())]

    def publish_health(self) -> None:
        """On each heartbeat of the agent, beside its own health metrics."""
        items = self.health_metrics()
        if items:
            self._agent.broadcaster.publish(items)

    # -- lifecycle ---------------------------------------------------------------------

    async def run(self, agent: AgentContext) -> None:
        self._agent = agent
        self._start_ns = time.time_ns()
        try:
            await self._start_nvml(agent)
            next_eval = time.monotonic() + self.evaluate_interval_s
            while True:
                t0 = time.monotonic()
                evaluate_now = t0 >= next_eval
                if evaluate_now:
                    next_eval = t0 + self.evaluate_interval_s
                try:
                    await self.tick(evaluate_now)
                except Exception:  # one bad interval must not end device monitoring
                    self.tick_errors += 1
                    if self.tick_errors in (1, 10, 100) or self.tick_errors % 1000 == 0:
                        log.exception("device job interval failed (%d so far); continuing", self.tick_errors)
                await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - t0)))
        finally:
            await self.aclose()

    async def _start_nvml(self, agent: AgentContext) -> None:
        """Ask NVML to start (on a daemon thread) and wait for it as long as for a sample; a driver that has
        not answered by then is picked up by a later interval once it does (:meth:`_nvml_ready`)."""
        if self.nvml is None:
            self.unavailable_reason = DISABLED_REASON
            log.info("NVML sampling is off (nvml.enabled = false); request verdicts still run")
            return
        self._init = in_daemon_thread(self.nvml.status, "infersight-nvml-init")
        self._init_since = time.monotonic()
        await asyncio.wait({self._init}, timeout=self.sample_wait_s)
        await self._nvml_ready()

    async def _nvml_ready(self) -> bool:
        """Whether NVML answers; finishes its start (status, the event watcher) once nvmlInit has returned."""
        fut = self._init
        if fut is None:
            return self.nvml is not None and self.status is not None and self.status.available
        if not fut.done():
            if self.unavailable_reason is None:
                self.unavailable_reason = INIT_PENDING_REASON
                log.warning("device sampling waits %.0f s already: %s; request latency and verdicts still run",
                            time.monotonic() - self._init_since, INIT_PENDING_REASON)
            return False
        self._init = None
        late = self.unavailable_reason is not None
        self.unavailable_reason = None
        try:
            st: NvmlStatus = fut.result()
        except Exception as exc:  # (the wrapper does not raise: kept for a binding that does)
            st = NvmlStatus(False, "%s: %s" % (type(exc).__name__, exc))
        self.status = st
        if not st.available:  # the wrapper already logged the reason, once
            self.unavailable_reason = st.reason or "NVML not available"
            log.info("device sampling is off; request latency and verdicts still run")
            return False
        assert self.nvml is not None
        self.watcher = XidWatcher(self.nvml, self._watch_events.append)
        try:
            done, started = await within(in_daemon_thread(self.watcher.start, "infersight-nvml-events"),
                                         self.sample_wait_s)
        except Exception as exc:  # no event watcher: samples and verdicts go on without Xid events
            log.warning("NVML's event watcher did not start: %s: %s", type(exc).__name__, exc)
            done = started = False
        if not (done and started):
            self.watcher.request_stop()  # a start that returns late then starts a thread that ends at once
            self.watcher = None
        log.info(
            "NVML%s: driver %s, %d device(s), sampling every %gs",
            " answered after %.0f s" % (time.monotonic() - self._init_since) if late else "",
            st.driver_version,
            st.device_count,
            self.interval_s,
        )
        return True

    async def aclose(self) -> None:
        """Stop the watcher, publish what is pending, shut NVML down. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            await asyncio.to_thread(watcher.stop, 2.0)
        if self._agent is not None:
            items: list[Item] = self._event_items()
            if self.requests is not None:
                items += self.requests.collect(everything=True)
            items += self.health_metrics()
            if items:
                self._agent.broadcaster.publish(items)
        if self.nvml is not None and self.status is not None and self.status.available:
            await within(in_daemon_thread(self._close_nvml, "infersight-nvml-close"), 2 * NVML_LOCK_WAIT_S)

    def _sample(self) -> list[DeviceSample]:
        assert self.nvml is not None
        with self._nvml_lock:
            return [] if self._closed else self.nvml.sample_all()

    async def _sample_within(self) -> list[DeviceSample]:
        """This interval's samples, waited for at most ``sample_wait_s``: a call that has not returned
        by then stays out on its own daemon thread (no second one starts beside it; the agent still
        exits) and the interval goes on without samples."""
        fut = self._sampling
        if fut is None:
            fut = self._sampling = in_daemon_thread(self._sample, "infersight-nvml-sample")
        try:  # once hung, an interval only looks: it does not wait for the call again
            got = await within(fut, 0.0 if self.hung_since is not None else self.sample_wait_s)
        finally:
            if fut.done():  # returned or raised: the next interval starts a new sample
                self._sampling = None
                if self.hung_since is not None:
                    log.warning("NVML answers again, after %.0f s", time.monotonic() - self.hung_since)
                    self.hung_since = None
        done, samples = got
        if not done:
            if self.hung_since is None:
                self.hung_since = time.monotonic() - self.sample_wait_s
                self.hangs += 1
                log.warning("NVML is not answering: a device sample has not returned for %.0f s; device samples "
                            "wait for it, request histograms and verdicts go on", self.sample_wait_s)
            return []
        return samples or []

    def nvml_call(self, fn: Callable[[], T]) -> T | None:
        """Run ``fn`` (NVML reads, in a worker thread) under the lock that keeps sampling and
        nvmlShutdown apart; None once NVML is shut down, and at once while it is not answering or
        when the read in progress holds it past ``NVML_LOCK_WAIT_S`` (the caller goes on without)."""
        if self._init is not None or not self._lock_answering():  # (nvmlInit out: every read would wait on it)
            self.reads_given_up += 1
            return None
        try:
            return None if self._closed else fn()
        finally:
            self._nvml_lock.release()

    def _lock_answering(self) -> bool:
        """Take the NVML lock, unless a call has not returned (it holds it, or will want it) or the read in
        progress holds it past NVML_LOCK_WAIT_S."""
        return self.hung_since is None and self._nvml_lock.acquire(timeout=NVML_LOCK_WAIT_S)

    def _close_nvml(self) -> None:
        assert self.nvml is not None
        if self._lock_answering():
            try:
                self.nvml.close()
            finally:
                self._nvml_lock.release()
        else:  # a call that never returned holds it: nvmlShutdown would wait behind it
            log.warning("NVML is not answering: closing without nvmlShutdown")

    # -- one interval ------------------------------------------------------------------

    async def tick(self, evaluate_now: bool = False) -> list[Item]:
        """Sample, publish metrics and events; with ``evaluate_now`` also the verdicts."""
        agent = self._agent
        now_ns = time.time_ns()
        samples: list[DeviceSample] = []
        if self.nvml is not None and await self._nvml_ready():
            samples = await self._sample_within()
            if samples or self.hung_since is None:  # a hung interval keeps the device map it had
                self._keep(samples, now_ns)
        items: list[Item] = self._event_items()
        coefficients: list[MetricItem] = []
        if evaluate_now:
            coefficients, logs = self.evaluate(now_ns)
            items += logs
        device = device_metrics(samples, resource=agent.resource, start_ns=self._start_ns, states=self.states)
        items += coefficients
        if self.requests is not None:
            items += self.requests.collect(now_ns, everything=evaluate_now)
            if evaluate_now:
                items += self.requests.self_metrics(agent.resource, self._start_ns, now_ns)
        if items:
            agent.broadcaster.publish(items)
        if device:  # live exporters get every sample, the recorded ones what RecordedSamples picks
            agent.broadcaster.publish_to(device, live=True)
            agent.broadcaster.publish_to(self.recorded.select(device, now_ns), live=False)
        return device + items

    def _keep(self, samples: list[DeviceSample], now_ns: int) -> None:
        horizon = now_ns - int(self.window_s * 1e9)
        requests = self.requests
        # every series' PIDs: read at most once a tick, and only for a sample crowded enough to be cut
        timing = functools.cache(lambda: requests.window.timing_pids() if requests is not None else frozenset())
        devices: list[NvmlDevice] = []
        states: dict[str, HwState] = {}
        for s in samples:
            devices.append(NvmlDevice(s.index, s.uuid, s.name))
            state = health_state(s)
            if state != "ok":
                states[hw_id(s)] = state
            if s.uuid is None:
                continue
            self.names[s.uuid] = s.name
            q = self.samples.get(s.uuid)
            if q is None:
                q = self.samples[s.uuid] = deque(maxlen=MAX_WINDOW_SAMPLES)
            q.append(kept_in_window(s, timing))
        self.sampled_states = states
        for q in self.samples.values():
            while q and q[0].time_ns < horizon:
                q.popleft()
        if self.requests is not None:
            self.requests.set_devices(devices)

    def _event_items(self) -> list[Item]:
        events: list[DeviceEvent] = []
        if self.nvml is not None:
            events += self.nvml.pop_events()
        while self._watch_events:
            events.append(self._watch_events.popleft())
        return [_event_log(self._agent, ev) for ev in sorted(events, key=lambda e: e.time_ns)]

    # -- verdicts ----------------------------------------------------------------------

    def windows(self) -> dict[str, WindowState]:
        from infersight.agent.devices.heterogeneity import summarize_samples

        return {hw: summarize_samples(list(q), self.thresholds) for hw, q in self.samples.items() if q}

    def series_windows(self, now_ns: int) -> Callable[[SeriesKey], WindowState | None]:
        """Each series' window: its device's, with the other processes as that series' requests see
        them (their producers' PIDs and those processes' children are its own; the same uid's servers of
        another model are others). Computed when a slow verdict asks, once per device and sets of PIDs."""
        from infersight.agent.devices.heterogeneity import with_neighbours

        devices = self.windows()
        memo: dict[tuple[str, frozenset[int], frozenset[int]], WindowState] = {}
        requests = self.requests

        def window_of(key: SeriesKey) -> WindowState | None:
            base = devices.get(key.device)
            own = requests.window.pids(key, now_ns / 1e9) if requests is not None else None
            q = self.samples.get(key.device)
            if base is None or own is None or not q:
                return base
            apart = requests.window.other_model_pids(key, now_ns / 1e9) if requests is not None else frozenset()
            hooked = self._hooked_pids(key.uid)
            if hooked is not None:  # a live producer's, not a PID an ended one left for reuse
                apart &= hooked
            own = self._with_hooked_ancestors(own, hooked, apart, key.uid)
            w = memo.get((key.device, own, apart))
            if w is None:
                w = memo[(key.device, own, apart)] = with_neighbours(base, list(q), self.thresholds, own, apart)
            return w

        return window_of

    def _hooked_pids(self, uid: int | None) -> frozenset[int] | None:
        """The kernel's PIDs of ``uid``'s live producers; None where the agent cannot say."""
        pids_of = getattr(self._agent, "hooked_pids", None)  # (an AgentContext of an older make has none)
        return pids_of(uid) if pids_of is not None else None

    def _with_hooked_ancestors(self, own: frozenset[int], hooked: frozenset[int] | None,
                               apart: frozenset[int], uid: int | None = None) -> frozenset[int]:
        """``own`` and its ancestors that are hooked producers of the same uid (``hooked``): what those start is
        the same application's (vLLM's engine core beside the API servers that time the requests, under ``vllm
        serve``; Ray's workers, under the driver that started the raylet; whatever runs under ``launch``).
        A Ray cluster started by ``ray start`` has no hooked parent: its raylet, of the same uid, stands for
        one (the workers it starts for a Serve replica, vLLM's tensor-parallel actors among them). Not one
        that times another model's requests (``apart``): a server that started this one is another."""
        if self.nvml is None or (not hooked and uid is None):
            return own
        nvml = self.nvml
        seen: dict[int, bool] = {}  # ancestor -> whether it stands for the application

        def parent_of_app(a: int) -> bool:
            if a in apart:
                return False
            if hooked and a in hooked:
                return True
            if a not in seen:
                seen[a] = nvml.comm_of(a) == RAYLET and uid is not None and nvml.uid_of(a) == uid
            return seen[a]

        found = {a for pid in own for a in nvml.ancestors_of(pid) or () if parent_of_app(a)}
        return own | found if found else own

    def evaluate(self, now_ns: int) -> tuple[list[MetricItem], list[LogItem]]:
        """Verdicts over the windows: coefficient gauge, degraded states, change events."""
        from infersight.agent.devices.heterogeneity import evaluate as verdicts_of

        agent = self._agent
        stats = self.requests.window.stats(now_ns / 1e9) if self.requests is not None else []
        verdicts = verdicts_of(stats, self.series_windows(now_ns), self.thresholds, self.verdicts)  # (hysteresis)
        self.verdicts = {v.key: v for v in verdicts}
        requests = self.requests

        def name_of(uid: int | None, hw_id: str) -> str | None:  # NVML's, else that uid's hooks' word
            return self.names.get(hw_id) or (requests.name_of(uid, hw_id) if requests is not None else None)
        states: dict[str, HwState] = {}
        points: list[NumberPoint] = []
        logs: list[LogItem] = []
        for device in degraded_devices(verdicts):
            states[device] = "degraded"
        for v in verdicts:
            attrs = _series_attrs(v.key, name_of)
            if v.coefficient is not None:
                points.append(NumberPoint(v.coefficient, dict(attrs)))
            now = (v.verdict, v.cause if v.verdict == "slow" else None)
            before = self._last.get(v.key)
            self._last[v.key] = now
            was_slow = before is not None and before[0] == "slow"
            if now[0] == "slow" and before != now:
                logs.append(self._verdict_log(v, attrs, now_ns, "WARN"))
            elif was_slow and now[0] != "slow":
                logs.append(self._verdict_log(v, attrs, now_ns, "INFO"))
        for key in [k for k in self._last if k not in self.verdicts]:  # series aged out
            if self._last.pop(key)[0] == "slow":
                attrs = _series_attrs(key, name_of)
                attrs["infersight.device.verdict"] = "insufficient_data"
                msg = "%s no longer slow: no requests left in the window" % key.device
                logs.append(LogItem(agent.resource, now_ns, 9, "INFO", msg, attrs, event_name="device"))
        self.states = states
        metrics: list[MetricItem] = []
        if points:
            metrics.append(
                COEFFICIENT_SPEC.item(agent.resource, now_ns, self._start_ns, points)
            )
        return metrics, logs

    def _verdict_log(self, v: DeviceVerdict, attrs: Attributes, now_ns: int, sev: str) -> LogItem:
        a: Attributes = dict(attrs)
        a["infersight.device.verdict"] = v.verdict
        a["infersight.request.count"] = v.count
        a["infersight.request.p50_s"] = v.p50_s
        a["infersight.request.p99_s"] = v.p99_s
        a["infersight.device.peers"] = v.peers
        if v.coefficient is not None:
            a["infersight.device.coefficient"] = v.coefficient
        if v.peer_median_p99_s is not None:
            a["infersight.device.peers.p99_s"] = v.peer_median_p99_s
        if v.verdict == "slow":
            a["hw.state"] = "degraded"
            a["infersight.device.cause"] = v.cause or "unknown"
            a["infersight.device.causes"] = list(v.causes) or ["unknown"]
            body = "%s slow for %s/%s: %s" % (v.key.device, v.key.model or "-", v.key.request_class, v.detail)
        else:
            body = "%s no longer slow for %s/%s: %s (%s)" % (
                v.key.device,
                v.key.model or "-",
                v.key.request_class,
                v.verdict,
                v.detail,
            )
        return LogItem(self._agent.resource, now_ns, _SEVERITY_NUMBER[sev], sev, body, a, event_name="device")


__all__ = ["COEFFICIENT", "DeviceJob"]
