"""The switch ``INFERSIGHT`` and misspelled ``INFERSIGHT_*`` names, end to end: a real venv
with ``infersight hooks install``, ``infersight launch`` and ``infersight agent``.

- The ``.pth`` line with ``INFERSIGHT`` neither on nor off (``enabled``, ``Y``, ``2``): one
  stderr line naming the variable, the value and the allowed words; the hooks stay off.
- A hooked process with a misspelled name: one stderr line with the name it likely means;
  the hooks work on.
- ``launch`` refuses a misspelled name (exit 2, CMD not started); the agent logs it and runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import BOOTSTRAP, hook_env, launch_tmpdir, wait_for

from infersight.agent.commands.hooks_install import pth_line
from infersight.hooks import _env as _hooks_env

CLI = [sys.executable, "-m", "infersight"]
PROBE = ("import sys; h = sys.modules.get('infersight.hooks'); "
         "print('active' if h is not None and h.active() else 'off')")


@pytest.fixture(scope="module")
def hooked_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fresh venv's interpreter with ``hooks install``'s ``.pth`` line (infersight itself not
    installed there: the bootstrap loads the hooks from its own directory)."""
    target = tmp_path_factory.mktemp("pth") / "venv"
    venv.create(target, with_pip=False, system_site_packages=False)
    py = str(target / "bin" / "python")
    r = subprocess.run([*CLI, "hooks", "install", "--python", py], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return py


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env: dict[str, str] = hook_env(tmp_path / "none.sock", tmp_path / "spool", INFERSIGHT_EXIT_FLUSH_S="0")
    for k in [k for k in env if k.startswith("INFERSIGHT") and k not in ("INFERSIGHT_SOCKET", "INFERSIGHT_SPOOL_DIR",
                                                                      "INFERSIGHT_EXIT_FLUSH_S")]:
        del env[k]
    env.pop("PYTHONPATH")  # the .pth line alone
    env.update(extra)
    return env


def _run(py: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([py, "-c", PROBE], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("value", ["enabled", "Y", "2"])
def test_a_bad_switch_is_one_line_and_no_hooks(tmp_path: Path, hooked_python: str, value: str) -> None:
    r = _run(hooked_python, _env(tmp_path, INFERSIGHT=value))
    assert r.returncode == 0 and r.stdout.strip() == "off", r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert "INFERSIGHT=%r" % value in lines[0] and "1/0, true/false, yes/no or on/off" in lines[0]


@pytest.mark.parametrize("value", [None, "", "0", "false"])
def test_unset_or_off_is_silent_and_loads_nothing(tmp_path: Path, hooked_python: str, value: str | None) -> None:
    env = _env(tmp_path, INFERSIGHT_SPOOL_MAX_BYTE="1")  # not checked either: nothing of ours runs
    if value is not None:
        env["INFERSIGHT"] = value
    code = "import sys; print(sorted(m for m in sys.modules if 'infersight' in m or m == 'difflib'))"
    r = subprocess.run([hooked_python, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]" and r.stderr == "", r.stderr


def test_a_misspelled_name_is_said_and_the_hooks_work_on(tmp_path: Path, hooked_python: str) -> None:
    r = _run(hooked_python, _env(tmp_path, INFERSIGHT="1", INFERSIGHT_SPOOL_MAX_BYTE="1"))
    assert r.returncode == 0 and r.stdout.strip() == "active", r.stderr
    lines = [x for x in r.stderr.splitlines() if "INFERSIGHT_SPOOL_MAX_BYTE" in x]
    assert len(lines) == 1, r.stderr
    assert "did you mean INFERSIGHT_SPOOL_MAX_BYTES?" in lines[0]


def test_known_names_are_silent_in_a_hooked_process(tmp_path: Path, hooked_python: str) -> None:
    """The agent's variables and the commands' own, in a service's environment: no line."""
    r = _run(hooked_python, _env(tmp_path, INFERSIGHT="1", INFERSIGHT_PROMETHEUS_PORT="9464",
                                 INFERSIGHT_MQTT_URL="mqtt://x", INFERSIGHT_MEASURE_STORAGE="0",
                                 INFERSIGHT_STATE_DIR=str(tmp_path / "state"), INFERSIGHT_CONFIG="/nonexistent"))
    assert r.returncode == 0 and r.stdout.strip() == "active", r.stderr
    assert "INFERSIGHT" not in r.stderr, r.stderr


def _launch_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env.update(TMPDIR=launch_tmpdir(tmp_path / "t"), INFERSIGHT_MEASURE_STORAGE="0", **extra)
    return env


# -- the switch misspelled: the .pth line says it, once, and loads nothing -----------------------------------

LOADED = "import sys; print(sorted(m for m in sys.modules if 'infersight' in m or m in ('difflib', 'runpy')))"


@pytest.mark.parametrize("name", ["INFERSIGT", "INFERSITE", "INFERSIGHTS", "INFRESIGHT", "infersight", "Infersight",
                                  "INFERSIGHT_ENABLED", "INFERSIGHT_ENABLE", "INFERSIGHT_ON", "INFERSIGHT_"])
def test_a_misspelled_switch_is_said_and_the_hooks_stay_off(tmp_path: Path, hooked_python: str, name: str) -> None:
    """INFERSIGT=1 or INFERSIGHT_ENABLED=1 alone: the hooks stayed off and nothing was printed (a review: "a typo
    in one variable switches the hooks off" is a known fleet failure). One line names it and the switch."""
    r = subprocess.run([hooked_python, "-c", LOADED], capture_output=True, text=True, timeout=60,
                       env=_env(tmp_path, **{name: "1"}))
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr  # nothing of ours loaded
    assert r.stderr.splitlines() == ["infersight: the hooks' switch is INFERSIGHT, not %s (INFERSIGHT=1 turns them "
                                     "on); the hooks stay off" % name], r.stderr  # once: site reads the line twice


@pytest.mark.parametrize("extra", [
    {"INFERSIGT": "0"},  # a typo that means off: off it is
    {"INFERSIGT": ""},
    {"INFERSIGHT_SOCKET": "/run/infersight/agent.sock", "INFERSIGHT_STATE_DIR": "/var/lib/x"},  # a fleet's, the switch
    {"INFERSIGHT_SPOOL_DIR": "/var/lib/infersight/spool", "INFERSIGHT_EXIT_FLUSH_S": "1"},  # per service
    {"INFERENCE_URL": "http://x", "INFERENCE_SERVER_ENDPOINT": "http://y", "INFO": "1", "INFLUXDB_HOST": "h"},
    {"INFERSIGHT": "0", "INFERSIGT": "1"},  # the switch itself off: the typo is no matter
])
def test_no_misspelled_switch_is_silent(tmp_path: Path, hooked_python: str, extra: dict[str, str]) -> None:
    r = subprocess.run([hooked_python, "-c", LOADED], capture_output=True, text=True, timeout=60,
                       env=_env(tmp_path, **extra))
    assert r.returncode == 0 and r.stdout.strip() == "[]" and r.stderr == "", r.stdout + r.stderr


def test_the_switch_on_beside_a_typo_hooks_and_says_nothing_of_it(tmp_path: Path, hooked_python: str) -> None:
    r = _run(hooked_python, _env(tmp_path, INFERSIGHT="1", INFERSIGT="1"))
    assert r.returncode == 0 and r.stdout.strip() == "active", r.stderr
    assert "switch" not in r.stderr, r.stderr


def test_a_typo_under_the_bootstrap_on_pythonpath_is_not_said(tmp_path: Path, hooked_python: str) -> None:
    """The bootstrap directory on PYTHONPATH hooks a process whose INFERSIGHT is unset: "stay off" would be false."""
    r = _run(hooked_python, _env(tmp_path, PYTHONPATH=str(BOOTSTRAP), INFERSIGT="1"))
    assert r.returncode == 0 and r.stdout.strip() == "active", r.stderr
    assert "switch" not in r.stderr, r.stderr


def test_the_line_runs_its_code_only_for_a_name_that_may_be_the_switch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The line's own test, made on every name at every start, lets through every name the code would say
    (``is_typo``) and, of the names a host sets, none of a fleet's INFERSIGHT_* ones nor long INF names."""
    from infersight.hooks.bootstrap import _infersight_pth as pth

    stub = tmp_path / "boot"
    stub.mkdir()
    (stub / "_infersight_pth.py").write_text("def run(w, boot):\n    print('ran')\n")
    line = pth_line(str(stub))
    for k in [k for k in os.environ if k.upper().startswith("INF")]:
        monkeypatch.delenv(k)
    typos = ["INFERSIGT", "INFERSITE", "INFERSIGHTS", "INFERSIGH", "INFRESIGHT", "INFERSIHGT", "INFOSIGHT",
             "infersight", "INFERSIGHT_", "INFERSIGHT_ON", *("INFERSIGHT_" + w for w in _hooks_env.SWITCH_TYPO_WORDS)]
    quiet = ["INFERSIGHT_SOCKET", "INFERSIGHT_SPOOL_DIR", "INFERSIGHT_EXIT_FLUSH_S", "INFERSIGHT_STATE_DIR",
             "INFERSIGHT_HOST_NAME", "INFERSIGHT_OTLP_FILE", "INFERENCE_SERVER_URL", "INFERENCE_ENDPOINT", "PATH_INFO"]
    for name in typos + quiet:
        monkeypatch.setenv(name, "1")
        exec(line, {})  # noqa: S102 - the line, as site runs it
        ran = capsys.readouterr().out == "ran\n"
        monkeypatch.delenv(name)
        assert ran == (name in typos), name
        assert pth.is_typo(name) == (name in typos), name


def test_the_line_code_agrees_with_the_hooks_words() -> None:
    """The file the line runs imports nothing of ours: its words are _env's, held equal here."""
    from infersight.hooks.bootstrap import _infersight_pth as pth

    assert pth.ON == _hooks_env.TRUE_WORDS and ("", *_hooks_env.FALSE_WORDS) == pth.OFF
    assert _hooks_env.VARS["INFERSIGHT"].allowed() == pth.ALLOWED and pth.SWITCH == _hooks_env.SWITCH
    assert pth.TYPO_WORDS == _hooks_env.SWITCH_TYPO_WORDS and pth.TYPO_DISTANCE == _hooks_env.SWITCH_TYPO_DISTANCE


def test_launch_env_refuses_a_misspelled_name(tmp_path: Path) -> None:
    marker = tmp_path / "cmd-ran"
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(tmp_path / "o.jsonl"), "--",
                        sys.executable, "-c", "open(%r, 'w').write('x')" % str(marker)],
                       capture_output=True, text=True, timeout=60,
                       env=_launch_env(tmp_path, INFERSIGHT_SPOOL_MAX_BYTE="1"))
    assert r.returncode == 2, r.stderr
    assert "INFERSIGHT_SPOOL_MAX_BYTE is not a variable" in r.stderr
    assert "did you mean INFERSIGHT_SPOOL_MAX_BYTES?" in r.stderr
    assert not marker.exists()


def test_launch_env_takes_every_known_name(tmp_path: Path) -> None:
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(tmp_path / "o.jsonl"), "--", "true"],
                       capture_output=True, text=True, timeout=60,
                       env=_launch_env(tmp_path, INFERSIGHT_SPOOL_MAX_BYTES="1MiB", INFERSIGHT_RULES_DIR=str(tmp_path),
                                       INFERSIGHT_TEST_WORKERS="0", INFERSIGHT_LOG_LEVEL="WARNING"))
    assert r.returncode == 0, r.stderr
    assert "not a variable" not in r.stderr


