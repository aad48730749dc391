"""Hostile rule files: expressions too deep for the evaluator, TOML too deep for tomllib.

Each is refused with a clear error naming file:line(:column), never a RecursionError
(issue 10, item 12). The real agent with such a file: tests/e2e/test_reload_atomic.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infersight.agent.daemon import config as cfg
from infersight.rules import engine
from infersight.rules.device_rules import DeviceRulesError, parse_device_rules
from infersight.rules.engine import ExpressionError, RuleFileError, load_rules, parse_expression
from infersight.settings import ConfigError

RULE = """engine_version = "1.0"

[[rule]]
id = "site.deep"
version = 1
class = "capacity"
priority = 5
condition = "{cond}"
remedy = "none"
[[rule.examples]]
kind = "positive"
numbers = {{ R = 2, A = 1, P = 1, T = 10, F = 0 }}
[[rule.examples]]
kind = "negative"
numbers = {{ R = 0, A = 1, P = 1, T = 10, F = 0 }}
"""


def chain(n: int, op: str = "*") -> str:
    return op.join(["R"] * n)


def test_a_1900_factor_product_is_refused_with_file_line_and_column(tmp_path: Path) -> None:
    p = tmp_path / "site.toml"
    p.write_text(RULE.format(cond=chain(1900) + " > 1"))
    with pytest.raises(RuleFileError) as e:
        load_rules([p])
    (loc, msg), = e.value.errors
    # The 65th factor is where the tree gets deeper than 64: 'R*' is 2 characters each,
    # the expression starts after 'condition = "' (13 characters): column 14 + 2 * 64.
    assert (loc.file, loc.line, loc.column) == (str(p), 8, 14 + 2 * engine._MAX_DEPTH)
    col = 14 + 2 * engine._MAX_DEPTH
    assert str(e.value).startswith(f"{p}:8:{col}: site.deep: condition: expression nested deeper")


@pytest.mark.parametrize("op", ["*", "+", "-", "/"])
def test_chain_depth_limit_is_exact(op: str) -> None:
    limit = engine._MAX_DEPTH
    parse_expression(chain(limit - 1, op) + " > 1")  # with the comparison: exactly the limit
    with pytest.raises(ExpressionError) as e:
        parse_expression(chain(limit, op) + " > 1")
    assert "nested deeper than" in str(e.value)


@pytest.mark.parametrize(
    "src",
    [
        "(" * 1500 + "R" + ")" * 1500 + " > 1",
        "-" * 1900 + "R > 1",
        "not " * 900 + "R > 1",
        "max(" * 900 + "R" + ", 1)" * 900 + " > 1",
    ],
)
def test_other_deep_shapes_are_refused(src: str) -> None:
    with pytest.raises(ExpressionError, match="nested deeper than|longer than") as e:
        parse_expression(src)
    assert e.value.pos is not None


def test_many_shallow_parts_are_fine() -> None:
    e = parse_expression(" and ".join(["(" + chain(40) + " > 1)"] * 20))
    assert engine._eval(e, {"R": 2.0}) is True


def test_deep_note_template_names_its_column(tmp_path: Path) -> None:
    text = RULE.format(cond="R > 1") + '[[rule.notes]]\ntext = "x {' + chain(100, "+") + '}"\n'
    p = tmp_path / "site.toml"
    p.write_text(text)
    with pytest.raises(RuleFileError) as e:
        load_rules([p])
    (loc, msg), = e.value.errors
    assert loc.line == text.splitlines().index('[[rule.notes]]') + 2
    assert loc.column == len('text = "x {') + 2 * engine._MAX_DEPTH + 1
    assert "note 1" in msg and "nested deeper" in msg


DEEP_TOML = "a = " + "[" * 5000 + "]" * 5000 + "\n"


def test_deeply_nested_toml_rule_file(tmp_path: Path) -> None:
    p = tmp_path / "site.toml"
    p.write_text(DEEP_TOML)
    with pytest.raises(RuleFileError) as e:
        load_rules([p])
    assert str(e.value) == f"{p}:1: TOML nested too deeply"


def test_deeply_nested_toml_config_and_device_rules(tmp_path: Path) -> None:
    p = tmp_path / "infersight.toml"
    p.write_text(DEEP_TOML)
    with pytest.raises(ConfigError, match="nested too deeply"):
        cfg.load(str(p), env={})
    with pytest.raises(DeviceRulesError, match="nested too deeply"):
        parse_device_rules(DEEP_TOML, "devices.toml")
