"""Health tells the truth (issue 21, point 2), and the daemon's embedded default (point 1).

The real ``infersight agent`` with a real ``NOTIFY_SOCKET`` datagram socket, probed by the
real ``infersight status`` command, as a container or systemd probe runs it. Each fault is
real: a Prometheus port another process holds, a file path that cannot be written (a
directory is there), a real OTLP receiver that answers 500. Each turns ``status`` non-zero,
naming the exporter and the reason, and systemd's STATUS= line says the same.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_port, read_otlp_lines, spans, wait_for
from otlp_receiver import OtlpReceiver

CLI = [sys.executable, "-m", "infersight"]


class Notifications:
    """systemd's end of NOTIFY_SOCKET: every datagram, as KEY=VALUE lines."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.got: list[dict[str, str]] = []

    def status_lines(self) -> list[str]:
        self.sock.setblocking(False)
        try:
            while True:
                data = self.sock.recv(65536).decode()
                self.got.append(dict(line.split("=", 1) for line in data.split("\n") if line))
        except BlockingIOError:
            pass
        return [m["STATUS"] for m in self.got if "STATUS" in m]


@pytest.fixture
def notify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Notifications]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        path = tmp_path / "notify.sock"
        sock.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
        yield Notifications(sock)


def status(sock: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "status", "--socket", str(sock), *args], capture_output=True, text=True,
                          timeout=60)


def unhealthy_naming(sock: Path, exporter: str, reason: str) -> subprocess.CompletedProcess[str]:
    """Wait until ``status`` exits non-zero naming ``exporter`` and ``reason``; that run."""
    last: list[subprocess.CompletedProcess[str]] = []

    def check() -> bool:
        r = status(sock)
        last[:] = [r]
        return r.returncode != 0 and "PROBLEM exporter %s:" % exporter in r.stdout and reason in r.stdout

    assert wait_for(check, 30, 0.2), last[0].stdout + last[0].stderr
    return last[0]


def status_says(notify: Notifications, exporter: str, reason: str) -> str:
    found: list[str] = []

    def check() -> bool:
        found[:] = [s for s in notify.status_lines()
                    if s.startswith("UNHEALTHY") and "exporter %s:" % exporter in s and reason in s]
        return bool(found)

    assert wait_for(check, 30, 0.1), notify.status_lines()[-3:]
    return found[-1]


