"""The CLI's output to a reader that went away (``infersight classify big.log | head -1``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FRAG = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate %d.%02d GiB. GPU 0 has a total capacity of "
        "79.15 GiB of which 1.20 GiB is free. Of the allocated memory 60.00 GiB is allocated by PyTorch, and "
        "16.00 GiB is reserved by PyTorch but unallocated.")


def test_output_to_a_reader_that_left_ends_quietly(tmp_path: Path) -> None:
    """``infersight classify big.log | head -1``: the reader closes the pipe; the command ends
    with 141 (as cat killed by SIGPIPE) and no traceback on stderr."""
    log = tmp_path / "big.log"
    # 3000 distinct messages: about 1.5 MB of findings, far more than a pipe holds (64 KiB)
    log.write_text("\n".join(FRAG % (i // 100 + 1, i % 100) for i in range(3000)))
    p = subprocess.Popen([sys.executable, "-m", "infersight", "classify", str(log)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(60) == 141, err
    assert "Traceback" not in err, err
