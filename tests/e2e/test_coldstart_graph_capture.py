"""``graph_capture``: CUDA-graph capture is its own stage (DESIGN "Cold-start spans").

No GPU here: the hooks are installed by ``infersight launch`` on the real ``torch.cuda.graphs``
objects of a CPU build, and the workload drives torch's own ``CUDAGraph.capture_begin`` /
``capture_end`` code, with a labelled stand-in for the driver-side capture below it
(``tests/support/workloads/graph_capture_cpu.py``). bench/gpu_check_coldstart.sh captures a real
graph on a GPU.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import HERE, launch, stage_name  # noqa: E402

pytest.importorskip("torch")
pytestmark = [pytest.mark.torch]


def test_capture_is_a_graph_capture_stage_and_its_forward_no_warmup(tmp_path) -> None:
    r = launch(str(tmp_path), [sys.executable, os.path.join(HERE, "graph_capture_cpu.py")],
               env={"PYTHONWARNINGS": "ignore"})
    assert r.rc == 0, r.output[-3000:]
    res = r.result
    assert res["wrapped_begin"] and res["wrapped_end"] and res["wrapped_enter"] and res["wrapped_callables"]
    assert res["calls"] == ["begin", "end"]  # torch's own methods reached the stand-in through super()
    assert res["graphed"] != "no error"  # make_graphed_callables needs CUDA
    root = next(x for x in r.roots() if x.parent_span_id is None)
    stages = r.stages(root)
    caps = [s for s in stages if stage_name(s) == "graph_capture"]
    assert len(caps) == 1, caps  # the failed make_graphed_callables captured nothing: no stage
    cap = caps[0]
    assert cap.name == "coldstart.graph_capture"
    assert cap.attributes["infersight.capture.api"] == "torch.cuda.CUDAGraph.capture_begin"
    assert cap.attributes["infersight.capture.graphs"] == 1
    assert "infersight.stage.custom" not in cap.attributes  # a builtin stage
    assert cap.start_ns < res["forward_in_capture_ns"] < cap.end_ns
    warm = [s for s in stages if stage_name(s) == "warmup"]
    assert warm, "the forward after the capture is a warmup"
    assert not any(w.start_ns < cap.end_ns and w.end_ns > cap.start_ns for w in warm)  # the captured one is not
