"""Cold-start workload through the explicit API, with a thread and a forked child.

Usage: python coldstart_explicit.py OUT.json
- custom stages: a context manager, a decorator, one nested in another, one in a thread;
- a child forked after import (inside a custom stage) runs its own stage and a forward;
- mark_ready() then first_response() around the first request's forward.
Writes {"t_first_ns", "t_end_ns", "pid", "child_pid", "child_status"} to OUT.json.
"""

import time

T_FIRST = time.time_ns()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

import torch  # noqa: E402

from infersight import hooks  # noqa: E402


@hooks.stage("build_model", layers=2)
def build() -> torch.nn.Module:
    with hooks.stage("init_layers"):
        return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


with hooks.stage("tokenizer_load"):
    time.sleep(0.02)
model = build()


def in_thread() -> None:
    with hooks.stage("thread_stage"):
        time.sleep(0.03)


t = threading.Thread(target=in_thread)
t.start()
t.join()

child_pid = 0
with hooks.stage("spawn_workers"):
    child_pid = os.fork()
    if child_pid == 0:
        with hooks.stage("child_stage"):
            time.sleep(0.01)
        with torch.no_grad():
            model(torch.randn(1, 32))
        hooks.flush(5.0)
        sys.exit(0)
_, status = os.waitpid(child_pid, 0)

with torch.no_grad():
    model(torch.randn(2, 32))  # warmup
hooks.mark_ready()
with torch.no_grad():
    model(torch.randn(1, 32))  # the first request's forward
time.sleep(0.02)  # serialising the response
hooks.first_response()
hooks.first_response()  # a second call does nothing

with open(sys.argv[1], "w") as f:
    json.dump({"t_first_ns": T_FIRST, "t_end_ns": time.time_ns(), "pid": os.getpid(), "child_pid": child_pid,
               "child_status": status}, f)
