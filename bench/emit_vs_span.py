"""Caller-side cost of the hooks' API vs starting and ending an OpenTelemetry SDK span, same run.

Goal (DESIGN, issue 13): ``emit``, ``log``, ``request`` and ``stage`` each at least 10x
cheaper than an SDK span. Issue 26 adds the ASGI middleware, which now times every HTTP
request: its added cost per request (a request through the middleware minus the same
request straight to the app, both measured here) must stay within the same budget.
Everything runs in this process, in turns (hook op, SDK span, hook op, ...), timed by the
calling thread's CPU clock; each figure is the median of the rounds, and each ratio is SDK
span / hook op, measured side by side: the ratio of the medians, and (``paired_ratio_*``)
the median and lowest of each round's ratio against the SDK round that ran right after it.

Two phases (issue 25): first ``stage`` while a cold start is being collected, as in a
process that ``launch`` started (the stack sampler and its checkpoints, import timing and
every cold-start hook installed: ``stage_coldstart_us``), where stages are mostly opened;
then, once readiness and the first response ended the cold start, every operation.

The hooks are real: activated as in a served process, with a drain thread that ships to
a real agent in another process (ingest and assembly, no exporter).

Run: python bench/emit_vs_span.py
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

from bench_agent import start_bench_agent  # bench/ is on sys.path when run as a script
from otel_reference import sdk_span_seconds

N = 20_000
# Caller-side: the CPU time of the calling thread, on both sides. Neither the hooks' drain
# thread nor the SDK's BatchSpanProcessor thread is counted, nor time spent waiting for
# the GIL they hold (on a busy machine, wall time mostly measures the neighbours).
CLOCK = time.thread_time
REPEAT = 7
# The heap is collected (untimed) before each timed run, on both sides. Objects
# one side leaves behind (the SDK's spans, say) otherwise trigger a full collection in
# whichever side runs next, which then pays for them: per-run figures were bimodal.
PAYLOAD = {"n": "coldstart.warmup", "id": "c" * 16, "p": "b" * 16, "s": 1_700_000_000_000_000_000,
           "a": {"infersight.stage": "warmup", "model": "resnet50", "batch": 8, "bytes": 123456789}}


def start_agent() -> tuple[str, str]:
    """``infersight agent`` in its own process (ingest, assembly, no exporter): its CPU is
    not the caller's, as in a real deployment. Stopped, and its directory removed, however this
    process's run ends (``bench_agent``)."""
    sock, spool, _pid = start_agent_process()
    return sock, spool


def start_agent_process() -> tuple[str, str, int]:
    """``start_agent``, and the agent's pid."""
    agent = start_bench_agent()
    return agent.sock, agent.spool, agent.pid


def activate(sock: str, spool: str) -> None:
    os.environ.update(INFERSIGHT_SOCKET=sock, INFERSIGHT_SPOOL_DIR=spool, INFERSIGHT_BUFFER_EVENTS=str(4 * N))
    os.environ.pop("TRACEPARENT", None)
    from infersight.hooks import _activate

    assert _activate.activate()


def ops() -> dict[str, Callable[[int], None]]:
    from infersight import hooks
    from infersight.hooks import _runtime

    client = _runtime.state().client
    assert client is not None

    def emit(n: int) -> None:
        e = client.emit
        for _i in range(n):
            e("span", PAYLOAD)

    def stage(n: int) -> None:
        s = hooks.stage
        for _i in range(n):
            with s("tokenizer_load", model="resnet50"):
                pass

    def log(n: int) -> None:
        lg = hooks.log
        for i in range(n):
            lg("loaded shard", shard=i)

    def request(n: int) -> None:
        r = hooks.request
        for _i in range(n):
            with r(device="cpu", model="resnet50", input_len=128):
                pass

    from infersight.hooks.asgi import ColdStartMiddleware

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        return None

    wrapped = ColdStartMiddleware(app)  # type: ignore[arg-type]
    scope = {"type": "http", "method": "GET", "path": "/v1/completions"}

    def drive(handler: Callable[..., object], n: int) -> None:
        for _i in range(n):
            coro = handler(dict(scope), None, None)  # a server makes a new scope per request
            try:
                coro.send(None)  # type: ignore[attr-defined]
            except StopIteration:
                pass

    def asgi_request(n: int) -> None:
        drive(wrapped, n)

    def asgi_bare(n: int) -> None:
        drive(app, n)

    from infersight.hooks.wsgi import RequestTimingMiddleware

    def wsgi_app(environ: dict[str, object], start_response: Callable[..., object]) -> Iterator[bytes]:
        start_response("200 OK", [])
        return iter((b"{}",))  # an iterable, as Flask's (werkzeug's ClosingIterator): the timed path to close()

    timed_wsgi = RequestTimingMiddleware(wsgi_app)  # type: ignore[arg-type]

    def serve_wsgi(handler: Callable[..., object], n: int) -> None:
        start_response = lambda status, headers, exc_info=None: None  # noqa: E731
        for _i in range(n):
            body = handler({"REQUEST_METHOD": "GET", "PATH_INFO": "/predict"}, start_response)  # one environ each
            for _chunk in body:  # type: ignore[attr-defined]
                pass
            close = getattr(body, "close", None)
            if close is not None:
                close()

    def wsgi_request(n: int) -> None:
        serve_wsgi(timed_wsgi, n)

    def wsgi_bare(n: int) -> None:
        serve_wsgi(wsgi_app, n)

    return {"emit": emit, "stage": stage, "log": log, "request": request,
            "asgi_request": asgi_request, "asgi_bare": asgi_bare, "wsgi_request": wsgi_request, "wsgi_bare": wsgi_bare}


