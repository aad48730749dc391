"""What the MQTT exporter is told: the ``[exporters.mqtt]`` keys and one validated settings object.

:data:`MQTT_KEYS` is the section's key table (TOML name, parser, environment variable, help);
the config loader uses it to report a bad value with its ``file:line``. :class:`MqttSettings`
is the exporter's whole input. It checks itself once, when it is made, with the same parsers
(plus the rules that tie keys together), so the exporter validates nothing and one rule
exists in one place. :func:`settings_from_config` makes it from a configuration.

Nothing here touches the network or imports the MQTT client.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any
from urllib.parse import unquote, urlsplit

from infersight.exporters.base import ExporterError
from infersight.exporters.mqtt_payload import Topics, validate_prefix
from infersight.redact import mask_url
from infersight.settings import Config, ConfigError, Key, section_settings, setting
from infersight.settings import parse_bool as _p_bool
from infersight.settings import parse_int as _p_int
from infersight.settings import parse_nonneg_float as _p_nonneg_float
from infersight.settings import parse_nonneg_int as _p_nonneg_int
from infersight.settings import parse_pos_float as _p_pos_float

_PROTOCOL_ALIASES = {
    "5": "5",
    "5.0": "5",
    "v5": "5",
    "mqttv5": "5",
    "3.1.1": "3.1.1",
    "311": "3.1.1",
    "v311": "3.1.1",
    "mqttv311": "3.1.1",
}
SCHEMES = {"mqtt": False, "tcp": False, "mqtts": True, "ssl": True, "tls": True}


class MqttConfigError(ExporterError, ValueError):
    """The MQTT exporter cannot be set up as configured (bad URL, missing file, bad option)."""


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    tls: bool
    host: str
    port: int
    username: str | None
    password: str | None = field(repr=False)


def parse_url(url: str) -> BrokerAddress:
    """``mqtt://[user[:pass]@]host[:port]`` or ``mqtts://...`` (ports default to 1883 / 8883)."""
    try:
        u = urlsplit(url.strip())
        port = u.port
    except ValueError as exc:
        raise MqttConfigError("bad MQTT URL %s: %s" % (mask_url(url), exc)) from None
    scheme = u.scheme.lower()
    if scheme not in SCHEMES:
        raise MqttConfigError("bad MQTT URL %s: scheme must be mqtt:// or mqtts://" % mask_url(url))
    if not u.hostname:
        raise MqttConfigError("bad MQTT URL %s: no host" % mask_url(url))
    if u.path not in ("", "/") or u.query or u.fragment:
        raise MqttConfigError("bad MQTT URL %s: no path or query allowed (set topic_prefix instead)" % mask_url(url))
    tls = SCHEMES[scheme]
    return BrokerAddress(
        tls, u.hostname, port or (8883 if tls else 1883),
        unquote(u.username) if u.username else None, unquote(u.password) if u.password is not None else None,
    )  # fmt: skip


def normalize_protocol(value: str) -> str:
    p = _PROTOCOL_ALIASES.get(str(value).strip().lower())
    if p is None:
        raise MqttConfigError("MQTT protocol must be 5 or 3.1.1, not %r" % (value,))
    return p


def local_host_name() -> str:
    return socket.gethostname().split(".")[0]


