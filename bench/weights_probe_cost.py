"""What measuring a weights read costs, beside the read itself (one process, side by side).

    python bench/weights_probe_cost.py [--mib 256] [--runs 5] [--huge-gib 64]

For a safetensors file of --mib MiB in the page cache (the fastest read, so the largest
share), it times a lazy ``load_file`` followed by the ``load_state_dict`` copy that reads it,
and, separately, everything the hooks add around that pair: the page-cache probe (mincore on
a mapping of the file), /proc/self/io and getrusage, the /proc/self/maps lookup that tells a
lazy load, and the pagemap reads of a deferred read. Best of --runs each; the ratio is the
hooks' share.
Then the probes alone on a sparse --huge-gib GiB file, where they sample instead of reading
every page's state.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--huge-gib", type=int, default=64)
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file, save_file

    from infersight.hooks import _pagestate, _state, _weights

    _state.current.weights.module = torch  # as _weights.install does
    rows = args.mib * 2**20 // (1024 * 4)
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "w.safetensors")
        save_file({"w%d" % i: torch.randn(rows // 8, 1024) for i in range(8)}, p)
        model = torch.nn.ParameterDict({"w%d" % i: torch.nn.Parameter(torch.empty(rows // 8, 1024))
                                        for i in range(8)})
        with open(p, "rb") as f:
            while f.read(8 << 20):
                pass
        work, probes = [], []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            sd = load_file(p)
            model.load_state_dict(sd)
            work.append(time.perf_counter() - t0)
            sd = load_file(p)
            t0 = time.perf_counter()
            probe = _weights._Probe([p])  # the lazy load's span: before and after
            probe.attrs("safetensors.torch.load_file", os.path.getsize(p), True)
            _weights._register([p], list(sd.values()))
            chunks, files = _weights._mapped_chunks(iter(sd.values()))  # the deferred copy's span
            deferred = _weights._Probe([m.path for m in files])
            deferred.attrs("deferred", sum(n for _, n in chunks), False)
            _pagestate.present_bytes(chunks)  # a deferred forward reads pagemap before and after
            _pagestate.present_bytes(chunks)
            probes.append(time.perf_counter() - t0)
            _weights._forget()
            del sd
        w, c = min(work), min(probes)  # best of each: a shared machine is only sometimes quiet
        print("warm %d MiB: load_file + load_state_dict %.1f ms; hooks' probes %.2f ms (%.2f%% of the read)"
              % (args.mib, w * 1e3, c * 1e3, 100.0 * c / w))

        huge = os.path.join(d, "huge.bin")
        with open(huge, "wb") as f:
            f.truncate(args.huge_gib << 30)
        t0 = time.perf_counter()
        ratio = _pagestate.page_cache_ratio([huge])
        t_ratio = time.perf_counter() - t0
        t0 = time.perf_counter()  # pagemap of as many pages, wherever they are: the same reads
        _pagestate.present_bytes([(0x7F0000000000, args.huge_gib << 30)])
        t_pm = time.perf_counter() - t0
        print("sparse %d GiB: page-cache probe %.2f ms (ratio %s), pagemap probe %.2f ms (both sampled)"
              % (args.huge_gib, t_ratio * 1e3, ratio, t_pm * 1e3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
