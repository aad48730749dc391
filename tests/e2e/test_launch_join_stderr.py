"""A joined launch hands the agent its CMD's stderr captures (review finding: a joined launch dropped them).

Real ``infersight agent`` processes and real ``infersight launch`` runs joined to them. Native
engines print their memory errors on file descriptor 2, where no hook sees them: under launch's
own agent the relay's captures were classified, but a launch that joined a running agent (the
README's fleet setup) let them go, so llama.cpp's, ollama's and TensorRT-LLM's OOMs reached no
sink. Now each capture goes to the agent on the subscription; the agent's sink records one OOM,
as CMD's, and launch prints its line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import attr, read_otlp_lines, wait_for
from test_launch_join import CLI, launch_env

LLAMA = (
    "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 45108.64 MiB on device 0: "
    "cudaMalloc failed: out of memory\n"
    "alloc_tensor_range: failed to allocate CUDA0 buffer of size 47299347456\n"
    "llama_model_load: error loading model: unable to allocate CUDA0 buffer\n"
)
# CMD writes on fd 2 from C-level writes, as a native engine does (no Python hook sees it)
NATIVE = "import os, sys\nos.write(2, sys.argv[1].encode())\nsys.exit(int(sys.argv[2]))\n"


def ooms(path: Path) -> list[dict[str, object]]:
    """The OOM log records of an OTLP file, each with its resource's attributes under ``resource``."""
    if not path.exists():
        return []
    return [{**rec, "resource": rl["resource"]} for req in read_otlp_lines(path) for rl in req.get("resourceLogs", [])
            for sl in rl["scopeLogs"] for rec in sl["logRecords"] if rec.get("eventName") == "oom"]


def res(rec: dict[str, object], key: str) -> object:
    return attr(rec["resource"], key)  # type: ignore[arg-type]


