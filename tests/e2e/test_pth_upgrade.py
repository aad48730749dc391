"""The ``.pth`` line of an older ``infersight hooks install`` after an in-place upgrade (pip replaces infersight's
files, not the line in the model server's site-packages): ``doctor`` (and ``doctor --python``) says it is from an
older infersight and what to run; ``hooks install`` rewrites it in place, once, after which the line's own checks
work (a misspelled switch is said). A real venv's site-packages in a temporary directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from infersight.agent.commands import doctor
from infersight.agent.commands.hooks_install import PTH_NAME, pth_line
from infersight.hooks import _bootstrap_dir

CLI = [sys.executable, "-m", "infersight"]


def _old_line(boot: str) -> str:
    """The line ``hooks install`` wrote on 2026-12-02 (no try: no misspelled switch, a traceback without infersight)."""
    return ("import os, sys; os.environ.get('INFERSIGHT', '').strip().lower() in %r and %r not in sys.path and "
            "(sys.path.insert(0, %r) or __import__('runpy').run_path(%r))\n"
            % (("1", "true", "yes", "on"), boot, boot, os.path.join(boot, "sitecustomize.py")))


@pytest.fixture
def server_python(tmp_path: Path) -> tuple[str, Path]:
    """A model server's interpreter (a fresh venv, infersight not in it) and its site-packages."""
    target = tmp_path / "srv"
    venv.create(target, with_pip=False, system_site_packages=False)
    py = str(target / "bin" / "python")
    site = subprocess.run([py, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    return py, Path(site)


def test_doctor_names_an_older_pth_line_and_hooks_install_rewrites_it_once(
        tmp_path: Path, server_python: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    py, site = server_python
    pth = site / PTH_NAME
    monkeypatch.chdir(tmp_path)
    none = doctor.check_pth(py)
    assert none.status == "ok" and none.detail.startswith("no %s in %s" % (PTH_NAME, site)), none

    pth.write_text(_old_line(_bootstrap_dir()))
    env = dict(os.environ, LD_LIBRARY_PATH="", INFERSIGHT_SPOOL_DIR=str(tmp_path / "spool"),
               INFERSIGHT_SOCKET=str(tmp_path / "none.sock"))
    r = subprocess.run([*CLI, "doctor", "--json", "--python", py], capture_output=True, text=True, env=env,
                       timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr  # a warning: launch can run
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["pth"]["status"] == "warn"
    assert checks["pth"]["detail"] == ("the .pth line in %s is from an older infersight: run infersight hooks install "
                                       "--python %s again" % (pth, py))
    assert checks["pth"]["fix"] == "infersight hooks install --python %s" % py

    for said in (" (in place of an older line)", ""):  # in place, and again: one line, the current one
        r = subprocess.run([*CLI, "hooks", "install", "--python", py], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[0] == "installed %s%s" % (pth, said), r.stdout
        assert pth.read_text() == pth_line(_bootstrap_dir())
        assert sorted(p.name for p in site.glob("*.pth")) == [PTH_NAME]
    ok = doctor.check_pth(py)
    assert ok.status == "ok" and ok.detail.startswith(str(pth)), ok
    # The line's own check works now (the old one said nothing of a misspelled switch).
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSIGHT", "PYTHON"))}
    r = subprocess.run([py, "-c", "print('served')"], capture_output=True, text=True, timeout=60,
                       env=dict(clean, INFERSIGT="1"))
    assert r.stdout == "served\n" and "INFERSIGT" in r.stderr and "INFERSIGHT" in r.stderr, r.stderr


def test_doctor_names_a_pth_line_of_another_install(tmp_path: Path, server_python: tuple[str, Path]) -> None:
    py, site = server_python
    other = str(tmp_path / "elsewhere" / "infersight" / "hooks" / "bootstrap")
    (site / PTH_NAME).write_text(pth_line(other))
    c = doctor.check_pth(py)
    assert c.status == "warn" and "runs the hooks of another infersight install" in c.detail, c
    assert c.fix == "to run this one's: infersight hooks install --python %s" % py


def test_doctor_without_python_looks_at_its_own_interpreters_pth(
        server_python: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    py, site = server_python
    (site / PTH_NAME).write_text(_old_line(_bootstrap_dir()))
    monkeypatch.setattr(sys, "executable", py)  # doctor run by that interpreter
    c = doctor.check_pth()
    assert c.status == "warn" and c.detail == ("the .pth line in %s is from an older infersight: run infersight "
                                               "hooks install again" % (site / PTH_NAME)), c
