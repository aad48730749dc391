"""Redaction of secrets and command lines; ``infersight status`` as the health probe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import attr, hook_env, read_otlp_lines

from infersight.agent.daemon.assemble import producer_resource
from infersight.redact import mask_url

CLI = [sys.executable, "-m", "infersight"]


def test_secret_looking_resource_values_are_masked() -> None:
    info = {"id": "p", "pid": 1, "start_ns": 1, "exe": "python", "argv0": "serve.py",
            "resource_attributes": "deployment.environment=prod,api.token=abc123,db.password=hunter2,"
                                   "vendor.credential=c,team.secret=s,aws.access.key=k"}
    res = producer_resource(info, "h").as_dict()
    assert res["deployment.environment"] == "prod"
    for key in ("api.token", "db.password", "vendor.credential", "team.secret", "aws.access.key"):
        assert res[key] == "***", key
    assert "abc123" not in json.dumps(res) and "hunter2" not in json.dumps(res)


def test_urls_lose_their_passwords() -> None:
    assert mask_url("mqtts://user:s3cret@broker:8883") == "mqtts://user:***@broker:8883"


def test_command_line_and_environment_are_not_exported(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    script = tmp_path / "serve.py"
    script.write_text("from infersight import hooks\nhooks.log('x')\n")
    env = hook_env(agent.sock, agent.spool, MY_API_TOKEN="tok-123-secret")
    r = subprocess.run([sys.executable, str(script), "--api-key", "KEY-987"], env=env, timeout=60)
    assert r.returncode == 0
    assert agent.stop() == 0
    text = agent.out.read_text()
    assert "KEY-987" not in text and "tok-123-secret" not in text and "--api-key" not in text
    res = next(line for line in read_otlp_lines(agent.out) if "resourceSpans" in line)["resourceSpans"][0]["resource"]
    assert attr(res, "process.command") == "serve.py"  # the script's name only, never its arguments


def test_status_exit_codes_and_json(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    missing = subprocess.run([*CLI, "status", "--socket", str(tmp_path / "none.sock")], capture_output=True,
                             text=True, timeout=30)
    assert missing.returncode == 1 and "not reachable" in missing.stdout
    agent = agent_factory().start()
    ok = subprocess.run([*CLI, "status", "--json", "--socket", str(agent.sock)], capture_output=True, text=True,
                        timeout=30)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    h = json.loads(ok.stdout)
    assert h["healthy"] is True and h["mode"] == "daemon" and "exporters" in h and h["lost"] == 0
    human = subprocess.run([*CLI, "status", "--socket", str(agent.sock)], capture_output=True, text=True, timeout=30)
    assert human.returncode == 0 and "healthy" in human.stdout and "exporter file" in human.stdout
