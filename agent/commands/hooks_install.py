"""``infersight hooks install|uninstall --python PY``: the ``.pth`` bootstrap.

The ``.pth`` line runs at every start of that interpreter but does nothing while
``INFERSIGHT`` is unset, empty or off (one environment lookup, no import); on (``1``,
``true``...), it puts the bootstrap directory on ``sys.path`` and runs it, as ``launch``
does through PYTHONPATH; any other value is one stderr line naming the variable, the value
and the allowed words, and the hooks stay off. The line never raises. Re-running ``hooks
install`` rewrites the line of an older install.
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


# What the .pth line runs once INFERSIGHT is set and not off (``w``: its value, stripped and
# lowercased). The bootstrap directory already on sys.path (PYTHONPATH) runs itself as
# ``sitecustomize`` and says a bad value there itself. site may read a venv's site-packages,
# and so this line, twice (Python 3.11: once from its venv set-up): a bad value is said once,
# marked on ``sys``.
_PTH_CODE = """\
try:
    if w in %(on)r:
        if %(dir)r not in sys.path:
            sys.path.insert(0, %(dir)r)
            __import__('runpy').run_path(%(file)r)
    elif %(dir)r not in sys.path and not getattr(sys, '_infersight_switch_said', False):
        sys._infersight_switch_said = True
        sys.stderr.write(%(bad)r %% (os.environ.get('INFERSIGHT'),))
        sys.stderr.flush()
except Exception as e:
    try:
        sys.stderr.write('infersight: bootstrap failed, running without hooks: %%r\\n' %% (e,))
    except Exception:
        pass
"""


def pth_line(bootstrap: str) -> str:
    """The ``.pth`` line (site executes lines that start with "import"): unset, empty or an off
    word costs one environment lookup; the rest runs in a ``try`` of its own (``_PTH_CODE``)."""
    code = _PTH_CODE % {
        "on": _env.TRUE_WORDS,
        "dir": bootstrap,
        "file": os.path.join(bootstrap, "sitecustomize.py"),
        "bad": "infersight: INFERSIGHT=%%r is not allowed: expected %s; the hooks stay off\n"
               % _env.VARS["INFERSIGHT"].allowed(),
    }
    return (
        "import os, sys; os.environ.get('INFERSIGHT', '').strip().lower() in %r or "
        "exec(%r, {'os': os, 'sys': sys, 'w': os.environ['INFERSIGHT'].strip().lower()})\n"
        % (("", *_env.FALSE_WORDS), code)
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


def install(python: str, out: TextIO, named: bool = True) -> int:
    """Write the ``.pth`` into ``python``'s site-packages. ``named``: the user named the interpreter
    (``--python``); without it this one is used, infersight's own, which is seldom the model server's."""
    target = pth_path(python, out)
    if target is None:
        return 2
    try:
        with open(target, "w") as f:
            f.write(pth_line(_bootstrap_dir()))
    except OSError as exc:
        out.write("infersight hooks: cannot write %s: %s\n" % (target, exc))
        return 1
    out.write("installed %s\n" % target)
    if not named:
        out.write("(into %s, the interpreter infersight runs in: for a model server's own, run again with "
                  "--python /path/to/its/python)\n" % python)
    out.write("start the service with INFERSIGHT=1 to activate the hooks\n")
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
    hp.add_argument("--python", metavar="PATH",
                    help="the model server's interpreter (default: the one infersight runs in)")
    hp.set_defaults(func=run)
    return hp


def run(args: argparse.Namespace) -> int:
    from infersight.agent.commands import hooks_install

    python = args.python or sys.executable
    if args.action == "install":
        return hooks_install.install(python, sys.stdout, named=args.python is not None)
    return hooks_install.uninstall(python, sys.stdout)
