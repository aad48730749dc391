"""One parser for every ``INFERSIGHT_*`` variable the hooks read (``hooks/_env.py``).

Under ``launch`` a bad value is a usage error (exit 2) before CMD starts, naming the variable,
the value and what is allowed; exporter settings given by environment are checked there too.
Under the bootstrap, one stderr line names it, that key takes its default, and the process is
still observed (its cold start reaches the agent).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import hook_env, read_otlp_lines, spans

from infersight.hooks import _env

HOOKS = Path(__file__).resolve().parents[2] / "hooks"
CLI = [sys.executable, "-m", "infersight"]

# (variable, bad value, words of what is allowed): the cases and one of each kind.
HOOK_CASES = [
    ("INFERSIGHT_SPOOL_MAX_BYTES", "lots", "whole number of bytes"),
    ("INFERSIGHT_SAMPLER", "maybe", "1/0, true/false"),
    ("INFERSIGHT_SAMPLER_INTERVAL_MS", "0", "a number > 0"),
    ("INFERSIGHT_EXIT_FLUSH_S", "soon", "a number >= 0"),
    ("INFERSIGHT_BATCH_EVENTS", "0", "a whole number >= 1"),
    ("INFERSIGHT_PROCESS_ROLE", "boss", "one of helper"),
]
EXPORTER_CASES = [
    ("INFERSIGHT_PROMETHEUS_PORT", "abc", "exporters.prometheus.port"),
    ("INFERSIGHT_MQTT_URL", "bogus://x", "mqtt:// or mqtts://"),
]


def _launch(tmp_path: Path, name: str, value: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    marker = tmp_path / "cmd-ran"
    env = dict(os.environ)
    env.update({"TMPDIR": str(tmp_path), name: value})
    r = subprocess.run([*CLI, "launch", "--no-console", "--otlp-file", str(tmp_path / "o.jsonl"), "--",
                        sys.executable, "-c", "open(%r, 'w').write('x')" % str(marker)],
                       capture_output=True, text=True, timeout=60, env=env)
    return r, marker


@pytest.mark.parametrize(("name", "value", "allowed"), HOOK_CASES + EXPORTER_CASES)
def test_launch_refuses_a_bad_value_before_cmd_starts(tmp_path: Path, name: str, value: str, allowed: str) -> None:
    r, marker = _launch(tmp_path, name, value)
    assert r.returncode == 2, r.stderr
    assert name in r.stderr and value in r.stderr and allowed in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not marker.exists(), "CMD must not start"


def test_launch_runs_cmd_with_good_values(tmp_path: Path) -> None:
    r, marker = _launch(tmp_path, "INFERSIGHT_SPOOL_MAX_BYTES", "64MiB")
    assert r.returncode == 0, r.stderr
    assert marker.exists()


def _hooked(tmp_path: Path, agent, **env: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    script = tmp_path / "serve.py"
    script.write_text("from infersight import hooks\nwith hooks.stage('load'):\n    pass\n"
                      "print('observed', hooks.active())\n")
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env=hook_env(agent.sock, agent.spool, **env))


@pytest.mark.parametrize(("name", "value", "allowed"), HOOK_CASES)
def test_bootstrap_says_one_line_and_keeps_observing(tmp_path: Path, agent_factory, name: str, value: str,  # type: ignore[no-untyped-def]
                                                     allowed: str) -> None:
    agent = agent_factory().start()
    env = {name: value}
    if name != "INFERSIGHT_EXIT_FLUSH_S":
        env["INFERSIGHT_EXIT_FLUSH_S"] = "5"
    r = _hooked(tmp_path, agent, **env)
    assert r.returncode == 0 and r.stdout.strip() == "observed True", r.stderr
    lines = [x for x in r.stderr.splitlines() if name in x]
    assert len(lines) == 1, r.stderr
    assert value in lines[0] and allowed in lines[0] and "default" in lines[0]
    assert "disabled" not in r.stderr
    assert agent.stop() == 0
    names = [s["name"] for s in spans(read_otlp_lines(agent.out))]
    assert "coldstart" in names and "coldstart.load" in names  # still observed


@pytest.mark.parametrize(("name", "value", "_key"), EXPORTER_CASES)
def test_bootstrap_leaves_agent_settings_to_the_agent(tmp_path: Path, agent_factory, name: str, value: str,  # type: ignore[no-untyped-def]
                                                      _key: str) -> None:
    """An exporter's variable is the agent's business: the hooked process neither warns nor stops."""
    agent = agent_factory().start()
    r = _hooked(tmp_path, agent, INFERSIGHT_EXIT_FLUSH_S="5", **{name: value})
    assert r.returncode == 0 and r.stdout.strip() == "observed True" and name not in r.stderr, r.stderr
    assert agent.stop() == 0
    assert "coldstart" in [s["name"] for s in spans(read_otlp_lines(agent.out))]


def test_every_variable_the_hooks_read_is_in_the_table() -> None:
    named = set()
    for f in [*HOOKS.glob("*.py"), *HOOKS.glob("bootstrap/*.py")]:
        if f.name == "_env.py":
            continue
        named |= set(re.findall(r"[\"'](INFERSIGHT_[A-Z_]+)[\"']", f.read_text()))
    assert named, "the scan found the hooks' variables"
    assert named <= set(_env.VARS), named - set(_env.VARS)
    # ... and nothing reads one of them but through the parser (``_env.get``).
    strays = [read for f in [*HOOKS.glob("*.py"), *HOOKS.glob("bootstrap/*.py")] if f.name != "_env.py"
              for read in stray_reads(f)]
    assert not strays, strays


def _infersight_key(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("INFERSIGHT_")


def stray_reads(path: Path) -> list[str]:
    """Reads of an ``INFERSIGHT_*`` variable that bypass ``_env.get``: ``x.get("INFERSIGHT_...")``
    on anything but ``_env``, ``getenv("INFERSIGHT_...")`` and ``x["INFERSIGHT_..."]`` read from
    anything but ``_env.VARS`` (a write, ``env[...] = ...``, or a ``pop`` is no read)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        where = "%s:%d" % (path.name, getattr(node, "lineno", 0))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and _infersight_key(node.args[0]) and node.func.attr in ("get", "getenv", "environ"):
            receiver = node.func.value
            if not (node.func.attr == "get" and isinstance(receiver, ast.Name) and receiver.id == "_env"):
                out.append(where)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _infersight_key(node.slice) \
                and not (isinstance(node.value, ast.Attribute) and node.value.attr == "VARS"):
            out.append(where)
    return out


