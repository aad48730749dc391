"""The one small protocol every sink implements.

An exporter receives batches of :mod:`infersight.telemetry` items. ``export`` raises
:class:`ExportError` when the peer is away or refuses; the agent's exporter worker then
retries with backoff and spools to disk, so an exporter holds no retry logic of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from infersight.errors import InfersightError
from infersight.telemetry import ColdStart, Item

OWNER_ATTR = "process.user.id"  # a resource's producer uid, set by the agent from the kernel's word


def item_owner(it: Item) -> int | None:
    """The uid whose producer an item is of (``OWNER_ATTR``); None for the agent's own items."""
    res = it.root.resource if isinstance(it, ColdStart) else it.resource
    uid = res.get(OWNER_ATTR)
    return uid if type(uid) is int else None


class ExporterError(InfersightError):
    """The base of the exporters' errors. Only :class:`ExportError` means "not delivered,
    retry or spool" to the agent's worker; a settings error is an ``ExporterError`` too, but
    never an ``ExportError``."""


class ExportError(ExporterError):
    """The batch was not delivered.

    ``retryable`` False: the peer refused this batch for good (a malformed payload, say);
    the worker drops it at once and counts it. ``rejected`` True: the peer answered and
    refused it, so retrying may or may not help; each such attempt counts toward the
    per-record cap (``agent.exporter_max_attempts``), after which the record is dropped and
    counted instead of blocking what is behind it. The default (retryable, not rejected)
    means the peer is away: retried without limit, spooled to disk meanwhile.
    """

    def __init__(self, message: str, *, retryable: bool = True, rejected: bool = False,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.rejected = rejected
        self.retry_after_s = retry_after_s  # the peer asked to wait this long before the next try (Retry-After)


@runtime_checkable
class Exporter(Protocol):
    """A sink. Methods are coroutines; blocking sinks run their I/O in a thread.

    An exporter may also set ``ephemeral = True`` (read with :func:`is_ephemeral`): what it
    shows is for the moment (the console's terminal), so the agent keeps no disk spool of
    undelivered items for it to replay later; and ``live = True`` (:func:`is_live`): it
    serves the current value (a scrape endpoint) rather than recording every item, so it gets
    every device sample while the recording sinks get them at a coarser interval. An
    exporter may define ``async settle(worker)``: an embedded agent awaits it when its session
    ends, before the shutdown, for the exporter to wait (bounded) until ``worker`` delivered
    what it holds (MQTT's ``exit_wait_s``).
    """

    name: str

    async def start(self) -> None:
        """Open connections or files. Must not raise for a peer that is merely away."""

    async def export(self, batch: Sequence[Item]) -> None:
        """Deliver ``batch`` or raise :class:`ExportError`."""

    async def force_flush(self, timeout_s: float) -> bool:
        """Push out anything buffered; True when everything was delivered in time."""

    async def shutdown(self) -> None:
        """Flush what can be flushed and release resources. Idempotent."""

    def state(self) -> dict[str, int | float | str]:
        """Counters and state for ``infersight status`` and the agent's health metrics."""


def is_ephemeral(exporter: Exporter) -> bool:
    """True for a sink whose output only matters now: the agent spools nothing for it."""
    return bool(getattr(exporter, "ephemeral", False))


def is_live(exporter: Exporter) -> bool:
    """True for a sink that serves the current value rather than recording every item."""
    return bool(getattr(exporter, "live", False))
