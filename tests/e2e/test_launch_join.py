"""``launch --agent auto|embedded|PATH`` (issue 21, point 3): launch joins a running agent.

Real ``infersight agent`` processes and real ``infersight launch`` runs, as a user types them.
When an agent answers on ``INFERSIGHT_SOCKET`` and accepts this uid, CMD's hooks report to it
(its sink records them), launch still prints the waterfall from the session's subscription
and exits with CMD's status; otherwise launch embeds its own agent as before. An agent killed
mid-run loses nothing: the hooks spool and replay, launch re-subscribes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import attr, read_otlp_lines, spans, wait_for
from short_tmp import short_tmpdir

CLI = [sys.executable, "-m", "infersight"]

# CMD: three stages, between which the test acts (kills the agent, starts it again).
WORKLOAD = """\
import os, sys, time
from infersight import hooks
d = sys.argv[1]
def wait(name):
    while not os.path.exists(os.path.join(d, name)):
        time.sleep(0.01)
with hooks.stage("before"):
    pass
open(os.path.join(d, "m1"), "w").close()
wait("go1")
with hooks.stage("during"):
    pass
open(os.path.join(d, "m2"), "w").close()
wait("go2")
with hooks.stage("after"):
    pass
sys.exit(int(sys.argv[2]))
"""


def launch_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_EXPORTER_OTLP", "INFERSIGHT_SOCKET"))}
    # launch's private directory in a TMPDIR of this test only (leftovers of other runs stay out)
    tmpdir = short_tmpdir(str(tmp_path), "isj-")
    e.update({"TMPDIR": tmpdir, "INFERSIGHT_MEASURE_STORAGE": "0", "INFERSIGHT_SPOOL_DIR": str(tmp_path / "spool"),
              **extra})
    return e


def start_launch(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, "launch", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def names(path: Path) -> list[str]:
    return [s["name"] for s in spans(read_otlp_lines(path))] if path.exists() else []


def test_auto_joins_the_running_agent(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    (tmp_path / "go1").touch()
    (tmp_path / "go2").touch()
    script = tmp_path / "w.py"
    script.write_text(WORKLOAD)
    env = launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock), INFERSIGHT_SPOOL_DIR=str(agent.spool))
    r = subprocess.run([*CLI, "launch", "--", sys.executable, str(script), str(tmp_path), "3"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert "reporting to the agent at %s" % agent.sock in r.stderr
    assert "sinks: file %s" % agent.out in r.stderr
    assert "infersight cold start:" in r.stderr and "after" in r.stderr, r.stderr  # the waterfall
    assert not list(tmp_path.glob("infersight-*.otlp.jsonl")), "joined: no local file unless --otlp-file"
    # The agent's sink has CMD's cold start: its root and every stage, once.
    assert wait_for(lambda: "coldstart" in names(agent.out), 20)
    got = names(agent.out)
    for stage in ("before", "during", "after"):
        assert got.count("coldstart." + stage) == 1, got
    assert agent.status()["events_in"] > 0 and agent.status()["subscribers"] == 0


def test_a_joined_launch_ends_saying_where_its_events_went(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """The quick start's ``infersight show <file>`` needs the local file that a joined launch does not
    write: the summary's last line says so, where the events went, and how to get a file."""
    agent = agent_factory().start()
    r = subprocess.run([*CLI, "launch", "--", sys.executable, "-c", "pass"], cwd=tmp_path,
                       env=launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock)), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.endswith(
        "infersight: no local file written; events went to the agent at %s (its sinks: file %s; --otlp-file PATH "
        "writes a local copy too)\n" % (agent.sock, agent.out)), r.stderr[-2000:]
    assert not list(tmp_path.glob("infersight-*.otlp.jsonl"))