def test_the_agent_logs_a_misspelled_name_and_runs(tmp_path: Path) -> None:
    sock = tmp_path / "agent.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSIGHT", "OTEL_EXPORTER_OTLP"))}
    env.update(INFERSIGHT_SOCKET=str(sock), INFERSIGHT_SPOOL_DIR=str(tmp_path / "spool"),
               INFERSIGHT_STATE_DIR=str(tmp_path / "state"), INFERSIGHT_OTLP_FILE=str(tmp_path / "out.jsonl"),
               INFERSIGHT_CONFIG=str(tmp_path / "absent.toml"), INFERSIGHT_SHUTDOWN_TIMEOUT_S="1",
               INFERSIGHT_PROMETHEUS_PROT="9999")
    env.pop("NOTIFY_SOCKET", None)
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*CLI, "agent"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        assert wait_for(sock.exists, 30), log.read_text()
        from infersight.agent.commands.status import query_status

        warnings = query_status(str(sock), 30.0)["warnings"]  # and `infersight status` says it
        assert any("INFERSIGHT_PROMETHEUS_PROT" in w and "INFERSIGHT_PROMETHEUS_PORT" in w for w in warnings), warnings
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    lines = [x for x in log.read_text().splitlines() if "INFERSIGHT_PROMETHEUS_PROT" in x]
    assert len(lines) == 1, log.read_text()
    assert "did you mean INFERSIGHT_PROMETHEUS_PORT?" in lines[0]


