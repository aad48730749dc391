"""Memory of the device job's verdict windows with a crowded neighbour: every sample kept whole against
what the window keeps (the busiest mapped processes, and those that time requests), side by side in one run.

The samples are FAKE (``DeviceSample`` objects as the NVML wrapper builds them: the busiest 16 mapped
processes with their uid and parents read, the rest not), on 8 devices, each shared with a neighbour's
``--crowd`` idle compute processes. Memory is ``tracemalloc``'s count of what the windows hold.

    python bench/device_window_memory.py [--crowd 400] [--samples 300]

300 samples is the default window (300 s at 1 s); a ``window_s`` of an hour keeps 3600.
"""

from __future__ import annotations

import argparse
import gc
import tracemalloc
from collections import deque

from infersight.agent.devices.nvml import MAX_DETAILED_PROCESSES, DeviceSample, GpuProcess, kept_in_window

DEVICES = 8
TIMING = frozenset(range(1000, 1004))  # the server's request-timing workers (among the busiest here)


def sample(device: int, t: int, crowd: int) -> DeviceSample:
    # as the wrapper returns them: fresh objects each sample (NVML's list, /proc's names read again)
    procs = [GpuProcess(50_000 + i, 300 << 20, 50_000 + i, "python%d" % (i % 10), None, sm_pct=0)
             for i in range(crowd)]
    procs += [GpuProcess(1000 + i, 4 << 30, 1000 + i, "server", None, sm_pct=40 - i, uid=1001, ancestors=(900, 1))
              for i in range(MAX_DETAILED_PROCESSES)]
    return DeviceSample(time_ns=t, index=device, uuid="GPU-%d" % device, name="FAKE GPU", utilization_gpu_pct=90,
                        processes=tuple(procs), process_util_read=True)


def held_bytes(samples: int, crowd: int, keep: bool) -> int:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    windows = {d: deque(maxlen=samples) for d in range(DEVICES)}
    for t in range(samples):
        for d in range(DEVICES):
            s = sample(d, t, crowd)
            windows[d].append(kept_in_window(s, lambda: TIMING) if keep else s)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del windows
    return held


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--crowd", type=int, default=400)
    ap.add_argument("--samples", type=int, default=300)
    a = ap.parse_args()
    whole = held_bytes(a.samples, a.crowd, keep=False)
    kept = held_bytes(a.samples, a.crowd, keep=True)
    print(f"{DEVICES} devices x {a.samples} samples, a neighbour's {a.crowd} processes on each:")
    print(f"  every sample whole: {whole / 2**20:8.1f} MiB")
    print(f"  what the window keeps: {kept / 2**20:8.1f} MiB   (ratio {kept / whole:.3f})")


if __name__ == "__main__":
    main()
