"""The sidecar path, end to end: ``deploy/kubernetes/pod.yaml`` as written (issue 21).

No cluster runs here, so the test plays kubelet, reading everything from the manifest (and
the image's ``ENTRYPOINT`` from the Dockerfile), duplicating none of its values:

- each volume is a directory under a scratch root: an ``emptyDir`` as kubelet makes one with
  ``fsGroup`` (group fsGroup, mode 2777), the ConfigMap's keys as files (0644);
- each container runs its command as its ``runAsUser``/``runAsGroup`` with the pod's
  ``supplementalGroups`` and ``fsGroup`` as supplementary groups, its manifest environment, and
  its mount paths mapped onto those directories;
- the sidecar starts first; the model server starts once the sidecar's ``startupProbe``
  command succeeds (a native sidecar's order).

What the test changes: paths (a mount path prefix becomes its directory, in the environment,
the commands and the ConfigMap's text, since no mount namespace maps them), the collector's
address in the ConfigMap (the real OTLP receiver of tests/support/otlp_receiver.py stands in for
``otel-collector.observability.svc``), the programs (``infersight`` and ``python`` are a venv
any uid can run, see fleet_env), and ``serve.py`` (a stdlib HTTP server that answers one
request). The model server's cold start must reach the receiver through the sidecar's agent.
Before issue 21, ``launch`` always ran its own agent: the sidecar got nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for
from fleet_env import REPO, SERVE, base_env, make_dir, open_base, read_port_pid, require_root, shared_python
from otlp_receiver import OtlpReceiver

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra")

POD = REPO / "deploy" / "kubernetes" / "pod.yaml"
DOCKERFILE = REPO / "Dockerfile"


def manifest() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = list(yaml.safe_load_all(POD.read_text()))
    return (next(d for d in docs if d["kind"] == "ConfigMap"), next(d for d in docs if d["kind"] == "Pod"))


def entrypoint() -> list[str]:
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("ENTRYPOINT "):
            return list(json.loads(line[len("ENTRYPOINT "):]))
    raise AssertionError("no ENTRYPOINT in the Dockerfile")


class Container:
    """One container of the pod, run as kubelet would (less the namespaces)."""

    def __init__(self, spec: dict[str, Any], pod_sc: dict[str, Any], volumes: dict[str, Path],
                 programs: dict[str, list[str]], tmp: Path) -> None:
        self.spec = spec
        sc = spec["securityContext"]
        self.uid, self.gid = int(sc["runAsUser"]), int(sc["runAsGroup"])
        self.groups = sorted({*pod_sc.get("supplementalGroups", []), pod_sc["fsGroup"]})
        self.mounts = {m["mountPath"]: volumes[m["name"]] for m in spec.get("volumeMounts", [])}
        self.programs = programs
        self.tmp = make_dir(tmp, 0o700, self.uid, self.gid)  # its own /tmp (the image's, or an emptyDir)
        self.scratch = str(tmp.parent)  # the test's own directories (under the host's /tmp): never remapped

    def path(self, text: str) -> str:
        """A path inside the container, as the test's directories hold it."""
        if text == self.scratch or text.startswith(self.scratch + "/"):
            return text
        for mount in sorted(self.mounts, key=len, reverse=True):
            if text == mount or text.startswith(mount + "/"):
                return str(self.mounts[mount]) + text[len(mount):]
        return text

    def env(self) -> dict[str, str]:
        env = base_env(TMPDIR=self.path("/tmp") if "/tmp" in self.mounts else str(self.tmp), HOME=str(self.tmp))
        env.update({e["name"]: self.path(str(e["value"])) for e in self.spec.get("env", [])})
        return env

    def argv(self, command: list[str]) -> list[str]:
        return [part for word in command for part in self.programs.get(word, [self.path(word)])]

    def popen(self, command: list[str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.argv(command), env=self.env(), cwd=cwd, user=self.uid, group=self.gid,
                                extra_groups=self.groups, stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115

    def run(self, command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(command), env=self.env(), cwd=cwd, user=self.uid, group=self.gid,
                              extra_groups=self.groups, capture_output=True, text=True, timeout=60)


def remap_config(text: str, container: Container) -> str:
    """Each quoted absolute path of the ConfigMap's text, as ``container`` sees it (one pass: a path
    already mapped under the scratch root is never mapped again by a shorter mount such as /tmp)."""
    return re.sub(r'"(/[^"]*)"', lambda m: '"%s"' % container.path(m.group(1)), text)


class Pod:
    """The manifest's pod, played on this host: volumes, the ConfigMap, the two containers."""

    def __init__(self, base: Path, rx: OtlpReceiver, logs: Path) -> None:
        cm, pod = manifest()
        spec = pod["spec"]
        pod_sc = spec["securityContext"]
        fs_group = int(pod_sc["fsGroup"])
        # Volumes, as kubelet makes them.
        make_dir(base / "volumes", 0o755)
        self.volumes = {v["name"]: make_dir(base / "volumes" / v["name"],
                                            *((0o2777, 0, fs_group) if "emptyDir" in v else (0o755,)))
                        for v in spec["volumes"]}
        python = str(shared_python(base))
        programs = {"infersight": [python, "-m", "infersight"], "python": [python]}
        self.sidecar_spec = next(c for c in spec["initContainers"] if c["name"] == "infersight")
        self.model_spec = next(c for c in spec["containers"] if c["name"] == "model-server")
        assert self.sidecar_spec["restartPolicy"] == "Always", "a native sidecar: it starts first"
        self.sidecar = Container(self.sidecar_spec, pod_sc, self.volumes, programs, base / "sidecar-root-tmp")
        self.model = Container(self.model_spec, pod_sc, self.volumes, programs, base / "model-root-tmp")

        # The ConfigMap's files, paths as the sidecar sees them; the collector is our receiver.
        config_text = cm["data"]["infersight.toml"]
        self.config = tomllib.loads(config_text)
        config_text = config_text.replace(self.config["exporters"]["otlp"]["endpoint"], rx.http_endpoint)
        config_text = remap_config(config_text, self.sidecar)
        cm_volume = next(v["name"] for v in spec["volumes"]
                         if v.get("configMap", {}).get("name") == cm["metadata"]["name"])
        for key in cm["data"]:
            f = self.volumes[cm_volume] / key
            f.write_text(config_text if key == "infersight.toml" else cm["data"][key])
            f.chmod(0o644)
        self.sidecar_log, self.model_log = logs / "sidecar.log", logs / "model.log"
        self.app = make_dir(base / "app", 0o755)  # the image's working directory
        (self.app / "serve.py").write_text(SERVE)
        self.rw = make_dir(base / "app-rw", 0o777)

    def start_sidecar(self) -> subprocess.Popen[bytes]:
        agent = self.sidecar.popen(entrypoint() + self.sidecar_spec["args"], cwd=Path("/"), log=self.sidecar_log)
        probe = self.sidecar_spec["startupProbe"]["exec"]["command"]
        assert wait_for(lambda: agent.poll() is not None or self.sidecar.run(probe, Path("/")).returncode == 0,
                        30, 0.1), self.sidecar_log.read_text()
        assert agent.poll() is None, "the sidecar exited: " + self.sidecar_log.read_text()
        return agent

    def start_model(self, portfile: Path) -> subprocess.Popen[bytes]:
        command = [*self.model_spec["command"], str(portfile)]  # serve.py's argument: where it says its port
        server = self.model.popen(command, cwd=self.app, log=self.model_log)
        assert wait_for(portfile.exists, 60), self.model_log.read_text()
        return server


def _coldstart_root(rx: OtlpReceiver, pid: int) -> Any:
    for res, _scope, span in rx.spans():
        if span.name == "coldstart" and res.get("process.pid") == pid:
            return span
    return None


def test_model_server_cold_start_reaches_the_collector_through_the_sidecar(tmp_path: Path) -> None:
    require_root()
    with open_base("isf-pod-") as base, OtlpReceiver(grpc_=False) as rx:
        pod = Pod(base, rx, tmp_path)
        agent = pod.start_sidecar()
        try:
            portfile = pod.rw / "port"
            server = pod.start_model(portfile)
            port, pid = read_port_pid(portfile)
            with urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=30) as resp:
                assert resp.status == 200
            assert server.wait(120) == 0, pod.model_log.read_text()
            out = pod.model_log.read_text()
            sock = pod.model.path(pod.config["agent"]["socket"])
            assert "reporting to the agent at %s" % sock in out, out
            assert "infersight cold start:" in out, out  # the waterfall, in the model server's log
            assert rx.wait_for(lambda: _coldstart_root(rx, pid) is not None, 30), pod.sidecar_log.read_text()
            assert pod.sidecar_spec["livenessProbe"]["exec"]["command"][-1] == "--alive"
            # the socket's directory, made by the agent in the 2777 emptyDir: no other uid may replace the socket
            sock_dir = os.stat(os.path.dirname(sock))
            assert not sock_dir.st_mode & 0o022 and sock_dir.st_uid == os.stat(sock).st_uid, oct(sock_dir.st_mode)
            for probe_name in ("startupProbe", "livenessProbe"):
                r = pod.sidecar.run(pod.sidecar_spec[probe_name]["exec"]["command"], Path("/"))
                assert r.returncode == 0, r.stdout + r.stderr
            assert not list(pod.app.glob("infersight-*.otlp.jsonl")), "joined: the data went to the sidecar"
            # the agent's state and the hooks' spool are where the ConfigMap says, inside the pod's volumes
            assert Path(pod.sidecar.path(pod.config["agent"]["state_dir"])).is_dir()
            assert Path(pod.sidecar.path(pod.config["agent"]["spool_dir"])).is_dir()
        finally:
            agent.terminate()
            assert agent.wait(30) == 0, pod.sidecar_log.read_text()


def test_a_sidecar_restart_during_the_model_servers_life_loses_nothing(tmp_path: Path) -> None:
    """The sidecar dies (OOM-killed, say) while the model server runs, and kubelet restarts it: the hooks
    spool to the shared spool volume meanwhile and hand it over, so the request served while the agent was
    away reaches the collector. Before, the hooks refused the volume (an emptyDir, 2777 without the
    sticky bit) and dropped those events."""
    require_root()
    with open_base("isf-pod-") as base, OtlpReceiver(grpc_=False) as rx:
        pod = Pod(base, rx, tmp_path)
        agent = pod.start_sidecar()
        try:
            portfile = pod.rw / "port"
            server = pod.start_model(portfile)
            port, pid = read_port_pid(portfile)
            agent.kill()  # SIGKILL, while the model server is listening: no goodbye
            agent.wait(30)
            with urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=30) as resp:
                assert resp.status == 200  # served while no agent listens: its events are spooled
            assert server.wait(120) == 0, pod.model_log.read_text()
            out = pod.model_log.read_text()
            assert "cannot spool" not in out and "lost" not in out, out
            agent = pod.start_sidecar()  # kubelet's restart: it replays what the model server spooled

            assert rx.wait_for(lambda: _coldstart_root(rx, pid) is not None, 30), (pod.model_log.read_text()
                                                                                  + pod.sidecar_log.read_text())
            stages = {span.name for res, _scope, span in rx.spans() if res.get("process.pid") == pid}
            assert {"coldstart.runtime_init", "coldstart.ready_wait"} <= stages, stages
            status = pod.sidecar.run(["infersight", "status", "--json"], Path("/"))
            assert json.loads(status.stdout)["counters"]["spool_files_replayed"] >= 1, status.stdout
            assert not list(Path(pod.sidecar.path(pod.config["agent"]["spool_dir"])).glob("*.spool"))
        finally:
            agent.terminate()
            assert agent.wait(30) == 0, pod.sidecar_log.read_text()
