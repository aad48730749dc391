"""PyTorch instrumentation for the cold start (imported only once the user imported torch).

Stdlib only at import: it receives the torch module from the import hook and never
imports torch (or torch._dynamo, safetensors, onnxruntime) itself.

| stage               | what is wrapped                                                          |
| ------------------- | ------------------------------------------------------------------------ |
| `cuda_init`         | `torch.cuda._lazy_init` (looked up at call time by C++ device_lazy_init), |
|                     | with `torch.cuda.is_initialized()` polled at checkpoints as a fallback    |
| `weights_load`      | see ``_weights``: torch/safetensors/transformers loaders, and the deferred |
|                     | read of file-mapped tensors (``load_state_dict`` copy, first forward)      |
| `weights_to_device` | the outermost `nn.Module._apply` that moved bytes from the CPU to a device |
| `graph_compile`     | torch._dynamo start/end callbacks (registered when torch._dynamo loads),  |
|                     | `torch.jit.trace` / `trace_module` / `script`, onnxruntime sessions       |
| `graph_capture`     | CUDA graphs: `torch.cuda.graph` (enter to exit), `CUDAGraph.capture_begin` |
|                     | to `capture_end`, `torch.cuda.make_graphed_callables`; outermost per thread |
| `warmup`, `first_request` | the outermost `nn.Module._call_impl` per thread (a class attribute: |
|                     | dynamo never sees it, so taking it out later causes no recompile)         |

Every wrapper is taken out when the root ends (``_readiness.uninstall``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Dict, Optional, Protocol, Tuple

from . import _contract, _readiness, _runtime, _state
from . import _recorder as cs
from ._recorder import Open
from ._recorder import patch as _patch
from ._recorder import timed as _timed


class WeightsReads(Protocol):
    """What the weights instrumenter (``_weights``, handed in by ``_coldstart``) is told by the
    wrappers here: a move or conversion of tensors that may still map a file, a forward that
    may read them."""

    def move_begin(self, module: Any) -> Any: ...

    def move_attrs(self, token: Any, module: Any, seconds: float, to_device: bool) -> Dict[str, Any]: ...

    def converted(self, o: Open, attrs: Dict[str, Any]) -> bool: ...

    def forward_begin(self, module: Any) -> Any: ...

    def forward_end(self, d: Any, err: Optional[BaseException] = None) -> None: ...


def _torch() -> _state.Torch:
    """This process's torch state (``_state``): the module, the per-thread flags."""
    return _state.current.torch


def _flag(name: str) -> int:
    v: int = getattr(_state.current.torch.tls, name, 0)
    return v


