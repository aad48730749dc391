"""``infersight doctor`` on this CPU-only machine: passes, and says what is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "infersight", "doctor", *args], capture_output=True, text=True,
                          timeout=120, env=e)


def test_doctor_passes_without_gpu_and_says_why(tmp_path: Path) -> None:
    r = run("--json", env={"INFERSIGHT_SPOOL_DIR": str(tmp_path / "spool"),
                           "INFERSIGHT_SOCKET": str(tmp_path / "none.sock"), "LD_LIBRARY_PATH": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["launch_ok"] is True and checks["launch"]["status"] == "ok"
    assert checks["nvml"]["status"] == "warn" and "NVMLError_LibraryNotFound" in checks["nvml"]["detail"]
    assert checks["cuda"]["status"] == "warn" and "CUDA is not compiled in" in checks["cuda"]["detail"]
    assert checks["agent"]["status"] == "warn"


def test_doctor_reports_unreachable_collector_as_warning(tmp_path: Path) -> None:
    r = run(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "INFERSIGHT_SPOOL_DIR": str(tmp_path)})
    assert r.returncode == 0
    assert "unreachable" in r.stdout and "launch can run here." in r.stdout


def test_doctor_asks_whether_otlp_is_requested_as_the_agent_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from infersight.agent.commands.doctor import check_exporters
    from infersight.agent.daemon import config as cfg

    for k in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(k)
    assert "not configured" in check_exporters(cfg.load(None, env={}))[0].detail
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1/v1/traces")
    assert "per-signal endpoints" in check_exporters(cfg.load(None, env={}))[0].detail
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert "not configured" in check_exporters(cfg.load(None, env={}))[0].detail


def test_the_torch_hint_works_where_infersight_is_not_in_the_servers_interpreter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The hint was `<its python> -m infersight doctor`: infersight need not be installed there (the hooks load
    from its own install), and then that command fails."""
    from infersight.agent.commands.doctor import check_torch

    monkeypatch.setitem(sys.modules, "torch", None)  # no torch in the doctor's own interpreter
    (check,) = check_torch()
    assert check.status == "warn"
    assert "`infersight doctor --python <its python>`" in check.fix, check.fix
    assert "-m infersight" not in check.fix


def test_doctor_checks_the_model_servers_interpreter_without_infersight_in_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--python``: the hooks activate in that interpreter from infersight's own install; torch is looked for
    there, not in the agent's."""
    import argparse

    from infersight.agent.commands import doctor

    srv = tmp_path / "srv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(srv)], check=True, timeout=120)
    py = str(srv / "bin" / "python")
    monkeypatch.chdir(tmp_path)  # not the checkout, whose infersight/ a plain `python -c` would import
    monkeypatch.setenv("INFERSIGHT_SPOOL_DIR", str(tmp_path / "spool"))
    assert subprocess.run([py, "-c", "import infersight"], capture_output=True, timeout=60).returncode != 0
    launch = doctor.check_launch(py)
    assert launch.status == "ok" and launch.detail.endswith(" in %s" % py), launch
    assert [(c.name, c.status, c.detail) for c in doctor.check_torch(py)] == [
        ("torch", "warn", "not installed in %s" % py)]
    # The CLI passes it on (resolved), and refuses one that is not there.
    parser = argparse.ArgumentParser(prog="infersight")
    doctor.add_parser(parser.add_subparsers(dest="command"))
    seen: list[str | None] = []
    monkeypatch.setattr(doctor, "run_doctor", lambda out, as_json=False, python=None: seen.append(python) or 0)
    args = parser.parse_args(["doctor", "--python", "srv/bin/python"])
    assert args.func(args) == 0 and seen == [py]
    args = parser.parse_args(["doctor", "--python", str(tmp_path / "absent" / "python")])
    assert args.func(args) == 2 and seen == [py]


def test_doctor_says_when_nvml_does_not_answer_and_does_not_wait_for_it(fake_libdir: Path, tmp_path: Path) -> None:
    """A driver that stopped answering (nvmlInit blocks: the FAKE libnvidia-ml.so.1 with ``hang_init``): doctor,
    which an operator runs just then, waited for ever. It now says so after its wait, and ends."""
    from fake_nvml.helpers import fake_env

    from infersight.agent.commands.doctor import NVML_WAIT_S

    libdir = fake_libdir
    cfg, hang = tmp_path / "fake_nvml.cfg", tmp_path / "nvml.hang"
    cfg.write_text("hang_init 1\n")
    hang.touch()
    env = fake_env(libdir, cfg)
    env.update(FAKE_NVML_HANG_FILE=str(hang), INFERSIGHT_SPOOL_DIR=str(tmp_path / "spool"),
               INFERSIGHT_SOCKET=str(tmp_path / "none.sock"))
    try:
        r = subprocess.run([sys.executable, "-m", "infersight", "doctor", "--json"], capture_output=True, text=True,
                           timeout=NVML_WAIT_S + 60, env=env)
        assert (tmp_path / "nvml.hang.entered").exists()  # nvmlInit was called, and blocked
    finally:
        hang.unlink()
    assert r.returncode == 0, r.stdout + r.stderr  # launch can still run: its agent goes on without NVML
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["nvml"]["status"] == "warn"
    assert "NVML did not answer within" in checks["nvml"]["detail"] and "Xid" in checks["nvml"]["fix"]
