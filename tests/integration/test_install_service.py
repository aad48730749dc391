"""`infersight install-service` through its argparse registration, as the CLI calls it."""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from infersight.agent.commands import install_service

FILES = [
    "etc/systemd/system/infersight.service",
    "etc/systemd/system/infersight.socket",
    "etc/sysusers.d/infersight.conf",
    "etc/tmpfiles.d/infersight.conf",
    "etc/infersight/infersight.toml",
]


# A real install from this test's interpreter: under CI it may be pyenv's, in /root, which ProtectHome hides, and
# install-service then refuses without --force (tested on its own below).
FORCE = ("--force",)


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="infersight")
    install_service.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["install-service", *argv])
    assert args.func is install_service.run
    return int(args.func(args))


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")
    }


def test_dry_run_touches_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    # An ExecStart the service can run (this test's interpreter may be under /root, and tmp_path is under /tmp).
    monkeypatch.setattr(install_service, "resolve_exec", lambda: ["/opt/infersight/bin/infersight"])
    (tmp_path / "etc").mkdir()
    before = snapshot(tmp_path)
    assert run_cli("--prefix", str(tmp_path), "--dry-run") == 0
    assert snapshot(tmp_path) == before
    out = capsys.readouterr().out
    for rel in FILES:
        assert f"would install  {tmp_path / rel}" in out
    for step in (
        "systemd-sysusers",
        "systemd-tmpfiles --create",
        "daemon-reload",
        "enable --now infersight.socket infersight.service",
    ):
        assert step in out


def test_install_then_keep_existing_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("--prefix", str(tmp_path), *FORCE) == 0
    for rel in FILES:
        path = tmp_path / rel
        assert path.is_file(), rel
        assert path.stat().st_mode & 0o777 == 0o644
    assert not list(tmp_path.rglob(".*.*")), "no temporary files left behind"
    cfg = tmp_path / "etc/infersight/infersight.toml"
    cfg.write_text("[agent]\nspool_max_bytes = 1\n")
    unit = tmp_path / "etc/systemd/system/infersight.service"
    unit.write_text("stale")
    capsys.readouterr()
    assert run_cli("--prefix", str(tmp_path), *FORCE) == 0
    assert cfg.read_text() == "[agent]\nspool_max_bytes = 1\n"
    assert "ExecStart=" in unit.read_text(), "units are replaced"
    out = capsys.readouterr().out
    assert f"keep     {cfg}" in out
    # --dry-run over an existing config says it would keep it.
    assert run_cli("--prefix", str(tmp_path), "--dry-run", *FORCE) == 0
    assert f"would keep     {cfg}" in capsys.readouterr().out