def _compile_describe(api: str) -> Callable[[Tuple[Any, ...], Dict[str, Any]], Dict[str, Any]]:
    def describe(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
        a: Dict[str, Any] = {"infersight.compile.api": api}
        target = args[0] if args else None
        if target is not None:
            a["infersight.compile.target"] = type(target).__name__
        return a

    return describe


# -- graph_compile: dynamo callbacks, onnxruntime ------------------------------------------


def _install_dynamo(mod: Any) -> None:
    handler = getattr(mod, "callback_handler", None)
    if handler is None:
        return

    def on_start(args: Any = None) -> None:
        try:
            if not cs.state().collecting or not cs.root_open():
                return
            a: Dict[str, Any] = {"infersight.compile.api": "torch.compile",
                                 "infersight.compile.backend": _torch().backend}
            a[_CACHE_SNAPSHOT] = _cache_counts()
            cid = getattr(args, "compile_id", None)
            if cid is not None:
                a["infersight.compile.id"] = str(cid)
            trig = getattr(args, "callback_trigger", None)
            if trig is not None:
                a["infersight.compile.trigger"] = str(getattr(trig, "name", trig)).lower()
            stack = _torch().tls.__dict__.setdefault("dynamo", [])
            stack.append(cs.begin("graph_compile", a))
            tls = cs.state().tls
            tls.compile = getattr(tls, "compile", 0) + 1
        except Exception as exc:
            _runtime.fail(exc)

    def on_end(args: Any = None) -> None:
        try:
            stack = _torch().tls.__dict__.get("dynamo")
            if stack:
                tls = cs.state().tls
                tls.compile = max(0, getattr(tls, "compile", 1) - 1)
                o = stack.pop()
                o.attrs.update(cache_attrs(o.attrs.pop(_CACHE_SNAPSHOT, None), _cache_counts()))
                cs.end(o)
        except Exception as exc:
            _runtime.fail(exc)

    handler.register_start_callback(on_start)
    handler.register_end_callback(on_end)

    def undo() -> None:
        for remove, cb in ((handler.remove_start_callback, on_start), (handler.remove_end_callback, on_end)):
            try:
                remove(cb)
            except ValueError:
                pass  # torch._dynamo.reset() clears callbacks

    cs.add_undo(undo)


_CACHE_SNAPSHOT = "_infersight.cache_snapshot"  # internal: popped before the span is emitted


def _cache_counts() -> Optional[Tuple[int, int]]:
    """(hits, misses) of inductor's FX graph cache so far; bypasses compile, so count as misses."""
    utils = _sys_module("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    if counters is None:
        return None
    try:
        ind = counters["inductor"]
        return int(ind["fxgraph_cache_hit"]), int(ind["fxgraph_cache_miss"]) + int(ind["fxgraph_cache_bypass"])
    except Exception:
        return None


def cache_attrs(before: Optional[Tuple[int, int]], after: Optional[Tuple[int, int]]) -> Dict[str, Any]:
    """``infersight.compile.cache`` = hit / miss / mixed from the counters' change (none: no lookup)."""
    if before is None or after is None:
        return {}
    hits, misses = after[0] - before[0], after[1] - before[1]
    if hits <= 0 and misses <= 0:
        return {}
    a: Dict[str, Any] = {"infersight.compile.cache_hits": max(hits, 0),
                         "infersight.compile.cache_misses": max(misses, 0)}
    a[_contract.COMPILE_CACHE] = "mixed" if hits > 0 and misses > 0 else ("hit" if hits > 0 else "miss")
    return a


def _sys_module(name: str) -> Any:
    return sys.modules.get(name)


def _backend_name(backend: Any) -> str:
    if isinstance(backend, str):
        return backend
    return str(getattr(backend, "__name__", None) or type(backend).__name__)


def _wrap_compile(orig: Callable[..., Any]) -> Callable[..., Any]:
    def compile(*args: Any, **kwargs: Any) -> Any:
        try:
            _torch().backend = _backend_name(kwargs.get("backend", "inductor"))
        except Exception as exc:
            _runtime.fail(exc)
        return orig(*args, **kwargs)

    compile.__wrapped__ = orig  # type: ignore[attr-defined]
    compile.__doc__ = getattr(orig, "__doc__", None)
    return compile


def _install_onnxruntime(mod: Any) -> None:
    cls = getattr(mod, "InferenceSession", None)
    if cls is None or "__init__" not in cls.__dict__:
        return
    orig = cls.__init__

    def describe(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
        a: Dict[str, Any] = {"infersight.compile.api": "onnxruntime.InferenceSession"}
        model = args[1] if len(args) > 1 else kwargs.get("path_or_bytes")
        if isinstance(model, (str, os.PathLike)):
            a["infersight.compile.model"] = os.path.abspath(os.fspath(model))
        return a

    _patch(cls, "__init__", _timed("graph_compile", orig, describe, "compile_ort"))


# -- graph_capture: CUDA graphs ------------------------------------------------------------
#
# One stage per outermost capture on a thread: ``torch.cuda.graph``'s ``__enter__`` to its
# ``__exit__`` (the synchronize and cache emptying before the capture belong to it), or a bare
# ``CUDAGraph.capture_begin`` to ``capture_end``, or a whole ``make_graphed_callables`` (its
# warmup iterations and captures). Captures inside it pass through. Forwards run while
# capturing are recorded into the graph, not warmups (the ``compile`` flag, as for tracing).


def _capture_open(api: str) -> None:
    """A capture starts on this thread: push the stage it opens (None when an outer capture
    covers it or nothing is collected)."""
    tls = _torch().tls
    stack = tls.__dict__.setdefault("capture", [])
    o = None
    try:
        if not stack and cs.state().collecting and cs.root_open():
            o = cs.begin("graph_capture", {"infersight.capture.api": api})
            o.attrs[_GRAPHS] = _flag("graphs")
            tls.began = 0
            cst = cs.state().tls
            cst.compile = getattr(cst, "compile", 0) + 1
    except Exception as exc:
        _runtime.fail(exc)
    stack.append(o)


def _capture_close(err: Optional[BaseException] = None) -> None:
    """The capture that ``_capture_open`` pushed ended (``err``: by raising). A capture that
    failed before any graph was captured (no CUDA: a CPU build) leaves no stage."""
    ttls = _torch().tls
    stack = ttls.__dict__.get("capture")
    if not stack:
        return
    o = stack.pop()
    if o is None:
        return
    try:
        tls = cs.state().tls
        tls.compile = max(0, getattr(tls, "compile", 1) - 1)
        graphs = _flag("graphs") - o.attrs.pop(_GRAPHS, 0)
        o.attrs["infersight.capture.graphs"] = graphs
        cs.end(o, err=err, keep=err is None or graphs > 0 or _flag("began") > 0)
        ttls.began = 0
    except Exception as exc:
        _runtime.fail(exc)


_GRAPHS = "_infersight.graphs_before"  # internal: popped before the span is emitted


def _wrap_capture_begin(orig: Callable[..., Any]) -> Callable[..., Any]:
    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not cs.state().collecting:
            return orig(self, *args, **kwargs)
        _capture_open("torch.cuda.CUDAGraph.capture_begin")
        try:
            result = orig(self, *args, **kwargs)
        except BaseException as e:
            _capture_close(e)
            raise
        _torch().tls.began = _flag("began") + 1
        return result

    capture_begin.__wrapped__ = orig  # type: ignore[attr-defined]
    capture_begin.__doc__ = getattr(orig, "__doc__", None)
    return capture_begin


def _wrap_capture_end(orig: Callable[..., Any]) -> Callable[..., Any]:
    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        tls = _torch().tls
        if not tls.__dict__.get("capture"):
            return orig(self, *args, **kwargs)  # no capture_begin of ours is open here
        try:
            result = orig(self, *args, **kwargs)
        except BaseException as e:
            _capture_close(e)
            raise
        tls.graphs = _flag("graphs") + 1
        _capture_close()
        return result

    capture_end.__wrapped__ = orig  # type: ignore[attr-defined]
    capture_end.__doc__ = getattr(orig, "__doc__", None)
    return capture_end


def _wrap_graph_enter(orig: Callable[..., Any]) -> Callable[..., Any]:
    def __enter__(self: Any) -> Any:  # noqa: N807
        if not cs.state().collecting:
            return orig(self)
        _capture_open("torch.cuda.graph")
        try:
            return orig(self)
        except BaseException as e:
            _capture_close(e)
            raise

    __enter__.__wrapped__ = orig  # type: ignore[attr-defined]
    return __enter__


def _wrap_graph_exit(orig: Callable[..., Any]) -> Callable[..., Any]:
    def __exit__(self: Any, *args: Any) -> Any:  # noqa: N807
        if not _torch().tls.__dict__.get("capture"):
            return orig(self, *args)
        try:
            result = orig(self, *args)
        except BaseException as e:
            _capture_close(e)
            raise
        raised = args[1] if len(args) > 1 and isinstance(args[1], BaseException) else None
        _capture_close(raised)  # the captured body raised: the stage says so
        return result

    __exit__.__wrapped__ = orig  # type: ignore[attr-defined]
    return __exit__


def _wrap_graphed_callables(orig: Callable[..., Any]) -> Callable[..., Any]:
    def make_graphed_callables(*args: Any, **kwargs: Any) -> Any:
        if not cs.state().collecting:
            return orig(*args, **kwargs)
        _capture_open("torch.cuda.make_graphed_callables")
        try:
            result = orig(*args, **kwargs)
        except BaseException as e:
            _capture_close(e)
            raise
        _capture_close()
        return result

    make_graphed_callables.__wrapped__ = orig  # type: ignore[attr-defined]
    make_graphed_callables.__name__ = getattr(orig, "__name__", "make_graphed_callables")
    make_graphed_callables.__doc__ = getattr(orig, "__doc__", None)
    return make_graphed_callables


def _install_graphs(mod: Any) -> None:
    """Wrap ``torch.cuda.graphs`` (the module torch.cuda re-exports them from)."""
    cls = getattr(mod, "CUDAGraph", None)
    if cls is not None and "capture_begin" in cls.__dict__ and "capture_end" in cls.__dict__:
        _patch(cls, "capture_begin", _wrap_capture_begin(cls.capture_begin))
        _patch(cls, "capture_end", _wrap_capture_end(cls.capture_end))
    ctx = getattr(mod, "graph", None)
    if isinstance(ctx, type) and "__enter__" in ctx.__dict__ and "__exit__" in ctx.__dict__:
        _patch(ctx, "__enter__", _wrap_graph_enter(ctx.__dict__["__enter__"]))
        _patch(ctx, "__exit__", _wrap_graph_exit(ctx.__dict__["__exit__"]))
    orig = getattr(mod, "make_graphed_callables", None)
    if callable(orig):
        wrapped = _wrap_graphed_callables(orig)
        _patch(mod, "make_graphed_callables", wrapped)
        cuda = sys.modules.get("torch.cuda")
        if cuda is not None and getattr(cuda, "make_graphed_callables", None) is orig:
            _patch(cuda, "make_graphed_callables", wrapped)


# -- weights_to_device and cuda_init --------------------------------------------------------


def _tensor_bytes(module: Any) -> Tuple[int, int, str]:
    """(bytes on the CPU, bytes on a device, the first device seen) over params and buffers."""
    cpu = dev = 0
    where = ""
    for group in (module.parameters(), module.buffers()):
        for t in group:
            kind = t.device.type
            n = t.numel() * t.element_size()
            if kind == "cpu":
                cpu += n
            elif kind != "meta":
                dev += n
                if not where:
                    where = str(t.device)
    return cpu, dev, where


def _make_apply(orig: Callable[..., Any], weights: WeightsReads) -> Callable[..., Any]:
    def _apply(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        o = mapped = None
        tls = _torch().tls
        try:
            if cs.state().collecting and not _flag("apply") and cs.root_open():
                cpu0, dev0, _ = _tensor_bytes(self)
                if cpu0:
                    o = cs.begin("weights_to_device")
                    mapped = weights.move_begin(self)  # still-mapped weights: this move reads them
                    tls.apply = 1
                    t0 = time.perf_counter()
        except Exception as exc:
            _runtime.fail(exc)
        if o is None:
            return orig(self, fn, *args, **kwargs)
        try:
            result = orig(self, fn, *args, **kwargs)
        except BaseException as e:
            tls.apply = 0
            cs.end(o, err=e, keep=False)
            raise
        tls.apply = 0
        try:
            seconds = time.perf_counter() - t0
            _cpu1, dev1, where = _tensor_bytes(self)
            moved = dev1 - dev0
            if moved > 0:
                o.attrs.update(cs.weights_attrs("", moved, seconds))
                o.attrs.update(weights.move_attrs(mapped, self, seconds, True))
                o.attrs["infersight.weights.device"] = where
                o.attrs["infersight.weights.module"] = type(self).__name__
                _poll_cuda(o.start, o.span)
                cs.end(o)
            elif mapped is not None and weights.converted(o, weights.move_attrs(mapped, self, seconds, False)):
                cs.end(o)  # a dtype change that read file-mapped weights: a deferred weights_load
            else:
                cs.end(o, keep=False)  # a dtype change or a move back to the CPU
        except Exception as exc:
            _runtime.fail(exc)
        return result

    return _apply


def _make_lazy_init(orig: Callable[[], None]) -> Callable[[], None]:
    def _lazy_init() -> None:
        ts = _torch()
        o = None
        try:
            # torch's _lazy_init runs its queued calls (seeds, device properties) before it marks CUDA
            # initialised, and they call _lazy_init again on this thread: one cuda_init, the outer call's
            if (cs.state().collecting and not ts.cuda_seen and not getattr(ts.tls, "cuda_init_open", False)
                    and not ts.module.cuda.is_initialized() and cs.root_open()):
                o = cs.begin("cuda_init", {"infersight.cuda_init.detected_by": "lazy_init"})
        except Exception as exc:
            _runtime.fail(exc)
        if o is None:
            return orig()
        ts.tls.cuda_init_open = True
        try:
            orig()
        except BaseException:
            cs.end(o, keep=False)  # no CUDA here (a CPU build, no driver): nothing was initialised
            raise
        finally:
            ts.tls.cuda_init_open = False
        ts.cuda_seen = True
        try:
            o.attrs["infersight.cuda.device_count"] = int(ts.module.cuda.device_count())
        except Exception:
            pass
        cs.end(o)
        return None

    return _lazy_init


def _poll_cuda(window_start: int, parent: Optional[str] = None) -> None:
    """Fallback: CUDA initialised without our wrapper seeing it (e.g. a saved reference)."""
    ts = _torch()
    if ts.cuda_seen or ts.module is None:
        return
    cuda = getattr(ts.module, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return
    except Exception:
        return
    ts.cuda_seen = True
    now = time.time_ns()
    cs.emit_stage("cuda_init", _runtime.new_span_id(), parent or _runtime.state().root_span_id,
                  min(window_start, now), now, {"infersight.cuda_init.detected_by": "poll"})


# -- forwards: warmup and first_request -----------------------------------------------------


def _make_call_impl(orig: Callable[..., Any], is_compiling: Callable[[], bool],
                    weights: WeightsReads) -> Callable[..., Any]:
    def _call_impl(self: Any, *args: Any, **kwargs: Any) -> Any:
        hs = _state.current
        if not hs.coldstart.collecting or is_compiling():
            return orig(self, *args, **kwargs)
        tls = hs.torch.tls
        depth = getattr(tls, "depth", 0)
        tls.depth = depth + 1
        token = None
        if not depth:
            try:
                token = _readiness.forward_begin()
                if token is not None and token[0] == "w" and token[1].n == 1:
                    _poll_cuda(token[1].start)
            except Exception as exc:
                _runtime.fail(exc)
        deferred = weights.forward_begin(self) if not depth and hs.weights.mapped else None
        try:
            return orig(self, *args, **kwargs)
        finally:
            tls.depth = depth
            weights.forward_end(deferred)
            if token is not None:
                try:
                    _readiness.forward_end(token)
                except Exception as exc:
                    _runtime.fail(exc)

    return _call_impl


def install(torch: Any, weights: WeightsReads) -> None:
    """Wrap what torch offers now; hook torch._dynamo, onnxruntime for later. ``weights``
    (``_weights``) is told of moves and forwards; ``_coldstart`` installs it, and
    ``_build``'s torch parts, beside."""
    if not cs.state().collecting:
        return
    _torch().module = torch
    jit = getattr(torch, "jit", None)
    if jit is not None:
        for name in ("trace", "trace_module", "script"):
            if hasattr(jit, name):
                _patch(jit, name, _timed_compile(getattr(jit, name), "torch.jit." + name))
    nn_module = getattr(getattr(torch, "nn", None), "Module", None)
    if nn_module is not None:
        compiler = getattr(torch, "compiler", None)
        is_compiling = getattr(compiler, "is_compiling", None) or (lambda: False)
        _patch(nn_module, "_call_impl", _make_call_impl(nn_module._call_impl, is_compiling, weights))
        _patch(nn_module, "_apply", _make_apply(nn_module._apply, weights))
    if callable(getattr(torch, "compile", None)):
        _patch(torch, "compile", _wrap_compile(torch.compile))
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and hasattr(cuda, "_lazy_init"):
        try:
            initialized = bool(cuda.is_initialized())
        except Exception:
            initialized = True
        if not initialized:
            _patch(cuda, "_lazy_init", _make_lazy_init(cuda._lazy_init))
    cs.state().callbacks["ready"] = _poll_cuda
    cs.on_import("torch._dynamo", _install_dynamo)
    cs.on_import("torch.cuda.graphs", _install_graphs)
    cs.on_import("onnxruntime", _install_onnxruntime)


def _timed_compile(orig: Callable[..., Any], api: str) -> Callable[..., Any]:
    inner = _timed("graph_compile", orig, _compile_describe(api), "jit")

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Forwards run by the tracer belong to graph_compile, not to warmup.
        tls = cs.state().tls
        tls.compile = getattr(tls, "compile", 0) + 1
        try:
            return inner(*args, **kwargs)
        finally:
            tls.compile = max(0, getattr(tls, "compile", 1) - 1)

    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(orig, "__name__", "wrapper")
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    return wrapper
