"""Live classification of serving engines' memory errors (issue 24, point 6).

Real hooked child processes (the bootstrap on PYTHONPATH, no torch, no GPU): one logs a real
vLLM message through ``logging`` (twice, and from a second process), one dies of an uncaught
SGLang error, one logs a non-memory error; a real agent with the real file exporter
classifies them, and the test reads the OTLP file.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import attr, log_records, read_otlp_lines, wait_for
from test_oom_live import _embedded_agent
from test_oom_live import _run_child as _child

from infersight.agent.oom import stderr_relay
from infersight.hooks import _enginelog, _runtime
from infersight.rules import serving

SUPPORT = Path(__file__).resolve().parents[1] / "support"
GIVEN = SUPPORT / "data" / "serving_ooms_given.jsonl"


def _given(rid: str) -> str:
    for line in GIVEN.read_text(encoding="utf-8").splitlines():
        d = json.loads(line)
        if d["id"] == rid:
            return str(d["message"])
    raise KeyError(rid)


CHILD_LOGS = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
log = logging.getLogger("vllm.engine")
log.info("Loading model weights took 14.99 GiB memory")   # INFO: never sent
log.warning("this is a warning without the needles")
msg = json.loads(sys.argv[1])
log.error(msg)
log.error(msg)      # the same message again: once
log.error("AssertionError: max_num_batched_tokens (2048) is smaller than max_model_len (8192); memory")
"""

CHILD_RAISES = """
import json, sys
raise RuntimeError(json.loads(sys.argv[1]))
"""


async def test_logged_and_raised_engine_errors_are_classified_once(tmp_path: Path) -> None:
    agent, oom, out, sock, spool = _embedded_agent(tmp_path)
    await agent.start()
    vllm_msg = _given("srv-025")
    try:
        rc, err = await _child(CHILD_LOGS, json.dumps(vllm_msg), sock, spool)
        assert rc == 0, err
        assert vllm_msg in err  # the user's own log output is untouched
        rc, err = await _child(CHILD_LOGS, json.dumps(vllm_msg), sock, spool)  # a second process: its own OOM
        assert rc == 0, err
        rc, err = await _child(CHILD_RAISES, json.dumps(
            "Not enough memory. Please try to increase --mem-fraction-static."), sock, spool)
        assert rc == 1 and "mem-fraction-static" in err
        await agent.ingest.wait_connections_closed(10)
    finally:
        await agent.shutdown(10)
    recs = [r for r in log_records(read_otlp_lines(out)) if r.get("eventName") == "oom"]
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        by_engine.setdefault(str(attr(r, "infersight.oom.engine")), []).append(r)
    assert sorted(by_engine) == ["sglang", "vllm"]
    # logged twice by each of two processes (one after the other, unrelated): once per process
    assert len(by_engine["vllm"]) == 2
    for v in by_engine["vllm"]:
        assert attr(v, "infersight.oom.class") == "reservation_conflict"
        assert attr(v, "infersight.oom.rule") == "vllm.startup.free-below-utilization"
        assert attr(v, "infersight.oom.source") == "log"
        assert attr(v, "infersight.oom.knob") == "gpu_memory_utilization"
        assert int(attr(v, "infersight.oom.T_bytes")) == round(79.32 * (1 << 30))
    (s,) = by_engine["sglang"]
    assert attr(s, "infersight.oom.class") == "reservation_conflict"
    assert attr(s, "infersight.oom.source") == "exception"
    assert oom.handlers.duplicates == 0  # each process's second log the hook itself did not send
    assert oom.handlers.not_memory == 2  # the assertion line, once per process: sent, dropped


FAMILY = """
import json, logging, subprocess, sys
logging.basicConfig(level=logging.INFO)
log = logging.getLogger("vllm.engine")
msg = json.loads(sys.argv[1])
log.error(msg)  # the engine process logs it ...
child = "import logging, sys; logging.basicConfig(); logging.getLogger('vllm.worker').error(sys.argv[1])"
subprocess.run([sys.executable, "-c", child, msg], check=True)  # ... its worker logs it too ...
raise RuntimeError(msg)  # ... and it dies of it
"""


async def test_one_error_logged_by_a_process_and_its_worker_then_raised_is_one_oom(tmp_path: Path) -> None:
    """A real process tree of one uid: the engine logs the message, its child (a worker) logs the same
    text, and the engine dies of it. One OOM, whoever's copy came first; the other two are duplicates."""
    agent, oom, out, sock, spool = _embedded_agent(tmp_path)
    await agent.start()
    try:
        rc, err = await _child(FAMILY, json.dumps(_given("srv-025")), sock, spool)
        assert rc == 1, err
        await agent.ingest.wait_connections_closed(10)
    finally:
        await agent.shutdown(10)
    recs = [r for r in log_records(read_otlp_lines(out)) if r.get("eventName") == "oom"]
    assert [attr(r, "infersight.oom.rule") for r in recs] == ["vllm.startup.free-below-utilization"]
    assert oom.handlers.duplicates == 2


CHILD_FLOODS = """
import logging, string, sys
logging.basicConfig(level=logging.INFO)
log = logging.getLogger("vllm.core.scheduler")
for i in range(300):   # one notice whose counters change: one text
    log.warning("Sequence group %d is preempted by PreemptionMode.RECOMPUTE mode because there is not "
                "enough KV cache space. total_num_cumulative_preemption=%d", i, i + 1)
letters = string.ascii_letters
for i in range(70):    # 70 warnings that differ in words: 63 fit the warnings' budget beside the notice
    log.warning("swap space of worker %s is low", letters[i % 52] * (1 + i // 52))
log.error(sys.argv[1])  # a memory error at ERROR: its own budget
"""


async def test_a_flood_of_warnings_neither_hides_a_memory_error_nor_goes_uncounted(tmp_path: Path) -> None:
    """A real agent: a process logs hundreds of warnings that hold a needle, then a memory error. The
    error is classified; the warnings over the budget are counted, and the agent's status says so."""
    agent, oom, out, sock, spool = _embedded_agent(tmp_path)
    await agent.start()
    try:
        rc, err = await _child(CHILD_FLOODS, _given("srv-025"), sock, spool)
        assert rc == 0, err
        await agent.ingest.wait_connections_closed(10)
        health = agent.health()
    finally:
        await agent.shutdown(10)
    recs = [r for r in log_records(read_otlp_lines(out)) if r.get("eventName") == "oom"]
    assert [attr(r, "infersight.oom.rule") for r in recs] == ["vllm.startup.free-below-utilization"]
    assert health["dropped_by_producers"] == 70 + 1 - _enginelog.MAX_REPORTS, health
    assert health["oom"]["classified"] == 1 and health["oom"]["over_budget"] == 0, health["oom"]


def test_hook_needles_match_the_rules() -> None:
    assert _enginelog.NEEDLES == serving.NEEDLES
    for rule in serving.builtin().rules:
        for ex in rule.examples:
            if ex.kind == "positive":
                assert _enginelog.interesting(ex.text), (rule.id, ex.text[:60])