def test_the_stray_read_scan_finds_each_kind(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import os\nenv = os.environ\na = env.get('INFERSIGHT_X')\nb = os.environ['INFERSIGHT_Y']\n"
                 "c = os.getenv('INFERSIGHT_Z')\nd = _env.get('INFERSIGHT_OK')\nenv['INFERSIGHT_W'] = '1'\n"
                 "env.pop('INFERSIGHT_V', None)\ne = _env.VARS['INFERSIGHT_OK'].default\n")
    assert stray_reads(f) == ["m.py:3", "m.py:4", "m.py:5"]


@pytest.mark.parametrize(("name", "raw", "value"), [
    ("INFERSIGHT_SPOOL_MAX_BYTES", "1048576", 1 << 20),
    ("INFERSIGHT_SPOOL_MAX_BYTES", "64MiB", 64 << 20),
    ("INFERSIGHT_SPOOL_MAX_BYTES", "2g", 2 << 30),
    ("INFERSIGHT_SAMPLER", "OFF", False),
    ("INFERSIGHT_READY_ON_LISTEN", " yes ", True),
    ("INFERSIGHT_BATCH_DELAY_MS", "0", 0.0),
    ("INFERSIGHT_MEM_INTERVAL_S", "0.25", 0.25),
    ("INFERSIGHT_PROCESS_ROLE", "helper", "helper"),
])
def test_values_parse(name: str, raw: str, value: object) -> None:
    assert _env.get(name, {name: raw}) == value
    assert _env.problems({name: raw}) == []


@pytest.mark.parametrize("raw", ["lots", "-1", "1.5", "nan", "12 MB", ""])
def test_bad_bytes_take_the_default(raw: str, capsys: pytest.CaptureFixture[str]) -> None:
    _env._reported.clear()
    assert _env.get("INFERSIGHT_SPOOL_MAX_BYTES", {"INFERSIGHT_SPOOL_MAX_BYTES": raw}) == 64 << 20
    assert _env.get("INFERSIGHT_SPOOL_MAX_BYTES", {"INFERSIGHT_SPOOL_MAX_BYTES": raw}) == 64 << 20
    err = capsys.readouterr().err
    assert err.count("INFERSIGHT_SPOOL_MAX_BYTES") == (0 if raw == "" else 1)  # once; empty is unset


def test_launch_does_not_check_what_it_sets_itself() -> None:
    env = {"INFERSIGHT_LAUNCH_SPAWN_NS": "x", "INFERSIGHT_READY_FILE": ""}
    assert _env.problems(env) == []
    assert len(_env.problems(env, internal=True)) == 1


def test_docs_table_is_the_parsers_table() -> None:
    doc = (HOOKS.parent / "docs" / "hooks-env.md").read_text()
    assert _env.reference_markdown() in doc
