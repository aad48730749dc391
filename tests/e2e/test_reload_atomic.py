"""SIGHUP reloads all or nothing, with the real ``infersight agent`` (issue 10, items 12, 13).

The config, the OOM rule files and the device rule file are all validated before any of
them is swapped: one invalid part keeps every part as it was. A rule expression too deep
to evaluate is one such invalid part, at start as on SIGHUP: a clear file:line:column,
never a RecursionError traceback.
"""

from __future__ import annotations

import signal
from pathlib import Path

from conftest import wait_for

SHIPPED_DEVICES = (Path(__file__).resolve().parents[2] / "rules" / "devices.toml").read_text()

VALID_RULE = """engine_version = "1.0"

[[rule]]
id = "site.big"
version = 1
class = "capacity"
priority = 5
condition = "{cond}"
remedy = "Use a bigger GPU."
[[rule.examples]]
kind = "positive"
numbers = {{ R = 2000, A = 1, P = 1, T = 10, F = 0 }}
[[rule.examples]]
kind = "negative"
numbers = {{ R = 1, A = 1, P = 1, T = 10, F = 0 }}
"""
DEEP = VALID_RULE.format(cond="*".join(["R"] * 1900) + " > 1000")


def devices_toml(coefficient: float) -> str:
    return SHIPPED_DEVICES.replace("slow_coefficient = 1.2 ", "slow_coefficient = %s " % coefficient, 1)


def setup(agent_factory, tmp_path: Path):  # type: ignore[no-untyped-def]
    rules = tmp_path / "rules.d"
    rules.mkdir()
    devices = tmp_path / "devices.toml"
    devices.write_text(devices_toml(1.2))
    agent = agent_factory(f'[rules]\ndirs = ["{rules}"]\n[devices]\nrules = "{devices}"\n[nvml]\nenabled = false\n')
    return agent, rules, devices


def test_one_invalid_part_swaps_nothing(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    agent, rules, devices = setup(agent_factory, tmp_path)
    agent.start()

    def status():  # type: ignore[no-untyped-def]
        return agent.status()

    def hup(failures: int, reloads: int) -> None:
        agent.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: status()["counters"]["reload_failures"] == failures
                        and status()["counters"]["reloads"] == reloads, 10), agent.log.read_text()

    assert status()["nvml"]["slow_coefficient"] == 1.2
    # Valid device rules, invalid OOM rules (an expression too deep to evaluate): nothing moves.
    devices.write_text(devices_toml(1.5))
    (rules / "site.toml").write_text(DEEP)
    hup(failures=1, reloads=0)
    assert status()["nvml"]["slow_coefficient"] == 1.2, "device thresholds were swapped by a failed reload"
    log = agent.log.read_text()
    assert "site.toml:8:142: site.big: condition: expression nested deeper than 64" in log
    assert "Traceback" not in log and "RecursionError" not in log
    assert "OOM rules reloaded" not in log
    # All valid: everything is swapped.
    (rules / "site.toml").write_text(VALID_RULE.format(cond="R > 1000"))
    hup(failures=1, reloads=1)
    assert status()["nvml"]["slow_coefficient"] == 1.5
    assert agent.log.read_text().count("OOM rules reloaded: ") == 1
    # Invalid device rules, valid OOM rule change: the OOM rules stay as they were too.
    devices.write_text(devices_toml(2.0).replace('engine_version = "1.0"', 'engine_version = "99.0"'))
    (rules / "site.toml").write_text(VALID_RULE.format(cond="R > 500"))
    hup(failures=2, reloads=1)
    assert status()["nvml"]["slow_coefficient"] == 1.5
    assert agent.log.read_text().count("OOM rules reloaded: ") == 1
    assert status()["healthy"] is True
    assert agent.stop() == 0
    assert "Traceback" not in agent.log.read_text()


def test_deep_rule_at_start_is_a_clear_error_not_a_traceback(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    agent, rules, _ = setup(agent_factory, tmp_path)
    (rules / "site.toml").write_text(DEEP)
    agent.start()
    assert agent.status()["healthy"] is True
    log = agent.log.read_text()
    assert f"{rules / 'site.toml'}:8:142: site.big: condition: expression nested deeper than 64" in log
    assert "classifying OOMs with the builtin rules" in log
    assert "Traceback" not in log
    assert agent.stop() == 0


def test_exporter_sections_are_validated_and_restart_only_keys_named(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """An MQTT URL the next restart would refuse fails the reload now (masked); a valid
    change to a key that applies only at restart is named in the log, without its value."""
    agent, _, _ = setup(agent_factory, tmp_path)
    agent.start()
    good = agent.config.read_text()
    agent.config.write_text(good + '[exporters.mqtt]\nurl = "mqtt://bob:hunter2@broker/x"\n')
    agent.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: agent.status()["counters"]["reload_failures"] == 1, 10)
    log = agent.log.read_text()
    assert "exporters.mqtt.url" in log and "hunter2" not in log
    agent.config.write_text(good.replace("frame_timeout_s = 2", "frame_timeout_s = 3")
                            + '[exporters.mqtt]\nurl = "mqtt://bob:hunter2@127.0.0.1:1"\n')
    agent.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: agent.status()["counters"]["reloads"] == 1, 10)
    assert wait_for(lambda: "apply at the next restart: exporters.mqtt.url" in agent.log.read_text(), 5)
    log = agent.log.read_text()
    assert "hunter2" not in log and "frame_timeout_s" not in log.split("next restart:")[1].splitlines()[0]
    assert agent.stop() == 0


def test_a_restart_only_key_changed_back_waits_for_nothing(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """What waits for a restart is measured against what runs, not against the last file read: a sink
    enabled and then commented out again by the next reload leaves nothing pending (before, the second
    reload named it once more), and while something waits, ``status`` says so among its warnings."""
    agent, _, _ = setup(agent_factory, tmp_path)
    agent.start()
    good = agent.config.read_text()
    agent.config.write_text(good + '[exporters.mqtt]\nurl = "mqtt://127.0.0.1:1"\n')
    agent.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: agent.status()["counters"]["reloads"] == 1, 10)
    waiting = [w for w in agent.status()["warnings"] if "waiting for a restart" in w]
    assert waiting and "exporters.mqtt.url" in waiting[0], agent.status()["warnings"]
    agent.config.write_text(good)
    agent.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: agent.status()["counters"]["reloads"] == 2, 10)
    assert wait_for(lambda: "nothing waits for a restart" in agent.log.read_text(), 5)
    assert agent.log.read_text().count("apply at the next restart") == 1
    assert not [w for w in agent.status()["warnings"] if "waiting for a restart" in w]
    assert agent.stop() == 0


def test_reload_keeps_command_line_flags(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`--socket` beats the file at start and after SIGHUP: the agent keeps serving, and
    later removes, the socket it listens on, not the file's."""
    import os
    import subprocess
    import sys

    from infersight.agent.commands.status import query_status

    agent = agent_factory()  # its config file names agent.sock
    flag_sock = tmp_path / "flag.sock"
    env = dict(os.environ)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    with open(agent.log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "infersight", "agent", "--config", str(agent.config),
                                 "--socket", str(flag_sock)], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        assert wait_for(flag_sock.exists, 15), agent.log.read_text()
        proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: query_status(str(flag_sock))["counters"]["reloads"] == 1, 10)
        assert query_status(str(flag_sock))["socket"] == str(flag_sock)
        assert "next restart" not in agent.log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert not flag_sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
