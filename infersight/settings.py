"""Settings: keys, value parsers and resolution, shared by the agent's config and the
modules that own a section of it (MQTT, Prometheus, devices).

A :class:`Key` has a TOML name (``section.key``), an environment variable and a parser.
A resolved :class:`Config` holds every value by dotted key and where it came from. A bad
value is a :class:`ConfigError` naming the key and, when it came from a file,
``file:line``. The agent's key table and its loader live in
``infersight.agent.daemon.config``.

Neutral: imports only the neutral modules (errors, redact).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from infersight.errors import Location, SourceError
from infersight.redact import is_secret_key, scrub, shown_value

log = logging.getLogger("infersight.settings")


class ConfigError(SourceError):
    """A bad configuration value; the message names the key and file:line."""


def parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(v, str) and v.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


def env_flag(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """An on/off environment variable outside the config file (``INFERSIGHT_MEASURE_STORAGE``):
    :func:`parse_bool`'s words; unset or empty is ``default``, and so is a bad value, with a
    warning naming it (a typo never turns a feature off nor on)."""
    raw = (os.environ if env is None else env).get(name, "")
    if not raw.strip():
        return default
    try:
        return parse_bool(raw)
    except ValueError:
        log.warning("%s=%r is not 1/0, true/false, yes/no or on/off: taken as %s", name, raw, default)
        return default


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


def parse_listen_port(v: Any) -> int:
    """A port a server of the agent binds (0: any free one)."""
    n = parse_int(v)
    if not 0 <= n <= 65535:
        raise ValueError("expected a port in 0..65535 (0: any free port)")
    return n


def strip_host(host: str) -> str:
    """``host`` without surrounding blanks, and without the brackets of ``[::1]``."""
    h = host.strip()
    return h[1:-1] if h.startswith("[") and h.endswith("]") else h


_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?")


def parse_listen_host(v: Any) -> str:
    """The address a server of the agent binds (brackets of an IPv6 address removed): a host name, an IPv4
    or IPv6 address, never a port nor a URL (``localhost:9`` passed and the bind then failed for ever)."""
    if not isinstance(v, str) or not strip_host(v):
        raise ValueError("expected a host name or address (0.0.0.0 or :: for all interfaces)")
    h = strip_host(v)
    if "://" in h:
        raise ValueError("expected a host, not a URL: no scheme (%s://), no port, no path" % h.split("://", 1)[0])
    if ":" in h:
        import ipaddress

        try:
            ipaddress.IPv6Address(h.split("%", 1)[0])  # (a zone: fe80::1%eth0)
            return h
        except ValueError:
            pass
        head, _, tail = h.rpartition(":")
        if tail.isdigit() and head:
            raise ValueError("expected a host without a port: the port has its own key (port = %s)" % tail)
        raise ValueError("expected a host name or address")
    if not _HOST_NAME.fullmatch(h):
        raise ValueError("expected a host name or address (letters, digits, '-', '.'), no port, no path")
    return h


def _parse_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError("expected a number")
    return float(v)


def parse_pos_float(v: Any) -> float:
    x = _parse_float(v)
    if not x > 0:
        raise ValueError("expected a positive number")
    return x


def parse_nonneg_float(v: Any) -> float:
    x = _parse_float(v)
    if not x >= 0:
        raise ValueError("expected a non-negative number")
    return x


def seconds_in(lo: float, hi: float) -> Callable[[Any], float]:
    """The parser of a number of seconds in ``[lo, hi]`` (a number, or a string of one)."""

    def parse(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float | str):
            raise ValueError("expected a number of seconds")
        x = float(v)
        if not math.isfinite(x) or not lo <= x <= hi:
            raise ValueError("expected a number of seconds in [%g, %g]" % (lo, hi))
        return x

    return parse


@dataclass(frozen=True)
class Key:
    name: str  # TOML dotted name
    parse: Callable[[Any], Any]
    default: Callable[[], Any]
    env: str | None
    help: str
    shown_default: str | None = None  # for the README, where the default depends on the host


@dataclass
class Config:
    values: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)  # key -> "default" | "env VAR" | "file:line" | "flag"
    path: str | None = None
    locations: dict[str, Location] = field(default_factory=dict)  # key -> where the file sets it

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


def bad_value(origin: str | Location, name: str, raw: Any, exc: BaseException) -> ConfigError:
    """The error for a value its parser refused, from ``origin`` (a file's location, or
    "env VAR", "flag"). It never echoes a secret or a URL's password: the value is shown
    masked, and so is any copy of it in the parser's message."""
    shown = shown_value(name, raw)
    why = str(exc)
    if is_secret_key(name):
        why = "invalid value"  # the parser may quote parts of it
    elif isinstance(raw, str):
        why = scrub(why, raw)
    message = "bad value for %s: %s (%s)" % (name, shown, why)
    if isinstance(origin, Location):
        return ConfigError(message, origin)
    return ConfigError("%s: %s" % (origin, message))


