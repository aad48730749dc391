"""``torch.export.load`` of a ``.pt2`` archive is a weights load: its file, its bytes and its rate (a review found
its 192 MiB unattributed, a gap in ``torch.export.pt2_archive``, and the only weights span the 9.5 KiB
``torch.load`` of the archive's sample inputs from memory, with no path)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import launch, stage_name  # noqa: E402

W = "infersight.weights."

SAVE = r"""
import sys, torch
m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB of float32
ep = torch.export.export(m, (torch.randn(2, 1024),))
torch.export.save(ep, sys.argv[1])
"""

SERVE = r"""
import json, os, sys, torch
m = torch.export.load(sys.argv[1]).module()
m(torch.randn(2, 1024))
json.dump({"pid": os.getpid()}, open(sys.argv[-1], "w"))
"""


@pytest.mark.torch
def test_torch_export_load_is_a_weights_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    archive = str(tmp_path / "m.pt2")
    import subprocess

    subprocess.run([sys.executable, "-c", SAVE, archive], check=True, timeout=300)
    (tmp_path / "serve.py").write_text(SERVE)
    run = launch(str(tmp_path), [sys.executable, str(tmp_path / "serve.py"), archive], "--agent", "embedded")
    assert run.rc == 0, run.output[-3000:]
    root = run.root_of(run.result["pid"])
    loads = [s for s in run.stages(root) if stage_name(s) == "weights_load"
             and s.attributes.get(W + "path") == archive]
    assert loads, [(stage_name(s), s.attributes) for s in run.stages(root)]
    (span,) = [s for s in loads if s.attributes.get(W + "api") == "torch.export.load"]
    assert 32 << 20 <= span.attributes[W + "bytes"] <= os.path.getsize(archive)
    assert span.attributes[W + "bytes_per_s"] > 0
