"""``doctor`` run as a server's user that is not in the socket's group said "no daemon socket at
/run/infersight/agent.sock" and "optional: infersight launch runs its own agent" (a review of the systemd
path): ``os.path.exists`` is False when the directory may not be searched. It names the denial, the user,
the group and how to join it now; the same for a 0660 socket it may see but not connect to. Real
permissions: a user made with ``useradd``, the check run in a child that became that user."""

from __future__ import annotations

import grp
import json
import os
import pwd
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import infersight.agent.commands.status  # noqa: F401 - imported before the child drops root
import infersight.hooks._wire  # noqa: F401
from infersight.agent.commands import doctor
from infersight.agent.daemon import config as cfg

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a user and act as it")

USER, GROUP = "isops3dr", "isops3sk"


@pytest.fixture(scope="module")
def user_and_group() -> Iterator[tuple[pwd.struct_passwd, int]]:
    made: list[list[str]] = []
    try:
        for cmd, look in ((["groupadd", GROUP], lambda: grp.getgrnam(GROUP)),
                          (["useradd", "-M", "-s", "/usr/sbin/nologin", USER], lambda: pwd.getpwnam(USER))):
            try:
                look()
            except KeyError:
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    pytest.skip("cannot run %s: %s" % (cmd[0], r.stderr.strip()))
                made.append(["groupdel", GROUP] if cmd[0] == "groupadd" else ["userdel", USER])
        yield pwd.getpwnam(USER), grp.getgrnam(GROUP).gr_gid
    finally:
        for cmd in reversed(made):
            subprocess.run(cmd, capture_output=True)


def as_user(pw: pwd.struct_passwd, fn: Callable[[], Any]) -> Any:
    """``fn()`` in a forked child running as ``pw`` (its own groups only), its JSON answer."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            os.setgroups(os.getgrouplist(pw.pw_name, pw.pw_gid))
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            os.write(w, json.dumps(fn()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the child failed"
    return json.loads(data)


def socket_checks(path: Path) -> list[dict[str, str]]:
    conf = cfg.load(None, env={"INFERSIGHT_SOCKET": str(path)})
    return [c.__dict__ for c in doctor.check_socket(conf)]


@pytest.mark.parametrize("closed", ["directory", "socket"])
def test_a_user_outside_the_socket_group_is_told_to_join_it(
        open_dir: Path, user_and_group: tuple[pwd.struct_passwd, int], closed: str) -> None:
    pw, gid = user_and_group
    run = open_dir / "run"
    run.mkdir()
    os.chown(run, 0, gid)
    os.chmod(run, 0o750 if closed == "directory" else 0o755)  # tmpfiles.d's 0750, or a 0755 the socket unit made
    path = run / "agent.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        s.listen()
        os.chown(path, 0, gid)
        os.chmod(path, 0o660)
        checks = as_user(pw, lambda: socket_checks(path))
    (check,) = [c for c in checks if c["name"] == "agent"]
    assert check["status"] == doctor.WARN, check
    assert "no daemon socket" not in check["detail"] and "launch" not in check["fix"], check
    assert check["detail"] == "the socket %s exists, but permission denied for uid %d (%s, not in group %s)" % (
        path, pw.pw_uid, USER, GROUP), check
    assert check["fix"] == "usermod -aG %s %s, then restart its processes (a service: SupplementaryGroups=%s)" % (
        GROUP, USER, GROUP), check


def test_a_socket_that_is_not_there_is_still_said_so(open_dir: Path,
                                                     user_and_group: tuple[pwd.struct_passwd, int]) -> None:
    pw, _ = user_and_group
    (check,) = as_user(pw, lambda: socket_checks(open_dir / "none.sock"))
    assert check["detail"] == "no daemon socket at %s" % (open_dir / "none.sock"), check
