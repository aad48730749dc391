"""``infersight install-service``: install the systemd units, snippets and default config.

``--prefix DIR`` is a staging root (DESTDIR): files go to ``DIR/etc/...`` while their
contents keep naming the final paths (``/etc/infersight/infersight.toml``). Units,
sysusers and tmpfiles snippets are replaced; an existing config is never overwritten.
``ExecStart=`` is rewritten to the ``infersight`` executable this command runs from.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from infersight.agent.cli import EXIT_USAGE, command_help

__all__ = ["DATA_FILES", "Action", "add_parser", "data_dir", "plan", "resolve_exec", "run"]

CONFIG_PATH = "/etc/infersight/infersight.toml"

# name in infersight/agent/data -> (path under the root, mode, overwrite?)
DATA_FILES: dict[str, tuple[str, int, bool]] = {
    "infersight.service": ("etc/systemd/system/infersight.service", 0o644, True),
    "infersight.socket": ("etc/systemd/system/infersight.socket", 0o644, True),
    "sysusers-infersight.conf": ("etc/sysusers.d/infersight.conf", 0o644, True),
    "tmpfiles-infersight.conf": ("etc/tmpfiles.d/infersight.conf", 0o644, True),
    "infersight.toml": (CONFIG_PATH.lstrip("/"), 0o644, False),
}
# Where the sources live in a checkout, for a tree without agent/data.
_CHECKOUT_NAMES = {
    "sysusers-infersight.conf": "sysusers.d/infersight.conf",
    "tmpfiles-infersight.conf": "tmpfiles.d/infersight.conf",
}
# Directories the unit's sandbox hides from the service, and the setting that hides them.
_HIDDEN: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("/home/", "/root/", "/run/user/"), "a home directory", "ProtectHome=yes"),
    (("/tmp/", "/var/tmp/"), "a temporary directory", "PrivateTmp=yes"),
)


@dataclass(frozen=True)
class Action:
    """One file to write (``content`` set) or to keep (``content`` None)."""

    dest: Path
    mode: int
    content: str | None
    note: str
    overwrite: bool = True


def data_dir() -> Path:
    """Package data (wheel or checkout via symlinks), else the checkout's ``systemd/``."""
    agent_dir = Path(__file__).resolve().parent.parent  # agent/commands/ -> agent/
    data = agent_dir / "data"
    if (data / "infersight.service").is_file():
        return data
    return agent_dir.parent / "systemd"


def _source(name: str) -> Path:
    base = data_dir()
    return base / (name if base.name == "data" else _CHECKOUT_NAMES.get(name, name))


def resolve_exec() -> list[str]:
    """Absolute command that runs infersight: argv[0], PATH, else ``python -m infersight``."""
    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name == "infersight" and os.access(argv0, os.X_OK):
        return [os.path.abspath(argv0)]
    found = shutil.which("infersight")
    if found:
        return [os.path.abspath(found)]
    return [os.path.abspath(sys.executable), "-m", "infersight"]


def hidden_by_sandbox(command: list[str]) -> list[tuple[str, str, str, str]]:
    """What the service must run that the unit's sandbox hides (ProtectHome=yes: home directories;
    PrivateTmp=yes: /tmp and /var/tmp): the program, and the interpreter it runs on as the kernel
    resolves it (a venv's ``python`` is a link to the Python it was made from, and a console
    script's ``#!`` line names that link). Each as (path, what, where, setting)."""
    found: list[tuple[str, str, str, str]] = []
    exe = command[0]
    interpreters = [sys.executable] if len(command) > 1 else []
    try:
        with open(exe, "rb") as f:
            first = f.readline(4096)
        if first.startswith(b"#!"):
            words = first[2:].decode("utf-8", "replace").split()
            if words:
                interpreters.append(words[0])
    except OSError:
        pass
    for path, what in [(exe, "the program"), *((p, "its interpreter") for p in interpreters)]:
        settings: set[str] = set()  # the resolved path first; the link's own only where another setting hides it
        for candidate in dict.fromkeys((os.path.realpath(path), os.path.abspath(path))):
            for prefixes, where, setting in _HIDDEN:
                if candidate.startswith(prefixes) and setting not in settings:
                    settings.add(setting)
                    if not any(f[0] == candidate and f[1] == what for f in found):
                        found.append((candidate, what, where, setting))
    return found


def _quote(word: str) -> str:
    """One word of a systemd command line: specifiers and variables escaped, quoted if needed."""
    word = word.replace("%", "%%").replace("$", "$$")
    if re.search(r"[\s\"'\\;]", word):
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def rewrite_exec_start(unit: str, command: list[str]) -> str:
    """Replace the program of ``ExecStart=`` (arguments kept) by ``command``."""
    exe = " ".join(_quote(w) for w in command)

    def repl(match: re.Match[str]) -> str:
        return f"# rewritten by `infersight install-service`\nExecStart={exe} agent"

    return re.sub(r"^ExecStart=\S+ agent", repl, unit, count=1, flags=re.M)


def plan(root: Path, command: list[str] | None = None) -> list[Action]:
    """Every action ``run`` takes for ``root``, computed without touching anything."""
    command = command or resolve_exec()
    actions: list[Action] = []
    for name, (rel, mode, overwrite) in DATA_FILES.items():
        dest = root / rel
        text = _source(name).read_text(encoding="utf-8")
        if name == "infersight.service":
            text = rewrite_exec_start(text, command)
        if not overwrite and (dest.exists() or dest.is_symlink()):
            actions.append(Action(dest, mode, None, "keep", overwrite))
        else:
            verb = "replace" if dest.exists() else "install"
            actions.append(Action(dest, mode, text, verb, overwrite))
    return actions


