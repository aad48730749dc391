"""Drive infersight.agent.devices.nvml in this process (against whatever libnvidia-ml.so.1 the dynamic
loader finds: the fake, in tests) and print one JSON report on the last line of stdout."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from infersight.agent.devices.metrics import device_metrics
from infersight.agent.devices.nvml import Nvml, XidWatcher
from infersight.telemetry import Resource


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--proc-root", default="/proc")
    ap.add_argument("--watch-ms", type=int, default=0)
    ap.add_argument("--cost-rounds", type=int, default=0)
    a = ap.parse_args()

    nv = Nvml(proc_root=a.proc_root)
    report: dict[str, object] = {"status": dataclasses.asdict(nv.status())}
    rounds = []
    events = []
    for _ in range(a.rounds):
        rounds.append([dataclasses.asdict(s) for s in nv.sample_all()])
        events += [dataclasses.asdict(e) for e in nv.pop_events()]
    report["rounds"] = rounds
    report["events"] = events

    last = nv.sample_all()
    views = [nv.memory_view(i) for i in range(nv.device_count())]
    report["memory_views"] = [dataclasses.asdict(v) if v is not None else None for v in views]
    items = device_metrics(last, resource=Resource.of({"service.name": "t"}), start_ns=1)
    report["metrics"] = [
        {
            "name": m.name,
            "kind": m.kind,
            "unit": m.unit,
            "monotonic": m.monotonic,
            "points": [{"value": p.value, "attributes": p.attributes} for p in m.points],
        }
        for m in items
    ]

    if a.watch_ms:
        got: list[dict[str, object]] = []
        w = XidWatcher(nv, lambda e: got.append(dataclasses.asdict(e)), timeout_ms=50)
        report["watch_started"] = w.start()
        report["watch_registered"] = list(w.registered)
        deadline = time.monotonic() + a.watch_ms / 1000
        while time.monotonic() < deadline and not got:
            time.sleep(0.01)
        w.stop()
        report["watch_running_after_stop"] = w.running
        report["xid_events"] = got

    if a.cost_rounds:
        n = nv.device_count()
        t0 = time.perf_counter()
        for _ in range(a.cost_rounds):
            nv.sample_all()
        dt = time.perf_counter() - t0
        report["cost_us_per_device"] = dt / (a.cost_rounds * max(n, 1)) * 1e6
    nv.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
