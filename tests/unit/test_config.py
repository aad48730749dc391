"""Configuration precedence (flag > env > file > default) and file:line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from infersight.agent.commands.config_reference import key_table
from infersight.agent.daemon import config as cfg
from infersight.settings import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_precedence_flag_env_file_default(tmp_path: Path) -> None:
    p = write(tmp_path, '[agent]\nsocket = "/file.sock"\nshutdown_timeout_s = 3\n[exporters.file]\nbackups = 7\n')
    env = {"INFERSIGHT_SOCKET": "/env.sock", "INFERSIGHT_SHUTDOWN_TIMEOUT_S": "4"}
    c = cfg.load(str(p), env=env, flags={"agent.socket": "/flag.sock"})
    assert c["agent.socket"] == "/flag.sock" and c.sources["agent.socket"] == "flag"
    assert c["agent.shutdown_timeout_s"] == 4.0 and c.sources["agent.shutdown_timeout_s"].startswith("env")
    assert c["exporters.file.backups"] == 7 and c.sources["exporters.file.backups"] == "%s:5" % p
    assert c["exporters.file.max_bytes"] == 256 << 20 and c.sources["exporters.file.max_bytes"] == "default"


def test_bad_value_names_key_and_file_line(tmp_path: Path) -> None:
    p = write(tmp_path, "[agent]\n# comment\nhealth_interval_s = -1\n")
    with pytest.raises(ConfigError) as e:
        cfg.load(str(p), env={})
    assert "%s:3" % p in str(e.value) and "agent.health_interval_s" in str(e.value)


def test_socket_mode_must_not_open_to_others(tmp_path: Path) -> None:
    p = write(tmp_path, '[agent]\nsocket_mode = "0666"\n')
    with pytest.raises(ConfigError, match="0660 or stricter"):
        cfg.load(str(p), env={})


def test_unknown_key_is_an_error_with_line(tmp_path: Path) -> None:
    p = write(tmp_path, "[agent]\n\nsokcet = 1\n")
    with pytest.raises(ConfigError, match=r"c\.toml:3: unknown key 'agent\.sokcet' \(did you mean 'agent\.socket'\?\)"):
        cfg.load(str(p), env={})


def test_an_unknown_key_names_the_key_it_likely_means_in_its_section_only(tmp_path: Path) -> None:
    """As the environment's typos are (``did you mean``); a name far from every key of its section gets
    no guess (``exporters.mqtt.enabeld``: MQTT has no ``enabled``, and ``username`` is no answer)."""
    from infersight.exporters.mqtt_settings import MQTT_KEYS
    from infersight.settings import section_settings

    p = write(tmp_path, "[agent]\nlog_levle = \"info\"\n")
    with pytest.raises(ConfigError, match=r"unknown key 'agent\.log_levle' \(did you mean 'agent\.log_level'\?\)"):
        cfg.load(str(p), env={})
    p = write(tmp_path, "[agnet]\nlog_level = \"info\"\n")  # a misspelled section: the whole name
    with pytest.raises(ConfigError, match=r"unknown key 'agnet\.log_level' \(did you mean 'agent\.log_level'\?\)"):
        cfg.load(str(p), env={})
    for text, want in (("[exporters.mqtt]\nenabeld = true\n", "unknown key 'exporters.mqtt.enabeld'"),
                       ("[exporters.mqtt]\nkeepalve = 30\n", "(did you mean 'exporters.mqtt.keepalive'?)")):
        conf = cfg.load(str(write(tmp_path, text)), env={})
        with pytest.raises(ConfigError) as e:
            section_settings(conf, "exporters.mqtt.", MQTT_KEYS, {})
        assert str(e.value).endswith(want) and ("did you mean" in want) == ("did you mean" in str(e.value)), e.value


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="INFERSIGHT_SHUTDOWN_TIMEOUT_S"):
        cfg.load(None, env={"INFERSIGHT_SHUTDOWN_TIMEOUT_S": "soon"})


def test_toml_syntax_error(tmp_path: Path) -> None:
    p = write(tmp_path, "[agent\n")
    with pytest.raises(ConfigError, match=str(p)):
        cfg.load(str(p), env={})


def test_key_table_lists_every_key() -> None:
    table = key_table()
    for k in cfg.KEYS:
        assert "`%s`" % k.name in table


def test_an_environment_flag_takes_its_default_when_unset_empty_or_bad(caplog: pytest.LogCaptureFixture) -> None:
    from infersight.settings import env_flag

    name = "INFERSIGHT_MEASURE_STORAGE"
    assert env_flag(name, True, {}) is True
    assert env_flag(name, True, {name: " "}) is True
    assert env_flag(name, True, {name: "Off"}) is False
    assert env_flag(name, False, {name: "yes"}) is True
    assert env_flag(name, True, {name: "maybe"}) is True
    assert "INFERSIGHT_MEASURE_STORAGE='maybe'" in caplog.text


def test_an_unset_exporter_section_is_known_without_its_module(tmp_path: Path) -> None:
    """compose skips importing the MQTT and Prometheus modules when their section is unset:
    that must mean exactly what their own parsing says (off), and a set one is still checked."""
    from infersight.agent.commands.compose import (
        MQTT_SECTION,
        PROMETHEUS_SECTION,
        build_exporters,
        check_exporter_settings,
    )
    from infersight.exporters.mqtt_settings import MQTT_KEYS, settings_from_config
    from infersight.exporters.prometheus_endpoint import PROMETHEUS_KEYS
    from infersight.exporters.prometheus_endpoint import from_config as prometheus_from_config
    from infersight.settings import section_unset

    for (prefix, env_prefix), keys in ((MQTT_SECTION, MQTT_KEYS), (PROMETHEUS_SECTION, PROMETHEUS_KEYS)):
        assert all(k.name.startswith(prefix) and k.env and k.env.startswith(env_prefix) for k in keys)
    out = str(tmp_path / "o.jsonl")
    c = cfg.load(None, env={}, flags={"exporters.file.path": out})
    assert section_unset(c, *MQTT_SECTION, {}) and section_unset(c, *PROMETHEUS_SECTION, {})
    assert settings_from_config(c, env={}) is None and prometheus_from_config(c, env={}) is None
    assert [type(e).__name__ for e in build_exporters(c, env={})] == ["FileExporter"]
    assert not section_unset(c, *MQTT_SECTION, {"INFERSIGHT_MQTT_QOS": "1"})
    assert section_unset(c, *MQTT_SECTION, {"INFERSIGHT_MQTT_URL": ""})  # empty: as if unset
    with pytest.raises(ConfigError, match="INFERSIGHT_PROMETHEUS_PORT"):
        check_exporter_settings(c, {"INFERSIGHT_PROMETHEUS_PORT": "not a port"})
    with pytest.raises(ConfigError, match="exporters.mqtt.qos"):
        check_exporter_settings(c, {"INFERSIGHT_MQTT_QOS": "7"})
    f = write(tmp_path, "[exporters.prometheus]\nport = 0\nnonsense = 1\n")
    with pytest.raises(ConfigError, match="nonsense"):
        check_exporter_settings(cfg.load(str(f), env={}), {})


def test_a_misspelled_section_of_another_modules_keys_names_the_section(tmp_path: Path) -> None:
    """``[exporter.mqtt]`` (singular) said ``unknown key 'exporter.mqtt.url'`` with no guess: the known keys are
    the agent's own, not those of the sections other modules check (MQTT, Prometheus, NVML, devices, routing)."""
    for text, want in (('[exporter.mqtt]\nurl = "mqtt://b:1883"\n', "'exporters.mqtt.url'"),
                       ("[exporter.prometheus]\nenabled = true\n", "'exporters.prometheus.enabled'"),
                       ("[device]\nwindow_s = 60\n", "'devices.window_s'"),
                       ("[routng]\nenabled = true\n", "'routing.enabled'"),
                       ('[exporter.file]\npath = "/x"\n', "'exporters.file.path'")):  # the agent's own, as before
        with pytest.raises(ConfigError) as e:
            cfg.load(str(write(tmp_path, text)), env={})
        assert str(e.value).endswith("(did you mean %s?)" % want), e.value
        assert "c.toml:2" in str(e.value), e.value
    with pytest.raises(ConfigError) as e:  # far from every section: no guess
        cfg.load(str(write(tmp_path, "[zebra]\nstripes = 3\n")), env={})
    assert "did you mean" not in str(e.value), e.value


