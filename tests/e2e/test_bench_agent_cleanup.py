"""The benches that start an infersight agent of their own (``bench/bench_agent.py``) leave
neither that agent running nor its temporary directory behind, however the run ends: a normal
end (the cold-loop benches end with ``os._exit``, which skips exit handlers), a failure, or a
signal (Ctrl-C, SIGTERM, SIGHUP) once the agent listens. Real bench runs, each with a
``TMPDIR`` of its own, which its agent's directory and config (and so the agent's command line)
are under."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def agents_under(tmp: Path) -> list[int]:
    """Processes whose command line names a path under ``tmp`` (an agent's ``--config``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if str(tmp).encode() in cmdline and b"agent" in cmdline:
            found.append(int(entry))
    return found


def bench_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSIGHT", "OTEL_", "TRACEPARENT"))}
    # its hooks' private spool is this test's (not the user's)
    return dict(env, TMPDIR=str(tmp_path / "tmp"), XDG_STATE_HOME=str(tmp_path / "xdg-state"), PYTHONUNBUFFERED="1")


def run_bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=bench_env(tmp_path), capture_output=True, text=True,
                          timeout=180, check=False)


def assert_nothing_left(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    assert agents_under(tmp) == []
    assert list(tmp.iterdir()) == []


def test_a_normal_run_of_the_cold_loop_benches(tmp_path: Path) -> None:
    mods = tmp_path / "mods"
    prep = run_bench(tmp_path, str(BENCH / "import_cold_loop.py"), "prepare", str(mods), "200")
    assert prep.returncode == 0, prep.stderr
    for bench, *args in (("import_cold_loop.py", str(mods), "100", "stage"), ("stage_cold_loop.py", "200")):
        r = run_bench(tmp_path, str(BENCH / bench), *args)
        assert r.returncode == 0, r.stderr
        assert_nothing_left(tmp_path)


def test_a_failed_run(tmp_path: Path) -> None:
    """The modules were never prepared: the import fails after the agent started."""
    r = run_bench(tmp_path, str(BENCH / "import_cold_loop.py"), str(tmp_path / "none"), "100", "top")
    assert r.returncode == 1 and "ModuleNotFoundError" in r.stderr, r.stderr
    assert_nothing_left(tmp_path)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_interrupted_run(tmp_path: Path, signum: int) -> None:
    """``emit_vs_span.py`` (its rounds take many seconds) signalled once its agent listens."""
    env = bench_env(tmp_path)
    tmp = tmp_path / "tmp"
    proc = subprocess.Popen([sys.executable, str(BENCH / "emit_vs_span.py")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp.glob("*/a.sock")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        assert agents_under(tmp)  # the agent runs
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "goal" not in out, (out, err)  # interrupted, not finished
    assert_nothing_left(tmp_path)
