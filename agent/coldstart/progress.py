"""Live progress of cold starts, and the history that predicts them.

The tracker watches the items the agent publishes. A producer's first cold-start stage
span starts its tracking; each further stage updates it; its ``ColdStart`` (the root has
ended, or the agent closed it for a producer that went away) ends it and appends the run to
the history of its service key. Readiness (``ready_wait``) ends the *warming* state that
gateways care about, even though the root may end a little later.

While a service has processes warming, :meth:`ProgressTracker.tick` returns at most one
``ColdStartProgress`` for it per second (and one at once on a stage change), describing its
least advanced process, and one with ``state=None`` when none warms any more: MQTT clears
its retained topic on that, Prometheus drops its gauges, the console erases its line.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from infersight.agent.coldstart import history as ch
from infersight.agent.coldstart.eta import MAX_STAGES, UNATTRIBUTED, Estimate, Run, predict
from infersight.hooks import _contract
from infersight.hooks._pagestate import page_cache_ratio
from infersight.telemetry import ColdStart, ColdStartProgress, Item, Resource, SpanItem
from infersight.weights_files import COLD_BELOW

log = logging.getLogger("infersight.agent.progress")
MIN_INTERVAL_NS = 1_000_000_000  # at most one update a second per process, but at once on a change
MAX_WARMING = 1024
MAX_DONE = 4096  # producers whose cold start ended, remembered so later stages do not restart it
MAX_AGE_NS = 3600 * 1_000_000_000  # a cold start silent this long is forgotten, not tracked forever
READY_STAGE = _contract.READY_WAIT
MAX_WARMING_PER_UID = MAX_WARMING // 4


def uid_of(resource: Resource) -> int | None:
    """The producer's uid, as the kernel told the agent (``process.user.id``)."""
    v = resource.get("process.user.id")
    return v if type(v) is int else None


def cmdline_of(pid: int, proc_root: str = "/proc") -> list[str] | None:
    try:
        with open("%s/%d/cmdline" % (proc_root, pid), "rb") as f:
            raw = f.read(65536)
    except OSError:
        return None
    args = [a.decode("utf-8", "replace") for a in raw.split(b"\0")]
    return args[:-1] if args and args[-1] == "" else args or None


@dataclass
class Warming:
    """One process in its cold start."""

    producer: str
    resource: Resource
    service: str
    pid: int
    uid: int | None
    key: str
    start_ns: int
    cache: str | None
    root_span_id: str | None = None
    ended: list[tuple[int, str, float]] = field(default_factory=list)  # (start_ns, stage, end offset s), by start
    last_stage: str | None = None
    last_event_ns: int = 0
    changed: bool = True
    ready: bool = False
    helper: bool = False


def _cache_of(stages: Sequence[SpanItem]) -> str:
    ratios = [s.attributes.get(_contract.WEIGHTS_PAGE_CACHE_RATIO) for s in stages]
    nums = [float(r) for r in ratios if isinstance(r, (int, float)) and not isinstance(r, bool)]
    compile_states = {str(s.attributes.get(_contract.COMPILE_CACHE)) for s in stages
                      if s.attributes.get(_contract.COMPILE_CACHE) is not None}
    compile_cache = compile_states.pop() if len(compile_states) == 1 else ("mixed" if compile_states else None)
    return ch.cache_state(min(nums) if nums else None, compile_cache)


def weights_paths(stages: Iterable[SpanItem]) -> list[str]:
    paths = {s.attributes.get(_contract.WEIGHTS_PATH) for s in stages}
    return sorted(p for p in paths if isinstance(p, str) and p)


def stage_name(span: SpanItem) -> str:
    """Cut as history keeps it (:func:`history.stage_label`): live milestones match recorded ones."""
    return ch.stage_label(str(span.attributes.get(_contract.STAGE) or span.name.removeprefix("coldstart.")))