def coldstart_phase(stage: Callable[[int], None]) -> tuple[list[float], list[float]]:
    """``stage`` rounds and SDK span rounds, in turns, while this process's cold start is
    being collected; then readiness and the first response end it."""
    from infersight import hooks
    from infersight.hooks import _coldstart

    _coldstart.install(time.time_ns())
    st = _coldstart.state()
    assert st.collecting, "no cold start collected"
    assert st.sampler is not None, "no stack sampler (and so no checkpoints)"
    assert st.finder is not None, "no import timing"
    rounds: list[float] = []
    spans: list[float] = []
    for _ in range(REPEAT):
        rounds.append(timed(stage, N))
        gc.collect()
        spans.append(sdk_span_seconds(N // 4, 1, clock=CLOCK))
    assert st.collecting, "the cold start ended during the rounds"
    hooks.mark_ready()
    hooks.first_response()
    assert not st.collecting
    return rounds, spans


def paired(ops: list[float], spans: list[float]) -> dict[str, float]:
    """Each round's ratio, SDK span over the hook op, against the SDK round run right after it:
    the machine's speed drifts between rounds (on a shared VM by up to 1.5x within a run), and
    a round and its neighbour see the same. The median and the lowest of the rounds."""
    r = [sp / op for op, sp in zip(ops, spans, strict=True)]
    return {"median": round(statistics.median(r), 1), "min": round(min(r), 1)}


def timed(fn: Callable[[int], None], n: int) -> float:
    from infersight.hooks import _runtime

    gc.collect()  # untimed, on both sides (see the note at REPEAT)
    t0 = CLOCK()
    fn(n)
    per_op = (CLOCK() - t0) / n
    assert _runtime.state().client is not None
    assert _runtime.state().client.flush(30)
    return per_op


def main() -> None:
    import json

    from infersight.hooks import _runtime, _wire

    activate(*start_agent())
    funcs = ops()
    cold_rounds, cold_spans = coldstart_phase(funcs["stage"])
    rounds: dict[str, list[float]] = {name: [] for name in funcs}
    after: dict[str, list[float]] = {name: [] for name in funcs}  # the SDK round right after each
    spans: list[float] = []
    for _ in range(REPEAT):
        for name, fn in funcs.items():
            rounds[name].append(timed(fn, N))
            gc.collect()
            spans.append(sdk_span_seconds(N // 4, 1, clock=CLOCK))
            after[name].append(spans[-1])
    client = _runtime.state().client
    assert client is not None
    assert client.dropped_buffer == 0
    s = statistics.median(spans)
    cold_s, cold_stage = statistics.median(cold_spans), statistics.median(cold_rounds)
    out: dict[str, object] = {
        "event_bytes": len(_wire.encode_batch([(1, time.time_ns(), "span", PAYLOAD)])),
        "otel_span_coldstart_us": round(cold_s * 1e6, 3),
        "stage_coldstart_us": round(cold_stage * 1e6, 3),
        "ratio_span_over_stage_coldstart": round(cold_s / cold_stage, 1),
        "paired_ratio_stage_coldstart": paired(cold_rounds, cold_spans),
        "otel_span_us": round(s * 1e6, 3),
    }
    for name, per in rounds.items():
        m = statistics.median(per)
        out[name + "_us"] = round(m * 1e6, 3)
        out["ratio_span_over_" + name] = round(s / m, 1)
        out["paired_ratio_" + name] = paired(per, after[name])
    added = statistics.median(rounds["asgi_request"]) - statistics.median(rounds["asgi_bare"])
    out["asgi_added_us"] = round(added * 1e6, 3)
    out["ratio_span_over_asgi_added"] = round(s / added, 1) if added > 0 else None
    added = statistics.median(rounds["wsgi_request"]) - statistics.median(rounds["wsgi_bare"])
    out["wsgi_added_us"] = round(added * 1e6, 3)
    out["ratio_span_over_wsgi_added"] = round(s / added, 1) if added > 0 else None
    out["goal"] = ("emit, log, request, stage (during a cold start and after it) and the ASGI and WSGI middlewares'"
                   " added cost per request >= 10x")
    out["python"] = sys.version.split()[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
