"""``infersight hooks install|uninstall --python PY``: the ``.pth`` bootstrap.

The ``.pth`` line runs at every start of that interpreter but does nothing unless
``INFERSIGHT=1`` is set; then it puts the bootstrap directory on ``sys.path`` and
runs it, as ``launch`` does through PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, TextIO

from infersight.agent.cli import command_help
from infersight.hooks import _bootstrap_dir, _env

PTH_NAME = "infersight-hooks.pth"


def pth_line(bootstrap: str) -> str:
    # One line: .pth files execute lines that start with "import".
    return (
        "import os, sys; os.environ.get('INFERSIGHT', '').strip().lower() in %r and %r not in sys.path and "
        "(sys.path.insert(0, %r) or __import__('runpy').run_path(%r))\n"
        % (_env.TRUE_WORDS, bootstrap, bootstrap, os.path.join(bootstrap, "sitecustomize.py"))
    )


def site_packages(python: str) -> str:
    code = "import json, sysconfig; print(json.dumps(sysconfig.get_paths()['purelib']))"
    out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=30, check=True)
    return str(json.loads(out.stdout))


def pth_path(python: str, out: TextIO) -> str | None:
    """Where the .pth file goes for ``python``; None (said on ``out``) when it cannot tell."""
    try:
        return os.path.join(site_packages(python), PTH_NAME)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        out.write("infersight hooks: cannot ask %s for its site-packages: %s\n" % (python, exc))
        return None


def install(python: str, out: TextIO) -> int:
    target = pth_path(python, out)
    if target is None:
        return 2
    try:
        with open(target, "w") as f:
            f.write(pth_line(_bootstrap_dir()))
    except OSError as exc:
        out.write("infersight hooks: cannot write %s: %s\n" % (target, exc))
        return 1
    out.write("installed %s\nstart the service with INFERSIGHT=1 to activate the hooks\n" % target)
    return 0


def uninstall(python: str, out: TextIO) -> int:
    target = pth_path(python, out)
    if target is None:
        return 2
    try:
        os.unlink(target)
    except FileNotFoundError:
        out.write("nothing to remove: %s does not exist\n" % target)
        return 0
    except OSError as exc:
        out.write("infersight hooks: cannot remove %s: %s\n" % (target, exc))
        return 1
    out.write("removed %s\n" % target)
    return 0


def add_parser(sub: Any, help_line: str | None = None) -> argparse.ArgumentParser:
    hp: argparse.ArgumentParser = sub.add_parser("hooks", help=help_line or command_help("hooks"))
    hp.add_argument("action", choices=("install", "uninstall"))
    hp.add_argument("--python", default=sys.executable, metavar="PATH", help="target interpreter")
    hp.set_defaults(func=run)
    return hp


def run(args: argparse.Namespace) -> int:
    from infersight.agent.commands import hooks_install

    if args.action == "install":
        return hooks_install.install(args.python, sys.stdout)
    return hooks_install.uninstall(args.python, sys.stdout)
