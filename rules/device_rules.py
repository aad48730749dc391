"""Loader for ``devices.toml``: slow-device thresholds and their example cases.

Every validation error names ``file:line``. The file declares the engine version it needs
(``engine``); a file that needs a newer engine is refused.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENGINE_VERSION = 1
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
    "thermal_throttling",
    "power_throttling",
    "pcie_link_degraded",
    "ecc_errors",
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
    "lost": bool,
}


class DeviceRulesError(ValueError):
    """A rule file problem; the message starts with ``file:line:``."""


@dataclass(frozen=True, slots=True)
class DeviceThresholds:
    slow_coefficient: float = 1.2  # P99 / peers' median P99 above this is slow
    min_requests: int = 20  # fewer requests in the window: insufficient_data, and not a peer
    throttle_share: float = 0.2  # share of samples with a thermal/power reason active
    pcie_below_max_share: float = 0.5  # share of busy samples with link gen/width below max
    clock_ratio: float = 0.9  # SM clock below this fraction of max counts as "below max"
    clocks_below_max_share: float = 0.5  # share of busy samples below max with no reason
    busy_utilization_pct: int = 10  # a sample is busy at or above this GPU utilization
    ecc_min_errors: int = 1  # new volatile ECC errors in the window
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
    engine: int
    thresholds: DeviceThresholds
    examples: tuple[DeviceExample, ...]


def _locate(text: str, table: str | None, key: str | None, nth: int = 0) -> int:
    """1-based line of ``key`` inside ``[table]`` (or the nth ``[[table]]``); best effort."""
    header_re = re.compile(r"^\s*\[\[?\s*([A-Za-z0-9_.\-]+)\s*\]\]?")
    current: str | None = None
    seen = -1
    table_line = 1
    for i, line in enumerate(text.splitlines(), 1):
        m = header_re.match(line)
        if m:
            current = m.group(1)
            if current == table:
                seen += 1
                if seen == nth:
                    table_line = i
            continue
        in_table = current == table and (table is None or seen == nth)
        if in_table and key is not None and re.match(rf"^\s*{re.escape(key)}\s*=", line):
            return i
    return table_line


class _Ctx:
    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.text = text

    def fail(self, msg: str, table: str | None = None, key: str | None = None, nth: int = 0) -> DeviceRulesError:
        return DeviceRulesError(f"{self.path}:{_locate(self.text, table, key, nth)}: {msg}")


def _num(ctx: _Ctx, v: Any, table: str, key: str, nth: int = 0) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ctx.fail(f"{key} must be a number, got {v!r}", table, key, nth)
    return float(v)


def _thresholds(ctx: _Ctx, raw: Any) -> DeviceThresholds:
    if not isinstance(raw, dict):
        raise ctx.fail("[thresholds] must be a table", "thresholds", None)
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
        elif key in ("min_requests", "busy_utilization_pct", "ecc_min_errors"):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ctx.fail(f"{key} must be a non-negative integer", "thresholds", key)
            values[key] = v
        else:
            x = _num(ctx, v, "thresholds", key)
            if key == "slow_coefficient" and x <= 1.0:
                raise ctx.fail("slow_coefficient must be above 1.0", "thresholds", key)
            if key != "slow_coefficient" and not 0.0 <= x <= 1.0:
                raise ctx.fail(f"{key} must lie in [0, 1]", "thresholds", key)
            values[key] = x
    return DeviceThresholds(**values)


def _example(ctx: _Ctx, raw: Any, nth: int) -> DeviceExample:
    t = "examples"
    if not isinstance(raw, dict):
        raise ctx.fail("each [[examples]] must be a table", t, None, nth)
    allowed = {"name", "device_p99_s", "peer_p99_s", "expect_verdict", "expect_cause", "window",
               "device_requests"}  # fmt: skip
    for key in raw:
        if key not in allowed:
            raise ctx.fail(f"unknown example key {key!r}", t, key, nth)
    for key in ("name", "device_p99_s", "peer_p99_s", "expect_verdict"):
        if key not in raw:
            raise ctx.fail(f"example needs {key!r}", t, None, nth)
    name = raw["name"]
    if not isinstance(name, str):
        raise ctx.fail("name must be a string", t, "name", nth)
    p99 = _num(ctx, raw["device_p99_s"], t, "device_p99_s", nth)
    peers = raw["peer_p99_s"]
    if not isinstance(peers, list):
        raise ctx.fail("peer_p99_s must be a list of numbers", t, "peer_p99_s", nth)
    peer_vals = tuple(_num(ctx, p, t, "peer_p99_s", nth) for p in peers)
    verdict = raw["expect_verdict"]
    if verdict not in VERDICTS:
        raise ctx.fail(f"expect_verdict must be one of {list(VERDICTS)}", t, "expect_verdict", nth)
    cause = raw.get("expect_cause")
    if cause is not None and cause not in CAUSES:
        raise ctx.fail(f"expect_cause must be one of {list(CAUSES)}", t, "expect_cause", nth)
    if verdict == "slow" and cause is None:
        raise ctx.fail("a slow example needs expect_cause", t, None, nth)
    window = raw.get("window", {})
    if not isinstance(window, dict):
        raise ctx.fail("window must be a table", t, "window", nth)
    for key, v in window.items():
        typ = WINDOW_KEYS.get(key)
        if typ is None:
            known = sorted(WINDOW_KEYS)
            raise ctx.fail(f"unknown window key {key!r}; known: {known}", t, "window", nth)
        bad_int = typ is int and (isinstance(v, bool) or not isinstance(v, int) or v < 0)
        if not isinstance(v, typ) or bad_int:
            raise ctx.fail(f"window.{key} must be a {typ.__name__} >= 0", t, "window", nth)
    requests = raw.get("device_requests", 1000)
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 0:
        raise ctx.fail("device_requests must be a non-negative integer", t, "device_requests", nth)
    return DeviceExample(
        name=name,
        line=_locate(ctx.text, t, None, nth),
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
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"line (\d+)", str(exc))
        raise DeviceRulesError(f"{path}:{m.group(1) if m else 1}: invalid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per nested array or table
        raise DeviceRulesError(f"{path}:1: invalid TOML: nested too deeply") from None
    for key in doc:
        if key not in ("engine", "thresholds", "examples"):
            raise ctx.fail(f"unknown top-level key {key!r}", None, key)
    engine = doc.get("engine")
    if isinstance(engine, bool) or not isinstance(engine, int):
        raise ctx.fail("engine (an integer engine version) is required", None, "engine")
    if engine > ENGINE_VERSION:
        raise ctx.fail(f"needs engine {engine}; this is engine {ENGINE_VERSION}", None, "engine")
    thresholds = _thresholds(ctx, doc.get("thresholds", {}))
    raw_examples = doc.get("examples", [])
    if not isinstance(raw_examples, list):
        raise ctx.fail("examples must be an array of tables", None, "examples")
    examples = tuple(_example(ctx, ex, i) for i, ex in enumerate(raw_examples))
    return DeviceRules(path=path, engine=engine, thresholds=thresholds, examples=examples)


def load_device_rules(path: str | Path | None = None) -> DeviceRules:
    """Load and validate a rule file (default: the shipped ``devices.toml``)."""
    p = Path(path) if path is not None else DEFAULT_PATH
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise DeviceRulesError(f"{p}:0: cannot read: {exc.strerror or exc}") from None
    return parse_device_rules(text, str(p))
