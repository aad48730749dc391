"""A driver that stops answering: a real agent against the FAKE libnvidia-ml.so.1, whose device 0
blocks every query after its 40th while a file exists (``hang_after``, ``FAKE_NVML_HANG_FILE``),
as NVML calls do for minutes on a GPU that fell off the bus.

While NVML hangs, the agent must go on with everything that does not need it: a hooked child's
request histograms and a PyTorch OOM (it needs NVML's per-process view, and goes out without
it); ``status`` and the health metric say NVML is not answering. When the call returns, samples
resume; and an agent stopped while NVML hangs still exits (it used to wait on the call for ever).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from conftest import attr, hook_env, log_records, read_otlp_lines, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from devices_agent_runner import metric_points, start_agent  # noqa: E402
from fake_nvml.helpers import fake_env  # noqa: E402

from infersight.agent.commands.status import query_status  # noqa: E402
from infersight.agent.requests.kind import DURATION  # noqa: E402

SCENARIO = """\
# FAKE NVML: two devices; device 0 stops answering after its 40th query while the hang file exists
count 2
0 hang_after 40
"""
# A PyTorch 1.x message: no per-process figures, so the agent asks NVML for them (FAKE: no torch here).
OOM_TEXT = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity; 70.00 GiB already "
            "allocated; 1.00 GiB free; 77.00 GiB reserved in total by PyTorch)")
CHILD = textwrap.dedent(
    """
    import sys, time
    from infersight import hooks
    from infersight.hooks import _alloc
    from infersight.hooks._request import request

    class OutOfMemoryError(RuntimeError):  # FAKE stand-in for torch.OutOfMemoryError
        pass

    for i in range(30):
        for dev in (0, 1):
            with request(device="cuda:%d" % dev, model="llama-fake", input_len=16):
                time.sleep(0.002)
    try:
        raise OutOfMemoryError(sys.argv[1])
    except OutOfMemoryError as exc:
        assert _alloc.report_oom(exc)
    print("flushed", hooks.flush(10))
    """
)



def _log(root: Path) -> str:
    return (root / "agent.log").read_text(errors="replace")


def _nvml_status(root: Path) -> dict[str, Any]:
    try:
        return dict(query_status(str(root / "agent.sock"))["nvml"])
    except Exception:
        return {}


def _agent_on_a_hanging_nvml(libdir: Path, root: Path, scenario: str) -> tuple[Path, subprocess.Popen[bytes]]:
    """A real agent on the FAKE NVML of ``scenario``, whose hangs last while the returned file exists."""
    hang = root / "nvml.hang"
    hang.touch()
    cfg = root / "fake_nvml.cfg"
    cfg.write_text(scenario)
    env = fake_env(libdir, cfg)
    env["FAKE_NVML_HANG_FILE"] = str(hang)
    return hang, start_agent(root, env, "[nvml]\ninterval_s = 0.1\n[devices]\nevaluate_interval_s = 0.5\n")


def _child_once_nvml_hangs(root: Path) -> None:
    """Once the FAKE NVML hangs, the hooked child's requests on cuda:0 and cuda:1 and its OOM, flushed."""
    assert wait_for((root / "nvml.hang.entered").exists, 60, 0.05), _log(root)
    child = subprocess.run([sys.executable, "-c", CHILD, OOM_TEXT], env=hook_env(root / "agent.sock", root / "spool"),
                           capture_output=True, text=True, timeout=60, check=False)
    assert child.returncode == 0 and "flushed True" in child.stdout, child.stdout + child.stderr


