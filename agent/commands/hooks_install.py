"""``infersight hooks install|uninstall --python PY``: the ``.pth`` bootstrap.

The ``.pth`` line runs at every start of that interpreter but does nothing while
``INFERSIGHT`` is off (one environment lookup, no import) or unset or empty (a look at each
name's first letters too); on (``1``, ``true``...), it puts the bootstrap directory on
``sys.path`` and runs it, as ``launch`` does through PYTHONPATH; any other value is one stderr
line naming the variable, the value and the allowed words, and the hooks stay off. Unset, a
name that looks like the switch misspelled (INFERSIGT, INFERSIGHT_ENABLED) is one stderr line
naming it and INFERSIGHT. The line never raises. Re-running ``hooks install`` rewrites the line
of an older install. It also warns when the users of that interpreter cannot read infersight's
install (:func:`access_problem`).
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import shlex
import stat
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from infersight.agent.cli import command_help
from infersight.hooks import _bootstrap_dir, _env

PTH_NAME = "infersight-hooks.pth"


# What the .pth line runs when its test lets it (below): the bootstrap's ``_infersight_pth.py``, read only
# then, whose ``run`` starts the bootstrap (the switch on), says a bad switch or a misspelled one. Whatever
# fails (an install this user cannot read, a .pth left behind by an uninstalled infersight) is one stderr
# line naming the file, the uid and the command that finds the rest; it never raises into site.
_PTH_CODE = """\
try:
    with open(%(file)r, 'rb') as f:
        g = {'__name__': '_infersight_pth', '__file__': %(file)r}
        exec(compile(f.read(), %(file)r, 'exec'), g)
    g['run'](os.environ.get('INFERSIGHT', '').strip().lower(), %(dir)r)
except Exception as e:
    try:
        if not getattr(sys, '_infersight_boot_failed', False):  # (site may read the line twice)
            sys._infersight_boot_failed = True
            sys.stderr.write('infersight: bootstrap failed, running without hooks: %%r%%s\\n' %% (e, (
                " (%%s: this user, uid %%d, must be able to read infersight's install, %%s, and enter each "
                "directory above it; `infersight hooks install --python %%s` names the first it cannot, and the fix)"
                %% (e.filename or %(file)r, os.getuid(), %(install)r, sys.executable))
                if isinstance(e, OSError) else ''))
    except Exception:
        pass
