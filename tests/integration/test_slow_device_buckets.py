"""The fleet slow-device alert judges P99s that Prometheus interpolates within the agent's request-duration
buckets (``DURATION_BOUNDS``). With the semconv's doubling bounds alone it was decided by where the P99s fell
between two edges: a GPU 1.4x slower on every request scored 1.04 (no alert), one 1.1x slower scored 1.57
(``InfersightSlowDevice`` fired). Lognormal traffic (sigma 0.25) bucketed into the agent's own bounds, through
the shipped rules with promtool, and the resolution the docs state, over every position between two edges."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest

from infersight.agent.requests.kind import DURATION_BOUNDS

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "exporters" / "prometheus"
PROMTOOL = shutil.which("promtool")
SIGMA = 0.25
Z99 = 2.3263478740408408  # the standard normal's 0.99 quantile
PER_MINUTE = 1200  # requests a minute per device
# Bounds the fleet's queries and dashboards were written against: they stay (semconv's 0.01 * 2^k among them).
EARLIER = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96,
           81.92)


def _cdf(x: float, median: float) -> float:
    return 0.5 * (1 + math.erf(math.log(x / median) / (SIGMA * math.sqrt(2))))


def _median_of_p99(p99: float) -> float:
    return p99 / math.exp(Z99 * SIGMA)


def _prom_quantile(q: float, bounds: tuple[float, ...], cumulative: list[float], total: float) -> float:
    """Prometheus's histogram_quantile over classic buckets (linear within the bucket; +Inf: the last bound)."""
    rank = q * total
    edges = [*bounds, math.inf]
    counts = [*cumulative, total]
    b = next(i for i, c in enumerate(counts) if c >= rank)
    if b == len(edges) - 1:
        return bounds[-1]
    start = edges[b - 1] if b else 0.0
    below = counts[b - 1] if b else 0.0
    return start + (edges[b] - start) * (rank - below) / (counts[b] - below)


def _estimated_p99(true_p99: float) -> float:
    median = _median_of_p99(true_p99)
    return _prom_quantile(0.99, DURATION_BOUNDS, [_cdf(b, median) for b in DURATION_BOUNDS], 1.0)


def test_the_bounds_keep_the_earlier_ones_and_are_a_quarter_octave_apart() -> None:
    assert set(EARLIER) <= set(DURATION_BOUNDS)
    assert list(DURATION_BOUNDS) == sorted(set(DURATION_BOUNDS))
    assert len(DURATION_BOUNDS) == 66  # 67 buckets: 69 Prometheus series a histogram (docs/requests.md)
    ratios = [b / a for a, b in zip(DURATION_BOUNDS, DURATION_BOUNDS[1:], strict=False)]
    assert max(ratios) <= 1.25
    assert max(ratios[5:]) < 2 ** 0.25 * 1.01  # from 2.5 ms up: 2^(1/4), rounded to 3 digits


@pytest.mark.parametrize(("ratio", "low", "high"), [(1.1, 1.05, 1.15), (1.2, 1.18, 1.23), (1.4, 1.37, 1.42)])
def test_the_bucket_estimated_coefficient_of_a_slower_device(ratio: float, low: float, high: float) -> None:
    """Wherever the two P99s fall between two edges (true P99 2 ms to 30 s), the ratio of the interpolated P99s
    stays within the range docs/prometheus.md states: a device 1.1x slower never reaches the 1.2 threshold, one
    1.4x slower always passes it, one 1.2x slower may read either side of it (within bucket error)."""
    seen = []
    for i in range(1400):
        p99 = 0.002 * 2 ** (i / 100)
        seen.append(_estimated_p99(p99 * ratio) / _estimated_p99(p99))
    assert low < min(seen) and max(seen) < high, (min(seen), max(seen))


def _series(host: str, model: str, true_p99: float) -> list[str]:
    median = _median_of_p99(true_p99)
    labels = ('host_name="%s",hw_id="GPU-%s",hw_name="FAKE H100",infersight_model="%s",'
              'infersight_request_class="chat"' % (host, host, model))
    out = []
    for b in DURATION_BOUNDS:
        n = round(PER_MINUTE * _cdf(b, median))
        out.append("      - series: 'infersight_request_duration_seconds_bucket{%s,le=\"%r\"}'\n"
                   "        values: '0+%dx30'" % (labels, b, n))
    out.append("      - series: 'infersight_request_duration_seconds_bucket{%s,le=\"+Inf\"}'\n"
               "        values: '0+%dx30'" % (labels, PER_MINUTE))
    out.append("      - series: 'infersight_request_duration_seconds_count{%s}'\n"
               "        values: '0+%dx30'" % (labels, PER_MINUTE))
    return out


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_the_fleet_alert_follows_the_slowdown_not_the_bucket_edges(tmp_path: Path) -> None:
    """FAKE fleet, four GPUs a group, every request of one GPU slower by a factor:
    h1..h3 P99 26.8 ms, h4 1.4x slower (37.5 ms): InfersightSlowDevice for h4 only;
    k1..k3 P99 39.4 ms, k4 1.1x slower (43.3 ms): no alert (slow_coefficient 1.2)."""
    series: list[str] = []
    for i in range(1, 5):
        series += _series("h%d" % i, "model-h", 0.0375 if i == 4 else 0.0268)
        series += _series("k%d" % i, "model-k", 0.0433 if i == 4 else 0.0394)
    text = "\n".join([
        "rule_files:",
        "  - %s" % (RULES / "recording.yml"),
        "  - %s" % (RULES / "alerts.yml"),
        "evaluation_interval: 1m",
        "tests:",
        "  - interval: 1m",
        "    input_series:",
        *series,
        "    promql_expr_test:",
        "      - expr: count by (host_name) (device:infersight_request_duration_seconds:p99_coefficient_5m > 1.3)",
        "        eval_time: 20m",
        "        exp_samples:",
        "          - labels: '{host_name=\"h4\"}'",
        "            value: 1",
        "      - expr: count(device:infersight_request_duration_seconds:p99_coefficient_5m"
        "{infersight_model=\"model-k\"} < 1.15)",
        "        eval_time: 20m",
        "        exp_samples:",
        "          - labels: '{}'",
        "            value: 4",
        "    alert_rule_test:",
        "      - eval_time: 20m",
        "        alertname: InfersightSlowDevice",
        "        exp_alerts:",
        "          - exp_labels:",
        "              severity: warning",
        "              host_name: h4",
        "              hw_id: GPU-h4",
        "              hw_name: FAKE H100",
        "              infersight_model: model-h",
        "              infersight_request_class: chat",
        "            exp_annotations:",
        "              summary: 'Slow device GPU-h4 on h4'",
        "              description: 'FAKE H100 GPU-h4 on h4 serves model-h (chat) with a P99 1.40x the median P99 of"
        " its peers. Look at its throttle reasons, PCIe link and ECC counters (InfersightGpuThrottling,"
        " InfersightPcieLinkDegraded).'",
        "",
    ])
    (tmp_path / "buckets.yml").write_text(text)
    r = subprocess.run([PROMTOOL, "test", "rules", "buckets.yml"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
