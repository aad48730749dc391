"""The systemd service path, end to end, as a new operator installs it (issue 21).

What is the operator's, unmodified:
- the config file: ``systemd/infersight.toml`` as shipped (every key commented), read in place;
- the unit's ``ExecStart=`` arguments and ``UMask=``, the directories and modes of
  ``systemd/tmpfiles.d/infersight.conf``;
- ``infersight hooks install --python VENV/bin/python`` into a fresh venv;
- the served process: another uid whose supplementary group is the socket group, with
  ``INFERSIGHT=1`` in its environment (the .pth bootstrap), nothing else of ours.

What the test changes, and only that: paths. ``/run/infersight`` and ``/var/lib/infersight``
become directories under a scratch root, given to the agent and the hooks through
``INFERSIGHT_SOCKET``, ``INFERSIGHT_STATE_DIR`` and ``INFERSIGHT_SPOOL_DIR`` (on a real host they
are the defaults); ``/usr/bin/infersight`` becomes a venv any uid can run (see fleet_env); the
users are numeric uids (the agent's ``User=infersight``, the model server's) and one gid for
group ``infersight``. The agent runs under a real ``NOTIFY_SOCKET``.

The cold start of the served process must then be in the default file,
``<state_dir>/infersight.otlp.jsonl``. Before issue 21 the agent had no sink: it counted the
events and dropped them, and ``status`` said healthy.
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from conftest import attr, read_otlp_lines, spans, wait_for
from fleet_env import (
    REPO,
    SERVE,
    base_env,
    make_dir,
    open_base,
    read_port_pid,
    require_root,
    shared_python,
    system_python,
)

CLI = [sys.executable, "-m", "infersight"]
AGENT_UID, SERVED_UID, GROUP_GID = 42901, 42902, 42900  # User=infersight, the model server, group infersight
UNIT = REPO / "systemd" / "infersight.service"
TMPFILES = REPO / "systemd" / "tmpfiles.d" / "infersight.conf"
SHIPPED_CONFIG = REPO / "systemd" / "infersight.toml"


def unit_values(key: str) -> list[str]:
    return [line.split("=", 1)[1].strip() for line in UNIT.read_text().splitlines() if line.startswith(key + "=")]


def make_tmpfiles(remap: dict[str, Path]) -> None:
    """The ``d`` lines of tmpfiles.d/infersight.conf, under the remapped roots."""
    ids = {"infersight": (AGENT_UID, GROUP_GID)}
    for line in TMPFILES.read_text().splitlines():
        if not line.startswith("d "):
            continue
        _d, path, mode, user, group, _age = line.split()
        target = next(remap[p] / path[len(p):].lstrip("/") for p in sorted(remap, key=len, reverse=True)
                      if path == p or path.startswith(p + "/"))
        make_dir(target, int(mode, 8), ids[user][0], ids[group][1])


def status(sock: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "status", "--socket", str(sock), *args], capture_output=True, text=True, timeout=60)


def test_service_records_a_hooked_process_to_the_default_file(tmp_path: Path) -> None:
    require_root()
    with open_base("isf-svc-") as base, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        remap = {"/run/infersight": base / "run" / "infersight", "/var/lib/infersight": base / "lib" / "infersight"}
        make_dir(base / "run", 0o755)
        make_dir(base / "lib", 0o755)
        make_tmpfiles(remap)
        sock = remap["/run/infersight"] / "agent.sock"
        state = remap["/var/lib/infersight"]
        spool = state / "spool"
        notify_path = make_dir(base / "systemd", 0o755) / "notify"
        notify.bind(str(notify_path))
        notify_path.chmod(0o777)  # systemd's is writable by the service's uid
        notify.settimeout(30)

        # The unit's ExecStart=, with the program and the config path remapped.
        argv = shlex.split(unit_values("ExecStart")[0])
        assert argv[:2] == ["/usr/bin/infersight", "agent"] and argv[2:] == ["--config",
                                                                              "/etc/infersight/infersight.toml"]
        python = shared_python(base)
        agent_cmd = [str(python), "-m", "infersight", "agent", "--config", str(SHIPPED_CONFIG)]
        agent_env = base_env(INFERSIGHT_SOCKET=str(sock), INFERSIGHT_STATE_DIR=str(state),
                             INFERSIGHT_SPOOL_DIR=str(spool), NOTIFY_SOCKET=str(notify_path))
        log = tmp_path / "agent.log"
        agent = subprocess.Popen(agent_cmd, env=agent_env, user=AGENT_UID, group=GROUP_GID, extra_groups=[],
                                 umask=int(unit_values("UMask")[0], 8), cwd="/",
                                 stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
        try:
            ready = {}
            while "READY" not in ready:
                ready = dict(line.split("=", 1) for line in notify.recv(65536).decode().splitlines() if line)
            assert ready["STATUS"].startswith("healthy"), ready
            default = state / "infersight.otlp.jsonl"
            r = status(sock)
            assert r.returncode == 0, r.stdout + log.read_text()
            assert "sinks                  file %s" % default in r.stdout
            assert "recording to the default file %s" % default in log.read_text()

            # infersight hooks install into a fresh venv (the model server's interpreter).
            # From the system python: the model server's uid must be able to run it.
            venv = base / "model-venv"
            subprocess.run([system_python(), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
            inst = subprocess.run([*CLI, "hooks", "install", "--python", str(venv / "bin" / "python")],
                                  capture_output=True, text=True, timeout=120)
            assert inst.returncode == 0, inst.stdout + inst.stderr

            # The served process: another uid, in the socket group, INFERSIGHT=1.
            app = make_dir(base / "app", 0o755)
            (app / "serve.py").write_text(SERVE)
            rw = make_dir(base / "app-rw", 0o777)
            portfile = rw / "port"
            served_env = base_env(INFERSIGHT="1", OTEL_SERVICE_NAME="fleet-svc-e2e",
                                  INFERSIGHT_SOCKET=str(sock), INFERSIGHT_SPOOL_DIR=str(spool), HOME=str(rw))
            served = subprocess.Popen([str(venv / "bin" / "python"), "serve.py", str(portfile)], cwd=app,
                                      env=served_env, user=SERVED_UID, group=SERVED_UID, extra_groups=[GROUP_GID],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert wait_for(portfile.exists, 60), served.communicate(timeout=5)[0] if served.poll() is not None else ""
            port, pid = read_port_pid(portfile)
            with urllib.request.urlopen("http://127.0.0.1:%d/" % port, timeout=30) as resp:
                assert resp.status == 200
            out, _ = served.communicate(timeout=60)
            assert served.returncode == 0, out
            assert "infersight" not in out, out  # the hooks said nothing: they ran

            def root() -> dict | None:  # type: ignore[type-arg]
                if not default.exists():
                    return None
                for req in read_otlp_lines(default):
                    for rs in req.get("resourceSpans", []):
                        res = {kv["key"]: next(iter(kv["value"].values())) for kv in rs["resource"]["attributes"]}
                        if res.get("service.name") != "fleet-svc-e2e" or int(res.get("process.pid", 0)) != pid:
                            continue
                        for s in spans([{"resourceSpans": [rs]}]):
                            if s["name"] == "coldstart":
                                return s  # type: ignore[no-any-return]
                return None

            assert wait_for(lambda: root() is not None, 30), log.read_text()
            assert attr(root(), "faas.coldstart") is True
            h = json.loads(status(sock, "--json").stdout)
            assert h["healthy"] is True and h["events_in"] > 0 and h["counters"]["refused_peers"] == 0
            assert oct(default.stat().st_mode & 0o777) == "0o600", "the unit's UMask=0077 applies"
            # a member of the socket group (another tenant: the model server's uid) may not read it
            peek = subprocess.run([str(python), "-c", "open(%r).read(1)" % str(default)], user=SERVED_UID,
                                  group=SERVED_UID, extra_groups=[GROUP_GID], capture_output=True, text=True,
                                  timeout=60)
            assert peek.returncode != 0 and "PermissionError" in peek.stderr, peek.stderr
        finally:
            agent.terminate()
            assert agent.wait(30) == 0, log.read_text()
