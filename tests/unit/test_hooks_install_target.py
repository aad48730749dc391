"""``hooks install`` without ``--python`` writes into the interpreter infersight runs in, which is seldom
the model server's: it says so and how to name the server's (a README walkthrough installed into the
agent's venv without noticing)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from infersight.agent.commands.hooks_install import PTH_NAME, install


def test_an_install_into_infersights_own_interpreter_says_how_to_name_the_servers(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "v")], check=True, timeout=60)
    py = str(tmp_path / "v" / "bin" / "python")
    out = io.StringIO()
    assert install(py, out, named=False) == 0
    assert "--python /path/to/its/python" in out.getvalue() and py in out.getvalue(), out.getvalue()
    assert list((tmp_path / "v").rglob(PTH_NAME))
    named = io.StringIO()
    assert install(py, named) == 0
    assert "--python" not in named.getvalue(), named.getvalue()  # a named interpreter needs no hint
