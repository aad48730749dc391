"""Running infersight's parts as other uids, as a fleet host or a pod runs them (root only).

The test's own interpreter may live where another uid cannot read it (pyenv under a 0700
``/root``): :func:`shared_python` makes a venv from the system Python of the same version that
any uid can run, with this checkout's installed packages (infersight in editable mode and its
dependencies) added through a ``.pth`` line. Nothing else is shared with the test process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A served process: a stdlib HTTP server that listens (readiness), answers one request and
# exits 0. It writes "PORT PID" where the test reads it.
SERVE = """\
import os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

server = HTTPServer(("127.0.0.1", 0), Handler)
tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as f:
    f.write("%d %d" % (server.server_address[1], os.getpid()))
os.replace(tmp, sys.argv[1])
server.handle_request()
"""


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the agent and the served process as their own uids")


def system_python() -> str:
    want = "%d.%d" % sys.version_info[:2]
    for p in ("/usr/bin/python" + want, "/usr/local/bin/python" + want):
        if os.access(p, os.X_OK):
            return p
    pytest.skip("no system python%s that other uids can run" % want)


@contextmanager
def open_base(prefix: str) -> Iterator[Path]:
    """A scratch root every uid can traverse (pytest's tmp_path is root's only)."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def shared_python(base: Path) -> Path:
    """A venv any uid can run, seeing this checkout's installed packages."""
    venv = base / "shared-venv"
    subprocess.run([system_python(), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    ours = sysconfig.get_paths()["purelib"]
    (site / "zz-infersight-checkout.pth").write_text("import site; site.addsitedir(%r)\n" % ours)
    return venv / "bin" / "python"


def make_dir(path: Path, mode: int, uid: int = 0, gid: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, gid)
    os.chmod(path, mode)
    return path


def base_env(**extra: str) -> dict[str, str]:
    """A bare environment, as a service manager or a container runtime gives one."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    env.update(extra)
    return env


def read_port_pid(path: Path) -> tuple[int, int]:
    port, pid = path.read_text().split()
    return int(port), int(pid)
