"""The shipped Grafana dashboard (exporters/prometheus/grafana/infersight.json): every panel's
query runs against a real Prometheus (Debian's ``prometheus``) that scraped a real agent, and
returns data.

FAKE NVML: two fake GPUs (tests/support/fake_nvml, a C libnvidia-ml.so.1 driving nvidia-ml-py's real
bindings); GPU 1 is thermally throttled, trained at x8 and has corrected ECC errors. The rest is
real: hooked processes (two cold starts that load weights with torch, each from a file evicted
from the page cache, a server that listens, times requests on both GPUs and reports OOMs), the
agent with its Prometheus endpoint and routing hints, and measuring its state directory's
storage ceiling at start (a fresh cache, nothing seeded), Prometheus with the shipped rule files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, hook_env, wait_for
from devices_agent_runner import start_agent
from fake_nvml.helpers import build_fake_nvml, fake_env

from infersight.agent.coldstart import storage_ceiling
from infersight.agent.commands.pagecache import evict

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "exporters" / "prometheus" / "grafana" / "infersight.json"
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")

SCENARIO = """\
# FAKE NVML: 0 healthy; 1 thermally throttled, PCIe x8 of x16, corrected ECC errors
count 2
0 name FAKE NVIDIA H100 (fake_nvml)
1 name FAKE NVIDIA H100 (fake_nvml)
1 throttle 0x40
1 clk_sm 1200
1 pcie_width 8
1 ecc_corr 3
"""
COLD_START = textwrap.dedent("""
    import sys, torch
    from infersight import hooks
    state = torch.load(sys.argv[1])
    hooks.mark_ready()
    hooks.flush(10)
""")
SERVER = textwrap.dedent("""
    import socket, time
    from infersight import hooks
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)  # readiness, with server.port: a routing instance

    class OutOfMemoryError(RuntimeError):
        pass

    OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; 79.15 GiB total capacity; "
           "77.50 GiB already allocated; 1.06 GiB free; 77.90 GiB reserved in total by PyTorch)")
    i = 0
    while True:
        for dev, extra in (("cuda:0", 0.0), ("cuda:1", 0.004 if i % 10 == 9 else 0.0)):
            with hooks.request(device=dev, model="fake-llm"):
                time.sleep(0.002 + extra)
        if i % 25 == 0:
            try:
                raise OutOfMemoryError(OOM)
            except OutOfMemoryError:
                hooks.report_oom()
        i += 1
        time.sleep(0.01)
