"""GPU check: force each OOM class for real and print infersight's verdicts.

    python bench/gpu_check_oom.py            # all scenarios, one process each
    python bench/gpu_check_oom.py --dry-run  # print the plan; needs neither torch nor a GPU
    python bench/gpu_check_oom.py --scenario fragmentation   # one scenario (what the parent runs)

Needs torch (CUDA) and infersight only; nvidia-ml-py is used when present. Each scenario
runs in a fresh process, with the hooks' allocator observer attached (hooks/_alloc.py) and
its events recorded in memory (no agent socket: a recorder stands in for the hook client).
The observer event and the caught exception (``report_oom``) then go through the agent's
own handlers (``agent/oom/kind.py``, with real NVML when it is available) while the
process, and any other tenant, still hold their memory. The text alone is classified too,
as ``infersight classify`` would.

Scenarios (T = device total, from get_device_properties):

- capacity: ask for T + 1 GiB;
- fragmentation: fill the device with 512 MiB segments, each split into two live 256 MiB
  tensors, free one half of every segment (256 MiB holes that cannot be released), then ask
  for 2 GiB: more than any hole and more than the device has free, far less than the holes;
- reservation_conflict (tenant): a second process holds 90% of T; ask for 20% of T;
- reservation_conflict (fraction): set_per_process_memory_fraction(0.25); ask for 50% of T.

Prints one line per scenario (expected, observer verdict, text verdict) and exits 0 when
every verdict matches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
SCENARIOS = ("capacity", "fragmentation", "tenant", "fraction")
EXPECT = {
    "capacity": "capacity",
    "fragmentation": "fragmentation",
    "tenant": "reservation_conflict",
    "fraction": "reservation_conflict",
}
PLAN = {
    "capacity": "request T + 1 GiB on an empty device",
    "fragmentation": "fill with 512 MiB segments split 256+256 MiB, free every first half, request 2 GiB",
    "tenant": "a second process holds 0.90*T; request 0.20*T",
    "fraction": "set_per_process_memory_fraction(0.25); request 0.50*T",
}
TRACE = "0" * 31 + "1"
ROOT = "0" * 15 + "1"
SPAN = "0" * 15 + "2"

HOLDER = r"""
import sys, torch
t = torch.cuda.get_device_properties(0).total_memory
x = torch.empty(int(float(sys.argv[1]) * t), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()  # hold until the parent closes stdin
"""


class Recorder:
    """Stands in for the hook client: keeps the events instead of sending them."""

    def __init__(self) -> None:
        self.enabled = True
        self.events: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        self.events.append((kind, json.loads(json.dumps(data, default=str))))


def classify_events(events: list[tuple[str, dict[str, Any]]], nvml: Any) -> list[dict[str, Any]]:
    """Feed recorded ``oom`` events to the agent's handlers; one dict per exported verdict."""
    from infersight.agent.daemon.assemble import Assembler
    from infersight.agent.oom import kind as oom_kind
    from infersight.telemetry import LogItem

    h = oom_kind.OomHandlers(oom_kind.OomClassifier([]), nvml)
    asm = Assembler("gpu-check", {"oom": h.oom, "mem": h.mem})
    p = asm.hello({"id": "gpu-check-%d" % os.getpid(), "pid": os.getpid(), "start_ns": 1,
                   "trace_id": TRACE, "root_span_id": ROOT})
    batch = [[i + 1, time.time_ns(), k, d] for i, (k, d) in enumerate(events) if k == "oom"]
    out = []
    for item in asm.events(p, batch):
        if isinstance(item, LogItem):
            a = item.attributes
            out.append({"class": a.get("infersight.oom.class"), "rule": a.get("infersight.oom.rule"),
                        "source": a.get("infersight.oom.source"), "nvml": bool(a.get("infersight.oom.nvml")),
                        "numbers": {k.split(".")[-1]: v for k, v in a.items()
                                    if k.startswith("infersight.oom.") and k.endswith("_bytes")
                                    and ".snapshot." not in k},
                        "body": item.body})
    if p.malformed:
        out.append({"class": "error", "rule": "%d malformed events" % p.malformed})
    return out


def _nvml() -> Any:
    try:
        from infersight.agent.devices.nvml import Nvml

        n = Nvml()
        return n if n.status().available else None
    except Exception:
        return None


def run_scenario(name: str) -> dict[str, Any]:
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # the native allocator, no expandable segments
    os.environ.pop("PYTORCH_ALLOC_CONF", None)
    import torch

    from infersight.hooks import _alloc, _runtime, _state
    from infersight.rules.engine import classify_message
    from infersight.rules.oom_parse import find_ooms

    rec = Recorder()
    rs = _state.current.runtime
    rs.client = rec  # type: ignore[assignment]
    rs.trace_id, rs.root_span_id = TRACE, ROOT
    torch.cuda.init()
    dev = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(0).total_memory
    _alloc.install(torch)
    _alloc.notify_cuda_ready()
    deadline = time.time() + 10
    while not _alloc.status()["observer"] and time.time() < deadline:
        time.sleep(0.01)
    holder = None
    keep: list[Any] = []
    result: dict[str, Any] = {"scenario": name, "expect": EXPECT[name], "total": total,
                              "hooks": _alloc.status(), "backend": torch.cuda.get_allocator_backend()}
    try:
        if name == "capacity":
            req = total + GIB
        elif name == "fragmentation":
            halves: list[Any] = []
            while torch.cuda.mem_get_info(0)[0] > GIB:
                big = torch.empty(512 * MIB, dtype=torch.uint8, device=dev)
                del big  # a cached 512 MiB segment ...
                halves.append(torch.empty(256 * MIB, dtype=torch.uint8, device=dev))  # ... split in two
                keep.append(torch.empty(256 * MIB, dtype=torch.uint8, device=dev))
            halves.clear()  # 256 MiB holes in segments that stay in use
            torch.cuda.synchronize()
            req = 2 * GIB
        elif name == "tenant":
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, "0.90"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
            line = holder.stdout.readline() if holder.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError("the other tenant could not take its memory")
            req = int(0.20 * total)
        else:
            torch.cuda.set_per_process_memory_fraction(0.25, 0)
            req = int(0.50 * total)
        result["requested"] = req
        text = ""
        token = _runtime.current_span.set(SPAN)
        try:
            torch.empty(req, dtype=torch.uint8, device=dev)
            result["error"] = "no OOM happened"
        except torch.OutOfMemoryError as exc:
            text = str(exc)
            _alloc.report_oom(exc)
        finally:
            _runtime.current_span.reset(token)
        result["text"] = text[:2000]
        result["events"] = [k for k, _ in rec.events]
        result["observer_event"] = next(({k: v for k, v in d.items() if k != "snap"}
                                         for k, d in rec.events if k == "oom" and d.get("source") == "observer"), None)
        result["verdicts"] = classify_events(rec.events, _nvml())
        msgs = find_ooms(text)
        if msgs:
            v = classify_message(msgs[0])
            result["text_verdict"] = {"class": v.cls, "rule": v.rule}
    finally:
        keep.clear()
        if holder is not None:
            if holder.stdin:
                holder.stdin.close()
            holder.wait(30)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description="force each OOM class on a GPU and print the verdicts")
    ap.add_argument("--dry-run", action="store_true", help="print the plan only")
    ap.add_argument("--scenario", choices=SCENARIOS)
    ap.add_argument("--timeout", type=float, default=120.0, help="per scenario, seconds")
    args = ap.parse_args()
    if args.dry_run:
        print("gpu_check_oom plan (each scenario in its own process; expected verdict):")
        for s in SCENARIOS:
            print("  %-14s %-21s %s" % (s, EXPECT[s], PLAN[s]))
        print("then: observer + report_oom events -> agent/oom_kind handlers (NVML if present); text -> rules")
        return 0
    if args.scenario:
        print(json.dumps(run_scenario(args.scenario)), flush=True)
        return 0
    ok = True
    for s in SCENARIOS:
        t0 = time.monotonic()
        try:
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--scenario", s],
                               capture_output=True, text=True, timeout=args.timeout, check=False)
        except subprocess.TimeoutExpired:
            print("oom %-14s FAIL timed out after %.0f s" % (s, args.timeout))
            ok = False
            continue
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode != 0 or not lines:
            print("oom %-14s FAIL rc=%d %s" % (s, r.returncode, r.stderr.strip()[-800:]))
            ok = False
            continue
        res = json.loads(lines[-1])
        verdicts = res.get("verdicts") or []
        obs = next((v for v in verdicts if v.get("source") == "observer"), verdicts[0] if verdicts else {})
        tv = res.get("text_verdict") or {}
        good = (not res.get("error") and obs.get("class") == EXPECT[s] and tv.get("class") == EXPECT[s]
                and len(verdicts) == 1)
        ok = ok and good
        print("oom %-14s %s expect %-20s observer %s/%s (nvml=%s, exported=%d)  text %s/%s  [%.1fs]" % (
            s, "PASS" if good else "FAIL", EXPECT[s], obs.get("class"), obs.get("rule"), obs.get("nvml"),
            len(verdicts), tv.get("class"), tv.get("rule"), time.monotonic() - t0))
        print("    hooks %s backend %s" % (json.dumps(res.get("hooks")), res.get("backend")))
        print("    numbers %s" % json.dumps(obs.get("numbers")))
        print("    text: %s" % " ".join((res.get("text") or res.get("error") or "").split())[:400])
    print("gpu_check_oom: %s" % ("all verdicts as expected" if ok else "MISMATCH (see above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
