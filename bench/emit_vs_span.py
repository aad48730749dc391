"""emit() of a ~200-byte event vs starting and ending an OpenTelemetry SDK span, same run.

Goal (DESIGN): emit is at least 10x cheaper. Both run in this process; emit goes into
a real hook client whose drain thread ships to a real agent socket in this process.
Run: python bench/emit_vs_span.py
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time

from otel_reference import sdk_span_seconds  # bench/ is on sys.path when run as a script

N = 100_000
REPEAT = 5


def bench_emit() -> list[float]:
    import asyncio

    from infersight.agent import config as cfg
    from infersight.agent.daemon import Agent

    d = tempfile.mkdtemp()
    sock = os.path.join(d, "a.sock")
    conf = cfg.load(None, env={}, flags={"agent.socket": sock, "agent.spool_dir": os.path.join(d, "spool")})
    loop = asyncio.new_event_loop()
    agent = Agent(conf, [], embedded=True)  # ingest + assembly, no exporter: we time the hook side
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(agent.start())
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    ready.wait(10)
    from infersight.hooks import _client

    client = _client.Client(sock, os.path.join(d, "spool"), {
        "id": "bench", "pid": os.getpid(), "start_ns": time.time_ns(), "trace_id": "a" * 32,
        "root_span_id": "b" * 16}, max_buffer=2 * N)
    payload = {"n": "coldstart.warmup", "id": "c" * 16, "p": "b" * 16, "s": 1_700_000_000_000_000_000,
               "a": {"infersight.stage": "warmup", "model": "resnet50", "batch": 8, "bytes": 123456789}}
    per_op = []
    for _ in range(REPEAT):
        t0 = time.perf_counter()
        emit = client.emit
        for _i in range(N):
            emit("span", payload)
        per_op.append((time.perf_counter() - t0) / N)
        client.flush(30)
    assert client.dropped_buffer == 0
    return per_op




def main() -> None:
    import json

    from infersight.hooks import _wire

    sample = _wire.encode_batch([(1, time.time_ns(), "span", {
        "n": "coldstart.warmup", "id": "c" * 16, "p": "b" * 16, "s": 1_700_000_000_000_000_000,
        "a": {"infersight.stage": "warmup", "model": "resnet50", "batch": 8, "bytes": 123456789}})])
    e = statistics.median(bench_emit())
    s = sdk_span_seconds(N // 5, REPEAT)
    out = {
        "event_bytes": len(sample),
        "emit_us": round(e * 1e6, 3),
        "otel_span_us": round(s * 1e6, 3),
        "ratio_span_over_emit": round(s / e, 1),
        "goal": ">= 10x",
        "python": sys.version.split()[0],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
