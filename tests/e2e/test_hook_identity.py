"""Identity of hooked processes through the ``.pth`` bootstrap (``infersight hooks install``).

A process started with ``INFERSIGHT=1`` in a venv where the hooks are installed reports its
real command, not the bootstrap's ``sitecustomize.py`` (``runpy.run_path`` sets ``sys.argv[0]``
while the ``.pth`` line runs it), and infersight's own CLI never becomes a producer: no cold
start, no ETA history line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from conftest import attr, hook_env, read_otlp_lines, wait_for

from infersight.hooks import _proc


def _hooked_venv(tmp_path: Path) -> Path:
    """A fresh venv with the ``.pth`` bootstrap installed, where infersight is importable (this
    checkout's site directory added by a ``.pth`` of its own) and ``bin/infersight`` is the
    console script pip made for this checkout, with the venv's interpreter."""
    target = tmp_path / "venv"
    venv.create(target, with_pip=False, system_site_packages=False)
    py = target / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "infersight", "hooks", "install", "--python", str(py)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    purelib = subprocess.run([str(py), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]  # this interpreter's: infersight is installed there
    # Sorted before infersight-hooks.pth: infersight is importable when the bootstrap runs.
    (Path(purelib) / "aa-infersight-checkout.pth").write_text("import site; site.addsitedir(%r)\n" % ours)
    script = Path(sys.executable).parent / "infersight"
    assert script.is_file(), "the checkout's console script"
    body = script.read_text().split("\n", 1)[1]
    cli = target / "bin" / "infersight"
    cli.write_text("#!%s\n%s" % (py, body))
    cli.chmod(0o755)
    return target


def _roots(out: Path) -> list[dict]:  # type: ignore[type-arg]
    found = []
    for req in read_otlp_lines(out):
        for rs in req.get("resourceSpans", []):
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    if s["name"] == "coldstart":
                        found.append({"resource": rs["resource"], "span": s})
    return found


@pytest.mark.slow
def test_pth_hooked_process_reports_its_command_and_the_cli_is_no_producer(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    target = _hooked_venv(tmp_path)
    env = hook_env(agent.sock, agent.spool, INFERSIGHT="1", OTEL_SERVICE_NAME="ident-svc", INFERSIGHT_EXIT_FLUSH_S="5")
    env.pop("PYTHONPATH")  # the .pth is the only way in
    # infersight's own CLI in that venv, with the service's environment: no producer.
    st = subprocess.run([str(target / "bin" / "infersight"), "status", "--json"], env=env,
                        capture_output=True, text=True, timeout=60)
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["healthy"] is True
    # A served process through the same venv and environment: a producer, named by its script.
    serve = tmp_path / "serve.py"
    serve.write_text("import sys\nprint('served', sys.argv[1:])\n")
    r = subprocess.run([str(target / "bin" / "python"), str(serve), "--port", "8123"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "served" in r.stdout, r.stderr
    assert wait_for(lambda: len(_roots(agent.out)) >= 1, 20)
    assert agent.status()["producers"] == 1  # the served process only
    assert agent.stop() == 0
    roots = _roots(agent.out)
    assert [attr(x["resource"], "process.command") for x in roots] == ["serve.py"]
    assert attr(roots[0]["resource"], "service.name") == "ident-svc"
    # The ETA history holds the served process's run alone.
    history = Path(os.environ["INFERSIGHT_STATE_DIR"]) / "coldstart-history.jsonl"
    lines = [json.loads(x) for x in history.read_text().splitlines()] if history.exists() else []
    mine = [x for x in lines if "ident-svc" in json.dumps(x)]
    assert len(mine) == 1, mine


@pytest.mark.parametrize(("orig", "argv", "name"), [
    (["python3", "serve.py", "--port", "1"], ["serve.py", "--port", "1"], "serve.py"),
    (["python3", "-u", "-m", "uvicorn", "app:app"], ["-m", "uvicorn", "app:app"], "uvicorn"),
    (["python3", "-muvicorn", "x"], ["-m", "uvicorn", "x"], "uvicorn"),
    (["python3", "-c", "code", "--multiprocessing-fork"], ["-c", "--multiprocessing-fork"], "-c"),
    (["python3", "-X", "importtime", "-W", "ignore", "/srv/s.py"], ["/srv/s.py"], "s.py"),
    (["python3", "-Wignore", "-B", "s.py", "a"], ["s.py", "a"], "s.py"),
    (["python3", "--check-hash-based-pycs", "always", "s.py"], ["s.py"], "s.py"),
    (["python3", "-I", "-c", "x"], ["-c"], "-c"),
])
def test_command_argv_skips_the_interpreter_and_its_options(orig: list[str], argv: list[str], name: str) -> None:
    assert _proc.command_argv(orig) == argv
    assert _proc.command_name(argv) == name


def test_own_cli_is_recognised_by_its_script(tmp_path: Path) -> None:
    cli = tmp_path / "infersight"
    cli.write_text("#!/usr/bin/python3\nfrom infersight.agent.cli import main\nmain()\n")
    other = tmp_path / "sub" / "infersight"
    other.parent.mkdir()
    other.write_text("print('a user script that happens to share the name')\n")
    assert _proc.is_own_cli([str(cli), "status"])
    assert _proc.is_own_cli(["-m", "infersight", "status"])
    assert not _proc.is_own_cli([str(other)])
    assert not _proc.is_own_cli(["serve.py"])
    assert not _proc.is_own_cli(["-m", "uvicorn"])
