"""The top-level ``infersight`` parser: a command's usage errors and its --help.

A wrong option after a command's name is that command's usage error (its own usage line, exit
2), not the top level's; a command's description (often its module docstring) reaches --help
without reStructuredText markup.
"""

from __future__ import annotations

import re

import pytest

from infersight.agent import cli

RST = re.compile(r"``|:[a-z]+:`")


@pytest.mark.parametrize("argv", [
    ["launch", "--bogus", "--", "true"],
    ["classify", "--bogus", "x"],
    ["report", "--bogus", "x"],
])
def test_a_wrong_option_is_the_commands_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: infersight %s " % argv[0]), err
    assert "infersight %s: error: unrecognized arguments: --bogus" % argv[0] in err


def test_a_wrong_option_before_the_command_is_the_top_levels(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--bogus", "classify", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: infersight [-h]") and "infersight: error: unrecognized arguments: --bogus" in err


@pytest.mark.parametrize("name", [name for name, _, _ in cli.COMMANDS])
def test_help_has_no_restructuredtext_markup(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: infersight %s" % name)
    assert not RST.search(out), out


def test_plain_text() -> None:
    assert cli.plain_text("``infersight x``: see :func:`run`, :mod:`~a.b.c` and :ref:`the page <page>`.") == (
        "infersight x: see run(), a.b.c and the page.")
    assert cli.plain_text("Usage: ``a [b]...\n[c]``") == "Usage: a [b]...\n[c]"
