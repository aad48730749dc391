"""What ``hooks install``'s ``.pth`` line runs once its own test let it: ``run(w, boot)``.

The line (``agent/commands/hooks_install.py``) runs at every start of the interpreter it is in and
stays short, since site compiles it each time: an off ``INFERSIGHT`` costs one environment lookup,
an unset one a look at each name's first letters. This file is read and run only when the switch
is on (the bootstrap follows), is neither on nor off, or is unset while a name looks like it
misspelled: ``w`` is its value, stripped and lowercased, ``boot`` this directory. Stdlib only, and
nothing imported for a misspelled switch; the line catches what this raises (one stderr line).
site may read a venv's site-packages, and so the line, twice (Python 3.11: once from its venv
set-up): what is said is said once, marked on ``sys``.
"""

import os
import sys

# hooks/_env.py's TRUE_WORDS, the allowed words of INFERSIGHT, SWITCH_TYPO_WORDS and SWITCH_TYPO_DISTANCE
# (a test holds them equal): this file imports nothing of ours.
ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")
ALLOWED = "1/0, true/false, yes/no or on/off"
TYPO_WORDS = ("", "ENABLE", "ENABLED", "ON", "HOOK", "HOOKS", "ACTIVE", "ACTIVATE", "SWITCH")
TYPO_DISTANCE = 3
SWITCH = "INFERSIGHT"


def distance(a: str, b: str) -> int:
    """The edit distance of ``a`` and ``b`` (insertions, deletions, substitutions)."""
    prev = list(range(len(b) + 1))
    for i, c in enumerate(a, 1):
        row = [i]
        for j, t in enumerate(b, 1):
            row.append(min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (c != t)))
        prev = row
    return prev[-1]


def is_typo(name: str) -> bool:
    """Whether ``name`` looks like the switch misspelled: INFERSIGHT in another case, INFERSIGHT_ and a
    switch word (INFERSIGHT_ENABLED), or within TYPO_DISTANCE of INFERSIGHT (INFERSIGT, INFERSITE)."""
    u = name.upper()
    if name == SWITCH or u[:3] != "INF":
        return False
    if u[:11] == SWITCH + "_":
        return u[11:] in TYPO_WORDS
    return distance(u, SWITCH) <= TYPO_DISTANCE


def typos(env: "dict[str, str] | os._Environ[str]") -> "list[str]":
    """The names of ``env`` that look like the switch misspelled, set to a value that is not off."""
    return sorted(k for k, v in env.items() if is_typo(k) and v.strip().lower() not in OFF)


def say(line: str) -> None:
    if not getattr(sys, "_infersight_switch_said", False):
        sys._infersight_switch_said = True  # type: ignore[attr-defined]
        sys.stderr.write("infersight: %s\n" % line)
        sys.stderr.flush()


def run(w: str, boot: str) -> None:
    if boot in sys.path:  # the bootstrap on PYTHONPATH runs itself, and says a bad value itself
        return
    if w in ON:
        sys.path.insert(0, boot)
        __import__("runpy").run_path(os.path.join(boot, "sitecustomize.py"))
    elif w:
        say("INFERSIGHT=%r is not allowed: expected %s; the hooks stay off" % (os.environ.get(SWITCH), ALLOWED))
    else:
        said = typos(os.environ)
        if said:
            say("the hooks' switch is INFERSIGHT, not %s (INFERSIGHT=1 turns them on); the hooks stay off"
                % " or ".join(said))
