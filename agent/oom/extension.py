"""Live OOM classification as an agent extension: the ``oom`` and ``mem`` event kinds.

An invalid site rule file at startup is logged (file:line) and the builtin rules run until
a reload succeeds; a reload validates ``rules.dirs`` and swaps the rules only when the whole
reload is valid. At shutdown it waits (bounded) for OOMs still reading NVML.

The daemon loads the serving-engine rules at start, so that no OOM waits for them; the
embedded agent of ``launch`` does not spend that CPU while CMD starts: they load when launch's
stderr relay opens a capture (:meth:`OomExtension.warm`) or at the first OOM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from infersight.agent.daemon.assemble import KindHandler
from infersight.agent.daemon.extension import AgentContext, Apply, Extension
from infersight.agent.oom.kind import OomClassifier, OomHandlers, RuleReloadError
from infersight.agent.oom.nvml_views import NvmlGuard, NvmlLike
from infersight.settings import Config

log = logging.getLogger("infersight.agent.oom")


class OomExtension(Extension):
    name = "oom"
    live_keys: frozenset[str] = frozenset({"rules.dirs"})

    def __init__(
        self,
        config: Config,
        nvml: NvmlLike | None = None,
        nvml_guard: NvmlGuard | None = None,
    ) -> None:
        """``nvml``/``nvml_guard``: the devices extension's NVML and the lock that keeps
        reads and nvmlShutdown apart (None: OOMs are classified without NVML's numbers)."""
        dirs = list(config.get("rules.dirs") or [])
        try:
            classifier = OomClassifier(dirs)
        except RuleReloadError as exc:
            log.error("%s\nclassifying OOMs with the builtin rules until a reload succeeds", exc)
            classifier = OomClassifier([])
            classifier.dirs = dirs
        self.handlers = OomHandlers(classifier, nvml, nvml_guard=nvml_guard)

    def kinds(self) -> Mapping[str, KindHandler]:
        return {"oom": self.handlers.oom, "mem": self.handlers.mem}

    async def start(self, agent: AgentContext) -> None:
        self.handlers.publish = agent.broadcaster.publish
        if not agent.embedded:
            self.warm()
            # a joined launch's relay sends its CMD's stderr captures: an undecided engine error the hooks
            # report waits a little for that copy, as under launch's own agent
            relayed, started = agent.stderr_relayed, agent.stderr_relay_started
            self.handlers.relayed = lambda p: bool(p.info.get("launched")) and relayed(p.info)
            self.handlers.relay_started = lambda p: started(p.info)

    async def session_ended(self, session: str, uid: int) -> None:
        """The held copies of the session's producers go out now; OOMs still reading NVML finish (bounded)."""
        await self.handlers.session_ended(session, uid)

    def warm(self) -> None:
        """Load the rules now (any thread): the next OOM does not wait for them."""
        self.handlers.classifier.warm()

    def reload(self, config: Config) -> Apply | None:
        return self.handlers.classifier.prepare(config)

    def health(self) -> Mapping[str, Any]:
        h = self.handlers
        return {"oom": {"classified": h.ooms, "duplicates": h.duplicates, "not_memory": h.not_memory,
                        "over_budget": h.over_budget, "over_uid_budget": h.over_uid_budget,
                        "nvml_late": h.nvml_late, "reads_refused": h.reads_refused}}

    async def aclose(self) -> None:
        await self.handlers.wait_later()
