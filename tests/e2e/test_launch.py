"""``infersight launch``: the CLI contract of DESIGN, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BOOTSTRAP, attr, launch_tmpdir, log_records, read_otlp_lines, spans
from google.protobuf import json_format
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from infersight.hooks._wire import AGENT_HELD_MARK

CLI = [sys.executable, "-m", "infersight"]


def launch(tmp_path: Path, *cmd: str, env: dict[str, str] | None = None, args: tuple[str, ...] = ()
           ) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "out.otlp.jsonl"
    e = dict(os.environ)
    for k in list(e):
        if k.startswith("OTEL_EXPORTER_OTLP"):
            del e[k]
    e.update(env or {})
    r = subprocess.run([*CLI, "launch", "--otlp-file", str(out), *args, "--", *cmd],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path, env=e)
    return r, out


def test_pass_writes_valid_file_and_exits_0(tmp_path: Path) -> None:
    r, out = launch(tmp_path, sys.executable, "-c", "pass")
    assert r.returncode == 0, r.stderr
    lines = read_otlp_lines(out)
    roots = [s for s in spans(lines) if s["name"] == "coldstart"]
    assert len(roots) == 1
    assert attr(roots[0], "faas.coldstart") is True
    assert attr(roots[0], "infersight.coldstart.unattributed_s") is not None
    assert "infersight cold start" in r.stderr and str(out) in r.stderr


def test_file_lines_parse_as_export_requests(tmp_path: Path) -> None:
    r, out = launch(tmp_path, sys.executable, "-c", "from infersight import hooks; hooks.log('hi')")
    assert r.returncode == 0, r.stderr
    seen = set()
    for line in out.read_text().splitlines():
        key = next(iter(json.loads(line)))
        msg = {"resourceSpans": ExportTraceServiceRequest, "resourceMetrics": ExportMetricsServiceRequest,
               "resourceLogs": ExportLogsServiceRequest}[key]()
        # OTLP/JSON ids are hex; the Collector converts them before protobuf parsing: do the same.
        json_format.Parse(line, msg, ignore_unknown_fields=False)
        seen.add(key)
    assert seen == {"resourceSpans", "resourceMetrics", "resourceLogs"}


def test_child_exit_status_is_propagated(tmp_path: Path) -> None:
    r, _ = launch(tmp_path, sys.executable, "-c", "import sys; sys.exit(3)")
    assert r.returncode == 3


def test_killed_child_gives_128_plus_signal(tmp_path: Path) -> None:
    r, _ = launch(tmp_path, sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert r.returncode == 128 + 9


def test_missing_command_gives_127(tmp_path: Path) -> None:
    r, _ = launch(tmp_path, "infersight-no-such-command")
    assert r.returncode == 127 and "not found" in r.stderr


def test_a_command_that_cannot_be_executed_gives_126_and_says_why(tmp_path: Path) -> None:
    """Found in a README walkthrough: an executable script without #! (ENOEXEC) raised a traceback and
    exit 1; a file that is not executable gave 126, as the shell does."""
    script = tmp_path / "noshebang.sh"
    script.write_text("echo hi\n")
    script.chmod(0o755)
    r, _ = launch(tmp_path, str(script))
    assert r.returncode == 126 and "Traceback" not in r.stderr, r.stderr
    assert "cannot execute %s: Exec format error" % script in r.stderr and "#!" in r.stderr, r.stderr
    script.chmod(0o644)  # no x bit: EACCES, even for root
    r, _ = launch(tmp_path, str(script))
    assert r.returncode == 126 and "permission denied" in r.stderr, r.stderr


def test_usage_errors_give_2(tmp_path: Path) -> None:
    assert subprocess.run([*CLI, "launch"], capture_output=True, timeout=30).returncode == 2
    assert subprocess.run([*CLI, "launch", "--nope", "--", "true"], capture_output=True, timeout=30).returncode == 2


@pytest.mark.parametrize(("option", "url"), [
    ("--ready-url", "notaurl"), ("--probe", "ftp://127.0.0.1:8799/"), ("--ready-url", "http:///health"),
    ("--probe", "http://127.0.0.1:99999/"),
])
def test_a_ready_or_probe_url_that_is_not_http_is_a_usage_error_before_cmd(tmp_path: Path, option: str, url: str
                                                                          ) -> None:
    """It was taken as given: "never ready at notaurl" at the end, exit 0; an ftp:// probe silently ignored."""
    started = tmp_path / "started"
    r = subprocess.run([*CLI, "launch", option, url, "--", "touch", str(started)], capture_output=True, text=True,
                       timeout=30, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("usage: infersight launch ")
    assert "infersight launch: error: argument %s: expected an http:// or https:// URL with a host, got %r" % (
        option, url) in r.stderr
    assert not started.exists(), "CMD never starts"
    assert not list(tmp_path.glob("infersight-*.otlp.jsonl"))


@pytest.mark.parametrize(("cmd", "rc", "said"), [
    (["true"], 0, ""),
    (["false"], 1, "infersight: CMD exited with status 1\n"),
    (["sh", "-c", "kill -TERM $$"], 143, "infersight: CMD was killed by SIGTERM (exit status 143)\n"),
    ([sys.executable, "-c", "import sys; sys.exit(3)"], 3, "infersight: CMD exited with status 3\n"),  # agent side
])
def test_a_failed_command_is_said_at_the_end_of_the_summary(tmp_path: Path, cmd: list[str], rc: int, said: str
                                                            ) -> None:
    """A failed CMD printed the same summary as a success: only the exit status told them apart."""
    r, out = launch(tmp_path, *cmd)
    assert r.returncode == rc, r.stderr
    assert r.stderr.endswith("infersight: wrote %s\n%s" % (out, said)), r.stderr[-2000:]


def test_default_output_name_in_cwd(tmp_path: Path) -> None:
    r = subprocess.run([*CLI, "launch", "--no-console", "--", "true"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 0
    files = list(tmp_path.glob("infersight-*.otlp.jsonl"))
    assert len(files) == 1 and files[0].name in r.stderr
    assert len(files[0].name) == len("infersight-20260101-000000.otlp.jsonl")


def test_non_python_command_gets_launcher_root(tmp_path: Path) -> None:
    r, out = launch(tmp_path, "sleep", "0.3")
    assert r.returncode == 0
    roots = [s for s in spans(read_otlp_lines(out)) if s["name"] == "coldstart"]
    assert len(roots) == 1 and attr(roots[0], "infersight.coldstart.source") == "launcher"
    dur = (int(roots[0]["endTimeUnixNano"]) - int(roots[0]["startTimeUnixNano"])) / 1e9
    assert 0.3 <= dur < 5


def test_root_starts_at_spawn_time(tmp_path: Path) -> None:
    """The launched child's root starts at the launcher's spawn, before the child's own exec."""
    code = ("import os, json; from infersight.hooks import _proc, _runtime; "
            "print(json.dumps([_runtime.state().root_start_ns, _proc.process_start_ns()]))")
    r, out = launch(tmp_path, sys.executable, "-c", code, args=("--no-console",))
    assert r.returncode == 0, r.stderr
    root_start, proc_start = json.loads(r.stdout)
    roots = [s for s in spans(read_otlp_lines(out)) if s["name"] == "coldstart"]
    assert int(roots[0]["startTimeUnixNano"]) == root_start
    # /proc start has clock-tick (10 ms) resolution: spawn precedes it within a tick.
    assert root_start <= proc_start + 20_000_000


def test_private_socket_even_with_daemon_env(tmp_path: Path) -> None:
    r, out = launch(tmp_path, sys.executable, "-c", "import os; print(os.environ['INFERSIGHT_SOCKET'])",
                    env={"INFERSIGHT_SOCKET": str(tmp_path / "daemon.sock")},
                    args=("--no-console", "--agent-wait", "0"))
    assert r.returncode == 0
    assert r.stdout.strip() != str(tmp_path / "daemon.sock")
    assert "infersight-launch-" in r.stdout


def test_a_tmpdir_too_deep_for_a_socket_path_falls_back_to_tmp(tmp_path: Path) -> None:
    """AF_UNIX paths hold 107 bytes: under a deeper $TMPDIR launch makes its private directory in
    /tmp (0700, made exclusively, as anywhere), and CMD's hooked events still arrive."""
    deep = tmp_path / ("d" * (110 - len(str(tmp_path))))
    deep.mkdir()
    code = ("import os\nfrom infersight import hooks\nhooks.log('from deep', i=7)\n"
            "print(os.environ['INFERSIGHT_SOCKET'])\n")
    r, out = launch(tmp_path, sys.executable, "-c", code, env={"TMPDIR": str(deep)}, args=("--no-console",))
    assert r.returncode == 0, r.stderr
    sock = Path(r.stdout.strip())
    assert sock.parent.parent == Path("/tmp") and sock.parent.name.startswith("infersight-launch-"), sock
    assert not sock.parent.exists()  # removed at exit, as under $TMPDIR
    assert [str(attr(x, "i")) for x in log_records(read_otlp_lines(out))] == ["7"]


def test_no_implicit_otlp_endpoint() -> None:
    from infersight.agent.commands.compose import otlp_requested
    from infersight.agent.daemon import config as cfg

    conf = cfg.load(None, env={})
    assert not otlp_requested(conf, {})
    assert otlp_requested(conf, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces"})
    assert not otlp_requested(conf, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_SDK_DISABLED": "true"})


def test_sigterm_is_forwarded_and_flushed(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    code = ("import signal, sys, time\n"
            "from infersight import hooks\n"
            "def bye(*a):\n    hooks.log('got sigterm'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\nprint('ready', flush=True)\ntime.sleep(30)\n")
    p = subprocess.Popen([*CLI, "launch", "--no-console", "--otlp-file", str(out), "--", sys.executable, "-c", code],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    p.terminate()
    assert p.wait(30) == 0
    bodies = [rec["body"]["stringValue"] for req in read_otlp_lines(out) for rl in req.get("resourceLogs", [])
              for sl in rl["scopeLogs"] for rec in sl["logRecords"]]
    assert "got sigterm" in bodies


def test_existing_sitecustomize_is_chained(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    r, out = launch(tmp_path, sys.executable, "-c", "import os; print(os.environ.get('CHAINED'))",
                    env={"PYTHONPATH": str(other)}, args=("--no-console",))
    assert r.returncode == 0 and r.stdout.strip() == "yes"
    assert [s for s in spans(read_otlp_lines(out)) if s["name"] == "coldstart"]


PYTHONS = [Path.home() / ".pyenv" / "versions" / v / "bin" / "python"
           for v in ("3.9.18", "3.10.13", "3.11.7", "3.12.1", "3.13.0")]


@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: p.parent.parent.name)
def test_hooks_import_without_infersight_installed(python: Path, tmp_path: Path) -> None:
    """Python 3.9-3.13, no infersight installed there: the bootstrap still loads the hooks."""
    if not python.exists():
        pytest.skip("%s is not on this machine" % python)
    r, out = launch(tmp_path, str(python), "-c",
                    "import infersight.hooks as h, sys; print(h.active(), sys.version_info[:2])",
                    args=("--no-console",))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("True"), r.stdout + r.stderr
    roots = [s for s in spans(read_otlp_lines(out)) if s["name"] == "coldstart"]
    assert len(roots) == 1


def test_the_hold_is_marked_before_cmd_starts(tmp_path: Path) -> None:
    """launch holds its agent back while CMD starts, and its mark beside the socket makes CMD's hooks
    spool meanwhile. The mark came after CMD's spawn: hooks that looked first connected, waited for a
    welcome that the held agent never sends, and CMD's exit waited 2 s for them (most short runs).
    CMD here reads at once (``-S``: no site, no hooks) what its hooks would; no hold, no mark."""
    code = "import os; print(os.path.exists(os.path.join(os.path.dirname(os.environ['INFERSIGHT_SOCKET']), %r)))" % (
        AGENT_HELD_MARK)
    r, _ = launch(tmp_path, sys.executable, "-S", "-c", code, args=("--no-console",))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"
    r, _ = launch(tmp_path, sys.executable, "-S", "-c", code, args=("--no-console", "--agent-hold", "0"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_bootstrap_is_on_pythonpath_only_for_children(tmp_path: Path) -> None:
    r, _ = launch(tmp_path, sys.executable, "-c", "import os; print(os.environ['PYTHONPATH'])",
                  args=("--no-console",))
    assert r.stdout.strip().split(os.pathsep)[0] == str(BOOTSTRAP)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_launch_exports_over_otlp_when_endpoint_is_set(tmp_path: Path, protocol: str) -> None:
    from otlp_receiver import OtlpReceiver

    with OtlpReceiver() as rx:
        endpoint = rx.http_endpoint if protocol == "http/protobuf" else rx.grpc_endpoint
        r, out = launch(tmp_path, sys.executable, "-c", "from infersight import hooks; hooks.log('via otlp')",
                        env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                             "OTEL_SERVICE_NAME": "demo-svc"},
                        args=("--no-console",))
        assert r.returncode == 0, r.stderr
        received = rx.spans()
        assert "coldstart" in [span.name for _res, _scope, span in received]
        assert all(res["service.name"] == "demo-svc" for res, _scope, _span in received)
        assert rx.log_count() >= 1
    # The file gets the same spans, with the service name from OTEL_SERVICE_NAME.
    roots = [s for s in spans(read_otlp_lines(out)) if s["name"] == "coldstart"]
    res = next(line for line in read_otlp_lines(out) if "resourceSpans" in line)["resourceSpans"][0]["resource"]
    assert roots and attr(res, "service.name") == "demo-svc"


# -- the quick end: a CMD done before the agent was needed ------------------------------


def _quiet_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No INFERSIGHT_*/OTEL_* setting, and a TMPDIR of its own (no other launch's directory)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSIGHT_", "OTEL_"))}
    env["TMPDIR"] = launch_tmpdir(tmp_path / "t")
    env.update(extra)
    return env


def _launch_in(tmp_path: Path, env: dict[str, str], *cmd: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "out.otlp.jsonl"
    r = subprocess.run([*CLI, "launch", "--otlp-file", str(out), "--", *cmd], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path, env=env)
    return r, out


def _metric_names(lines: list[dict]) -> set[str]:  # type: ignore[type-arg]
    return {m["name"] for req in lines for rm in req.get("resourceMetrics", []) for sm in rm["scopeMetrics"]
            for m in sm["metrics"]}


@pytest.mark.parametrize(("cmd", "rc"), [(["true"], 0), (["sh", "-c", "exit 3"], 3),
                                         (["sh", "-c", "kill -9 $$"], 128 + 9)])
def test_a_command_done_at_once_needs_no_agent(tmp_path: Path, cmd: list[str], rc: int) -> None:
    """``launch -- true``: the launcher's root, its cold-start metrics and the waterfall, as
    the agent writes them, but no agent ran (none of its own metrics), and nothing is left."""
    r, out = _launch_in(tmp_path, _quiet_env(tmp_path), *cmd)
    assert r.returncode == rc, r.stderr
    lines = read_otlp_lines(out)
    (root,) = [s for s in spans(lines) if s["name"] == "coldstart"]
    assert attr(root, "infersight.coldstart.source") == "launcher"
    names = _metric_names(lines)
    assert {"infersight.coldstart.duration", "infersight.coldstart.count"} <= names
    assert "infersight.events.received" not in names, "the agent did not start"
    assert "infersight cold start: unknown_service:%s" % os.path.basename(cmd[0]) in r.stderr
    assert "wrote %s" % out in r.stderr
    assert os.listdir(tmp_path / "t") == [], "its private directory is gone"


def test_another_commands_empty_leftover_keeps_the_quick_end(tmp_path: Path) -> None:
    """A dead launch of another command that left nothing to replay: neither path acts on it
    (the agent's replays only the same command's, and reports another's only with spool
    files), so it must not cost every later ``launch -- true`` the agent's start."""
    env = _quiet_env(tmp_path)
    left = tmp_path / "t" / "infersight-launch-000000000000"
    (left / "spool" / "children-0").mkdir(mode=0o700, parents=True)
    left.chmod(0o700)
    (left / "launch.lock").write_text("1\n")
    (left / "command").write_bytes(b"python3\0serve.py")
    r, out = _launch_in(tmp_path, env, "true")
    assert r.returncode == 0, r.stderr
    assert "infersight.events.received" not in _metric_names(read_otlp_lines(out)), "the quick end: no agent"
    assert left.exists(), "another command's leftover is not ours to remove"


@pytest.mark.parametrize("why", ["setting", "live_child", "leftover"])
def test_anything_left_to_deliver_takes_the_agent(tmp_path: Path, why: str) -> None:
    """A setting the agent applies, a process CMD left running (it may still report), or an
    earlier launch's directory to replay: the agent runs (its own metrics are in the file)."""
    env = _quiet_env(tmp_path)
    cmd = ["true"]
    if why == "setting":
        env["INFERSIGHT_HOST_NAME"] = "quick-test-host"
    elif why == "live_child":
        cmd = ["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"]
    else:  # a dead launch of the same command: the agent's path replays and removes it
        left = tmp_path / "t" / "infersight-launch-000000000000"
        left.mkdir(mode=0o700)
        (left / "launch.lock").write_text("1\n")
        (left / "command").write_bytes(b"true")
    r, out = _launch_in(tmp_path, env, *cmd)
    assert r.returncode == 0, r.stderr
    lines = read_otlp_lines(out)
    assert "infersight.events.received" in _metric_names(lines), r.stderr
    if why == "leftover":
        assert not left.exists(), "a delivered leftover is removed"
    if why == "live_child":
        os.kill(int(r.stdout.split()[0]), 9)  # the sleep CMD left behind
        assert "started under launch still run" in r.stderr