def test_a_taken_prometheus_port_makes_the_agent_unhealthy(agent_factory, notify: Notifications) -> None:  # type: ignore[no-untyped-def]
    """Degraded, not fatal: the agent keeps running and recording to its other sinks, and the
    probe says what is wrong. Before: ``status`` said healthy while nothing served /metrics."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        agent = agent_factory(f"[exporters.prometheus]\nenabled = true\nport = {port}\n").start()
        r = unhealthy_naming(agent.sock, "prometheus", "cannot listen on 127.0.0.1:%d" % port)
        assert "Address already in use" in r.stdout
        line = status_says(notify, "prometheus", "cannot listen on 127.0.0.1:%d" % port)
        assert "Address already in use" in line
        assert "exporter(s) down" not in line, line  # named once, by its problem
        h = json.loads(status(agent.sock, "--json").stdout)
        assert h["healthy"] is False
        assert h["problems"][0]["exporter"] == "prometheus"
        # the exporter's own line agrees (it said peer_up=1 beside the PROBLEM line: a README walkthrough)
        (prom,) = [e for e in h["exporters"] if e["name"] == "prometheus"]
        assert prom["peer_up"] == 0
        assert "exporter prometheus   peer_up=0" in r.stdout, r.stdout
        assert agent.proc.poll() is None, "a bind failure is a degraded state, not an exit"
        assert "file %s" % agent.out in h["sinks"]
    finally:
        holder.close()


def test_an_unwritable_file_path_makes_the_agent_unhealthy(agent_factory, notify: Notifications) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory()
    agent.out.mkdir()  # a directory where the file should be: it cannot be opened for writing
    agent.start()
    r = unhealthy_naming(agent.sock, "file", "cannot start: [Errno 21] Is a directory")
    assert str(agent.out) in r.stdout
    status_says(notify, "file", "Is a directory")


def test_a_receiver_answering_500_makes_the_agent_unhealthy_until_it_recovers(  # type: ignore[no-untyped-def]
        agent_factory, notify: Notifications) -> None:
    """No progress while holding data (``agent.exporter_stall_s``): the agent's own metrics
    keep coming every half second and the receiver refuses them all."""
    with OtlpReceiver(grpc_=False) as rx:
        rx.set_fail_status(500)
        agent = agent_factory(f'[exporters.otlp]\nendpoint = "{rx.http_endpoint}"\n')
        agent.config.write_text(agent.config.read_text().replace("[agent]\n", "[agent]\nexporter_stall_s = 1\n"))
        agent.start()
        r = unhealthy_naming(agent.sock, "otlp", "500")
        assert "no progress for" in r.stdout or "refused" in r.stdout
        status_says(notify, "otlp", "500")
        # the pod's liveness probe: the agent answers, so no restart (it would not mend the collector)
        alive = status(agent.sock, "--alive")
        assert alive.returncode == 0 and "UNHEALTHY" in alive.stdout, alive.stdout
        rx.set_fail_status(None)  # the receiver recovers: so does the verdict
        assert wait_for(lambda: status(agent.sock).returncode == 0, 60, 0.2), status(agent.sock).stdout
        assert wait_for(lambda: any(s.startswith("healthy") for s in notify.status_lines()[-1:]), 30, 0.1)


def test_a_broker_certificate_that_does_not_verify_makes_the_agent_unhealthy(  # type: ignore[no-untyped-def]
        tmp_path: Path, agent_factory, notify: Notifications) -> None:
    """A real mosquitto on TLS whose CA the agent was not given: a bad certificate is a
    configuration the exporter cannot work with, unhealthy at once (not after the stall time)."""
    from mosquitto import make_tls, running_broker

    with running_broker(tmp_path / "broker", tls=make_tls(tmp_path / "tls")) as broker:
        agent = agent_factory(f'[exporters.mqtt]\nurl = "{broker.url}"\nconnect_timeout_s = 3\n').start()
        unhealthy_naming(agent.sock, "mqtt", "certificate did not verify")
        status_says(notify, "mqtt", "certificate did not verify")


def test_stall_is_a_config_key_with_env_and_file(tmp_path: Path) -> None:
    from infersight.agent.daemon import config as cfg

    f = tmp_path / "c.toml"
    f.write_text("[agent]\nexporter_stall_s = 7\n")
    assert cfg.load(str(f), env={})["agent.exporter_stall_s"] == 7.0
    assert cfg.load(str(f), env={"INFERSIGHT_EXPORTER_STALL_S": "3"})["agent.exporter_stall_s"] == 3.0
    assert cfg.load(None, env={})["agent.exporter_stall_s"] == 120.0
    with pytest.raises(cfg.ConfigError, match="exporter_stall_s"):
        cfg.load(None, env={"INFERSIGHT_EXPORTER_STALL_S": "soon"})


# -- point 1: the daemon's embedded default ---------------------------------------------------


def run_agent(tmp_path: Path, config_text: str | None, **env: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    sock, state, log = tmp_path / "a.sock", tmp_path / "state", tmp_path / "agent.log"
    conf = tmp_path / "infersight.toml"
    args = [*CLI, "agent"]
    if config_text is not None:
        conf.write_text(config_text)
        args += ["--config", str(conf)]
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "INFERSIGHT_"))}
    e.update(INFERSIGHT_SOCKET=str(sock), INFERSIGHT_STATE_DIR=str(state),
             INFERSIGHT_SPOOL_DIR=str(tmp_path / "spool"), INFERSIGHT_CONFIG=str(tmp_path / "absent.toml"), **env)
    proc = subprocess.Popen(args, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=e)  # noqa: SIM115
    assert wait_for(lambda: status(sock).returncode in (0, 1) and "agent 0." in status(sock).stdout, 20), \
        log.read_text()
    return proc, sock, log


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    assert proc.wait(30) == 0


def test_the_default_file_beside_another_sink_is_no_missing_sink(tmp_path: Path) -> None:
    """exporters.file.enabled = true beside an OTLP endpoint: the log said "no sink configured" while
    status listed both sinks (a review of the systemd path)."""
    port = free_port()
    proc, sock, log = run_agent(tmp_path, '[exporters.file]\nenabled = true\n[exporters.otlp]\n'
                                          'endpoint = "http://127.0.0.1:%d"\n' % port)
    default = tmp_path / "state" / "infersight.otlp.jsonl"
    try:
        assert "recording also to the default file %s" % default in log.read_text()
        assert "no sink configured" not in log.read_text()
    finally:
        stop(proc)


def test_no_sink_configured_records_to_the_default_file(tmp_path: Path) -> None:
    """Before: no sink at all, events counted and dropped. Now the state dir's OTLP file."""
    proc, sock, log = run_agent(tmp_path, None)
    default = tmp_path / "state" / "infersight.otlp.jsonl"
    try:
        r = status(sock)
        assert r.returncode == 0, r.stdout
        assert "sinks                  file %s" % default in r.stdout
        assert "no sink configured: recording to the default file %s" % default in log.read_text()
        env = dict(os.environ, INFERSIGHT_SOCKET=str(sock), INFERSIGHT_SPOOL_DIR=str(tmp_path / "spool"),
                   PYTHONPATH=str(Path(__file__).resolve().parents[2] / "hooks" / "bootstrap"))
        env.pop("TRACEPARENT", None)
        subprocess.run([sys.executable, "-c", "from infersight import hooks\nwith hooks.stage('warmup'):\n    pass\n"],
                       env=env, check=True, timeout=60)
        assert wait_for(lambda: default.exists() and any(
            s["name"] == "coldstart.warmup" for s in spans(read_otlp_lines(default))), 20)
    finally:
        stop(proc)


