"""The agent process on a bad configuration file: exit status 2, the key and its file:line
(the loader itself: tests/unit/test_config.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_agent_exits_2_on_bad_config(tmp_path: Path) -> None:
    p = write(tmp_path, "[agent]\nframe_timeout_s = \"x\"\n")
    r = subprocess.run([sys.executable, "-m", "infersight", "agent", "--config", str(p)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "%s:2" % p in r.stderr and "agent.frame_timeout_s" in r.stderr
