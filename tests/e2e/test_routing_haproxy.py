"""Routing hints end to end: a real HAProxy (Debian's haproxy) in front of two real
FastAPI/uvicorn backends of one service, hooked, reporting to a real agent with routing on.

FAKE DEVICE: the backends stand in for GPUs (tests/support/routing_backend.py): each serves one
request at a time; "slow" takes four times as long per request, the stand-in for a slow GPU.

- Under the same bounded open-loop load, measured side by side in one run: through plain
  round robin, then through the same servers with infersight's agent-check weights. The slow
  backend's share of requests falls to 35% or less and the pool's P99 to 0.7x or less of
  round robin's. The agent's Prometheus gauges say the same.
- A backend restarted with a 5 s cold start, which listens from its first second (as vLLM
  does), gets no request until it is ready, and the clients see no error.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from agent_check import ask
from conftest import AgentProcess, free_port, hook_env, wait_for
from mosquitto import retained, running_broker

SUPPORT = Path(__file__).resolve().parents[1] / "support"
BACKEND = SUPPORT / "routing_backend.py"
HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)
pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy not installed (apt-get install haproxy)")
SERVICE = "llm-pool"
FAST_S = 0.02
SLOW_S = 4 * FAST_S


@dataclass
class Result:
    sent: float
    latency: float
    backend: str | None
    pid: int | None
    error: str | None


def _server_line(name: str, port: int, agent_port: int | None) -> str:
    line = "  server %s 127.0.0.1:%d weight 100 check inter 200ms rise 2 fall 1" % (name, port)
    if agent_port is not None:
        line += ' agent-check agent-addr 127.0.0.1 agent-port %d agent-send "%d\\n" agent-inter 200ms' % (
            agent_port, port)
    return line


def haproxy_config(root: Path, rr_port: int, ag_port: int, servers: dict[str, int], agent_port: int) -> str:
    rr = "\n".join(_server_line(n, p, None) for n, p in servers.items())
    ag = "\n".join(_server_line(n, p, agent_port) for n, p in servers.items())
    return f"""global
  maxconn 1024
  stats socket {root}/haproxy.sock mode 600 level admin
defaults
  mode http
  timeout connect 1s
  timeout client 60s
  timeout server 60s
  retries 3
  option redispatch 1
frontend fe_rr
  bind 127.0.0.1:{rr_port}
  default_backend be_rr
frontend fe_agent
  bind 127.0.0.1:{ag_port}
  default_backend be_agent