def test_a_native_engine_oom_on_stderr_reaches_the_joined_agents_sinks(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    script = tmp_path / "engine.py"
    script.write_text(NATIVE)
    env = launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock), INFERSIGHT_SPOOL_DIR=str(agent.spool))
    r = subprocess.run([*CLI, "launch", "--", sys.executable, str(script), LLAMA, "1"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "reporting to the agent at %s" % agent.sock in r.stderr
    assert "cudaMalloc failed: out of memory" in r.stderr  # CMD's own output, copied through
    assert wait_for(lambda: bool(ooms(agent.out)), 20), r.stderr
    (rec,) = ooms(agent.out)
    assert attr(rec, "infersight.oom.engine") == "llama.cpp"
    assert attr(rec, "infersight.oom.source") == "stderr"
    assert attr(rec, "infersight.oom.class") == "capacity"
    # as CMD's own (its hooked Python's producer), not a stand-in
    assert res(rec, "process.pid") is not None
    # launch printed the agent's verdict, and the same rule as `infersight classify` on the same text
    c = subprocess.run([*CLI, "classify", "--json", "-"], input=LLAMA, capture_output=True, text=True, timeout=60)
    assert c.returncode == 0, c.stderr
    rule = json.loads(c.stdout)["rule"]
    assert attr(rec, "infersight.oom.rule") == rule
    assert "OOM [llama.cpp]: capacity by rule %s" % rule in r.stderr, r.stderr[-3000:]


def test_an_unhooked_cmd_gets_a_producer_that_stands_for_it(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """CMD is no Python at all (a shell script's printf): the capture is of a producer standing for CMD, with
    the kernel's uid and CMD's pid (launch's own child). CMD exits at once, as an engine that fails its load
    does: the agent learnt it was launch's child from the ``cmd`` frame sent at its spawn, before its capture."""
    agent = agent_factory().start()
    env = launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock), INFERSIGHT_SPOOL_DIR=str(agent.spool),
                     OTEL_SERVICE_NAME="llama-server")
    r = subprocess.run([*CLI, "launch", "--", "sh", "-c", 'printf "%s" "$1" >&2', "sh", LLAMA],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert wait_for(lambda: bool(ooms(agent.out)), 20), r.stderr
    (rec,) = ooms(agent.out)
    assert attr(rec, "infersight.oom.engine") == "llama.cpp"
    assert res(rec, "service.name") == "llama-server"
    assert int(str(res(rec, "process.user.id"))) == os.getuid()  # (OTLP JSON writes an int as a string)
    assert int(str(res(rec, "process.pid"))) > 1
    assert "OOM [llama.cpp]: capacity" in r.stderr, r.stderr[-3000:]


def test_a_repeated_error_is_one_oom_and_non_memory_errors_none(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    script = tmp_path / "engine.py"
    script.write_text(NATIVE)
    noise = ("RuntimeError: CUDA error: an illegal memory access was encountered\n"
             "[E ProcessGroupNCCL.cpp:475] Watchdog caught collective operation timeout\n")
    text = noise + LLAMA * 5
    env = launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock), INFERSIGHT_SPOOL_DIR=str(agent.spool))
    r = subprocess.run([*CLI, "launch", "--", sys.executable, str(script), text, "0"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert wait_for(lambda: bool(ooms(agent.out)), 20), r.stderr
    assert wait_for(lambda: agent.status().get("subscribers") == 0, 10)
    assert len(ooms(agent.out)) == 1, ooms(agent.out)
    assert r.stderr.count("OOM [llama.cpp]") == 1, r.stderr[-3000:]


# A hooked engine logs an undecided error (TensorRT-LLM's runtime error, srv-044 of the given sample): the
# agent holds the hooks' copy a little for the relay's, which carries what the engine printed around it
LOGS = """
import json, logging, sys
logging.basicConfig(stream=sys.stderr if sys.argv[2] == "stderr" else sys.stdout)
logging.getLogger("tensorrt_llm").error(json.loads(sys.argv[1]))
"""


def given(rid: str) -> str:
    path = Path(__file__).resolve().parents[1] / "support" / "data" / "serving_ooms_given.jsonl"
    return next(str(d["message"]) for d in map(json.loads, path.read_text().splitlines()) if d["id"] == rid)


def test_a_logged_engine_error_is_one_oom_whether_or_not_it_reached_stderr(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    script = tmp_path / "engine.py"
    script.write_text(LOGS)
    env = launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock), INFERSIGHT_SPOOL_DIR=str(agent.spool))
    sources = []
    for stream in ("stderr", "stdout"):
        before = len(ooms(agent.out))
        r = subprocess.run([*CLI, "launch", "--", sys.executable, str(script), json.dumps(given("srv-044")), stream],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        # launch got the verdict back before the session ended: the held copy went out at the session's end
        assert r.stderr.count("OOM [tensorrt-llm]") == 1, r.stderr[-3000:]
        assert wait_for(lambda: len(ooms(agent.out)) > before, 20), r.stderr  # noqa: B023
        assert wait_for(lambda: agent.status().get("subscribers") == 0, 10)
        new = ooms(agent.out)[before:]
        assert len(new) == 1, new
        sources.append(attr(new[0], "infersight.oom.source"))
    # on stderr, the relay's copy replaced the hooks' (what the engine printed around it); else the hooks' own
    assert sources == ["stderr", "log"]


def test_launch_with_its_own_agent_prints_the_verdict_too(tmp_path: Path) -> None:
    script = tmp_path / "engine.py"
    script.write_text(NATIVE)
    out = tmp_path / "run.otlp.jsonl"
    r = subprocess.run([*CLI, "launch", "--agent", "embedded", "--otlp-file", str(out), "--", sys.executable,
                        str(script), LLAMA, "0"], cwd=tmp_path, env=launch_env(tmp_path), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (rec,) = ooms(out)
    line = next(x for x in r.stderr.splitlines() if "OOM [llama.cpp]" in x)
    assert line == "infersight: pid %s: %s" % (res(rec, "process.pid"), rec["body"]["stringValue"])  # type: ignore[index]


# CMD exits at once; a child it left running (stderr inherited) prints the error once launch has asked the agent
# for the session's end
LEFT_BEHIND = """
import os, sys, time
if os.fork() == 0:
    time.sleep(3.5)  # past launch's 2 s wait for CMD's stderr to close (RELAY_CLOSE_WAIT_S), well within its 10 s flush
    os.write(2, sys.argv[1].encode())
    os._exit(0)
"""


def test_a_memory_error_printed_after_the_sessions_end_is_said_not_counted_as_sent(
        tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """After CMD exits, launch waits 2 s for its stderr to close, then asks the agent for the session's end; the
    agent reads no more of the subscription. A capture made after that was written anyway and lost unsaid
    (review finding): launch now says how many it could not hand over."""
    agent = agent_factory().start()
    script = tmp_path / "left.py"
    script.write_text(LEFT_BEHIND)
    env = launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock), INFERSIGHT_SPOOL_DIR=str(agent.spool))
    r = subprocess.run([*CLI, "launch", "--", sys.executable, str(script), LLAMA], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "cudaMalloc failed: out of memory" in r.stderr  # still copied through
    assert "1 memory error(s) printed on CMD's stderr after CMD exited" in r.stderr, r.stderr[-3000:]