def test_another_sink_replaces_the_default_file(tmp_path: Path) -> None:
    with OtlpReceiver(grpc_=False) as rx:
        proc, sock, _log = run_agent(tmp_path, f'[exporters.otlp]\nendpoint = "{rx.http_endpoint}"\n')
        try:
            h = json.loads(status(sock, "--json").stdout)
            assert [e["name"] for e in h["exporters"]] == ["otlp"]
            assert h["warnings"] == []
        finally:
            stop(proc)
    assert not (tmp_path / "state" / "infersight.otlp.jsonl").exists()


def test_every_sink_disabled_warns_at_start_and_in_status(tmp_path: Path) -> None:
    proc, sock, log = run_agent(tmp_path, "[exporters.file]\nenabled = false\n")
    try:
        r = status(sock)
        assert r.returncode == 0  # a choice, not a failure
        assert "WARNING no sink: every sink is disabled" in r.stdout
        assert "sinks                  none" in r.stdout
        assert "WARNING" in log.read_text() and "no sink: every sink is disabled" in log.read_text()
    finally:
        stop(proc)
    assert not (tmp_path / "state").exists() or not (tmp_path / "state" / "infersight.otlp.jsonl").exists()


def test_file_enabled_true_keeps_the_default_file_beside_another_sink(tmp_path: Path) -> None:
    from infersight.agent.commands.compose import build_exporters
    from infersight.agent.daemon import config as cfg

    env = {"INFERSIGHT_STATE_DIR": str(tmp_path), "INFERSIGHT_OTLP_FILE_ENABLED": "true",
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}
    conf = cfg.load(None, env=env)
    got = build_exporters(conf, env=env)
    assert [e.name for e in got] == ["file", "otlp"]
    assert got[0].state()["path"] == str(tmp_path / "infersight.otlp.jsonl")
    with pytest.raises(cfg.ConfigError, match="exporters.file.enabled"):
        cfg.load(None, env={"INFERSIGHT_OTLP_FILE_ENABLED": "sometimes"})


def test_a_socket_held_with_no_agent_behind_it_is_named(tmp_path: Path) -> None:
    """systemd's socket unit holds the socket while the service is stopped: a connect succeeds and nothing
    answers. status says so and where to look, not only "timed out"."""
    import socket

    path = tmp_path / "agent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as held:
        held.bind(str(path))
        held.listen(8)
        r = status(path)
    assert r.returncode == 1
    assert "no agent answers" in r.stdout and "systemctl status infersight.service" in r.stdout, r.stdout
    assert "a hung or busy agent" in r.stdout, r.stdout  # a pod has no systemd: the message is not only its
