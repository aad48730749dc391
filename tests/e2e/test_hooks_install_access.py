"""``hooks install`` into the venv of a server that runs as another user, from an install that user cannot
read (root's umask 077 made it 0700): it succeeded silently, ``doctor --python`` said ok, and the served process
printed only ``bootstrap failed, running without hooks: PermissionError(13, 'Permission denied')`` (a review of
the systemd path). Now both name the first path in the way, the user, and the fix, and the served process names
the file it could not read. Everything real: a user made with ``useradd``, its own venv, its process."""

from __future__ import annotations

import io
import os
import pwd
import shutil
import subprocess
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

import infersight.hooks
from infersight.agent.commands import doctor, hooks_install

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a user and act as it")

USER = "isops2hk"


@pytest.fixture(scope="module")
def server_user() -> Iterator[pwd.struct_passwd]:
    made = False
    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        r = subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", USER], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip("cannot make user %s: %s" % (USER, r.stderr.strip()))
        made = True
        pw = pwd.getpwnam(USER)
    yield pw
    if made:
        subprocess.run(["pkill", "-KILL", "-u", USER], capture_output=True)
        subprocess.run(["userdel", USER], capture_output=True)


def private_install(base: Path) -> Path:
    """A copy of the hooks package as root installs it under umask 077: directories 0700, files 0600."""
    hooks = base / "opt" / "infersight" / "hooks"
    shutil.copytree(Path(infersight.hooks.__file__).parent, hooks, ignore=shutil.ignore_patterns("__pycache__"))
    for top, dirs, files in os.walk(base / "opt"):
        os.chmod(top, 0o700)
        for f in files:
            os.chmod(os.path.join(top, f), 0o600)
    return hooks / "bootstrap"


def served(py: str, pw: pwd.struct_passwd, base: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "INFERSIGHT": "1", "INFERSIGHT_SOCKET": str(base / "none.sock"),
           "INFERSIGHT_SPOOL_DIR": str(base / "spool"), "INFERSIGHT_EXIT_FLUSH_S": "0"}
    code = "import sys; h = sys.modules.get('infersight.hooks'); print('active' if h and h.active() else 'off')"
    return subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                          user=pw.pw_uid, group=pw.pw_gid, extra_groups=[], cwd="/")


def test_an_install_the_servers_user_cannot_read_is_named_with_its_fix(
        open_dir: Path, server_user: pwd.struct_passwd, monkeypatch: pytest.MonkeyPatch) -> None:
    boot = private_install(open_dir)
    monkeypatch.setattr(hooks_install, "_bootstrap_dir", lambda: str(boot))
    monkeypatch.setattr(doctor, "_bootstrap_dir", lambda: str(boot))
    srv = open_dir / "srv"
    venv.create(srv, with_pip=False)
    subprocess.run(["chown", "-R", "%d:%d" % (server_user.pw_uid, server_user.pw_gid), str(srv)], check=True)
    (open_dir / "spool").mkdir(mode=0o777)
    os.chmod(open_dir / "spool", 0o1777)
    py = str(srv / "bin" / "python")

    out = io.StringIO()
    assert hooks_install.install(py, out) == 0  # it still installs: a later chmod makes it work
    said = out.getvalue()
    warning = next((ln for ln in said.splitlines() if ln.startswith("warning: ")), "")
    assert "uid %d (%s), who owns" % (server_user.pw_uid, USER) in warning, said
    assert "cannot enter %s (drwx------ root:root)" % (open_dir / "opt") in warning, said
    fix = next(ln for ln in said.splitlines() if ln.startswith("  fix: "))[len("  fix: "):]
    assert fix.startswith("chmod o+x %s %s && chmod -R o+rX %s (" % (
        open_dir / "opt", open_dir / "opt" / "infersight", boot.parent)), fix

    check = doctor.check_launch(py)  # the hooks activate as root, doctor's user: that was "ok"
    assert check.status == doctor.WARN and "cannot enter %s" % (open_dir / "opt") in check.detail, check
    assert check.fix == fix

    r = served(py, server_user, open_dir)
    assert r.returncode == 0 and r.stdout.strip() == "off", r.stderr  # it serves, unhooked
    assert "bootstrap failed, running without hooks" in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr  # once, though site reads a venv's .pth line twice
    assert str(boot / "_infersight_pth.py") in r.stderr and "uid %d" % server_user.pw_uid in r.stderr, r.stderr
    assert "infersight hooks install --python %s" % py in r.stderr, r.stderr

    subprocess.run(fix.split(" (", 1)[0], shell=True, check=True)  # noqa: S602 - the command it printed
    out = io.StringIO()
    assert hooks_install.install(py, out) == 0
    assert "warning" not in out.getvalue(), out.getvalue()
    assert doctor.check_launch(py).status == doctor.OK
    r = served(py, server_user, open_dir)
    assert r.stdout.strip() == "active" and "bootstrap failed" not in r.stderr, r.stderr


def test_a_venv_only_root_may_reach_is_not_checked(open_dir: Path) -> None:
    """Root's own server (its venv 0700, or under a 0700 directory): root reads anything, there is no one else
    to warn for. Root's venv open to all: any user may run it."""
    site = open_dir / "venv" / "site"
    site.mkdir(parents=True, mode=0o700)
    os.chmod(site, 0o700)
    assert hooks_install.audience(str(site)) is None
    os.chmod(site, 0o755)
    os.chmod(site.parent, 0o700)  # open itself, but no one else can reach it
    assert hooks_install.audience(str(site)) is None
    os.chmod(site.parent, 0o755)
    who = hooks_install.audience(str(site))
    assert who is not None and who.uid == -1 and not who.gids
