"""Blocking calls that may never return (a driver that stopped answering), run off the event loop.

``asyncio.to_thread`` runs a call on the loop's default executor, whose threads the interpreter
joins at exit: one NVML call stuck in the driver would keep the agent from ever exiting. A call
here gets a daemon thread of its own, and the caller waits for it with a deadline
(:func:`within`), going on without the result when it is late.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from infersight.agent.errors import AgentError

T = TypeVar("T")

MAX_CALLS_OUT = 64  # capped calls on their own threads at once (a storm of OOMs while NVML hangs): past it, refused
_out = [0]
_out_lock = threading.Lock()


class TooManyCallsError(AgentError):
    """MAX_CALLS_OUT calls are out and have not returned: this one is not started."""


def in_daemon_thread(fn: Callable[[], T], name: str, capped: bool = False) -> asyncio.Future[T]:
    """``fn()`` on a daemon thread of its own, as a future of the running loop. A result that comes
    after the loop closed is dropped; an exception nobody awaits is retrieved (no "never retrieved" log).
    ``capped`` (calls made per event, as an OOM's reads): with MAX_CALLS_OUT of them out already, the
    future holds :class:`TooManyCallsError` at once. The device job's own calls, one at a time, are not."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()
    fut.add_done_callback(_retrieve)
    if capped:
        with _out_lock:
            full = _out[0] >= MAX_CALLS_OUT
            if not full:
                _out[0] += 1
        if full:
            fut.set_exception(TooManyCallsError("%d calls are out and have not returned" % MAX_CALLS_OUT))
            return fut

    def settle(value: T | None, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)  # type: ignore[arg-type]

    def run() -> None:
        try:
            value, exc = fn(), None
        except BaseException as e:  # handed to the awaiting side, whatever it is
            value, exc = None, e
        finally:
            if capped:
                with _out_lock:
                    _out[0] -= 1
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # the loop closed while the call was out
            pass

    try:
        threading.Thread(target=run, name=name, daemon=True).start()
    except RuntimeError as exc:  # can't start new thread (the limit of threads or memory)
        if capped:
            with _out_lock:
                _out[0] -= 1
        fut.set_exception(exc)
    return fut


async def within(fut: asyncio.Future[T], timeout_s: float) -> tuple[bool, T | None]:
    """``(True, result)`` when ``fut`` is done within ``timeout_s`` (its exception raised), else
    ``(False, None)`` with ``fut`` left running (never cancelled: its thread cannot be stopped)."""
    done, _ = await asyncio.wait({fut}, timeout=timeout_s)
    if not done:
        return False, None
    return True, fut.result()


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
