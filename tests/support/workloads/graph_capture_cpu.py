"""CUDA-graph capture through torch's real ``torch.cuda.graphs`` code on a CPU build.

Usage: python graph_capture_cpu.py RESULT_JSON   (run under ``infersight launch``)

No GPU here, so the C++ capture that ``CUDAGraph.capture_begin``/``capture_end`` call through
``super()`` is a LABELLED FAKE: ``GpuCaptureStandIn`` sits after torch's ``_CUDAGraph`` in the
method order and sleeps where the driver would capture. Everything above it is torch's own
code with the hooks' wrappers installed on the real class, and the real
``make_graphed_callables``, which fails on a CPU build before capturing anything.
"""

import json
import sys
import time

import torch
from torch.cuda import graphs


class GpuCaptureStandIn:
    """FAKE for the absent GPU: the driver-side capture of torch._C._CUDAGraph."""

    calls: list = []

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.calls.append("begin")
        time.sleep(0.06)

    def capture_end(self):
        self.calls.append("end")
        time.sleep(0.06)


class StandInGraph(graphs.CUDAGraph, GpuCaptureStandIn):
    def __new__(cls, keep_graph=False):
        inst = object.__new__(cls)  # torch._C._CUDAGraph cannot be made without CUDA
        inst._tracker = None
        return inst

    def __init__(self, keep_graph=False):
        pass  # the dummy base refuses to be initialised


model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
x = torch.randn(4, 64)
result = {
    "wrapped_begin": hasattr(graphs.CUDAGraph.__dict__["capture_begin"], "__wrapped__"),
    "wrapped_end": hasattr(graphs.CUDAGraph.__dict__["capture_end"], "__wrapped__"),
    "wrapped_enter": hasattr(graphs.graph.__dict__["__enter__"], "__wrapped__"),
    "wrapped_callables": hasattr(torch.cuda.make_graphed_callables, "__wrapped__")
    and torch.cuda.make_graphed_callables is graphs.make_graphed_callables,
}
g = StandInGraph()
with torch.no_grad():
    g.capture_begin()
    t_forward = time.time_ns()
    model(x)  # recorded into the graph: not a warmup
    g.capture_end()
result["forward_in_capture_ns"] = t_forward
try:
    torch.cuda.make_graphed_callables(model, (x,))  # a CPU build: fails before any capture
    result["graphed"] = "no error"
except Exception as exc:
    result["graphed"] = type(exc).__name__
with torch.no_grad():
    model(x)  # a warmup forward after the capture
result["calls"] = GpuCaptureStandIn.calls
with open(sys.argv[1], "w") as f:
    json.dump(result, f)
