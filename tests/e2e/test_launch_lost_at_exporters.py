"""``infersight launch``'s closing report says what its exporters lost, as ``infersight status`` does. It said
only the producers' sequence gaps ("N event(s) lost"): a launch whose file sink and exporter spool sat on a
full disk ended with no loss said, only "N item(s) not delivered to file", which a spooled item left for a
later replay says too. Here a real launch on a small tmpfs that CMD fills before its hooks send anything."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import launch_tmpdir
from small_fs import tmpfs

pytestmark = [pytest.mark.slow]

CLI = [sys.executable, "-m", "infersight"]
FILL_THEN_LOG = """
import sys
from infersight import hooks
with open(sys.argv[1], "ab", buffering=0) as f:  # the disk under launch's output file and its spool, to the last byte
    for chunk in (4096, 1):
        try:
            while True:
                f.write(b"\\0" * chunk)
        except OSError:
            pass
for i in range(100):
    hooks.log("after the disk filled", i=i)
"""
# status's words (agent/commands/status.py lost_text), after "lost"
LOST = re.compile(r"^infersight: lost (\d+) event\(s\) in producers' sequence gaps; (\d+) item\(s\) exporters "
                  r"could neither deliver nor keep \(file (\d+)\)(;|$)", re.M)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real small filesystem that CMD fills (needs root and mount rights)."""
    with tmpfs(tmp_path / "fs", "size=512k,mode=0700") as d:
        yield d


def test_launch_says_what_its_exporters_lost_on_a_full_disk(tmp_path: Path, small_disk: Path) -> None:
    script = tmp_path / "fill_then_log.py"
    script.write_text(FILL_THEN_LOG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env["TMPDIR"] = launch_tmpdir(small_disk / "t")  # launch's private directory, with its exporter spool
    env["INFERSIGHT_MEASURE_STORAGE"] = "0"
    r = subprocess.run([*CLI, "launch", "--agent", "embedded", "--otlp-file", str(small_disk / "out.jsonl"), "--",
                        sys.executable, str(script), str(small_disk / "filler")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "No space left on device" in r.stderr, r.stderr[-3000:]
    m = LOST.search(r.stderr)
    assert m is not None, r.stderr[-3000:]
    gaps, at_exporters, at_file = map(int, m.groups()[:3])
    assert gaps == 0 and at_exporters == at_file > 0, m.group(0)
    # the undelivered count stays beside it: of the file exporter, what it neither wrote nor spooled at least
    undelivered = re.search(r"(\d+) item\(s\) not delivered to file \(", r.stderr)
    assert undelivered is not None and int(undelivered.group(1)) >= at_file, r.stderr[-3000:]