def test_no_typo_costs_no_import() -> None:
    """The check runs in every hooked process: difflib is imported only for an unknown name."""
    code = ("import sys; sys.modules.pop('difflib', None)\n"
            "from infersight.hooks import _env\n"
            "assert _env.unknown({'INFERSIGHT_SOCKET': '/s', 'INFERSIGHT_STATE_DIR': '/d'}) == []\n"
            "print('difflib' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


# -- the .pth line ------------------------------------------------------------------


def _pth(value: str | None, times: int = 1) -> subprocess.CompletedProcess[str]:
    """The .pth line as site runs it (``times``: site reads a venv's site-packages twice),
    then whether the hooks loaded; the bootstrap not on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSIGHT") and k != "PYTHONPATH"}
    env.update(INFERSIGHT_SOCKET="/nonexistent/agent.sock", INFERSIGHT_EXIT_FLUSH_S="0")
    if value is not None:
        env["INFERSIGHT"] = value
    line = pth_line(str(BOOTSTRAP)).strip()
    code = "\n".join([line] * times) + "\nimport sys; print('infersight.hooks' in sys.modules)\n"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("value", ["enabled", "Y", "2", "tru"])
def test_the_pth_line_says_a_bad_switch_once_and_stays_off(value: str) -> None:
    r = _pth(value, times=2)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert "INFERSIGHT=%r" % value in lines[0] and "1/0, true/false, yes/no or on/off" in lines[0]


@pytest.mark.parametrize("value", [None, "", "0", "off", " No "])
def test_the_pth_line_is_silent_unset_or_off(value: str | None) -> None:
    r = _pth(value)
    assert r.returncode == 0 and r.stdout.strip() == "False" and r.stderr == "", r.stderr


def test_the_pth_line_never_raises_into_site() -> None:
    """A .pth line left behind by an uninstalled infersight: one line, no traceback."""
    line = pth_line("/nonexistent/infersight/bootstrap").strip()
    env = {**os.environ, "INFERSIGHT": "1"}
    env.pop("PYTHONPATH", None)
    r = subprocess.run([sys.executable, "-c", line + "\nprint('ran')\n"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ran", r.stderr
    assert len(r.stderr.splitlines()) == 1 and "bootstrap failed" in r.stderr and "Traceback" not in r.stderr
