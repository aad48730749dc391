"""Real local users for the tests where one member of the socket group attacks another's process (root only).

``socket_group(group, *members)`` makes the group and its members where they are missing and removes what it
made afterwards (the users before their group, their processes killed first: ``userdel`` refuses a user with a
process left by a test that failed half way)."""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def system_python3() -> str:
    """The venv's interpreter lives under /root: the other users run a system Python."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    pytest.skip("no system python3 for the other users' processes")


def _ensure_user(name: str, gid: int, made: list[list[str]]) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        r = subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", "-G", str(gid), name],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip("cannot make user %s: %s" % (name, r.stderr.strip()))
        made.append(["userdel", name])
        return pwd.getpwnam(name)


@contextmanager
def socket_group(group: str, *members: str) -> Iterator[tuple[int, list[pwd.struct_passwd]]]:
    """The group's gid and its members' entries."""
    made: list[list[str]] = []
    try:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            r = subprocess.run(["groupadd", group], capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip("cannot make group %s: %s" % (group, r.stderr.strip()))
            made.append(["groupdel", group])
            gid = grp.getgrnam(group).gr_gid
        yield gid, [_ensure_user(name, gid, made) for name in members]
    finally:
        for cmd in reversed(made):  # the users before their group
            if cmd[0] == "userdel":
                subprocess.run(["pkill", "-KILL", "-u", cmd[1]], capture_output=True)
            if subprocess.run(cmd, capture_output=True).returncode != 0:
                subprocess.run(cmd, capture_output=True)  # once more, its processes reaped by now
