"""No NVML at all, through the real bindings in a child process whose loader finds no
libnvidia-ml.so.1 (the wrapper with the library missing in-process: tests/unit/test_nvml_absent.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REASON = "NVMLError_LibraryNotFound: NVML Shared Library Not Found"


def test_real_bindings_without_driver(tmp_path: Path) -> None:
    """The real nvidia-ml-py, with no libnvidia-ml.so.1 the loader can find."""
    code = textwrap.dedent(
        """
        import ctypes, json, logging
        try:
            ctypes.CDLL("libnvidia-ml.so.1")
            print(json.dumps({"skip": "a real libnvidia-ml.so.1 is installed"}))
            raise SystemExit(0)
        except OSError:
            pass
        logging.basicConfig(level=logging.WARNING)
        from infersight.agent.devices.nvml import Nvml
        nv = Nvml()
        out = [nv.sample_all(), nv.sample_all()]
        st = nv.status()
        import sys
        print(json.dumps({"available": st.available, "reason": st.reason,
                          "code": st.error_code, "samples": [len(x) for x in out],
                          "pynvml_imported": "pynvml" in sys.modules}))
        """
    )
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(tmp_path), "PYTHONNOUSERSITE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in rep:
        pytest.skip(rep["skip"])
    # pynvml's own failure, said without importing pynvml (~15 ms of CPU): the loader's answer decides.
    assert rep == {"available": False, "reason": REASON, "code": 12, "samples": [0, 0], "pynvml_imported": False}
    assert proc.stderr.count("NVML not available") == 1
