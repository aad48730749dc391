"""The hook side: fail-open, fork safety, threads, import cost, .pth bootstrap."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

from conftest import BOOTSTRAP, attr, hook_env, log_records, read_otlp_lines, spans


def run_hooked(tmp_path: Path, agent, code: str, **env: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    script = tmp_path / "w.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], env=hook_env(agent.sock, agent.spool, **env),
                          capture_output=True, text=True, timeout=60)


def test_hooks_are_noops_when_inactive() -> None:
    code = ("import infersight.hooks as h\n"
            "assert not h.active()\n"
            "with h.stage('x'):\n    pass\n"
            "@h.stage('y')\ndef f():\n    return 5\n"
            "assert f() == 5\nh.log('x'); h.metric('m', 1); assert h.flush() is True\nprint('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "ok", r.stderr


def test_internal_error_disables_hooks_with_one_line(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    code = ("from infersight import hooks\nfrom infersight.hooks import _runtime\n"
            "def boom(*a, **k):\n    raise RuntimeError('hook bug')\n"
            "_runtime.state().client.emit = boom\n"
            "for i in range(3):\n    hooks.log('x')\n    with hooks.stage('s'):\n        pass\n"
            "print('user code still runs', hooks.active())\n")
    r = run_hooked(tmp_path, agent, code, INFERSIGHT_EXIT_FLUSH_S="1")
    assert r.returncode == 0
    assert r.stdout.strip() == "user code still runs False"
    assert r.stderr.count("infersight: hooks disabled") == 1


def test_fork_child_is_a_new_producer_without_duplicates(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    code = (
        "import os, threading\nfrom infersight import hooks\n"
        "for i in range(100):\n    hooks.log('parent', i=i)\n"
        "def worker():\n    with hooks.stage('thread_stage'):\n        hooks.log('in thread')\n"
        "t = threading.Thread(target=worker); t.start(); t.join()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    for i in range(50):\n        hooks.log('child', i=i)\n"
        "    hooks.flush(5)\n    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "for i in range(100, 120):\n    hooks.log('parent', i=i)\n"
    )
    r = run_hooked(tmp_path, agent, code)
    assert r.returncode == 0, r.stderr
    assert agent.stop() == 0
    lines = read_otlp_lines(agent.out)
    recs = log_records(lines)
    parent = sorted(int(attr(x, "i")) for x in recs if x["body"]["stringValue"] == "parent")
    child = sorted(int(attr(x, "i")) for x in recs if x["body"]["stringValue"] == "child")
    assert parent == list(range(120)) and child == list(range(50))
    pids = {attr(rl["resource"], "process.pid") for req in lines for rl in req.get("resourceLogs", [])
            if any(r["body"]["stringValue"] == "child" for sl in rl["scopeLogs"] for r in sl["logRecords"])}
    assert len(pids) == 1
    sp = spans(lines)
    assert len([s for s in sp if s["name"] == "coldstart.thread_stage"]) == 1
    roots = [s for s in sp if s["name"] == "coldstart"]
    parent_root = [s for s in roots if not s.get("parentSpanId")]
    assert len(parent_root) == 1
    # The child ends with os._exit (no exit handler sends its root): the agent closes one for
    # it, under the parent's root, once (it had cold-start stages: the fork's runtime_init).
    child_roots = [s for s in roots if s.get("parentSpanId")]
    assert len(child_roots) <= 1
    assert all(s["parentSpanId"] == parent_root[0]["spanId"] for s in child_roots)
    # The forked child's own root (ended at os._exit? no: flushed before) joins the parent's trace.
    assert all(s["traceId"] == parent_root[0]["traceId"] for s in sp)


def test_bootstrap_import_is_stdlib_only() -> None:
    code = ("import sys\nbefore = set(sys.modules)\nimport infersight.hooks\n"
            "new = set(sys.modules) - before\n"
            "bad = [m for m in new if m.split('.')[0] in ('opentelemetry', 'grpc', 'google', 'torch', 'psutil', "
            "'aiomqtt', 'pynvml')]\nprint(bad)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "[]"


def test_pth_install_activates_only_with_env(tmp_path: Path) -> None:
    target = tmp_path / "venv"
    venv.create(target, with_pip=False, system_site_packages=False)
    py = str(target / "bin" / "python")
    r = subprocess.run([sys.executable, "-m", "infersight", "hooks", "install", "--python", py],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    probe = "import sys; print('infersight.hooks' in sys.modules and sys.modules['infersight.hooks'].active())"
    sock = tmp_path / "none.sock"
    env = hook_env(sock, tmp_path / "spool", INFERSIGHT_EXIT_FLUSH_S="0.2")
    env.pop("PYTHONPATH")
    off = subprocess.run([py, "-c", probe], capture_output=True, text=True, env=env, timeout=30)
    assert off.stdout.strip() == "False"
    on = subprocess.run([py, "-c", probe], capture_output=True, text=True, env={**env, "INFERSIGHT": "1"}, timeout=30)
    assert on.stdout.strip() == "True", on.stderr
    r = subprocess.run([sys.executable, "-m", "infersight", "hooks", "uninstall", "--python", py],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    again = subprocess.run([py, "-c", probe], capture_output=True, text=True, env={**env, "INFERSIGHT": "1"},
                           timeout=30)
    assert again.stdout.strip() == "False"
    assert BOOTSTRAP.is_dir()


def test_multiprocessing_fork_worker_flushes_before_os_exit(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """multiprocessing's fork workers end with os._exit (no atexit): the hooks flush anyway."""
    agent = agent_factory().start()
    code = (
        "import multiprocessing as mp\nfrom infersight import hooks\n"
        "def work(n):\n    for i in range(n):\n        hooks.log('worker', i=i)\n"
        "if __name__ == '__main__':\n"
        "    p = mp.get_context('fork').Process(target=work, args=(500,))\n"
        "    p.start(); p.join()\n    assert p.exitcode == 0\n"
    )
    r = run_hooked(tmp_path, agent, code)
    assert r.returncode == 0, r.stderr
    assert agent.stop() == 0
    lines = read_otlp_lines(agent.out)
    got = sorted(int(attr(x, "i")) for x in log_records(lines) if x["body"]["stringValue"] == "worker")
    assert got == list(range(500))
    roots = [s for s in spans(lines) if s["name"] == "coldstart" and attr(s, "infersight.process.forked")]
    assert len(roots) == 1, "the worker's own cold-start root is exported too"


def test_cold_start_checkpoints_never_ring_the_urgent_doorbell(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """The sampler's checkpoints (cs_tick, every 100 ms of a cold start) are sent soon, but the
    doorbell that opens the agent's read gate at once is an OOM's alone."""
    agent = agent_factory().start()
    code = "import time\nfrom infersight import hooks\nfor _ in range(8):\n    time.sleep(0.1)\nhooks.log('done')\n"
    r = run_hooked(tmp_path, agent, code)
    assert r.returncode == 0, r.stderr
    st = agent.status()
    assert agent.stop() == 0
    kinds = [x["body"]["stringValue"] for x in log_records(read_otlp_lines(agent.out))]
    assert "done" in kinds
    assert st["counters"]["urgent_wakeups"] == 0
