"""``scripts/demo python my_serve.py`` runs the checkout's .venv interpreter (README quick start).

scripts/demo installs torch and the project into the checkout's .venv; a bare ``python`` in
CMD used to be whatever PATH found first (or nothing at all on hosts without ``python``).
The script runs here from a scratch root whose .venv is a real virtualenv, already marked
as set up, so that nothing is installed; PATH holds no virtualenv. No agent is named
(INFERSIGHT_SOCKET unset: a named socket that nothing answers is waited for, 30 s) and the
default socket is one in the test's own XDG_RUNTIME_DIR, where none listens: launch embeds its
agent at once, as on a workstation.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_python_in_cmd_is_the_checkouts_venv(tmp_path: Path) -> None:
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "demo", root / "scripts" / "demo")
    (root / "pyproject.toml").write_text("")
    venv = root / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # The venv's infersight: this test environment's console script (what the demo's install makes).
    cli = Path(sys.executable).parent / "infersight"
    assert cli.is_file(), "the test environment has no infersight console script"
    (venv / "bin" / "infersight").symlink_to(cli)
    (venv / ".infersight-demo").touch()  # newer than pyproject.toml: no install
    os.utime(root / "pyproject.toml", (1, 1))

    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSIGHT", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH="/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin", XDG_RUNTIME_DIR=str(tmp_path / "run"))
    r = subprocess.run([str(root / "scripts" / "demo"), "python", "-c", "import sys; print('prefix=' + sys.prefix)"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "prefix=%s\n" % venv in r.stdout
    assert list(tmp_path.glob("infersight-*.otlp.jsonl")), "launch wrote no OTLP file in the current directory"


@pytest.mark.parametrize(("extra", "rc"), [((), 0), (("--device", "no-such-device"), 1)])
def test_the_demo_leaves_no_weights_behind(tmp_path: Path, extra: tuple[str, ...], rc: int) -> None:
    """Every run left its demo-weights-* directory (128 MiB at the default size) in the temporary
    directory, when it served and when it failed (here: after saving the weights)."""
    pytest.importorskip("torch")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSIGHT", "OTEL_"))}
    env["TMPDIR"] = str(tmp)
    r = subprocess.run([sys.executable, str(REPO / "examples" / "demo_serve.py"), "--hidden", "64", *extra],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert r.returncode == rc, r.stdout[-3000:] + r.stderr[-3000:]
    assert ("demo: served" in r.stdout) == (rc == 0)
    assert list(tmp.iterdir()) == []
