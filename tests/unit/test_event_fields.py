"""The field checks every event kind shares (``assemble.text_field``, ``uint64_field``), one
copy for the daemon and the cold-start extension, and a stage rule's ``ready`` values."""

from __future__ import annotations

from pathlib import Path

import pytest

from infersight.agent.coldstart import assembly
from infersight.agent.coldstart.assembly import coldstart_assembler
from infersight.agent.daemon import assemble
from infersight.agent.daemon.assemble import INT64_MAX, MAX_STR, Malformed, text_field, uint64_field
from infersight.rules.stage_rules import StageRuleFileError, load_stage_rules

S = 1_000_000_000


def test_text_field_cuts_strings_and_refuses_anything_else() -> None:
    assert text_field("x" * (MAX_STR + 10), "body") == "x" * MAX_STR
    assert text_field("abcdef", "stage", 3) == "abc"
    with pytest.raises(Malformed, match="stage must be a string"):
        text_field(5, "stage", 64)


@pytest.mark.parametrize("bad", [True, -1, INT64_MAX + 1, 1.5, "7", None])
def test_uint64_field_refuses_what_is_not_a_non_negative_int64(bad: object) -> None:
    with pytest.raises(Malformed, match="start must be a non-negative 64-bit integer"):
        uint64_field(bad, "start")


def test_uint64_field_takes_the_whole_range() -> None:
    assert uint64_field(0, "s") == 0
    assert uint64_field(INT64_MAX, "s") == INT64_MAX


def test_the_coldstart_checkpoint_uses_the_daemons_checks() -> None:
    assert not hasattr(assembly, "_s") and not hasattr(assembly, "_i")  # no second copy
    assert assembly.text_field is assemble.text_field and assembly.uint64_field is assemble.uint64_field
    a = coldstart_assembler("h")
    p = a.hello({"id": "p1", "pid": 101, "start_ns": S, "trace_id": "%032x" % 1, "root_span_id": "%016x" % 1,
                 "service_name": "svc"}, 1000)
    assert p is not None
    good = [["weights_load", "%016x" % 2, "%016x" % 1, S, 2 * S, {}]]
    bool_start = [["weights_load", "%016x" % 2, "%016x" % 1, True, 2 * S, {}]]
    a.events(p, [[1, 2 * S, "cs_tick", {"open": good, "t": [], "i": [], "l": []}]])
    assert p.malformed == 0
    a.events(p, [[2, 2 * S, "cs_tick", {"open": bool_start, "t": [], "i": [], "l": []}]])
    assert p.malformed == 1


def _rule_file(tmp_path: Path, ready: str) -> Path:
    path = tmp_path / "r.toml"
    path.write_text('engine_version = "1.0"\n\n[[stage]]\nid = "t.r"\nstage = "custom_x"\n'
                    'targets = ["m:f"]\nready = %s\n\n[[stage.examples]]\nrun = "x"\n' % ready)
    return path


@pytest.mark.parametrize(("toml", "ready"), [("true", "return"), ("false", ""), ('"return"', "return"),
                                            ('"entry"', "entry"), ('"helper"', "helper")])
def test_a_stage_rules_ready_values(tmp_path: Path, toml: str, ready: str) -> None:
    (rule,) = load_stage_rules([_rule_file(tmp_path, toml)]).rules
    assert rule.ready == ready


def test_a_stage_rules_ready_refuses_other_words(tmp_path: Path) -> None:
    with pytest.raises(StageRuleFileError, match='ready must be true, false, "entry" or "helper"'):
        load_stage_rules([_rule_file(tmp_path, '"later"')])
