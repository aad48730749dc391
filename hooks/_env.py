"""Every ``INFERSIGHT_*`` variable the hooks read: one table, one parser (stdlib only).

Each variable is defined once here: its name, kind, default and what it allows. The hooks
read a value with :func:`get`; a bad value never switches the hooks off: the process's
stderr gets one line naming the variable, the value and what is allowed (once per
variable), and that key takes its default. ``launch`` calls :func:`problems` on its own
environment before CMD starts and refuses a bad value there (exit 2): the same parser.
An ``INFERSIGHT_*`` name that infersight does not read at all (:func:`unknown`: a typo such
as ``INFERSIGHT_SPOOL_MAX_BYTE``) is one stderr line when the hooks activate, with the known
name it likely means, a refusal of ``launch``, and a warning of the agent at its start.

Kinds: ``bool`` (1/0, true/false, yes/no, on/off), ``int`` and ``float`` with a lower
bound, ``bytes`` (a whole number, optionally with a KiB/MiB/GiB or K/M/G suffix), ``choice``
and ``path`` (any non-empty string). ``internal`` variables are set by ``launch`` or by the
hooks for their children: launch does not check what the user's environment holds for them
(it overwrites them), the bootstrap does.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Dict, List, Mapping, Optional, Tuple

TRUE_WORDS = ("1", "true", "yes", "on")  # a bool variable's values (the .pth line and sitecustomize use them too)
FALSE_WORDS = ("0", "false", "no", "off")
_HUGE = 1e300
_UNITS = (("kib", 1 << 10), ("mib", 1 << 20), ("gib", 1 << 30), ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30))


class Var:
    """One variable: ``kind`` in bool/int/float/bytes/choice/path; ``low`` the least number
    allowed; ``above`` True when the bound itself is excluded; ``choices`` for a choice;
    ``shown`` the docs' default where the value alone would mislead."""

    __slots__ = ("above", "choices", "default", "help", "internal", "kind", "low", "name", "shown")

    def __init__(self, name: str, kind: str, default: Any, help: str, low: float = 0,
                 above: bool = False, choices: Tuple[str, ...] = (), internal: bool = False,
                 shown: str = "") -> None:
        self.name = name
        self.kind = kind
        self.default = default
        self.help = help
        self.low = low
        self.above = above
        self.choices = choices
        self.internal = internal
        self.shown = shown

    def allowed(self) -> str:
        """What a value must be, in words (for the error line)."""
        if self.kind == "bool":
            return "1/0, true/false, yes/no or on/off"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "path":
            return "a non-empty path"
        bound = ("> %g" if self.above else ">= %g") % self.low
        if self.kind == "bytes":
            return "a whole number of bytes %s (e.g. 67108864 or 64MiB)" % bound
        if self.kind == "int":
            return "a whole number %s" % bound
        return "a number %s" % bound

    def parse(self, raw: str) -> Any:
        """The value of ``raw``; ValueError when it is not allowed."""
        text = raw.strip()
        kind = self.kind
        if kind == "path":
            if not text:
                raise ValueError(raw)
            return raw
        if kind == "bool":
            low = text.lower()
            if low in TRUE_WORDS:
                return True
            if low in FALSE_WORDS:
                return False
            raise ValueError(raw)
        if kind == "choice":
            if text in self.choices:
                return text
            raise ValueError(raw)
        value: Any
        if kind == "bytes":
            low = text.lower()
            scale = 1
            for suffix, n in _UNITS:
                if low.endswith(suffix):
                    low, scale = low[: -len(suffix)].strip(), n
                    break
            if not low.isdigit():
                raise ValueError(raw)
            value = int(low) * scale
        elif kind == "int":
            if not text.lstrip("-").isdigit():
                raise ValueError(raw)
            value = int(text)
        else:
            value = float(text)  # ValueError on text
            if not -_HUGE < value < _HUGE:  # nan and inf are not numbers here
                raise ValueError(raw)
        if value < self.low or (self.above and value == self.low):
            raise ValueError(raw)
        return value


def _v(*args: Any, **kwargs: Any) -> Tuple[str, Var]:
    var = Var(*args, **kwargs)
    return var.name, var


