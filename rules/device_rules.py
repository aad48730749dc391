"""Loader for ``devices.toml``: slow-device thresholds and their example cases.

Every validation error is a :class:`DeviceRulesError` at ``file:line``. The file declares
the engine version it needs, as every rule file does: ``engine_version = "1.0"``
(:mod:`infersight.rules.rulefile`); a file that needs another major or a newer minor is
refused. Deprecated: the older key ``engine = 1`` (an integer major) still loads, so files
written for it keep working; a file may not set both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from infersight.errors import Location, SourceError
from infersight.rules.rulefile import ENGINE_VERSION_KEY, RulesError, needed_engine
from infersight.tomlfile import TomlKeys, loads

ENGINE_VERSION = (1, 0)
DEPRECATED_ENGINE_KEY = "engine"
DEFAULT_PATH = Path(__file__).with_name("devices.toml")

# nvml.h nvmlClocksEventReason* bits (formerly nvmlClocksThrottleReason*).
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks_setting"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
    (0x200, "board_limit"),
    (0x400, "reliability"),
)
THROTTLE_REASON_NAMES: tuple[str, ...] = tuple(name for _, name in THROTTLE_REASONS)

# In priority order: the first that applies is a slow device's cause.
CAUSES = (
    "gpu_lost",  # NVML lost the GPU in the window (hw.state failed): whatever its samples before said
    "thermal_throttling",
    "power_throttling",
    "pcie_link_degraded",
    "ecc_errors",
    "other_process",  # measured: other processes' SM use; mere presence ranks after clocks_below_max
    "clocks_below_max",
    "unknown",
)
VERDICTS = ("ok", "slow", "no_peers", "insufficient_data")
# Keys of an example's ``window`` table: the fields of heterogeneity.WindowState.
WINDOW_KEYS: dict[str, type] = {
    "samples": int,
    "busy_samples": int,
    "thermal_samples": int,
    "power_samples": int,
    "pcie_below_max_samples": int,
    "clocks_below_max_samples": int,
    "ecc_errors": int,
    "other_process_samples": int,
    "other_present_samples": int,
    "lost": bool,
}


class DeviceRulesError(SourceError, RulesError, ValueError):
    """A rule file problem; the message starts with ``file:line:``."""


@dataclass(frozen=True, slots=True)
class DeviceThresholds:
    slow_coefficient: float = 1.2  # P99 (its lower confidence bound) / peers' median P99 above this is slow
    recover_coefficient: float = 1.1  # a slow series stays slow until it is at or below this
    slow_evaluations: int = 3  # evaluations in a row over slow_coefficient before a series turns slow
    min_requests: int = 100  # fewer requests in the window: insufficient_data, and not a peer
    throttle_share: float = 0.2  # share of samples with a thermal/power reason active
    pcie_below_max_share: float = 0.5  # share of busy samples with link gen/width below max
    clock_ratio: float = 0.9  # SM clock below this fraction of max counts as "below max"
    clocks_below_max_share: float = 0.5  # share of busy samples below max with no reason
    busy_utilization_pct: int = 10  # a sample is busy at or above this GPU utilization
    ecc_min_errors: int = 1  # new volatile ECC errors in the window
    other_process_sm_pct: int = 20  # other processes' SM utilisation (summed) counts from this ...
    other_process_share: float = 0.2  # ... in this share of busy samples
    other_present_share: float = 0.5  # no per-process utilisation: another compute process present this often
    thermal_reasons: tuple[str, ...] = ("sw_thermal_slowdown", "hw_thermal_slowdown")
    power_reasons: tuple[str, ...] = ("sw_power_cap", "hw_power_brake_slowdown", "hw_slowdown")


@dataclass(frozen=True, slots=True)
class DeviceExample:
    name: str
    line: int
    device_p99_s: float
    peer_p99_s: tuple[float, ...]
    expect_verdict: str
    expect_cause: str | None
    window: dict[str, int | bool] = field(default_factory=dict)
    device_requests: int = 1000


@dataclass(frozen=True, slots=True)
class DeviceRules:
    path: str
    engine: int  # the major engine version the file needs
    thresholds: DeviceThresholds
    examples: tuple[DeviceExample, ...]


class _Ctx:
    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.keys = TomlKeys(text, path)

    def line(self, *key: str | int) -> int:
        """The line of ``key`` (a path into the document), or of the nearest table around it."""
        return self.keys.nearest(key).line

    def fail(self, msg: str, *key: str | int) -> DeviceRulesError:
        return DeviceRulesError(msg, Location(self.path, self.line(*key)))


def _num(ctx: _Ctx, v: Any, *key: str | int) -> float:
    """``v`` as a number, else the error at ``key`` (its path; the last part names it)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ctx.fail(f"{key[-1]} must be a number, got {v!r}", *key)
    return float(v)


