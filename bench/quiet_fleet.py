"""Agent CPU per event: a quiet fleet (many producers at a low rate) against one busy producer.

    python bench/quiet_fleet.py [--producers 16] [--rate 100] [--seconds 6] [--rounds 3]
                                [--frames-of-1 | --raw-batch-ms 50] [--floor]

Starts a real agent process (``python -m infersight agent``, OTLP file exporter) and, in
alternating rounds, the two configurations of issue 13, each sending the same total rate:

- fleet: ``--producers`` processes at ``--rate`` events/s each;
- one:   one process at ``--producers * --rate`` events/s.

Producers are subprocesses using the real hooks (``hooks.log`` under the bootstrap), paced
every 10 ms, so whatever batching the hooks do is part of the figure. ``--frames-of-1``
replaces them with raw-socket producers that send one event per frame: the agent's fixed
cost per frame, isolated from the hooks' batching; ``--raw-batch-ms 50`` makes them send
what they have every 50 ms (the hooks' deadline batching, without the hooks).

The agent's CPU (its threads' run time from /proc, so other processes on a busy machine do
not count, only how they slow the agent) and its ``events_in`` are sampled over a window
after every producer is connected; the figure is agent CPU-microseconds per event. Each
round runs both configurations back to back against the same agent; the result is the
median over rounds of the paired ratio, and the target (issue 13) is ``fleet / one <= 2``.
Also shown: the agent's wake-ups per second (how often its event loop slept and was
woken). ``--floor`` adds the CPU per message of the barest asyncio server fed the same way
(one message per wake-up): what a wake-up alone costs on this machine, which is why the
agent reads quiet producers together (its read gate) rather than each frame as it comes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BOOTSTRAP = REPO / "hooks" / "bootstrap"
TICK_S = 0.01

HOOKED = r"""
import sys, time
from infersight import hooks
assert hooks.active(), "hooks not active"
rate, until = float(sys.argv[1]), float(sys.argv[2])
per_tick, owed, i = rate * %(tick)r, 0.0, 0
nxt = time.monotonic()
while time.time() < until:
    owed += per_tick
    while owed >= 1:
        hooks.log("request done", i=i, model="m", latency_s=0.012)
        i += 1
        owed -= 1
    nxt += %(tick)r
    d = nxt - time.monotonic()
    if d > 0:
        time.sleep(d)
hooks.flush(10)
""" % {"tick": TICK_S}

RAW = r"""
import json, os, socket, struct, sys, time
sock_path, rate, until = sys.argv[3], float(sys.argv[1]), float(sys.argv[2])
def frame(o):
    b = json.dumps(o, separators=(",", ":")).encode()
    return struct.pack("!I", len(b)) + b
s = socket.socket(socket.AF_UNIX); s.connect(sock_path)
s.sendall(frame({"t": "hello", "schema": 1, "producer": {"id": "raw-%%d" %% os.getpid(), "pid": os.getpid(),
          "start_ns": time.time_ns(), "trace_id": "a" * 32, "root_span_id": "b" * 16}}))
s.recv(100); s.setblocking(False)
batch_s = float(sys.argv[4])
per_tick, owed, i, pending, sent_at = rate * %(tick)r, 0.0, 0, [], time.monotonic()
nxt = time.monotonic()
while time.time() < until:
    owed += per_tick
    while owed >= 1:
        i += 1
        pending.append([i, time.time_ns(), "log", {"body": "request done", "sev": "INFO",
                        "a": {"i": i, "model": "m", "latency_s": 0.012}}])
        owed -= 1
        if not batch_s:  # one event per frame
            s.setblocking(True); s.sendall(frame({"t": "b", "e": pending})); s.setblocking(False)
            pending = []
    if pending and time.monotonic() - sent_at >= batch_s:
        s.setblocking(True); s.sendall(frame({"t": "b", "e": pending})); s.setblocking(False)
        pending, sent_at = [], time.monotonic()
    try:
        while s.recv(65536):
            pass
    except BlockingIOError:
        pass
    nxt += %(tick)r
    d = nxt - time.monotonic()
    if d > 0:
        time.sleep(d)
