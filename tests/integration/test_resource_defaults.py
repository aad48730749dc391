"""The agent's own OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES under each producer's resource.

The Kubernetes pod (deploy/kubernetes/pod.yaml) names the model server in the sidecar agent's
environment; the model server itself sets nothing. Its items must then carry the agent's
``service.name`` and ``k8s.pod.name`` (docs/otlp.md): the agent's attributes are defaults, a
producer's own win, and the agent's service name replaces only the default
``unknown_service:<exe>``. Before, the agent's variables reached no producer's resource.

An in-process agent (its environment set before it starts, as the sidecar's is) takes real
hellos over its socket; the items come out through the broadcaster, as every exporter gets them.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from infersight.agent.daemon import assemble
from infersight.agent.daemon.assemble import Assembler, producer_resource
from infersight.hooks import _wire
from infersight.telemetry import Item, LogItem, MetricItem

POD_ENV = {"OTEL_SERVICE_NAME": "model-server", "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=model-server"}


def info(pid: int, pid_id: str, **extra: Any) -> dict[str, Any]:
    return {"id": pid_id, "pid": pid, "start_ns": 1, "trace_id": "%032x" % pid, "root_span_id": "%016x" % pid,
            "exe": "python3.11", **extra}


async def test_a_producer_without_its_own_names_gets_the_agents(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from infersight.agent.daemon import config as cfg
    from infersight.agent.daemon.lifecycle import Agent

    for k, v in POD_ENV.items():
        monkeypatch.setenv(k, v)  # the sidecar agent's environment, read when the agent starts
    conf = cfg.load(None, env={}, flags={
        "agent.socket": str(tmp_path / "a.sock"), "agent.spool_dir": str(tmp_path / "spool"),
        "agent.state_dir": str(tmp_path / "state"), "agent.health_interval_s": 3600,
    })  # fmt: skip
    agent = Agent(conf, [], embedded=True)
    for k in POD_ENV:
        monkeypatch.delenv(k)  # read once at start: later changes to it do not count
    seen: list[Item] = []
    agent.broadcaster.taps.append(seen.extend)
    await agent.start()
    loop = asyncio.get_running_loop()
    socks = []
    try:
        producers = {
            "bare": info(os.getpid(), "bare"),  # the model server: no OTEL_* of its own
            "named": info(os.getpid(), "named", service_name="llm-own",
                          resource_attributes="k8s.pod.name=own-pod,team=ml"),
            "attr-named": info(os.getpid(), "attr-named", resource_attributes="service.name=from-attrs"),
        }
        for name, hello in producers.items():
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            await loop.sock_connect(s, conf["agent.socket"])
            await loop.sock_sendall(s, _wire.hello_frame(hello))
            await loop.sock_sendall(s, _wire.encode_frame({"t": "b", "e": [[1, 5, "log", {"body": name}]]}))
            socks.append(s)
        for _ in range(3000):
            if len([i for i in seen if isinstance(i, LogItem)]) >= 3:
                break
            await asyncio.sleep(0.01)
        logs = {i.body: i.resource.as_dict() for i in seen if isinstance(i, LogItem)}
        assert set(logs) == set(producers)
        bare = logs["bare"]
        assert bare["service.name"] == "model-server", "the agent's OTEL_SERVICE_NAME names a producer that set none"
        assert bare["k8s.pod.name"] == "model-server"
        named = logs["named"]
        assert named["service.name"] == "llm-own" and named["k8s.pod.name"] == "own-pod" and named["team"] == "ml"
        assert logs["attr-named"]["service.name"] == "from-attrs"
        assert logs["attr-named"]["k8s.pod.name"] == "model-server"
        for res in logs.values():  # what the agent detects still wins over any env attribute
            assert res["service.instance.id"] in producers and res["process.pid"] == os.getpid()
        # The agent's own telemetry keeps its own resource.
        agent.publish_health()
        own = {i.resource.get("service.name") for i in seen
               if isinstance(i, MetricItem) and i.resource.get("infersight.agent.mode")}
        assert own == {"infersight-agent"}
        assert agent.resource.get("k8s.pod.name") is None
    finally:
        for s in socks:
            s.close()
        await agent.shutdown(5)


def test_precedence_bounds_and_cleaning_of_the_agents_defaults() -> None:
    env = {"OTEL_SERVICE_NAME": " svc\x1b[31m ",
           "OTEL_RESOURCE_ATTRIBUTES": ",".join(["k8s.pod.name=pod%2Dx", "process.user.id=0", "host.name=spoof",
                                                 "api.token=s3cret", "service.name=ignored"]
                                                + ["a%d=v" % i for i in range(100)])}
    d = assemble.resource_defaults(env)
    assert d["service.name"] == "svc\ufffd[31m"  # OTEL_SERVICE_NAME wins over the attribute, cleaned
    assert d["k8s.pod.name"] == "pod-x" and "process.user.id" not in d and "host.name" not in d
    assert len(d) <= 64
    a = Assembler("h", resource_env=env)
    p = a.hello(info(7, "p7"), uid=1000)
    res = p.resource.as_dict()
    assert res["service.name"] == "svc\ufffd[31m"
    assert res["host.name"] == "h" and res["process.user.id"] == 1000, "detected values and the kernel's uid win"
    assert res["api.token"] == "***", "secret-looking values of the agent's attributes are masked too"
    # A producer's own attributes come first within the bound of 64 env-given attributes.
    own = ",".join("own%d=x" % i for i in range(60))
    q = a.hello(info(8, "p8", resource_attributes=own), uid=1000).resource.as_dict()
    assert all(q["own%d" % i] == "x" for i in range(60))
    from_defaults = sorted(k for k in d if k in q and k != "service.name")
    assert from_defaults == ["a0", "a1", "api.token", "k8s.pod.name"], "64 env-given attributes at most"
    # Without the agent's variables, nothing changes: the default name stays.
    bare = Assembler("h", resource_env={}).hello(info(9, "p9")).resource.as_dict()
    assert bare["service.name"] == "unknown_service:python3.11" and "k8s.pod.name" not in bare
    # producer_resource alone (no defaults) is as before.
    assert producer_resource(info(9, "p9"), "h").get("service.name") == "unknown_service:python3.11"