def test_a_hung_nvml_stops_neither_requests_nor_ooms_nor_the_agents_exit(fake_libdir: Path, tmp_path: Path) -> None:
    hang, agent = _agent_on_a_hanging_nvml(fake_libdir, tmp_path, SCENARIO)
    out = tmp_path / "out.otlp.jsonl"
    try:
        # NVML stops answering after a few samples; a hooked child's requests and OOM still go out
        _child_once_nvml_hangs(tmp_path)

        def sent() -> bool:
            lines = read_otlp_lines(out) if out.exists() else []
            ooms = [r for r in log_records(lines) if r.get("eventName") == "oom"]
            hist = [p for p in metric_points(lines, DURATION) if int(p["count"]) >= 30]
            return bool(ooms and len(hist) >= 2)

        assert wait_for(sent, 60, 0.2), _log(tmp_path)  # (they waited for ever: the interval, the OOM's NVML read)
        (oom,) = [r for r in log_records(read_otlp_lines(out)) if r.get("eventName") == "oom"]
        assert attr(oom, "infersight.oom.class") in ("capacity", "fragmentation", "reservation_conflict", "unknown")

        # status and the health metric say NVML is not answering, and for how long; it still is
        hung = _nvml_status(tmp_path)
        assert hung.get("available") is False and hung.get("hangs") == 1 and hung.get("hung_s", 0) > 0, hung
        assert "has not returned" in hung["reason"], hung
        assert "NVML is not answering" in _log(tmp_path)
        text = subprocess.run([sys.executable, "-m", "infersight", "status", "--socket", str(tmp_path / "agent.sock")],
                              capture_output=True, text=True, timeout=30, check=False).stdout
        assert re.search(r"nvml {19}not available \(for [0-9.]+ s\): an NVML call has not returned", text), text
        assert wait_for(lambda: len([p for p in metric_points(read_otlp_lines(out), "infersight.nvml.available")
                                     if "has not returned" in str(attr(p, "infersight.nvml.reason"))]) >= 2, 60, 0.2)
        reasons = {str(attr(p, "infersight.nvml.reason")) for p in
                   metric_points(read_otlp_lines(out), "infersight.nvml.available")}
        assert len(reasons) == 1, reasons  # one series while it lasts: a label that changed would make one a beat

        # the call returns: samples resume, status is back
        hang.unlink()
        assert wait_for(lambda: _nvml_status(tmp_path).get("available") is True, 60, 0.2), _log(tmp_path)
        assert "NVML answers again" in _log(tmp_path)
        back = _nvml_status(tmp_path)
        assert back["hung_s"] is None and back["reason"] is None and back["hangs"] == 1
        t_back = time.time_ns()
        assert wait_for(lambda: any(
            int(p["timeUnixNano"]) > t_back and str(attr(p, "hw.id")).endswith("0")
            for p in metric_points(read_otlp_lines(out), "hw.gpu.utilization")), 60, 0.2), _log(tmp_path)

        # it hangs again, and the agent is stopped: it exits, without nvmlShutdown
        hang.touch()
        assert wait_for(lambda: _nvml_status(tmp_path).get("hangs") == 2, 60, 0.2), _log(tmp_path)
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(60)  # (it waited for ever: the interval, then nvmlShutdown, behind the hung call)
    finally:
        hang.unlink(missing_ok=True)
        if agent.poll() is None:
            agent.kill()
            agent.wait(5)
    assert rc == 0, _log(tmp_path)
    assert "closing without nvmlShutdown" in _log(tmp_path)


def test_an_nvml_that_answers_its_start_late_is_picked_up_then(fake_libdir: Path, tmp_path: Path) -> None:
    """nvmlInit blocks (``hang_init``): the agent starts anyway, its request histograms go out, status says why
    there are no device samples; when nvmlInit returns, sampling starts without a restart."""
    hang, agent = _agent_on_a_hanging_nvml(fake_libdir, tmp_path, "hang_init 1\ncount 2\n")
    out = tmp_path / "out.otlp.jsonl"
    try:
        _child_once_nvml_hangs(tmp_path)
        assert wait_for(lambda: len([p for p in metric_points(read_otlp_lines(out) if out.exists() else [], DURATION)
                                     if int(p["count"]) >= 30]) >= 2, 60, 0.2), _log(tmp_path)
        assert wait_for(lambda: "has not answered nvmlInit" in str(_nvml_status(tmp_path).get("reason")), 60, 0.2)
        assert _nvml_status(tmp_path)["available"] is False
        assert not metric_points(read_otlp_lines(out), "hw.gpu.utilization")
        hang.unlink()
        assert wait_for(lambda: _nvml_status(tmp_path).get("available") is True, 60, 0.2), _log(tmp_path)
        assert _nvml_status(tmp_path)["reason"] is None and _nvml_status(tmp_path)["devices"] == 2
        assert wait_for(lambda: metric_points(read_otlp_lines(out), "hw.gpu.utilization"), 60, 0.2), _log(tmp_path)
        assert "NVML answered after" in _log(tmp_path)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0
    finally:
        hang.unlink(missing_ok=True)
        if agent.poll() is None:
            agent.kill()
            agent.wait(5)
