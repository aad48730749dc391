"""The embedded agent as ``infersight launch`` sees it: the one interface its session uses.

launch's session (:mod:`~infersight.agent.commands.launch_session`) never reaches into the
agent's pipeline (ingest, assembler, exporter workers) nor knows an exporter by name: it
holds an :class:`EmbeddedAgent`, and what that offers is all it does with its agent:

- :meth:`~EmbeddedAgent.serve`: run the agent until the session ends;
- :meth:`~EmbeddedAgent.replay_spools`, :attr:`~EmbeddedAgent.open_connections`: read what
  producers spooled, wait for the connections of exiting ones;
- :meth:`~EmbeddedAgent.launched`: CMD's own producers (their hello says ``launched``);
- :meth:`~EmbeddedAgent.classify_stderr`: a capture of CMD's stderr, for the OOM classifier;
  :meth:`~EmbeddedAgent.prepare_oom` when one opens. The classifier's rules (~70 ms of CPU)
  load then, or once a process of CMD is ready (its cold start ended by readiness), or at
  the first OOM: not while CMD starts, unless CMD is a serving engine (its command line, or a
  stage of an engine's stage rule, says so), whose memory errors come while it starts;
- :meth:`~EmbeddedAgent.publish`, :meth:`~EmbeddedAgent.publish_coldstart`: what launch
  itself saw (the probe span; its own cold-start root, with the fleet metrics);
- :meth:`~EmbeddedAgent.settle`: exporters that wait for their peer at exit (MQTT);
- :meth:`~EmbeddedAgent.health`: for launch's closing report.

It is built on the agent's public session methods
(:class:`~infersight.agent.daemon.lifecycle.Agent`: ``producers``, ``inject``, ``publish``,
``settle_exporters``...) and the cold-start extension's ``finished``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Sequence
from typing import Any, TextIO

from infersight.agent.coldstart.extension import ColdStartExtension
from infersight.agent.commands.compose import build_exporters
from infersight.agent.commands.extensions import build_extensions, new_agent
from infersight.agent.commands.launch_base import Child
from infersight.agent.daemon.assemble import Producer
from infersight.agent.daemon.lifecycle import Agent
from infersight.agent.oom.extension import OomExtension
from infersight.hooks._contract import ENDED_BY, ENDED_BY_FIRST_REQUEST, ENDED_BY_READY, ENGINE_PACKAGES, STAGE_RULE
from infersight.settings import Config
from infersight.telemetry import ColdStart, Item, Resource, SpanItem

SERVING = (ENDED_BY_READY, ENDED_BY_FIRST_REQUEST)  # a cold start that ended so: the process serves
# A serving engine's memory errors come while it starts (the KV cache is sized after the weights load, from a
# profile of the device), before any readiness: the OOM rules load when a stage of an engine's stage rule ends
# (rules/stages.toml names them by engine: vllm.load_model...), or at once when CMD's command line names an engine
# (engine_cmdline.engine_command).
ENGINE_STAGE_RULES = ("vllm.", "sglang.", "tgi.")
# The engines' packages (hooks._contract.ENGINE_PACKAGES): a process that imported one (its framework_import stage
# names the packages it imported, longest first) loads the rules before the engine's first stage, whose OOM
# (weights larger than the device, in vllm.load_model) would otherwise come before any stage of it ended.
IMPORT_PACKAGES = "infersight.import.packages"  # hooks/_imports.py: ["vllm 3.21 s", "torch 1.90 s", ...]

log = logging.getLogger("infersight.launch")


class EmbeddedAgent:
    """launch's agent: everything the session may ask of it (see the module's docstring)."""

    def __init__(self, agent: Agent, coldstart: ColdStartExtension | None = None,
                 oom: OomExtension | None = None) -> None:
        self._agent = agent
        self._coldstart = coldstart
        self._oom = oom
        self._oom_warm: threading.Thread | None = None
        self._oom_lock = threading.Lock()
        if oom is not None:
            agent.observe(self._watch_ready)
        self._stand_ins: dict[int, Producer] = {}  # pid -> the producer that stands for an unhooked CMD

    @classmethod
    def build(cls, conf: Config, out: TextIO, listen_sock: socket.socket, exporter_spool_root: str) -> EmbeddedAgent:
        """The agent of ``launch``: every extension, the exporters ``conf`` asks for (the
        console on ``out``), listening on launch's private socket."""
        extensions = build_extensions(conf)
        agent = new_agent(conf, build_exporters(conf, console_stream=out, embedded=True), extensions,
                          embedded=True, listen_sock=listen_sock, exporter_spool_root=exporter_spool_root)
        return cls(agent, next((e for e in extensions if isinstance(e, ColdStartExtension)), None),
                   next((e for e in extensions if isinstance(e, OomExtension)), None))

    @property
    def host_name(self) -> str:
        return str(self._agent.host_name)

    async def serve(self, until: Awaitable[object], shutdown_timeout_s: float) -> bool:
        """Run the agent until ``until`` (the session) completes, then shut it down; True when
        everything was delivered or spooled in time."""
        return await self._agent.serve(until=until, shutdown_timeout_s=shutdown_timeout_s)

    def know_command(self, pid: int, argv: list[str]) -> None:
        """CMD's command line, for its cold-start history key should it exit before its events
        are read (what /proc says while it runs: launch exec'd ``argv`` as given)."""
        if self._coldstart is not None:
            self._coldstart.tracker.known_commands[pid] = list(argv)

    def adopt(self, conns: Sequence[Any]) -> None:
        """The hooks' connections that launch accepted while it held the agent back."""
        self._agent.adopt(conns)

    def replay_spools(self, directory: str) -> int:
        return self._agent.replay_spools(directory)

    @property
    def open_connections(self) -> int:
        return self._agent.open_connections

    def launched(self, pid: int | None = None) -> list[Producer]:
        """Producers of launched processes (their hello says so); with ``pid``, that process's."""
        return [p for p in self._agent.producers()
                if p.info.get("launched") and (pid is None or p.info.get("pid") == pid)]

    def classify_stderr(self, child: Child, text: str) -> None:
        """A capture of CMD's stderr, as an ``oom`` event: of CMD's own producer when CMD runs
        hooked Python, else of a producer that stands for CMD (its pid and executable, like
        the launcher's cold-start root). A capture the classifier refuses is dropped."""
        p = next(iter(self.launched(child.pid)), None) or self._stand_in(child)
        try:
            items = self._agent.inject(p, "oom", {"source": "stderr", "text": text})
        except Exception as exc:  # never fatal
            log.debug("stderr capture not classified: %s", exc)
            return
        if items:
            self._agent.publish(items)

    def relay_started(self) -> None:
        """CMD's stderr goes through launch's relay (its processes inherit it): an engine error that their hooks
        report undecided waits a little for the relay's copy, which holds what the engine printed around it."""
        if self._oom is not None:
            self._oom.handlers.relayed = _launched

    def read_context_early(self, child: Child) -> None:
        """A capture of CMD's stderr opened (the relay's thread, at once: the event loop may be busy): the OOM
        classifier reads the live context of CMD's process tree now, on a thread of its own, while the process
        that prints the error still holds its memory (it may exit before the capture's text is classified)."""
        if self._oom is None:
            return
        # in-process (no uid): CMD's pid is launch's own child, its command line read from /proc
        p = Producer("launch-early-%d" % child.pid, {"pid": child.pid, "launched": True, "argv": _cmd_argv(child)},
                     Resource.of({}))
        self._oom.handlers.read_early(p)

    def prepare_oom(self, why: str = "a capture of CMD's stderr opened") -> None:
        """Load the OOM rules on a thread of their own now, once (any thread): a capture of
        CMD's stderr opened (it ends at least 50 ms later), a process of CMD serves, or CMD is a
        serving engine (``why`` says which, in launch's debug log)."""
        with self._oom_lock:  # the relay's thread and the event loop both call it
            if self._oom is None or self._oom_warm is not None:
                return
            self._oom_warm = threading.Thread(target=self._oom.warm, name="infersight-oom-rules", daemon=True)
        log.debug("loading the OOM rules now: %s", why)
        self._oom_warm.start()

    def _watch_ready(self, batch: Sequence[Item]) -> None:
        """A tap: the first cold start that ended by readiness (not by exit), or the first stage of a
        serving engine's stage rule (see ENGINE_STAGE_RULES) or the import of its package, loads the OOM rules."""
        if self._oom_warm is not None:
            return
        for it in batch:
            if isinstance(it, ColdStart) and it.root.attributes.get(ENDED_BY) in SERVING:
                self.prepare_oom("a process of CMD serves")
                return
            if not isinstance(it, SpanItem):
                continue
            rule = str(it.attributes.get(STAGE_RULE, ""))
            if rule.startswith(ENGINE_STAGE_RULES):
                self.prepare_oom("a serving engine's stage ended (%s)" % rule)
                return
            engine = _engine_imported(it.attributes.get(IMPORT_PACKAGES))
            if engine is not None:
                self.prepare_oom("a serving engine's package was imported (%s)" % engine)
                return

    def publish(self, items: list[Item]) -> None:
        self._agent.publish(items)

    def publish_coldstart(self, cs: ColdStart, t_ns: int) -> None:
        """A cold start only launch saw (CMD ran no hooked Python): its root, stages and
        summary, with what the cold-start extension adds (the fleet metrics), as one batch."""
        if self._coldstart is not None:
            self._agent.publish(self._coldstart.finished(cs, t_ns))
        else:
            self._agent.publish([cs.root, *cs.stages, cs])

    async def settle(self) -> None:
        """After the last publish: exporters that wait for their peer at exit (MQTT) do so;
        the OOM rules' load, if one runs, ends (not in the middle of interpreter shutdown)."""
        if self._oom_warm is not None:
            await asyncio.to_thread(self._oom_warm.join, 10.0)
        await self._agent.settle_exporters()

    def health(self) -> dict[str, Any]:
        """The agent's status reply (lost events, exporters' states), without the extensions'
        sections (the devices' would load the device rules, for a report that does not show them)."""
        return self._agent.health(extensions=False)

    def _stand_in(self, child: Child) -> Producer:
        p = self._stand_ins.get(child.pid)
        if p is None:
            argv = _cmd_argv(child)  # for the OOM classifier's engine knobs once CMD has exited
            exe = os.path.basename(argv[0]) if argv else ""
            res = Resource.of({
                "service.name": os.environ.get("OTEL_SERVICE_NAME") or "unknown_service:%s" % exe,
                "host.name": self.host_name, "process.pid": child.pid, "process.executable.name": exe,
                "telemetry.sdk.name": "infersight",
            })
            p = self._stand_ins[child.pid] = Producer("launch-stderr-%d" % child.pid,
                                                      {"pid": child.pid, "launched": True, "argv": argv}, res)
        return p


def _cmd_argv(child: Child) -> list[str]:
    """CMD's argv as launch started it, bounded (512 arguments of 256 characters)."""
    cmd = child.popen.args if isinstance(child.popen.args, list) else [child.popen.args]
    return [str(a)[:256] for a in cmd[:512]]


def _launched(p: Producer) -> bool:
    return bool(p.info.get("launched"))


def _engine_imported(packages: object) -> str | None:
    """The serving engine among a framework_import stage's packages ("vllm 3.21 s"), if any."""
    if not isinstance(packages, (list, tuple)):
        return None
    for entry in packages[:64]:
        name = str(entry).partition(" ")[0]
        if name in ENGINE_PACKAGES:
            return name
    return None
