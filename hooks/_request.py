"""Request latency per device: ``request()`` (stdlib only, Python 3.9+).

    from infersight.hooks import request

    with request(device="cuda:0", model="llama-3-8b", input_len=len(ids)) as r:
        for tok in generate(...):
            r.first_token()            # the first call counts; later ones are free
            yield tok

    @request(device="cuda:1", model="resnet50", request_class="batch8")
    def infer(x): ...

One ``req`` event per request, emitted when it ends::

    {d: "cuda:0" | "cpu" | None, m: model, n: input_len, c: request class,
     s: start (Unix ns), dur: seconds, ttft: seconds or None, sp: current span id,
     err: exception type name or None, h: "GPU-<uuid>" (only when known here),
     hn: device name (with h), vis: CUDA_VISIBLE_DEVICES (only when h is unknown)}

The hook resolves ``h`` only when ``torch.cuda`` is already initialised in this process
(``torch.cuda.get_device_properties(i).uuid``), once per device index; it never
initialises CUDA itself. Otherwise the agent maps ``cuda:N`` through ``vis`` and NVML.

While the hooks are inactive, entering and leaving a request costs one attribute test.
Nothing here raises into user code or blocks: any internal error disables the hooks.
"""

from __future__ import annotations

import contextvars
import os
import sys
import time

from . import _client, _runtime, _state

TYPE_CHECKING = False  # the typing module costs ~10 ms at start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Optional, Tuple, TypeVar
    F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["Request", "first_token", "request"]

_CO_COROUTINE = 0x80  # inspect.CO_COROUTINE, without importing inspect
_MAX_STR = 256

_current: contextvars.ContextVar[Optional[Request]] = contextvars.ContextVar("infersight_request", default=None)
# cuda device index -> (hw.id, hw.name), or None when torch could not say.


def _text(v: Any) -> Optional[str]:
    if v is None:
        return None
    return (v if isinstance(v, str) else str(v))[:_MAX_STR]


