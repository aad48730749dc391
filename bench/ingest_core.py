"""CPU cost per event of the agent's pure core: decode -> validate/assemble -> OTLP JSON.

No sockets, no threads: process CPU time for N log events in frames of 512. This is
the floor under bench/ingest.py's figure. Also: OTLP JSON bytes per record of items that went
through the exporters' disk spool and back against the same items encoded directly.
Run: python bench/ingest_core.py [--profile]
"""

from __future__ import annotations

import cProfile
import json
import pstats
import sys
import time
from collections import deque

from infersight.agent.daemon.assemble import Assembler
from infersight.agent.daemon.health import Counters
from infersight.agent.daemon.ingest import Ingest
from infersight.exporters.otlp_json import encode_lines
from infersight.hooks import _wire

N = 200_704
HELLO = {"id": "p1", "pid": 1, "start_ns": 1, "trace_id": "a" * 32, "root_span_id": "b" * 16}


class _Collect:
    def __init__(self) -> None:
        self.batches: list = []  # type: ignore[type-arg]

    def publish(self, items, on_done=None) -> None:  # type: ignore[no-untyped-def]
        self.batches.append(items)
        if on_done is not None:
            on_done()


def main() -> None:
    t = time.time_ns()
    frames = [
        _wire.encode_batch([
            (i + j + 1, t + i + j, "log",
             {"body": "request done", "sev": "INFO", "a": {"i": i + j, "model": "m", "latency_s": 0.012}})
            for j in range(512)
        ])[_wire.HEADER.size:]
        for i in range(0, N, 512)
    ]
    sink = _Collect()
    ingest = Ingest(Assembler("h"), sink, Counters(), {0}, {0}, dict)  # type: ignore[arg-type]
    producer = ingest.assembler.hello(HELLO)

    def run() -> int:
        size = 0
        for f in frames:
            msg = _wire.decode_payload(f)
            assert msg is not None
            ingest.process_batch(producer, msg["e"], deque(), lambda: None)
            for line in encode_lines(sink.batches.pop()):
                size += len(line)
        return size

    if "--profile" in sys.argv:
        cProfile.runctx("run()", globals(), {"run": run}, "/tmp/infersight-ingest-core.prof")
        pstats.Stats("/tmp/infersight-ingest-core.prof").sort_stats("tottime").print_stats(15)
        return
    t0 = time.process_time()
    size = run()
    cpu = time.process_time() - t0
    print(json.dumps({"events": N, "cpu_us_per_event": round(cpu / N * 1e6, 2),
                      "events_per_cpu_s": round(N / cpu), "bytes_per_event": round(size / N, 1),
                      **spilled_vs_direct(ingest, frames[:40])}))


def spilled_vs_direct(ingest: Ingest, frames: list[bytes]) -> dict[str, float]:
    """OTLP JSON bytes per record of items that went through the exporters' disk spool and
    back, against the same items encoded directly (issue 13: at most 1.3x)."""
    import tempfile

    from infersight.agent.daemon.spool import DiskSpool

    sink = ingest.broadcaster
    producer = ingest.assembler.hello({**HELLO, "id": "p2", "pid": 2})  # fresh sequence numbers
    items = []
    for f in frames:
        msg = _wire.decode_payload(f)
        assert msg is not None
        ingest.process_batch(producer, msg["e"], deque(), lambda: None)
        items += sink.batches.pop()  # type: ignore[attr-defined]
    spool = DiskSpool(tempfile.mkdtemp(prefix="ingest-core-spool-"))
    for i in range(0, len(items), 512):
        spool.append(items[i : i + 512])
    replayed: list = []  # type: ignore[type-arg]
    while spool:
        got, records = spool.peek_many(4096)
        replayed += got
        spool.pop_many(records)
    assert len(replayed) == len(items)
    direct = sum(len(x) for i in range(0, len(items), 4096) for x in encode_lines(items[i : i + 4096]))
    spilled = sum(len(x) for i in range(0, len(replayed), 4096) for x in encode_lines(replayed[i : i + 4096]))
    return {"spilled_bytes_per_event": round(spilled / len(items), 1),
            "direct_bytes_per_event": round(direct / len(items), 1),
            "spilled_over_direct_bytes": round(spilled / direct, 3), "goal_spilled_over_direct_max": 1.3}


if __name__ == "__main__":
    main()
