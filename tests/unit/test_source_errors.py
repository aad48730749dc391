"""One file-error model: the config, the OOM rules and devices.toml report a problem the
same way (a SourceError at file:line, file:line:col inside a value), and every package's
exceptions share one base."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from test_rule_engine import VALID_RULE

from infersight.agent.daemon import config as cfg
from infersight.agent.errors import AgentError
from infersight.errors import InfersightError, Location, SourceError
from infersight.exporters.base import ExporterError
from infersight.hooks._paths import HooksError
from infersight.rules.device_rules import DeviceRulesError, load_device_rules, parse_device_rules
from infersight.rules.engine import RuleFileError, load_rules
from infersight.rules.rulefile import RulesError
from infersight.settings import ConfigError, Key, parse_int, setting

REPO = Path(__file__).resolve().parents[2]

RULE = 'engine_version = "1.0"\n' + VALID_RULE  # a rule file that loads


def _raised(fn: object) -> SourceError:
    with pytest.raises(SourceError) as e:
        fn()  # type: ignore[operator]
    return e.value


def test_three_loaders_report_a_bad_value_through_one_type(tmp_path: Path) -> None:
    conf = tmp_path / "infersight.toml"
    conf.write_text("[agent]\n# comment\nhealth_interval_s = -1\n")
    rules = tmp_path / "site.toml"
    rules.write_text(RULE.replace("priority = 5", 'priority = "high"'))
    devices = tmp_path / "devices.toml"
    devices.write_text('engine_version = "1.0"\n[thresholds]\n\nthrottle_share = "x"\n')

    errors = [
        _raised(lambda: cfg.load(str(conf), env={})),
        _raised(lambda: load_rules([rules])),
        _raised(lambda: load_device_rules(devices)),
    ]
    assert [type(e) for e in errors] == [ConfigError, RuleFileError, DeviceRulesError]
    # The bad value's key names the line; the column adds nothing there.
    assert [e.locations for e in errors] == [[Location(str(conf), 3)], [Location(str(rules), 7)],
                                             [Location(str(devices), 4)]]
    for e in errors:
        assert str(e).startswith("%s: " % e.locations[0])
    assert "bad value for agent.health_interval_s" in str(errors[0])


def test_a_problem_inside_a_value_names_its_column(tmp_path: Path) -> None:
    rules = tmp_path / "site.toml"
    rules.write_text(RULE.replace('condition = "R > 100GiB"', 'condition = "R > > 100GiB"'))
    err = _raised(lambda: load_rules([rules]))
    assert err.locations == [Location(str(rules), 8, 18)]  # the second ">"
    assert str(err) == f"{rules}:8:18: site.x: condition: unexpected '>'"


def test_config_errors_carry_the_file_location(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('[exporters.mqtt]\nurl = "mqtt://h"\n\nqos = "x"\nqoss = 1\n')
    loaded = cfg.load(str(conf), env={})
    assert loaded.locations["exporters.mqtt.qos"] == Location(str(conf), 4)
    assert loaded.sources["exporters.mqtt.qos"] == "%s:4" % conf
    qos = Key("exporters.mqtt.qos", parse_int, lambda: 1, None, "qos")
    err = _raised(lambda: setting(loaded, qos, {}))
    assert err.locations == [Location(str(conf), 4)]
    conf.write_text("[agent]\n\nsokcet = 1\n")
    err = _raised(lambda: cfg.load(str(conf), env={}))
    assert err.locations == [Location(str(conf), 3)]
    assert err.message == "unknown key 'agent.sokcet' (did you mean 'agent.socket'?)"
    err = _raised(lambda: cfg.load(None, env={"INFERSIGHT_SHUTDOWN_TIMEOUT_S": "soon"}))
    assert err.locations == []  # from the environment: the message names the variable


def test_toml_syntax_errors_are_source_errors_everywhere(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("engine_version = \"1.0\"\n[thresholds\n")
    for load in (lambda: cfg.load(str(p), env={}), lambda: load_rules([p]), lambda: load_device_rules(p)):
        assert _raised(load).locations == [Location(str(p), 2)]


# -- devices.toml declares engine_version, as every rule file does ------------------------


def test_devices_toml_takes_engine_version() -> None:
    assert parse_device_rules('engine_version = "1.0"\n').engine == 1
    assert parse_device_rules('engine_version = "1"\n').engine == 1


def test_devices_toml_still_takes_the_deprecated_engine_key() -> None:
    assert parse_device_rules("engine = 1\n").engine == 1


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("[thresholds]\n", 1, "missing engine_version (this engine is 1.0)"),
        ('\nengine_version = "1.1"\n', 2, "needs engine 1.1, this engine is 1.0"),
        ('engine_version = "2.0"\n', 1, "needs engine 2.0, this engine is 1.0"),
        ("engine = 2\n", 1, "needs engine 2.0, this engine is 1.0"),
        ('engine_version = "one"\n', 1, "engine_version 'one' is not MAJOR or MAJOR.MINOR"),
        ('engine_version = "1.0"\nengine = 1\n', 2, "set engine_version only (engine is its deprecated name)"),
    ],
)
def test_devices_toml_refuses_a_version_it_cannot_run(text: str, line: int, message: str) -> None:
    with pytest.raises(DeviceRulesError) as e:
        parse_device_rules(text, "d.toml")
    assert str(e.value) == f"d.toml:{line}: {message}"


def test_shipped_devices_toml_uses_engine_version() -> None:
    text = (REPO / "rules" / "devices.toml").read_text()
    assert 'engine_version = "1.0"' in text and "\nengine = " not in text


# -- one base per package ------------------------------------------------------------------

PACKAGE_BASES: dict[str, type[Exception]] = {
    "agent": AgentError,
    "rules": RulesError,
    "infersight": InfersightError,
    "hooks": HooksError,  # hooks import nothing of ours outside hooks: not an InfersightError
    "exporters": ExporterError,
}
MODULE_PREFIX = {"agent": "infersight.agent", "rules": "infersight.rules", "infersight": "infersight",
                 "hooks": "infersight.hooks", "exporters": "infersight.exporters"}


def _exception_classes(folder: str) -> list[tuple[str, str]]:
    """(module, class) of every class in ``folder`` whose bases name an Error or Exception."""
    found = []
    for path in sorted((REPO / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(b).endswith(("Error", "Exception")) for b in node.bases
            ):
                rel = path.relative_to(REPO / folder).with_suffix("")
                parts = [p for p in rel.parts if p != "__init__"]
                found.append((".".join([MODULE_PREFIX[folder], *parts]), node.name))
    return found


@pytest.mark.parametrize("folder", sorted(PACKAGE_BASES))
def test_every_exception_derives_from_its_package_base(folder: str) -> None:
    classes = _exception_classes(folder)
    assert classes
    for module, name in classes:
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, PACKAGE_BASES[folder]), f"{module}.{name}"
        assert issubclass(cls, InfersightError) == (folder != "hooks"), f"{module}.{name}"