VARS: Dict[str, Var] = dict((
    # The switch: the .pth bootstrap (``hooks install``) loads the hooks only when it is on
    # (unset, empty or off: nothing of ours loads; any other value: one stderr line, and off);
    # the bootstrap directory on PYTHONPATH is on unless it is off (a bad value: said, and on).
    # infersight's CLI drops it at its start: ``launch`` neither checks it nor passes it to CMD.
    _v("INFERSIGHT", "bool", True, "the hooks' switch: off (0/false/no/off) leaves the process unhooked; "
       "a value neither on nor off is said on stderr (see above)",
       shown="unset: off under the `.pth` line (`hooks install`), on with the bootstrap on `PYTHONPATH`; "
             "launch ignores it (CMD is hooked)"),
    # Where events go.
    _v("INFERSIGHT_SOCKET", "path", None, "the agent's socket (default: see the docs)"),
    _v("INFERSIGHT_SPOOL_DIR", "path", None, "where the hooks spool while the agent is away"),
    _v("INFERSIGHT_SPOOL_MAX_BYTES", "bytes", 64 << 20, "bound of this process's spool file"),
    _v("INFERSIGHT_BUFFER_EVENTS", "int", 0, "events the in-process buffer holds (0: 131072)"),
    _v("INFERSIGHT_BATCH_EVENTS", "int", 512, "send once this many events are queued", low=1),
    _v("INFERSIGHT_BATCH_DELAY_MS", "float", 50.0, "... or once the oldest queued event is this old"),
    _v("INFERSIGHT_EXIT_FLUSH_S", "float", 3.0, "how long a process waits at exit to deliver (then it spools the "
       "rest: at most 0.3 s more, even with an agent that accepts and never answers)"),
    # Cold start.
    _v("INFERSIGHT_READY_ON_LISTEN", "bool", True, "a listening TCP socket means ready",
       shown="unset: `True`, `False` under `launch --ready-url` (`INFERSIGHT_READY_FILE` set)"),
    _v("INFERSIGHT_SAMPLER", "bool", True, "the stack sampler that explains unattributed gaps"),
    _v("INFERSIGHT_SAMPLER_INTERVAL_MS", "float", 10.0, "the sampler's period", above=True),
    _v("INFERSIGHT_PROCESS_ROLE", "choice", "", "force this process's role", choices=("helper",)),
    # Allocator and OOM.
    _v("INFERSIGHT_MEM_INTERVAL_S", "float", 1.0, "memory_stats sampling period (0: off)"),
    _v("INFERSIGHT_LARGE_ALLOC_BYTES", "bytes", 256 << 20, "an allocation this large is logged"),
    _v("INFERSIGHT_MEMORY_HISTORY", "int", 0, "entries of the allocator history ring (0: off)"),
    _v("INFERSIGHT_OOM_SNAPSHOT", "bool", True, "summarise the allocator's segments at an OOM"),
    # Stage rules.
    _v("INFERSIGHT_STAGE_RULES", "bool", True, "apply the stage rules (module:qualname -> stage)"),
    _v("INFERSIGHT_RULES_DIRS", "path", None,
       "rules directories (':'-separated) whose *.toml stage rules apply (default /etc/infersight/rules.d)"),
    # Set by launch, or by the hooks for their children.
    _v("INFERSIGHT_READY_FILE", "path", None, "launch --ready-url: where the ready time is written",
       internal=True),
    _v("INFERSIGHT_LAUNCH_SPAWN_NS", "int", None, "launch: when CMD was spawned", internal=True),
    _v("INFERSIGHT_CHILDREN_DIR", "path", None, "where a supervisor's workers report", internal=True),
    _v("INFERSIGHT_EXEC_PID", "int", None, "an exec's pid: the new program's cold start begins at the exec",
       internal=True),
    _v("INFERSIGHT_EXEC_NS", "int", None, "when that exec happened (not the process's fork)", internal=True),
    _v("INFERSIGHT_LAUNCH_SESSION", "path", None, "launch joined an agent: the session its hooks name",
       internal=True),
    _v("INFERSIGHT_LAUNCH_EMBEDDED", "bool", False, "launch's own agent: its spool takes no earlier processes' files",
       internal=True),
))

