"""The device job in a real agent process, against the FAKE libnvidia-ml.so.1, with requests
sent through the real hooks (``infersight.hooks._request.request``) by a hooked child.

One agent run (module fixture) serves the integration tests: three fake devices (0 healthy,
1 thermally throttled and slow at the tail, 2 lost mid-run), an Xid on device 1.
The pure parts (config validation, the ``req`` handler, histograms, device mapping) are
tested in-process below.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import attr, hook_env, log_records, read_otlp_lines, wait_for

from infersight.agent.daemon import config as cfg
from infersight.agent.daemon.assemble import Malformed
from infersight.agent.devices.job import DeviceJob
from infersight.agent.devices.settings import load_thresholds, parse_config
from infersight.agent.requests.kind import DURATION, DURATION_BOUNDS, TTFT, RequestStats, parse_req
from infersight.latency import NvmlDevice, SeriesKey
from infersight.settings import Config, ConfigError
from infersight.telemetry import Resource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from devices_agent_runner import metric_points, start_agent, value  # noqa: E402
from fake_nvml.helpers import fake_env  # noqa: E402

UUID = "GPU-fa4e0000-0000-4000-8000-00000000000%d"
SCENARIO = """\
# FAKE NVML: 0 healthy, 1 thermally throttled (hw_thermal_slowdown), 2 lost mid-run
count 3
0 name FAKE NVIDIA H100 (fake_nvml)
1 name FAKE NVIDIA H100 (fake_nvml)
1 throttle 0x40
1 clk_sm 1200
2 name FAKE NVIDIA H100 (fake_nvml)
2 pcie_gen 3
2 lost_after 150
1 xid 48
"""
CHILD = textwrap.dedent(
    """
    import time
    from infersight import hooks
    from infersight.hooks._request import first_token, request

    for i in range(60):
        with request(device="cuda:0", model="llama-fake", input_len=16) as r:
            time.sleep(0.002)
            r.first_token()
            time.sleep(0.001)
        # cuda:1: the same median, a slow tail (3 of 60 requests)
        with request(device="cuda:1", model="llama-fake", input_len=16):
            time.sleep(0.002)
            first_token()
            time.sleep(0.25 if i % 20 == 19 else 0.001)  # (well past a loaded machine's scheduling delays)
    try:
        with request(device="cuda:0", model="llama-fake"):
            raise ValueError("bad input")
    except ValueError:
        pass
    print("flushed", hooks.flush(10))
    """
)


def device_logs(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in log_records(lines) if r.get("eventName") == "device" or attr(r, "infersight.device.event")
            or attr(r, "infersight.device.verdict")]  # fmt: skip


def body(r: dict[str, Any]) -> str:
    return str(r.get("body", {}).get("stringValue", ""))



def _done(out: Path) -> bool:
    if not out.exists():
        return False
    lines = read_otlp_lines(out)
    slow = [r for r in device_logs(lines) if attr(r, "infersight.device.verdict") == "slow"]
    lost = [p for p in metric_points(lines, "hw.status")
            if attr(p, "hw.id") == UUID % 2 and attr(p, "hw.state") == "failed" and value(p) == 1]  # fmt: skip
    xid = [r for r in device_logs(lines) if attr(r, "infersight.device.event") == "xid"]
    hist = [p for p in metric_points(lines, DURATION) if int(p["count"]) >= 60]
    return bool(slow and lost and xid and len(hist) >= 2)


@pytest.fixture(scope="module")
def run(fake_libdir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("devjob")
    cfg_file = root / "fake_nvml.cfg"
    cfg_file.write_text(SCENARIO)
    # 60 requests per device: below the shipped min_requests (100), so a rule file that asks for 20.
    rules = root / "devices.toml"
    rules.write_text('engine_version = "1.0"\n[thresholds]\nmin_requests = 20\n')
    extra = (f"[nvml]\ninterval_s = 0.1\n[devices]\nevaluate_interval_s = 0.5\nwindow_s = 120\n"
             f"rules = \"{rules}\"\n")
    agent = start_agent(root, fake_env(fake_libdir, cfg_file), extra)
    try:
        child = subprocess.run(
            [sys.executable, "-c", CHILD],
            env=hook_env(root / "agent.sock", root / "spool"),
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert child.returncode == 0, child.stderr
        assert "flushed True" in child.stdout, child.stdout + child.stderr
        out = root / "out.otlp.jsonl"
        ok = wait_for(lambda: _done(out), 60, 0.2)  # (a loaded CI machine took over 20 s once)
        from infersight.agent.commands.status import query_status

        status = query_status(str(root / "agent.sock"))
        cli = subprocess.run(
            [sys.executable, "-m", "infersight", "status", "--json", "--socket", str(root / "agent.sock")],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        text = subprocess.run([sys.executable, "-m", "infersight", "status", "--socket", str(root / "agent.sock")],
                              capture_output=True, text=True, timeout=30, check=False)
        t0 = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(20)
        stop_s = time.monotonic() - t0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(5)
    log = (root / "agent.log").read_text()
    assert ok, log
    return {
        "lines": read_otlp_lines(out), "status": status, "cli": cli, "text": text, "rc": rc, "stop_s": stop_s,
        "log": log,
    }  # fmt: skip


def test_device_metrics_carry_gpu_uuid(run: dict[str, Any]) -> None:
    util = metric_points(run["lines"], "hw.gpu.utilization")
    ids = {attr(p, "hw.id") for p in util}
    assert {UUID % 0, UUID % 1} <= ids
    p0 = next(p for p in util if attr(p, "hw.id") == UUID % 0)
    assert value(p0) == pytest.approx(0.5)
    assert attr(p0, "hw.type") == "gpu"
    assert attr(p0, "hw.name") == "FAKE NVIDIA H100 (fake_nvml)"
    assert metric_points(run["lines"], "hw.gpu.memory.limit")
    # a clean stop: the Xid watcher thread and the job ended with the agent
    assert run["rc"] == 0, run["log"]
    assert run["stop_s"] < 10


def test_throttled_device_reason_metrics(run: dict[str, Any]) -> None:
    thr = metric_points(run["lines"], "infersight.device.throttle")
    on = {(attr(p, "hw.id"), attr(p, "infersight.device.throttle.reason")) for p in thr if value(p) == 1}
    assert (UUID % 1, "hw_thermal_slowdown") in on
    assert not any(dev == UUID % 0 for dev, _ in on)


def test_lost_device_fails_with_a_device_event(run: dict[str, Any]) -> None:
    failed = [p for p in metric_points(run["lines"], "hw.status")
              if attr(p, "hw.id") == UUID % 2 and attr(p, "hw.state") == "failed" and value(p) == 1]  # fmt: skip
    assert failed
    lost = [r for r in device_logs(run["lines"]) if attr(r, "infersight.device.event") == "gpu_lost"]
    assert len(lost) == 1
    assert lost[0]["severityText"] == "ERROR"
    assert lost[0]["eventName"] == "device"
    assert attr(lost[0], "hw.id") == UUID % 2
    xid = [r for r in device_logs(run["lines"]) if attr(r, "infersight.device.event") == "xid"]
    assert int(attr(xid[0], "infersight.device.xid")) == 48
    assert attr(xid[0], "hw.id") == UUID % 1


def test_request_histograms_per_device(run: dict[str, Any]) -> None:
    pts = metric_points(run["lines"], DURATION)
    last: dict[tuple[Any, Any], dict[str, Any]] = {}
    for p in pts:  # cumulative: the last point of each series holds everything
        last[(attr(p, "hw.id"), attr(p, "error.type"))] = p
    d0, d1 = last[(UUID % 0, None)], last[(UUID % 1, None)]
    assert int(d0["count"]) == 60
    assert int(d1["count"]) == 60
    assert [float(b) for b in d0["explicitBounds"]] == list(DURATION_BOUNDS)
    assert sum(int(c) for c in d1["bucketCounts"]) == 60
    assert float(d1["max"]) >= 0.25
    assert attr(d0, "gen_ai.request.model") == "llama-fake"
    assert attr(d0, "infersight.model") == "llama-fake"
    assert attr(d0, "infersight.request.class") == "default"
    assert attr(d0, "hw.name") == "FAKE NVIDIA H100 (fake_nvml)"
    assert attr(d0, "infersight.device") == "cuda:0"
    assert int(last[(UUID % 0, "ValueError")]["count"]) == 1  # failed requests counted apart
    ttft = [p for p in metric_points(run["lines"], TTFT) if attr(p, "hw.id") == UUID % 1]
    assert int(ttft[-1]["count"]) == 60
    # the tail came after the first token: 3 requests slept 0.25 s and 57 slept 0.001 s after it
    assert float(d1["sum"]) - float(ttft[-1]["sum"]) >= 3 * 0.25 + 57 * 0.001


def test_slow_verdict_degrades_the_device(run: dict[str, Any]) -> None:
    slow = [r for r in device_logs(run["lines"]) if attr(r, "infersight.device.verdict") == "slow"]
    assert {attr(r, "hw.id") for r in slow} == {UUID % 1}
    ev = slow[0]
    assert ev["severityText"] == "WARN"
    assert ev["eventName"] == "device"
    assert attr(ev, "infersight.device.cause") == "thermal_throttling"
    assert attr(ev, "hw.state") == "degraded"
    assert attr(ev, "infersight.device.coefficient") > 1.2
    assert "thermal throttling" in body(ev)
    degraded = [p for p in metric_points(run["lines"], "hw.status")
                if attr(p, "hw.state") == "degraded" and value(p) == 1]  # fmt: skip
    assert {attr(p, "hw.id") for p in degraded} == {UUID % 1}
    coef = {attr(p, "hw.id"): value(p) for p in metric_points(run["lines"], "infersight.device.coefficient")}
    assert coef[UUID % 1] > 1.2
    assert coef[UUID % 0] < 1.0


def test_health_reports_nvml(run: dict[str, Any]) -> None:
    nv = run["status"]["nvml"]
    assert nv["available"] is True
    assert nv["devices"] == 3
    assert nv["driver_version"] == "0.0.fake"
    assert nv["slow_devices"] == [UUID % 1]
    assert nv["failed_devices"] == [UUID % 2]  # lost mid-run
    assert nv["degraded_devices"] == []
    assert json.loads(run["cli"].stdout)["nvml"]["reason"] is None
    # The text says which GPU fell off the bus and which is slow; the agent itself is healthy (exit 0).
    lines = run["text"].stdout.splitlines()
    assert "  devices FAILED (lost)  %s" % (UUID % 2) in lines, run["text"].stdout
    assert "  devices slow           %s" % (UUID % 1) in lines
    assert run["text"].returncode == 0 and "healthy" in lines[0]
    assert not metric_points(run["lines"], "infersight.nvml.available")  # only when unavailable


# -- in-process: configuration ---------------------------------------------------------------


def _conf(values: dict[str, Any]) -> Config:
    return Config(dict(values), {k: "f.toml:%d" % i for i, k in enumerate(values, 1)})


def test_config_defaults_and_env() -> None:
    c = parse_config(_conf({}), env={})
    assert (c.interval_s, c.enabled, c.rules, c.evaluate_interval_s) == (1.0, True, None, 10.0)
    c = parse_config(_conf({"nvml.interval_s": 2, "nvml.enabled": False}), env={"INFERSIGHT_NVML_INTERVAL_S": "0.5"})
    assert (c.interval_s, c.enabled) == (0.5, False)


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"nvml.interval_s": 0}, "nvml.interval_s"),
        ({"nvml.interval_s": "fast"}, "nvml.interval_s"),
        ({"nvml.interval_s": True}, "nvml.interval_s"),
        ({"nvml.enabled": "maybe"}, "nvml.enabled"),
        ({"devices.rules": 3}, "devices.rules"),
        ({"devices.window_s": -1}, "devices.window_s"),
        ({"nvml.intervall_s": 1}, "nvml.intervall_s"),
    ],
)
def test_bad_config_names_the_key(values: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as ei:
        parse_config(_conf(values), env={})
    assert "f.toml:1" in str(ei.value)


def test_bad_rule_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "devices.toml"
    bad.write_text("engine = 1\n[thresholds]\nslow_coefficient = 0.5\n")
    with pytest.raises(ConfigError, match=r"devices\.rules: .*devices\.toml:3"):
        load_thresholds(str(bad))
    assert load_thresholds(None).slow_coefficient == 1.2


def test_a_users_rule_file_is_checked_at_start_and_the_shipped_one_at_first_use(tmp_path: Path) -> None:
    from infersight.agent.devices.extension import DevicesExtension

    bad = tmp_path / "devices.toml"
    bad.write_text("engine = 1\n[thresholds]\nslow_coefficient = 0.5\n")
    with pytest.raises(ConfigError, match=r"devices\.rules: .*devices\.toml:3"):
        DevicesExtension(_conf({"devices.rules": str(bad)}), RequestStats(), env={})
    ext = DevicesExtension(_conf({}), RequestStats(), env={})
    assert ext.job.thresholds == load_thresholds(None)  # loaded now, at its first use
    assert ext.health()["nvml"]["slow_coefficient"] == 1.2


# -- in-process: the req handler -------------------------------------------------------------

REQ = {"d": "cuda:0", "m": "m", "n": 5, "c": None, "s": 1, "dur": 0.01, "ttft": None, "sp": None, "err": None}


@pytest.mark.parametrize(
    "bad",
    [
        {"dur": -1}, {"dur": "1"}, {"dur": math.inf}, {"dur": None}, {"s": -5}, {"s": 1.5},
        {"n": -1}, {"n": True}, {"d": 7}, {"sp": "XYZ"}, {"ttft": "x"}, {"h": "abc"}, {"m": ["x"]},
        {"ttft": 0.5},  # a first token 0.49 s after the 0.01 s request ended: impossible
    ],
)  # fmt: skip
def test_malformed_req(bad: dict[str, Any]) -> None:
    with pytest.raises(Malformed):
        parse_req({**REQ, **bad})


def test_a_first_token_at_the_requests_end_is_kept() -> None:
    assert parse_req({**REQ, "ttft": 0.01}).ttft_s == 0.01
    assert parse_req({**REQ, "ttft": 0.0105}).ttft_s == 0.0105  # within clock rounding


def test_histogram_buckets_are_cumulative_and_bounded() -> None:
    rs = RequestStats()
    res = Resource.of({"service.name": "s"})
    for dur in (0.001, 0.0011, 0.5, 100.0):
        rs.record("p", res, parse_req({**REQ, "dur": dur}), 10**18)
    (item,) = rs.collect()
    (pt,) = item.points
    assert (item.kind, item.unit) == ("histogram", "s")
    assert pt.count == 4
    assert pt.bucket_counts[0] == 1  # 0.001 sits in (-inf, 0.001]
    assert (pt.bucket_counts[1], pt.bucket_counts[-1]) == (1, 1)
    assert (pt.min, pt.max) == (0.001, 100.0)
    assert rs.collect() == []  # nothing changed since
    rs.record("p", res, parse_req({**REQ, "dur": 0.002}), 10**18)
    (item2,) = rs.collect()
    assert item2.points[0].count == 5  # cumulative
    assert pt.count == 4  # published points are snapshots, not shared state
    assert len(rs.collect(everything=True)) == 1


def test_device_mapping_through_visible_devices() -> None:
    rs = RequestStats()
    rs.set_devices([NvmlDevice(i, UUID % i, "G") for i in range(3)])
    ev = parse_req({**REQ, "d": "cuda:0", "vis": "2,0"})
    assert rs.resolve(ev) == (UUID % 2, "G")
    ev = parse_req({**REQ, "d": "cuda:1", "vis": "GPU-fa4e0000-0000-4000-8000-000000000001"})
    assert rs.resolve(ev) == (None, None)  # ordinal past the list
    ev = parse_req({**REQ, "d": "cuda:0", "vis": "GPU-fa4e0000-0000-4000-8000-000000000001"})
    assert rs.resolve(ev) == (UUID % 1, "G")
    assert rs.resolve(parse_req({**REQ, "d": "cuda:0", "vis": "MIG-1234"})) == (None, None)
    assert rs.resolve(parse_req({**REQ, "d": "cuda:2"})) == (UUID % 2, "G")
    assert rs.resolve(parse_req({**REQ, "d": "cpu"})) == (None, None)
    hooked = parse_req({**REQ, "d": "cuda:0", "h": "GPU-abc", "hn": "H200"})
    assert rs.resolve(hooked) == (None, None)  # a hw.id NVML does not list is not believed
    listed = parse_req({**REQ, "d": "cuda:0", "h": UUID % 1, "hn": "H200"})
    assert rs.resolve(listed) == (UUID % 1, "G")  # NVML's name, not the hook's
    assert RequestStats().resolve(hooked) == ("GPU-abc", "H200")  # without NVML, the hook's word


def test_failed_requests_stay_out_of_the_window() -> None:
    rs = RequestStats()
    res = Resource.of({})
    rs.record("p", res, parse_req({**REQ, "d": "cpu", "err": "ValueError"}), 10**18)
    rs.record("p", res, parse_req({**REQ, "d": "cpu"}), 10**18)
    (s,) = rs.window.stats(10**9)
    assert s.key == SeriesKey("cpu", "m", "default", "cpu")
    assert s.count == 1


async def test_job_without_nvml_in_process() -> None:
    """nvml.enabled = false: the reason is set once, ticks still publish request histograms,
    and the job's close publishes the health metric that says why."""

    class _Agent:
        resource = Resource.of({"service.name": "a"})

        def __init__(self) -> None:
            self.published: list[Any] = []
            self.broadcaster = self

        def publish(self, items: Any) -> None:
            self.published += items

    agent = _Agent()
    requests = RequestStats()
    job = DeviceJob(enabled=False, interval_s=0.05, evaluate_interval_s=0.1, requests=requests)
    requests.record("p", agent.resource, parse_req({**REQ, "d": "cpu"}), 10**18)
    import asyncio

    task = asyncio.create_task(job.run(agent))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert job.unavailable_reason == "disabled by configuration (nvml.enabled = false)"
    assert job.health()["reason"] == job.unavailable_reason
    assert any(getattr(i, "name", "") == DURATION for i in agent.published)
    (health,) = [i for i in agent.published if getattr(i, "name", "") == "infersight.nvml.available"]
    assert [(p.value, p.attributes) for p in health.points] == [
        (0, {"infersight.nvml.reason": job.unavailable_reason})]