class _Counted:
    """A log argument that counts how often a record holding it was formatted (the hook catches
    what getMessage raises, so a raising __str__ would prove nothing)."""

    formatted = 0

    def __str__(self) -> str:
        _Counted.formatted += 1
        return "cache blocks"  # a needle: formatted, it would be worth sending


def test_records_below_warning_are_not_even_formatted() -> None:
    saved = logging.Logger.callHandlers
    try:
        _enginelog.install_logging(logging)
        _enginelog.install_logging(logging)  # idempotent
        log = logging.getLogger("infersight-test-enginelog")
        log.propagate = False
        log.setLevel(logging.DEBUG)
        _Counted.formatted = 0
        log.info("%s", _Counted())  # no handler formats it, and neither does the hook
        assert _Counted.formatted == 0
    finally:
        logging.Logger.callHandlers = saved


def test_a_warning_is_not_formatted_while_the_hooks_are_off() -> None:
    """Hooks not active (no agent client, or failed): the wrapper adds one compare, as for INFO."""
    assert not _runtime.active()
    saved = logging.Logger.callHandlers
    try:
        _enginelog.install_logging(logging)
        log = logging.getLogger("infersight-test-enginelog-off")
        log.propagate = False
        log.handlers[:] = [logging.NullHandler()]  # a handler that formats nothing
        _Counted.formatted = 0
        log.warning("%s", _Counted())
        assert _Counted.formatted == 0
    finally:
        logging.Logger.callHandlers = saved


# -- launch: CMD's stderr ------------------------------------------------------------------------

CLI = [sys.executable, "-m", "infersight"]

CHILD_STDERR = """
import json, os, sys
msg = json.loads(sys.argv[1])
os.write(2, (msg + "\\n").encode())       # as native code writes it: fd 2, no Python logging
print("progress 50%", file=sys.stderr)   # ordinary output, copied through
sys.stderr.write(msg + "\\n")             # the same message again: classified once
"""


def _launch(tmp_path: Path, *cmd: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    out = tmp_path / "run.otlp.jsonl"
    env = dict(os.environ)
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(out), "--", *cmd],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    recs = [x for x in log_records(read_otlp_lines(out)) if x.get("eventName") == "oom"]
    return r, recs


def test_launch_classifies_a_python_child_writing_to_stderr(tmp_path: Path) -> None:
    msg = _given("srv-053")  # llama-cpp-python: three lines, one event
    r, recs = _launch(tmp_path, sys.executable, "-c", CHILD_STDERR, json.dumps(msg))
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("llama_kv_cache_init: failed to allocate buffer for kv cache") == 2  # copied through
    assert "progress 50%" in r.stderr
    (rec,) = recs
    assert attr(rec, "infersight.oom.engine") == "llama.cpp"
    assert attr(rec, "infersight.oom.class") == "capacity"
    assert attr(rec, "infersight.oom.source") == "stderr"
    assert int(attr(rec, "infersight.oom.R_bytes")) == 204800 << 20
    assert attr(rec, "infersight.oom.knob") == "n_ctx"


def test_launch_classifies_a_native_child_and_ignores_other_errors(tmp_path: Path) -> None:
    script = tmp_path / "engine.sh"
    script.write_text("#!/bin/sh\n"
                      "echo 'RuntimeError: CUDA error: an illegal memory access was encountered' >&2\n"
                      "echo 'Error: model requires more system memory (44.0 GiB) than is available (7.6 GiB)' >&2\n"
                      "exit 1\n", encoding="utf-8")
    script.chmod(0o755)
    r, recs = _launch(tmp_path, str(script))
    assert r.returncode == 1
    assert "illegal memory access" in r.stderr
    (rec,) = recs
    assert attr(rec, "infersight.oom.engine") == "ollama"
    assert attr(rec, "infersight.oom.class") == "capacity"
    assert int(attr(rec, "infersight.oom.R_bytes")) == 44 << 30


CUDA_OOM = "cudaMalloc failed: out of memory"
RETRIED = f"""ggml_backend_cuda_buffer_type_alloc_buffer: allocating 808.35 MiB on device 1: {CUDA_OOM}
ggml_gallocr_reserve_n: failed to allocate CUDA1 buffer of size 847617024
graph_reserve: failed to allocate compute buffers
sched_reserve: compute buffer allocation failed, retrying without pipeline parallelism
"""
RETRY_FAILED = f"""ggml_backend_cuda_buffer_type_alloc_buffer: allocating 408.09 MiB on device 1: {CUDA_OOM}
ggml_gallocr_reserve_n: failed to allocate CUDA1 buffer of size 427909632
graph_reserve: failed to allocate compute buffers
llama_init_from_model: failed to initialize the context: failed to allocate compute pp buffers
"""


def _launch_llama_server(tmp_path: Path, *stderr: str,
                         rc: int) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """``launch`` a fake llama-server that prints each of ``stderr`` on its stderr and exits with ``rc``."""
    script = tmp_path / "llama-server.sh"
    script.write_text("#!/bin/sh\n" + "".join("cat >&2 <<'EOF'\n%sEOF\n" % text for text in stderr) + "exit %d\n" % rc,
                      encoding="utf-8")
    script.chmod(0o755)
    return _launch(tmp_path, str(script))


@pytest.mark.parametrize("retry", ["recovered", "failed"])
def test_launch_reports_a_retried_llama_cpp_reservation_only_when_the_retry_fails(tmp_path: Path, retry: str) -> None:
    """llama.cpp with several GPUs retries a compute-buffer reservation without pipeline parallelism: the
    failure before that retry is no OOM; a retry that fails too is one, the retry's own request."""
    recovered = retry == "recovered"
    r, recs = _launch_llama_server(
        tmp_path, RETRIED, "main: server is listening on http://127.0.0.1:8080\n" if recovered else RETRY_FAILED,
        rc=0 if recovered else 1)
    assert "retrying without pipeline parallelism" in r.stderr  # copied through either way
    if retry == "recovered":
        assert r.returncode == 0 and recs == [], recs
        return
    assert r.returncode == 1
    (rec,) = recs
    assert attr(rec, "infersight.oom.engine") == "llama.cpp"
    assert int(attr(rec, "infersight.oom.R_bytes")) == 427909632


_KV_RETRY = "srv        decode: failed to find free space in the KV cache, retrying with smaller batch size, off = 0, "
KV_PURGED = ("decode: failed to find a memory slot for batch of size 2048\n"
             "srv  try_clear_id: purging slot 1 with 6143 tokens\n"
             f"{_KV_RETRY}n_batch = 2048, ret = 1\n")
KV_EXHAUSTED = ("decode: failed to find a memory slot for batch of size 2\n"
                f"{_KV_RETRY}n_batch = 1, ret = 1\n"
                "decode: failed to find a memory slot for batch of size 1\n"
                "srv        decode: Context size has been exceeded. off = 0, n_batch = 1, ret = 1\n")


