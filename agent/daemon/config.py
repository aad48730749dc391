"""Configuration: flag > env > file > default, one table of keys.

Every key has a TOML name (``section.key``), an environment variable and, for some,
a command-line flag. A bad value is a :class:`ConfigError` naming the key and, when
it came from a file, ``file:line``. ``key_table()`` renders the README's table.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from infersight.hooks import _paths
from infersight.redact import is_secret_key, scrub, shown_value


def _default_state_dir() -> str:
    from infersight.agent.coldstart.history import default_state_dir

    return default_state_dir({k: v for k, v in os.environ.items() if k != "INFERSIGHT_STATE_DIR"})

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG_PATH = "/etc/infersight/infersight.toml"
# Sections whose keys their own modules validate (MQTT, Prometheus, NVML).
EXTENSION_SECTIONS = ("exporters.mqtt.", "exporters.prometheus.", "nvml.", "devices.")


class ConfigError(Exception):
    """A bad configuration value; the message names the key and file:line."""


def parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(v, str) and v.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


def parse_int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError("expected an integer")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        return int(v.strip(), 0)
    raise ValueError("expected an integer")


def parse_nonneg_int(v: Any) -> int:
    n = parse_int(v)
    if n < 0:
        raise ValueError("expected a non-negative integer")
    return n


def parse_pos_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError("expected a number")
    x = float(v)
    if not x > 0:
        raise ValueError("expected a positive number")
    return x


def parse_nonneg_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError("expected a number")
    x = float(v)
    if not x >= 0:
        raise ValueError("expected a non-negative number")
    return x


def _mode(v: Any) -> int:
    m = int(v, 8) if isinstance(v, str) else parse_int(v)
    if m & ~0o770:
        raise ValueError("socket mode must be 0660 or stricter (no bits for others)")
    return m


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("expected a string")
    return v


def _opt_str(v: Any) -> str | None:
    return None if v in (None, "") else _str(v)


def _int_list(v: Any) -> list[int]:
    if isinstance(v, str):
        v = [x for x in re.split(r"[,\s]+", v) if x]
    if not isinstance(v, list):
        raise ValueError("expected a list of integers")
    return [parse_int(x) for x in v]


def _str_list(v: Any) -> list[str]:
    if isinstance(v, str):
        v = [x for x in re.split(r"[,:]", v) if x]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("expected a list of strings")
    return list(v)


def _protocol(v: Any) -> str:
    s = _str(v)
    if s not in ("http/protobuf", "grpc", "http/json"):
        raise ValueError("expected http/protobuf or grpc")
    return s


def _log_level(v: Any) -> str:
    s = _str(v).upper()
    if s not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("expected DEBUG, INFO, WARNING or ERROR")
    return s


@dataclass(frozen=True)
class Key:
    name: str  # TOML dotted name, also the Config attribute with '.' -> '_'
    parse: Callable[[Any], Any]
    default: Callable[[], Any]
    env: str | None
    help: str
    shown_default: str | None = None  # for the README, where the default depends on the host


KEYS: tuple[Key, ...] = (
    Key("agent.socket", _str, lambda: _paths.socket_path({**os.environ, "INFERSIGHT_SOCKET": ""}),
        "INFERSIGHT_SOCKET", "Unix socket the hooks send to (flag `--socket`)",
        "`/run/infersight/agent.sock` if that dir exists, else `$XDG_RUNTIME_DIR/infersight/agent.sock`, "
        "else `/tmp/infersight-<uid>/agent.sock`"),
    Key("agent.socket_mode", _mode, lambda: 0o660, "INFERSIGHT_SOCKET_MODE", "socket permissions (0660 or stricter)"),
    Key("agent.allowed_uids", _int_list, lambda: sorted({0, os.getuid()}), "INFERSIGHT_ALLOWED_UIDS",
        "peer uids allowed to send", "root and the agent's uid"),
    Key("agent.allowed_gids", _int_list, lambda: [os.getgid()], "INFERSIGHT_ALLOWED_GIDS",
        "peer gids (primary or supplementary) allowed to send", "the agent's gid"),
    Key("agent.spool_dir", _str, lambda: _paths.spool_dir({**os.environ, "INFERSIGHT_SPOOL_DIR": ""}),
        "INFERSIGHT_SPOOL_DIR", "hooks' spool, replayed by the agent",
        "`/var/lib/infersight/spool` if writable, else `$XDG_STATE_HOME/infersight/spool`"),
    Key("agent.state_dir", _str, _default_state_dir, "INFERSIGHT_STATE_DIR",
        "cold-start history (ETAs), shared by the daemon and launch",
        "`/var/lib/infersight` if writable, else `$XDG_STATE_HOME/infersight`"),
    Key("agent.exporter_spool_max_bytes", parse_nonneg_int, lambda: 256 << 20, "INFERSIGHT_EXPORTER_SPOOL_MAX_BYTES",
        "disk spool per exporter while its peer is away"),
    Key("agent.exporter_max_attempts", parse_nonneg_int, lambda: 10, "INFERSIGHT_EXPORTER_MAX_ATTEMPTS",
        "a spooled record the peer rejects this often is dropped and counted"),
    Key("agent.shutdown_timeout_s", parse_pos_float, lambda: 10.0, "INFERSIGHT_SHUTDOWN_TIMEOUT_S",
        "drain and flush limit on SIGTERM"),
    Key("agent.health_interval_s", parse_pos_float, lambda: 15.0, "INFERSIGHT_HEALTH_INTERVAL_S",
        "how often the agent exports its own metrics"),
    Key("agent.frame_timeout_s", parse_pos_float, lambda: 10.0, "INFERSIGHT_FRAME_TIMEOUT_S",
        "a peer must send a whole frame within this"),
    Key("agent.max_connections", parse_nonneg_int, lambda: 1024, "INFERSIGHT_MAX_CONNECTIONS",
        "producer connections at once (kept below the descriptor limit; status is answered beyond it)"),
    Key("agent.idle_timeout_s", parse_nonneg_float, lambda: 300.0, "INFERSIGHT_IDLE_TIMEOUT_S",
        "close a producer connection silent this long (0: never); the hook reconnects when it has news"),
    Key("agent.max_pending_bytes", parse_nonneg_int, lambda: 8 << 20, "INFERSIGHT_MAX_PENDING_BYTES",
        "per producer: cold-start stage spans kept for their root's summary"),
    Key("agent.log_level", _log_level, lambda: "INFO", "INFERSIGHT_LOG_LEVEL", "agent log level"),
    Key("agent.host_name", _opt_str, lambda: None, "INFERSIGHT_HOST_NAME", "`host.name`, also the MQTT `<host>`",
        "short hostname"),
    Key("exporters.file.path", _opt_str, lambda: None, "INFERSIGHT_OTLP_FILE", "OTLP JSON lines file",
        "unset (launch: `--otlp-file`)"),
    Key("exporters.file.max_bytes", parse_nonneg_int, lambda: 256 << 20, "INFERSIGHT_OTLP_FILE_MAX_BYTES",
        "rotate the file past this size"),
    Key("exporters.file.backups", parse_nonneg_int, lambda: 3, "INFERSIGHT_OTLP_FILE_BACKUPS",
        "rotated files kept (`PATH.1` ... `PATH.N`)"),
    Key("exporters.otlp.endpoint", _opt_str, lambda: None, "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTLP collector (no default: set it to export); per-signal `OTEL_EXPORTER_OTLP_*_ENDPOINT` work too"),
    Key("exporters.otlp.protocol", _protocol, lambda: None, "OTEL_EXPORTER_OTLP_PROTOCOL", "or `grpc`",
        "`http/protobuf`"),
    Key("exporters.otlp.timeout_s", parse_pos_float, lambda: None, "OTEL_EXPORTER_OTLP_TIMEOUT",
        "per-export timeout in seconds", "`10`"),
    Key("exporters.console.enabled", parse_bool, lambda: False, "INFERSIGHT_CONSOLE", "print cold-start waterfalls",
        "`false` (launch: on, `--no-console`)"),
    Key("rules.dirs", _str_list, lambda: ["/etc/infersight/rules.d"], "INFERSIGHT_RULES_DIRS",
        "site OOM rule files (`*.toml`)", "`/etc/infersight/rules.d`"),
)
KEY_BY_NAME = {k.name: k for k in KEYS}


@dataclass
class Config:
    values: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)  # key -> "default" | "env VAR" | "file:line" | "flag"
    path: str | None = None

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


def bad_value(origin: str, name: str, raw: Any, exc: BaseException) -> ConfigError:
    """The error for a value its parser refused. It never echoes a secret or a URL's
    password: the value is shown masked, and so is any copy of it in the parser's message."""
    shown = shown_value(name, raw)
    why = str(exc)
    if is_secret_key(name):
        why = "invalid value"  # the parser may quote parts of it
    elif isinstance(raw, str):
        why = scrub(why, raw)
    return ConfigError("%s: bad value for %s: %s (%s)" % (origin, name, shown, why))