def test_exec_start_names_the_real_executable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exe = tmp_path / "bin" / "infersight"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    monkeypatch.setattr(sys, "argv", [str(exe), "install-service"])
    assert install_service.resolve_exec() == [str(exe)]
    root = tmp_path / "root"
    assert run_cli("--prefix", str(root), *FORCE) == 0
    text = (root / "etc/systemd/system/infersight.service").read_text()
    assert f"\nExecStart={exe} agent --config /etc/infersight/infersight.toml\n" in text
    assert "\nRestartPreventExitStatus=2\n" in text  # a config error at start is not restarted every 2 s
    analyze = shutil.which("systemd-analyze")
    if analyze:  # the installed units verify clean with the rewritten ExecStart
        units = root / "etc/systemd/system"
        proc = subprocess.run(
            [
                analyze,
                "verify",
                str(units / "infersight.socket"),
                str(units / "infersight.service"),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert not (proc.stdout + proc.stderr).strip(), proc.stdout + proc.stderr


def test_fallback_is_python_dash_m(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["-c"])
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert install_service.resolve_exec() == [os.path.abspath(sys.executable), "-m", "infersight"]


def test_rewrite_quotes_odd_paths() -> None:
    unit = "[Service]\nExecStart=/usr/bin/infersight agent --config /etc/x.toml\n"
    out = install_service.rewrite_exec_start(unit, ["/opt/my tools/100%/infersight"])
    assert 'ExecStart="/opt/my tools/100%%/infersight" agent --config /etc/x.toml' in out


def test_home_directory_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(install_service, "resolve_exec", lambda: ["/home/me/.venv/bin/infersight"])
    assert run_cli("--prefix", str(tmp_path), "--dry-run") == 2  # as the real run (below)
    assert "ProtectHome=yes" in capsys.readouterr().err


def test_a_unit_the_service_cannot_run_is_not_installed_without_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The warning was all: the run exited 0 and installed a unit that fails with 203/EXEC (a review
    of the systemd path, with pyenv's python3 behind the README's venv)."""
    monkeypatch.setattr(install_service, "resolve_exec", lambda: ["/home/me/.venv/bin/infersight"])
    assert run_cli("--prefix", str(tmp_path)) == 2
    assert "--force installs it anyway" in capsys.readouterr().err
    assert not any(tmp_path.rglob("*.service")), "nothing written"
    assert run_cli("--prefix", str(tmp_path), "--force") == 0
    assert (tmp_path / "etc/systemd/system/infersight.service").is_file()


def test_home_directory_warning_for_the_interpreter_a_venv_links_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A venv under /opt made from pyenv's Python: its program is outside home directories, but its
    ``python`` links into one, which ProtectHome=yes hides (203/EXEC). Before, nothing was said."""
    venv_bin = tmp_path / "opt" / "infersight" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to("/home/ops/.pyenv/versions/3.12.7/bin/python3.12")
    script = venv_bin / "infersight"
    script.write_text("#!%s\nfrom infersight.agent.cli import main\nmain()\n" % (venv_bin / "python"))
    script.chmod(0o755)
    monkeypatch.setattr(install_service, "resolve_exec", lambda: [str(script)])
    assert run_cli("--prefix", str(tmp_path), "--dry-run") == 2
    err = capsys.readouterr().err
    assert "its interpreter /home/ops/.pyenv/versions/3.12.7/bin/python3.12 is under a home directory" in err, err
    # The program itself is outside home directories (tmp_path may be under /tmp, which PrivateTmp hides: below).
    assert not [line for line in err.splitlines() if line.startswith("warning: the program")
                and "under a home directory" in line]


def test_a_dry_run_refuses_as_the_real_run_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--dry-run printed "would install ..." and exited 0 where the real run refuses (exit 2)."""
    monkeypatch.setattr(install_service, "resolve_exec", lambda: ["/home/me/.venv/bin/infersight"])
    assert run_cli("--prefix", str(tmp_path), "--dry-run") == 2
    out, err = capsys.readouterr()
    assert "--force installs it anyway" in err
    assert "would install" not in out
    assert not any(tmp_path.rglob("*")), "nothing written"
    assert run_cli("--prefix", str(tmp_path), "--dry-run", "--force") == 0
    assert "would install" in capsys.readouterr().out
    assert not any(tmp_path.rglob("*")), "nothing written"


@pytest.mark.parametrize("exe", ["/tmp/build/.venv/bin/infersight", "/var/tmp/ci/venv/bin/infersight"])
def test_a_program_under_a_temporary_directory_is_not_installed_without_force(
    exe: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The unit's PrivateTmp=yes gives the service an empty /tmp and /var/tmp: an ExecStart there fails
    203/EXEC, and nothing was said."""
    monkeypatch.setattr(install_service, "resolve_exec", lambda: [exe])
    assert run_cli("--prefix", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"the program {exe} is under a temporary directory, which PrivateTmp=yes hides" in err, err
    assert "ProtectHome" not in err
    assert not any(tmp_path.rglob("*.service")), "nothing written"
    assert run_cli("--prefix", str(tmp_path), "--force") == 0
    assert (tmp_path / "etc/systemd/system/infersight.service").is_file()


def test_an_interpreter_linked_into_var_tmp_is_flagged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The venv's ``python`` links to a Python under /var/tmp: resolved as for home directories."""
    venv_bin = tmp_path / "opt" / "infersight" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to("/var/tmp/uv/python/cpython-3.12/bin/python3.12")
    script = venv_bin / "infersight"
    script.write_text("#!%s\nfrom infersight.agent.cli import main\nmain()\n" % (venv_bin / "python"))
    script.chmod(0o755)
    monkeypatch.setattr(install_service, "resolve_exec", lambda: [str(script)])
    assert run_cli("--prefix", str(tmp_path / "root")) == 2
    err = capsys.readouterr().err
    assert ("its interpreter /var/tmp/uv/python/cpython-3.12/bin/python3.12 is under a temporary directory, "
            "which PrivateTmp=yes hides") in err, err


def test_next_steps_name_the_installed_executable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """After the documented install into /opt/infersight, a bare `infersight` is on neither root's PATH nor
    sudo's secure_path: the step to verify names what ExecStart runs."""
    monkeypatch.setattr(install_service, "resolve_exec", lambda: ["/opt/infersight/bin/infersight"])
    assert run_cli("--prefix", str(tmp_path), "--dry-run") == 0
    steps = capsys.readouterr().out.split("next steps", 1)[1].splitlines()
    assert "  /opt/infersight/bin/infersight status" in steps, steps
    assert "  infersight status" not in steps


def test_unwritable_root_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "etc"
    blocker.write_text("a file where a directory must go")
    assert run_cli("--prefix", str(tmp_path), *FORCE) == 1
    assert "install-service" in capsys.readouterr().err


@pytest.mark.parametrize("umask", [0o027, 0o077])
def test_directories_it_makes_are_readable_under_a_hardened_umask(tmp_path: Path, umask: int,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """CIS-style hosts run root with umask 027 or 077: /etc/infersight came out 0750/0700 root, and
    User=infersight could not read its config (the agent exited 2)."""
    old = os.umask(umask)
    try:
        assert run_cli("--prefix", str(tmp_path), *FORCE) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    for rel in ("etc/infersight", "etc/systemd/system", "etc/sysusers.d", "etc/tmpfiles.d"):
        assert stat.S_IMODE((tmp_path / rel).stat().st_mode) == 0o755, rel
    assert stat.S_IMODE((tmp_path / "etc/infersight/infersight.toml").stat().st_mode) == 0o644


def _systemctl(bin_dir: Path, active: bool) -> None:
    """A systemctl that answers `is-active` as systemd would for a running (or stopped) infersight.service."""
    bin_dir.mkdir()
    tool = bin_dir / "systemctl"
    tool.write_text('#!/bin/sh\n[ "$1 $2 $3" = "is-active --quiet infersight.service" ] && exit %d\nexit 3\n'
                    % (0 if active else 3))
    tool.chmod(0o755)


def test_a_running_service_is_told_to_restart_on_the_code_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`enable --now` leaves a running service as it is, on the code it loaded: the steps restart it
    (`try-restart`: nothing when it is stopped), and a service running now is named as needing it."""
    monkeypatch.setattr(install_service, "resolve_exec", lambda: ["/opt/infersight/bin/infersight"])
    _systemctl(tmp_path / "bin", active=True)
    monkeypatch.setenv("PATH", "%s:%s" % (tmp_path / "bin", os.environ["PATH"]))
    assert run_cli("--dry-run") == 0  # root /: the service there is the one that runs
    out = capsys.readouterr().out
    steps = out.split("next steps", 1)[1].splitlines()
    enable = steps.index("  systemctl enable --now infersight.socket infersight.service")
    assert steps[enable + 1].startswith("  systemctl try-restart infersight.service"), steps
    assert "note: infersight.service is running, on the code it started with: it needs a restart" in out, out


def test_a_stopped_service_gets_no_restart_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(install_service, "resolve_exec", lambda: ["/opt/infersight/bin/infersight"])
    _systemctl(tmp_path / "bin", active=False)
    monkeypatch.setenv("PATH", "%s:%s" % (tmp_path / "bin", os.environ["PATH"]))
    assert run_cli("--dry-run") == 0
    out = capsys.readouterr().out
    assert "systemctl try-restart infersight.service" in out
    assert "note: infersight.service is running" not in out
