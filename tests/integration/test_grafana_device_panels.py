"""The Grafana dashboard's per-device panels show devices only: requests timed with no device (the ASGI/WSGI
middleware's HTTP requests, ``infersight_device="unknown"``, no ``hw_id``) and unresolved devices' coefficients
(``infersight_device="cuda:0"``, no ``hw_id``) drew a series with an empty ``hw_id``. Each panel query that reads
the request histograms or the coefficient runs in promtool over such series."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "exporters" / "prometheus" / "grafana" / "infersight.json"
PROMTOOL = shutil.which("promtool")
SUBSTITUTIONS = {"$__rate_interval": "5m", "$__range": "10m", "$service": ".*", "$hw_id": ".*"}
GPU = "GPU-fa4e0000-0000-4000-8000-000000000001"  # a FAKE GPU


def _panel_queries() -> list[tuple[str, str]]:
    def walk(panels: list[dict[str, object]]) -> list[dict[str, object]]:
        out = []
        for p in panels:
            out.append(p)
            out += walk(p.get("panels", []))  # type: ignore[arg-type]
        return out

    found = []
    for p in walk(json.loads(DASHBOARD.read_text())["panels"]):
        for t in p.get("targets", []):  # type: ignore[attr-defined]
            expr = t["expr"]
            if "infersight_request_duration_seconds_bucket" in expr or "infersight_device_coefficient_ratio" in expr:
                for k, v in SUBSTITUTIONS.items():
                    expr = expr.replace(k, v)
                found.append((str(p["title"]), expr))
    return found


def _series() -> list[str]:
    out = []
    for labels in ('host_name="a",hw_id="%s",hw_name="FAKE H100",infersight_device="cuda:0",infersight_model="m",'
                   'infersight_request_class="default"' % GPU,
                   'host_name="a",infersight_device="unknown",infersight_request_class="http"'):
        for le, n in (("0.05", 30), ("0.1", 60), ("+Inf", 60)):
            out.append("      - series: 'infersight_request_duration_seconds_bucket{%s,le=\"%s\"}'\n"
                       "        values: '0+%dx30'" % (labels, le, n))
    for labels in ('host_name="a",hw_id="%s",hw_name="FAKE H100",infersight_model="m"' % GPU,
                   'host_name="a",infersight_device="cuda:1",infersight_model="m"'):
        out.append("      - series: 'infersight_device_coefficient_ratio{%s}'\n        values: '1+0x30'" % labels)
    return out


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_per_device_panels_show_devices_only(tmp_path: Path) -> None:
    queries = _panel_queries()
    assert len(queries) >= 3  # request P50, request P99, coefficient
    cases = []
    for _title, expr in queries:
        cases += [
            "      - expr: 'count by (hw_id) (%s)'" % expr.replace("'", "''"),
            "        eval_time: 20m",
            "        exp_samples:",
            "          - labels: '{hw_id=\"%s\"}'" % GPU,
            "            value: 1",
        ]
    text = "\n".join(["rule_files: []", "evaluation_interval: 1m", "tests:", "  - interval: 1m",
                      "    input_series:", *_series(), "    promql_expr_test:", *cases, ""])
    (tmp_path / "panels.yml").write_text(text)
    r = subprocess.run([PROMTOOL, "test", "rules", "panels.yml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
