"""An agent whose default state directory is not the service's, though the service's is there (root run
in the foreground after systemd-tmpfiles made /var/lib/infersight, the infersight user's), says so and why:
a README walkthrough found its file in /root/.local/state and nothing in the log saying why. The service's
directory is a FAKE one under tmp_path here."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from infersight.agent.commands import agent as agent_cmd
from infersight.agent.daemon import config as cfg
from infersight.settings import Config


def _conf(state_dir: str, source: str) -> Config:
    return Config({"agent.state_dir": state_dir}, sources={"agent.state_dir": source})


def test_the_agent_says_why_it_records_elsewhere_than_the_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: a directory of another owner")
    service = tmp_path / "var-lib-infersight"
    service.mkdir(mode=0o750)
    os.chown(service, 42912, 42912)  # the service user's
    monkeypatch.setattr(cfg, "SERVICE_STATE_DIR", str(service))
    with caplog.at_level(logging.WARNING, logger="infersight.agent"):
        agent_cmd._say_why_not_the_service_state_dir(_conf(str(tmp_path / "xdg"), "default"))
    (said,) = [r.getMessage() for r in caplog.records]
    assert str(tmp_path / "xdg") in said and str(service) in said and "42912" in said, said
    assert "agent.state_dir" in said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infersight.agent"):
        agent_cmd._say_why_not_the_service_state_dir(_conf(str(tmp_path / "mine"), "file x.toml:3"))  # chosen
        monkeypatch.setattr(cfg, "SERVICE_STATE_DIR", str(tmp_path / "absent"))
        agent_cmd._say_why_not_the_service_state_dir(_conf(str(tmp_path / "xdg"), "default"))  # no service here
    assert not caplog.records
