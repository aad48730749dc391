"""TRACEPARENT reaches children at spawn time, not at every stage; span ids per process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import hook_env

# Runs hooked: prints "name traceparent-seen-by-the-child expected-span" per spawn path.
SPAWNS = r'''
import multiprocessing, os, subprocess, sys
from infersight import hooks
from infersight.hooks import _runtime

# -I: these children ignore PYTHONPATH, so their hooks stay off and do not replace TRACEPARENT.
PRINT = [sys.executable, "-I", "-c", "import os; print(os.environ.get('TRACEPARENT', ''))"]

def child_tp(argv_env=None):
    return subprocess.run(PRINT, capture_output=True, text=True, env=argv_env).stdout.strip()

def spawned(path):
    r, w = os.pipe()
    os.set_inheritable(w, True)
    pid = os.posix_spawn(sys.executable, [sys.executable, "-I", "-c",
        "import os; os.write(%d, os.environ.get('TRACEPARENT', '').encode())" % w], os.environ,
        file_actions=[], setsid=False) if path == "posix_spawn" else None
    if path == "fork_exec":
        pid = os.fork()
        if pid == 0:
            os.execv(sys.executable, [sys.executable, "-I", "-c",
                "import os; os.write(%d, os.environ.get('TRACEPARENT', '').encode())" % w])
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return f.read().strip()

def mp_child(q):
    # A hooked child: its own root's parent is what it read from TRACEPARENT.
    assert _runtime.state().client is not None and _runtime.state().root_parent
    q.put("00-%s-%s-01" % (_runtime.state().trace_id, _runtime.state().root_parent))

def report(name, seen, span):
    print(name, seen or "-", span, flush=True)

def main():
    root = _runtime.state().root_span_id
    at_start = os.environ["TRACEPARENT"]
    report("root", child_tp(), root)
    with hooks.stage("outer") as st:
        outer = _runtime.current_span.get()
        assert os.environ["TRACEPARENT"] == at_start, "entering a stage writes no environment"
        with hooks.stage("inner"):
            inner = _runtime.current_span.get()
            report("subprocess", child_tp(), inner)
            report("posix_spawn", spawned("posix_spawn"), inner)
            report("fork_exec", spawned("fork_exec"), inner)
            report("env_copy", child_tp(dict(os.environ, EXTRA="1")), inner)
            foreign = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
            report("env_foreign", child_tp(dict(os.environ, TRACEPARENT=foreign)), "2" * 16)
            ctx = multiprocessing.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=mp_child, args=(q,))
            p.start()
            report("mp_spawn", q.get(timeout=60), inner)
            p.join()
        report("after_inner", child_tp(), outer)
    report("after_outer", child_tp(), root)
    print("trace", _runtime.state().trace_id, flush=True)


if __name__ == "__main__":
    main()
'''


def test_children_join_the_trace_under_the_current_span(tmp_path: Path) -> None:
    script = tmp_path / "spawns.py"
    script.write_text(SPAWNS)
    r = subprocess.run([sys.executable, str(script)], env=hook_env(tmp_path / "none.sock", tmp_path / "spool",
                                                                    INFERSIGHT_EXIT_FLUSH_S="0.2"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()]
    trace = {row[0]: row[1] for row in rows if len(row) == 2}["trace"]
    seen = {row[0]: (row[1], row[2]) for row in rows if len(row) == 3}
    assert set(seen) == {"root", "subprocess", "posix_spawn", "fork_exec", "env_copy", "env_foreign", "mp_spawn",
                         "after_inner", "after_outer"}
    for name, (tp, span) in seen.items():
        parts = tp.split("-")
        assert len(parts) == 4, (name, tp)
        assert parts[2] == span, "%s: the child's parent span is the current one" % name
        if name != "env_foreign":
            assert parts[1] == trace, name
    assert seen["env_foreign"][0].split("-")[1] == "1" * 32, "another trace in an explicit env is left alone"


def test_stages_do_not_grow_the_environment(tmp_path: Path) -> None:
    """No setenv per stage: os.environ and the C environment stay as they were."""
    code = (
        "import os, ctypes\nfrom infersight import hooks\n"
        "libc = ctypes.CDLL(None); libc.getenv.restype = ctypes.c_char_p\n"
        "before = libc.getenv(b'TRACEPARENT')\n"
        "for i in range(2000):\n    with hooks.stage('s%d' % (i % 7)):\n        pass\n"
        "assert libc.getenv(b'TRACEPARENT') == before, (before, libc.getenv(b'TRACEPARENT'))\n"
        "assert os.environ['TRACEPARENT'].encode() == before\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=hook_env(tmp_path / "none.sock", tmp_path / "spool",
                                                                   INFERSIGHT_EXIT_FLUSH_S="0.2"),
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "ok", r.stderr


def test_span_ids_differ_between_parent_and_forked_child(tmp_path: Path) -> None:
    code = (
        "import os\nfrom infersight.hooks import _runtime\n"
        "r, w = os.pipe()\npid = os.fork()\n"
        "ids = [_runtime.new_span_id() for _ in range(50)]\n"
        "if pid == 0:\n    os.write(w, ' '.join(ids).encode()); os._exit(0)\n"
        "os.close(w); os.waitpid(pid, 0)\n"
        "child = os.read(r, 65536).decode().split()\n"
        "assert len(child) == 50 and not set(child) & set(ids), 'reseeded after fork'\n"
        "assert all(len(i) == 16 and int(i, 16) for i in ids + child)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=hook_env(tmp_path / "none.sock", tmp_path / "spool",
                                                                   INFERSIGHT_EXIT_FLUSH_S="0.2"),
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "ok", r.stderr
