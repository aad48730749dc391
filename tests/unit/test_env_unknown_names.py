"""An ``INFERSIGHT_*`` name that nothing of infersight reads is a typo, and is said, never
silently ignored: the hooks' list of known names (``hooks/_env.py``: ``VARS`` and
``OTHER_NAMES``) is complete, ``unknown`` finds the typos with the name they likely mean,
and the agent logs them once at its start. (Spawned processes: tests/e2e/test_env_switch_pth.py.)"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

from infersight.agent.commands.hooks_install import pth_line
from infersight.agent.daemon import config as cfg
from infersight.hooks import _env

ROOT = Path(__file__).resolve().parents[2]

# Names outside the agent's key tables that something reads: the commands' own, and the
# developers' knobs of scripts/check and the test suite.
COMMANDS_AND_KNOBS = {
    "INFERSIGHT_CONFIG", "INFERSIGHT_MEASURE_STORAGE", "INFERSIGHT_RULES_DIR",
    "INFERSIGHT_TEST_WORKERS", "INFERSIGHT_STAGE_RULE_SOURCES", "INFERSIGHT_OOM_EXAMPLES",
}
# Names in the tree that nothing reads on purpose: the docs' and these tests' typos, and the
# stray-read scan's made-up names (tests/e2e/test_hook_env.py, tests/unit/test_tomlfile.py).
DELIBERATE = {
    "INFERSIGHT_SPOOL_MAX_BYTE", "INFERSIGHT_PROMETHEUS_PROT", "INFERSIGHT_OTLP_FILE_ENABLE",
    "INFERSIGHT_SAMPLR", "INFERSIGHT_ZZZ_NOTHING_LIKE_IT",
    "INFERSIGHT_X", "INFERSIGHT_Y", "INFERSIGHT_Z", "INFERSIGHT_W", "INFERSIGHT_V", "INFERSIGHT_OK",
    "INFERSIGHT_ENABLED", "INFERSIGHT_ENABLE", "INFERSIGHT_ON",  # the switch misspelled (_env.SWITCH_TYPO_WORDS)
}
SKIP_DIRS = {".git", ".venv", "__pycache__", "node_modules", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
NAME = re.compile(r"\bINFERSIGHT_[A-Z0-9_]*[A-Z0-9]\b(?![_*])")  # not a prefix (INFERSIGHT_MQTT_*)


def agent_key_names() -> set[str]:
    from infersight.agent.devices.settings import KEYS as DEVICE_KEYS
    from infersight.agent.routing.extension import ROUTING_KEYS
    from infersight.exporters.mqtt_settings import MQTT_KEYS
    from infersight.exporters.prometheus_endpoint import PROMETHEUS_KEYS
    from infersight.latency import WINDOW_KEY

    keys = (*cfg.KEYS, *MQTT_KEYS, *PROMETHEUS_KEYS, *DEVICE_KEYS, *ROUTING_KEYS, WINDOW_KEY)
    return {k.env for k in keys if k.env and k.env.startswith("INFERSIGHT")}


def test_the_known_names_are_the_agents_keys_the_hooks_and_the_commands() -> None:
    agent = agent_key_names()
    assert not agent - set(_env.VARS) - _env.OTHER_NAMES, "an agent key the hooks would call a typo"
    # ... and nothing more: a name removed from the agent leaves the list too.
    assert (agent - set(_env.VARS)) | COMMANDS_AND_KNOBS == _env.OTHER_NAMES


def test_every_name_in_the_tree_is_known() -> None:
    """Every INFERSIGHT_* name written anywhere in the project (code, docs, deployment files,
    scripts, tests) is one infersight reads, or a deliberate typo of the docs and tests."""
    known = set(_env.VARS) | _env.OTHER_NAMES | DELIBERATE
    strays: dict[str, str] = {}
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for f in files:
            path = Path(top) / f
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for m in NAME.finditer(text):
                if m.group(0) not in known:
                    strays.setdefault(m.group(0), str(path.relative_to(ROOT)))
    assert not strays, strays


@pytest.mark.parametrize(("typo", "meant"), [
    ("INFERSIGHT_SPOOL_MAX_BYTE", "INFERSIGHT_SPOOL_MAX_BYTES"),
    ("INFERSIGHT_OTLP_FILE_ENABLE", "INFERSIGHT_OTLP_FILE_ENABLED"),
    ("INFERSIGHT_PROMETHEUS_PROT", "INFERSIGHT_PROMETHEUS_PORT"),
    ("INFERSIGHT_SAMPLR", "INFERSIGHT_SAMPLER"),
])
def test_a_typo_is_found_with_the_name_it_likely_means(typo: str, meant: str) -> None:
    assert _env.unknown({typo: "1", "INFERSIGHT_SOCKET": "/s", "PATH": "/bin"}) == [(typo, meant)]
    line = _env.unknown_message(typo, meant)
    assert typo in line and "did you mean %s?" % meant in line


def test_a_name_like_nothing_gets_no_suggestion() -> None:
    assert _env.unknown({"INFERSIGHT_ZZZ_NOTHING_LIKE_IT": "1"}) == [("INFERSIGHT_ZZZ_NOTHING_LIKE_IT", None)]
    assert "did you mean" not in _env.unknown_message("INFERSIGHT_ZZZ_NOTHING_LIKE_IT", None)


def test_known_names_are_not_typos() -> None:
    env = dict.fromkeys((*_env.VARS, *_env.OTHER_NAMES), "1")
    env.update(INFERSIGHT="1", infersight_spool_max_byte="1", OTEL_SERVICE_NAME="x")
    assert _env.unknown(env) == []


def test_the_agent_logs_each_typo_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cfg, "_warned_names", set())
    monkeypatch.setenv("INFERSIGHT_PROMETHEUS_PROT", "1")
    monkeypatch.setenv("INFERSIGHT_OTLP_FILE_ENABLE", "false")
    with caplog.at_level(logging.WARNING, logger="infersight.config"):
        cfg.load(None)
        cfg.load(None)  # a reload: the same environment, said once
    lines = [r.getMessage() for r in caplog.records if r.name == "infersight.config"]
    assert len(lines) == 2, lines
    assert "INFERSIGHT_OTLP_FILE_ENABLE" in lines[0] and "did you mean INFERSIGHT_OTLP_FILE_ENABLED?" in lines[0]
    assert "INFERSIGHT_PROMETHEUS_PROT" in lines[1] and "did you mean INFERSIGHT_PROMETHEUS_PORT?" in lines[1]
    assert cfg.unknown_env_warnings() == lines


def test_an_explicit_environment_is_not_the_agents(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cfg, "_warned_names", set())
    with caplog.at_level(logging.WARNING, logger="infersight.config"):
        cfg.load(None, env={"INFERSIGHT_PROMETHEUS_PROT": "1"})
    assert not [r for r in caplog.records if r.name == "infersight.config"]


def test_the_docs_default_of_the_switch_says_where_it_is_off() -> None:
    row = next(x for x in _env.reference_markdown().splitlines() if x.startswith("| `INFERSIGHT` |"))
    assert "`True`" not in row and "off under the `.pth` line" in row


def test_the_pth_line_is_one_line() -> None:
    line = pth_line("/opt/infersight/hooks/bootstrap")
    assert line.startswith("import ") and line.count("\n") == 1 and line.endswith("\n")
