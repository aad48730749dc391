"""A child forked from a thread other than the main one ends when that thread does, hooked or not.

There the forking thread is no main program: when it ends (a return, ``sys.exit()``) the interpreter does
not exit, and the process ends with its last thread. The hooks' threads (drain, sampler) kept such a child
alive for ever, its parent's ``waitpid`` with it (``hooks/_forkexit.py``). A hang is the failure here, not a
speed: the bound is 10 s, and a child still alive then is killed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import attr, hook_env, log_records, read_otlp_lines, wait_for

BOUND_S = 10.0

PARENT = r"""
import json, os, sys, threading, time
from infersight import hooks
how = sys.argv[1]
hooks.log("parent", tag="parent")
result = {}

def child_body():
    for i in range(5):
        hooks.log("child", tag="child-" + how, i=i)
    if how == "late-thread":  # a thread of the user's outlives the forking thread: the child waits for it
        def late():
            time.sleep(0.5)
            hooks.log("late", tag="late-" + how)
        threading.Thread(target=late).start()
        return
    if how == "sysexit":
        sys.exit(0)
    if how == "grandchild":  # the child's only thread forks again: the grandchild is watched too
        pid = os.fork()
        if pid == 0:
            hooks.log("grandchild", tag="grandchild-" + how)
            return
        wait_child(pid, %(bound)s / 2)  # (a grandchild that hangs is killed before its parent is)

def wait_child(pid, bound=%(bound)s):
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        r, st = os.waitpid(pid, os.WNOHANG)
        if r:
            return {"exited": True, "status": st, "s": time.monotonic() - t0}
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return {"exited": False}

def worker():
    if how == "mp":
        import multiprocessing
        p = multiprocessing.get_context("fork").Process(target=child_body)
        p.start()
        p.join(%(bound)s)
        alive = p.is_alive()
        if alive:
            p.kill()
            p.join()
        result.update(exited=not alive, status=p.exitcode)
        return
    pid = os.fork()
    if pid == 0:
        child_body()
        return  # the forking thread's function ends in the child
    result.update(wait_child(pid))

t = threading.Thread(target=worker)
t.start()
t.join()
print(json.dumps(result), flush=True)
""" % {"bound": BOUND_S}


def run_parent(tmp_path: Path, agent, how: str) -> dict:  # type: ignore[no-untyped-def,type-arg]
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    r = subprocess.run(
        [sys.executable, str(script), how],
        env=hook_env(agent.sock, agent.spool),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def tags(agent) -> list[str]:  # type: ignore[no-untyped-def]
    return [str(attr(rec, "tag")) for rec in log_records(read_otlp_lines(agent.out)) if attr(rec, "tag")]


@pytest.mark.parametrize("how", ["return", "sysexit", "late-thread", "grandchild", "mp"])
def test_child_forked_from_a_thread_exits_and_flushes(tmp_path: Path, agent_factory, how: str) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    res = run_parent(tmp_path, agent, how)
    assert res["exited"], "the child forked from a thread was still alive after %ss" % BOUND_S
    # the status it has without the hooks: a thread's SystemExit is no exit status
    assert res["status"] == 0, res
    want = {"child-%s" % how}
    if how == "late-thread":
        want.add("late-" + how)
    if how == "grandchild":
        want.add("grandchild-" + how)
    assert wait_for(lambda: want <= set(tags(agent)) and tags(agent).count("child-" + how) == 5, 15), tags(agent)