@pytest.mark.parametrize("retry", ["recovered", "failed"])
def test_launch_reports_a_llama_cpp_kv_batch_only_when_no_slot_purge_or_halving_saved_it(tmp_path: Path,
                                                                                       retry: str) -> None:
    """llama-server with a shared KV cache purges an idle slot and retries a batch that found no free cells: no
    OOM; a batch that still finds none at one token fails the request, which is one (the last failure's)."""
    recovered = retry == "recovered"
    r, recs = _launch_llama_server(tmp_path, KV_PURGED, *(() if recovered else (KV_EXHAUSTED,)),
                                   rc=0 if recovered else 1)
    assert "purging slot 1 with 6143 tokens" in r.stderr  # copied through either way
    if retry == "recovered":
        assert r.returncode == 0 and recs == [], recs
        return
    assert r.returncode == 1
    (rec,) = recs
    assert attr(rec, "infersight.oom.engine") == "llama.cpp"
    assert attr(rec, "infersight.oom.rule") == "llama.cpp.kv-slots-full"
    assert "batch of size 1" in attr(rec, "infersight.oom.message")


def test_launch_counts_an_uncaught_pytorch_oom_once_though_stderr_repeats_it(tmp_path: Path) -> None:
    text = ("CUDA out of memory. Tried to allocate 1.70 GiB. GPU 0 has a total capacty of 6.00 GiB of which 0 bytes "
            "is free. Of the allocated memory 2.93 GiB is allocated by PyTorch, and 2.30 GiB is reserved by PyTorch "
            "but unallocated.")
    code = "import json, sys\nraise RuntimeError(json.loads(sys.argv[1]))\n"  # the traceback goes to stderr too
    r, recs = _launch(tmp_path, sys.executable, "-c", code, json.dumps(text))
    assert r.returncode == 1 and "Tried to allocate 1.70 GiB" in r.stderr
    (rec,) = recs
    assert attr(rec, "infersight.oom.class") == "fragmentation"
    assert attr(rec, "infersight.oom.engine") == "pytorch"


# JAX 0.11.2 on an H200 (bench/gpu_check_engines.py, XLA_PYTHON_CLIENT_MEM_FRACTION=0.10): the pool's limit is on
# stderr, 10 s before the error; the exception's text holds none of it.
XLA_STDERR = [
    "E1204 17:22:47.754138     910 gpu_hlo_schedule.cc:1068] The byte size of input/output arguments (30150964020) "
    "exceeds the base limit (15011414016). This indicates an error in the calculation!",
    "W1204 17:22:57.811386     910 bfc_allocator.cc:598] Allocator (GPU_0_bfc) ran out of memory trying to allocate "
    "28.08GiB (rounded to 30150964224) from the lower end requested by op ",
    "If this is caused by memory fragmentation, the environment variable 'TF_GPU_ALLOCATOR=cuda_malloc_async' may "
    "improve the situation.",
    "Current allocation summary follows.",
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 28.08GiB with allocator GPU_0_bfc on device 0. "
    "[executable_name='jit_broadcast_in_dim'] [tf-allocator-allocation-error='']",
]


# The hooks' copy reaches the agent first (flushed), the stderr copy 0.2 s later: as an uncaught exception's report
# comes before its traceback is printed.
HOOKS_FIRST = """import json, logging, sys, time
from infersight import hooks
lines = json.loads(sys.argv[1])
sys.stderr.write(lines[0] + "\\n"); sys.stderr.flush(); time.sleep(0.3)
log = logging.getLogger("jax._src.xla_bridge")
log.propagate = False
log.addHandler(logging.NullHandler())
log.error(lines[-1])  # the hooks' copy: the error's text alone
hooks.flush(5)
time.sleep(0.2)
sys.stderr.write("\\n".join(lines[1:]) + "\\n"); sys.stderr.flush()
"""


@pytest.mark.parametrize("order", ["hooks first", "uncaught"])
def test_launch_sends_the_stderr_copy_of_an_undecided_engine_error_the_hooks_reported(tmp_path: Path,
                                                                                       order: str) -> None:
    """JAX printed its pool's limit on stderr before the error; the hooks' copy (an exception's, a log record's) has
    none of it and is ``unknown`` by its own text: it waits for launch's stderr copy, and that one goes out."""
    code = HOOKS_FIRST if order == "hooks first" else (
        "import json, sys, time\nlines = json.loads(sys.argv[1])\n"
        "sys.stderr.write(lines[0] + '\\n'); sys.stderr.flush(); time.sleep(0.3)\n"
        "sys.stderr.write('\\n'.join(lines[1:-1]) + '\\n'); sys.stderr.flush()\n"
        "raise RuntimeError(lines[-1])\n")
    r, recs = _launch(tmp_path, sys.executable, "-c", code, json.dumps(XLA_STDERR))
    assert "exceeds the base limit" in r.stderr, r.stderr
    (rec,) = recs
    assert attr(rec, "infersight.oom.source") == "stderr"
    assert attr(rec, "infersight.oom.rule") == "xla.gpu.out-of-memory/over-pool-limit"
    assert int(attr(rec, "infersight.oom.L_bytes")) == 15011414016
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in str(attr(rec, "infersight.oom.reason"))


# -- the relay itself ------------------------------------------------------------------------------

def _run_through(relay: Any, code: str) -> int:
    got: list[str] = []
    p = subprocess.Popen([sys.executable, "-c", code], stderr=relay.child_fd)
    relay.started()
    relay.set_consumer(got.append)
    rc = p.wait(timeout=60)
    assert relay.wait_closed(30)
    relay.got = got
    return rc


def test_relay_needles_are_the_rules_needles() -> None:
    assert stderr_relay.NEEDLES == serving.NEEDLES