backend be_rr
  balance roundrobin
{rr}
backend be_agent
  balance roundrobin
{ag}
"""


def haproxy_stat(root: Path) -> dict[tuple[str, str], dict[str, str]]:
    """``show stat`` over HAProxy's admin socket: (backend, server) -> columns."""
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(root / "haproxy.sock"))
        s.sendall(b"show stat\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    lines = data.decode().splitlines()
    head = lines[0].lstrip("# ").split(",")
    rows = [dict(zip(head, line.split(","), strict=False)) for line in lines[1:] if line]
    return {(r["pxname"], r["svname"]): r for r in rows}


class Stack:
    def __init__(self, root: Path, agent: AgentProcess) -> None:
        self.root = root
        self.agent = agent
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.haproxy: subprocess.Popen[bytes] | None = None

    def backend(self, name: str, port: int, service_s: float, **env: str) -> subprocess.Popen[bytes]:
        e = hook_env(self.agent.sock, self.agent.spool, OTEL_SERVICE_NAME=SERVICE, NAME=name, PORT=str(port),
                     SERVICE_S=str(service_s), **env)
        log = open(self.root / ("%s.log" % name), "ab")  # noqa: SIM115
        p = subprocess.Popen([sys.executable, str(BACKEND)], env=e, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = p
        return p

    def start_haproxy(self, config: str) -> None:
        cfg = self.root / "haproxy.cfg"
        cfg.write_text(config)
        assert HAPROXY is not None
        check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
        self.haproxy = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=open(self.root / "haproxy.log", "ab"),  # noqa: SIM115
                                        stderr=subprocess.STDOUT)
        assert wait_for((self.root / "haproxy.sock").exists, 15)

    def close(self) -> None:
        for p in [*self.procs.values(), *([self.haproxy] if self.haproxy else [])]:
            if p.poll() is None:
                p.kill()
                p.wait(10)


HOST = "routing-host"


@pytest.fixture
def stack(tmp_path: Path, agent_factory) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    prom = free_port()
    with running_broker(tmp_path / "mosquitto") as broker:
        agent = agent_factory(
            "[routing]\nenabled = true\nagent_check_port = 0\n"
            f"[exporters.prometheus]\nenabled = true\nport = {prom}\n"
            f'[exporters.mqtt]\nurl = "{broker.url}"\n'
        )
        agent.config.write_text(agent.config.read_text().replace("[agent]\n", f'[agent]\nhost_name = "{HOST}"\n'))
        agent.start()
        s = Stack(tmp_path, agent)
        s.prom_port = prom  # type: ignore[attr-defined]
        s.broker = broker  # type: ignore[attr-defined]
        yield s
        s.close()


def agent_check_port(agent: AgentProcess) -> int:
    port = agent.status()["routing"]["agent_check_port"]
    assert isinstance(port, int) and port > 0
    return port


def listening_addresses(port: int) -> set[str]:
    """The local addresses that listen on ``port``, from the kernel's socket tables."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hexport = local.rsplit(":", 1)
                if state == "0A" and int(hexport, 16) == port:
                    out.add(addr)
    return out


def ready_ports(agent: AgentProcess) -> set[int]:
    """The ports of the instances the agent holds ready (the fail-open reply for a port it does not know says
    "up ready 100%" too: a reply alone does not tell)."""
    return {i["port"] for i in agent.status()["routing"]["instances"] if i["state"] == "ready" and i["port"]}


def weight(reply: str) -> int | None:
    words = reply.split()
    return int(words[2][:-1]) if words[:2] == ["up", "ready"] else None


async def open_loop(url: str, n: int, rate: float) -> list[Result]:
    """``n`` requests at ``rate`` per second, each on a new connection, whatever the answers."""
    out: list[Result] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def one() -> None:
            t0 = time.time()
            p0 = time.perf_counter()
            try:
                r = await client.get(url)
                lat = time.perf_counter() - p0
                if r.status_code != 200:
                    out.append(Result(t0, lat, None, None, "HTTP %d" % r.status_code))
                    return
                body = r.json()
                out.append(Result(t0, lat, body["backend"], body["pid"], None))
            except httpx.HTTPError as exc:
                out.append(Result(t0, time.perf_counter() - p0, None, None, type(exc).__name__))

        tasks = []
        start = time.perf_counter()
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return out


def p99(results: list[Result]) -> float:
    lat = sorted(r.latency for r in results)
    return lat[max(0, -(-99 * len(lat) // 100) - 1)]


def share(results: list[Result], backend: str) -> float:
    return sum(1 for r in results if r.backend == backend) / len(results)


def _gauges(port: int) -> dict[str, float]:
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(("infersight_routing_weight_ratio{", "infersight_instance_settled{"))}


def test_agent_check_weights_cut_the_slow_backends_share_and_the_pool_p99(stack: Stack) -> None:
    fast, slow = free_port(), free_port()
    stack.backend("fast", fast, FAST_S)
    stack.backend("slow", slow, SLOW_S)  # FAKE: the stand-in for a GPU four times slower
    ac = agent_check_port(stack.agent)
    assert listening_addresses(ac) == {"0100007F"}  # 127.0.0.1 only, as no routing.host was configured
    assert wait_for(lambda: {fast, slow} <= ready_ports(stack.agent), 60), \
        "both backends should be ready instances: %r" % [ask(ac, p) for p in (fast, slow)]
    rr_port, ag_port = free_port(), free_port()
    stack.start_haproxy(haproxy_config(stack.root, rr_port, ag_port, {"fast": fast, "slow": slow}, ac))
    assert wait_for(lambda: all(haproxy_stat(stack.root)[(b, s)]["status"].startswith("UP")
                                for b in ("be_rr", "be_agent") for s in ("fast", "slow")), 30)

    # The same bounded load, side by side: plain round robin first (the agent learns the
    # backends' latency from it), then the agent-check backend once HAProxy applied the weights.
    n, rate = 240, 30.0
    rr = asyncio.run(open_loop("http://127.0.0.1:%d/infer" % rr_port, n, rate))

    def weights_applied() -> bool:
        st = haproxy_stat(stack.root)
        return int(st[("be_agent", "slow")]["weight"]) <= 30 and int(st[("be_agent", "fast")]["weight"]) == 100

    assert wait_for(weights_applied, 60), (ask(ac, fast), ask(ac, slow), stack.agent.status().get("routing"))
    weighted = asyncio.run(open_loop("http://127.0.0.1:%d/infer" % ag_port, n, rate))

    assert [r.error for r in rr + weighted if r.error] == []
    shares = (share(rr, "slow"), share(weighted, "slow"))
    tails = (p99(rr), p99(weighted))
    print("slow share: round robin %.2f, agent-check %.2f; P99: %.3f s vs %.3f s (ratio %.2f)"
          % (*shares, *tails, tails[1] / tails[0]))
    assert shares[1] <= 0.35, shares
    assert tails[1] <= 0.7 * tails[0], tails

    gauges = _gauges(stack.prom_port)  # type: ignore[attr-defined]
    key = 'infersight_routing_weight_ratio{port="%d",service="%s"}'
    assert gauges[key % (slow, SERVICE)] <= 0.35 and gauges[key % (fast, SERVICE)] == 1.0, gauges
    assert gauges['infersight_instance_settled{port="%d",service="%s"}' % (fast, SERVICE)] == 1.0, gauges
    topic = "infersight/%s/routing/%s/%%d" % (HOST, SERVICE)
    mqtt = {p: json.loads(asyncio.run(retained(stack.broker, topic % p)) or b"{}")  # type: ignore[attr-defined]
            for p in (fast, slow)}
    assert mqtt[slow]["weight_ratio"] <= 0.35 and mqtt[slow]["state"] == "ready", mqtt
    assert mqtt[fast]["weight_ratio"] == 1.0 and mqtt[fast]["settled"] is True, mqtt
    assert mqtt[fast]["reply"] == "up ready 100%" and mqtt[fast]["server.port"] == fast
    inst = {i["port"]: i for i in stack.agent.status()["routing"]["instances"]}
    assert inst[fast]["settled"] and inst[slow]["weight_ratio"] <= 0.35

    def instances() -> dict[int, dict]:  # type: ignore[type-arg]
        return {i["pid"]: i for i in stack.agent.status()["requests"]["instances"]}

    # Every request was timed (no code change in the backend), as its own event: both phases.
    assert wait_for(lambda: sum(i["count"] for i in instances().values()) == 2 * n, 30), instances()
    per_instance = instances()
    assert per_instance[stack.procs["slow"].pid]["p50_s"] > per_instance[stack.procs["fast"].pid]["p50_s"]


def test_a_restarted_backend_gets_no_request_until_ready_and_clients_see_no_error(stack: Stack) -> None:
    a, b = free_port(), free_port()
    stack.backend("a", a, FAST_S)
    stack.backend("b", b, FAST_S)
    ac = agent_check_port(stack.agent)
    assert wait_for(lambda: {a, b} <= ready_ports(stack.agent), 60)
    rr_port, ag_port = free_port(), free_port()
    stack.start_haproxy(haproxy_config(stack.root, rr_port, ag_port, {"a": a, "b": b}, ac))
    assert wait_for(lambda: all(haproxy_stat(stack.root)[("be_agent", s)]["status"].startswith("UP")
                                for s in ("a", "b")), 30)
    ready_file = stack.root / "b2.ready"
    results: list[Result] = []

    async def collecting() -> None:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            stop = asyncio.Event()
            inflight: set[asyncio.Task[None]] = set()

            async def one() -> None:
                t0 = time.time()
                p0 = time.perf_counter()
                try:
                    r = await client.get("http://127.0.0.1:%d/infer" % ag_port)
                    body = r.json() if r.status_code == 200 else {}
                    results.append(Result(t0, time.perf_counter() - p0, body.get("backend"), body.get("pid"),
                                          None if r.status_code == 200 else "HTTP %d" % r.status_code))
                except httpx.HTTPError as exc:
                    results.append(Result(t0, time.perf_counter() - p0, None, None, type(exc).__name__))

            async def load() -> None:
                while not stop.is_set():
                    t = asyncio.create_task(one())
                    inflight.add(t)
                    t.add_done_callback(inflight.discard)
                    await asyncio.sleep(0.05)

            loader = asyncio.create_task(load())
            await asyncio.sleep(1.0)
            old = stack.procs["b"]
            old.send_signal(signal.SIGTERM)
            await asyncio.to_thread(old.wait, 30)
            stack.backend("b2", b, FAST_S, COLD_S="5", EARLY_LISTEN="1", INFERSIGHT_READY_ON_LISTEN="0",
                          READY_FILE=str(ready_file))
            assert await asyncio.to_thread(wait_for, ready_file.exists, 60)
            new_pid = stack.procs["b2"].pid
            served = await asyncio.to_thread(wait_for, lambda: any(r.pid == new_pid for r in results), 60)
            stop.set()
            await loader
            await asyncio.gather(*list(inflight))
            assert served, "the restarted backend should serve again once ready"

    asyncio.run(collecting())
    ready_at = float(ready_file.read_text())
    new_pid = stack.procs["b2"].pid
    errors = [r.error for r in results if r.error]
    early = [r for r in results if r.pid == new_pid and r.sent < ready_at]
    print("requests %d, to the restart %d, errors %d, sent to it before ready %d"
          % (len(results), sum(r.pid == new_pid for r in results), len(errors), len(early)))
    assert errors == []
    assert early == [], "the restarted backend got requests sent before it was ready"
    assert any(r.backend == "a" and r.sent < ready_at for r in results)  # the pool kept serving meanwhile
