"""The wheel an operator builds (README "Install without a checkout") ships the whole program.

The folders map into one ``infersight`` namespace through an explicit package list in
pyproject.toml, so a new subpackage or data file that is not listed works in the editable
install of a checkout and is silently missing from the wheel. These tests build the wheel
from a copy of the source tree (never from a ``build/`` left behind by an earlier build),
check its file list against the tree, check that the build prints no setuptools warning, and
run the installed program from a fresh virtualenv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# source folder -> its place in the wheel (pyproject.toml's [tool.setuptools.package-dir])
ROOTS = {"infersight": "infersight", "agent": "infersight/agent", "hooks": "infersight/hooks",
         "exporters": "infersight/exporters", "rules": "infersight/rules"}
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".mypy_cache",
                                    ".ruff_cache", ".pytest_cache", ".hypothesis", ".mypy_tree", ".whl", ".cache",
                                    "*.otlp.jsonl", "*.pyc")
OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
       "23.53 GiB of which 20.38 MiB is free. Process 4242 has 21.69 GiB memory in use. Including non-PyTorch "
       "memory, this process has 1.81 GiB memory in use. Of the allocated memory 1.34 GiB is allocated by "
       "PyTorch, and 94.59 MiB is reserved by PyTorch but unallocated.\n")


class Built:
    def __init__(self, source: Path, wheel: Path, log: str) -> None:
        self.source, self.wheel, self.log = source, wheel, log
        with zipfile.ZipFile(wheel) as z:
            self.names = set(z.namelist())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    tmp = tmp_path_factory.mktemp("wheel")
    source, out = tmp / "src", tmp / "dist"
    shutil.copytree(REPO, source, symlinks=True, ignore=NOT_COPIED)
    # --no-build-isolation: the test venv's setuptools, so that no network is needed.
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                        "--no-index", str(source), "-w", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (wheel,) = out.glob("infersight-*.whl")
    return Built(source, wheel, r.stdout + r.stderr)


def expected_files(source: Path) -> set[str]:
    """Every module and data file under the package folders, as wheel paths (docs excepted)."""
    want = set()
    for folder, target in ROOTS.items():
        for path in (source / folder).rglob("*"):
            if path.is_dir() or "__pycache__" in path.parts or path.suffix in {".md", ".pyc"}:
                continue
            want.add(target + "/" + path.relative_to(source / folder).as_posix())
    return want


def test_the_build_prints_no_setuptools_warning(built: Built) -> None:
    assert "absent from the `packages` configuration" not in built.log
    assert "Warning" not in built.log, [line for line in built.log.splitlines() if "Warning" in line][:5]


def test_the_wheel_ships_every_module_and_data_file(built: Built) -> None:
    want = expected_files(built.source)
    # What the code loads at run time, named so that a glob change cannot hide it.
    assert {"infersight/rules/oom.toml", "infersight/rules/devices.toml", "infersight/hooks/py.typed",
            "infersight/hooks/bootstrap/sitecustomize.py", "infersight/agent/data/infersight.service",
            "infersight/agent/data/infersight.toml", "infersight/exporters/prometheus/alerts.yml"} <= want
    assert sorted(want - built.names) == []
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in built.names)


def test_the_wheel_ships_no_stray_files(built: Built) -> None:
    dist_info = {n for n in built.names if ".dist-info/" in n}
    assert sorted(built.names - dist_info - expected_files(built.source)) == []


def test_the_installed_wheel_runs_from_a_fresh_venv(built: Built, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                        str(built.wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # Tests have no network: the dependencies come from this test venv, appended to the fresh
    # venv's path after its own site-packages (a path added by a .pth line gets no .pth
    # processing, so this venv's editable finder for the checkout is not loaded).
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSIGHT", "PYTHON"))}
    cli = str(venv / "bin" / "infersight")

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, input=stdin, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)

    r = run(cli, "--help")
    assert r.returncode == 0, r.stderr
    for command in ("launch", "agent", "status", "hooks", "classify", "install-service"):
        assert command in r.stdout
    r = run(str(py), "-c", "import json, infersight\n"
            "from infersight.exporters.prometheus_endpoint import shipped_rule_files\n"
            "from infersight.rules.device_rules import DEFAULT_PATH\n"
            "from infersight.agent.commands.install_service import data_dir\n"
            "print(json.dumps([infersight.__file__, [str(p) for p in shipped_rule_files()], str(DEFAULT_PATH),"
            " str(data_dir())]))")
    assert r.returncode == 0, r.stderr
    module, rule_files, devices_rules, data = json.loads(r.stdout)
    assert module.startswith(str(site)), "infersight must come from the wheel, not the checkout"
    assert len(rule_files) >= 3 and all(p.startswith(str(site)) for p in rule_files)
    assert Path(devices_rules).is_file() and Path(data).name == "data"
    # The OOM rules are package data too: classify loads them.
    r = run(cli, "classify", "--json", "-", stdin=OOM)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout.splitlines()[0])["class"] == "fragmentation"
    # An agent's serving rules come from the pre-parsed copy that ships beside serving.toml.
    r = run(str(py), "-c", "from infersight.rules.serving import LazyPattern, builtin\n"
            "print(all(isinstance(p, LazyPattern) for r in builtin().rules for p in r.patterns))")
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stdout + r.stderr
    # The unit files ship with the program: install-service plans from them, no checkout needed.
    r = run(cli, "install-service", "--dry-run", "--force", "--prefix", str(tmp_path / "root"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "infersight.service" in r.stdout and "infersight.toml" in r.stdout
