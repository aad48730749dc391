"""The agent process refuses a bad MQTT URL naming the key, never its password (the masking
itself: tests/unit/test_redact_urls.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    "url",
    [
        "mqtt://bob:hunter2@broker:1883/topic",  # a path: refused
        "ftp://bob:hunter2@broker",  # a bad scheme
        "mqtt://bob:hun/ter2@broker:1883",  # '/' in the password: parses as a path
        "mqtt://bob:hun@ter2@broker:99999",  # '@' in the password, bad port
        "mqtt://bob:hunter2?x@broker",  # '?' splits it: the port parser quotes a piece
    ],
)
def test_bad_mqtt_url_error_names_the_key_not_the_password(tmp_path: Path, url: str) -> None:
    conf = tmp_path / "infersight.toml"
    conf.write_text(f'[exporters.mqtt]\nurl = "{url}"\n')
    r = subprocess.run(
        [sys.executable, "-m", "infersight", "agent", "--config", str(conf), "--socket", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert "exporters.mqtt.url" in r.stderr and f"{conf}:2" in r.stderr
    for piece in ("hunter2", "hun", "ter2"):
        assert piece not in r.stderr + r.stdout, r.stderr
