"""The agent's configuration: flag > env > file > default, one table of keys.

Every key has a TOML name (``section.key``), an environment variable and, for some,
a command-line flag. A bad value is a :class:`~infersight.settings.ConfigError` naming
the key and, when it came from a file, ``file:line``. Keys, parsers and resolution are
the neutral :mod:`infersight.settings`, which exporters share. :data:`KEYS` is the
agent's own table; the sections other modules own (exporters, devices) are resolved by
those modules, or here when their keys are handed in (``load(extra_keys=...)``). The
table of every key, the README's and the example file's, is composed in
:mod:`infersight.agent.commands.config_reference`.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from infersight.errors import Location, SourceError, undecodable
from infersight.hooks import _env, _paths
from infersight.settings import (
    Config,
    ConfigError,
    Key,
    bad_value,
    parse_bool,
    parse_int,
    parse_nonneg_float,
    parse_nonneg_int,
    parse_pos_float,
    unknown_key,
)
from infersight.tomlfile import TomlKeys, loads

SERVICE_STATE_DIR = "/var/lib/infersight"  # the service's StateDirectory= (tmpfiles.d: its user's)


def _default_state_dir(system: str = SERVICE_STATE_DIR) -> str:
    """``/var/lib/infersight`` when writable and the agent's own to use, else the XDG state dir (the
    environment variable is the key's own, resolved before any default). Root can write the service's
    directory, owned by its user, but would refuse it as its state directory: not its default."""
    from infersight.statefiles import refusal

    if os.access(system, os.W_OK) and refusal(system) is None:
        return system
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.environ.get("HOME") or "/tmp", ".local", "state")
    return os.path.join(base, "infersight")


DEFAULT_CONFIG_PATH = "/etc/infersight/infersight.toml"
# Sections whose keys their own modules validate (MQTT, Prometheus, NVML).
EXTENSION_SECTIONS = ("exporters.mqtt.", "exporters.prometheus.", "nvml.", "devices.", "routing.")


def _mode(v: Any) -> int:
    m = int(v, 8) if isinstance(v, str) else parse_int(v)
    if m & ~0o770:
        raise ValueError("socket mode must be 0660 or stricter (no bits for others)")
    return m


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("expected a string")
    return v


SUN_PATH_MAX = 107  # bytes of a Unix socket path (sun_path is 108, with its NUL)
MAX_CONFIG_BYTES = 4 << 20  # a config file larger than this is refused, not read
MAX_TABLE_DEPTH = 16  # [a.b.c...]: ours go 3 deep


def _path(v: Any) -> str:
    """A file system path: a non-empty string without NUL."""
    s = _str(v)
    if not s:
        raise ValueError("expected a path, got an empty string")
    if "\0" in s:
        raise ValueError("a path cannot contain a NUL character")
    return s


def _socket_path(v: Any) -> str:
    """A Unix socket path: as :func:`_path`, and short enough for ``sun_path``."""
    s = _path(v)
    n = len(os.fsencode(s))
    if n > SUN_PATH_MAX:
        raise ValueError("a Unix socket path is at most %d bytes, this one is %d" % (SUN_PATH_MAX, n))
    return s


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


def _auto_bool(v: Any) -> str | bool:
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    try:
        return parse_bool(v)
    except ValueError:
        raise ValueError("expected auto, true or false") from None


def _log_level(v: Any) -> str:
    s = _str(v).upper()
    if s not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError("expected DEBUG, INFO, WARNING or ERROR")
    return s


KEYS: tuple[Key, ...] = (
    Key("agent.socket", _socket_path, lambda: _paths.socket_path({**os.environ, "INFERSIGHT_SOCKET": ""}),
        "INFERSIGHT_SOCKET", "Unix socket the hooks send to (flag `--socket`)",
        "`/run/infersight/agent.sock` if that dir exists, else `$XDG_RUNTIME_DIR/infersight/agent.sock`, "
        "else `/tmp/infersight-<uid>/agent.sock`"),
    Key("agent.socket_mode", _mode, lambda: 0o660, "INFERSIGHT_SOCKET_MODE", "socket permissions (0660 or stricter)"),
    Key("agent.allowed_uids", _int_list, lambda: sorted({0, os.getuid()}), "INFERSIGHT_ALLOWED_UIDS",
        "peer uids allowed to send", "root and the agent's uid"),
    Key("agent.allowed_gids", _int_list, lambda: [os.getgid()], "INFERSIGHT_ALLOWED_GIDS",
        "peer gids (primary or supplementary) allowed to send",
        "the agent's gid (an agent run as root: with its socket directory's group)"),
    Key("agent.spool_dir", _path, lambda: _paths.spool_dir({**os.environ, "INFERSIGHT_SPOOL_DIR": ""}),
        "INFERSIGHT_SPOOL_DIR", "hooks' spool, replayed by the agent",
        "`/var/lib/infersight/spool` if writable, else `$XDG_STATE_HOME/infersight/spool`"),
    Key("agent.state_dir", _path, _default_state_dir, "INFERSIGHT_STATE_DIR",
        "the agent's own state, writable by it alone: exporter spools, cold-start history (ETAs), "
        "the default OTLP file",
        "`/var/lib/infersight` if writable, else `$XDG_STATE_HOME/infersight`"),
    Key("agent.exporter_spool_max_bytes", parse_nonneg_int, lambda: 256 << 20, "INFERSIGHT_EXPORTER_SPOOL_MAX_BYTES",
        "disk spool per exporter while its peer is away (one uid holds a quarter while others hold items)"),
    Key("agent.exporter_max_attempts", parse_nonneg_int, lambda: 10, "INFERSIGHT_EXPORTER_MAX_ATTEMPTS",
        "a spooled record the peer rejects this often is dropped and counted"),
    Key("agent.exporter_stall_s", parse_nonneg_float, lambda: 120.0, "INFERSIGHT_EXPORTER_STALL_S",
        "an exporter that holds undelivered data and delivered nothing for this long makes the agent "
        "unhealthy (0: never)"),
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
    Key("exporters.file.enabled", _auto_bool, lambda: "auto", "INFERSIGHT_OTLP_FILE_ENABLED",
        "write the file: `auto` when `path` is set or no other sink records (OTLP, MQTT), then at "
        "`<state_dir>/infersight.otlp.jsonl`; `true` always; `false` never"),
    Key("exporters.file.path", _opt_str, lambda: None, "INFERSIGHT_OTLP_FILE", "OTLP JSON lines file",
        "unset (`<state_dir>/infersight.otlp.jsonl` when written; launch: `--otlp-file`)"),
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
        "site OOM and stage rule files (`*.toml`)", "`/etc/infersight/rules.d`"),
)
KEY_BY_NAME = {k.name: k for k in KEYS}


def _flatten(obj: Mapping[str, Any], prefix: str = "", depth: int = 0) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; a table nested past MAX_TABLE_DEPTH is an error
    (no key of ours is that deep, and the recursion must stay bounded)."""
    if depth > MAX_TABLE_DEPTH:
        raise ValueError("tables nested more than %d deep (at %s...)" % (MAX_TABLE_DEPTH, prefix[:80]))
    out: dict[str, Any] = {}
    for k, v in obj.items():
        name = prefix + k
        if isinstance(v, dict) and name not in KEY_BY_NAME:
            out.update(_flatten(v, name + ".", depth + 1))
        else:
            out[name] = v
    return out


