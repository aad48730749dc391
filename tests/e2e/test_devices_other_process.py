"""A slow device shared with another process: a real agent against the FAKE libnvidia-ml.so.1 and a
FAKE /proc, with requests timed by a hooked child through the real hooks.

Four fake GPUs of one kind. The child's requests are slow at the tail on GPUs 2 and 3.

- GPU 3 is shared with pid 4242 (uid 1001), which NVML's per-process utilisation shows using 45% of
  the SMs; the child's own worker (pid 5151, its child in the fake /proc) computes there too:
  ``slow``, cause ``other_process``, naming 4242 and not the worker.
- GPU 2 holds pid 4343, another user's process that is present (it holds memory) and idle, and the
  child's worker computing at 30%: ``slow``, and no ``other_process`` cause.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import attr, hook_env, log_records, read_otlp_lines, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from devices_agent_runner import start_agent  # noqa: E402
from fake_nvml.helpers import add_fake_process, build_fake_nvml, fake_env, make_proc_root  # noqa: E402

UUID = "GPU-fa4e0000-0000-4000-8000-00000000000%d"
GIB = 1 << 30
NEIGHBOUR, IDLE_NEIGHBOUR, WORKER = 4242, 4343, 5151
SCENARIO = f"""\
# FAKE NVML: four devices of one kind; 3 shared with a busy process, 2 with an idle one
count 4
0 name FAKE NVIDIA H100 (fake_nvml)
1 name FAKE NVIDIA H100 (fake_nvml)
2 name FAKE NVIDIA H100 (fake_nvml)
3 name FAKE NVIDIA H100 (fake_nvml)
2 procs {IDLE_NEIGHBOUR}:{GIB},{WORKER}:{2 * GIB}
2 procutil {WORKER}:30:10
3 procs {NEIGHBOUR}:{GIB},{WORKER}:{2 * GIB}
3 procutil {NEIGHBOUR}:45:20,{WORKER}:50:10
"""
CHILD = textwrap.dedent(
    """
    import sys, time
    from infersight import hooks
    from infersight.hooks._request import request

    sys.stdin.readline()  # the test has placed this process's worker in the fake /proc
    for i in range(60):
        for dev in range(4):
            with request(device="cuda:%d" % dev, model="llama-fake", input_len=16):
                slow_tail = dev >= 2 and i % 20 == 19
                time.sleep(0.25 if slow_tail else 0.002)
    print("flushed", hooks.flush(10))
    """
)


def _slow(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The first slow verdict's event per device."""
    out: dict[str, dict[str, Any]] = {}
    for r in log_records(lines):
        if attr(r, "infersight.device.verdict") == "slow":
            out.setdefault(str(attr(r, "hw.id")), r)
    return out


def body(r: dict[str, Any]) -> str:
    return str(r.get("body", {}).get("stringValue", ""))


def causes(r: dict[str, Any]) -> list[str]:
    return [v["stringValue"] for v in attr(r, "infersight.device.causes")["values"]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("other_process")
    try:
        libdir = build_fake_nvml(root / "lib")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    (root / "fake_nvml.cfg").write_text(SCENARIO)
    proc = make_proc_root(root / "proc", {NEIGHBOUR: "python3", IDLE_NEIGHBOUR: "jupyter-lab"},
                          parents={NEIGHBOUR: 1, IDLE_NEIGHBOUR: 1}, uids={NEIGHBOUR: 1001, IDLE_NEIGHBOUR: 1002})
    rules = root / "devices.toml"
    rules.write_text('engine_version = "1.0"\n[thresholds]\nmin_requests = 20\n')  # 60 requests a device
    extra = (f'[nvml]\ninterval_s = 0.1\nproc_root = "{proc}"\n[devices]\nevaluate_interval_s = 0.5\n'
             f'window_s = 120\nrules = "{rules}"\n')
    agent = start_agent(root, fake_env(libdir, root / "fake_nvml.cfg"), extra)
    out = root / "out.otlp.jsonl"
    try:
        child = subprocess.Popen([sys.executable, "-c", CHILD], env=hook_env(root / "agent.sock", root / "spool"),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The child (the process the kernel names for its requests) and its worker, in the FAKE /proc.
        add_fake_process(proc, child.pid, "python3", parent=1, uid=1000)
        add_fake_process(proc, WORKER, "worker", parent=child.pid, uid=1000)
        stdout, stderr = child.communicate("go\n", timeout=90)
        assert child.returncode == 0, stderr
        assert "flushed True" in stdout, stdout + stderr
        ok = wait_for(lambda: out.exists() and {UUID % 2, UUID % 3} <= set(_slow(read_otlp_lines(out))), 30, 0.2)
        agent.send_signal(signal.SIGTERM)
        agent.wait(20)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(5)
    log = (root / "agent.log").read_text()
    assert ok, log
    return {"lines": read_otlp_lines(out), "log": log}


def test_a_device_shared_with_a_busy_process_is_slow_because_of_it(run: dict[str, Any]) -> None:
    ev = _slow(run["lines"])[UUID % 3]
    assert attr(ev, "infersight.device.cause") == "other_process"
    assert causes(ev) == ["other_process"]
    assert attr(ev, "hw.state") == "degraded"
    text = body(ev)
    assert "pid 4242 (uid 1001, python3) used 45% SM in" in text, text
    assert str(WORKER) not in text  # the series' own worker computes there too: not another process


def test_an_idle_neighbour_and_the_own_worker_are_no_cause(run: dict[str, Any]) -> None:
    ev = _slow(run["lines"])[UUID % 2]
    assert attr(ev, "infersight.device.cause") == "unknown"
    assert causes(ev) == ["unknown"]
    assert str(IDLE_NEIGHBOUR) not in body(ev) and str(WORKER) not in body(ev)


def test_only_the_slow_devices_are_slow(run: dict[str, Any]) -> None:
    assert set(_slow(run["lines"])) == {UUID % 2, UUID % 3}
