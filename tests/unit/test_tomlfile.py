"""The one TOML key locator (infersight.tomlfile) and the Location/SourceError model."""

from __future__ import annotations

import pytest

from infersight.errors import InfersightError, Location, SourceError
from infersight.tomlfile import TomlKeys, loads


def test_location_formats_with_and_without_column() -> None:
    assert str(Location("a.toml", 3, 7)) == "a.toml:3:7"
    assert str(Location("a.toml", 3)) == "a.toml:3"


def test_locations_sort_by_file_line_column() -> None:
    locs = [Location("b.toml", 1), Location("a.toml", 10), Location("a.toml", 2, 5), Location("a.toml", 2, 1)]
    assert sorted(locs) == [Location("a.toml", 2, 1), Location("a.toml", 2, 5), Location("a.toml", 10),
                            Location("b.toml", 1)]


def test_source_error_text_and_locations() -> None:
    err = SourceError("bad value", Location("c.toml", 4, 9), Location("d.toml", 1))
    assert isinstance(err, InfersightError)
    assert str(err) == "c.toml:4:9: bad value"
    assert err.message == "bad value"
    assert err.locations == [Location("c.toml", 4, 9), Location("d.toml", 1)]
    assert str(SourceError("env INFERSIGHT_X: bad value")) == "env INFERSIGHT_X: bad value"


TEXT = """\
top = 1
agent.socket = "/s"

[agent]
  log_level = "INFO"   # a comment
"quoted.key" = 2
'literal' = 3
[exporters . "file"]
path = "/x"
"""


def test_finds_dotted_section_and_quoted_keys_with_column() -> None:
    keys = TomlKeys(TEXT, "c.toml")
    assert keys.find("top") == Location("c.toml", 1, 1)
    assert keys.find("agent.socket") == Location("c.toml", 2, 1)  # a dotted key at the top level
    assert keys.find("agent.log_level") == Location("c.toml", 5, 3)  # in [agent], indented
    assert keys.find(("agent", "quoted.key")) == Location("c.toml", 6, 1)  # a dot inside quotes
    assert keys.find(("agent", "literal")) == Location("c.toml", 7, 1)
    assert keys.find("exporters.file.path") == Location("c.toml", 9, 1)  # header with spaces and quotes
    assert keys.find("exporters.file") == Location("c.toml", 8, 1)  # the table: its header
    assert keys.find("agent.nope") is None


ARRAYS = """\
engine_version = "1.0"

[[rule]]
id = "a"
[[rule.examples]]
kind = "positive"
[[rule.examples]]
kind = "negative"

[[rule]]
id = "b"
condition = \"\"\"
x = 1
[[rule]]
\"\"\"
[[rule.notes]]
text = "n"
"""


def test_finds_keys_in_arrays_of_tables_by_index() -> None:
    keys = TomlKeys(ARRAYS, "r.toml")
    assert keys.find(("rule", 0)) == Location("r.toml", 3, 1)
    assert keys.find(("rule", 0, "id")) == Location("r.toml", 4, 1)
    assert keys.find(("rule", 0, "examples", 1, "kind")) == Location("r.toml", 8, 1)
    assert keys.find(("rule", 1, "id")) == Location("r.toml", 11, 1)
    # The lines of a multi-line string are neither keys nor headers.
    assert keys.find(("rule", 1, "x")) is None and keys.find(("rule", 2)) is None
    assert keys.find(("rule", 1, "notes", 0, "text")) == Location("r.toml", 17, 1)
    assert keys.find(("rule", 1, "examples")) is None


def test_nearest_falls_back_to_the_table_then_line_one() -> None:
    keys = TomlKeys(ARRAYS, "r.toml")
    assert keys.nearest(("rule", 1, "remedy")) == Location("r.toml", 10, 1)
    assert keys.nearest(("rule", 0, "examples", 0, "numbers")) == Location("r.toml", 5, 1)
    assert keys.nearest(("nowhere", 3)) == Location("r.toml", 1)


def test_offsets_and_locations_round_trip() -> None:
    keys = TomlKeys(TEXT, "c.toml")
    where = keys.find("agent.log_level")
    assert where is not None
    at = keys.offset(where)
    assert TEXT[at:].startswith("log_level")
    assert keys.location(at) == where


def test_loads_reports_a_syntax_error_at_its_line() -> None:
    with pytest.raises(SourceError) as e:
        loads("a = 1\n[table\n", "x.toml")
    assert e.value.locations == [Location("x.toml", 2)]
    assert str(e.value).startswith("x.toml:2: TOML syntax: ")