def run_of(cs: ColdStart) -> Run:
    """The history record of a finished cold start: top-level stages in start order, those
    within the root (not a first request that came after a root ended at readiness)."""
    root = cs.root
    top = sorted((s for s in cs.stages if s.parent_span_id == root.span_id and s.start_ns < root.end_ns),
                 key=lambda s: s.start_ns)[:MAX_STAGES]
    stages = tuple(
        (stage_name(s), (s.end_ns - s.start_ns) / 1e9, (s.end_ns - root.start_ns) / 1e9) for s in top
    )
    return Run(stages, (root.end_ns - root.start_ns) / 1e9, _cache_of(cs.stages), root.end_ns / 1e9)


class ProgressTracker:
    """Cold starts in progress for one agent, with ETAs from ``history_path``."""

    def __init__(
        self,
        history_path: str | None,
        *,
        producer_info: Callable[[str], dict[str, Any] | None] | None = None,
        clock: Callable[[], int] = time.time_ns,
        proc_root: str = "/proc",
        max_warming_per_uid: int = MAX_WARMING_PER_UID,
    ) -> None:
        self.history_path = history_path
        self.history = ch.load(history_path) if history_path else ch.History()
        self.lines_on_disk = self.history.lines_read
        self.bytes_on_disk = self.history.bytes_read
        self.weights_of: dict[str, list[str]] = {}  # key -> weights paths of its latest run
        self.producer_info = producer_info or (lambda _p: None)
        # The PID this agent's /proc shows a producer's process under (None: another PID namespace, where the
        # hello's pid names some other process here); without it, the resource's process.pid.
        self.visible_pid: Callable[[str], int | None] | None = None
        self.clock = clock
        self.proc_root = proc_root
        self.warming: dict[str, Warming] = {}
        # pid -> the command line it was started with, for a process that may be gone when its
        # events are read (launch holds its agent back while CMD starts: ``launch_hold``)
        self.known_commands: dict[int, list[str]] = {}
        # Each uid's share of the table: one user's processes cannot starve another's progress.
        self.max_warming_per_uid = max_warming_per_uid
        self.warming_by_uid: dict[int | None, int] = {}
        self.refused_warming = 0  # cold starts not tracked: the table or the uid's share was full
        # Producers whose cold start ended (the one longest without a stage first): a stage
        # they open later (per request, say) is not a new cold start, and must not show the
        # service as warming; nor after an agent restart (their hello says the root ended).
        self.done: dict[str, None] = {}
        self.sent: dict[str, tuple[int, Resource, int]] = {}  # service -> (last sent, resource, pid)
        self.recorded = 0
        self.record_errors = 0

    # -- input ---------------------------------------------------------------------------

    def observe(self, items: Sequence[Item]) -> None:
        for it in items:
            if isinstance(it, SpanItem) and it.name.startswith("coldstart.") and it.origin is not None:
                self._stage(it)
            elif isinstance(it, ColdStart):
                self._finished(it)

    def _begin(self, span: SpanItem) -> Warming | None:
        producer = span.origin.producer if span.origin else ""
        uid = uid_of(span.resource)
        if len(self.warming) >= MAX_WARMING or self.warming_by_uid.get(uid, 0) >= self.max_warming_per_uid:
            self.refused_warming += 1  # the table, or this uid's share of it, is full
            return None
        info = self.producer_info(producer) or {}
        if info.get("root_ended"):  # its cold start ended before this agent started
            self._remember_done(producer)
            return None
        resource = span.resource
        service = str(resource.get("service.name") or "unknown_service")
        pid_v = resource.get("process.pid")
        pid = int(pid_v) if isinstance(pid_v, int) else 0
        key = self._key_of(resource, service, self._pid_here(producer, resource))
        start = int(info.get("start_ns") or span.start_ns)
        w = Warming(producer, resource, service, pid, uid_of(resource), key, start, self._live_cache(key))
        w.root_span_id = info.get("root_span_id") or span.parent_span_id
        w.helper = span.attributes.get(_contract.PROCESS_ROLE) == _contract.ROLE_HELPER
        self.warming[producer] = w
        self.warming_by_uid[uid] = self.warming_by_uid.get(uid, 0) + 1
        return w

    def _forget(self, producer: str) -> Warming | None:
        w = self.warming.pop(producer, None)
        if w is not None:
            n = self.warming_by_uid.get(w.uid, 1) - 1
            if n > 0:
                self.warming_by_uid[w.uid] = n
            else:
                self.warming_by_uid.pop(w.uid, None)
        return w

    def _live_cache(self, key: str) -> str | None:
        """The weights part of the cache state, probed on the files the last run of this key read."""
        paths = self.weights_of.get(key)
        if paths is None:
            runs = self.history.of(key)
            if not runs:
                return None
            paths = []
        if not paths:
            return None
        ratio = page_cache_ratio(paths)
        if ratio is None:
            return None
        return "weights=%s" % ("warm" if ratio >= COLD_BELOW else "cold")

    def _stage(self, span: SpanItem) -> None:
        producer = span.origin.producer if span.origin else ""
        w = self.warming.get(producer)
        if w is None:
            if producer in self.done:
                self.done[producer] = self.done.pop(producer)  # still serving: evicted last
                return
            w = self._begin(span)
            if w is None:
                return
        stage = stage_name(span)
        if span.attributes.get(_contract.PROCESS_ROLE) == _contract.ROLE_HELPER:
            w.helper = True
        if stage != UNATTRIBUTED and span.parent_span_id == w.root_span_id:
            # The first MAX_STAGES by start time, as history keeps a run (``run_of``).
            if len(w.ended) < MAX_STAGES or span.start_ns < w.ended[-1][0]:
                bisect.insort(w.ended, (span.start_ns, stage, (span.end_ns - w.start_ns) / 1e9))
                del w.ended[MAX_STAGES:]
            w.last_stage = stage
        w.last_event_ns = max(w.last_event_ns, span.end_ns)
        w.changed = True
        if stage == READY_STAGE:
            w.ready = True

    def _finished(self, cs: ColdStart) -> None:
        producer = cs.root.origin.producer if cs.root.origin else None
        w = self._forget(producer) if producer else None
        if producer:
            self._remember_done(producer)
        if cs.root.attributes.get(_contract.PROCESS_ROLE) == _contract.ROLE_HELPER or (w is not None and w.helper):
            return
        service = str(cs.root.resource.get("service.name") or "unknown_service")
        key = w.key if w is not None else self._key_of(cs.root.resource, service,
                                                      self._pid_here(producer or "", cs.root.resource))
        run = self.history.add(key, run_of(cs))  # as kept: bounded
        self.weights_of[key] = weights_paths(cs.stages)
        self.recorded += 1
        if self.history_path:
            try:
                self._write(self.history_path, key, run)
            except OSError as e:
                self.record_errors += 1
                if self.record_errors == 1:
                    log.warning("cannot write the cold-start history %s: %s", self.history_path, e)

    def _write(self, path: str, key: str, run: Run) -> None:
        """Append the run; compact the file when it holds twice what is kept, or has no room for
        the line (it never passes ``MAX_FILE_BYTES``, so a load reads back every run kept)."""
        size = ch.append(path, key, run)
        if size is not None:
            self.lines_on_disk += 1
            self.bytes_on_disk = size
            if not ch.needs_compaction(self.lines_on_disk, self.history, self.bytes_on_disk):
                return
        # What other writers (launch) appended too; the run itself when the file had no room for it.
        merged = ch.compact(path, key, run) if size is None else ch.compact(path)
        merged.runs_cut, merged.runs_pushed_out = self.history.runs_cut, self.history.runs_pushed_out  # not twice
        self.history = merged
        self.lines_on_disk = sum(len(r) for r in merged.runs.values())
        self.bytes_on_disk = merged.bytes

    def _remember_done(self, producer: str) -> None:
        self.done[producer] = None
        if len(self.done) > MAX_DONE:
            del self.done[next(iter(self.done))]  # the one longest without a stage

    def _pid_here(self, producer: str, resource: Resource) -> int | None:
        """The producer's PID in this agent's /proc (``visible_pid``), else its resource's process.pid (no
        producer behind it: launch's own root of CMD, whose pid launch itself saw)."""
        if self.visible_pid is not None and producer and self.producer_info(producer) is not None:
            return self.visible_pid(producer)
        pid = resource.get("process.pid")
        return pid if isinstance(pid, int) and not isinstance(pid, bool) else None

    def _key_of(self, resource: Resource, service: str, pid: int | None) -> str:
        """The history key (:func:`history.service_key`): the service, the producer's uid (the
        kernel's), and its command line's shape: /proc's for ``pid`` (the process as this agent sees it;
        None: it cannot), else ``argv0``."""
        command = cmdline_of(pid, self.proc_root) if pid else None
        if not command:  # (a zombie's cmdline is empty) exited before its events were read: launch's CMD, whose
            said = resource.get("process.pid")  # pid launch saw spawning it, in its own namespace
            command = self.known_commands.get(said) if isinstance(said, int) else None
        return ch.service_key(service, command or [str(resource.get("process.command") or "")], uid=uid_of(resource))

    # -- output --------------------------------------------------------------------------

    def estimate(self, w: Warming, now_ns: int) -> Estimate:
        elapsed = max(0.0, (now_ns - w.start_ns) / 1e9)
        ended = [(stage, end) for _start, stage, end in w.ended]  # kept in start order
        return predict(self.history.of(w.key), ended, elapsed, cache=w.cache)

    def state(self, w: Warming, now_ns: int) -> dict[str, Any]:
        est = self.estimate(w, now_ns)
        return {
            "service": w.service,
            "pid": w.pid,
            "uid": w.uid,
            "stage": est.stage or w.last_stage,
            "elapsed_s": round(est.elapsed_s, 3),
            "eta_s": None if est.eta_s is None else round(est.eta_s, 3),
            "eta_runs": est.runs,
            "eta_spread_s": None if est.spread_s is None else round(est.spread_s, 3),
            "progress": None if est.progress is None else round(est.progress, 4),
            "cache": w.cache,
        }

    def snapshot(self, now_ns: int | None = None) -> list[dict[str, Any]]:
        """The processes in their cold start, for ``status --json``."""
        now = self.clock() if now_ns is None else now_ns
        return [self.state(w, now) for w in self.warming.values() if not w.ready and not w.helper]

    def tick(self, now_ns: int | None = None) -> list[ColdStartProgress]:
        """Per-service updates due now: at once on a change, else at most once a second.

        A service's update describes its least advanced warming process (the largest ETA):
        the service is ready when its last worker is. When none of its processes warms any
        more, one update with ``state=None`` clears it.
        """
        now = self.clock() if now_ns is None else now_ns
        for producer, w in list(self.warming.items()):
            if now - max(w.last_event_ns, w.start_ns) > MAX_AGE_NS:
                self._forget(producer)
        by_service: dict[str, list[Warming]] = {}
        for w in self.warming.values():
            if not w.ready and not w.helper:
                by_service.setdefault(w.service, []).append(w)
        out: list[ColdStartProgress] = []
        for service in list(self.sent):
            if service not in by_service:
                resource, pid = self.sent.pop(service)[1:]
                out.append(ColdStartProgress(resource, service, pid, now, None))
        for service, ws in by_service.items():
            changed = any(w.changed for w in ws)
            last = self.sent.get(service)
            if not changed and last is not None and now - last[0] < MIN_INTERVAL_NS:
                continue
            states = [(self.state(w, now), w) for w in ws]
            state, w = max(states, key=lambda sw: (sw[0]["eta_s"] or 0.0, -sw[1].start_ns))
            state["processes"] = len(ws)
            state["uids"] = sorted({x.uid for x in ws if x.uid is not None})
            out.append(ColdStartProgress(w.resource, service, w.pid, now, state))
            self.sent[service] = (now, w.resource, w.pid)
            for x in ws:
                x.changed = False
        return out

    def end_all(self) -> None:
        """The agent stops: nothing warms any more; the next tick clears what was shown."""
        self.warming.clear()
        self.warming_by_uid.clear()


def history_path_from(state_dir: str | None) -> str | None:
    if not state_dir:
        return None
    return os.path.join(state_dir, ch.FILE_NAME)