def key_line(text: str, dotted: str) -> int:
    """1-based line where ``dotted`` is set in TOML ``text`` (0 when not found)."""
    *tables, leaf = dotted.split(".")
    table = ".".join(tables)
    current = ""
    pat = re.compile(r"\s*(?:\"%s\"|'%s'|%s)\s*=" % ((re.escape(leaf),) * 3))
    for i, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*\[\s*([^\]]+?)\s*\]\s*(#.*)?$", line)
        if m:
            current = m.group(1).replace('"', "").replace(" ", "")
            continue
        if current == table and pat.match(line):
            return i
        if not current and pat.match(line.replace(table + ".", "", 1)) and line.strip().startswith(table + "."):
            return i
    return 0


def _flatten(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in obj.items():
        name = prefix + k
        if isinstance(v, dict) and not any(key.name == name for key in KEYS):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def load(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    require_file: bool = False,
    extra_keys: tuple[Key, ...] = (),
) -> Config:
    """Resolve every key: flag > env > file > default."""
    env = os.environ if env is None else env
    keys = KEYS + extra_keys
    known = {k.name: k for k in keys}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    file_values: dict[str, Any] = {}
    text = ""
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = f.read()
            text = raw.decode("utf-8")
            file_values = _flatten(tomllib.loads(text))
        except FileNotFoundError:
            if require_file:
                raise ConfigError("%s: config file not found" % path) from None
            path = None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("%s: %s" % (path, exc)) from None
        except RecursionError:  # tomllib recurses once per nested array or table
            raise ConfigError("%s: TOML nested too deeply" % path) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("%s: cannot read: %s" % (path, exc)) from None
    for name in file_values:
        if name not in known and not name.startswith(EXTENSION_SECTIONS):
            line = key_line(text, name)
            raise ConfigError("%s:%d: unknown key %r" % (path, line, name))
    for k in keys:
        origin, raw_value = "default", None
        if flags and flags.get(k.name) is not None:
            origin, raw_value = "flag", flags[k.name]
        elif k.env and env.get(k.env) not in (None, ""):
            origin, raw_value = "env " + k.env, env[k.env]
        elif k.name in file_values:
            origin, raw_value = "%s:%d" % (path, key_line(text, k.name)), file_values[k.name]
        if origin == "default":
            values[k.name] = k.default()
        else:
            try:
                values[k.name] = k.parse(raw_value)
            except (ValueError, TypeError) as exc:
                raise bad_value(origin, k.name, raw_value, exc) from None
        sources[k.name] = origin
    # Sections that other modules own (mqtt, prometheus, nvml) stay available raw.
    for name, v in file_values.items():
        values.setdefault(name, v)
        sources.setdefault(name, "%s:%d" % (path, key_line(text, name)))
    return Config(values, sources, path)


def setting(config: Config, key: Key, env: Mapping[str, str]) -> Any:
    """One key of a section that its own module owns (MQTT, Prometheus): the value
    ``load(extra_keys=...)`` resolved, or resolved here, flag > env > file > default."""
    src = config.sources.get(key.name, "")
    if key.name in config.values and src.startswith(("flag", "env ", "default")):
        return config.values[key.name]
    origin, raw = "default", None
    if key.env and env.get(key.env) not in (None, ""):
        origin, raw = "env " + key.env, env[key.env]
    elif key.name in config.values:
        origin, raw = src or "file", config.values[key.name]
    if origin == "default":
        return key.default()
    try:
        return key.parse(raw)
    except (ValueError, TypeError) as exc:
        raise bad_value(origin, key.name, raw, exc) from None


def section_settings(config: Config, prefix: str, keys: tuple[Key, ...], env: Mapping[str, str]) -> dict[str, Any]:
    """Every key of section ``prefix`` (e.g. ``exporters.mqtt.``), by its name inside the
    section; an unknown key in the file is an error naming it and its file:line."""
    values = {k.name[len(prefix) :]: setting(config, k, env) for k in keys}
    unknown = sorted(n for n in config.values if n.startswith(prefix) and n[len(prefix) :] not in values)
    if unknown:
        raise ConfigError("%s: unknown key %r" % (config.sources.get(unknown[0], "config"), unknown[0]))
    return values


# Rows of the README's table for the sections their own modules own (one row each).
SECTION_ROWS = (
    "| `exporters.mqtt.*` | `INFERSIGHT_MQTT_*` | off | see [docs/mqtt.md](docs/mqtt.md) |",
    "| `exporters.prometheus.*` | `INFERSIGHT_PROMETHEUS*` | off, `127.0.0.1:9464` "
    "| see [docs/prometheus.md](docs/prometheus.md) |",
    "| `nvml.interval_s`, `nvml.enabled`, `nvml.proc_root` | `INFERSIGHT_NVML_*` | `1.0`, `true`, `/proc` "
    "| device sampling ([docs/requests.md](docs/requests.md)) |",
    "| `devices.rules`, `devices.window_s`, `devices.evaluate_interval_s` | `INFERSIGHT_DEVICES_*` "
    "| shipped `rules/devices.toml`, `300`, `10` | slow-device verdicts |",
)


def key_table() -> str:
    """The README's configuration table (tests/test_config_example.py checks the README)."""
    rows = ["| key (TOML) | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for k in KEYS:
        d = k.default()
        shown = k.shown_default or ("`0660`" if k.name == "agent.socket_mode" else
                                    "`%s`" % (d,) if d is not None else "unset")
        rows.append("| `%s` | %s | %s | %s |" % (k.name, "`%s`" % k.env if k.env else "", shown, k.help))
    rows[-1:-1] = SECTION_ROWS  # before rules.dirs, as the README has always listed them
    return "\n".join(rows)


# -- the commented example config (systemd/infersight.toml) --------------------------------

EXAMPLE_HEADER = """\
# infersight agent configuration: /etc/infersight/infersight.toml
#
# GENERATED by `python -m infersight.agent.daemon.config --example` from the key table that
# also renders the README's; tests/test_config_example.py checks that this file is
# current and that uncommenting every setting gives a config the agent accepts.
#
# Precedence: command-line flag > environment (INFERSIGHT_*, OTEL_*) > this file >
# built-in default. Each setting shows its default, or an example marked so where the
# default depends on the host or is "unset"; uncomment to change it.
# `infersight install-service` never overwrites an existing file.
# Reload after editing: systemctl reload infersight (SIGHUP). An invalid file keeps
# the running config, logs file:line and counts the failure.
"""
# Values shown for keys whose default depends on the host or is unset: the values of a
# systemd install, or a placeholder that is valid when uncommented (file paths stay empty:
# a named file must exist).
EXAMPLE_VALUES: dict[str, str] = {
    "agent.socket": '"/run/infersight/agent.sock"',
    "agent.allowed_uids": "[0]",
    "agent.allowed_gids": "[993]  # example: the gid of group infersight (getent group infersight)",
    "agent.spool_dir": '"/var/lib/infersight/spool"',
    "agent.state_dir": '"/var/lib/infersight"',
    "agent.host_name": '"gpu-node-1"',
    "exporters.file.path": '"/var/lib/infersight/infersight.otlp.jsonl"',
    "exporters.otlp.endpoint": '"http://otel-collector.example:4318"',
    "exporters.otlp.protocol": '"http/protobuf"',
    "exporters.otlp.timeout_s": "10.0",
    "exporters.mqtt.url": '"mqtts://broker.example:8883"',
    "exporters.mqtt.username": '"infersight"',
    "exporters.mqtt.password": '""',
    "exporters.mqtt.password_file": '""',
    "exporters.mqtt.ca_file": '""',
    "exporters.mqtt.cert_file": '""',
    "exporters.mqtt.key_file": '""',
    "exporters.mqtt.client_id": '""',
    "devices.rules": '""',
}
# Comments on top of a key's help, for what an operator must know before changing it.
EXAMPLE_NOTES: dict[str, str] = {
    "agent.socket": "Under systemd the socket comes from infersight.socket (LISTEN_FDS); "
                    "this path must match its ListenStream=.",
    "agent.allowed_uids": "Checked on each connection with SO_PEERCRED; the socket's 0660 mode "
                          "and group decide who can connect at all.",
    "exporters.otlp.endpoint": "No endpoint, no OTLP export: there is no implicit localhost.",
}


def all_keys() -> tuple[Key, ...]:
    """Every configuration key: the core table plus the sections their modules own."""
    from infersight.agent.devices import job as devices_job
    from infersight.exporters.mqtt import MQTT_KEYS
    from infersight.exporters.prometheus_endpoint import PROMETHEUS_KEYS

    defaults = devices_job.DeviceJobConfig()

    def default_of(attr: str) -> Callable[[], Any]:
        return lambda: getattr(defaults, attr)

    job_keys = tuple(
        Key(name, devices_job._PARSE[name], default_of(attr), env, devices_job.CONFIG_HELP[name])
        for name, (env, attr) in devices_job.CONFIG_KEYS.items()
    )
    core = {k.name: k for k in KEYS}
    rules_dirs = core.pop("rules.dirs")
    return (*core.values(), *MQTT_KEYS, *PROMETHEUS_KEYS, *job_keys, rules_dirs)


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string for everything a default holds
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError("no TOML form for %r" % (v,))


def _wrap_comment(text: str) -> list[str]:
    return ["# " + line for line in textwrap.wrap(text, 86, break_long_words=False, break_on_hyphens=False)]


def example_config() -> str:
    """The commented example config, every key with its default (or an example)."""
    out = [EXAMPLE_HEADER.rstrip("\n")]
    section = None
    for k in all_keys():
        table, _, leaf = k.name.rpartition(".")
        if table != section:
            section = table
            out += ["", "[%s]" % table]
        text = k.help[:1].upper() + k.help[1:]
        text = text.replace("`", "") + ("." if not text.endswith(".") else "")
        if k.env:
            text += " Environment: %s." % k.env
        if k.name in EXAMPLE_NOTES:
            text += " " + EXAMPLE_NOTES[k.name]
        example = EXAMPLE_VALUES.get(k.name)
        if example == '""':  # the empty string is how a file says "unset"
            value = example
        elif example is not None:
            if k.shown_default:
                text += " Default: %s." % k.shown_default.replace("`", "")
            elif k.default() is None:
                text += " Default: unset."
            value = example if "#" in example else example + "  # example"
        elif k.name == "agent.socket_mode":
            value = "0o660"
        else:
            value = toml_value(k.default())
        out += _wrap_comment(text)
        out.append("# %s = %s" % (leaf, value))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--example"]:
        sys.stdout.write(example_config())
        return 0
    if args == ["--table"]:
        print(key_table())
        return 0
    sys.stderr.write("usage: python -m infersight.agent.daemon.config --example | --table\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
