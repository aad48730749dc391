"""The shipped serving rules' pre-parsed JSON (``rules/serving.parsed.json``): current with the TOML,
taken only for the exact text it came from, and the rules it gives find and classify exactly what the
rules parsed from TOML do, on every labelled message and rule example."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infersight.rules import preparsed
from infersight.rules.engine import builtin_rule_set
from infersight.rules.serving import (
    LazyPattern,
    ServingRules,
    analyse,
    builtin,
    builtin_serving_path,
    load_serving_rules,
)
from infersight.tomlfile import loads

DATA = Path(__file__).resolve().parents[1] / "support" / "data"
SHIPPED = Path(str(builtin_serving_path())).with_name(preparsed.PARSED)


def test_the_shipped_json_is_current_with_serving_toml() -> None:
    text = builtin_serving_path().read_text(encoding="utf-8")
    want = preparsed.render(text, loads(text, "serving.toml"))
    assert SHIPPED.read_text(encoding="utf-8") == want, (
        "rules/serving.parsed.json is stale: run `python -m infersight.rules.preparsed`")


def test_it_is_taken_only_for_the_text_it_was_made_from() -> None:
    text = builtin_serving_path().read_text(encoding="utf-8")
    shipped = SHIPPED.read_text(encoding="utf-8")
    assert preparsed.document_for(text, shipped) == loads(text, "serving.toml")
    edited = text.replace("[[rule]]", "[[rule]] ", 1)
    assert preparsed.document_for(edited, shipped) is None  # same keys, one more character
    flipped = text.replace("priority = 10", "priority = 11", 1)
    assert len(flipped) == len(text) and preparsed.document_for(flipped, shipped) is None  # the CRC
    wrapper = json.loads(shipped)
    for broken in ("", "{", "[]", json.dumps({**wrapper, "format": 2}), json.dumps({**wrapper, "document": []})):
        assert preparsed.document_for(text, broken) is None


def test_the_builtin_rules_come_from_it_with_patterns_compiled_at_first_use() -> None:
    rs = load_serving_rules(rubric=builtin_rule_set(), run_examples=False)
    pats = [p for r in rs.rules for p in (*r.patterns, *r.context)]
    assert pats and all(isinstance(p, LazyPattern) for p in pats)
    assert not any(p._compiled for p in pats)
    # a file given by path (a site's, or the shipped one named) is parsed and compiled at load, checked whole
    eager = load_serving_rules([builtin_serving_path()], rubric=builtin_rule_set(), run_examples=False)
    assert not any(isinstance(p, LazyPattern) for r in eager.rules for p in (*r.patterns, *r.context))


def _messages() -> list[str]:
    out = []
    for f in sorted(DATA.glob("serving_ooms_*.jsonl")):
        out += [json.loads(x)["message"] for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]
    for r in builtin().rules:
        out += [e.text for e in r.examples]
    out += [e.text for q in builtin().not_memory for e in q.examples]
    return out


def _findings(text: str, rs: ServingRules) -> list[dict[str, object]]:
    return [{**f.to_json(), "lines": (f.first_line, f.last_line)} for f in analyse(text, rs)]


@pytest.mark.parametrize("run", ["pre-parsed", "from TOML"])
def test_pre_parsed_and_toml_rules_give_the_same_findings(run: str) -> None:
    lazy = load_serving_rules(rubric=builtin_rule_set(), run_examples=False)
    eager = load_serving_rules([builtin_serving_path()], rubric=builtin_rule_set(), run_examples=False)
    first, second = (lazy, eager) if run == "pre-parsed" else (eager, lazy)  # either compiles first
    texts = _messages()
    assert len(texts) > 650
    found = 0
    for t in texts:
        a = _findings(t, first)
        assert a == _findings(t, second), t[:300]
        found += bool(a)
    assert found > 450


def test_a_pattern_that_does_not_compile_at_first_use_matches_nothing_and_raises_nothing() -> None:
    bad = LazyPattern("(unclosed")
    assert bad.search("(unclosed") is None and list(bad.finditer("x")) == [] and dict(bad.groupindex) == {}
    good = LazyPattern(r"(?P<R>\d+) MiB")
    m = good.search("tried 20 MiB")
    assert m is not None and m.group("R") == "20" and "R" in good.groupindex