@dataclass(frozen=True, slots=True)
class MqttSettings:
    """The MQTT exporter's settings, checked and normalised when made (``MqttConfigError``)."""

    url: str = field(repr=False)  # may hold a password: the exporter shows it masked
    # -- the [exporters.mqtt] keys (password_file is read into password) --
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    tls_verify: bool = True
    client_id: str | None = None  # None: infersight-<host>-agent, or -launch-<pid> when embedded
    topic_prefix: str = "infersight"
    qos: int = 1
    keepalive: int = 60
    protocol: str = "5"
    session_expiry_s: int = 3600
    connect_timeout_s: float = 10.0
    max_payload_bytes: int = 256 << 10
    exit_wait_s: float = 5.0
    # -- who is speaking: set by the command that builds the exporter --
    host_name: str = field(default_factory=local_host_name)  # agent.host_name
    embedded: bool = False  # under `infersight launch`: its own client id, status and clean session
    launch_pid: int | None = None  # embedded: the launch's pid (default: this process)
    birth: Mapping[str, Any] = field(default_factory=dict, hash=False)  # extra fields of the birth message
    # -- tuning, not in the file (tests and benches shorten them) --
    publish_timeout_s: float = 30.0
    max_inflight: int = 100
    reconnect_initial_s: float = 0.5
    reconnect_max_s: float = 30.0
    # -- derived --
    address: BrokerAddress = field(init=False, repr=False)
    topics: Topics = field(init=False)

    def __post_init__(self) -> None:
        for name, check in _CHECKS.items():
            try:
                value = check(getattr(self, name))
            except ValueError as exc:
                raise MqttConfigError("MQTT %s: %s" % (name, exc)) from None
            object.__setattr__(self, name, value)
        object.__setattr__(self, "address", parse_url(self.url))
        try:
            object.__setattr__(self, "topics", Topics.of(self.topic_prefix, self.host_name))
        except ValueError as exc:
            raise MqttConfigError(str(exc)) from None
        username, password = self.credentials
        if password and not username:
            raise MqttConfigError("MQTT password given without a username")
        if (self.ca_file or self.cert_file or self.key_file) and not self.address.tls:
            raise MqttConfigError("ca_file/cert_file/key_file need an mqtts:// URL (got %s)" % mask_url(self.url))
        if self.key_file and not self.cert_file:
            raise MqttConfigError("MQTT key_file given without cert_file")

    @property
    def credentials(self) -> tuple[str | None, str | None]:
        """User name and password: the keys' where set, else the URL's."""
        return self.username or self.address.username, self.password or self.address.password


# -- the key table -----------------------------------------------------------------------------


def _p_str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("expected a string")
    return v


def _p_opt_str(v: Any) -> str | None:
    return None if v in (None, "") else _p_str(v)


def _p_qos(v: Any) -> int:
    n = _p_int(v)
    if n not in (0, 1, 2):
        raise ValueError("expected 0, 1 or 2")
    return n


def _p_keepalive(v: Any) -> int:
    n = _p_int(v)
    if not 1 <= n <= 65535:
        raise ValueError("expected 1..65535 seconds")
    return n


def _p_url(v: Any) -> str | None:
    s = _p_opt_str(v)
    if s is not None:
        try:
            parse_url(s)
        except MqttConfigError as exc:
            raise ValueError(str(exc)) from None
    return s


def _p_protocol(v: Any) -> str:
    try:
        return normalize_protocol(_p_str(v) if not isinstance(v, (int, float)) else str(v))
    except MqttConfigError as exc:
        raise ValueError(str(exc)) from None


def _p_prefix(v: Any) -> str:
    return validate_prefix(_p_str(v))


def _p_pos_int(v: Any) -> int:
    n = _p_int(v)
    if n < 1:
        raise ValueError("expected a positive integer")
    return n


_DEFAULTS = {f.name: f.default for f in fields(MqttSettings) if f.init and f.default is not MISSING}


def _default(name: str) -> Callable[[], Any]:
    """A key's default is the settings field's: one source for both."""
    return lambda: _DEFAULTS[name]


