"""Where a joined launch's CMD spools: the agent's ``agent.spool_dir``, but only from an agent the hooks would
connect to. The hooks grant a spool directory's owner read access to their files, so an agent another local user
started first at a per-user fallback socket (``$XDG_RUNTIME_DIR/infersight``, ``/tmp/infersight-<uid>``) must not
name one (a review read a victim's spooled prompts that way)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from infersight.agent.commands.launch_base import Joined
from infersight.agent.commands.launch_base import joined_spool as _joined_spool
from infersight.hooks import _paths


@pytest.fixture
def peer_fd() -> Iterator[int]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # the peer: this process (this user)
    yield a.fileno()
    a.close()
    b.close()


def joined_spool(joined: Joined) -> str | None:
    return _joined_spool(joined, _paths)


def _joined(sock_path: Path, fd: int, spool: Path) -> Joined:
    return Joined(str(sock_path), fd, "ab" * 16, {"t": "subscribed", "spool_dir": str(spool)})


def test_an_agent_at_a_socket_of_the_operators_choosing_names_the_spool(tmp_path: Path, peer_fd: int,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERSIGHT_SPOOL_DIR", raising=False)
    spool = tmp_path / "spool"
    assert joined_spool(_joined(tmp_path / "agent.sock", peer_fd, spool)) == str(spool)  # made by the hooks
    monkeypatch.setenv("INFERSIGHT_SPOOL_DIR", str(tmp_path / "mine"))
    assert joined_spool(_joined(tmp_path / "agent.sock", peer_fd, spool)) is None  # the environment's wins


@pytest.mark.parametrize(("mode", "trusted"), [(0o700, True), (0o777, False)])
def test_an_agent_at_a_per_user_fallback_names_it_only_from_a_directory_the_hooks_would_use(
        tmp_path: Path, peer_fd: int, monkeypatch: pytest.MonkeyPatch, mode: int, trusted: bool) -> None:
    monkeypatch.delenv("INFERSIGHT_SPOOL_DIR", raising=False)
    run = tmp_path / "run"
    (run / "infersight").mkdir(parents=True)
    os.chmod(run / "infersight", mode)  # 0777: anybody could have put an agent there
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    evil = tmp_path / "evil"
    evil.mkdir()
    got = joined_spool(_joined(run / "infersight" / "agent.sock", peer_fd, evil))
    assert got == (str(evil) if trusted else None)
