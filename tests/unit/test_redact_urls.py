"""Passwords in URLs never reach an error message or a masked URL (issue 10, item 15)."""

from __future__ import annotations

import pytest

from infersight.agent.daemon import config as cfg
from infersight.redact import mask_url
from infersight.settings import ConfigError, Key, parse_int

SECRETS = ["s3cret", "p@ss", "pa/ss", "a@b/c", "pa?ss", "pa#ss", "p%40ss%2Fx"]


@pytest.mark.parametrize("password", SECRETS)
def test_mask_url_hides_every_password(password: str) -> None:
    url = f"mqtts://alice:{password}@broker.example:8883"
    masked = mask_url(url)
    assert password not in masked
    for piece in password.replace("%40", "@").replace("%2F", "/").replace("?", "/").replace("#", "/").split("/"):
        for part in piece.split("@"):
            if len(part) >= 2:
                assert part not in masked.replace("alice", "").replace("broker.example", ""), masked
    assert masked.endswith("@broker.example:8883")
    assert "***" in masked


def test_mask_url_keeps_what_is_not_secret() -> None:
    assert mask_url("mqtts://user:s3cret@broker:8883") == "mqtts://user:***@broker:8883"
    assert mask_url("mqtt://user:a%40b@broker") == "mqtt://user:***@broker"
    assert mask_url("http://collector:4318") == "http://collector:4318"
    assert mask_url("mqtt://onlyuser@broker") == "mqtt://onlyuser@broker"
    assert mask_url("https://c/v1?api_key=abc&region=eu") == "https://c/v1?api_key=***&region=eu"


def test_secret_keys_are_never_echoed() -> None:
    key = Key("exporters.otlp.api_key", parse_int, lambda: None, None, "test key")
    with pytest.raises(ConfigError) as e:
        cfg.load(None, env={}, flags={"exporters.otlp.api_key": "tok-123"}, extra_keys=(key,))
    assert "tok-123" not in str(e.value) and "exporters.otlp.api_key" in str(e.value)


def test_env_url_error_is_masked() -> None:
    from infersight.exporters import mqtt

    conf = cfg.load(None, env={})
    with pytest.raises(ConfigError) as e:
        mqtt.from_config(conf, env={"INFERSIGHT_MQTT_URL": "mqtt://u:top@secret@h/p"})
    assert "top" not in str(e.value) and "secret" not in str(e.value)
    assert "env INFERSIGHT_MQTT_URL" in str(e.value)