# Every other INFERSIGHT_* name that infersight reads. The hooks neither read nor check these
# (their values are someone else's business), but know their names: an INFERSIGHT_* name
# that nothing reads is a typo, said on stderr (``unknown``), and refused by ``launch``.
# tests/unit/test_env_unknown_names.py holds this set equal to the agent's key tables plus
# the names below them, and finds every name written in the tree known.
OTHER_NAMES = frozenset((
    # The agent's configuration keys (agent/daemon/config.py KEYS).
    "INFERSIGHT_SOCKET_MODE", "INFERSIGHT_ALLOWED_UIDS", "INFERSIGHT_ALLOWED_GIDS", "INFERSIGHT_STATE_DIR",
    "INFERSIGHT_EXPORTER_SPOOL_MAX_BYTES", "INFERSIGHT_EXPORTER_MAX_ATTEMPTS", "INFERSIGHT_EXPORTER_STALL_S",
    "INFERSIGHT_SHUTDOWN_TIMEOUT_S", "INFERSIGHT_HEALTH_INTERVAL_S", "INFERSIGHT_FRAME_TIMEOUT_S",
    "INFERSIGHT_MAX_CONNECTIONS", "INFERSIGHT_IDLE_TIMEOUT_S", "INFERSIGHT_MAX_PENDING_BYTES",
    "INFERSIGHT_LOG_LEVEL", "INFERSIGHT_HOST_NAME", "INFERSIGHT_OTLP_FILE_ENABLED", "INFERSIGHT_OTLP_FILE",
    "INFERSIGHT_OTLP_FILE_MAX_BYTES", "INFERSIGHT_OTLP_FILE_BACKUPS", "INFERSIGHT_CONSOLE",
    # The sections their own modules own: MQTT, Prometheus, NVML and devices, routing.
    "INFERSIGHT_MQTT_URL", "INFERSIGHT_MQTT_USERNAME", "INFERSIGHT_MQTT_PASSWORD", "INFERSIGHT_MQTT_PASSWORD_FILE",
    "INFERSIGHT_MQTT_CA_FILE", "INFERSIGHT_MQTT_CERT_FILE", "INFERSIGHT_MQTT_KEY_FILE", "INFERSIGHT_MQTT_TLS_VERIFY",
    "INFERSIGHT_MQTT_CLIENT_ID", "INFERSIGHT_MQTT_CONNECT_TIMEOUT_S", "INFERSIGHT_MQTT_EXIT_WAIT_S",
    "INFERSIGHT_MQTT_KEEPALIVE", "INFERSIGHT_MQTT_MAX_PAYLOAD_BYTES", "INFERSIGHT_MQTT_PROTOCOL",
    "INFERSIGHT_MQTT_QOS", "INFERSIGHT_MQTT_SESSION_EXPIRY_S", "INFERSIGHT_MQTT_TOPIC_PREFIX",
    "INFERSIGHT_PROMETHEUS", "INFERSIGHT_PROMETHEUS_HOST", "INFERSIGHT_PROMETHEUS_PORT",
    "INFERSIGHT_PROMETHEUS_MAX_SERIES", "INFERSIGHT_PROMETHEUS_MAX_SERIES_PER_UID",
    "INFERSIGHT_PROMETHEUS_SERIES_TTL_S", "INFERSIGHT_PROMETHEUS_TARGET_INFO",
    "INFERSIGHT_NVML_ENABLED", "INFERSIGHT_NVML_INTERVAL_S", "INFERSIGHT_NVML_EXPORT_INTERVAL_S",
    "INFERSIGHT_NVML_PROC_ROOT", "INFERSIGHT_DEVICES_RULES", "INFERSIGHT_DEVICES_WINDOW_S",
    "INFERSIGHT_DEVICES_EVALUATE_INTERVAL_S",
    "INFERSIGHT_ROUTING", "INFERSIGHT_ROUTING_HOST", "INFERSIGHT_ROUTING_AGENT_CHECK_PORT",
    "INFERSIGHT_ROUTING_MAX_CONCURRENCY",
    # The commands' own: the agent's and doctor's config file, launch's and the agent's storage
    # measurement, classify's site rules directory.
    "INFERSIGHT_CONFIG", "INFERSIGHT_MEASURE_STORAGE", "INFERSIGHT_RULES_DIR",
    # The developers' knobs (scripts/check, the test suite): a hooked test process inherits them.
    "INFERSIGHT_TEST_WORKERS", "INFERSIGHT_STAGE_RULE_SOURCES", "INFERSIGHT_OOM_EXAMPLES",
))
PREFIX = "INFERSIGHT_"

