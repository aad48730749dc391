"""Lifecycle of a real ``infersight agent`` process: SIGHUP reload, SIGTERM drain, forced exit."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import hook_env, log_records, read_otlp_lines, wait_for


def counters(agent) -> dict:  # type: ignore[no-untyped-def,type-arg]
    return agent.status()["counters"]


def test_sighup_reloads_valid_config_and_keeps_old_on_invalid(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rules = tmp_path / "rules.d"
    rules.mkdir()
    agent = agent_factory(f'[rules]\ndirs = ["{rules}"]\n').start()
    good = agent.config.read_text()
    # A valid change: reload succeeds and is counted.
    agent.config.write_text(good.replace("health_interval_s = 0.5", "health_interval_s = 0.7"))
    agent.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    assert wait_for(lambda: counters(agent)["reloads"] == 1, 10)
    # An invalid value: the old config keeps running, the error names file:line.
    agent.config.write_text(good.replace("health_interval_s = 0.5", 'health_interval_s = "often"'))
    agent.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    assert wait_for(lambda: counters(agent)["reload_failures"] == 1, 10)
    line = next(i for i, t in enumerate(agent.config.read_text().splitlines(), 1) if "health_interval_s" in t)
    assert wait_for(lambda: "%s:%d" % (agent.config, line) in agent.log.read_text(), 5)
    # An invalid rule file: refused with its file:line, the old rules keep running.
    agent.config.write_text(good)
    (rules / "site.toml").write_text('engine_version = "1.0"\n\n[[rule]]\nid = "x"\nclass = "nonsense"\n')
    agent.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    assert wait_for(lambda: counters(agent)["reload_failures"] == 2, 10)
    assert "site.toml:" in agent.log.read_text()
    assert agent.status()["healthy"] is True
    assert agent.stop() == 0


def test_a_reload_refuses_an_mqtt_file_the_next_start_could_not_read_and_status_says_so(
        agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """docs/mqtt.md recommends a password_file; one the service's user cannot read passed a reload
    ("configuration reloaded") and the next restart exited 2, leaving the service down. The reload now
    reads what the exporters read at start, and a failed reload shows in `status`, not only in a counter."""
    agent = agent_factory().start()
    good = agent.config.read_text()
    missing = tmp_path / "mqtt.password"  # never made: as unreadable for the agent as root's 0600 file
    agent.config.write_text(good + '\n[exporters.mqtt]\nurl = "mqtt://127.0.0.1:1"\nusername = "infersight"\n'
                            'password_file = "%s"\n' % missing)
    agent.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    assert wait_for(lambda: counters(agent)["reload_failures"] == 1, 10), agent.log.read_text()
    assert "password_file" in agent.log.read_text()
    assert counters(agent)["reloads"] == 0
    warnings = agent.status()["warnings"]
    assert any("last reload failed" in w and "password_file" in w for w in warnings), warnings
    r = subprocess.run([sys.executable, "-m", "infersight", "status", "--socket", str(agent.sock)],
                       capture_output=True, text=True, timeout=30)
    assert "WARNING the last reload failed" in r.stdout, r.stdout
    # the file back as it was: the next reload succeeds and the warning goes
    agent.config.write_text(good)
    agent.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
    assert wait_for(lambda: counters(agent)["reloads"] == 1, 10)
    assert not any("reload failed" in w for w in agent.status()["warnings"])
    assert agent.stop() == 0


def test_sigterm_drains_flushes_and_exits_0(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    script = tmp_path / "w.py"
    script.write_text("from infersight import hooks\nfor i in range(3000):\n    hooks.log('x', i=i)\n"
                      "hooks.flush(10)\n")
    assert subprocess.run([sys.executable, str(script)], env=hook_env(agent.sock, agent.spool),
                          timeout=60).returncode == 0
    assert agent.stop(signal.SIGTERM) == 0
    assert len(log_records(read_otlp_lines(agent.out))) == 3000
    assert not agent.sock.exists(), "the socket is removed on a clean stop"


def test_second_sigterm_forces_exit(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """An exporter stuck on a collector that never answers: the second SIGTERM does not wait."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # accepts connections in the kernel, never answers
    port = hole.getsockname()[1]
    agent = agent_factory(
        f'[exporters.otlp]\nendpoint = "http://127.0.0.1:{port}"\ntimeout_s = 60\n'
    )
    agent.config.write_text(agent.config.read_text().replace("shutdown_timeout_s = 10", "shutdown_timeout_s = 120"))
    agent.start()
    script = tmp_path / "w.py"
    # its event is sent at once and never acked (the export is stuck): a short flush, and no exit flush to wait out
    script.write_text("import os\nfrom infersight import hooks\nhooks.log('stuck')\nhooks.flush(2)\nos._exit(0)\n")
    subprocess.run([sys.executable, str(script)], env=hook_env(agent.sock, agent.spool), timeout=60)
    time.sleep(0.5)
    agent.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    time.sleep(1.0)
    assert agent.proc.poll() is None, "first SIGTERM: still draining within its time limit"  # type: ignore[union-attr]
    agent.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert agent.proc.wait(15) == 1  # type: ignore[union-attr]
    assert "second stop signal" in agent.log.read_text()
    hole.close()
