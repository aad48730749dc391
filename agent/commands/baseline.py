"""infersight baseline: the same fixed requests on every visible device, P50/P99 per device,
the coefficient against peers of the same kind, and verdicts.

One request is a fixed sequence: a matmul ladder (128, 256, 512), a small conv and a small
transformer encoder block, with fixed seeds and shapes. Warmup requests are excluded. Peers of a
device are the other devices with the same product name; a CPU-only run has none (verdict
no_peers). torch is optional: it is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from infersight.agent.cli import command_help
from infersight.agent.devices.heterogeneity import DeviceVerdict, WindowState, evaluate, summarize_samples
from infersight.agent.devices.nvml import DeviceSample, Nvml
from infersight.latency import SeriesKey, series_stats
from infersight.rules.device_rules import DeviceRulesError, DeviceThresholds, load_device_rules

DEFAULT_REQUESTS = 100
WARMUP = 10
LADDER = (128, 256, 512)
SAMPLE_INTERVAL_S = 0.1


def add_parser(subparsers: Any, help_line: str | None = None) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "baseline",
        help=help_line or command_help("baseline"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print the JSON result")
    p.add_argument(
        "--requests", type=int, default=DEFAULT_REQUESTS, metavar="N",
        help=f"measured requests per device, after {WARMUP} warmup (default {DEFAULT_REQUESTS})",
    )  # fmt: skip
    p.add_argument(
        "--devices", nargs="+", metavar="DEV",
        help="devices to run on: cpu, cuda, cuda:N (default: every visible GPU, else cpu)",
    )  # fmt: skip
    p.set_defaults(func=run)
    return p


@dataclass(frozen=True, slots=True)
class _Device:
    device: str  # cpu | cuda:N
    hw_id: str | None
    name: str


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _cuda_device(torch: Any, i: int) -> _Device:
    props = torch.cuda.get_device_properties(i)
    uuid = getattr(props, "uuid", None)
    hw_id = None
    if uuid is not None:
        text = str(uuid)
        hw_id = text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
    return _Device(f"cuda:{i}", hw_id, str(props.name))


def _resolve(torch: Any, wanted: Sequence[str] | None) -> list[_Device]:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not wanted:
        return [_cuda_device(torch, i) for i in range(n)] or [_Device("cpu", None, _cpu_name())]
    out: list[_Device] = []
    for item in (x for w in wanted for x in w.split(",") if x):
        if item == "cpu":
            out.append(_Device("cpu", None, _cpu_name()))
        elif item == "cuda":
            out += [_cuda_device(torch, i) for i in range(n)]
        elif item.startswith("cuda:") and item[5:].isdigit() and int(item[5:]) < n:
            out.append(_cuda_device(torch, int(item[5:])))
        else:
            raise ValueError(f"unknown or invisible device {item!r} ({n} CUDA devices visible)")
    return list({d.device: d for d in out}.values())


def _workload(torch: Any, device: str) -> Callable[[], None]:
    """The fixed request for one device: same seeds and shapes everywhere."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    mats = [torch.randn(n, n, generator=g).to(device) for n in LADDER]
    conv = torch.nn.Conv2d(8, 16, 3, padding=1).to(device).eval()
    img = torch.randn(4, 8, 32, 32, generator=g).to(device)
    block = torch.nn.TransformerEncoderLayer(
        d_model=128, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True
    ).to(device).eval()  # fmt: skip
    seq = torch.randn(4, 32, 128, generator=g).to(device)
    cuda = device.startswith("cuda")

    def request() -> None:
        with torch.inference_mode():
            for m in mats:
                m @ m
            conv(img)
            block(seq)
        if cuda:
            torch.cuda.synchronize(device)

    return request


def _measure(request: Callable[[], None], n: int) -> list[float]:
    for _ in range(WARMUP):
        request()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        request()
        out.append(time.perf_counter() - t0)
    return out


class _Sampler:
    """NVML samples of every device on a thread while the baseline runs."""

    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml
        self.samples: dict[str, list[DeviceSample]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="baseline-nvml", daemon=True)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            for s in self.nvml.sample_all():
                if s.uuid:
                    self.samples.setdefault(s.uuid, []).append(s)
            if self._stop.wait(SAMPLE_INTERVAL_S):
                return


def _during(samples: Sequence[DeviceSample], span: tuple[int, int]) -> list[DeviceSample]:
    """The samples taken while the device ran its own requests (the devices run one after another)."""
    t0, t1 = span
    return [s for s in samples if t0 <= s.time_ns <= t1 + int(SAMPLE_INTERVAL_S * 1e9)]


