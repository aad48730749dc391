"""torch's _lazy_init calling itself (its queued calls), through the hooks' cuda_init wrapper.

CPU torch has no CUDA to initialise: a stand-in for torch's own _lazy_init runs the wrapper again
from inside, as torch's queued calls do (torch.cuda._lazy_init -> _queued_calls -> _lazy_init), so the
wrapper sees a re-entrant call while its cuda_init is open. Writes {"pid", "calls"} to argv[1]."""

import json
import os
import sys

import torch  # noqa: F401  (the hooks' torch state: the real module, CUDA not initialised)

from infersight.hooks import _torch

calls = []


def lazy_init_stand_in() -> None:
    calls.append(len(calls))
    if len(calls) == 1:
        wrapped()  # a queued call that calls torch.cuda._lazy_init again


wrapped = _torch._make_lazy_init(lazy_init_stand_in)
wrapped()
with open(sys.argv[1], "w", encoding="utf-8") as f:
    json.dump({"pid": os.getpid(), "calls": len(calls)}, f)