def make_dirs(directory: Path) -> None:
    """Make ``directory`` and its missing parents 0755 whatever the umask: under a hardened root umask
    (027, 077) a new /etc/infersight came out 0750 or 0700 root, and the service's user could not read
    its config (exit 2). A directory that exists is left as the operator made it."""
    missing: list[Path] = []
    d = directory
    while not d.exists() and not d.is_symlink() and d != d.parent:
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        m.mkdir(exist_ok=True)
        os.chmod(m, 0o755)  # noqa: S103 - config and unit directories: read by systemd and the service


def _write(action: Action) -> None:
    """Write atomically; a file that must not be overwritten is linked in with O_EXCL semantics."""
    assert action.content is not None
    make_dirs(action.dest.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{action.dest.name}.", dir=action.dest.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(action.content)
        os.chmod(tmp, action.mode)
        if action.overwrite:
            os.replace(tmp, action.dest)
        else:
            os.link(tmp, action.dest)  # FileExistsError if a config appeared meanwhile
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def next_steps(root: Path, command: list[str] | None = None) -> list[str]:
    """What the operator runs next. ``status`` by the absolute command ExecStart runs: after an
    install into a venv (/opt/infersight) ``infersight`` is on neither root's PATH nor sudo's."""
    status = shlex.join([*(command or resolve_exec()), "status"])
    steps = [
        "systemd-sysusers /etc/sysusers.d/infersight.conf",
        "systemd-tmpfiles --create /etc/tmpfiles.d/infersight.conf",
        "systemctl daemon-reload",
        "systemctl enable --now infersight.socket infersight.service",
        # enable --now starts a stopped service and leaves a running one as it is: on the code it loaded
        "systemctl try-restart infersight.service   # an agent already running restarts on the code just installed",
        "usermod -aG infersight <model-server-user>   # lets its hooks use the socket",
        status,
    ]
    if root != Path("/"):
        steps.insert(0, f"# files were staged under {root}; copy them to / first")
    return steps


def run(args: argparse.Namespace) -> int:
    root = Path(getattr(args, "prefix", None) or "/")
    dry = bool(getattr(args, "dry_run", False))
    command = resolve_exec()
    out = sys.stdout
    try:
        actions = plan(root, command)
    except OSError as exc:
        print(f"infersight install-service: cannot read unit files: {exc}", file=sys.stderr)
        return 1
    print(f"ExecStart={shlex.join(command)} agent --config {CONFIG_PATH}", file=out)
    hidden = hidden_by_sandbox(command)
    for path, what, where, setting in hidden:
        print(
            f"warning: {what} {path} is under {where}, which {setting} hides from the service (it would"
            " fail with 203/EXEC); install infersight under /usr, /usr/local or /opt, in a venv made from"
            " a Python outside home and temporary directories (pyenv, conda and uv keep theirs in home"
            " directories)",
            file=sys.stderr,
        )
    if hidden and not getattr(args, "force", False):
        # A unit that cannot start is no install: say so before writing anything (--force installs it anyway,
        # e.g. with a drop-in that sets ProtectHome=read-only or PrivateTmp=no). A dry run says and exits as the real
        # run would.
        print(f"infersight install-service: {'would not install' if dry else 'not installing'} a unit whose"
              " ExecStart the service cannot run (above); --force installs it anyway", file=sys.stderr)
        return EXIT_USAGE
    prefix = "would " if dry else ""
    for action in actions:
        if action.content is None:
            print(f"{prefix}keep     {action.dest} (existing config, not overwritten)", file=out)
            continue
        print(f"{prefix}{action.note:<8} {action.dest} (mode {action.mode:04o})", file=out)
        if dry:
            continue
        try:
            _write(action)
        except FileExistsError:
            print(f"keep     {action.dest} (appeared meanwhile, not overwritten)", file=out)
        except OSError as exc:
            print(f"infersight install-service: {action.dest}: {exc}", file=sys.stderr)
            return 1
    print("\nnext steps (as root):", file=out)
    for step in next_steps(root, command):
        print(f"  {step}", file=out)
    if root == Path("/") and service_active():
        print("\nnote: infersight.service is running, on the code it started with: it needs a restart to run the "
              "infersight installed here (systemctl try-restart infersight.service, above)", file=out)
    return 0


def service_active(unit: str = "infersight.service") -> bool:
    """Whether systemd runs ``unit`` now (``systemctl is-active``); False where there is no systemctl."""
    try:
        r = subprocess.run(["systemctl", "is-active", "--quiet", unit], check=False, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def add_parser(
    subparsers: argparse._SubParsersAction,  # type: ignore[type-arg]
    help_line: str | None = None,
) -> argparse.ArgumentParser:
    """Register ``install-service`` on the CLI's subparsers; sets ``func=run``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "install-service",
        help=help_line or command_help("install-service"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--prefix",
        metavar="DIR",
        default="/",
        help="root to install under, as DESTDIR (default: /)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print every action, change nothing")
    parser.add_argument("--force", action="store_true",
                        help="install even when the service could not run ExecStart (an interpreter under a "
                             "home directory, /tmp or /var/tmp, which ProtectHome=yes and PrivateTmp=yes hide)")
    parser.set_defaults(func=run)
    return parser
