"""OOM to classified result exported: time from the OOM in a served process to the file.

A hooked child process (the bootstrap on PYTHONPATH, as ``infersight launch`` does) has
OOMs; for each one it records the wall clock just before the allocator would call its
observers, and the OOM goes through the real path: ``hooks/_alloc`` observer (memory_stats,
snapshot summary) -> hook client -> agent socket -> ``agent/oom/kind`` (parse, NVML when
there is one, rules) -> the OTLP JSON file exporter. The server catches each OOM and calls
``report_oom`` too, so the agent's observer/exception de-duplication is on the path.

Without ``--real`` the child uses a FAKE torch (only the CUDA calls ``_alloc`` makes; its
``oom()`` calls the attached observers, then raises), so this runs on any host. With
``--real`` (a CUDA GPU) the child asks real PyTorch for more than the device has.

The agent is a separate process (the daemon, with the OOM extension); this process
tails the file and stamps each classified record as it appears (poll: 0.5 ms).

    python bench/oom_latency.py [--n 200] [--interval-ms 20] [--real] [--quiet-peers 2] [--compare]

``--flood-peers N`` adds N hooked processes that log flat out (a busy producer is never held;
it loads the agent). ``--quiet-peers N`` runs N other hooked processes that each log one event every 50 ms (quiet
producers: the agent's read gate holds them, and the OOM reporter with them, to coalesce
wake-ups; issue 22.10). The OOM reporter rings the agent's doorbell after an urgent event so
that it is never held. ``--compare`` runs the same load twice, side by side: with the
doorbell, and without it (the hook's ``_ring`` disabled in the child: the behaviour before).

Goal (DESIGN): under 100 ms. Prints median, p99 and max in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BOOTSTRAP = REPO / "hooks" / "bootstrap"
GOAL_MS = 100.0
GIB = 1 << 30

AGENT = r"""
import asyncio, logging, sys
from infersight.agent.daemon import config as cfg
from infersight.agent.oom.extension import OomExtension
from infersight.agent.daemon.lifecycle import Agent
from infersight.agent.commands.compose import build_exporters
conf = cfg.load(sys.argv[1], require_file=True)
logging.basicConfig(level="WARNING")
nvml = None
try:
    from infersight.agent.devices.nvml import Nvml
    n = Nvml()
    nvml = n if n.status().available else None
except Exception:
    nvml = None
async def run():
    agent = Agent(conf, build_exporters(conf, env={}), [OomExtension(conf, nvml=nvml)])
    await agent.serve()
    return 0
sys.exit(asyncio.run(run()))
"""

QUIET_PEER = r"""
import time
from infersight import hooks
while True:
    hooks.log("quiet")
    time.sleep(0.05)
"""

FLOOD_PEER = r"""
from infersight import hooks
while True:
    for _ in range(1000):
        hooks.log("flood")
    hooks.flush(5)
"""

NO_DOORBELL = r"""
import os
if os.environ.get("BENCH_NO_DOORBELL"):  # the behaviour before issue 22.10: no doorbell
    from infersight.hooks import _connection
    _connection.Connection.ring = lambda self: None
"""

CHILD_FAKE = NO_DOORBELL + r"""
import sys, time, types
from infersight.hooks import _alloc
n, interval = int(sys.argv[1]), float(sys.argv[2])
GIB = 1 << 30

class OutOfMemoryError(RuntimeError):  # FAKE torch.OutOfMemoryError
    pass

observers = []
stats = {"allocated_bytes": {"all": {"current": 10 * GIB, "peak": 10 * GIB}},
         "reserved_bytes": {"all": {"current": 12 * GIB, "peak": 12 * GIB}},
         "num_alloc_retries": 3, "num_device_alloc": 40, "num_device_free": 2, "num_ooms": 1}
segments = [{"device": 0, "total_size": 20 << 20, "segment_type": "large",
             "blocks": [{"size": 2 << 20, "state": "inactive"}, {"size": 18 << 20, "state": "active_allocated"}]}
            for _ in range(600)]
fake = types.SimpleNamespace(  # FAKE torch: only the calls _alloc makes
    OutOfMemoryError=OutOfMemoryError,
    cuda=types.SimpleNamespace(
        is_initialized=lambda: True, get_allocator_backend=lambda: "native", device_count=lambda: 1,
        get_device_properties=lambda d: types.SimpleNamespace(total_memory=16 * GIB, uuid=None),
        memory_stats_as_nested_dict=lambda d: stats, memory_snapshot=lambda include_traces=True: segments,
        memory=types.SimpleNamespace()),
    _C=types.SimpleNamespace(_cuda_attach_out_of_memory_observer=observers.append,
                             _cuda_getMemoryFraction=lambda d: 1.0))
