"""The cold-start stack sampler and the unattributed stretches it explains (stdlib only).

A daemon thread, alive only while the cold start is being collected: every
``INTERVAL_S`` it takes the main thread's stack (``sys._current_frames``) and keeps one
label per sample, ``"module:function"`` of the innermost frame outside the standard
library and these hooks (the code that is really running, not ``posixpath.join``). Inside
a timed import (``in_import``: the import timing's own stack for the main thread), which
the import run covers, ever more sparsely, down to once per ``TICK_S``,
and its tick (``tick``: supervisors, the kernel's listening sockets) every
``IMPORT_TICK_S``: each wake-up, and each system call of the tick, takes the GIL from the
busy main thread (a forced switch). The checkpoint (``ship``) keeps its ``TICK_S`` there too:
a process SIGKILLed inside an import loses at most that much of its samples.
At the end of the cold start, every stretch of at least ``MIN_GAP_NS`` that no stage
covers becomes a ``coldstart.unattributed`` span with its sample count and, from
``MIN_SAMPLES`` samples on, the top labels of its samples: one or two samples of a gap
(a garbage collection that happened to run then) name a frame "100%" by chance.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from . import _contract, _env

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

INTERVAL_S: float = _env.VARS["INFERSIGHT_SAMPLER_INTERVAL_MS"].default / 1e3
MIN_GAP_NS = 50_000_000
MAX_SAMPLES = 200_000  # 30+ minutes at 10 ms; a sampler never grows without bound
MAX_RUN_S = 3600.0  # a cold start that never ends (a helper that lives forever) stops it
TOP = 5
MIN_SAMPLES = _contract.MIN_GAP_SAMPLES  # fewer samples in a gap name no frame
TICK_S = 0.1
IMPORT_INTERVAL_S = TICK_S  # the longest sleep while the main thread is inside an import
IMPORT_TICK_S = 0.3  # the tick's period meanwhile

_STDLIB = os.path.dirname(os.__file__)
_HOOKS = os.path.dirname(os.path.abspath(__file__))


def _env_interval() -> float:
    v = float(_env.get("INFERSIGHT_SAMPLER_INTERVAL_MS")) / 1000
    return min(max(v, 0.001), 1.0)


class Sampler:
    """Samples the main thread until ``stop()``; ``samples`` holds (t_ns, label)."""

    def __init__(self, main_ident: int, interval_s: Optional[float] = None,
                 tick: Optional[Callable[[], None]] = None, sample: bool = True,
                 in_import: Optional[Callable[[], bool]] = None,
                 ship: Optional[Callable[[], None]] = None) -> None:
        self.main_ident = main_ident
        # whether the main thread is inside an import the import timing covers (None: never)
        self.in_import = in_import
        self.tick = tick  # called about every TICK_S (the supervisor check, the listening sockets)
        self.ship = ship  # called about every TICK_S, inside imports too (the checkpoint)
        self.done: Optional[Callable[[], None]] = None  # called when the thread ends
        self.sample = sample  # False (INFERSIGHT_SAMPLER=0): only the tick, every TICK_S
        self.interval_s = interval_s if interval_s is not None else (_env_interval() if sample else TICK_S)
        self.samples: List[Tuple[int, str]] = []
        self._stop = threading.Event()
        # id(code) -> (code, its label): a code object's own hash walks its bytecode and
        # constants (12-30 us for a module's body, what an import's sample lands in); the
        # entry holds the code, so its id is not reused while cached.
        self._labels: Dict[int, Tuple[Any, Optional[str]]] = {}
        self._thread: Optional[threading.Thread] = None
        self.slowed = 0  # sleeps lengthened inside an import (tests)
        self.ticks = 0
        self.ships = 0

    def start(self) -> None:
        t = threading.Thread(target=self._run, name="infersight-coldstart-sampler", daemon=True)
        self._thread = t
        t.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive() and not self._stop.is_set()

    def _run(self) -> None:
        # time.sleep, not Event.wait: a plain sleep is the cheapest way to give up the GIL
        # for an interval (Event.wait runs Condition's Python code); stop() is seen within one.
        sleep = time.sleep
        base = interval = self.interval_s
        stopped = self._stop.is_set
        frames_of = sys._current_frames
        importing = self.in_import
        samples = self.samples
        now = time.monotonic
        deadline = now() + MAX_RUN_S
        last_tick = last_ship = now()
        try:
            while True:
                sleep(interval)
                if stopped():
                    return
                # Inside an import the import run covers the time: its samples explain no gap,
                # and each wake-up takes the GIL from the busy main thread (a forced switch;
                # the tick's system calls one each). So a long import is sampled ever more
                # sparsely, down to one wake-up per TICK_S, and ticks every IMPORT_TICK_S;
                # out of it, the base interval and TICK_S again.
                in_import = importing is not None and importing()
                t = now()
                every = IMPORT_TICK_S if in_import else TICK_S
                if self.tick is not None and t - last_tick >= every - interval / 2:
                    last_tick = t
                    self.tick()
                    self.ticks += 1
                if self.ship is not None and t - last_ship >= TICK_S - interval / 2:
                    last_ship = t
                    self.ship()
                    self.ships += 1
                if not self.sample:
                    interval = TICK_S  # sampling stopped (readiness), or off: the tick only
                    continue
                f = frames_of().get(self.main_ident)
                if f is not None:
                    samples.append((time.time_ns(), self.label(f)))
                    interval = min(interval * 2, IMPORT_INTERVAL_S) if in_import else base
                    self.slowed += interval > base
                del f
                if len(samples) >= MAX_SAMPLES or t > deadline:
                    return
        except Exception:
            return  # never disturb the host; an unexplained gap is better than a crash
        finally:
            if self.done is not None:
                try:
                    self.done()
                except Exception:
                    pass

    def label(self, frame: Any) -> str:
        """The innermost frame that is neither the standard library nor the hooks."""
        labels = self._labels
        leaf = ""
        depth = 0
        f = frame
        while f is not None and depth < 128:
            code = f.f_code
            hit = labels.get(id(code))
            if hit is not None and hit[0] is code:
                lab = hit[1]
            else:
                lab = _code_label(code, f.f_globals)
                labels[id(code)] = (code, lab)
            if lab is not None:
                return lab
            if not leaf:
                leaf = _raw_label(code, f.f_globals)
            f = f.f_back
            depth += 1
        return leaf or "?"


def _raw_label(code: Any, glob: Dict[str, Any]) -> str:
    mod = glob.get("__name__") or os.path.basename(code.co_filename)
    return "%s:%s" % (mod, getattr(code, "co_qualname", code.co_name))


def _code_label(code: Any, glob: Dict[str, Any]) -> Optional[str]:
    fn = code.co_filename
    if fn.startswith(("<", _HOOKS)):
        return None
    if fn.startswith(_STDLIB) and "-packages" not in fn:
        return None
    return _raw_label(code, glob)


def uncovered(intervals: List[Tuple[int, int]], lo: int, hi: int, min_ns: int = MIN_GAP_NS) -> List[Tuple[int, int]]:
    """Stretches of [lo, hi] that no interval covers, at least ``min_ns`` long."""
    out: List[Tuple[int, int]] = []
    cur = lo
    for s, e in sorted(intervals):
        if e <= cur:
            continue
        if s > cur and min(s, hi) - cur >= min_ns:
            out.append((cur, min(s, hi)))
        cur = max(cur, e)
        if cur >= hi:
            break
    if hi - cur >= min_ns:
        out.append((cur, hi))
    return out


def top_labels(samples: List[Tuple[int, str]], start: int, end: int, n: int = TOP,
               min_samples: int = MIN_SAMPLES) -> List[str]:
    """``"module:function NN%"`` for the most frequent labels among the samples in [start, end);
    none when fewer than ``min_samples`` fell there (too few to say what ran)."""
    counts: Dict[str, int] = {}
    total = 0
    for t, lab in samples:
        if start <= t < end:
            counts[lab] = counts.get(lab, 0) + 1
            total += 1
    if not total or total < min_samples:
        return []
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    return ["%s %d%%" % (lab, round(100.0 * c / total)) for lab, c in ranked]
