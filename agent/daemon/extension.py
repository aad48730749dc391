"""How a feature plugs into the agent: one small base class, and what the agent offers it.

An :class:`Extension` (cold start, OOM, requests, devices, routing) is handed to the
:class:`~infersight.agent.daemon.lifecycle.Agent` when it is built; the agent takes its
event-kind handlers and its span handler then, starts it before it listens, asks it to
validate a reloaded configuration (all extensions validate before any applies), merges its
health into the status reply, and closes it at shutdown before the exporters drain. The daemon package
knows no extension by name, nor their configuration keys (each declares the ones its
reload applies live): the commands (the composition root) choose them.

:class:`Extension` is a base class whose defaults do nothing: an extension overrides only
what its feature uses.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

from infersight.agent.daemon.assemble import KindHandler, Producer, SpanHandler
from infersight.agent.daemon.broadcast import Broadcaster
from infersight.settings import Config
from infersight.telemetry import Item, Resource

# What a validated reload runs to take effect; None: nothing to apply.
Apply = Callable[[], None]


class AgentContext(Protocol):
    """What a running agent offers its extensions (the Agent itself is one)."""

    config: Config  # the configuration in force; a reload replaces it
    resource: Resource  # the agent's own resource (service.name infersight-agent)
    broadcaster: Broadcaster  # publish items to every exporter (or only to live/recorded ones)
    embedded: bool  # the agent of ``infersight launch`` (True), or the daemon

    def producer_info(self, producer: str) -> dict[str, Any] | None:
        """The hello of a producer the agent knows (pid, start_ns, trace and root ids)."""

    def hooked_pids(self, uid: int | None) -> frozenset[int]:
        """The kernel's PIDs (SO_PEERCRED, in the agent's namespace) of ``uid``'s live producers."""

    def stderr_relayed(self, info: dict[str, Any]) -> bool:
        """Whether a joined launch copies the stderr of the producer of hello ``info`` to the agent."""

    def stderr_relay_started(self, info: dict[str, Any]) -> float | None:
        """When (monotonic s) that launch's relay started forwarding its captures at once; None while it has not
        (its event loop is still starting: it keeps them), 0.0 when no launch relays that producer's stderr."""

    def visible_pid(self, producer: str) -> int | None:
        """The PID under which this agent's /proc shows ``producer``'s process: its hello's, unless the kernel
        put it in another PID namespace (SO_PEERCRED gave 0: the hello's pid is its container's, and the same
        number here is some other process); None then, or for a producer the agent does not know."""

    def observe(self, tap: Callable[[Sequence[Item]], None]) -> None:
        """Show ``tap`` every batch before the exporters get it (quick, must not raise)."""

    def on_hello(self, tap: Callable[[Producer], None]) -> None:
        """Show ``tap`` each producer that says hello on a connection (a live process; a reconnect too, and
        every producer again after this agent restarted), once its identity is checked (quick)."""

    def on_heartbeat(self, job: Callable[[], None]) -> None:
        """Run ``job`` on each heartbeat, after the agent's own health is published (quick,
        must not raise)."""

    def spawn(self, job: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``job`` beside ingest until shutdown; a failure is logged and the agent runs on."""


class Extension:
    """A feature of the agent. Subclass it, set ``name``, and override what the feature uses:
    each default does nothing (no event kinds, no span handler, nothing to start or close,
    nothing to reload live, no health sections)."""

    name: str = ""  # unique among the agent's extensions: its entry in the status reply
    # Keys whose new value its reload applies to the running agent; a change to any key no
    # extension (nor the agent) applies live takes effect at the next restart (logged).
    live_keys: frozenset[str] = frozenset()

    def kinds(self) -> Mapping[str, KindHandler]:
        """The event kinds it handles (``oom``, ``req``, ...), taken once when the agent is
        built. Default: none."""
        return {}

    def spans(self) -> SpanHandler | None:
        """Its part in span assembly (spans by name prefix, producers that died), taken once
        when the agent is built. Default: None."""
        return None

    async def start(self, agent: AgentContext) -> None:
        """Before the agent listens: quick; long work goes to ``agent.spawn``. Default: nothing."""

    def reload(self, config: Config) -> Apply | None:
        """Validate its part of a new configuration, changing nothing: raise the error
        (an ``InfersightError`` such as ConfigError naming file:line), or return what applies it.
        Default: None (nothing of it applies live)."""
        return None

    async def session_ended(self, session: str, uid: int) -> None:
        """A joined launch's session ``session`` ends (its CMD exited): publish now what it holds of that
        session's producers of ``uid`` (the launch's, the kernel's word; 0: any), before launch is told
        ``ended``. Default: nothing."""

    def health(self) -> Mapping[str, Any]:
        """Sections added to the status reply (``infersight status --json``). Default: none."""
        return {}

    async def aclose(self) -> None:
        """At shutdown, after producers' connections closed and before the exporters drain:
        publish what is pending, release resources. Idempotent; also without ``start``.
        Default: nothing."""