_alloc.install(fake)
while not observers:
    time.sleep(0.001)
for i in range(n):
    req = 6 * GIB + i * 4096  # the request size identifies the OOM in the file
    t0 = time.time_ns()
    try:
        for obs in observers:
            obs(0, req, 16 * GIB, 512 << 20)
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate %d bytes" % req)
    except OutOfMemoryError as exc:
        _alloc.report_oom(exc)  # where a server catches it
    print(req, t0, flush=True)
    time.sleep(interval)
"""

CHILD_REAL = NO_DOORBELL + r"""
import sys, time
import torch
from infersight.hooks import _alloc
n, interval = int(sys.argv[1]), float(sys.argv[2])
torch.cuda.init()
_alloc.install(torch)
_alloc.notify_cuda_ready()
deadline = time.time() + 10
while not _alloc.status()["observer"] and time.time() < deadline:
    time.sleep(0.001)
total = torch.cuda.get_device_properties(0).total_memory
for i in range(n):
    req = total + (i + 1) * (2 << 20)  # more than the device has; rounded by the allocator
    t0 = time.time_ns()
    try:
        torch.empty(req, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as exc:
        t1 = time.time_ns()  # torch's OOM handling, the hooks' observer included, is done
        _alloc.report_oom(exc)
    print(req, t0, t1, flush=True)
    time.sleep(interval)
"""


# The same OOMs with no hooks in the process (not even the bootstrap): torch's own OOM handling alone, for the
# served process's share of the figures above (the first CUDA OOM of a process is slower in torch itself).
CHILD_PLAIN = r"""
import sys, time, statistics
import torch
n = int(sys.argv[1])
torch.cuda.init()
total = torch.cuda.get_device_properties(0).total_memory
took = []
for i in range(n):
    req = total + (i + 1) * (2 << 20)
    t0 = time.time_ns()
    try:
        torch.empty(req, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        took.append((time.time_ns() - t0) / 1e6)
print("%.2f %.2f %.2f" % (took[0], statistics.median(took), max(took)))
"""


class Tail(threading.Thread):
    """Stamp every OOM log record as it lands in the file: R_bytes -> wall clock."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.seen: dict[int, int] = {}
        self.stop = False

    def run(self) -> None:
        pos = 0
        buf = b""
        while not self.stop:
            try:
                with open(self.path, "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            now = time.time_ns()
            if chunk:
                pos += len(chunk)
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if b'"oom"' in line:
                        self._scan(json.loads(line), now)
            time.sleep(0.0005)

    def _scan(self, req: dict, now: int) -> None:  # type: ignore[type-arg]
        for rl in req.get("resourceLogs", []):
            for sl in rl["scopeLogs"]:
                for rec in sl["logRecords"]:
                    for kv in rec.get("attributes", []):
                        if kv["key"] == "infersight.oom.R_bytes":
                            self.seen.setdefault(int(next(iter(kv["value"].values()))), now)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--interval-ms", type=float, default=20.0)
    ap.add_argument("--real", action="store_true", help="real CUDA OOMs (needs a GPU)")
    ap.add_argument("--quiet-peers", type=int, default=0, help="other hooked processes logging every 50 ms")
    ap.add_argument("--flood-peers", type=int, default=0, help="other hooked processes logging flat out")
    ap.add_argument("--compare", action="store_true", help="with and without the urgent doorbell, side by side")
    args = ap.parse_args()
    if not args.compare:
        return run(args, doorbell=True)[0]
    rc_on, p99_on = run(args, doorbell=True)
    rc_off, p99_off = run(args, doorbell=False)
    if p99_on and p99_off:
        print("p99 without the doorbell / with it: %.1fx" % (p99_off / p99_on))
    return rc_on or rc_off


def run(args: argparse.Namespace, doorbell: bool) -> tuple[int, float]:
    d = Path(tempfile.mkdtemp(prefix="infersight-oom-bench-"))
    sock, out, conf = d / "agent.sock", d / "out.otlp.jsonl", d / "agent.toml"
    conf.write_text(
        '[agent]\nsocket = "%s"\nspool_dir = "%s"\nstate_dir = "%s"\nhealth_interval_s = 3600\n'
        '[exporters.file]\npath = "%s"\n[rules]\ndirs = []\n' % (sock, d / "spool", d / "state", out)
    )
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("OTEL_EXPORTER_OTLP"):
            del env[k]
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(conf)], env=env)
    try:
        deadline = time.monotonic() + 20
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not sock.exists():
            print("agent did not start", file=sys.stderr)
            return 1, 0.0
        tail = Tail(out)
        tail.start()
        child_env = dict(env, INFERSIGHT_SOCKET=str(sock), INFERSIGHT_SPOOL_DIR=str(d / "spool"),
                         PYTHONPATH=str(BOOTSTRAP), INFERSIGHT_MEM_INTERVAL_S="0")
        child_env.pop("TRACEPARENT", None)
        if not doorbell:
            child_env["BENCH_NO_DOORBELL"] = "1"
        peers = [subprocess.Popen([sys.executable, "-c", QUIET_PEER], env=child_env)
                 for _ in range(args.quiet_peers)]
        peers += [subprocess.Popen([sys.executable, "-c", FLOOD_PEER], env=child_env)
                  for _ in range(args.flood_peers)]
        time.sleep(1.0 if peers else 0.0)  # connected and talking
        code = CHILD_REAL if args.real else CHILD_FAKE
        r = subprocess.run([sys.executable, "-c", code, str(args.n), str(args.interval_ms / 1000)],
                           env=child_env, capture_output=True, text=True, timeout=600, check=False)
        for peer in peers:
            peer.terminate()
            peer.wait(10)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1, 0.0
        sent = [tuple(int(x) for x in line.split()) for line in r.stdout.splitlines() if line.strip()]
        deadline = time.monotonic() + 10
        while len(tail.seen) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.01)
        tail.stop = True
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(20)
    lat = []
    by_req = dict(tail.seen)
    in_process: list[float] = []
    for req, t0, *rest in sent:
        if rest:
            in_process.append((rest[0] - t0) / 1e6)
        # Real OOMs: the allocator rounds the request up; match the nearest recorded size.
        hit = by_req.get(req)
        if hit is None and args.real:
            near = min(by_req, key=lambda x: abs(x - req), default=None)
            hit = by_req.pop(near) if near is not None and abs(near - req) < (2 << 20) else None
        if hit is not None:
            lat.append((hit - t0) / 1e6)
    mode = "real CUDA OOMs" if args.real else "FAKE torch, real hooks/agent/exporter path"
    print("OOM -> classified record in the OTLP file (%s; %d quiet and %d flooding peers; doorbell %s)"
          % (mode, args.quiet_peers, args.flood_peers, "on" if doorbell else "OFF: the behaviour before"))
    if not lat:
        print("  no OOM reached the file: FAIL")
        return 1, 0.0
    med, p99 = statistics.median(lat), pct(lat, 0.99)
    print("  OOMs %d, classified %d" % (len(sent), len(lat)))
    print("  median %.2f ms  p99 %.2f ms  max %.2f ms" % (med, p99, max(lat)))
    if in_process:
        print("  of which in the served process (the allocation to the exception caught: torch's OOM handling with "
              "the hooks' observer): median %.2f ms, first %.2f ms, max %.2f ms"
              % (statistics.median(in_process), in_process[0], max(in_process)))
        plain_env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSIGHT")}
        p = subprocess.run([sys.executable, "-c", CHILD_PLAIN, str(min(args.n, 30))], env=plain_env,
                           capture_output=True, text=True, timeout=300, check=False)
        if p.returncode == 0 and p.stdout.split():
            first, med_plain, worst = (float(x) for x in p.stdout.split())
            print("  the same OOMs without hooks (torch alone, another process): median %.2f ms, first %.2f ms, "
                  "max %.2f ms" % (med_plain, first, worst))
        else:
            print("  the same OOMs without hooks: failed (%s)" % p.stderr.strip()[-200:])
    slow = sorted(range(len(lat)), key=lambda i: -lat[i])[:3]
    print("  the first OOM %.2f ms; the slowest: %s" % (lat[0], ", ".join("#%d %.2f ms" % (i + 1, lat[i])
                                                                           for i in slow)))
    print("  goal < %.0f ms: p99 is %.1fx under the goal -> %s" % (GOAL_MS, GOAL_MS / max(p99, 1e-6),
                                                                 "OK" if p99 < GOAL_MS else "OVER"))
    return 0, p99


if __name__ == "__main__":
    sys.exit(main())