def test_hook_request_is_inert_without_hooks() -> None:
    from infersight.hooks import _request

    calls = []

    @_request.request(device="cuda:0", model="m")
    def f(x: int) -> int:
        _request.first_token()
        calls.append(x)
        return x * 2

    assert f(3) == 6
    with _request.request(device=1) as r:
        r.first_token()
    assert calls == [3]
    assert _request._device_name(1) == "cuda:1"
    assert _request._device_name("cpu") == "cpu"
    assert _request._device_name(None) is None


def test_hook_resolves_hw_id_only_when_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from infersight.hooks import _request, _state

    state = {"init": False, "calls": 0}

    def props(i: int) -> SimpleNamespace:
        state["calls"] += 1
        return SimpleNamespace(uuid="1b2c3d4e-0000-4000-8000-00000000000%d" % i, name="NVIDIA H200")

    cuda = SimpleNamespace(is_initialized=lambda: state["init"], get_device_properties=props, current_device=lambda: 1)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(_state.current.requests, "hw_cache", {})
    assert _request._hw("cuda:1") is None  # CUDA not initialised: the hook never initialises it
    assert state["calls"] == 0
    state["init"] = True
    assert _request._hw("cuda:1") == ("GPU-1b2c3d4e-0000-4000-8000-000000000001", "NVIDIA H200")
    assert _request._hw("cuda:1") is not None
    assert state["calls"] == 1  # cached per device index
    assert _request._hw("cpu") is None
    assert _request._device_name("cuda") == "cuda:1"
    assert _request._device_name(SimpleNamespace(type="cuda", index=0)) == "cuda:0"