def setting(config: Config, key: Key, env: Mapping[str, str]) -> Any:
    """One key of a section that its own module owns (MQTT, Prometheus): the value
    ``load(extra_keys=...)`` resolved, or resolved here, flag > env > file > default."""
    src = config.sources.get(key.name, "")
    if key.name in config.values and src.startswith(("flag", "env ", "default")):
        return config.values[key.name]
    origin: str | Location = "default"
    raw = None
    if key.env and env.get(key.env) not in (None, ""):
        origin, raw = "env " + key.env, env[key.env]
    elif key.name in config.values:
        origin, raw = config.locations.get(key.name) or src or "file", config.values[key.name]
    if origin == "default":
        return key.default()
    try:
        return key.parse(raw)
    except (ValueError, TypeError) as exc:
        raise bad_value(origin, key.name, raw, exc) from None


def section_unset(config: Config, prefix: str, env_prefix: str, env: Mapping[str, str]) -> bool:
    """Whether section ``prefix`` is all defaults, from nothing set: no key of it in ``config``
    (file, flag or a resolved default), no non-empty environment variable named
    ``env_prefix...`` (every key of the section has its variable there). The section's module
    need not be imported to know that :func:`section_settings` would return its defaults."""
    return (not any(n.startswith(prefix) for n in config.values)
            and not any(v != "" and k.startswith(env_prefix) for k, v in env.items()))


def unknown_key(name: str, known: Iterable[str], sections: Iterable[str] = ()) -> str:
    """``unknown key 'agent.log_levle' (did you mean 'agent.log_level'?)``: the message for a key nothing
    reads, with the closest known one (difflib, imported only for an error). ``sections``: sections whose
    keys other modules know (``exporters.mqtt.``): a misspelled one (``[exporter.mqtt]``) is named with the
    key's name in it."""
    import difflib

    known = sorted(known)
    section, _, leaf = name.rpartition(".")
    # within the key's section, by its last part: a shared long prefix makes any two names look alike
    same = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == section}
    close = [same[c] for c in difflib.get_close_matches(leaf, sorted(same), n=1, cutoff=0.75)]
    if not same:  # a section nothing has (misspelled, ``[agnet]``): the whole name, among every key
        others = sorted({s.rstrip(".") for s in sections} - {k.rpartition(".")[0] for k in known})
        near = difflib.get_close_matches(section, sorted({k.rpartition(".")[0] for k in known} | set(others)),
                                         n=1, cutoff=0.75)
        if near and near[0] in others:  # a section whose keys its own module checks once it is found
            close = ["%s.%s" % (near[0], leaf)]
        else:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
    return "unknown key %r%s" % (name, " (did you mean %r?)" % close[0] if close else "")


def section_settings(config: Config, prefix: str, keys: tuple[Key, ...], env: Mapping[str, str]) -> dict[str, Any]:
    """Every key of section ``prefix`` (e.g. ``exporters.mqtt.``), by its name inside the
    section; an unknown key in the file is an error naming it and its file:line."""
    values = {k.name[len(prefix) :]: setting(config, k, env) for k in keys}
    unknown = sorted(n for n in config.values if n.startswith(prefix) and n[len(prefix) :] not in values)
    if unknown:
        name = unknown[0]
        where = config.locations.get(name)
        message = unknown_key(name, (prefix + n for n in values))
        if where is not None:
            raise ConfigError(message, where)
        raise ConfigError("%s: %s" % (config.sources.get(name, "config"), message))
    return values
