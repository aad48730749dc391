"""Static checks of the systemd units and snippets (no systemd as PID 1 needed).

systemd-analyze comes from the Debian package `systemd`; CI installs it so that
these tests never skip there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "systemd"
SERVICE = SYSTEMD / "infersight.service"
SOCKET = SYSTEMD / "infersight.socket"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None,
    reason="systemd-analyze not found: apt-get install systemd (CI must install it)",
)


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value (systemd keys repeat, so configparser won't do)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path}: key outside a section: {raw!r}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def staged_units(tmp_path: Path) -> tuple[Path, Path]:
    """Copies whose ExecStart names an existing executable, as install-service writes them."""
    exe = tmp_path / "infersight"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    service = tmp_path / SERVICE.name
    service.write_text(
        re.sub(r"^ExecStart=\S+", f"ExecStart={exe}", SERVICE.read_text(), flags=re.M)
    )
    socket_unit = tmp_path / SOCKET.name
    shutil.copy(SOCKET, socket_unit)
    return service, socket_unit


def exposure(unit: Path) -> tuple[float, str]:
    assert ANALYZE is not None
    proc = subprocess.run(
        [ANALYZE, "security", "--offline=yes", "--no-pager", str(unit)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = proc.stdout + proc.stderr
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", out)
    assert match, f"no exposure score in output (rc={proc.returncode}):\n{out}"
    return float(match.group(1)), out


@needs_analyze
def test_security_exposure_at_most_2() -> None:
    score, out = exposure(SERVICE)
    assert score <= 2.0, out


@needs_analyze
def test_verify_is_clean(tmp_path: Path) -> None:
    service, socket_unit = staged_units(tmp_path)
    assert ANALYZE is not None
    proc = subprocess.run(
        [ANALYZE, "verify", "--no-pager", str(socket_unit), str(service)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (proc.stdout + proc.stderr).strip() == "", proc.stdout + proc.stderr


@needs_analyze
def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The verify test above would notice a bad directive (guards against a silent no-op)."""
    service, socket_unit = staged_units(tmp_path)
    service.write_text(service.read_text().replace("Type=notify", "Type=notifyy"))
    assert ANALYZE is not None
    proc = subprocess.run(
        [ANALYZE, "verify", "--no-pager", str(socket_unit), str(service)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "notifyy" in proc.stdout + proc.stderr


def test_service_contents() -> None:
    svc = parse_unit(SERVICE)["Service"]
    assert svc["Type"] == ["notify"]
    assert svc["NotifyAccess"] == ["main"]
    assert svc["WatchdogSec"]
    assert svc["WatchdogSec"][0] not in ("0", "infinity")
    assert svc["Restart"] == ["on-failure"]
    assert svc["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert svc["ExecStart"][0].endswith("agent --config /etc/infersight/infersight.toml")
    assert svc["User"] == ["infersight"]
    assert svc["Group"] == ["infersight"]
    assert svc["DevicePolicy"] == ["closed"]
    groups = {v.split()[0] for v in svc["DeviceAllow"]}
    assert "char-nvidia*" in groups
    assert {"char-nvidiactl", "char-nvidia-uvm", "char-nvidia-frontend"} <= groups
    assert all(g.startswith("char-") for g in groups), "globs work only in group names"
    assert svc["StateDirectory"] == ["infersight"]
    assert svc["ConfigurationDirectory"] == ["infersight"]
    assert "PrivateDevices" not in svc, "GPU access needs /dev/nvidia*"
    assert "RuntimeDirectory" not in svc, "the socket unit owns /run/infersight"
    assert svc["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6 AF_NETLINK"]
    assert "@system-service" in svc["SystemCallFilter"]
    unit = parse_unit(SERVICE)["Unit"]
    assert "infersight.socket" in unit["Requires"][0].split()


def test_socket_contents() -> None:
    sock = parse_unit(SOCKET)["Socket"]
    assert sock["ListenStream"] == ["/run/infersight/agent.sock"]
    mode = int(sock["SocketMode"][0], 8)
    assert mode & 0o007 == 0, "0660 or stricter"
    assert mode & 0o600 == 0o600, "the agent user reads and writes"
    assert sock["SocketUser"] == ["infersight"]
    assert sock["SocketGroup"] == ["infersight"]
    assert sock["Service"] == ["infersight.service"]


def test_snippets_match_units() -> None:
    sysusers = (SYSTEMD / "sysusers.d" / "infersight.conf").read_text()
    assert re.search(r"^u infersight -", sysusers, re.M)
    tmpfiles = (SYSTEMD / "tmpfiles.d" / "infersight.conf").read_text()
    entries = {f[1]: f for f in (ln.split() for ln in tmpfiles.splitlines()) if f and f[0] == "d"}
    assert entries["/run/infersight"][2:5] == ["0750", "infersight", "infersight"]
    assert entries["/var/lib/infersight/spool"][2:5] == ["3770", "infersight", "infersight"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to the new user needs root")
@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None, reason="apt-get install systemd")
def test_sysusers_and_tmpfiles_apply_in_a_scratch_root(tmp_path: Path) -> None:
    (tmp_path / "etc" / "sysusers.d").mkdir(parents=True)
    (tmp_path / "etc" / "tmpfiles.d").mkdir(parents=True)
    shutil.copy(SYSTEMD / "sysusers.d" / "infersight.conf", tmp_path / "etc" / "sysusers.d")
    shutil.copy(SYSTEMD / "tmpfiles.d" / "infersight.conf", tmp_path / "etc" / "tmpfiles.d")
    subprocess.run(["systemd-sysusers", f"--root={tmp_path}"], check=True, timeout=60)
    passwd = (tmp_path / "etc" / "passwd").read_text()
    uid = int(next(ln for ln in passwd.splitlines() if ln.startswith("infersight:")).split(":")[2])
    subprocess.run(["systemd-tmpfiles", f"--root={tmp_path}", "--create"], check=True, timeout=60)
    spool = (tmp_path / "var/lib/infersight/spool").stat()
    assert spool.st_uid == uid
    assert spool.st_mode & 0o7777 == 0o3770  # setgid + sticky: no member removes another's file
    run = (tmp_path / "run/infersight").stat()
    assert run.st_uid == uid
    assert run.st_mode & 0o7777 == 0o750


def test_default_config_parses_and_examples_are_valid() -> None:
    text = (SYSTEMD / "infersight.toml").read_text()
    assert tomllib.loads(text)  # as shipped: only tables
    # Uncomment every "# key = value" example: the result must still be valid TOML.
    examples = re.sub(r"^# ([a-z_]+ = )", r"\1", text, flags=re.M)
    cfg = tomllib.loads(examples)
    agent = cfg["agent"]
    assert agent["socket"] == "/run/infersight/agent.sock"
    assert agent["socket_mode"] == 0o660
    assert agent["spool_dir"] == "/var/lib/infersight/spool"
    assert agent["exporter_spool_max_bytes"] == 256 << 20
    prom = cfg["exporters"]["prometheus"]
    assert (prom["enabled"], prom["host"], prom["port"]) == (False, "127.0.0.1", 9464)
    assert cfg["nvml"]["interval_s"] == 1.0
    assert set(cfg["exporters"]) == {"file", "otlp", "console", "mqtt", "prometheus"}
    assert isinstance(cfg["rules"]["dirs"], list)
    # That the agent's own loader accepts it, with the real defaults: tests/e2e/test_config_example.py.


def test_package_data_matches_checkout() -> None:
    """agent/data/ (wheel package data) holds the same bytes as systemd/."""
    data = ROOT / "agent" / "data"
    pairs = {
        "infersight.service": SERVICE,
        "infersight.socket": SOCKET,
        "infersight.toml": SYSTEMD / "infersight.toml",
        "sysusers-infersight.conf": SYSTEMD / "sysusers.d" / "infersight.conf",
        "tmpfiles-infersight.conf": SYSTEMD / "tmpfiles.d" / "infersight.conf",
    }
    for name, src in pairs.items():
        assert (data / name).read_bytes() == src.read_bytes(), name


def test_a_config_error_at_start_is_not_restarted_every_2_s(tmp_path: Path) -> None:
    """A typo in the config exits 2 and ``Restart=on-failure`` restarted the agent every 2 s, reading the same file
    (a review of the systemd path). Exit 2 is a configuration or usage error found at start, and the unit does
    not restart it; a crash (1) or a signal still restarts."""
    svc = parse_unit(SERVICE)["Service"]
    assert svc["Restart"] == ["on-failure"] and svc["RestartPreventExitStatus"] == ["2"]
    conf = tmp_path / "infersight.toml"
    conf.write_text('[agent]\nsocket = "%s"\nlog_levle = "info"\n' % (tmp_path / "agent.sock"))
    r = subprocess.run([sys.executable, "-m", "infersight", "agent", "--config", str(conf)], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "INFERSIGHT_STATE_DIR": str(tmp_path / "state")})
    assert r.returncode == 2, r.stderr
    assert "%s:3: unknown key 'agent.log_levle' (did you mean 'agent.log_level'?)" % conf in r.stderr, r.stderr
