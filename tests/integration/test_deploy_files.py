"""Static checks of the Dockerfile and the Kubernetes example (no engine or cluster here)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra")

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
POD = ROOT / "deploy" / "kubernetes" / "pod.yaml"
SOCKET = "/run/infersight/agent/agent.sock"  # the pod's: a subdirectory the agent makes (the emptyDir is 2777)
IMAGE_SOCKET = "/run/infersight/agent.sock"  # the image's default: its /run/infersight is the agent's own (0750)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    instrs = dockerfile_instructions()
    last_from = max(i for i, (w, _) in enumerate(instrs) if w == "FROM")
    return instrs[last_from:]


def test_dockerfile_runs_as_non_root() -> None:
    users = [arg for word, arg in final_stage() if word == "USER"]
    assert users, "final stage must set USER"
    user = users[-1].split(":")[0]
    assert user not in ("0", "root", "")


def test_dockerfile_healthcheck_entrypoint_volume() -> None:
    stage = dict(final_stage())
    assert stage["FROM"].startswith("python:")
    assert "slim" in stage["FROM"]
    assert stage["HEALTHCHECK"].endswith('CMD ["infersight", "status"]')
    assert stage["ENTRYPOINT"] == '["infersight", "agent"]'
    assert "/run/infersight" in stage["VOLUME"]
    assert f"INFERSIGHT_SOCKET={IMAGE_SOCKET}" in stage["ENV"]
    assert "NVIDIA_VISIBLE_DEVICES" not in DOCKERFILE.read_text().replace(
        "# No NVIDIA_VISIBLE_DEVICES", ""
    )


def test_the_image_installs_the_grpc_extra() -> None:
    """The README's config table offers `protocol = "grpc"`: without the extra the sidecar exits 2 and, as a native
    sidecar gating the model server, holds the pod in Init:CrashLoopBackOff."""
    stage = final_stage()
    assert ("ARG", "EXTRAS=grpc") in stage
    (install,) = [arg for word, arg in stage if word == "RUN" and "pip install" in arg]
    assert install.startswith("set -- /wheels/infersight-*.whl") and '"$1${EXTRAS:+[$EXTRAS]}"' in install
    # what the shell makes of it, with the default and without
    for extras, want in (("grpc", "/wheels/infersight-1-py3-none-any.whl[grpc]"),
                         ("", "/wheels/infersight-1-py3-none-any.whl")):
        got = subprocess.run(["sh", "-c", 'set -- /wheels/infersight-1-py3-none-any.whl; EXTRAS="%s"; '
                              'printf %%s "$1${EXTRAS:+[$EXTRAS]}"' % extras],
                             capture_output=True, text=True, check=True).stdout
        assert got == want


def test_dockerignore_keeps_the_venv_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored
    assert ".git" in ignored


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed")
def test_hadolint() -> None:
    proc = subprocess.run(
        ["hadolint", str(DOCKERFILE)], check=False, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def pod() -> dict[str, Any]:
    docs = list(yaml.safe_load_all(POD.read_text()))
    pods = [d for d in docs if d["kind"] == "Pod"]
    assert len(pods) == 1
    result: dict[str, Any] = pods[0]
    return result


def containers(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_pod_shares_the_socket_through_an_empty_dir() -> None:
    spec = pod()["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    cs = containers(spec)
    assert set(cs) == {"infersight", "model-server"}
    mounts = [
        {m["mountPath"]: m["name"] for m in c["volumeMounts"]}["/run/infersight"]
        for c in cs.values()
    ]
    assert len(set(mounts)) == 1, "both containers mount the same volume"
    assert "emptyDir" in volumes[mounts[0]]
    for c in cs.values():
        assert env(c)["INFERSIGHT_SOCKET"] == SOCKET


def test_sidecar_probes_and_hardening() -> None:
    spec = pod()["spec"]
    side = containers(spec)["infersight"]
    if side in spec.get("initContainers", []):
        assert side["restartPolicy"] == "Always", "a native sidecar, not a one-shot init"
    # Every probe asks only that the agent answers: a native sidecar's startup probe holds the model
    # server back and its readiness counts in the pod's Ready condition, so an exporter's health (a
    # collector outage) must not take the server out of its Service; a restart would not mend it.
    for probe in ("startupProbe", "livenessProbe"):
        assert side[probe]["exec"]["command"] == ["infersight", "status", "--alive"]
        assert side[probe]["timeoutSeconds"] >= 5, "the 1 s default times out on a busy node"
    if "readinessProbe" in side:
        assert side["readinessProbe"]["exec"]["command"] == ["infersight", "status", "--alive"]
    sc = side["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] != 0
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "nvidia.com/gpu" not in side.get("resources", {}).get("limits", {})
    assert not spec.get("hostPID"), "hostPID is opt-in, documented in deploy/kubernetes/README.md"


def test_model_server_gets_the_gpu() -> None:
    model = containers(pod()["spec"])["model-server"]
    assert model["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_configmap_is_valid_infersight_toml() -> None:
    docs = list(yaml.safe_load_all(POD.read_text()))
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    cfg = tomllib.loads(cm["data"]["infersight.toml"])
    assert cfg["agent"]["socket"] == SOCKET
    model = containers(pod()["spec"])["model-server"]
    assert model["securityContext"]["runAsUser"] in cfg["agent"]["allowed_uids"]
    side = containers(pod()["spec"])["infersight"]
    assert shlex.join(side["args"]) == "--config /etc/infersight/infersight.toml"


def _size(limit: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(limit[:-2]) * units[limit[-2:]]


def test_the_model_server_cannot_rename_the_agents_socket_directory() -> None:
    """The socket's emptyDir is 2777 without the sticky bit: writable there, the model server's uid could rename
    the agent's socket directory away and listen in its place (a review on a played pod). Read-only, it cannot;
    connecting to the socket needs no write."""
    model = containers(pod()["spec"])["model-server"]
    (run,) = [m for m in model["volumeMounts"] if m["mountPath"] == "/run/infersight"]
    assert run.get("readOnly") is True


def test_what_the_agent_and_the_hooks_may_write_fits_the_volumes_size_limits() -> None:
    """An emptyDir past its sizeLimit gets the whole pod evicted, model server included: the exporters' disk
    spool (default 256 MiB each) against the state volume's 64Mi, the hooks' spool against its volume."""
    docs = list(yaml.safe_load_all(POD.read_text()))
    cfg = tomllib.loads(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["infersight.toml"])
    spec = pod()["spec"]
    limits = {v["name"]: _size(v["emptyDir"]["sizeLimit"]) for v in spec["volumes"] if "emptyDir" in v}
    assert 2 * cfg["agent"]["exporter_spool_max_bytes"] <= limits["infersight-state"]  # room for the history too
    side, model = containers(spec)["infersight"], containers(spec)["model-server"]
    assert env(side)["INFERSIGHT_MEASURE_STORAGE"] == "0", "its 64 MiB sample would fill the state volume"
    assert 16 * int(env(model)["INFERSIGHT_SPOOL_MAX_BYTES"]) <= limits["infersight-spool"]
    assert {m["mountPath"] for m in model["volumeMounts"]} >= {"/tmp"}, "launch's private directory"
