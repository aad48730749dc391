"""The one extension protocol: what the agent does with an Extension, and that the daemon and
``launch`` run the same set (agent/commands/extensions.py is their one composition root)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from infersight.agent.coldstart.assembly import ColdStartAssembly
from infersight.agent.commands.extensions import EXTENSIONS
from infersight.agent.commands.status import query_status
from infersight.agent.daemon import config as cfg
from infersight.agent.daemon.extension import AgentContext, Apply, Extension
from infersight.agent.daemon.lifecycle import Agent
from infersight.settings import Config, ConfigError

# A launched CMD asks its launch's agent for its status over INFERSIGHT_SOCKET.
ASK_STATUS = (
    "import json, os\n"
    "from infersight.agent.commands.status import query_status\n"
    "print('STATUS ' + json.dumps(query_status(os.environ['INFERSIGHT_SOCKET'])))\n"
)


def test_the_daemon_and_launch_run_the_same_extensions(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    daemon = agent_factory().start()
    assert daemon.status()["extensions"] == list(EXTENSIONS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    r = subprocess.run([sys.executable, "-m", "infersight", "launch", "--otlp-file", str(tmp_path / "o.jsonl"),
                        "--", sys.executable, "-c", ASK_STATUS],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("STATUS "))
    launched = json.loads(line.removeprefix("STATUS "))
    assert launched["mode"] == "embedded"
    assert launched["extensions"] == list(EXTENSIONS)
    for section in ("coldstarts", "nvml", "requests"):  # each extension's health, in both modes
        assert section in launched and section in daemon.status()


class Recorder(Extension):
    """An extension that records what the agent does with it."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name = name
        self.calls = calls
        self.level = 0
        self.refuse = False

    async def start(self, agent: AgentContext) -> None:
        self.calls.append(self.name + ".start")

    def reload(self, config: Config) -> Apply | None:
        self.calls.append(self.name + ".validate")
        if self.refuse:
            raise ConfigError("%s: refused" % self.name)
        level = self.level + 1

        def apply() -> None:
            self.calls.append(self.name + ".apply")
            self.level = level

        return apply

    def health(self) -> Mapping[str, Any]:
        return {self.name: {"level": self.level}, "healthy": "an extension never hides the agent's own keys"}

    async def aclose(self) -> None:
        self.calls.append(self.name + ".aclose")


class Bare(Extension):
    """An extension that overrides nothing but its name."""

    name = "bare"


def test_the_base_class_defaults_do_nothing(tmp_path: Path) -> None:
    bare = Bare()
    assert (bare.kinds(), bare.spans(), bare.health(), bare.live_keys) == ({}, None, {}, frozenset())
    conf = cfg.load(None, env={}, flags={"agent.socket": str(tmp_path / "a.sock"),
                                         "agent.spool_dir": str(tmp_path / "spool")})
    assert bare.reload(conf) is None

    async def main() -> None:
        agent = Agent(conf, [], [bare], embedded=True, exporter_spool_root=str(tmp_path / "x"))
        await agent.start()
        try:
            assert agent.health()["extensions"] == ["bare"]
            assert agent.reload() is True
        finally:
            assert await agent.shutdown(5)

    asyncio.run(main())


class Spans(Extension):
    """An extension whose span handler takes ``prefixes``."""

    def __init__(self, name: str, prefixes: tuple[str, ...]) -> None:
        self.name = name
        self.handler = ColdStartAssembly()
        self.handler.prefixes = prefixes

    def spans(self) -> ColdStartAssembly:
        return self.handler


def test_two_extensions_never_share_span_names(tmp_path: Path) -> None:
    conf = cfg.load(None, env={}, flags={"agent.socket": str(tmp_path / "a.sock"),
                                         "agent.spool_dir": str(tmp_path / "spool")})
    agent = Agent(conf, [], [Spans("a", ("coldstart",)), Spans("b", ("other",))], embedded=True,
                  exporter_spool_root=str(tmp_path / "x"))
    assert [h.prefixes for h in agent.assembler.span_handlers] == [("coldstart",), ("other",)]
    with pytest.raises(ValueError, match=r"two extensions \(one is b\)"):
        Agent(conf, [], [Spans("a", ("coldstart",)), Spans("b", ("coldstart.x",))], embedded=True,
              exporter_spool_root=str(tmp_path / "y"))


