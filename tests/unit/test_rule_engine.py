"""The rule engine: rubric rules and their examples, validation with file:line, no eval."""

from __future__ import annotations

import builtins
import re
from pathlib import Path

import pytest

from infersight.errors import SourceError
from infersight.rules import engine
from infersight.rules.engine import (
    ExpressionError,
    RuleFileError,
    RuleSet,
    builtin_rules_path,
    check_examples,
    classify,
    derive,
    load_rules,
    parse_expression,
)

GIB = 1 << 30
MIB = 1 << 20
DOCS = Path(__file__).resolve().parents[2] / "docs" / "oom.md"

BUILTIN = load_rules([builtin_rules_path()])
ALL_EXAMPLES = [(r, ex) for r in BUILTIN.rules for ex in r.examples]


def _write(tmp_path: Path, text: str, name: str = "site.toml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def _errors(paths: list[Path]) -> list[str]:
    with pytest.raises(RuleFileError) as info:
        load_rules([builtin_rules_path(), *paths])
    return [f"{loc}: {msg}" for loc, msg in info.value.errors]


VALID_RULE = """
[[rule]]
id = "site.x"
version = 1
class = "capacity"
priority = 5
condition = "R > 100GiB"
remedy = "buy more"

[[rule.examples]]
kind = "positive"
numbers = { R = "200 GiB" }

[[rule.examples]]
kind = "negative"
numbers = { R = "1 GiB" }
"""


# ---------------------------------------------------------------- the builtin rubric


def test_builtin_rules_are_the_rubric_in_order() -> None:
    assert [r.id for r in BUILTIN.ordered()] == [
        "oom.capacity.beyond-device",
        "oom.fragmentation",
        "oom.reservation.cap",
        "oom.reservation.tenants",
        "oom.capacity.per-process",
        "oom.reservation.outside-allocator",
        "oom.capacity",
        "oom.unknown",
    ]
    for r in BUILTIN.rules:
        assert {e.kind for e in r.examples} == {"positive", "negative"}, r.id


@pytest.mark.parametrize(
    ("rule", "ex"),
    ALL_EXAMPLES,
    ids=[f"{r.id}-{i}-{e.kind}" for i, (r, e) in enumerate(ALL_EXAMPLES)],
)
def test_every_builtin_example_case(rule: engine.Rule, ex: engine.Example) -> None:
    v = BUILTIN.classify(ex.numbers, backend=ex.backend)
    if ex.kind == "positive":
        assert v.rule == rule.id, (v.cls, v.rule, ex.where)
    else:
        assert v.rule != rule.id, ex.where
    if ex.expect_class:
        assert v.cls == ex.expect_class


def test_check_examples_reports_nothing_for_the_builtin_file() -> None:
    assert check_examples(BUILTIN) == []


def test_step5_unknown_names_the_missing_numbers() -> None:
    v = classify({"R": 2 * GIB, "T": 16 * GIB, "F": 1 * GIB})
    assert v.cls == "unknown"
    assert v.rule == "oom.unknown"
    assert v.missing == ("A", "P")
    assert v.note == "missing: A, P"
    v = classify({})
    assert v.cls == "unknown"
    assert "R" in v.missing
    assert "F" in v.missing
    assert v.requested_bytes is None


def test_fragmentation_from_free_alone_when_cache_is_unknown() -> None:
    v = classify({"R": 192 * MIB, "T": 32 * GIB, "F": 13 * GIB})
    assert v.cls == "fragmentation"


def test_cap_rule_and_used_numbers() -> None:
    nums = {"R": 4 * GIB, "T": 12 * GIB, "F": 11 * GIB, "A": GIB // 2, "P": GIB, "L": 4 * GIB}
    v = classify(nums)
    assert (v.cls, v.rule) == ("reservation_conflict", "oom.reservation.cap")
    assert v.used == {"A": GIB // 2, "C": GIB // 2, "F": 11 * GIB, "L": 4 * GIB, "P": GIB, "R": 4 * GIB}
    assert v.numbers == {**dict.fromkeys("RTFAPUOL"), **nums}
    assert "the cap L = 4.00 GiB bound" in v.note


def test_async_backend_takes_no_cache() -> None:
    env = derive({"A": 10 * GIB}, backend="cudaMallocAsync")
    assert env["C"] == 0
    assert env["P"] == 10 * GIB
    env = derive({"A": 10 * GIB})
    assert env["C"] is None


def test_fragmentation_note_for_live_tensors_near_the_device_size() -> None:
    v = classify({"R": 2 * MIB, "T": 6 * GIB, "F": 0, "A": int(5.8 * GIB), "P": int(5.9 * GIB)})
    assert v.cls == "fragmentation"
    assert "live tensors use 97% of the device" in v.note


# ---------------------------------------------------------------- expressions


def _ev(src: str, **env: float | None) -> object:
    return engine._eval(parse_expression(src), env)


def test_expression_units_precedence_and_functions() -> None:
    assert _ev("1GiB + 512MiB == 1.5 GiB")
    assert _ev("2 * 3 + 4 == 10 and 2 * (3 + 4) == 14")
    assert _ev("max(1, 2, 3) == 3 and min(4, 5) == 4 and abs(-2) == 2")
    assert _ev("not 1 > 2")
    assert _ev("-R < 0", R=1.0)
    assert _ev("R / 0 > 1", R=1.0) is None  # division by zero is unknown, not an error


def test_three_valued_logic() -> None:
    assert _ev("R > 1 or true") is True
    assert _ev("R > 1 and false") is False
    assert _ev("R > 1") is None
    assert _ev("not R > 1") is None
    assert _ev("known(R)") is False
    assert _ev("known(R)", R=5.0) is True
    assert _ev("known(L) and F + C >= R") is False


@pytest.mark.parametrize(
    ("src", "message"),
    [
        ("R +", "end of expression"),
        ("R > ", "end of expression"),
        ("Q > 1", "unknown quantity 'Q'"),
        ("R", "needs a true/false test"),
        ("R and T", "needs a true/false test"),
        ("(R > 1) + 2", "needs a number"),
        ("1 < R < 3", "chained comparisons"),
        ("max(R)", "two or more"),
        ("known(1)", "known() takes one quantity name"),
        ("__import__ > 1", "unknown quantity '__import__'"),
        ("__import__('os').system('true')", "unexpected character"),
        ("R.__class__", "unexpected character '.'"),
        ("R > 1; T", "unexpected character ';'"),
        ("(" * 100 + "R > 1" + ")" * 100, "nested deeper"),
        ("R + " * 2000 + "R > 1", "longer than"),
    ],
)
def test_expression_errors(src: str, message: str) -> None:
    with pytest.raises(ExpressionError, match=re.escape(message)):
        parse_expression(src)


def test_engine_never_calls_eval_or_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("eval/exec/compile used")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    monkeypatch.setattr(builtins, "compile", refuse)
    rs = load_rules([builtin_rules_path()])
    assert check_examples(rs) == []
    assert rs.classify({"R": GIB, "T": 8 * GIB, "F": 0, "A": 7 * GIB, "P": 7 * GIB}).cls
    source = Path(engine.__file__).read_text(encoding="utf-8")
    assert not re.search(r"\b(eval|exec)\(", source.replace("_eval(", ""))


# ---------------------------------------------------------------- validation


def test_valid_site_file_loads_after_builtin(tmp_path: Path) -> None:
    p = _write(tmp_path, 'engine_version = "1.0"\n' + VALID_RULE)
    rs = load_rules([builtin_rules_path(), p])
    assert rs.ordered()[0].id == "site.x"
    assert rs.classify({"R": 200 * GIB}).rule == "site.x"
    assert rs.sources[-1] == str(p)


def test_engine_version_mismatch_names_the_line(tmp_path: Path) -> None:
    p = _write(tmp_path, '# site\n\nengine_version = "2.0"\n' + VALID_RULE)
    errs = _errors([p])
    assert errs == [f"{p}:3: needs engine 2.0, this engine is 1.0"]
    p = _write(tmp_path, 'engine_version = "1.7"\n' + VALID_RULE)
    assert _errors([p]) == [f"{p}:1: needs engine 1.7, this engine is 1.0"]
    p = _write(tmp_path, VALID_RULE)
    assert _errors([p]) == [f"{p}:1: missing engine_version (this engine is 1.0)"]


def test_every_error_names_file_and_line(tmp_path: Path) -> None:
    text = """engine_version = "1"
colour = "blue"

[[rule]]
id = "site.bad"
version = 0
class = "oops"
priority = "high"
condition = "R >> 1"
remedy = ""
extra = 1

[[rule.examples]]
kind = "positive"
numbers = { R = "lots" }
"""
    p = _write(tmp_path, text)
    errs = _errors([p])
    assert f"{p}:2: unknown top-level key 'colour'" in errs
    assert f"{p}:11: unknown rule key 'extra'" in errs
    assert f"{p}:6: site.bad: version must be a positive integer" in errs
    assert any(e.startswith(f"{p}:7: site.bad: class must be one of") for e in errs)
    assert f"{p}:8: site.bad: priority must be an integer" in errs
    assert f"{p}:9:17: site.bad: condition: unexpected '>'" in errs  # line:column of the second '>'
    assert f"{p}:10: site.bad: remedy must be a non-empty string" in errs
    assert f"{p}:13: site.bad: example 1: R = 'lots' is not a size" in errs


def test_toml_syntax_error_line(tmp_path: Path) -> None:
    p = _write(tmp_path, 'engine_version = "1.0"\n\n[[rule]]\nid = \n')
    errs = _errors([p])
    assert len(errs) == 1
    assert errs[0].startswith(f"{p}:4: TOML syntax")


def test_failing_example_names_its_line(tmp_path: Path) -> None:
    text = 'engine_version = "1.0"\n' + VALID_RULE.replace('R = "1 GiB"', 'R = "101 GiB"')
    p = _write(tmp_path, text)
    lines = text.splitlines()
    line = [i for i, s in enumerate(lines, 1) if s == "[[rule.examples]]"][1]
    assert _errors([p]) == [f"{p}:{line}: site.x: negative example fired the rule"]


def test_missing_negative_example_and_duplicate_id(tmp_path: Path) -> None:
    only_pos = VALID_RULE.split('[[rule.examples]]\nkind = "negative"', maxsplit=1)[0]
    p = _write(tmp_path, 'engine_version = "1.0"\n' + only_pos)
    assert _errors([p]) == [f"{p}:3: site.x: needs at least one positive and one negative example"]
    a = _write(tmp_path, 'engine_version = "1.0"\n' + VALID_RULE, "a.toml")
    b = _write(tmp_path, 'engine_version = "1.0"\n' + VALID_RULE, "b.toml")
    errs = _errors([a, b])
    assert errs == [f"{b}:3: duplicate rule id 'site.x' (first at {a}:3)"]


def test_bad_note_template_is_reported(tmp_path: Path) -> None:
    text = 'engine_version = "1.0"\n' + VALID_RULE + '\n[[rule.notes]]\ntext = "{R:furlongs}"\n'
    p = _write(tmp_path, text)
    line = len(text.splitlines()) - 1
    # The text's own line and the column of its '{' (the note's table starts one line up).
    assert _errors([p]) == [f"{p}:{line + 1}:9: site.x: note 1: unknown format 'furlongs' (use bytes, pct, int, num)"]


def test_a_template_prints_a_fraction_as_the_engine_does() -> None:
    t = engine.parse_template("{f:num} / {m:num} / {m:pct} / {n:num}", ["f", "m", "n"])
    assert engine.render(t, {"f": 0.77, "m": 0.7726, "n": 3.0}) == "0.77 / 0.7726 / 77% / 3"


def test_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    errs = _errors([missing])
    assert errs[0].startswith(f"{missing}:1: cannot read rule file")


def test_a_file_that_is_not_utf8_is_refused_at_its_bad_byte(tmp_path: Path) -> None:
    """Every rule file and the agent's config name the line and column of the first byte that is not UTF-8 (they
    named line 1 and Python's codec text, with the byte's offset in the file)."""
    from infersight.agent.daemon.config import ConfigError, read_config_text
    from infersight.rules.serving import load_serving_rules
    from infersight.rules.stage_rules import load_stage_rules

    body = b'engine_version = "1.0"\n\n[[rule]]\nid = "site.caf\xe9"\n'
    p = tmp_path / "latin1.toml"
    p.write_bytes(body)
    want = f"{p}:4:15: not UTF-8: byte 0xe9 cannot be read (save the file as UTF-8)"
    assert _errors([p]) == [want]
    for load in (load_serving_rules, load_stage_rules):
        with pytest.raises(SourceError) as info:
            load([p])
        assert str(info.value).splitlines()[0] == want, load
    with pytest.raises(ConfigError, match=re.escape(want)):
        read_config_text(str(p))


# ---------------------------------------------------------------- unknown handling, extras


def test_skip_versus_stop(tmp_path: Path) -> None:
    rule = VALID_RULE.replace('condition = "R > 100GiB"', 'condition = "O > 100GiB"')
    rule = rule.replace('R = "200 GiB"', 'O = "200 GiB"')
    p = _write(tmp_path, 'engine_version = "1.0"\n' + rule)
    rs = load_rules([builtin_rules_path(), p])
    # O unknown: the skipping site rule does not block the rubric.
    v = rs.classify({"R": 2 * MIB, "T": 6 * GIB, "F": 0, "A": 5 * GIB, "P": 5 * GIB + 50 * MIB})
    assert v.cls == "fragmentation"
    stop = rule.replace('remedy = "buy more"', 'remedy = "buy more"\nwhen_unknown = "stop"')
    p = _write(tmp_path, 'engine_version = "1.0"\n' + stop)
    rs = load_rules([builtin_rules_path(), p])
    v = rs.classify({"R": 2 * MIB, "T": 6 * GIB, "F": 0, "A": 5 * GIB, "P": 5 * GIB + 50 * MIB})
    assert (v.cls, v.missing) == ("unknown", ("O",))


def test_extra_quantities(tmp_path: Path) -> None:
    rule = VALID_RULE.replace(
        'condition = "R > 100GiB"',
        'condition = "known(gmu) and gmu >= 0.9"',
    ).replace('numbers = { R = "200 GiB" }', 'numbers = { R = "1 GiB" }')
    p = _write(tmp_path, 'engine_version = "1.0"\nquantities = ["gmu"]\n' + rule)
    with pytest.raises(RuleFileError):  # examples cannot carry extras: the positive fails
        load_rules([builtin_rules_path(), p])
    # Without the positive example check, the rule works with extras at classify time.
    rs = RuleSet(rules=list(BUILTIN.rules))
    loader = engine._FileLoader(str(p), p.read_text(), rs.quantities, 100)
    rules, names = loader.load()
    assert "gmu" in names
    assert not loader.errors
    rs.rules.extend(rules)
    nums = {"R": GIB, "T": 80 * GIB, "F": 0, "A": 70 * GIB, "P": 70 * GIB}
    assert rs.classify(nums, extra={"gmu": 0.95}).rule == "site.x"
    assert rs.classify(nums).rule != "site.x"


def test_docs_site_rule_example_loads_and_its_examples_pass(tmp_path: Path) -> None:
    doc = DOCS.read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```toml\n(.*?)```", doc, re.S) if "rules.d/" in b]
    assert blocks, "docs/oom.md lost its site rule example"
    paths = [_write(tmp_path, b, f"{i}.toml") for i, b in enumerate(blocks)]
    rs = load_rules([builtin_rules_path(), *paths])
    site = [r for r in rs.rules if r.where.file in {str(p) for p in paths}]
    assert site
    assert check_examples(rs, site) == []
    vllm = {
        "R": 4960687227,
        "T": 23794118820,
        "F": 3564822856,
        "A": 19273665741,
        "P": 19742431642,
        "U": 20218558546,
        "O": 10737418,
    }
    assert BUILTIN.classify(vllm).cls == "capacity"
    assert rs.classify(vllm).rule == "site.vllm.preallocation"
