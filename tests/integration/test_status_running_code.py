"""`status` tells a running agent that predates the installed infersight (an upgrade that was not restarted).

Every build says version 0.1.0: after `pip install --force-reinstall` the old agent, still running, answered as the
new one would, and `install-service` (`systemctl enable --now`) does not restart a running service. The agent now
reports the fingerprint of the files it loaded at start, and `status` compares it with the install it runs from.
Here the install is a copy of the package, laid out as a wheel installs it, whose files change under a real agent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from conftest import wait_for

from infersight.agent.daemon.health import CODE_PACKAGES, CodePrint, code_predates

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {"infersight": "infersight", "infersight.agent": "agent", "infersight.hooks": "hooks",
           "infersight.exporters": "exporters", "infersight.rules": "rules"}


def _install_copy(site: Path) -> Path:
    """The package as a wheel lays it out (one ``infersight`` folder), from this checkout."""
    assert set(FOLDERS) == set(CODE_PACKAGES)
    pkg = site / "infersight"
    shutil.copytree(REPO / "infersight", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for name, folder in FOLDERS.items():
        if name != "infersight":
            shutil.copytree(REPO / folder, pkg / name.split(".", 1)[1], ignore=shutil.ignore_patterns("__pycache__"))
    return pkg


def _status(env: dict[str, str], sock: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infersight", "status", "--socket", str(sock), *extra],
                          env=env, cwd="/", capture_output=True, text=True, timeout=60)  # (-m: cwd is on sys.path)


def test_status_says_a_running_agent_predates_the_files_installed_under_it(tmp_path: Path) -> None:
    site = tmp_path / "site"
    pkg = _install_copy(site)
    sock, spool, state = tmp_path / "agent.sock", tmp_path / "spool", tmp_path / "state"
    config = tmp_path / "infersight.toml"
    config.write_text('[agent]\nsocket = "%s"\nspool_dir = "%s"\nstate_dir = "%s"\n[exporters.file]\npath = "%s"\n'
                      % (sock, spool, state, tmp_path / "out.otlp.jsonl"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERSIGHT_", "OTEL_"))}
    env.update(PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1")
    log = tmp_path / "agent.log"
    agent = subprocess.Popen([sys.executable, "-m", "infersight", "agent", "--config", str(config)], env=env, cwd="/",
                             stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    try:
        assert wait_for(lambda: '"version"' in _status(env, sock, "--json").stdout, 30), log.read_text()
        h = json.loads(_status(env, sock, "--json").stdout)
        assert h["code"]["path"] == str(pkg.resolve()), h["code"]  # the copy, not this checkout
        assert not [w for w in h["warnings"] if "predates" in w], h["warnings"]

        # an upgrade replaces the files; the agent runs on with what it loaded
        later = time.time() + 60
        os.utime(pkg / "agent" / "daemon" / "lifecycle.py", (later, later))
        r = _status(env, sock)
        assert r.returncode == 0, r.stdout  # a warning, as the agent's own: the exit status stays the health's
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(later))
        assert ("  WARNING the running agent predates the installed infersight (installed %s): restart it "
                "(systemctl restart infersight)" % when) in r.stdout, r.stdout
        h = json.loads(_status(env, sock, "--json").stdout)
        assert [w for w in h["warnings"] if "predates" in w], h["warnings"]
        assert {"version", "healthy", "warnings", "code"} <= set(h)

        # another install's CLI (this checkout) has no say on this agent's
        other = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        assert "predates" not in _status(other, sock).stdout
    finally:
        agent.terminate()
        assert agent.wait(30) == 0, log.read_text()


def test_code_predates_only_for_the_same_install_with_other_files() -> None:
    installed = CodePrint("/opt/infersight/lib/python3.11/site-packages/infersight", "aaaa", 1_800_000_000 * 10**9)
    same = {"path": installed.path, "fingerprint": "aaaa", "installed_ns": 1}
    assert code_predates(same, installed) is None
    older = dict(same, fingerprint="bbbb")
    w = code_predates(older, installed)
    assert w is not None and w.startswith("the running agent predates the installed infersight (installed ")
    assert w.endswith("): restart it (systemctl restart infersight)")
    assert time.strftime("%Y-%m-%d", time.localtime(1_800_000_000)) in w
    assert code_predates(dict(older, path="/usr/lib/python3/dist-packages/infersight"), installed) is None
    assert code_predates(None, installed) is None  # an agent older than the fingerprint says nothing of it
    assert code_predates(older, CodePrint("", "cccc", 0)) is None