def _thresholds(ctx: _Ctx, raw: Any) -> DeviceThresholds:
    if not isinstance(raw, dict):
        raise ctx.fail("[thresholds] must be a table", "thresholds")
    known = {f.name: f for f in fields(DeviceThresholds)}
    values: dict[str, Any] = {}
    for key, v in raw.items():
        if key not in known:
            raise ctx.fail(f"unknown threshold {key!r}", "thresholds", key)
        if key.endswith("_reasons"):
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ctx.fail(f"{key} must be a list of strings", "thresholds", key)
            bad = [x for x in v if x not in THROTTLE_REASON_NAMES]
            if bad:
                raise ctx.fail(
                    f"{key}: unknown reason(s) {bad}; known: {list(THROTTLE_REASON_NAMES)}",
                    "thresholds",
                    key,
                )
            values[key] = tuple(v)
        elif key in ("min_requests", "busy_utilization_pct", "ecc_min_errors", "slow_evaluations",
                     "other_process_sm_pct"):
            low = 1 if key in ("slow_evaluations", "other_process_sm_pct") else 0  # (0% SM is no use)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ctx.fail(f"{key} must be an integer >= {low}", "thresholds", key)
            values[key] = v
        else:
            x = _num(ctx, v, "thresholds", key)
            if key in ("slow_coefficient", "recover_coefficient") and x <= 1.0:
                raise ctx.fail(f"{key} must be above 1.0", "thresholds", key)
            if key not in ("slow_coefficient", "recover_coefficient") and not 0.0 <= x <= 1.0:
                raise ctx.fail(f"{key} must lie in [0, 1]", "thresholds", key)
            values[key] = x
    th = DeviceThresholds(**values)
    if th.recover_coefficient > th.slow_coefficient:
        if "recover_coefficient" in raw:
            raise ctx.fail("recover_coefficient must not exceed slow_coefficient", "thresholds", "recover_coefficient")
        th = replace(th, recover_coefficient=th.slow_coefficient)  # the default follows a low slow_coefficient
    return th


def _example(ctx: _Ctx, raw: Any, nth: int) -> DeviceExample:
    t = "examples"
    if not isinstance(raw, dict):
        raise ctx.fail("each [[examples]] must be a table", t, nth)
    allowed = {"name", "device_p99_s", "peer_p99_s", "expect_verdict", "expect_cause", "window",
               "device_requests"}  # fmt: skip
    for key in raw:
        if key not in allowed:
            raise ctx.fail(f"unknown example key {key!r}", t, nth, key)
    for key in ("name", "device_p99_s", "peer_p99_s", "expect_verdict"):
        if key not in raw:
            raise ctx.fail(f"example needs {key!r}", t, nth)
    name = raw["name"]
    if not isinstance(name, str):
        raise ctx.fail("name must be a string", t, nth, "name")
    p99 = _num(ctx, raw["device_p99_s"], t, nth, "device_p99_s")
    peers = raw["peer_p99_s"]
    if not isinstance(peers, list):
        raise ctx.fail("peer_p99_s must be a list of numbers", t, nth, "peer_p99_s")
    peer_vals = tuple(_num(ctx, p, t, nth, "peer_p99_s") for p in peers)
    verdict = raw["expect_verdict"]
    if verdict not in VERDICTS:
        raise ctx.fail(f"expect_verdict must be one of {list(VERDICTS)}", t, nth, "expect_verdict")
    cause = raw.get("expect_cause")
    if cause is not None and cause not in CAUSES:
        raise ctx.fail(f"expect_cause must be one of {list(CAUSES)}", t, nth, "expect_cause")
    if verdict == "slow" and cause is None:
        raise ctx.fail("a slow example needs expect_cause", t, nth)
    window = raw.get("window", {})
    if not isinstance(window, dict):
        raise ctx.fail("window must be a table", t, nth, "window")
    for key, v in window.items():
        typ = WINDOW_KEYS.get(key)
        if typ is None:
            known = sorted(WINDOW_KEYS)
            raise ctx.fail(f"unknown window key {key!r}; known: {known}", t, nth, "window", key)
        bad_int = typ is int and (isinstance(v, bool) or not isinstance(v, int) or v < 0)
        if not isinstance(v, typ) or bad_int:
            raise ctx.fail(f"window.{key} must be a {typ.__name__} >= 0", t, nth, "window", key)
    requests = raw.get("device_requests", 1000)
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 0:
        raise ctx.fail("device_requests must be a non-negative integer", t, nth, "device_requests")
    return DeviceExample(
        name=name,
        line=ctx.line(t, nth),
        device_p99_s=p99,
        peer_p99_s=peer_vals,
        expect_verdict=verdict,
        expect_cause=cause,
        window=dict(window),
        device_requests=requests,
    )


def parse_device_rules(text: str, path: str = "<string>") -> DeviceRules:
    ctx = _Ctx(path, text)
    try:
        doc = loads(text, path)
    except SourceError as exc:
        raise DeviceRulesError("invalid " + exc.message, *exc.locations) from None
    for key in doc:
        if key not in (ENGINE_VERSION_KEY, DEPRECATED_ENGINE_KEY, "thresholds", "examples"):
            raise ctx.fail(f"unknown top-level key {key!r}", key)
    version_key = ENGINE_VERSION_KEY
    if DEPRECATED_ENGINE_KEY in doc:
        if ENGINE_VERSION_KEY in doc:
            raise ctx.fail(f"set {ENGINE_VERSION_KEY} only ({DEPRECATED_ENGINE_KEY} is its deprecated name)",
                           DEPRECATED_ENGINE_KEY)
        version_key = DEPRECATED_ENGINE_KEY
    try:
        needs = needed_engine(doc.get(version_key), ENGINE_VERSION)
    except ValueError as exc:
        raise ctx.fail(str(exc), version_key) from None
    thresholds = _thresholds(ctx, doc.get("thresholds", {}))
    raw_examples = doc.get("examples", [])
    if not isinstance(raw_examples, list):
        raise ctx.fail("examples must be an array of tables", "examples")
    examples = tuple(_example(ctx, ex, i) for i, ex in enumerate(raw_examples))
    return DeviceRules(path=path, engine=needs[0], thresholds=thresholds, examples=examples)


def load_device_rules(path: str | Path | None = None) -> DeviceRules:
    """Load and validate a rule file (default: the shipped ``devices.toml``)."""
    p = Path(path) if path is not None else DEFAULT_PATH
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise DeviceRulesError(f"cannot read: {exc.strerror or exc}", Location(str(p), 1)) from None
    return parse_device_rules(text, str(p))
