"""Cold starts in span assembly: roots, their pending stages, checkpoints, and the roots the
agent closes for producers that died (pure: no sockets, no clocks).

The daemon's :class:`~infersight.agent.daemon.assemble.Assembler` hands :class:`ColdStartAssembly`
every span named ``coldstart`` or ``coldstart.*`` (it is a
:class:`~infersight.agent.daemon.assemble.SpanHandler`), the ``cs_tick`` checkpoints (an event
kind), the end of a producer's process, and the producers it forgets. Stage spans are kept
(bounded) until their root arrives, so that the root can carry the time no stage covers and
the summary (:class:`~infersight.telemetry.ColdStart`) lists them; the cold-start observers
(the fleet metrics, weights files) add their items to the summary's batch. A producer killed
before it sent its root gets one made here (``infersight.coldstart.ended_by=producer_lost``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from infersight.agent.coldstart.checkpoint import MAX_SAMPLES, Checkpoint, gap_spans
from infersight.agent.daemon.assemble import (
    HEX16,
    INT64_MAX,
    Assembler,
    KindHandler,
    Malformed,
    Producer,
    attributes,
    descendants,
    span_bytes,
    text_field,
    uint64_field,
)
from infersight.coldstart_stages import as_number, covered_ns, merge, named_intervals, stage_name
from infersight.hooks import _contract
from infersight.telemetry import Attributes, ColdStart, Item, Origin, SpanItem

MAX_PENDING_STAGE_SPANS = 4096  # per producer: stage spans kept for their root's summary
MAX_OPEN_STAGES = 64  # open runs in one cold-start checkpoint
MAX_TICK_SAMPLES = 4096  # samples in one checkpoint (about 40 s at 10 ms: a tick carries 100 ms)
DEFAULT_MAX_PENDING_BYTES = 8 << 20  # per producer: stage spans waiting for their root
# All producers' cold-start state (pending stages and checkpoints), and one uid's share of it: a quarter, as
# for the producer table (root and in-process producers aside). One uid's 1024 producers at their own bound
# once held 10 GiB. The share (16 MiB) holds two producers at their own bound, or a few hundred honest cold
# starts (a stage span is about 500 bytes: a cold start keeps a few hundred KiB at most).
DEFAULT_MAX_COLDSTART_BYTES = 64 << 20
UID_SHARES = 4
SAMPLE_BYTES = 12  # a checkpoint sample: its time (8) and label index (4)
LABEL_BYTES = 128  # a checkpoint label's overhead beside its characters (the str, its list and index slots)
MAX_RECENT_ROOTS = 1024
MAX_STAGE_DEPTH = 64  # stages walked up from an ended parent (hang_under_open_stage)
ROOT_NAME = "coldstart"
STAGE_PREFIX = "coldstart."
STATE_KEY = "coldstart"  # in ``Producer.state``

# ready_wait sources at which the hooks end a root, and "fork": a forked worker's readiness, sent
# when it enters its serving loop, which ends its root if it is killed later without serving.
ROOT_ENDING_READY = frozenset((*_contract.READY_SIGNALS, "fork"))

# Sees each finished cold start (its summary, and the event time it finished at) and returns
# items that go out in the same batch, right after the summary (the fleet metrics).
ColdStartObserver = Callable[[ColdStart, int], Iterable[Item]]
RootKey = tuple[str, str, int | None]  # a root's trace and span id, and its producer's uid (:func:`root_key`)


def span_uid(s: SpanItem) -> int | None:
    """The uid of the producer that sent ``s`` (``process.user.id``, the kernel's word; None in-process)."""
    v = s.resource.get("process.user.id")
    return v if type(v) is int else None


def root_key(s: SpanItem) -> RootKey:
    """A root as the supervisors' bookkeeping knows it: ids are the producer's choice, so another
    user's root of the same ids is another root."""
    return s.trace_id, s.span_id, span_uid(s)


def adopts(parent: int | None, child: int | None) -> bool:
    """Whether a root of uid ``parent`` takes ``child``'s root as its worker: the same user's, or any
    under root's (a root supervisor whose workers run as another user). Trace and span ids are no
    secret (the MQTT ``coldstart`` message carries them): another user's process that names them
    joins no cold start of this one, nor its tree's figure."""
    return parent in (child, 0)


@dataclass(slots=True)
class ColdStartState:
    """One producer's cold-start bookkeeping (``Producer.state["coldstart"]``)."""

    pending: list[SpanItem] = field(default_factory=list)  # stage spans waiting for the root (bounded)
    ended: dict[str, SpanItem] = field(default_factory=dict)  # the same spans by span id
    pending_bytes: int = 0
    pending_dropped: int = 0  # stage spans not kept for the summary (bound reached)
    stages_seen: int = 0
    lost_root_made: bool = False  # the agent closed the root for it (producer_lost)
    # The hooks' cold-start checkpoint (cs_tick): open runs and samples, for a root it never sends.
    checkpoint: Checkpoint | None = None
    checkpoint_bytes: int = 0  # about what the checkpoint holds (open runs, samples, labels)
    label_bytes: int = 0  # of which its labels
    charged: int = 0  # bytes charged to its uid's share (ColdStartAssembly._settle)


def hang_under_open_stage(span: SpanItem, ended: Mapping[str, SpanItem]) -> None:
    """A stage opened by a task or thread context that its parent stage made (``asyncio.create_task`` inside
    it, which copies the current span) after that stage had ended hangs under the innermost stage still open at
    its start (the root at the top), as the waterfall nests by time; ``STAGE_STARTED_IN`` names the stage it
    came from. ``ended``: the producer's stages that ended (and came) before it, by span id; a parent not among
    them is still open, or the root."""
    parent = ended.get(span.parent_span_id) if span.parent_span_id is not None else None
    if parent is None or span.start_ns < parent.end_ns:
        return
    origin = parent
    for _ in range(MAX_STAGE_DEPTH):  # (a cycle of forged parents ends the walk)
        up = parent.parent_span_id
        if up is None:  # (bad data: a stage with no parent) left as sent
            return
        above = ended.get(up)
        if above is None or span.start_ns < above.end_ns:
            span.parent_span_id = up
            span.attributes[_contract.STAGE_STARTED_IN] = stage_name(origin) or origin.name
            return
        parent = above


def budgeted(uid: int | None) -> bool:
    """Whether ``uid`` has a share of cold-start state: root and in-process producers (None) aside."""
    return uid not in (None, 0)


def checkpoint_bytes(cp: Checkpoint, label_bytes: int) -> int:
    """About what ``cp`` holds in memory, its labels' ``label_bytes`` included."""
    return sum(span_bytes(s) for s in cp.open.values()) + len(cp.times) * SAMPLE_BYTES + label_bytes


def state_of(p: Producer) -> ColdStartState:
    """``p``'s cold-start state, made on first use."""
    st: ColdStartState | None = p.state.get(STATE_KEY)
    if st is None:
        st = p.state[STATE_KEY] = ColdStartState()
    return st


class ColdStartAssembly:
    """The cold-start part of span assembly, across the producers of one agent."""

    prefixes: tuple[str, ...] = (ROOT_NAME,)  # span names it takes (``str.startswith``)

    def __init__(self, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 observers: Sequence[ColdStartObserver] = (), *, max_total_bytes: int | None = None) -> None:
        self.max_pending_bytes = max_pending_bytes
        # A raised per-producer bound raises the total with it: a uid's share still holds two producers.
        self.max_total_bytes = (max(DEFAULT_MAX_COLDSTART_BYTES, 2 * UID_SHARES * max_pending_bytes)
                                if max_total_bytes is None else max_total_bytes)
        self.max_uid_bytes = self.max_total_bytes // UID_SHARES
        self._uid_bytes: dict[int | None, int] = {}  # what each budgeted uid's producers hold
        self._budgeted_bytes = 0  # their sum
        self.stages_refused_budget = 0  # stage spans not kept: their uid's share (or the total) was full
        self.ticks_refused_budget = 0  # checkpoints not kept, for the same reason
        self.observers: list[ColdStartObserver] = list(observers)
        self.roots_closed_for_lost = 0  # cold-start roots the agent closed for a producer that died
        self.late_roots_of_lost = 0  # a producer's own root that arrived after that (not exported)
        self.pending_dropped_of_forgotten = 0
        self.recent_roots: OrderedDict[RootKey, SpanItem] = OrderedDict()  # for supervisors' workers
        self.recent_covered: OrderedDict[RootKey, list[tuple[int, int]]] = OrderedDict()  # their trees' stages

    # -- the SpanHandler protocol ------------------------------------------------------

    def span(self, p: Producer, span: SpanItem, t_ns: int, out: list[Item]) -> None:
        """A span whose name starts with ``coldstart``: a root is closed (summary and observers'
        items follow it), a stage is kept for its root's summary; both go out."""
        name = span.name
        if name == ROOT_NAME:
            if span.span_id == p.info.get("root_span_id"):
                if state_of(p).lost_root_made:
                    # Its own root came after all (a spool file replayed late): the agent's
                    # stand-in went out under the same span id, and one span id is one span.
                    self.late_roots_of_lost += 1
                    return
                p.root_closed = True
            self._close_root(p, span, out, t_ns=t_ns)
            return
        if name.startswith(STAGE_PREFIX):
            st = state_of(p)
            p.last_ns = max(p.last_ns, span.end_ns)
            st.stages_seen += 1
            if not p.root_closed:  # else its summary went out already
                hang_under_open_stage(span, st.ended)
                self._keep_pending(p, st, span)
        out.append(span)

    def producer_lost(self, p: Producer) -> list[Item]:
        """The producer's process has ended. If it sent cold-start stages but never its root
        (killed before its exit handlers ran), close the root here: ended at the last event
        seen, ``infersight.coldstart.ended_by=producer_lost``; a stage still open then (seen
        only as the missing parent of a stage that ended) is closed with it. Then free the
        producer's pending state. Returns the items to export."""
        out: list[Item] = []
        st: ColdStartState | None = p.state.get(STATE_KEY)
        if st is None:
            return out
        root_id = p.info.get("root_span_id")
        # A root that went out before an agent restart (its hello says so) is not made again.
        cp = st.checkpoint
        if ((st.stages_seen or cp is not None) and not p.root_closed and not p.info.get("root_ended")
                and isinstance(root_id, str)):
            p.root_closed = st.lost_root_made = True
            self.roots_closed_for_lost += 1
            end = max(p.last_ns, int(p.info["start_ns"]))
            ready_spans = sorted((s for s in st.pending if s.name == "coldstart.ready_wait"
                                  and s.attributes.get(_contract.READY_SOURCE) in ROOT_ENDING_READY),
                                 key=lambda s: s.end_ns)
            ready = [s.end_ns for s in ready_spans]
            attrs: Attributes = {"faas.coldstart": True, _contract.ENDED_BY: _contract.ENDED_BY_PRODUCER_LOST}
            if ready and min(ready) <= end:
                # the hooks would have ended it at readiness: what it sent later (its first
                # request) lies after the root, and the wait for traffic is in no share
                end = min(ready)
                attrs[_contract.ENDED_BY] = _contract.ENDED_BY_READY
                # as the hooks' own root would say: when, and from what
                attrs[_contract.READY_S] = (end - int(p.info["start_ns"])) / 1e9
                source = ready_spans[0].attributes.get(_contract.READY_SOURCE)
                if source is not None:  # (one of ROOT_ENDING_READY: the spans were chosen by it)
                    attrs[_contract.READY_SOURCE] = source
            parent = p.info.get("root_parent")
            root = SpanItem(p.resource, p.info["trace_id"], root_id,
                            parent if isinstance(parent, str) and HEX16.match(parent) else None,
                            ROOT_NAME, int(p.info["start_ns"]), end, attrs,
                            p.span_events.pop(root_id, []), None, Origin(p.id, 0))
            if cp is not None:  # the runs it had open at its last checkpoint, as they were then
                seen = {s.span_id for s in st.pending}
                for s in cp.open.values():
                    if s.span_id not in seen:
                        s.end_ns = min(s.end_ns, end)
                        s.start_ns = min(s.start_ns, s.end_ns)
                        s.events = p.span_events.pop(s.span_id, [])
                        st.pending.append(s)
                        out.append(s)
            stages = self._close_open_stages(p, st, root, out)
            if cp is not None:  # and the gaps, explained by the samples it had sent
                gaps = gap_spans(cp, root, stages)
                out.extend(gaps)
                stages.extend(gaps)
            self._close_root(p, root, out, stages)
        st.checkpoint = None
        st.checkpoint_bytes = st.label_bytes = 0
        st.pending_dropped += len(st.pending)  # stages of a root that never comes
        st.pending = []
        st.ended = {}
        st.pending_bytes = 0
        self._settle(p, st)
        return out

    def awaits_end(self, p: Producer) -> bool:
        """Whether ``p``'s process end still matters: stages kept, or a cold start still open
        (stages seen, or only a checkpoint: killed before its first stage ended)."""
        st: ColdStartState | None = p.state.get(STATE_KEY)
        return st is not None and bool(st.pending or ((st.stages_seen or st.checkpoint is not None)
                                                      and not p.root_closed and not p.info.get("root_ended")))

    def forget(self, p: Producer) -> None:
        """``p`` leaves the producer table: keep its drop count in the totals."""
        st: ColdStartState | None = p.state.get(STATE_KEY)
        if st is not None:
            self.pending_dropped_of_forgotten += st.pending_dropped + len(st.pending)
            # Out of the table, its state is no longer its uid's to hold (a watch may still close it).
            self._charge(p.uid, -st.charged)
            st.charged = 0

    def stats(self, producers: Iterable[Producer]) -> dict[str, int]:
        """Its counters over the producers in the table, for the assembler's stats
        (``infersight status --json``, the agent's health metrics)."""
        states = [st for p in producers if (st := p.state.get(STATE_KEY)) is not None]
        return {
            "pending_bytes": sum(st.pending_bytes for st in states),
            "checkpoint_bytes": sum(st.checkpoint_bytes for st in states),
            "pending_stages_dropped": self.pending_dropped_of_forgotten + sum(st.pending_dropped for st in states),
            "pending_stages_refused_uid_budget": self.stages_refused_budget,
            "coldstart_ticks_refused_uid_budget": self.ticks_refused_budget,
            "coldstart_roots_closed_for_lost": self.roots_closed_for_lost,
            "coldstart_late_roots_of_lost": self.late_roots_of_lost,
        }

    # -- the cs_tick event kind ----------------------------------------------------------

    def checkpoint(self, p: Producer, origin: Origin, t_ns: int, d: dict[str, Any], out: list[Item]) -> None:
        """(KindHandler of ``cs_tick``) The open runs replace the last ones; the samples add up
        (bounded)."""
        if p.root_closed:
            return
        opened, times, ids, labels = d.get("open", []), d.get("t", []), d.get("i", []), d.get("l", [])
        if not isinstance(opened, list) or len(opened) > MAX_OPEN_STAGES:
            raise Malformed("open must be a list of at most %d stages" % MAX_OPEN_STAGES)
        if (not isinstance(times, list) or not isinstance(ids, list) or not isinstance(labels, list)
                or len(times) != len(ids) or len(times) > MAX_TICK_SAMPLES or len(labels) > len(times)):
            raise Malformed("samples must be lists t and i of one length, and their labels l")
        stages: dict[str, SpanItem] = {}
        for o in opened:
            if type(o) is not list or len(o) != 6:
                raise Malformed("an open stage is [stage, span id, parent id, start, end, attributes]")
            stage, span_id, parent = text_field(o[0], "stage", 64), o[1], o[2]
            if not isinstance(span_id, str) or not HEX16.match(span_id) or not isinstance(parent, str) \
                    or not HEX16.match(parent):
                raise Malformed("open stage ids must be 16 lowercase hex digits")
            start, end = uint64_field(o[3], "start"), uint64_field(o[4], "end")
            if end < start:
                raise Malformed("an open stage ends before it starts")
            attrs = attributes(o[5])
            attrs[_contract.STAGE] = stage
            stages[span_id] = SpanItem(p.resource, p.info["trace_id"], span_id, parent, STAGE_PREFIX + stage,
                                       start, end, attrs, [], None, Origin(p.id, 0))
        label_list = [text_field(lab, "label", 512) for lab in labels]
        if any(type(t) is not int or not 0 <= t <= INT64_MAX for t in times) or any(
                type(i) is not int or not 0 <= i < len(label_list) for i in ids):
            raise Malformed("sample times must be integers and their label indices in range")
        st = state_of(p)
        if not self._fits(p, self._tick_growth(st.checkpoint, stages, len(times), label_list)):
            self.ticks_refused_budget += 1  # the last checkpoint kept stays
            return
        cp = st.checkpoint = st.checkpoint or Checkpoint()
        cp.open = stages
        known = len(cp.labels)
        cp.add_samples(times, ids, label_list)
        st.label_bytes += sum(len(lab) + LABEL_BYTES for lab in cp.labels[known:])
        st.checkpoint_bytes = checkpoint_bytes(cp, st.label_bytes)
        self._settle(p, st)

    @staticmethod
    def _tick_growth(cp: Checkpoint | None, opened: dict[str, SpanItem], samples: int, labels: list[str]) -> int:
        """At most how many bytes a tick adds to the checkpoint ``cp`` (its open runs replace the last)."""
        if cp is None:
            cp = Checkpoint()
        growth = sum(span_bytes(s) for s in opened.values()) - sum(span_bytes(s) for s in cp.open.values())
        growth += min(samples, max(MAX_SAMPLES - len(cp.times), 0)) * SAMPLE_BYTES
        return growth + sum(len(lab) + LABEL_BYTES for lab in set(labels) if lab not in cp.index)

    # -- the per-uid budget ----------------------------------------------------------------

    def _fits(self, p: Producer, growth: int) -> bool:
        """Whether ``p``'s cold-start state may grow by ``growth`` bytes: within its uid's share and
        the total. Past them only that uid's new state is refused: no other uid's gives way."""
        if growth <= 0 or not budgeted(p.uid):
            return True
        return (self._uid_bytes.get(p.uid, 0) + growth <= self.max_uid_bytes
                and self._budgeted_bytes + growth <= self.max_total_bytes)

    def _settle(self, p: Producer, st: ColdStartState) -> None:
        """Charge ``p``'s uid with what its cold-start state holds now."""
        held = st.pending_bytes + st.checkpoint_bytes
        self._charge(p.uid, held - st.charged)
        st.charged = held

    def _charge(self, uid: int | None, delta: int) -> None:
        if not delta or not budgeted(uid):
            return
        left = self._uid_bytes.get(uid, 0) + delta
        if left > 0:
            self._uid_bytes[uid] = left
        else:
            self._uid_bytes.pop(uid, None)
        self._budgeted_bytes += delta

    # -- summaries -------------------------------------------------------------------------

    def observe(self, cs: ColdStart, t_ns: int) -> list[Item]:
        """What the cold-start observers add for ``cs``, finished at ``t_ns``: called for each
        root closed here, and by ``launch`` for a root only the launcher saw."""
        return [item for observer in self.observers for item in observer(cs, t_ns)]

    def _close_root(
        self, p: Producer, root: SpanItem, out: list[Item], stages: list[SpanItem] | None = None,
        *, t_ns: int | None = None,
    ) -> None:
        """Export ``root``, the cold-start summary of the stages under it, and what the
        cold-start observers add (its fleet metrics)."""
        st = state_of(p)
        if stages is None:
            stages = descendants(root.span_id, st.pending)
        workers = self._workers_of(root, stages)
        # An explicit ``unattributed`` span explains a gap; it never counts as covered. A
        # worker's root is no stage of ours: its named stages cover our time in the tree's
        # figure only, and never its whole lifetime.
        worker_covered = [iv for w in workers for iv in self.recent_covered.get(root_key(w), ())]
        total = root.end_ns - root.start_ns
        # The hooks' own figure when it is the larger: stages sent to an agent before a restart are not here.
        said = as_number(root.attributes.get(_contract.COVERED_S))
        hooks_ns = int(min(total, max(0.0, said * 1e9))) if said is not None and math.isfinite(said) else 0
        root.attributes[_contract.UNATTRIBUTED_S] = (total - max(covered_ns(stages, root), hooks_ns)) / 1e9
        if workers:
            root.attributes["infersight.coldstart.tree_unattributed_s"] = (
                total - max(covered_ns(stages, root, worker_covered), hooks_ns)) / 1e9
        root.attributes.setdefault("faas.coldstart", True)
        self._remember_covered(root, named_intervals(stages), worker_covered)
        done = {s.span_id for s in stages}
        st.pending = [s for s in st.pending if s.span_id not in done]
        st.ended = {s.span_id: s for s in st.pending}
        st.checkpoint = None  # the root came (or was made): no more use for it
        st.checkpoint_bytes = st.label_bytes = 0
        st.pending_bytes = sum(span_bytes(s) for s in st.pending)
        self._settle(p, st)
        out.append(root)
        cs = ColdStart(root, sorted(stages, key=lambda s: s.start_ns), workers, merge(worker_covered))
        out.append(cs)
        out.extend(self.observe(cs, root.end_ns if t_ns is None else t_ns))

    def _keep_pending(self, p: Producer, st: ColdStartState, span: SpanItem) -> None:
        """Keep a stage span for its root's summary, within the per-producer byte bound:
        the oldest pending spans give way (counted); the span itself is exported anyway.
        Past its uid's share the span is not kept (counted): one uid's many producers
        once held 8 MiB each."""
        size = span_bytes(span)
        if not self._fits(p, size):
            st.pending_dropped += 1
            self.stages_refused_budget += 1
            return
        st.pending.append(span)
        st.ended[span.span_id] = span
        st.pending_bytes += size
        drop, n = 0, len(st.pending)
        while drop < n and (st.pending_bytes > self.max_pending_bytes or n - drop > MAX_PENDING_STAGE_SPANS):
            st.pending_bytes -= span_bytes(st.pending[drop])
            st.ended.pop(st.pending[drop].span_id, None)
            drop += 1
        if drop:
            del st.pending[:drop]
            st.pending_dropped += drop
        self._settle(p, st)

    @staticmethod
    def _close_open_stages(p: Producer, st: ColdStartState, root: SpanItem, out: list[Item]) -> list[SpanItem]:
        """Stages under ``root``, plus a closed stand-in for every stage that was still open:
        the missing parent of a stage that ended (its name was never sent)."""
        known = {s.span_id for s in st.pending} | {root.span_id}
        children: dict[str, list[SpanItem]] = {}
        for s in st.pending:
            if s.parent_span_id is not None and s.parent_span_id not in known:
                children.setdefault(s.parent_span_id, []).append(s)
        stages = list(st.pending)
        for span_id, kids in children.items():
            stand_in = SpanItem(
                p.resource, root.trace_id, span_id, root.span_id, "coldstart.interrupted",
                min(k.start_ns for k in kids), root.end_ns,
                {_contract.STAGE: "interrupted", _contract.ENDED_BY: _contract.ENDED_BY_PRODUCER_LOST},
                p.span_events.pop(span_id, []), "the process ended inside this stage", Origin(p.id, 0),
            )
            out.append(stand_in)
            stages.append(stand_in)
        return stages

    def _remember_covered(self, root: SpanItem, own: list[tuple[int, int]],
                          workers: list[tuple[int, int]]) -> None:
        """What a closed root's tree covers, for its supervisor (merged intervals, bounded
        like the roots)."""
        self.recent_covered[root_key(root)] = merge([*own, *workers])
        while len(self.recent_covered) > MAX_RECENT_ROOTS:
            self.recent_covered.popitem(last=False)

    def _workers_of(self, root: SpanItem, stages: list[SpanItem]) -> list[SpanItem]:
        """Roots of other processes (not helpers) already seen under this root or its stages, that
        it adopts (:func:`adopts`: its own user's, any under root's); remembers this root for its own
        parent."""
        ids = {root.span_id, *(s.span_id for s in stages)}
        uid = span_uid(root)
        workers = [r for r in self.recent_roots.values()
                   if r.trace_id == root.trace_id and r.parent_span_id in ids and adopts(uid, span_uid(r))
                   and r.attributes.get(_contract.PROCESS_ROLE) != _contract.ROLE_HELPER]
        self.recent_roots[root_key(root)] = root
        if len(self.recent_roots) > MAX_RECENT_ROOTS:
            self.recent_roots.popitem(last=False)
        return sorted(workers, key=lambda r: r.start_ns)


def coldstart_assembler(host_name: str | None = None, handlers: Mapping[str, KindHandler] | None = None, *,
                        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                        observers: Sequence[ColdStartObserver] = (),
                        max_total_bytes: int | None = None) -> Assembler:
    """An assembler that assembles cold starts as the agent's does (tests, benches, tools):
    the daemon's :class:`Assembler` with a :class:`ColdStartAssembly` (``span_handlers[0]``)
    and its ``cs_tick`` kind, beside ``handlers``."""
    cs = ColdStartAssembly(max_pending_bytes, observers, max_total_bytes=max_total_bytes)
    return Assembler(host_name, {"cs_tick": cs.checkpoint, **(handlers or {})}, [cs])
