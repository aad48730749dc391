"""What a process killed in its cold start leaves the agent (stdlib only).

A worker SIGKILLed at shutdown runs no exit handler: the stages it finished went out as they
ended, but the sampler's samples and the runs still open here (an import run, ``nn.init``
runs, a warmup run: each is emitted when the next stage starts, at readiness or at the end)
would die with it. So every ``_sampler.TICK_S`` the sampler thread sends one ``cs_tick``
event, at once with whatever is queued (not a batch delay later): the samples taken since
the last one, and the open runs as stages so far, under the span ids they will have. The
agent keeps the latest; if the process dies before its root, the agent closes the root with
those runs and the gaps explained by those samples. A process that ends its cold start
itself sends its own stages and gaps, and the agent drops the checkpoint. Nothing here runs
on the host's threads.
"""

from __future__ import annotations

import time

from . import _recorder as cs
from . import _runtime

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Tuple

    Stage = Tuple[str, str, str, int, int, Dict[str, Any]]

KIND = "cs_tick"
MAX_OPEN = 64  # open runs sent per tick (one per thread and kind, in practice)


def open_stages() -> List[Stage]:
    """The runs not emitted yet, as stages that end at their last known time."""
    out: List[Stage] = cs.open_runs()  # import runs, nn.init runs: the run sources
    st = cs.state()
    init = pending_runtime_init(st)
    if init is not None:
        out.insert(0, init)
    with st.lock:
        w = st.warm
        if w is not None:
            end = w.end if w.inflight == 0 else time.time_ns()
            out.append(("warmup", w.span, w.parent, w.start, max(end, w.start),
                        {"infersight.warmup.forwards": w.n}))
    return out[:MAX_OPEN]


def pending_runtime_init(st: Any) -> Optional[Stage]:
    """``runtime_init`` while it waits for the program's first frame (``_mainstart``), as the root's
    end would emit it now: to where the watch gave up, else to the end of the hooks' set-up (the
    part known to be start-up: a watch a profiler displaced never says when the program began)."""
    try:
        hooks_end = st.init_pending[0]  # (the main thread may claim it meanwhile: then nothing)
    except IndexError:
        return None
    rs = _runtime.state()
    end, attrs = cs.runtime_init_extent(st, hooks_end, 0)
    return ("runtime_init", st.init_span, rs.root_span_id, rs.root_start_ns, max(end, rs.root_start_ns), attrs)


class Checkpoint:
    """The sampler's shipping state: how many of its samples went out, and the open runs sent last."""

    __slots__ = ("sent_open", "shipped", "shipped_ns")

    def __init__(self) -> None:
        self.shipped = 0  # samples sent so far
        self.shipped_ns = 0  # the time of the last sample sent
        self.sent_open: List[Stage] = []

    def tick(self, samples: List[Tuple[int, str]]) -> None:
        """(Sampler thread) Send what changed since the last tick, if anything."""
        if not cs.root_open():
            return
        new = samples[self.shipped:]
        opened = open_stages()
        if not new and opened == self.sent_open:
            return
        labels: Dict[str, int] = {}
        index = [labels.setdefault(lab, len(labels)) for _t, lab in new]
        data: Dict[str, Any] = {"t": [t for t, _lab in new], "i": index, "l": list(labels),
                                "open": [list(s) for s in opened]}
        _runtime.emit_soon(KIND, data)  # sent now, with what is queued: not a batch delay later
        self.shipped += len(new)
        if new:
            self.shipped_ns = new[-1][0]
        self.sent_open = opened