def _cuda_initialised() -> Any:
    """The ``torch`` module when CUDA is already initialised in this process, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is not None and cuda.is_initialized():
            return torch
    except Exception:
        return None
    return None


def _device_name(device: Any) -> Optional[str]:
    """``cuda:N`` / ``cpu`` / ``mps`` ... from a string, an int (a CUDA index) or a torch.device."""
    if device is None:
        return None
    if isinstance(device, bool):
        return None
    if isinstance(device, int):
        return "cuda:%d" % device
    if isinstance(device, str):
        d = device.strip()
        if d == "cuda":
            torch = _cuda_initialised()
            if torch is not None:
                return "cuda:%d" % torch.cuda.current_device()
        return d[:64]
    kind = getattr(device, "type", None)  # torch.device, without importing torch
    if isinstance(kind, str):
        index = getattr(device, "index", None)
        if index is None and kind == "cuda":
            return _device_name("cuda")
        return kind if index is None else "%s:%d" % (kind, index)
    return str(device)[:64]


def _hw(device: Optional[str]) -> Optional[Tuple[str, Optional[str]]]:
    """(hw.id, hw.name) of ``cuda:N`` when torch already initialised CUDA; cached per index."""
    if device is None or not device.startswith("cuda:"):
        return None
    try:
        index = int(device[5:])
    except ValueError:
        return None
    cache = _state.current.requests.hw_cache
    if index in cache:
        return cache[index]
    torch = _cuda_initialised()
    if torch is None:
        return None  # not cached: CUDA may be initialised by a later request
    found: Optional[Tuple[str, Optional[str]]] = None
    try:
        props = torch.cuda.get_device_properties(index)
        uuid = str(getattr(props, "uuid", "") or "")
        if uuid:
            found = (uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid, _text(getattr(props, "name", None)))
    except Exception:
        found = None
    cache[index] = found
    return found


def _request_data(
    device: Optional[str], model: Any, n: Any, request_class: Any, start: int, dur_ns: int,
    ttft: Optional[float], sp: Optional[str], err: Optional[str],
) -> Dict[str, Any]:
    """A request's ``req`` event, built on the drain thread from what ``Request`` queued
    (``device``: a name, resolved on the caller's thread where that matters)."""
    d = device.strip()[:64] if device is not None else None
    data: Dict[str, Any] = {
        "d": d,
        "m": _text(model),
        "n": n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None,
        "c": _text(request_class),
        "s": start,
        "dur": dur_ns / 1e9,
        "ttft": ttft,
        "sp": sp,
        "err": err,
    }
    hw = _hw(d)
    if hw is not None:
        data["h"], data["hn"] = hw
    elif d is not None and d.startswith("cuda"):
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        if vis is not None:
            data["vis"] = vis[:1024]
    return data


_client.builders["req"] = _request_data


class Request:
    """One request: a context manager (sync and async) and a decorator.

    ``first_token()`` marks the time to first token of a streamed response.
    """

    __slots__ = ("_args", "_perf", "_sp", "_start", "_token", "_ttft")
    _sp: Optional[str]
    _start: int
    _token: Any
    _ttft: Optional[float]

    def __init__(self, device: Any = None, model: Any = None, input_len: Any = None, request_class: Any = None) -> None:
        # The rest is set on entry while the hooks are active: construction stays cheap.
        self._args = (device, model, input_len, request_class)
        self._perf = 0  # perf_counter_ns at start; 0 while not timing

    # -- timing ----------------------------------------------------------------------

    def __enter__(self) -> Request:
        if _state.current.runtime.client is None:
            return self
        try:
            self._ttft = None
            self._start = time.time_ns()
            self._sp = _runtime.current_span.get()
            self._token = _current.set(self)
            self._perf = time.perf_counter_ns()
        except Exception as exc:
            _runtime.fail(exc)
        return self

    def first_token(self) -> None:
        """The first token (or first body byte) is out. The first call counts."""
        if self._perf and self._ttft is None:
            self._ttft = (time.perf_counter_ns() - self._perf) / 1e9

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._perf:
            return
        end = time.perf_counter_ns()
        try:
            if self._token is not None:
                try:
                    _current.reset(self._token)
                except ValueError:  # left in another context (a generator moved across tasks)
                    pass
            c = _state.current.runtime.client
            if c is not None and c.enabled:
                device, model, n, request_class = self._args
                if device.__class__ is not str or device.strip() == "cuda":
                    device = _device_name(device)  # here: the current CUDA device is this thread's
                # One flat tuple: the drain thread builds the event's dict (``_request_data``).
                event = (next(c._seq), time.time_ns(), "req", device, model, n, request_class, self._start,
                         end - self._perf, self._ttft, self._sp,
                         None if exc_type is None else getattr(exc_type, "__name__", "error"))
                buf = c._buf
                queued = len(buf)
                if 0 < queued < c.calm or c.calm_from <= queued < c.calm_to:
                    buf.append(event)  # c.queue(event), inlined: nothing to wake, spill or drop
                else:
                    c.queue(event)
        except Exception as e:
            _runtime.fail(e)
        finally:
            self._perf = 0
            self._token = None

    async def __aenter__(self) -> Request:
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)

    # -- decorator -------------------------------------------------------------------

    def __call__(self, fn: F) -> F:
        args = self._args
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_flags & _CO_COROUTINE:

            @_runtime.wraps(fn)
            async def awrapper(*a: Any, **kw: Any) -> Any:
                with request(*args):
                    return await fn(*a, **kw)

            return awrapper  # type: ignore[return-value]

        @_runtime.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            with request(*args):
                return fn(*a, **kw)

        return wrapper  # type: ignore[return-value]


_new_request = object.__new__


def request(device: Any = None, model: Any = None, input_len: Any = None, request_class: Any = None) -> Request:
    """Time one request on ``device`` (``"cuda:0"``, ``"cpu"``, a CUDA index or a
    torch.device): a context manager (sync and async) and a decorator. A function that
    makes the ``Request`` without calling ``__init__``: one call per request, not two."""
    r: Request = _new_request(Request)
    r._args = (device, model, input_len, request_class)
    r._perf = 0
    return r


def first_token() -> None:
    """Mark the first token of the innermost request open in this context (thread or task)."""
    r = _current.get()
    if r is not None:
        r.first_token()