def read_config_text(path: str) -> str:
    """The config file's text. Only a regular file is read (a FIFO would block the agent, at
    start or, worse, on SIGHUP inside the event loop; a device could be endless), at most
    MAX_CONFIG_BYTES; FileNotFoundError passes through, other problems are ConfigError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigError("%s: cannot read: %s" % (path, exc.strerror or exc)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError("%s: not a regular file (a FIFO, device or directory is not read)" % path)
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError("%s: %d bytes, larger than a config file can be (%d)" % (
                path, st.st_size, MAX_CONFIG_BYTES))
        data = os.read(fd, MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError("%s: cannot read: %s" % (path, exc.strerror or exc)) from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where, what = undecodable(str(path), exc)
        raise ConfigError("%s: %s" % (where, what)) from None


log = logging.getLogger("infersight.config")
_warned_names: set[str] = set()  # the unknown-name lines this process has logged


def unknown_env_warnings(env: Mapping[str, str] | None = None) -> list[str]:
    """One line per ``INFERSIGHT_*`` name of ``env`` (default: this process's environment) that
    nothing of infersight reads (a typo: ``INFERSIGHT_PROMETHEUS_PROT``), with the known name it
    likely means. The hooks' list of names (``hooks/_env.py``) is the one list: it holds the
    agent's keys, the exporters' and the hooks' own."""
    env = os.environ if env is None else env
    return ["environment: %s; ignored" % _env.unknown_message(name, suggestion)
            for name, suggestion in _env.unknown(env)]


def _warn_unknown_env() -> None:
    """Log each unknown name of this process's environment once (at the agent's start; a
    reload, whose environment is the same, says nothing again). The agent starts all the same."""
    for line in unknown_env_warnings():
        if line not in _warned_names:
            _warned_names.add(line)
            log.warning("%s", line)


def load(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    require_file: bool = False,
    extra_keys: tuple[Key, ...] = (),
) -> Config:
    """Resolve every key: flag > env > file > default. With this process's environment
    (``env`` None), an ``INFERSIGHT_*`` name that nothing reads is logged once as a warning."""
    if env is None:
        _warn_unknown_env()
    env = os.environ if env is None else env
    keys = KEYS + extra_keys
    known = {k.name: k for k in keys}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    file_values: dict[str, Any] = {}
    locations: dict[str, Location] = {}
    if path is not None:
        try:
            text = read_config_text(path)
            doc = loads(text, path)
            file_values = _flatten(doc)
        except FileNotFoundError:
            if require_file:
                raise ConfigError("%s: config file not found" % path) from None
            path = None
        except SourceError as exc:
            raise ConfigError(exc.message, *exc.locations) from None
        except ValueError as exc:  # _flatten: nested too deep
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError("%s: %s" % (path, exc)) from None
        else:
            where = TomlKeys(text, path)
            # A key's line says where; its column adds nothing.
            locations = {name: Location(path, where.nearest(name).line) for name in file_values}
    for name in file_values:
        if name not in known and not name.startswith(EXTENSION_SECTIONS):
            raise ConfigError(unknown_key(name, known, EXTENSION_SECTIONS), locations[name])
    for k in keys:
        origin: str | Location = "default"
        raw_value = None
        if flags and flags.get(k.name) is not None:
            origin, raw_value = "flag", flags[k.name]
        elif k.env and env.get(k.env) not in (None, ""):
            origin, raw_value = "env " + k.env, env[k.env]
        elif k.name in file_values:
            origin, raw_value = locations[k.name], file_values[k.name]
        if origin == "default":
            values[k.name] = k.default()
        else:
            try:
                values[k.name] = k.parse(raw_value)
            except (ValueError, TypeError) as exc:
                raise bad_value(origin, k.name, raw_value, exc) from None
        sources[k.name] = str(origin)
    # Sections that other modules own (mqtt, prometheus, nvml) stay available raw.
    for name, v in file_values.items():
        values.setdefault(name, v)
        sources.setdefault(name, str(locations[name]))
    return Config(values, sources, path, locations)