def test_the_extension_wires_the_agent_and_reloads_rules(tmp_path: Path) -> None:
    from infersight.agent.daemon.lifecycle import Agent
    from infersight.agent.devices.extension import DevicesExtension
    from infersight.agent.requests.extension import RequestsExtension

    rules = tmp_path / "devices.toml"
    rules.write_text("engine = 1\n[thresholds]\nslow_coefficient = 1.5\n")
    conf_file = tmp_path / "infersight.toml"
    base = f'[agent]\nsocket = "{tmp_path / "a.sock"}"\nspool_dir = "{tmp_path / "spool"}"\n'
    conf_file.write_text(base + f'[devices]\nrules = "{rules}"\n[nvml]\nenabled = false\n')
    conf = cfg.load(str(conf_file), env={})
    assert parse_config(conf, env={}).enabled is False
    requests = RequestsExtension.from_config(conf, env={})
    devices = DevicesExtension(conf, requests.stats, env={})
    agent = Agent(conf, [], [requests, devices])
    job = devices.job
    assert agent.assembler.handlers["req"] == requests.stats.handle
    assert devices in agent.extensions  # the agent runs the job (start) and closes it (shutdown)
    assert job.requests is requests.stats
    assert job.thresholds.slow_coefficient == 1.5
    assert agent.health()["nvml"]["reason"] == "disabled by configuration (nvml.enabled = false)"
    assert agent.ingest.health()["nvml"]["available"] is False
    rules.write_text("engine = 1\n[thresholds]\nslow_coefficient = 0.5\n")
    assert agent.reload() is False  # a bad rule file keeps the running thresholds
    assert job.thresholds.slow_coefficient == 1.5
    rules.write_text("engine = 1\n[thresholds]\nslow_coefficient = 1.3\n")
    assert agent.reload() is True
    assert job.thresholds.slow_coefficient == 1.3
    conf_file.write_text(base + "[nvml]\ninterval_s = 0\n")
    with pytest.raises(ConfigError, match=r"infersight\.toml:\d+: bad value for nvml\.interval_s"):
        DevicesExtension(cfg.load(str(conf_file), env={}), RequestStats(), env={})  # what the CLI builds