""" % {"tick": TICK_S}


def query_status(path: str) -> dict[str, Any]:
    from infersight.hooks import _wire

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(_wire.STATUS_FRAME)
        buf = b""
        while True:
            frames, buf, _bad = _wire.split_frames(buf)
            if frames:
                msg = _wire.decode_payload(frames[0])
                assert msg is not None
                return msg
            chunk = s.recv(65536)
            if not chunk:
                raise OSError("agent closed the connection")
            buf += chunk


def cpu_s(pid: int) -> tuple[float, float, float]:
    """(total, user, system) CPU seconds of a process. The total sums the scheduler's
    nanosecond run time of its threads (``/proc/PID/task/*/schedstat``), not the 10 ms ticks
    of ``/proc/PID/stat``, which would be a few % of a quiet agent's figure; user and system
    (ticks) are only for the split."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    user, system = int(fields[11]) / tck, int(fields[12]) / tck
    total = 0
    try:
        for tid in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/schedstat" % (pid, tid)) as f:
                total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # no schedstat: the ticks
        return user + system, user, system
    return total / 1e9, user, system


def wakeups(pid: int) -> int:
    """Times the agent's event loop went to sleep and was woken (voluntary context switches
    of its main thread)."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


class Agent:
    def __init__(self, root: Path) -> None:
        self.sock = root / "agent.sock"
        self.spool = root / "spool"
        self.out = root / "out.otlp.jsonl"
        conf = root / "infersight.toml"
        conf.write_text("[agent]\nsocket = \"%s\"\nspool_dir = \"%s\"\nhealth_interval_s = 3600\n"
                        "[exporters.file]\npath = \"%s\"\n" % (self.sock, self.spool, self.out))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "INFERSIGHT"))}
        env["INFERSIGHT_STATE_DIR"] = str(root / "state")  # its own cold-start history, not the user's
        self.proc = subprocess.Popen([sys.executable, "-m", "infersight", "agent", "--config", str(conf)],
                                     stdout=open(root / "agent.log", "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                     env=env)
        deadline = time.monotonic() + 30
        while not self.sock.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("agent did not start: see %s" % (root / "agent.log"))
            time.sleep(0.05)

    def status(self) -> dict[str, Any]:
        return query_status(str(self.sock))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def one_round(agent: Agent, producers: int, rate: float, seconds: float, raw: bool, root: Path,
              raw_batch_s: float = 0.0) -> dict[str, Any]:
    warmup = 2.0
    until = time.time() + warmup + seconds + 1.0
    env = dict(os.environ, INFERSIGHT_SOCKET=str(agent.sock), INFERSIGHT_SPOOL_DIR=str(root / "hookspool"),
               PYTHONPATH=str(BOOTSTRAP))
    env.pop("TRACEPARENT", None)
    base = agent.status()["producers"]
    procs = [subprocess.Popen([sys.executable, "-c", RAW if raw else HOOKED, str(rate), str(until), str(agent.sock),
                               str(raw_batch_s)],
                              env=env) for _ in range(producers)]
    try:
        deadline = time.monotonic() + 30
        while agent.status()["producers"] < base + producers:
            if time.monotonic() > deadline:
                raise SystemExit("producers did not connect")
            time.sleep(0.1)
        time.sleep(max(0.0, until - seconds - 1.0 - time.time()))
        pid = agent.proc.pid
        e0, c0, w0, t0 = agent.status()["events_in"], cpu_s(pid), wakeups(pid), time.monotonic()
        time.sleep(seconds)
        e1, c1, w1, t1 = agent.status()["events_in"], cpu_s(pid), wakeups(pid), time.monotonic()
    finally:
        for p in procs:
            p.wait(60)
    events, cpu, system, wall = e1 - e0, c1[0] - c0[0], c1[2] - c0[2], t1 - t0
    return {"events": events, "events_per_s": round(events / wall),
            "agent_cpu_pct": round(100 * cpu / wall, 1),
            "agent_sys_pct": round(100 * system / wall, 1),
            "agent_wakeups_per_s": round((w1 - w0) / wall),
            "agent_cpu_us_per_event": round(cpu / max(1, events) * 1e6, 1)}


FLOOR_CLIENT = r"""
import socket, sys, time
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.setblocking(False)
period, end = float(sys.argv[2]), time.time() + float(sys.argv[3])
nxt = time.monotonic()
while time.time() < end:
    s.setblocking(True); s.sendall(b"x" * 200); s.setblocking(False)
    try:
        while s.recv(4096):
            pass
    except BlockingIOError:
        pass
    nxt += period
    d = nxt - time.monotonic()
    if d > 0:
        time.sleep(d)
"""


def asyncio_floor(root: Path, producers: int, frames_per_s: float, seconds: float) -> float:
    """CPU microseconds per message of the barest asyncio server (a Protocol that counts a
    message and writes an ack), fed like the fleet: what any asyncio agent pays per wakeup here."""
    import asyncio
    import resource

    path = str(root / "floor.sock")

    async def run() -> float:
        count = [0]

        class Counting(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport

            def data_received(self, data: bytes) -> None:
                count[0] += 1
                self.transport.write(b"ack")  # type: ignore[attr-defined]

        server = await asyncio.get_running_loop().create_unix_server(Counting, path)
        procs = [subprocess.Popen([sys.executable, "-c", FLOOR_CLIENT, path, str(producers / frames_per_s),
                                   str(seconds + 2)]) for _ in range(producers)]
        await asyncio.sleep(1)
        r0, c0 = resource.getrusage(resource.RUSAGE_SELF), count[0]
        await asyncio.sleep(seconds)
        r1, c1 = resource.getrusage(resource.RUSAGE_SELF), count[0]
        for p in procs:
            p.wait()
        server.close()
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        return cpu / max(1, c1 - c0) * 1e6

    return round(asyncio.run(run()), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--producers", type=int, default=16)
    ap.add_argument("--rate", type=float, default=100.0, help="events/s of each fleet producer")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--frames-of-1", action="store_true", help="raw producers, one event per frame")
    ap.add_argument("--floor", action="store_true",
                    help="also measure the barest asyncio server's CPU per message, fed as the fleet")
    ap.add_argument("--raw-batch-ms", type=float, default=0.0,
                    help="raw producers that send what they have every N ms (a hook's deadline batching)")
    args = ap.parse_args()
    raw = args.frames_of_1 or args.raw_batch_ms > 0
    root = Path(tempfile.mkdtemp(prefix="quiet-fleet-"))
    agent = Agent(root)
    rounds: list[tuple[dict[str, Any], dict[str, Any]]] = []
    try:
        for r in range(args.rounds):  # side by side: the two configurations alternate, same agent
            f = one_round(agent, args.producers, args.rate, args.seconds, raw, root, args.raw_batch_ms / 1000)
            o = one_round(agent, 1, args.rate * args.producers, args.seconds, raw, root, args.raw_batch_ms / 1000)
            ratio = f["agent_cpu_us_per_event"] / max(o["agent_cpu_us_per_event"], 1e-9)
            rounds.append((f, o))
            print(json.dumps({"round": r, "fleet": f, "one": o, "ratio": round(ratio, 2)}), flush=True)
    finally:
        agent.stop()

    def median(config: int, key: str) -> float:
        return round(statistics.median(r[config][key] for r in rounds), 1)

    fm, om = median(0, "agent_cpu_us_per_event"), median(1, "agent_cpu_us_per_event")
    paired = statistics.median(f["agent_cpu_us_per_event"] / max(o["agent_cpu_us_per_event"], 1e-9)
                               for f, o in rounds)
    floor = asyncio_floor(root, args.producers, args.producers * args.rate, args.seconds) if args.floor else None
    kind = ("raw, a frame every %g ms" % args.raw_batch_ms if args.raw_batch_ms
            else "raw, one event per frame" if raw else "hooks")
    fleet_name = "%d x %g ev/s" % (args.producers, args.rate)
    one_name = "1 x %g ev/s" % (args.producers * args.rate)
    print("median of %d rounds (%s)        %16s  %16s" % (args.rounds, kind, fleet_name, one_name))
    for label, key in (("agent CPU us per event", "agent_cpu_us_per_event"), ("agent CPU %", "agent_cpu_pct"),
                       ("agent wake-ups per s", "agent_wakeups_per_s"), ("events per s", "events_per_s")):
        print("  %-40s %16s  %16s" % (label, median(0, key), median(1, key)))
    print("  fleet / one (median of paired rounds): %.2f  (target <= 2)" % paired)
    print(json.dumps({
        "producers": args.producers, "rate_each": args.rate, "producers_kind": kind, "rounds": args.rounds,
        "fleet_agent_cpu_us_per_event": fm, "one_agent_cpu_us_per_event": om,
        "ratio_fleet_over_one": round(paired, 2), "ratio_of_medians": round(fm / om, 2), "target_ratio_max": 2.0,
        **({"bare_asyncio_cpu_us_per_message": floor} if floor is not None else {}),
    }))


if __name__ == "__main__":
    main()