@pytest.mark.parametrize(("host", "why"), [
    ("localhost:9", "expected a host without a port: the port has its own key (port = 9)"),
    ("[::1]:9464", "expected a host without a port"),
    ("http://127.0.0.1", "expected a host, not a URL"),
    ("127.0.0.1/metrics", "expected a host name or address"),
    ("my host", "expected a host name or address"),
])
def test_a_listen_host_with_a_port_or_a_scheme_is_refused_naming_the_key(tmp_path: Path, host: str,
                                                                          why: str) -> None:
    """``exporters.prometheus.host = "localhost:9"`` passed validation, and the endpoint then failed to bind
    for ever at run time (retried every 10 s): now the agent's start refuses it, with the key and file:line."""
    from infersight.agent.commands.compose import check_exporter_settings

    p = write(tmp_path, '[exporters.prometheus]\nenabled = true\nhost = "%s"\n' % host)
    with pytest.raises(ConfigError) as e:
        check_exporter_settings(cfg.load(str(p), env={}), env={})
    assert "c.toml:3" in str(e.value) and "exporters.prometheus.host" in str(e.value), e.value
    assert why in str(e.value), e.value


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0", "::", "fe80::1%eth0",
                                  "metrics.example.internal"])
def test_a_listen_host_that_is_a_host_passes(host: str) -> None:
    from infersight.settings import parse_listen_host

    assert parse_listen_host(host) == host.strip("[]")