""")
# Grafana's built-in variables and the dashboard's own, as a user with "All" selected sees them.
SUBSTITUTIONS = {"$__rate_interval": "1m", "$__range": "10m", "$service": ".*", "$hw_id": ".*"}


def targets() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def expand(expr: str) -> str:
    for k, v in SUBSTITUTIONS.items():
        expr = expr.replace(k, v)
    assert "$" not in expr, expr
    return expr


def test_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "infersight-overview"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"] for p in panels)
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"service", "hw_id"} <= names
    text = DASHBOARD.read_text()
    for metric in ("infersight_coldstart_duration_seconds_bucket", "infersight_oom_count_total",
                   "infersight_request_duration_seconds_bucket", "infersight_device_throttle", "hw_errors_total",
                   "infersight_device_pcie_link_width", "infersight_routing_weight_ratio",
                   "infersight_instance_settled", "service:infersight_coldstart_seconds:p95_1d",
                   "infersight_storage_ceiling_bytes_per_second", "infersight_coldstart_weights_ceiling_ratio_bucket"):
        assert metric in text, metric


class Prometheus:
    def __init__(self, root: Path, scrape_port: int) -> None:
        self.port = free_port()
        rules = sorted(str(p) for p in (ROOT / "exporters" / "prometheus").glob("*.yml"))
        cfg = root / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "rule_files:\n" + "".join("  - %s\n" % r for r in rules)
            + "scrape_configs:\n  - job_name: infersight\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{scrape_port}']\n"
        )
        assert PROMETHEUS is not None
        self.proc = subprocess.Popen(
            [PROMETHEUS, "--config.file=%s" % cfg, "--storage.tsdb.path=%s" % (root / "tsdb"),
             "--web.listen-address=127.0.0.1:%d" % self.port, "--log.level=warn"],
            stdout=open(root / "prometheus.log", "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
        )

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/-/ready" % self.port, timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = "http://127.0.0.1:%d/api/v1/query?%s" % (self.port, urllib.parse.urlencode({"query": expr}))
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def label_values(self, label: str, metric: str) -> list[str]:
        url = "http://127.0.0.1:%d/api/v1/label/%s/values?%s" % (
            self.port, label, urllib.parse.urlencode({"match[]": metric}))
        with urllib.request.urlopen(url, timeout=10) as r:
            values: list[str] = json.load(r)["data"]
        return values

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[dict[str, Any]]:
    try:
        libdir = build_fake_nvml(tmp_path / "fake_nvml")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    cfg = tmp_path / "fake_nvml.cfg"
    cfg.write_text(SCENARIO)
    prom_port = free_port()
    extra = ("[nvml]\ninterval_s = 0.2\n[devices]\nevaluate_interval_s = 0.5\nwindow_s = 120\n"
             f"[exporters.prometheus]\nenabled = true\nport = {prom_port}\n"
             "[routing]\nenabled = true\nagent_check_port = 0\n")
    # The agent's own ceiling cache, empty: it measures its state directory's device (the
    # weights file's too) at start, as in production (INFERSIGHT_MEASURE_STORAGE is on by default).
    agent_env = {**fake_env(libdir, cfg), "XDG_CACHE_HOME": str(tmp_path / "agent-cache")}
    agent = start_agent(tmp_path, agent_env, extra, agent_keys='state_dir = "%s"\n' % (tmp_path / "state"))
    prom = Prometheus(tmp_path, prom_port)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield {"root": tmp_path, "agent": agent, "prom": prom, "procs": procs}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        prom.close()
        agent.terminate()
        agent.wait(20)


def test_every_panel_query_returns_data_from_a_real_prometheus(stack: dict[str, Any]) -> None:
    root: Path = stack["root"]
    prom: Prometheus = stack["prom"]
    sock, spool = root / "agent.sock", root / "spool"
    assert wait_for(prom.ready, 60), (root / "prometheus.log").read_text()
    # The agent measured its state directory's device: the ceiling is scraped before any load.
    ceiling = "infersight_storage_ceiling_bytes_per_second"
    assert wait_for(lambda: prom.query(ceiling), 120), (root / "agent.log").read_text()
    weights = root / "weights.pt"
    subprocess.run([sys.executable, "-c", "import sys, torch; torch.save({'w': torch.zeros(512, 1024)}, sys.argv[1])",
                    str(weights)], check=True, timeout=120)
    script = root / "coldstart.py"
    script.write_text(COLD_START)
    # The hooks' own ceiling cache is empty: each file's ceiling ratio is the agent's figure.
    env = hook_env(sock, spool, OTEL_SERVICE_NAME="grafana-llm", XDG_CACHE_HOME=str(root / "hooks-cache"))

    def cold_start() -> None:
        ev = evict([str(weights)])
        assert ev.files == 1 and not ev.still_resident, ev  # the load reads from the disk
        assert subprocess.run([sys.executable, str(script), str(weights)], env=env, timeout=120).returncode == 0

    cold_start()
    # Rates need two samples that differ: the second cold start comes once the first was scraped.
    assert wait_for(lambda: prom.query('infersight_coldstart_duration_seconds_count{service_name="grafana-llm"}'), 60)
    cold_start()
    server = root / "server.py"
    server.write_text(SERVER)
    stack["procs"].append(subprocess.Popen([sys.executable, str(server)],
                                           env=hook_env(sock, spool, OTEL_SERVICE_NAME="grafana-llm")))

    empty: dict[str, str] = {}

    def all_return_data() -> bool:
        empty.clear()
        for title, expr in targets():
            if not prom.query(expand(expr)):
                empty[title] = expr
        return not empty

    assert wait_for(all_return_data, 120, 1.0), "panels without data:\n" + "\n".join(
        "%s: %s" % kv for kv in empty.items())
    for var in json.loads(DASHBOARD.read_text())["templating"]["list"]:  # label_values(metric, label)
        if var["type"] == "query":
            metric, label = var["query"]["query"].removeprefix("label_values(").rstrip(")").split(", ")
            assert prom.label_values(label, metric), var["name"]
    # The figures are the scenario's, not just any series.
    throttled = prom.query(expand(next(e for t, e in targets() if t == "Throttling reasons")))
    assert {r["metric"]["hw_id"] for r in throttled} == {"GPU-fa4e0000-0000-4000-8000-000000000001"}
    widths = {r["metric"]["hw_id"][-1]: float(r["value"][1])
              for r in prom.query('max by (hw_id) (infersight_device_pcie_link_width)')}
    assert widths == {"0": 16.0, "1": 8.0}
    ooms = prom.query('sum by (infersight_oom_class) (infersight_oom_count_total)')
    assert ooms and all(float(r["value"][1]) >= 1 for r in ooms)
    # The ceiling is the agent's measurement of the device the weights are on, labelled by its
    # block device name (or major:minor), and both cold starts were compared with it.
    key = storage_ceiling.device_key(str(weights))
    measured = storage_ceiling.load_cache(str(root / "agent-cache" / "infersight" / "storage_ceiling.json"))
    (point,) = prom.query('%s{infersight_storage_device="%s"}' % (ceiling, storage_ceiling.device_label(key)))
    assert point["metric"]["service_name"] == "infersight-agent"
    assert float(point["value"][1]) == pytest.approx(float(measured[key]["bytes_per_s"]))
    (ratios,) = prom.query('infersight_coldstart_weights_ceiling_ratio_count{service_name="grafana-llm"}')
    assert float(ratios["value"][1]) == 2
