"""The shipped Prometheus rules: `promtool check rules` and `promtool test rules` (Debian's prometheus)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "exporters" / "prometheus"
FIXTURES = ROOT / "tests" / "support" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")

EXPECTED_ALERTS = {
    "InfersightSlowDevice",
    "InfersightGpuThrottling",
    "InfersightPcieLinkDegraded",
    "InfersightGpuLost",
    "InfersightGpuEccDegraded",
    "InfersightAgentLosingEvents",
    "InfersightColdStartRegression",
    "InfersightColdStartSlowWeights",
}


def _rule_files() -> list[Path]:
    return sorted(RULES.glob("*.yml"))


def _fixtures() -> list[Path]:
    return sorted(FIXTURES.glob("*.yml"))


def _promtool(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_rule_files_are_shipped_as_package_data() -> None:
    from infersight.exporters.prometheus_endpoint import shipped_rule_files

    names = sorted(p.name for p in shipped_rule_files())
    assert names == ["alerts.yml", "coldstart.yml", "recording.yml"]
    assert {p.name for p in _rule_files()} == set(names)


@needs_promtool
def test_promtool_check_rules() -> None:
    files = _rule_files()
    r = _promtool("check", "rules", *files)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == len(files)


@needs_promtool
def test_promtool_test_rules() -> None:
    fixtures = _fixtures()
    assert fixtures
    r = _promtool("test", "rules", *fixtures)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == len(fixtures)


@needs_promtool
def test_promtool_test_rules_catches_a_wrong_expectation(tmp_path: Path) -> None:
    """The fixtures are live: flip one expectation and promtool must fail."""
    text = (FIXTURES / "devices.yml").read_text()
    text = text.replace("../../exporters/prometheus/", str(RULES) + "/")
    broken = text.replace(
        "hw_id: GPU-b\n              hw_name: NVIDIA H100\n              hw_state: failed",
        "hw_id: GPU-a\n              hw_name: NVIDIA H100\n              hw_state: failed",
    )
    assert broken != text
    (tmp_path / "broken.yml").write_text(broken)
    r = _promtool("test", "rules", tmp_path / "broken.yml", cwd=tmp_path)
    assert r.returncode != 0


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    yaml = pytest.importorskip("yaml")
    shipped: set[str] = set()
    for f in _rule_files():
        for g in yaml.safe_load(f.read_text())["groups"]:
            shipped |= {r["alert"] for r in g["rules"] if "alert" in r}
    assert shipped == EXPECTED_ALERTS
    fires: set[str] = set()
    silent: set[str] = set()
    for f in _fixtures():
        doc = yaml.safe_load(f.read_text())
        for t in doc["tests"]:
            for case in t.get("alert_rule_test", []):
                (fires if case.get("exp_alerts") else silent).add(case["alertname"])
    assert fires == EXPECTED_ALERTS, "alerts without a firing case: %s" % (EXPECTED_ALERTS - fires)
    assert silent == EXPECTED_ALERTS, "alerts without a silent case: %s" % (EXPECTED_ALERTS - silent)


def test_rules_use_the_exported_names() -> None:
    """Every raw metric the rules read is a name the exporter produces from our declared metrics."""
    import importlib

    from metric_modules import DECLARING

    from infersight.metricspec import REGISTRY, prometheus_name

    for module in DECLARING:
        importlib.import_module(module)
    text = "\n".join(p.read_text() for p in _rule_files())
    produced = {
        prometheus_name(s) + suffix
        for s in REGISTRY
        for suffix in (("_bucket", "_count", "_sum") if s.kind == "histogram" else ("",))
    }
    exprs = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    used = set(re.findall(r"\b((?:hw|infersight|gen_ai)_[a-z0-9_]+)\s*(?:\{|\[|\)|\s|<|$)", exprs))
    used = {
        u
        for u in used
        if not u.startswith(
            (
                "infersight_model",
                "infersight_request_class",
                "infersight_device_throttle_reason",
                "hw_name",
                "hw_id",
                "hw_state",
                "hw_type",
                "hw_gpu_task",
                "infersight_stage",
                "infersight_weights_cache",
            )
        )
    }
    assert used, "no metric names found"
    assert used <= produced, used - produced


@needs_promtool
def test_coldstart_regression_min_count_is_what_keeps_a_rare_slow_start_silent(tmp_path: Path) -> None:
    """Drop the minimum count (20 cold starts in the hour) and the fixture's rare service pages."""
    (tmp_path / "exporters" / "prometheus").mkdir(parents=True)
    (tmp_path / "tests" / "support" / "prometheus" / "rules").mkdir(parents=True)
    rules = (RULES / "coldstart.yml").read_text()
    assert rules.count(">= 20") == 1
    (tmp_path / "exporters" / "prometheus" / "coldstart.yml").write_text(rules.replace(">= 20", ">= 1"))
    for rel in ("coldstart.yml", "rules/coldstart_floor.yml"):
        (tmp_path / "tests" / "support" / "prometheus" / rel).write_text((FIXTURES / rel).read_text())
    r = _promtool("test", "rules", "coldstart.yml", cwd=tmp_path / "tests" / "support" / "prometheus")
    assert r.returncode != 0
    assert 'service_name="rare"' in r.stdout + r.stderr


def test_fleet_p99_needs_as_many_requests_as_the_agents_verdicts() -> None:
    """The per-device P50/P99 rules keep devices with min_requests (rules/devices.toml) requests
    in their 5 m window, as the agent does: below it a P99 is the slowest request or two, and the
    fleet alert paged on it (the rules said 20 after the agent had moved to 100)."""
    from infersight.rules.device_rules import load_device_rules

    floors = re.findall(r"_count:rate5m \* 300 >= (\d+)\)", (RULES / "recording.yml").read_text())
    assert len(floors) == 2  # P50 and P99
    assert {int(f) for f in floors} == {load_device_rules().thresholds.min_requests}
