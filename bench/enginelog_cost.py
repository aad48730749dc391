"""What the engine-log hook adds to a ``logging`` call in the served process.

    python bench/enginelog_cost.py

Side by side in one run, in interleaved rounds (the best of each side): the same logger (a
NullHandler, so only logging's own work counts) before and after
``hooks._enginelog.install_logging`` wraps ``Logger.callHandlers``, for an INFO record (the
hot case: two integer compares and a logger-name check added), an INFO record of an engine's
logger (``vllm...``: its format string is checked for the sizing words the hook keeps as context)
and a WARNING record without the needles (its words checked). Prints ns per call and the ratio
with / without. The hooks count as active (as in a hooked process that reaches its agent): while
they are off the wrapper formats nothing.
"""

from __future__ import annotations

import logging
import time

from infersight.hooks import _enginelog, _runtime

N = 200_000


def per_call(fn: object, n: int = N // 4) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()  # type: ignore[operator]
    return (time.perf_counter_ns() - t0) / n


def main() -> None:
    log = logging.getLogger("bench.enginelog")
    log.handlers[:] = [logging.NullHandler()]
    log.propagate = False
    log.setLevel(logging.INFO)

    engine = logging.getLogger("vllm.engine.metrics")
    engine.handlers[:] = [logging.NullHandler()]
    engine.propagate = False
    engine.setLevel(logging.INFO)

    def info() -> None:
        log.info("Avg prompt throughput: %.1f tokens/s", 1234.5)

    def engine_info() -> None:
        engine.info("Avg prompt throughput: %.1f tokens/s", 1234.5)

    def warning() -> None:
        log.warning("Sequence group %d is preempted by %s", 7, "RECOMPUTE")

    saved = logging.Logger.callHandlers
    saved_active = _runtime.active
    _runtime.active = lambda: True  # a needle-free text is never sent: nothing else changes
    cases = (info, engine_info, warning)
    before = [float("inf")] * len(cases)
    after = [float("inf")] * len(cases)
    try:
        for _ in range(9):  # interleaved rounds, the best of each side: a busy host hurts both alike
            logging.Logger.callHandlers = saved
            before = [min(b, per_call(c)) for b, c in zip(before, cases, strict=True)]
            _enginelog.install_logging(logging)
            after = [min(a, per_call(c)) for a, c in zip(after, cases, strict=True)]
    finally:
        logging.Logger.callHandlers = saved
        _runtime.active = saved_active
    names = ("INFO record", "INFO record, engine logger", "WARNING record, no needle")
    for name, b, a in zip(names, before, after, strict=True):
        print(f"{name:<28} {b:8.0f} ns -> {a:8.0f} ns   ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