# The switch misspelled. With INFERSIGHT unset or empty, the ``.pth`` line (``hooks install``) says one
# stderr line for a name that looks like it, set to a value that is not off: one within this edit distance
# of INFERSIGHT in any case (INFERSIGT, INFERSITE, INFERSIGHTS, infersight), or INFERSIGHT_ and one of
# these words (INFERSIGHT_ENABLED). Other INFERSIGHT_* names, set without the switch, say nothing: a
# fleet may set them for every service and switch the hooks on per service. Only names that begin with
# INF (any case) are looked at, the one test made on every name at every start of that interpreter.
SWITCH = "INFERSIGHT"
SWITCH_TYPO_DISTANCE = 3
SWITCH_TYPO_WORDS = ("", "ENABLE", "ENABLED", "ON", "HOOK", "HOOKS", "ACTIVE", "ACTIVATE", "SWITCH")

_reported: Dict[str, str] = {}  # variable -> the bad value already said on stderr


def say(msg: str) -> None:
    """One line on the process's stderr, ``infersight: <msg>``: how the hooks tell the host
    anything (a bad variable, a refused agent, lost events). Never raises."""
    try:
        sys.stderr.write("infersight: %s\n" % msg)
        sys.stderr.flush()
    except Exception:
        pass


def message(var: Var, raw: str) -> str:
    return "%s=%r is not allowed: expected %s" % (var.name, raw, var.allowed())


def get(name: str, env: Optional[Mapping[str, str]] = None) -> Any:
    """The value of ``name`` (its default when unset, empty or bad; a bad value is said once)."""
    var = VARS[name]
    raw = (os.environ if env is None else env).get(name)
    if not raw:
        return var.default
    try:
        return var.parse(raw)
    except ValueError:
        if _reported.get(name) != raw:
            _reported[name] = raw
            say("%s; using the default (%r)" % (message(var, raw), var.default))
        return var.default


def ready_on_listen() -> bool:
    """``INFERSIGHT_READY_ON_LISTEN``; unset, off where launch's ``--ready-url`` hands this process its ready
    file (the URL is the authority) and on elsewhere. The default goes with the file, not as a value of its own
    in the environment: a launch nested in such a run's CMD drops the outer run's file, and with it this
    default, for its own CMD."""
    if os.environ.get("INFERSIGHT_READY_ON_LISTEN"):  # set (a bad value: said, and its default, on)
        return bool(get("INFERSIGHT_READY_ON_LISTEN"))
    return get("INFERSIGHT_READY_FILE") is None


def exit_flush_s() -> float:
    """``INFERSIGHT_EXIT_FLUSH_S``: how long a process waits at exit to deliver, all waits together."""
    return float(get("INFERSIGHT_EXIT_FLUSH_S"))


def problems(env: Mapping[str, str], internal: bool = False) -> List[str]:
    """One line per variable of ``env`` with a value that is not allowed (``launch``)."""
    out = []
    for name, var in VARS.items():
        raw = env.get(name)
        if raw is None or raw == "" or (var.internal and not internal):
            continue
        try:
            var.parse(raw)
        except ValueError:
            out.append(message(var, raw))
    return out


def unknown(env: Mapping[str, str]) -> List[Tuple[str, Optional[str]]]:
    """Each ``INFERSIGHT_*`` name of ``env`` that infersight does not read (a typo), sorted,
    with the closest known name or None. Cheap when there is none: difflib is imported only
    for an unknown name."""
    names = sorted(k for k in env if k.startswith(PREFIX) and k not in VARS and k not in OTHER_NAMES)
    if not names:
        return []
    import difflib

    n = len(PREFIX)
    known = sorted({k[n:] for k in VARS if k.startswith(PREFIX)} | {k[n:] for k in OTHER_NAMES})
    out: List[Tuple[str, Optional[str]]] = []
    for name in names:
        close = difflib.get_close_matches(name[n:], known, n=1)
        out.append((name, PREFIX + close[0] if close else None))
    return out


def unknown_message(name: str, suggestion: Optional[str]) -> str:
    """The line for an unknown name: it, and the name it likely means."""
    return "%s is not a variable infersight reads%s" % (
        name, " (did you mean %s?)" % suggestion if suggestion else "")


def reference_markdown() -> str:
    """The table of ``docs/hooks-env.md`` (a test keeps the two equal)."""
    lines = ["| variable | default | allowed | what it does |", "| --- | --- | --- | --- |"]
    for var in VARS.values():
        default = var.shown or ("-" if var.default is None else
                                ("`%s`" % (var.default if var.default != "" else '""')))
        lines.append("| `%s` | %s | %s | %s%s |" % (var.name, default, var.allowed(), var.help,
                                                   " (set by launch or the hooks)" if var.internal else ""))
    return "\n".join(lines) + "\n"
