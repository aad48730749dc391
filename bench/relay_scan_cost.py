"""What launch's stderr relay spends scanning CMD's stderr, against only splitting it into lines.

    python bench/relay_scan_cost.py [--lines 200000] [--rounds 5]

The relay's thread reads CMD's stderr, copies it through, then scans it (agent/oom/stderr_relay.py);
while it scans, CMD's next writes wait in the pipe. Here its scan runs in-process over 64 KiB reads
of three streams (a log without needles, vLLM's periodic stats line, which holds "KV cache", and a
log with one memory error at its end), beside ``bytes.split`` of the same reads: the ratio is the
scan's cost over the least any line reader pays. Medians of alternating rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from infersight.agent.oom import stderr_relay

PLAIN = b"INFO 12-05 06:33:00 [engine.py:100] Avg prompt throughput: 1.0 tokens/s, running: 3 reqs\n"
STATS = b"INFO 12-05 06:33:00 [metrics.py:100] GPU KV cache usage: 1.5%, CPU KV cache usage: 0.0%\n"
ERROR = (b"ggml_backend_cuda_buffer_type_alloc_buffer: allocating 8900.01 MiB on device 0: cudaMalloc failed: "
         b"out of memory\n")


def scan(data: bytes) -> float:
    relay = stderr_relay.StderrRelay(out_fd=os.open(os.devnull, os.O_WRONLY))
    relay.set_consumer(lambda _text: None)
    t = time.perf_counter()
    for i in range(0, len(data), 65536):
        relay._scan(data[i:i + 65536])
    relay._flush_capture()
    return time.perf_counter() - t


def split_only(data: bytes) -> float:
    t = time.perf_counter()
    partial = b""
    for i in range(0, len(data), 65536):
        *_lines, partial = (partial + data[i:i + 65536]).split(b"\n")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    streams = {"no needle": PLAIN * a.lines, "stats line (needle)": STATS * a.lines,
               "one error at the end": PLAIN * a.lines + ERROR}
    for name, data in streams.items():
        s, b = [], []
        for _ in range(a.rounds):
            s.append(scan(data))
            b.append(split_only(data))
        ms, mb = statistics.median(s), statistics.median(b)
        print("%-22s %d lines, %.1f MB: scan %.3f s, split only %.3f s: %.1fx; %.2f us a line"
              % (name, a.lines, len(data) / 1e6, ms, mb, ms / mb, ms / a.lines * 1e6))


if __name__ == "__main__":
    main()