"""


def pth_line(bootstrap: str) -> str:
    """The ``.pth`` line (site executes lines that start with "import"). An off ``INFERSIGHT`` costs one
    environment lookup; otherwise a look at each name: the code (``_PTH_CODE``, in a ``try`` of its own)
    runs only for a name that begins with INF (any case) and is short enough to be the switch misspelled
    (INFERSIGHT itself among them: on, a bad value, or empty) or is INFERSIGHT_ and the start of a switch
    word (``_env.SWITCH_TYPO_WORDS``: INFERSIGHT_ENABLED); ``_infersight_pth.run`` then decides. Other
    INFERSIGHT_* names (a fleet's, for every service) run nothing. site compiles the line at every start:
    each node of it costs (bench/pth_line_cost.py), hence one flat test."""
    code = _PTH_CODE % {
        "dir": bootstrap,
        "file": os.path.join(bootstrap, "_infersight_pth.py"),
        "install": os.path.dirname(os.path.dirname(bootstrap)),
    }
    longest = len(_env.SWITCH) + _env.SWITCH_TYPO_DISTANCE  # (INFERSIGHT_ and a word up to 2 letters: shorter)
    starts = tuple(sorted({w[:3] for w in _env.SWITCH_TYPO_WORDS if len(w) > 2}))
    return (
        "import os, sys; os.environ.get('INFERSIGHT', '').strip().lower() in %r or not any(k[:3].upper() == 'INF' "
        "and (len(k) <= %d or k[11:14].upper() in %r) for k in os.environ) or exec(%r, {'os': os, 'sys': sys})\n"
        % (_env.FALSE_WORDS, longest, starts, code)
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


@dataclass(frozen=True)
class Audience:
    """Who runs an interpreter, as far as its site-packages tells: ``uid`` (-1: any user outside the
    owner) with ``gids``, and how to say it."""

    uid: int
    gids: frozenset[int]
    said: str


def audience(site: str) -> Audience | None:
    """The users who may run the interpreter whose site-packages is ``site``: its owner where that is
    not root (a server user's venv); where root owns it, every user when others may reach and read it
    (any server user), else the members of its group when they may; None for root alone (root reads
    anything, and there is no one else to check for)."""
    site = os.path.realpath(site)
    st = os.stat(site)
    if st.st_uid != 0:
        try:
            pw = pwd.getpwuid(st.st_uid)
            gids = frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid))
            name = "uid %d (%s)" % (st.st_uid, pw.pw_name)
        except KeyError:  # a uid with no passwd entry: its file's group is the best guess
            gids, name = frozenset({st.st_gid}), "uid %d" % st.st_uid
        return Audience(st.st_uid, gids, "%s, who owns %s," % (name, site))
    anyone = Audience(-1, frozenset(), "a user other than root (%s is root's, open to all)" % site)
    if _reaches(site, anyone):
        return anyone
    group = Audience(-1, frozenset({st.st_gid}), "a member of group %s (%s is root's, open to it)"
                     % (_group_name(st.st_gid), site))
    return group if st.st_gid != 0 and _reaches(site, group) else None


def _reaches(path: str, who: Audience) -> bool:
    """``who`` may enter each directory down to ``path``, and list and enter ``path``."""
    if not _allows(os.stat(path), who, 5):
        return False
    while path != os.path.dirname(path):
        path = os.path.dirname(path)
        if not _allows(os.stat(path), who, 1):
            return False
    return True


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _who(st: os.stat_result, who: Audience) -> str:
    """Which of a file's permission classes applies to ``who``: u, g or o (the first that matches)."""
    if st.st_uid == who.uid:
        return "u"
    return "g" if st.st_gid in who.gids else "o"


def _allows(st: os.stat_result, who: Audience, want: int) -> bool:
    """``want`` (4 read, 1 search) in the permission class that applies to ``who`` (ACLs aside)."""
    shift = {"u": 6, "g": 3, "o": 0}[_who(st, who)]
    return (st.st_mode >> shift) & want == want


def blocked(tree: str, who: Audience) -> list[tuple[str, str, os.stat_result]]:
    """What keeps ``who`` from loading ``tree`` (the hooks package the bootstrap loads): each directory
    above it that it cannot enter (x), then the first path within it that it cannot use (a directory to
    list and enter, r and x; a file to read, r), ``__pycache__`` aside (an unreadable cache is compiled
    afresh). Each as (path, what it lacks, its stat); empty when nothing is in the way."""
    tree = os.path.realpath(tree)
    above = []
    d = os.path.dirname(tree)
    while True:
        above.append(d)
        if d == os.path.dirname(d):
            break
        d = os.path.dirname(d)
    out = []
    for path in reversed(above):
        st = os.stat(path)
        if not _allows(st, who, 1):
            out.append((path, "enter", st))
    for top, dirs, files in os.walk(tree):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        st = os.stat(top)
        if not _allows(st, who, 5):
            return [*out, (top, "list and enter", st)]
        for f in sorted(files):
            fst = os.stat(os.path.join(top, f))
            if not _allows(fst, who, 4):
                return [*out, (os.path.join(top, f), "read", fst)]
    return out


def access_problem(site: str, bootstrap: str) -> tuple[str, str] | None:
    """(what is wrong, the fix) when the users of the interpreter whose site-packages is ``site`` cannot
    load the hooks that ``bootstrap``'s ``.pth`` line runs (infersight installed by root under umask 077:
    the hooked server said only ``PermissionError(13, 'Permission denied')`` and ran without hooks).
    The fix opens infersight's install (its prefix, where the hooks are in it) recursively, and only
    lets the directories above it be entered."""
    try:
        who = audience(site)
        if who is None:
            return None
        hooks = os.path.realpath(os.path.dirname(bootstrap))
        found = blocked(hooks, who)
    except OSError as exc:  # cannot look (a path gone meanwhile): say so rather than guess
        return "cannot check who may read %s: %s" % (bootstrap, exc), ""
    if not found:
        return None
    path, lacks, st = found[0]
    cls = _who(st, who)
    what = ("%s cannot %s %s (%s %s:%s): the hooked server would run without hooks"
            % (who.said, lacks, path, stat.filemode(st.st_mode), _user_name(st.st_uid), _group_name(st.st_gid)))
    prefix = os.path.realpath(sys.prefix)
    root = prefix if hooks.startswith(prefix + os.sep) else hooks

    def within(p: str) -> bool:
        return p == root or p.startswith(root + os.sep)

    outside = [shlex.quote(p) for p, _, _ in found if not within(p)]
    fix = ["chmod %s+x %s" % (cls, " ".join(outside))] if outside else []
    if any(within(p) for p, _, _ in found):  # (one file there, and likely all, made under the same umask)
        fix.append("chmod -R %s+rX %s" % (cls, shlex.quote(root)))
    return what, "%s (a umask such as 077 made it private: install infersight under 022)" % " && ".join(fix)


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def install(python: str, out: TextIO, named: bool = True) -> int:
    """Write the ``.pth`` into ``python``'s site-packages. ``named``: the user named the interpreter
    (``--python``); without it this one is used, infersight's own, which is seldom the model server's."""
    target = pth_path(python, out)
    if target is None:
        return 2
    line = pth_line(_bootstrap_dir())
    try:
        with open(target, encoding="utf-8", errors="replace") as f:
            before: str | None = f.read()
    except OSError:
        before = None
    try:
        with open(target, "w") as f:  # the whole file: an older install's line is replaced, never kept beside it
            f.write(line)
    except OSError as exc:
        out.write("infersight hooks: cannot write %s: %s\n" % (target, exc))
        return 1
    out.write("installed %s%s\n" % (target, "" if before in (None, line) else " (in place of an older line)"))
    problem = access_problem(os.path.dirname(target), _bootstrap_dir())
    if problem is not None:
        out.write("warning: %s\n" % problem[0] + ("  fix: %s\n" % problem[1] if problem[1] else ""))
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