def _thresholds(requests: int) -> DeviceThresholds:
    try:
        th = load_device_rules().thresholds
    except DeviceRulesError as exc:
        print(f"infersight baseline: {exc}; using default thresholds", file=sys.stderr)
        th = DeviceThresholds()
    return replace(th, min_requests=min(th.min_requests, requests))


def _row(dev: _Device, v: DeviceVerdict) -> dict[str, Any]:
    return {
        "device": dev.device,
        "hw_id": dev.hw_id,
        "name": dev.name,
        "p50_s": v.p50_s,
        "p99_s": v.p99_s,
        "coefficient": v.coefficient,
        "verdict": v.verdict,
        "cause": v.cause,
    }


def run(args: argparse.Namespace) -> int:
    requests = int(getattr(args, "requests", DEFAULT_REQUESTS))
    if requests < 1:
        print("infersight baseline: --requests must be at least 1", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError as exc:
        print(
            f"infersight baseline: needs torch, which is not importable ({exc}). "
            "Install it with: pip install 'infersight[torch]'",
            file=sys.stderr,
        )
        return 2
    try:
        devices = _resolve(torch, getattr(args, "devices", None))
    except ValueError as exc:
        print(f"infersight baseline: {exc}", file=sys.stderr)
        return 2

    th = _thresholds(requests)
    nvml = Nvml()
    gpus = any(d.device.startswith("cuda") for d in devices)
    nv_status = nvml.status() if gpus else None
    series = []
    spans: dict[str, tuple[int, int]] = {}  # device -> its own run (ns): the samples that judge it
    sampler = _Sampler(nvml) if nv_status is not None and nv_status.available else None
    if sampler is not None:
        sampler.__enter__()
    try:
        for d in devices:
            request = _workload(torch, d.device)
            t0 = time.time_ns()
            latencies = _measure(request, requests)
            spans[d.device] = (t0, time.time_ns())
            stats = series_stats(SeriesKey(d.device, "baseline", "baseline", d.name), latencies)
            assert stats is not None
            series.append(stats)
    finally:
        if sampler is not None:
            sampler.__exit__()
    windows: dict[str, WindowState] = {}
    if sampler is not None:
        own = {os.getpid()}  # the requests run in this process: any other process on the device is another's
        for d in devices:
            if d.hw_id and d.hw_id in sampler.samples:
                windows[d.device] = summarize_samples(_during(sampler.samples[d.hw_id], spans[d.device]), th, own)
    verdicts = evaluate(series, windows, th)
    rows = [_row(d, v) for d, v in zip(devices, verdicts, strict=True)]
    note = _note(torch, devices, requests, nv_status.reason if nv_status else None, gpus)
    if getattr(args, "json", False):
        print(json.dumps({"devices": rows, "note": note}))
    else:
        _print_table(rows, note)
    return 0


P99_MIN_REQUESTS = 100  # nearest rank: below this many, the 99th percentile is the maximum


def _note(torch: Any, devices: Sequence[_Device], requests: int, nvml_reason: str | None, gpus: bool) -> str:
    parts = []
    if not gpus:
        parts.append(
            f"no GPU visible: ran on cpu only (torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads); a coefficient needs a peer device "
            "of the same kind"
        )
    elif nvml_reason:
        parts.append(f"NVML not available ({nvml_reason}): causes of slow devices are unknown")
    parts.append(
        f"{requests} requests per device after {WARMUP} warmup; one request = matmul "
        f"{'/'.join(map(str, LADDER))} + conv 8->16 3x3 on 4x8x32x32 + transformer block "
        "d128 h4 on 4x32; P50/P99 nearest-rank; coefficient = P99 / median P99 of peers "
        "(same product name)"
    )
    if requests < P99_MIN_REQUESTS:
        parts.append(f"with {requests} requests the P99 is the slowest one (nearest rank needs "
                     f"{P99_MIN_REQUESTS} for it to be any other): a single slow request decides the coefficient; "
                     f"the agent asks min_requests ({DeviceThresholds().min_requests} by default)")
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None and gpus:
        parts.append(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}")
    return "; ".join(parts)


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _print_table(rows: Sequence[dict[str, Any]], note: str) -> None:
    print(f"{'device':<8} {'name':<28} {'p50 ms':>9} {'p99 ms':>9} {'coef':>6}  verdict")
    for r in rows:
        cause = f" ({r['cause']})" if r["cause"] else ""
        p50 = _fmt(r["p50_s"] * 1e3, ".3f")
        p99 = _fmt(r["p99_s"] * 1e3, ".3f")
        print(
            f"{r['device']:<8} {r['name'][:28]:<28} {p50:>9} {p99:>9} "
            f"{_fmt(r['coefficient'], '.2f'):>6}  {r['verdict']}{cause}"
        )
    print(f"note: {note}")
