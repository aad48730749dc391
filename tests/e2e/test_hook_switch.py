"""``INFERSIGHT``, the hooks' switch, has one meaning everywhere: the bootstrap, the ``.pth``
line (``hooks install``) and the hooks' own parser (``_env``) agree on its words, and a value
that is no boolean is said on stderr, naming the variable, and leaves the hooks on (the
default), as for every other ``INFERSIGHT_*`` variable."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BOOTSTRAP, hook_env

from infersight.agent.commands.hooks_install import pth_line
from infersight.hooks import _env

# Prints whether the hooks are loaded and active in this process.
PROBE = ("import sys; h = sys.modules.get('infersight.hooks._runtime'); "
         "print('active' if h is not None and h.active() else 'off')")


def _run(tmp_path: Path, value: str | None, *, pth: bool = False) -> subprocess.CompletedProcess[str]:
    env = hook_env(tmp_path / "none.sock", tmp_path / "spool", INFERSIGHT_EXIT_FLUSH_S="0")
    env.pop("INFERSIGHT", None)
    if value is not None:
        env["INFERSIGHT"] = value
    code = PROBE
    if pth:  # the .pth line as site.py runs it, then the probe; the bootstrap is not on PYTHONPATH
        env.pop("PYTHONPATH", None)
        code = pth_line(str(BOOTSTRAP)).strip() + "\n" + PROBE
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_the_bootstrap_and_the_parser_share_the_off_words() -> None:
    tree = ast.parse((BOOTSTRAP / "sitecustomize.py").read_text())
    off = next(ast.literal_eval(n.value) for n in ast.walk(tree)
               if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "OFF" for t in n.targets))
    assert tuple(off) == _env.FALSE_WORDS
    assert _env.VARS["INFERSIGHT"].kind == "bool" and _env.VARS["INFERSIGHT"].default is True


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_every_off_word_leaves_the_process_unhooked(tmp_path: Path, value: str) -> None:
    p = _run(tmp_path, value)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "off"
    assert "infersight" not in p.stderr


@pytest.mark.parametrize("value", [None, "1", "true", "Yes"])
def test_unset_or_on_hooks_the_process(tmp_path: Path, value: str | None) -> None:
    p = _run(tmp_path, value)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "active", p.stderr
    assert "INFERSIGHT" not in p.stderr


def test_a_value_that_is_no_boolean_is_said_and_the_hooks_stay_on(tmp_path: Path) -> None:
    p = _run(tmp_path, "flase")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "active"
    assert "INFERSIGHT='flase' is not allowed" in p.stderr


@pytest.mark.parametrize(("value", "state"), [("1", "active"), ("true", "active"), ("on", "active"),
                                              (None, "off"), ("0", "off"), ("false", "off")])
def test_the_pth_line_loads_the_hooks_only_when_the_switch_is_on(tmp_path: Path, value: str | None,
                                                                  state: str) -> None:
    p = _run(tmp_path, value, pth=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == state, p.stderr