def test_extension_health_in_status_and_reload_all_or_nothing(tmp_path: Path) -> None:
    conf_file = tmp_path / "infersight.toml"
    conf_file.write_text(f'[agent]\nsocket = "{tmp_path / "a.sock"}"\nspool_dir = "{tmp_path / "spool"}"\n')
    conf = cfg.load(str(conf_file), env={})
    calls: list[str] = []
    first, second = Recorder("first", calls), Recorder("second", calls)
    exporters_ok = [True]

    def check_exporters(_new: Config) -> None:
        if not exporters_ok[0]:
            raise ConfigError("exporters.mqtt.qos: refused")

    async def main() -> None:
        agent = Agent(conf, [], [first, second], embedded=True, exporter_spool_root=str(tmp_path / "x"),
                      check_config=check_exporters)
        await agent.start()
        try:
            assert calls == ["first.start", "second.start"]
            status = await asyncio.to_thread(query_status, str(tmp_path / "a.sock"))
            assert status["first"] == {"level": 0} and status["second"] == {"level": 0}
            assert status["healthy"] is True
            assert status["extensions"] == ["first", "second"]

            second.refuse = True  # one part invalid: nothing applies, every part was validated
            calls.clear()
            assert agent.reload() is False
            assert calls == ["first.validate", "second.validate"]
            assert (first.level, second.level) == (0, 0)
            assert agent.counters.reload_failures == 1 and "second: refused" in (agent.last_reload_error or "")

            second.refuse = False  # the exporters' sections invalid: no extension is even asked
            exporters_ok[0] = False
            calls.clear()
            assert agent.reload() is False
            assert calls == []

            exporters_ok[0] = True  # all valid: validated first, then applied
            calls.clear()
            assert agent.reload() is True
            assert calls == ["first.validate", "second.validate", "first.apply", "second.apply"]
            status = await asyncio.to_thread(query_status, str(tmp_path / "a.sock"))
            assert status["first"] == {"level": 1} and status["second"] == {"level": 1}
        finally:
            await agent.shutdown(5)
        assert calls[-2:] == ["first.aclose", "second.aclose"]

    asyncio.run(main())


def test_serve_until_stops_like_a_signal_and_closes_the_extensions(tmp_path: Path) -> None:
    """launch's shape: the agent serves until its session ends, then shuts down in order."""
    conf = cfg.load(None, env={}, flags={"agent.socket": str(tmp_path / "a.sock"),
                                         "agent.spool_dir": str(tmp_path / "spool")})
    calls: list[str] = []

    async def main() -> bool:
        agent = Agent(conf, [], [Recorder("ext", calls)], embedded=True, exporter_spool_root=str(tmp_path / "x"))

        async def session() -> None:
            calls.append("session: listening=%s" % agent.listening)

        ok = await agent.serve(until=session(), shutdown_timeout_s=5)
        assert not agent.listening
        return ok

    assert asyncio.run(main()) is True
    assert calls == ["ext.start", "session: listening=True", "ext.aclose"]


class NamedConsole:
    """A recording sink that happens to be called "console"."""

    name = "console"

    async def start(self) -> None:
        return None

    async def export(self, batch: Any) -> None:
        return None

    async def force_flush(self, timeout_s: float) -> bool:
        return True

    async def shutdown(self) -> None:
        return None

    def state(self) -> dict[str, int | float | str]:
        return {}


def test_an_ephemeral_exporter_gets_no_spool_whatever_its_name(tmp_path: Path) -> None:
    """The console shows the present (a terminal): no disk spool. That is the exporter's
    property (``ephemeral``), not its name."""
    from infersight.exporters.console import ConsoleExporter

    conf = cfg.load(None, env={}, flags={"agent.socket": str(tmp_path / "a.sock"),
                                         "agent.spool_dir": str(tmp_path / "spool")})
    agent = Agent(conf, [ConsoleExporter(), NamedConsole()], embedded=True, exporter_spool_root=str(tmp_path / "x"))
    console, recording = agent.workers
    assert console.spool is None
    assert recording.spool is not None


def test_keys_an_extension_applies_live_are_not_left_for_the_restart(tmp_path: Path, caplog: Any) -> None:
    """The agent knows no feature's keys: an extension declares the ones its reload applies,
    and only a change to another key is logged as waiting for the next restart."""
    import logging

    conf_file = tmp_path / "infersight.toml"
    base = f'[agent]\nsocket = "{tmp_path / "a.sock"}"\nspool_dir = "{tmp_path / "spool"}"\n'
    conf_file.write_text(base)
    live = Recorder("live", [])
    live.live_keys = frozenset({"rules.dirs"})
    agent = Agent(cfg.load(str(conf_file)), [], [live], embedded=True, exporter_spool_root=str(tmp_path / "x"))
    conf_file.write_text(base + 'idle_timeout_s = 5.0\n\n[rules]\ndirs = ["%s"]\n' % tmp_path)
    with caplog.at_level(logging.WARNING, logger="infersight.agent"):
        assert agent.reload() is True
    assert agent.config["rules.dirs"] == [str(tmp_path)] and live.level == 1
    (line,) = [r.getMessage() for r in caplog.records if "next restart" in r.getMessage()]
    assert line.endswith(": agent.idle_timeout_s")