def test_joined_with_otlp_file_writes_a_local_copy_too(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    out = tmp_path / "local.otlp.jsonl"
    code = "from infersight import hooks\nwith hooks.stage('warmup'):\n    pass\n"
    r = subprocess.run([*CLI, "launch", "--otlp-file", str(out), "--", sys.executable, "-c", code],
                       cwd=tmp_path, env=launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "reporting to the agent" in r.stderr and "wrote %s" % out in r.stderr
    local = [s for s in spans(read_otlp_lines(out)) if s["name"] == "coldstart"]
    assert wait_for(lambda: "coldstart" in names(agent.out), 20)
    remote = [s for s in spans(read_otlp_lines(agent.out)) if s["name"] == "coldstart"]
    assert [s["spanId"] for s in local] == [s["spanId"] for s in remote], "the same root, in both"


def test_no_agent_answering_means_an_embedded_agent(tmp_path: Path) -> None:
    """A socket file with nobody listening (an agent that died): launch says so and embeds."""
    import socket

    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # bound, never listening: connect() is refused
    r = subprocess.run([*CLI, "launch", "--agent-wait", "0", "--", sys.executable, "-c", "pass"], cwd=tmp_path,
                       env=launch_env(tmp_path, INFERSIGHT_SOCKET=str(stale)), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no agent answers at %s" % stale in r.stderr and "running an embedded agent" in r.stderr
    assert len(list(tmp_path.glob("infersight-*.otlp.jsonl"))) == 1


def test_a_socket_directory_without_its_socket_is_said_a_workstation_without_one_is_not(tmp_path: Path) -> None:
    """The default socket's directory there (a host with the service installed but stopped: its tmpfiles.d
    directory, here XDG_RUNTIME_DIR's) and no socket in it: launch says why it embeds (a README walkthrough
    found it silent, as docs/operations.md promised otherwise). No directory at all, the workstation case:
    nothing is said."""
    from infersight.hooks import _paths

    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = launch_env(tmp_path, XDG_RUNTIME_DIR=str(runtime))
    path = _paths.socket_path({k: v for k, v in env.items() if k != "INFERSIGHT_SOCKET"})
    if not path.startswith(str(runtime)):
        pytest.skip("this machine has %s: the default socket is not XDG_RUNTIME_DIR's" % path)
    r = subprocess.run([*CLI, "launch", "--", sys.executable, "-c", "pass"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "infersight:" not in r.stderr.replace("infersight: wrote", ""), r.stderr
    (runtime / "infersight").mkdir(mode=0o700)
    r = subprocess.run([*CLI, "launch", "--", sys.executable, "-c", "pass"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no agent listens at %s (no socket)" % path in r.stderr and "running an embedded agent" in r.stderr, \
        r.stderr


def test_an_agent_that_refuses_this_uid_means_an_embedded_agent(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    agent.stop()
    agent.config.write_text(agent.config.read_text().replace(
        "[agent]\n", "[agent]\nallowed_uids = [4242]\nallowed_gids = [4242]\n"))
    agent.start()
    r = subprocess.run([*CLI, "launch", "--", sys.executable, "-c", "pass"], cwd=tmp_path,
                       env=launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock)), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "does not take this launch: uid %d is not allowed" % os.getuid() in r.stderr
    assert "running an embedded agent" in r.stderr
    assert len(list(tmp_path.glob("infersight-*.otlp.jsonl"))) == 1


def test_agent_embedded_never_joins(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    r = subprocess.run([*CLI, "launch", "--agent", "embedded", "--", sys.executable, "-c",
                        "import os; print(os.environ['INFERSIGHT_SOCKET'])"], cwd=tmp_path,
                       env=launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock)), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "infersight-launch-" in r.stdout and "reporting to the agent" not in r.stderr
    assert agent.status()["events_in"] == 0


def test_agent_path_joins_that_agent_or_fails_before_cmd(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    env = launch_env(tmp_path)  # no INFERSIGHT_SOCKET: the path names the agent
    r = subprocess.run([*CLI, "launch", "--agent", str(agent.sock), "--", sys.executable, "-c",
                        "import os; print(os.environ['INFERSIGHT_SOCKET'])"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(agent.sock) and "reporting to the agent at %s" % agent.sock in r.stderr
    marker = tmp_path / "ran"
    absent = tmp_path / "no-agent.sock"
    r = subprocess.run([*CLI, "launch", "--agent", str(absent), "--agent-wait", "0.5", "--", sys.executable, "-c",
                        "open(%r, 'w').close()" % str(marker)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "waiting up to 0.5 s for the agent at %s" % absent in r.stderr
    assert "--agent %s: no agent listens at %s (no socket)" % (absent, absent) in r.stderr
    assert not marker.exists(), "CMD must not start when the named agent is not there"


def test_a_named_socket_whose_agent_is_not_up_yet_is_waited_for(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """A cluster without native sidecars starts the model server and the agent side by side: with
    INFERSIGHT_SOCKET naming a socket that is not there yet, launch waits for it (and says so), then
    joins, instead of embedding an agent whose telemetry the sidecar never sees."""
    agent = agent_factory()
    proc = subprocess.Popen([*CLI, "launch", "--agent-wait", "60", "--", sys.executable, "-c", "print('served')"],
                            cwd=tmp_path, env=launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        assert proc.poll() is None, "launch did not wait for the named agent"
        agent.start()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "waiting up to 60 s for the agent at %s" % agent.sock in err
    assert "reporting to the agent at %s" % agent.sock in err and "embedded" not in err
    assert "served" in out
    assert wait_for(lambda: agent.status()["events_in"] > 0, 20)
    assert not list(tmp_path.glob("infersight-*.otlp.jsonl")), "an embedded agent's file was written"


def test_an_agent_that_does_not_answer_is_not_waited_for(tmp_path: Path) -> None:
    """Only an agent that is not there yet is waited for (no socket, or one nobody listens on). A socket
    this user may not connect to, or an agent too busy to answer, had every launch wait 30 s (a review, as
    a user outside the socket group with INFERSIGHT_SOCKET set)."""
    import socket

    mute = tmp_path / "mute.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(mute))
    s.listen(8)  # accepts into its backlog, never answers: the join times out
    try:
        r = subprocess.run([*CLI, "launch", "--agent-wait", "60", "--", sys.executable, "-c", "pass"], cwd=tmp_path,
                           env=launch_env(tmp_path, INFERSIGHT_SOCKET=str(mute)), capture_output=True, text=True,
                           timeout=120)
    finally:
        s.close()
    assert r.returncode == 0, r.stderr
    assert "waiting up to" not in r.stderr and "running an embedded agent" in r.stderr, r.stderr


def test_an_embedded_launch_leaves_the_users_private_spool_alone(tmp_path: Path) -> None:
    """The files a user's earlier processes left in its private spool belong to the system agent (after the
    user joins the socket group): an embedded launch's hooks moved them into launch's own temporary spool,
    where they went into this run's file or were deleted with launch's directory (a review). CMD's descendants
    too: a gunicorn worker, a spawned child (they replayed an earlier test's `python -c` into this run's file as
    a second cold start)."""
    state_home = tmp_path / "xdg"
    private = state_home / "infersight" / "spool"
    private.mkdir(parents=True)
    left = private / "0123456789ab-999-1-deadbeef.spool"
    left.write_bytes(b"x")
    (tmp_path / "child.py").write_text("from infersight import hooks\nwith hooks.stage('child'):\n    pass\n"
                                       "assert hooks.flush(5)\n")
    script = ("import subprocess, sys, time\nfrom infersight import hooks\n"
              "subprocess.run([sys.executable, 'child.py'], check=True)\n"
              "hooks.mark_ready()\nhooks.first_response()\nhooks.flush(5)\ntime.sleep(3)\n")
    r = subprocess.run([*CLI, "launch", "--agent", "embedded", "--", sys.executable, "-c", script], cwd=tmp_path,
                       env=launch_env(tmp_path, XDG_STATE_HOME=str(state_home)), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert left.exists() and "moved" not in r.stderr, r.stderr


def test_agent_killed_mid_run_and_restarted_loses_nothing(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL the agent between two stages; the hooks keep their events (buffer, spool) and
    send them when it is back; launch re-subscribes, prints the waterfall, exits with CMD's status."""
    agent = agent_factory().start()
    script = tmp_path / "w.py"
    script.write_text(WORKLOAD)
    env = launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock), INFERSIGHT_SPOOL_DIR=str(agent.spool))
    proc = start_launch(tmp_path, env, "--", sys.executable, str(script), str(tmp_path), "5")
    try:
        assert wait_for((tmp_path / "m1").exists, 60)
        assert wait_for(lambda: "coldstart.before" in names(agent.out), 20)
        agent.kill()
        (tmp_path / "go1").touch()
        assert wait_for((tmp_path / "m2").exists, 60)  # "during" ended while no agent ran
        agent.start()
        assert wait_for(lambda: agent.status()["subscribers"] == 1, 30), "launch re-subscribes"
        (tmp_path / "go2").touch()
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 5, output
    assert "went away 1 time(s) during the run" in output, output
    assert "infersight cold start:" in output and "after" in output, output
    assert wait_for(lambda: "coldstart" in names(agent.out), 20)
    got = names(agent.out)
    for stage in ("before", "during", "after"):
        assert got.count("coldstart." + stage) >= 1, got
    roots = [s for s in spans(read_otlp_lines(agent.out)) if s["name"] == "coldstart"]
    assert len({s["spanId"] for s in roots}) == 1, roots


@pytest.mark.parametrize("told", [True, False], ids=["INFERSIGHT_SPOOL_DIR set", "no INFERSIGHT_SPOOL_DIR"])
def test_agent_gone_at_exit_keeps_the_spool_for_its_return(tmp_path: Path, agent_factory, told: bool) -> None:  # type: ignore[no-untyped-def]
    """The agent does not come back while launch waits: launch says where the events wait and
    exits with CMD's status; the agent, started later, replays them into its sink. Without
    INFERSIGHT_SPOOL_DIR, CMD's hooks spool where the agent replays too (its ``agent.spool_dir``, from the
    session reply): they spooled to the user's private directory, which the agent never reads (a review: 27 of
    60 OOMs reached the sinks, and launch said the hooks had replayed what they spooled)."""
    agent = agent_factory().start()
    script = tmp_path / "w.py"
    script.write_text(WORKLOAD)
    (tmp_path / "go2").touch()
    env = launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock), INFERSIGHT_SPOOL_DIR=str(agent.spool),
                     XDG_STATE_HOME=str(tmp_path / "state"))
    if not told:
        del env["INFERSIGHT_SPOOL_DIR"]
    proc = start_launch(tmp_path, env, "--", sys.executable, str(script), str(tmp_path), "4")
    try:
        assert wait_for((tmp_path / "m1").exists, 60)
        assert wait_for(lambda: "coldstart.before" in names(agent.out), 20)
        agent.kill()
        (tmp_path / "go1").touch()
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 4, output
    assert "went away and was not back" in output and str(agent.spool) in output, output
    assert "during" not in names(agent.out)
    spooled = list(agent.spool.glob("*.spool"))
    assert spooled, "CMD's hooks spooled what the agent did not take, where it replays"
    assert not list((tmp_path / "state").rglob("*.spool")), "nothing in the user's private spool"
    agent.start()
    assert wait_for(lambda: {"coldstart.during", "coldstart.after", "coldstart"} <= set(names(agent.out)), 30)
    roots = [s for s in spans(read_otlp_lines(agent.out)) if s["name"] == "coldstart"]
    assert len(roots) == 1 and attr(roots[0], "faas.coldstart") is True


def test_joined_non_python_command_gets_the_launchers_root(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    out = tmp_path / "local.otlp.jsonl"
    r = subprocess.run([*CLI, "launch", "--otlp-file", str(out), "--", "sh", "-c", "exit 7"], cwd=tmp_path,
                       env=launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock)), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 7, r.stderr
    assert "reporting to the agent" in r.stderr and "infersight cold start:" in r.stderr
    roots = [s for s in spans(read_otlp_lines(out)) if s["name"] == "coldstart"]
    assert len(roots) == 1 and attr(roots[0], "infersight.coldstart.source") == "launcher"


def test_joined_ready_url_and_probe(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """--ready-url reaches CMD's hooks as embedded (a file in launch's private directory), so
    the agent's sink has the ready_wait it ends; the --probe span goes to the local copy."""
    from conftest import free_port

    agent = agent_factory().start()
    port = free_port()
    base = "http://127.0.0.1:%d" % port
    server = Path(__file__).resolve().parents[1] / "support" / "workloads" / "ready_server.py"
    out = tmp_path / "local.otlp.jsonl"
    r = subprocess.run([*CLI, "launch", "--otlp-file", str(out), "--ready-url", base + "/health", "--probe",
                        base + "/", "--", sys.executable, str(server), str(port), "0.3"], cwd=tmp_path,
                       env=launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock)), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "reporting to the agent" in r.stderr and "ready at %s/health" % base in r.stderr
    assert wait_for(lambda: "coldstart" in names(agent.out), 20)
    ready = [s for s in spans(read_otlp_lines(agent.out)) if s["name"] == "coldstart.ready_wait"]
    assert len(ready) == 1 and attr(ready[0], "infersight.ready.source") == "ready_url"
    local = spans(read_otlp_lines(out))
    root = next(s for s in local if s["name"] == "coldstart")
    probe = [s for s in local if s["name"] == "infersight.probe"]
    assert len(probe) == 1 and probe[0]["parentSpanId"] == root["spanId"]


def test_a_joined_launch_refuses_a_bad_hook_variable_before_cmd(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """Joining an agent does not skip the check of what CMD's hooks would read."""
    agent = agent_factory().start()
    marker = tmp_path / "cmd-ran"
    r = subprocess.run([*CLI, "launch", "--", sys.executable, "-c", "open(%r, 'w').write('x')" % str(marker)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=launch_env(tmp_path, INFERSIGHT_SOCKET=str(agent.sock), INFERSIGHT_SPOOL_MAX_BYTES="lots"))
    assert r.returncode == 2, r.stderr
    assert "INFERSIGHT_SPOOL_MAX_BYTES" in r.stderr and "lots" in r.stderr
    assert not marker.exists(), "CMD must not start"
    assert agent.status()["events_in"] == 0