_K = "exporters.mqtt."
MQTT_KEYS: tuple[Key, ...] = (
    Key(_K + "url", _p_url, lambda: None, "INFERSIGHT_MQTT_URL",
        "MQTT broker, mqtt://host[:1883] or mqtts://host[:8883] (unset: no MQTT)"),
    Key(_K + "username", _p_opt_str, _default("username"), "INFERSIGHT_MQTT_USERNAME", "MQTT user name"),
    Key(_K + "password", _p_opt_str, _default("password"), "INFERSIGHT_MQTT_PASSWORD",
        "MQTT password (never logged; prefer password_file)"),
    Key(_K + "password_file", _p_opt_str, lambda: None, "INFERSIGHT_MQTT_PASSWORD_FILE",
        "file holding the MQTT password (first line)"),
    Key(_K + "ca_file", _p_opt_str, _default("ca_file"), "INFERSIGHT_MQTT_CA_FILE",
        "CA bundle to verify the broker (mqtts://; default: system store)"),
    Key(_K + "cert_file", _p_opt_str, _default("cert_file"), "INFERSIGHT_MQTT_CERT_FILE",
        "client certificate (mqtts://)"),
    Key(_K + "key_file", _p_opt_str, _default("key_file"), "INFERSIGHT_MQTT_KEY_FILE", "client private key (mqtts://)"),
    Key(_K + "tls_verify", _p_bool, _default("tls_verify"), "INFERSIGHT_MQTT_TLS_VERIFY",
        "verify the broker's certificate and host name"),
    Key(_K + "client_id", _p_opt_str, _default("client_id"), "INFERSIGHT_MQTT_CLIENT_ID",
        "client id (default infersight-<host>-agent, launch: infersight-<host>-launch-<pid>)"),
    Key(_K + "topic_prefix", _p_prefix, _default("topic_prefix"), "INFERSIGHT_MQTT_TOPIC_PREFIX",
        "first topic level(s)"),
    Key(_K + "qos", _p_qos, _default("qos"), "INFERSIGHT_MQTT_QOS", "QoS of event messages"),
    Key(_K + "keepalive", _p_keepalive, _default("keepalive"), "INFERSIGHT_MQTT_KEEPALIVE", "keepalive in seconds"),
    Key(_K + "protocol", _p_protocol, _default("protocol"), "INFERSIGHT_MQTT_PROTOCOL", "5 or 3.1.1"),
    Key(_K + "session_expiry_s", _p_nonneg_int, _default("session_expiry_s"), "INFERSIGHT_MQTT_SESSION_EXPIRY_S",
        "daemon session expiry (MQTT 5)"),
    Key(_K + "connect_timeout_s", _p_pos_float, _default("connect_timeout_s"), "INFERSIGHT_MQTT_CONNECT_TIMEOUT_S",
        "connect (CONNACK) timeout"),
    Key(_K + "max_payload_bytes", _p_nonneg_int, _default("max_payload_bytes"), "INFERSIGHT_MQTT_MAX_PAYLOAD_BYTES",
        "larger messages are dropped and counted (brokers refuse them; e.g. AWS IoT: 128 KiB)"),
    Key(_K + "exit_wait_s", _p_nonneg_float, _default("exit_wait_s"), "INFERSIGHT_MQTT_EXIT_WAIT_S",
        "launch: how long to wait for the broker at exit"),
)  # fmt: skip

# What MqttSettings checks each field with: the key table's parsers, and the tuning fields'.
_CHECKS: dict[str, Callable[[Any], Any]] = {
    **{k.name[len(_K):]: k.parse for k in MQTT_KEYS if k.name[len(_K):] in _DEFAULTS},
    "url": _p_str,  # parse_url checks the rest, once
    "launch_pid": lambda v: None if v is None else _p_pos_int(v),
    "publish_timeout_s": _p_pos_float,
    "max_inflight": _p_pos_int,
    "reconnect_initial_s": _p_pos_float,
    "reconnect_max_s": _p_pos_float,
}


def mqtt_requested(config: Config, env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return bool(setting(config, MQTT_KEYS[0], env))


def settings_from_config(
    config: Config,
    *,
    env: Mapping[str, str] | None = None,
    embedded: bool = False,
    launch_pid: int | None = None,
) -> MqttSettings | None:
    """The settings a configuration asks for, or None when no MQTT URL is set.

    Raises :class:`ConfigError` naming the key (and ``file:line``) for a bad value.
    """
    env = os.environ if env is None else env
    v = section_settings(config, _K, MQTT_KEYS, env)
    url = v.pop("url")
    if not url:
        return None
    password_file = v.pop("password_file")
    if password_file:
        try:
            with open(password_file, encoding="utf-8") as f:
                v["password"] = f.readline().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError("exporters.mqtt.password_file: cannot read: %s" % exc) from None
    host_name = config.get("agent.host_name")
    if host_name:
        v["host_name"] = host_name
    try:
        return MqttSettings(url, embedded=embedded, launch_pid=launch_pid, **v)
    except MqttConfigError as exc:
        raise ConfigError("exporters.mqtt: %s" % exc) from None
