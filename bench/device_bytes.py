"""OTLP file bytes per GPU per day from device samples: every sample against the default
``nvml.export_interval_s`` (10 s, changed states at once).

    python bench/device_bytes.py [--gpus 8] [--minutes 10] [--export-interval 10]

Samples come from the real NVML wrapper over the FAKE ``libnvidia-ml.so.1`` of the tests
(tests/support/fake_nvml, built with gcc), one per simulated second at ``nvml.interval_s`` = 1 s, and
are encoded as the file exporter writes them (one OTLP JSON line per sample interval). Both
ways run over the same samples; the figure is extrapolated to a day. The fake's readings do
not drift; that is the worst case for nothing: drifting gauges go out every interval either
way, and states that do not change go out at the heartbeat (6 intervals), so a real busy
GPU writes about the same, plus one point per actual state change.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "support"))

SCENARIO = "count %d\n" + "".join("%d name FAKE NVIDIA H100 80GB HBM3 (fake_nvml)\n" % i for i in range(16))


def measure(minutes: float, export_interval_s: float) -> dict[str, float]:
    from infersight.agent.devices.metrics import RecordedSamples, device_metrics
    from infersight.agent.devices.nvml import Nvml
    from infersight.exporters.otlp_json import encode_lines
    from infersight.telemetry import Resource

    res = Resource.of({"host.name": "node-1", "service.name": "infersight-agent",
                       "service.instance.id": "node-1-agent"})
    nvml = Nvml()
    st = nvml.status()
    assert st.available, st.reason
    every, recorded = 0, 0
    sel = RecordedSamples(export_interval_s)
    t0 = 1_700_000_000 * 10**9
    seconds = int(minutes * 60)
    for s in range(seconds):
        now = t0 + s * 10**9
        items = device_metrics(nvml.sample_all(), resource=res, start_ns=t0, time_ns=now)
        every += sum(len(x) + 1 for x in encode_lines(items))
        recorded += sum(len(x) + 1 for x in encode_lines(sel.select(items, now)))
    nvml.close()
    day = 86400 / seconds / st.device_count
    return {"gpus": st.device_count, "every_sample_bytes_per_gpu_day": round(every * day),
            "recorded_bytes_per_gpu_day": round(recorded * day)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--export-interval", type=float, default=10.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.minutes, args.export_interval)))
        return
    from fake_nvml.helpers import build_fake_nvml, fake_env

    tmp = Path(tempfile.mkdtemp(prefix="device-bytes-"))
    lib = build_fake_nvml(tmp / "lib")
    cfg = tmp / "fake_nvml.cfg"
    cfg.write_text(SCENARIO % args.gpus)
    r = subprocess.run([sys.executable, __file__, "--child", "--minutes", str(args.minutes),
                        "--export-interval", str(args.export_interval)],
                       env=fake_env(lib, cfg), capture_output=True, text=True, check=False)
    if r.returncode:
        raise SystemExit(r.stderr)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["export_interval_s"] = args.export_interval
    out["ratio_recorded_over_every_sample"] = round(
        out["recorded_bytes_per_gpu_day"] / out["every_sample_bytes_per_gpu_day"], 3)
    out["recorded_MiB_per_gpu_day"] = round(out["recorded_bytes_per_gpu_day"] / 2**20, 1)
    out["every_sample_MiB_per_gpu_day"] = round(out["every_sample_bytes_per_gpu_day"] / 2**20, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    os.environ.pop("INFERSIGHT_NVML_PROC_ROOT", None)
    main()