@pytest.mark.parametrize(
    ("section", "why"),
    [
        ("[nvml]\ninterval_s = 0\n", "bad value for nvml.interval_s: 0 (expected a number of seconds in [0.05, 3600])"),
        ("[devices]\nwindw_s = 60\n", "unknown key 'devices.windw_s' (did you mean 'devices.window_s'?)"),
    ],
)
def test_a_reload_refused_for_a_devices_key_logs_file_line_and_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, section: str, why: str
) -> None:
    """The devices keys go through the key tables: a reload refused for one of them logs the
    error as the config's own errors are logged (file:line: why), not as a crash (no class name)."""
    import logging

    from infersight.agent.daemon.lifecycle import Agent
    from infersight.agent.devices.extension import DevicesExtension
    from infersight.agent.requests.extension import RequestsExtension

    conf_file = tmp_path / "infersight.toml"
    base = f'[agent]\nsocket = "{tmp_path / "a.sock"}"\nspool_dir = "{tmp_path / "spool"}"\n'
    conf_file.write_text(base + "[nvml]\nenabled = false\n")
    conf = cfg.load(str(conf_file), env={})
    requests = RequestsExtension.from_config(conf, env={})
    agent = Agent(conf, [], [requests, DevicesExtension(conf, requests.stats, env={})])
    conf_file.write_text(base + section)
    with caplog.at_level(logging.ERROR, logger="infersight.agent"):
        assert agent.reload() is False
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert logged == ["reload failed, keeping the running configuration: %s:5: %s" % (conf_file, why)]
    assert agent.last_reload_error == "%s:5: %s" % (conf_file, why)
    assert agent.config is conf