def test_the_docs_list_every_needle() -> None:
    """docs/oom_live.md and docs/oom_engines.md list the needles a user's message must hold (they listed 18 and
    21 of 22)."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    for name in ("oom_live.md", "oom_engines.md"):
        text = " ".join((docs / name).read_text(encoding="utf-8").split())
        missing = [n for n in serving.NEEDLES if "`%s`" % n not in text]
        assert not missing, (name, missing)
        assert "%d in all" % len(serving.NEEDLES) in text, name


def test_relay_keeps_every_line_a_rule_may_read_after_its_anchor() -> None:
    # else a stderr copy lacks numbers the exception's copy has, and the two count as two OOMs
    assert stderr_relay.AFTER_LINES >= serving.MAX_WINDOW_LINES - 1


def test_relay_says_when_a_capture_opens_before_its_text_comes() -> None:
    """launch loads the OOM rules when a capture opens: that call comes first, once a capture."""
    r, w = os.pipe()
    relay = stderr_relay.StderrRelay(out_fd=w)
    events: list[str] = []
    # before CMD starts: set later, a capture that opened meanwhile (a loaded machine may run this thread again
    # after CMD's first error) has told nobody, and its text waits as pending
    relay.set_consumer(lambda text: events.append("text"), lambda: events.append("open"))
    # CMD writes its second error once the first capture has ended (on the pause it makes, waiting for stdin):
    # two errors 0.3 s apart were one capture when the relay's thread ran late and read both at once
    p = subprocess.Popen([sys.executable, "-c", (
        "import os, sys\nos.write(2, b'starting\\n')\nsys.stdin.readline()\n"
        "os.write(2, b'RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.\\n')\n"
        "sys.stdin.readline()\nos.write(2, b'ValueError: No available memory for the cache blocks.\\n')\n")],
        stdin=subprocess.PIPE, stderr=relay.child_fd)
    relay.started()
    assert p.stdin is not None
    try:
        p.stdin.write(b"\n")
        p.stdin.flush()
        assert wait_for(lambda: len(events) >= 2, 30)  # the first capture ended, CMD still waiting
        assert events == ["open", "text"]
        p.stdin.write(b"\n")
        p.stdin.flush()
        assert p.wait(timeout=60) == 0
        assert relay.wait_closed(30)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(w)
        os.close(r)
    assert events == ["open", "text", "open", "text"]


# PyTorch 2.13's caching allocator warns on every failed cudaMalloc attempt, recovered ones included
# (pytorch#193195: thousands of lines while vLLM starts); with expandable segments, on every failed page mapping
_RETRY_WARNING = (b"[rank1]:[W812 16:00:28.643448608 CUDACachingAllocator.cpp:3933] memory allocation failed with OOM "
                  b"on device 1 while trying to allocate 20971520 bytes (free: 15794176, total: 150111977472).\n")
_MAP_RETRY_WARNING = (b"[rank4]:[W827 22:16:08.199727429 CUDACachingAllocator.cpp:508] expandable_segments: memory "
                      b"mapping failed with OOM on device 1 while trying to map 20971520 bytes (free: 17235968, total: "
                      b"150111977472).\n")


@pytest.mark.parametrize("warning", [_RETRY_WARNING, _MAP_RETRY_WARNING], ids=["cudaMalloc", "expandable-segments"])
@pytest.mark.parametrize("fails", [False, True])
def test_relay_opens_no_capture_for_the_allocators_recoverable_retry_warning(fails: bool, warning: bytes) -> None:
    r, w = os.pipe()
    relay = stderr_relay.StderrRelay(out_fd=w)
    texts: list[str] = []
    oom = (b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 1 has a total capacity "
           b"of 139.80 GiB of which 15.06 MiB is free.\n")
    code = f"import os\nfor _ in range(200): os.write(2, {warning!r})\n"
    if fails:
        code += f"os.write(2, {oom!r})\n"
    p = subprocess.Popen([sys.executable, "-c", code], stderr=relay.child_fd)
    relay.started()
    relay.set_consumer(texts.append)
    copied = b""
    try:
        assert p.wait(timeout=60) == 0
        assert relay.wait_closed(30)
        os.close(w)
        w = -1
        while chunk := os.read(r, 1 << 16):
            copied += chunk
    finally:
        if w >= 0:
            os.close(w)
        os.close(r)
    assert copied.count(warning) == 200  # copied through unchanged (under a pipe's 64 KiB)
    assert relay.memory_error_seen is fails and relay.captures == int(fails)
    if fails:
        (text,) = texts
        assert "Tried to allocate 20.00 MiB" in text
        assert serving.analyse(text)[0].message is not None  # the PyTorch message; the warnings before it are context
    else:
        assert texts == []


def test_relay_sleeps_while_cmd_is_quiet_and_no_capture_is_open() -> None:
    """With no capture open, the relay's thread waits for CMD's bytes, not for a pause: it does
    not wake up while CMD says nothing (it did 20 times a second). A capture still ends on a
    pause (PAUSE_S), as before: its text comes while CMD is still quiet."""
    r, w = os.pipe()
    relay = stderr_relay.StderrRelay(out_fd=w)
    texts: list[str] = []
    p = subprocess.Popen([sys.executable, "-c", (
        "import os, sys\nos.write(2, b'starting\\n')\nsys.stdin.readline()\n"
        "os.write(2, b'RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.\\n')\n"
        "sys.stdin.readline()\n")], stdin=subprocess.PIPE, stderr=relay.child_fd)
    relay.started()
    relay.set_consumer(texts.append)
    assert p.stdin is not None
    try:
        assert os.read(r, 4096) == b"starting\n"  # copied through
        n = relay.wakeups
        time.sleep(10 * stderr_relay.PAUSE_S)  # CMD quiet, no capture open
        assert relay.wakeups == n
        p.stdin.write(b"\n")
        p.stdin.flush()
        assert wait_for(lambda: len(texts) == 1, 30)  # ended by the pause, CMD still running
        assert p.poll() is None and "mem-fraction-static" in texts[0]
        p.stdin.write(b"\n")
        p.stdin.flush()
        assert p.wait(timeout=60) == 0
        assert relay.wait_closed(30)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(w)
        os.close(r)


def test_relay_keeps_reading_when_launch_stderr_is_gone() -> None:
    """Fault: launch's stderr is a pipe nobody reads any more. CMD must not block, and its
    memory error is still classified."""
    r, w = os.pipe()
    os.close(r)
    relay = stderr_relay.StderrRelay(out_fd=w)
    try:
        code = ("import os\nfor _ in range(64): os.write(2, b'x' * 16384 + b'\\n')\n"
                "os.write(2, b'RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.\\n')\n")
        assert _run_through(relay, code) == 0
    finally:
        os.close(w)
    assert relay.copy_errors > 0
    assert any("mem-fraction-static" in t for t in relay.got)


def test_relay_gives_cmd_a_terminal_of_launch_terminal_size() -> None:
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 123, 0, 0))
    relay = stderr_relay.StderrRelay(out_fd=slave)
    assert relay.tty
    try:
        code = "import os\nos.write(2, ('%s %d\\n' % (os.isatty(2), os.get_terminal_size(2).columns)).encode())\n"
        assert _run_through(relay, code) == 0
        out = os.read(master, 4096).decode()
    finally:
        os.close(master)
        os.close(slave)
    assert out.split() == ["True", "123"]


def test_hook_reports_once_and_never_waits(monkeypatch: Any) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []
    from infersight.hooks import _runtime

    monkeypatch.setattr(_runtime, "active", lambda: True)
    monkeypatch.setattr(_runtime, "emit_urgent", lambda kind, data: sent.append((kind, data)))
    monkeypatch.setattr(_enginelog, "_seen", {})
    text = "ValueError: No available memory for the cache blocks."
    assert _enginelog.report_text(text, "log")
    assert not _enginelog.report_text(text, "log")  # the same text: once
    assert not _enginelog.report_text("INFO: 200 OK", "log")  # no needle
    assert [k for k, _ in sent] == ["oom"] and sent[0][1]["source"] == "log"
    # Fault: another thread holds the lock (as a thread that did not survive a fork would).
    _enginelog._lock.acquire()
    try:
        assert not _enginelog.report_text(text + " again", "log")  # returns at once, nothing sent
    finally:
        _enginelog._lock.release()
    held = _enginelog._lock
    held.acquire()
    try:
        _enginelog.after_fork_child()  # the child gets a fresh lock and forgets what was sent
        assert _enginelog._lock is not held
        assert _enginelog.report_text(text, "log")
    finally:
        held.release()


def _fresh_budgets(monkeypatch: Any) -> list[tuple[str, dict[str, Any]]]:
    sent: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(_runtime, "active", lambda: True)
    monkeypatch.setattr(_runtime, "emit_urgent", lambda kind, data: sent.append((kind, data)))
    monkeypatch.setattr(_enginelog, "_seen", {})
    monkeypatch.setattr(_enginelog, "_sent", {"warning": 0, "error": 0})
    monkeypatch.setattr(_enginelog, "_refused", {})
    _enginelog.dropped[0] = 0  # (shared with the client: reset, not replaced)
    return sent


def test_a_flood_of_warnings_leaves_the_errors_budget_and_what_it_drops_is_counted(monkeypatch: Any) -> None:
    """vLLM's preemption notice holds a needle ("KV cache") and changes its ids and counts at every print:
    one text with its digits masked. Warnings that differ in words use up only the warnings' budget; a
    memory error logged at ERROR, or raised, still goes out; each text over budget is counted, and the
    count rides the client's drops report."""
    from infersight.hooks import _client

    sent = _fresh_budgets(monkeypatch)
    for i in range(200):
        _enginelog.report_text("WARNING 05-01 scheduler.py:1560] Sequence group %d is preempted by "
                               "PreemptionMode.RECOMPUTE mode because there is not enough KV cache space. "
                               "total_num_cumulative_preemption=%d" % (i, i + 1), "log", warning=True)
    assert len(sent) == 1  # one notice, whatever its counters
    for i in range(_enginelog.MAX_REPORTS + 10):
        _enginelog.report_text("WARNING: swap space of worker %s is low" % chr(65 + i % 26) * (1 + i // 26),
                               "log", warning=True)
    assert len(sent) == _enginelog.MAX_REPORTS and _enginelog.dropped[0] == 11
    assert _enginelog.report_text("ValueError: No available memory for the cache blocks.", "log")
    assert _enginelog.report_uncaught(RuntimeError("Not enough memory. Please try to increase --mem-fraction-static."))
    assert len(sent) == _enginelog.MAX_REPORTS + 2
    assert _client.TEXT_DROPS[0] == 11  # what the client's next drops report carries as "texts"


class _ErrorText:
    """A plain object whose text is the engine's error (a wrapper some servers log)."""

    def __str__(self) -> str:
        return "No available memory for the cache blocks."


class FakeTensor:
    """FAKE: stands in for a torch tensor (its module says torch): its text is never asked for."""

    __module__ = "torch"
    calls = 0

    def __str__(self) -> str:
        FakeTensor.calls += 1
        return "tensor(KV cache)"


@pytest.mark.parametrize(("msg", "args"), [
    ({"event": "engine failed: No available memory for the cache blocks."}, ()),   # structlog's dict message
    ("child stderr: %s", (b"CUDA error: out of memory\n",)),                        # captured bytes
    ("ranks failed: %s", ([RuntimeError("No available memory for the cache blocks.")],)),  # one per rank
    ("engine failed: %s", (_ErrorText(),)),                                          # an object's text
])
def test_memory_errors_in_every_shape_of_record_still_go_out(monkeypatch: Any, msg: Any, args: tuple) -> None:
    sent = _fresh_budgets(monkeypatch)
    record = logging.LogRecord("vllm", logging.ERROR, __file__, 1, msg, args, None)
    assert _enginelog.worth_formatting(record)
    _enginelog.report_text(_enginelog._record_text(record), "log")
    assert len(sent) == 1


def test_an_array_argument_is_never_made_a_string(monkeypatch: Any) -> None:
    _fresh_budgets(monkeypatch)
    FakeTensor.calls = 0
    record = logging.LogRecord("vllm", logging.WARNING, __file__, 1, "logits %s", (FakeTensor(),), None)
    assert not _enginelog.worth_formatting(record) and FakeTensor.calls == 0


class _CountedList(list):  # type: ignore[type-arg]
    """A list that counts the items iterated out of it."""

    stepped = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        for x in super().__iter__():
            _CountedList.stepped += 1
            yield x


def test_a_long_list_argument_is_looked_into_no_further_than_its_first_items(monkeypatch: Any) -> None:
    """A warning whose argument is a prompt's million token ids costs what one of sixteen does: the
    items past MAX_SCANNED_ARGS are not even stepped through (the check walked the whole list, 8 ms a
    warning at 200k items, in the request's thread)."""
    _fresh_budgets(monkeypatch)
    _CountedList.stepped = 0
    ids = _CountedList(range(1_000_000))
    record = logging.LogRecord("vllm", logging.WARNING, __file__, 1, "prompt token ids %s", (ids,), None)
    assert not _enginelog.worth_formatting(record)
    assert _CountedList.stepped <= _enginelog.MAX_SCANNED_ARGS + 1
    ids[3] = "No available memory for the cache blocks"
    record = logging.LogRecord("vllm", logging.WARNING, __file__, 1, "prompt token ids %s", (ids,), None)
    assert _enginelog.worth_formatting(record), "a needle among the first items is still found"


def test_a_text_over_budget_is_counted_once_however_often_it_repeats(monkeypatch: Any) -> None:
    _fresh_budgets(monkeypatch)
    monkeypatch.setitem(_enginelog._sent, "error", _enginelog.MAX_REPORTS)
    for _ in range(1000):
        _enginelog.report_text("ValueError: No available memory for the cache blocks.", "log")
    _enginelog.report_text("ValueError: No available memory for the cache blocks. (rank 1)", "log")
    assert _enginelog.dropped[0] == 2


class _Formats:
    """An object argument whose ``str`` counts (a CUDA tensor's synchronises the device)."""

    calls = 0

    def __str__(self) -> str:
        _Formats.calls += 1
        return "KV cache"


def test_a_warning_is_formatted_only_when_its_words_may_hold_a_needle(monkeypatch: Any) -> None:
    """With the hooks active, a WARNING+ record's format string and string arguments are checked first;
    an array argument (a tensor's text would synchronise the device) is not made a string unless they hold
    a needle; an exception argument is (its text is cheap) and a memory error in it goes out."""
    sent = _fresh_budgets(monkeypatch)
    saved = logging.Logger.callHandlers
    try:
        _enginelog.install_logging(logging)
        log = logging.getLogger("infersight-test-enginelog-cheap")
        log.propagate = False
        log.handlers[:] = [logging.NullHandler()]
        _Formats.calls = FakeTensor.calls = 0
        log.warning("step %d took %s", 3, FakeTensor())  # an array: never made a string for the check
        assert FakeTensor.calls == 0 and sent == []
        log.warning("KV cache usage %s", _Formats())  # the format string holds a needle: formatted
        assert _Formats.calls == 1 and len(sent) == 1
        log.error("engine failed: %s", RuntimeError("No available memory for the cache blocks."))
        assert len(sent) == 2 and "cache blocks" in sent[1][1]["text"]
    finally:
        logging.Logger.callHandlers = saved


# -- launch loads the OOM rules while a serving engine starts -------------------------------------

FAKE_RUNNER = """
import time


class GPUModelRunner:  # a stand-in for vLLM's (rules/stages.toml: vllm.load_model), no torch
    def load_model(self):
        time.sleep(0.05)
"""

FAKE_ENGINE = """
import logging, time
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

GPUModelRunner().load_model()
time.sleep(0.5)  # the memory profile
logging.getLogger("vllm.v1.engine.core").error(
    "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
    "initializing the engine.")
"""


def _fake_vllm(tmp_path: Path) -> None:
    pkg = tmp_path / "vllm"
    for sub in ("", "v1", "v1/worker", "entrypoints", "entrypoints/openai"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    # real vLLM's import takes seconds; launch's hold begins 50 ms after the spawn
    (pkg / "__init__.py").write_text("import time\ntime.sleep(0.2)\n")
    (pkg / "v1" / "worker" / "gpu_model_runner.py").write_text(FAKE_RUNNER)
    (pkg / "entrypoints" / "openai" / "api_server.py").write_text(FAKE_ENGINE)
    (tmp_path / "serve.py").write_text(FAKE_ENGINE)


@pytest.mark.parametrize(("cmd", "why"), [
    # a script that runs the engine: its import of vllm (it takes 0.2 s here) rings the held agent's doorbell
    (["serve.py"], "a process of CMD imported a serving engine's package"),
    (["-m", "vllm.entrypoints.openai.api_server"], "CMD is a serving engine (vllm.entrypoints.openai.api_server)"),
    # as a pod's command often reads: behind env and a shell
    (["env", "VLLM_LOGGING_LEVEL=INFO", "/bin/sh", "-c", "exec {python} -m vllm.entrypoints.openai.api_server"],
     "CMD is a serving engine (vllm.entrypoints.openai.api_server)"),
])
def test_launch_loads_the_oom_rules_when_cmd_is_a_serving_engine(tmp_path: Path, cmd: list[str],
                                                                 why: str | tuple[str, ...]) -> None:
    # an engine's memory errors come while it starts, before any readiness: the rules load early
    _fake_vllm(tmp_path)
    out = tmp_path / "run.otlp.jsonl"
    env = dict(os.environ, INFERSIGHT_LOG_LEVEL="DEBUG", PYTHONPATH=str(tmp_path))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    argv = [a.format(python=sys.executable) for a in cmd] if cmd[0] == "env" else [sys.executable, *cmd]
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(out), "--", *argv],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    whys = (why,) if isinstance(why, str) else why
    assert any("loading the OOM rules now: " + w in r.stderr for w in whys), r.stderr[-2000:]
    (rec,) = [x for x in log_records(read_otlp_lines(out)) if x.get("eventName") == "oom"]
    assert attr(rec, "infersight.oom.rule") == "vllm.kv.no-cache-blocks"
    # the logging hook's copy, or launch's stderr relay's when a loaded machine delays the hook's batch:
    # the same message is classified once, from whichever reached the agent first
    assert attr(rec, "infersight.oom.source") in ("log", "stderr")


EARLY_OOM = """
import logging, time
import sglang  # the engine's package: its import is a framework_import stage of its own

time.sleep(0.05)
import later  # a later import: the engine's import run is emitted
time.sleep(1.0)  # before any stage of the engine ended: the weights load
logging.getLogger("sglang.srt.managers.scheduler").error(
    "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.")
"""


def test_launch_loads_the_oom_rules_when_a_serving_engine_s_package_is_imported(tmp_path: Path) -> None:
    # the agent not held back (a terminal's console, or a hold that ended for another reason): the
    # framework_import stage that names the engine's package loads the rules
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import time\ntime.sleep(0.05)  # a stand-in for SGLang, no torch\n")
    (tmp_path / "later.py").write_text("import time\ntime.sleep(0.01)\n")
    (tmp_path / "early.py").write_text(EARLY_OOM)
    out = tmp_path / "run.otlp.jsonl"
    env = dict(os.environ, INFERSIGHT_LOG_LEVEL="DEBUG", PYTHONPATH=str(tmp_path))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    r = subprocess.run([*CLI, "launch", "--no-console", "--agent-hold", "0", "--otlp-file", str(out), "--",
                        sys.executable, "early.py"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "loading the OOM rules now: a serving engine's package was imported (sglang)" in r.stderr
    (rec,) = [x for x in log_records(read_otlp_lines(out)) if x.get("eventName") == "oom"]
    assert str(attr(rec, "infersight.oom.rule")).startswith("sglang.")


def test_launch_of_a_plain_script_loads_no_oom_rules_while_it_starts(tmp_path: Path) -> None:
    # hooks.flush() under the hold rings the plain doorbell: the agent starts, but no rules load for it
    (tmp_path / "job.py").write_text("import infersight.hooks as h\nh.flush()\nprint('done')\n")
    env = dict(os.environ, INFERSIGHT_LOG_LEVEL="DEBUG")
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(tmp_path / "o.jsonl"), "--",
                        sys.executable, "job.py"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "loading the OOM rules now" not in r.stderr


@pytest.mark.parametrize(("package", "why"), [("vllm", "engine"), ("tensorrt_llm", "engine"),
                                              ("notanengine", "exited")])
def test_an_engine_s_import_ends_launch_s_hold_on_its_agent(tmp_path: Path, package: str, why: str) -> None:
    # a single-process engine from a script: its memory errors come while it starts, so the agent starts
    # on the engine's import rather than at the OOM's doorbell; any other package leaves the hold as it was
    pkg = tmp_path / package
    pkg.mkdir()
    # an engine's import takes seconds; the hold begins 50 ms after the spawn
    (pkg / "__init__.py").write_text("import time\ntime.sleep(0.2)\n")
    (tmp_path / "job.py").write_text(f"import time\nimport {package}\ntime.sleep(1.5)\n")
    env = dict(os.environ, INFERSIGHT_LOG_LEVEL="DEBUG", PYTHONPATH=str(tmp_path))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(tmp_path / "o.jsonl"), "--",
                        sys.executable, "job.py"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"the agent starts: launch held it back until {why}" in r.stderr, r.stderr[-2000:]



def _relay_run(code: str) -> tuple[stderr_relay.StderrRelay, list[str]]:
    """CMD (``python -c code``) writing to a relay; the texts it handed over."""
    r, w = os.pipe()
    relay = stderr_relay.StderrRelay(out_fd=w)
    texts: list[str] = []
    p = subprocess.Popen([sys.executable, "-c", code], stderr=relay.child_fd)
    relay.started()
    relay.set_consumer(texts.append)
    done = threading.Event()

    def drain() -> None:  # launch's stderr, read so that CMD never blocks on it
        while os.read(r, 1 << 16):
            pass
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert p.wait(timeout=60) == 0
        assert relay.wait_closed(30)
    finally:
        os.close(w)
        done.wait(10)
        os.close(r)
    return relay, texts


_GGML_OOM = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 8900.01 MiB on device 0: cudaMalloc failed: "
             "out of memory")


def test_relay_hands_over_a_busy_stream_in_pieces_the_agent_reads_whole() -> None:
    """A server that logs needle lines without a pause (llama-server's slot and KV-cache lines), then a
    memory error: the capture never grows past what the agent reads, so the error at its end is read."""
    code = ("import os, time\n"
            "for i in range(600):\n"
            "    os.write(2, b'slot update_slots: id  0 | task %d | kv cache rm [%d, end)\\n' % (i, i))\n"
            f"os.write(2, {(_GGML_OOM + chr(10)).encode()!r})\n")
    relay, texts = _relay_run(code)
    assert all(len(t) <= stderr_relay.MAX_CAPTURE_CHARS for t in texts), [len(t) for t in texts]
    found = [f.rule for t in texts for f in serving.analyse(t)]
    assert "ggml.cuda-error" in found or "llama.cpp.cuda-buffer" in found, found


def test_relay_reads_the_end_of_a_line_longer_than_its_limit() -> None:
    """One JSON log record of 23 KB whose message ends in the error: the line keeps its head and its tail."""
    code = ("import json, os\n"
            f"rec = json.dumps({{'ctx': 'x' * 23000, 'msg': {_GGML_OOM!r}}})\n"
            "os.write(2, rec.encode() + b'\\n')\n")
    relay, texts = _relay_run(code)
    from infersight.agent.oom.kind import MAX_TEXT

    assert relay.captures == 1 and "cudaMalloc failed: out of memory" in texts[0][:MAX_TEXT]  # what the agent reads


def _fed(chunks: list[bytes]) -> tuple[stderr_relay.StderrRelay, list[str]]:
    """A relay fed directly (its reading thread's own steps), then closed: the texts it handed over."""
    relay = stderr_relay.StderrRelay(out_fd=os.open(os.devnull, os.O_WRONLY))
    texts: list[str] = []
    relay.set_consumer(texts.append)
    for c in chunks:
        relay._scan(c)
    relay._flush_capture()
    return relay, texts


_TRT_WARN = ("[TensorRT-LLM][WARNING] kv cache block reuse: %05d blocks evicted from the KV cache to make room for "
             "new requests\n")
_TRT_ERR = ("RuntimeError: Executor creation failed due to insufficient GPU memory.\n\nThe following component could "
            "not be created: Model\nTotal GPU memory (GiB): 79.11\nFree GPU memory before component creation attempt "
            "(GiB): 78.52\n\nPreviously created components and free GPU memory before/after creation (GiB):\n")


def test_relay_keeps_a_multi_line_error_in_one_capture_when_it_fills_one() -> None:
    """A needle stream fills a capture just as a multi-line error comes: the capture is handed over short of the
    error's lines, which start the next one, so the error is read whole, once."""
    lines = [(_TRT_WARN % i).encode() for i in range(
        (stderr_relay.MAX_CAPTURE_CHARS - 200) // len(_TRT_WARN % 0))]
    relay, texts = _fed([*lines, _TRT_ERR.encode()])
    found = [(f.rule, f.cls) for t in texts for f in serving.analyse(t)]
    assert found == [("tensorrt-llm.executor.insufficient-memory/model-exceeds-device", "capacity")], found
    assert all(len(t) <= stderr_relay.MAX_CAPTURE_CHARS for t in texts)


class _StoppedClock:
    """FAKE ``time`` for the relay: every handover falls in the same second, whatever the host's speed."""

    @staticmethod
    def monotonic() -> float:
        return 1000.0


def test_relay_rolling_past_its_rate_keeps_the_line_that_reports_the_failure(monkeypatch: Any) -> None:
    """Past MAX_FULL_PER_S full captures a second the relay rolls instead of handing over; a line that reports
    a failure is kept while the notices around it go, so the error is still read at the stream's end."""
    monkeypatch.setattr(stderr_relay, "time", _StoppedClock)
    warn = (b"WARNING 05-01 scheduler.py:1560] Sequence group %d is preempted by PreemptionMode.RECOMPUTE mode "
            b"because there is not enough KV cache space.\n")
    before = [warn % i for i in range(2000)]
    after = [warn % i for i in range(2000, 2200)]
    relay, texts = _fed([*before, (_GGML_OOM + "\n").encode(), *after])
    assert relay.rolled_lines > 0
    assert any("cudaMalloc failed: out of memory" in t for t in texts)
    assert [f.rule for t in texts for f in serving.analyse(t)] == ["llama.cpp.cuda-buffer"]


def test_an_engines_sizing_lines_at_info_go_with_its_error(monkeypatch: Any) -> None:
    """vLLM logs its memory profiling at INFO and then raises 'No available memory for the cache blocks': the
    error alone leaves the fraction and the sizes out. The hook keeps the engine loggers' sizing lines and sends
    them before the error, so the live verdict reads what `infersight classify` reads in the whole log."""
    sent = _fresh_budgets(monkeypatch)
    if _enginelog._context is not None:
        _enginelog._context.clear()
    saved = logging.Logger.callHandlers
    try:
        _enginelog.install_logging(logging)
        log = logging.getLogger("vllm.worker.worker")
        log.propagate = False
        log.handlers[:] = [logging.NullHandler()]
        log.setLevel(logging.INFO)
        log.info("Received request %s", "cmpl-1")  # no sizing words: not kept
        log.info("the current vLLM instance can use total_gpu_memory (%.2fGiB) x gpu_memory_utilization (%.2f) = "
                 "%.2fGiB", 8.0, 0.7, 5.6)
        log.info("model weights take 5.20GiB; non_torch_memory takes 0.03GiB; PyTorch activation peak memory takes "
                 "1.42GiB; the rest of the memory reserved for KV Cache is -1.05GiB.")
        logging.getLogger("myapp").info("cache memory stats: fine")  # not an engine's logger: not kept
        log.error("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                  "when initializing the engine.")
    finally:
        logging.Logger.callHandlers = saved
    (kind_, data), = sent
    ctx = data["ctx"]
    assert "gpu_memory_utilization (0.70)" in ctx and "Received request" not in ctx
    assert "cache memory stats" not in ctx and "No available memory" in data["text"]
    (f,) = serving.analyse(ctx + "\n" + data["text"])  # as the agent reads it
    assert (f.rule, f.cls) == ("vllm.kv.no-cache-blocks/fraction", "reservation_conflict"), (f.rule, f.cls)
    (alone,) = serving.analyse(data["text"])
    assert alone.rule == "vllm.kv.no-cache-blocks"  # what the error alone gives: no numbers


def test_kept_sizing_lines_are_read_for_numbers_never_as_an_error(tmp_path: Path) -> None:
    """A real agent: a worker's profiling lines said its KV share was negative (kept as context), and a later,
    unrelated PyTorch OOM is logged: the agent classifies the OOM, not the stale context; the periodic stats
    line ('GPU KV cache usage') is not kept; a logger that only starts like an engine's is not read."""
    import asyncio

    code = """
import logging, sys
logging.basicConfig(level=logging.INFO)
log = logging.getLogger("vllm.worker.worker")
log.info("the current vLLM instance can use total_gpu_memory (8.00GiB) x gpu_memory_utilization (0.70) = 5.60GiB")
log.info("model weights take 5.20GiB; non_torch_memory takes 0.03GiB; PyTorch activation peak memory takes "
         "1.42GiB; the rest of the memory reserved for KV Cache is -1.05GiB.")
for i in range(20):
    logging.getLogger("vllm.engine.metrics").info("Avg prompt throughput: 1.0 tokens/s, GPU KV cache usage: 3.1%%")
logging.getLogger("vllm_bench_client").info("model weights take 99GiB")
log.error(sys.argv[1])
"""
    oom_text = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.70 GiB. GPU 0 has a total capacity of "
                "7.79 GiB of which 0 bytes is free. Including non-PyTorch memory, this process has 7.79 GiB memory in "
                "use. Of the allocated memory 2.93 GiB is allocated by PyTorch, and 2.30 GiB is reserved by PyTorch "
                "but unallocated.")

    async def run() -> list[dict[str, Any]]:
        agent, _oom, out, sock, spool = _embedded_agent(tmp_path)
        await agent.start()
        try:
            rc, err = await _child(code, oom_text, sock, spool)
            assert rc == 0, err
            await agent.ingest.wait_connections_closed(10)
        finally:
            await agent.shutdown(10)
        return [r for r in log_records(read_otlp_lines(out)) if r.get("eventName") == "oom"]

    (rec,) = asyncio.run(run())
    assert attr(rec, "infersight.oom.class") == "fragmentation"  # the OOM's own numbers: 2.30 GiB cached
    assert attr(rec, "infersight.oom.engine") == "vllm"


def test_relay_never_lets_an_error_line_go_unsent_to_make_room() -> None:
    """An error line, then lines that fill the capture at once (one near 16 KiB, or a dozen of 2 KiB): the
    capture is handed over before them, never trimmed, so the error reaches the agent."""
    big = b'{"ctx": "' + b"x" * 16000 + b'"}\n'
    mid = [b"progress " + b"y" * 2000 + b"\n"] * 12
    for tail in ([big], mid):
        relay, texts = _fed([(_GGML_OOM + "\n").encode(), *tail])
        assert any("cudaMalloc failed: out of memory" in t for t in texts), [len(t) for t in texts]
        assert all(len(t) <= stderr_relay.MAX_CAPTURE_CHARS for t in texts)


def test_an_engine_error_wrapped_by_another_exception_is_sent_with_its_cause(monkeypatch: Any) -> None:
    """vLLM's engine core raises ``RuntimeError: Engine core initialization failed`` from the memory error:
    the uncaught exception's text names no memory, its cause does (review finding: nothing was sent)."""
    sent = _fresh_budgets(monkeypatch)
    try:
        try:
            raise ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization`.")
        except ValueError as exc:
            raise RuntimeError("Engine core initialization failed. See root cause above.") from exc
    except RuntimeError as outer:
        wrapped = outer
    assert _enginelog.report_uncaught(wrapped)
    ((kind, data),) = sent
    assert kind == "oom" and data["source"] == "exception"
    assert data["text"] == ("ValueError: No available memory for the cache blocks. Try increasing "
                            "`gpu_memory_utilization`.\nRuntimeError: Engine core initialization failed. See root "
                            "cause above.")
    # a link already reported (a PyTorch OOM the allocator hooks sent) is left out; an unrelated one alone sends nothing
    inner = ValueError("KV cache is full")
    inner._infersight_reported = True  # type: ignore[attr-defined]
    outer2 = RuntimeError("worker died")
    outer2.__cause__ = inner
    assert not _enginelog.report_uncaught(outer2)
    assert len(sent) == 1


CHILD_TP_WORKERS = """
import json, logging, multiprocessing as mp, sys

def worker(msg):
    logging.getLogger("vllm.worker").error(msg)

if __name__ == "__main__":
    msg = json.loads(sys.argv[1])
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(msg,)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
"""


async def test_tensor_parallel_workers_logging_the_same_error_are_one_oom(tmp_path: Path) -> None:
    """Two workers of one engine (children of one parent, in its trace) log the same memory error each: one OOM
    (review finding: one per worker); two unrelated runs of the same program still get one each."""
    agent, oom, out, sock, spool = _embedded_agent(tmp_path)
    await agent.start()
    msg = "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`."
    script = tmp_path / "engine.py"  # (spawn re-imports the parent's main module: a file, not -c)
    script.write_text(CHILD_TP_WORKERS)
    try:
        for _ in range(2):
            rc, err = await _child("import runpy, sys; sys.argv[0] = %r; runpy.run_path(%r, run_name='__main__')"
                                   % (str(script), str(script)), json.dumps(msg), sock, spool)
            assert rc == 0, err
        await agent.ingest.wait_connections_closed(10)
    finally:
        await agent.shutdown(10)
    recs = [r for r in log_records(read_otlp_lines(out)) if r.get("eventName") == "oom"]
    assert len(recs) == 2, [r["body"] for r in recs]  # one per run, not one per worker
    assert oom.handlers.duplicates >= 2


@pytest.mark.parametrize("split", [None, 7, 30])
def test_relay_skips_chunks_without_a_needle_and_keeps_their_last_lines_as_context(split: int | None) -> None:
    """A chunk with no needle and no capture open is not read line by line (the relay took 2.4x longer than the
    copy alone over 200k plain lines): its last lines still come before the error as context, and a needle cut
    between two reads ('memo' | 'ry') still opens the capture."""
    plain = b"".join(b"INFO step %d: 12 tokens/s\n" % i for i in range(200))
    err = (_GGML_OOM + "\n").encode()
    chunks = [plain, err] if split is None else [plain + err[:split], err[split:]]
    relay, texts = _fed(chunks)
    (text,) = texts
    lines = text.splitlines()
    assert lines[-1] == _GGML_OOM
    assert lines[:-1] == ["INFO step %d: 12 tokens/s" % i for i in range(200 - stderr_relay.CONTEXT_LINES, 200)]
    _, none = _fed([plain, plain])
    assert none == []
