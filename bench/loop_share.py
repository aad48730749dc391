"""One uid streams the costliest frames the wire allows; another uid's acks and ``status`` meanwhile.

    python bench/loop_share.py [SECONDS] [CONNECTIONS]      (as root: the flood runs as ``nobody``)

The agent runs as a subprocess with its own config, twice in one run, side by side: with each uid's
share of the event loop (``agent/daemon/loop_share.py``) and without it (the agent of the same code,
``LoopShare.over`` patched to never pace: the behaviour before). The flooding uid (``nobody``) sends
pre-encoded 1 MiB batches of wide events on CONNECTIONS connections, as fast as the agent reads them.
The victim (root, whose frames are never paced but who competes for the loop) sends a one-event batch
and waits for its ack, then asks ``status``, every 50 ms. Printed per arm: the victim's ack and status
latencies (median, p99, max), how many round trips it made, the flood's events read (taken in, or
duplicates of a reconnect's resent frames: read and decoded all the same) and frames paced; then the
ratios. Latencies depend on the machine (record them with its load); the ratios are the figure.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infersight.agent.commands.status import query_status
from infersight.hooks import _wire

FLOOD = r"""
import json, os, socket, struct, sys, time
sock_path, conns = sys.argv[1], int(sys.argv[2])
event = {"body": "x", "a": {"k%d" % j: "v" * 6 for j in range(100)}}
per_frame, rounds = 600, 12

def frame(obj):
    b = json.dumps(obj).encode()
    return struct.pack("!I", len(b)) + b

for c in range(conns):
    if os.fork() == 0:
        frames = [frame({"t": "b", "e": [[r * per_frame + i + 1, 5, "log", event] for i in range(per_frame)]})
                  for r in range(rounds)]  # pre-encoded: the flood's own CPU stays small
        n = 0
        while True:
            try:
                s = socket.socket(socket.AF_UNIX); s.connect(sock_path)
                s.sendall(frame({"t": "hello", "schema": 1, "producer": {"id": "flood-%d" % os.getpid(),
                                 "pid": os.getpid(), "start_ns": 1 + n, "trace_id": "c" * 32,
                                 "root_span_id": "d" * 16}}))
                for f in frames:
                    s.sendall(f)
                    s.setblocking(False)
                    try:
                        while s.recv(65536):
                            pass
                    except BlockingIOError:
                        pass
                    s.setblocking(True)
                s.close()
                n += 1
            except OSError:
                time.sleep(0.05)
print("sending", flush=True)
time.sleep(3600)
"""

NO_PACING = ("import infersight.agent.daemon.loop_share as m; m.LoopShare.over = lambda self, uid: False; "
             "from infersight.agent.cli import main; raise SystemExit(main())")


def start_agent(root: Path, paced: bool) -> tuple[subprocess.Popen[bytes], Path]:
    sock = root / "agent.sock"
    config = root / "infersight.toml"
    flood_uid = pwd.getpwnam("nobody").pw_uid
    config.write_text("[agent]\n"
                      f'socket = "{sock}"\nspool_dir = "{root / "spool"}"\n'
                      f"allowed_uids = [0, {flood_uid}]\nhealth_interval_s = 1\n"
                      f'[exporters.file]\npath = "{root / "out.otlp.jsonl"}"\nmax_bytes = 67108864\n')
    env = dict(os.environ, INFERSIGHT_STATE_DIR=str(root / "state"))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    argv = [sys.executable, "-m", "infersight"] if paced else [sys.executable, "-c", NO_PACING]
    proc = subprocess.Popen([*argv, "agent", "--config", str(config)], env=env,
                            stdout=open(root / "agent.log", "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            query_status(str(sock), 1.0)
            break
        except OSError:
            time.sleep(0.1)
    os.chmod(root, 0o755)
    os.chmod(sock, 0o666)
    return proc, sock


def read_reply(s: socket.socket, buf: bytearray) -> dict:  # type: ignore[type-arg]
    while True:
        if len(buf) >= 4:
            n = _wire.frame_size(bytes(buf[:4]))
            if len(buf) >= 4 + n:
                payload = bytes(buf[4:4 + n])
                del buf[:4 + n]
                return _wire.decode_reply(payload) or {}
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("the agent hung up")
        buf += chunk


def victim(sock: Path, seconds: float) -> tuple[list[float], list[float]]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(str(sock))
    s.sendall(_wire.encode_frame({"t": "hello", "schema": 1, "producer": {
        "id": "victim-%d" % os.getpid(), "pid": os.getpid(), "start_ns": time.time_ns(), "trace_id": "a" * 32,
        "root_span_id": "b" * 16}}))
    buf = bytearray()
    read_reply(s, buf)  # welcome
    acks: list[float] = []
    status: list[float] = []
    seq = 0
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        seq += 1
        t = time.monotonic()
        s.sendall(_wire.encode_frame({"t": "b", "e": [[seq, 5, "log", {"body": "victim"}]]}))
        while read_reply(s, buf).get("t") != "ack":
            pass
        acks.append(time.monotonic() - t)
        t = time.monotonic()
        query_status(str(sock), 30.0)
        status.append(time.monotonic() - t)
        time.sleep(0.05)
    s.close()
    return acks, status


def system_python() -> str:
    """The flood runs as nobody, who may not read a venv under /root: a system Python (stdlib only)."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    raise SystemExit("no system python3 for the flooding uid")


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def arm(paced: bool, seconds: float, conns: int) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="loopshare-"))
    proc, sock = start_agent(root, paced)
    flood: subprocess.Popen[str] | None = None
    try:
        flood = subprocess.Popen([system_python(), "-c", FLOOD, str(sock), str(conns)], stdout=subprocess.PIPE,
                                 text=True, user="nobody", start_new_session=True, cwd="/")
        assert flood.stdout is not None
        assert flood.stdout.readline().strip() == "sending"
        time.sleep(2.0)  # the flood is under way
        acks, status = victim(sock, seconds)
        counters = query_status(str(sock), 30.0)["counters"]
    finally:  # the agent goes whatever failed (a flood that could not start left it running)
        if flood is not None:
            os.killpg(flood.pid, signal.SIGKILL)
            flood.wait()
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)
    return {"round trips": len(acks), "ack p50": statistics.median(acks), "ack p99": pct(acks, 0.99),
            "ack max": max(acks), "status p50": statistics.median(status), "status p99": pct(status, 0.99),
            "status max": max(status), "flood events read": counters["events_in"] + counters["duplicates"] - len(acks),
            "frames paced": counters.get("frames_paced", 0)}


def main() -> None:
    if os.getuid() != 0:
        raise SystemExit("run as root: the flood runs as nobody, another uid than the victim's")
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    conns = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; flood on {conns} connections, {seconds:.0f} s")
    before = arm(False, seconds, conns)
    after = arm(True, seconds, conns)
    print(f"{'':18} {'unpaced (before)':>18} {'paced (now)':>14} {'ratio':>8}")
    for k in before:
        b, a = before[k], after[k]
        unit = "s" if k.startswith(("ack", "status")) else ""
        ratio = f"{b / a:.1f}x" if a and unit else ""
        fb, fa = (f"{b * 1000:.0f} ms", f"{a * 1000:.0f} ms") if unit else (f"{b:.0f}", f"{a:.0f}")
        print(f"{k:18} {fb:>18} {fa:>14} {ratio:>8}")
    print(json.dumps({"before": before, "after": after}))


if __name__ == "__main__":
    main()
