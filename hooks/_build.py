"""``model_build`` and ``tokenizer_load`` (stdlib only; imported once torch or transformers is).

| stage            | what is timed                                                           |
| ---------------- | ----------------------------------------------------------------------- |
| `model_build`    | a transformers model's construction: ``PreTrainedModel.__init__`` up to   |
|                  | the end of that object's ``post_init()`` (outermost model only); else a   |
|                  | run of ``torch.nn.init.*`` calls (``reset_parameters``, random init)      |
|                  | outside any other stage and import, merged while gaps stay < 20 ms        |
| `tokenizer_load` | ``AutoTokenizer``/``AutoProcessor``/``PreTrainedTokenizerBase``           |
|                  | ``.from_pretrained``, sentencepiece ``Load``/``LoadFromFile``             |

Construction under ``torch.device("meta")`` (as ``from_pretrained`` does) is a
``model_build`` with ``infersight.model.meta=true``.
"""

from __future__ import annotations

import sys
import threading
import time

from . import _recorder as cs
from . import _runtime, _state
from ._recorder import patch as _patch
from ._recorder import timed as _timed

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

    from ._state import Build

INIT_GAP_NS = 20_000_000
MIN_RUN_NS = 2_000_000
INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)



def _build() -> Build:
    """This process's state here (``_state``): the open ``nn.init`` runs, per-thread builds."""
    return _state.current.build


def _patch_raw(cls: Any, name: str, new: Any) -> Any:
    """Replace ``cls.__dict__[name]`` (a classmethod, say) and put the raw object back on undo."""
    orig = cls.__dict__[name]
    setattr(cls, name, new)

    def undo() -> None:
        if cls.__dict__.get(name) is new:
            setattr(cls, name, orig)

    cs.add_undo(undo)
    return orig


# -- model_build: transformers models -------------------------------------------------------


def _importing() -> bool:
    return bool(_state.current.imports.thread().stack)


def _open_build(model: Any) -> None:
    tls = _build().tls
    if getattr(tls, "build", None) is not None or not cs.state().collecting or not cs.root_open():
        return
    o = cs.begin("model_build", {"infersight.model.class": type(model).__name__,
                                 "infersight.model.api": "transformers"})
    tls.build = (o, id(model))


def _close_build(model: Any, err: Optional[BaseException] = None) -> None:
    tls = _build().tls
    b = getattr(tls, "build", None)
    if b is None or b[1] != id(model):
        return
    tls.build = None
    o = b[0]
    try:
        n = 0
        meta = False
        for p in model.parameters():
            n += p.numel()
            meta = meta or p.device.type == "meta"
        o.attrs["infersight.model.parameters"] = n
        if meta:
            o.attrs["infersight.model.meta"] = True
    except Exception:
        pass
    cs.end(o, err=err)


def _install_modeling(mu: Any) -> None:
    cls = getattr(mu, "PreTrainedModel", None)
    if cls is None or "__init__" not in cls.__dict__ or "post_init" not in cls.__dict__:
        return
    orig_init = cls.__dict__["__init__"]
    orig_post = cls.__dict__["post_init"]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        try:
            _open_build(self)
        except Exception as exc:
            _runtime.fail(exc)
        try:
            return orig_init(self, *args, **kwargs)
        except BaseException as e:
            _close_build(self, e)
            raise

    def post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return orig_post(self, *args, **kwargs)
        finally:
            try:
                _close_build(self)
            except Exception as exc:
                _runtime.fail(exc)

    for fn, orig in ((__init__, orig_init), (post_init, orig_post)):
        fn.__wrapped__ = orig  # type: ignore[attr-defined]
        fn.__doc__ = orig.__doc__
        fn.__qualname__ = orig.__qualname__
    _patch(cls, "__init__", __init__)
    _patch(cls, "post_init", post_init)


# -- model_build: runs of torch.nn.init -----------------------------------------------------


def _note_init(t0: int, t1: int) -> None:
    ident = threading.get_ident()
    parent = _runtime.current_span.get() or _runtime.state().root_span_id
    st = cs.state()
    bs = _build()
    seq, imp = st.stage_mark, st.imports
    # Import runs and init runs on one thread must not overlap without nesting: an init run is
    # not extended across an import piece, and a new one ends the import run open before it.
    imported_until = imp.thread_run_end() if imp is not None else 0  # read before taking bs.lock
    done = None
    with bs.lock:
        run = bs.init_runs.get(ident)
        if (run is not None and run[0] == parent and run[4] == seq and t0 - run[2] <= INIT_GAP_NS
                and imported_until <= run[2]):
            run[2] = t1
            run[3] += 1
            return
        done = run
        bs.init_runs[ident] = [parent, t0, t1, 1, seq, _runtime.new_span_id()]
    if done is not None:
        _emit_init_run(done)
    if imp is not None:
        imp.flush(this_thread_only=True)


def _init_attrs(calls: int) -> Dict[str, Any]:
    return {"infersight.model.api": "torch.nn.init", "infersight.model.init_calls": calls}


def _emit_init_run(run: list) -> None:  # type: ignore[type-arg]
    parent, start, end, calls, _seq, span = run
    if end - start < MIN_RUN_NS:
        return
    cs.emit_stage("model_build", span, parent, start, end, _init_attrs(calls))


def open_runs() -> List[Tuple[str, str, str, int, int, Dict[str, Any]]]:
    """(Sampler thread) The ``nn.init`` runs not emitted yet, as ``_imports.open_runs``."""
    bs = _build()
    with bs.lock:
        runs = [list(r) for r in bs.init_runs.values()]
    return [("model_build", span, parent, start, end, _init_attrs(calls))
            for parent, start, end, calls, _seq, span in runs if end - start >= MIN_RUN_NS]


def _wrap_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tls = _build().tls
        if (not cs.state().collecting or getattr(tls, "in_init", False) or getattr(tls, "build", None) is not None
                or _runtime.current_span.get() not in (None, _runtime.state().root_span_id) or _importing()):
            return orig(*args, **kwargs)
        tls.in_init = True
        t0 = time.time_ns()
        try:
            return orig(*args, **kwargs)
        finally:
            tls.in_init = False
            try:
                _note_init(t0, time.time_ns())
            except Exception as exc:
                _runtime.fail(exc)

    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(orig, "__name__", "wrapper")
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    return wrapper


def install_torch(torch: Any) -> None:
    """Once torch is imported: runs of ``torch.nn.init`` calls are ``model_build``."""
    bs = _build()
    if bs.torch_done:
        return
    bs.torch_done = True
    cs.add_run_source(flush, open_runs)
    init = getattr(getattr(torch, "nn", None), "init", None)
    if init is None:
        return
    for name in INIT_FUNCTIONS:
        if callable(getattr(init, name, None)):
            _patch(init, name, _wrap_init(getattr(init, name)))


def flush(end_ns: int, final: bool = False) -> None:
    """Readiness or the root's end: emit the open ``nn.init`` runs; at the end, close a
    model_build left open (its ``post_init`` never came)."""
    bs = _build()
    with bs.lock:
        runs = list(bs.init_runs.values())
        bs.init_runs.clear()
    for run in runs:
        _emit_init_run(run)
    b = getattr(bs.tls, "build", None)
    if b is not None and final:
        bs.tls.build = None
        cs.end(b[0], end_ns=end_ns)


# -- tokenizer_load ----------------------------------------------------------------------


def _tok_describe(api: str) -> Callable[[Tuple[Any, ...], Dict[str, Any]], Dict[str, Any]]:
    def describe(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
        a: Dict[str, Any] = {"infersight.tokenizer.api": api}
        src = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if isinstance(src, str):
            a["infersight.tokenizer.source"] = src
        return a

    return describe


def _wrap_classmethod(cls: Any, name: str, api: str) -> None:
    raw = cls.__dict__.get(name)
    func = getattr(raw, "__func__", None)
    if func is None:
        return
    describe = _tok_describe(api)
    if isinstance(raw, classmethod):
        def call(klass: Any, *args: Any, **kwargs: Any) -> Any:
            return func(klass, *args, **kwargs)

        timed = _timed("tokenizer_load", call, lambda a, k: describe(a[1:], k), "tokenizer")
        timed.__doc__ = func.__doc__
        _patch_raw(cls, name, classmethod(timed))
    elif isinstance(raw, staticmethod):
        _patch_raw(cls, name, staticmethod(_timed("tokenizer_load", func, describe, "tokenizer")))


def _install_tok_base(mod: Any) -> None:
    cls = getattr(mod, "PreTrainedTokenizerBase", None)
    if cls is not None:
        _wrap_classmethod(cls, "from_pretrained", "transformers.%s.from_pretrained" % cls.__name__)


def _install_auto(attr: str) -> Callable[[Any], None]:
    def install(mod: Any) -> None:
        cls = getattr(mod, attr, None)
        if cls is not None:
            _wrap_classmethod(cls, "from_pretrained", "transformers.%s.from_pretrained" % attr)

    return install


def install_sentencepiece(mod: Any) -> None:
    cls = getattr(mod, "SentencePieceProcessor", None)
    if cls is None:
        return
    for name in ("Load", "LoadFromFile"):
        if name in cls.__dict__:
            _patch(cls, name, _timed("tokenizer_load", cls.__dict__[name], _sp_describe(name), "tokenizer"))


def _install_tokenizers(mod: Any) -> None:
    """``tokenizers.Tokenizer.from_file`` / ``from_pretrained``: staticmethods of a native type
    that cannot be subclassed, but whose attributes can be replaced."""
    cls = getattr(mod, "Tokenizer", None)
    if cls is None:
        return
    for name in ("from_file", "from_pretrained"):
        try:
            _wrap_classmethod(cls, name, "tokenizers.Tokenizer." + name)
        except (TypeError, AttributeError):  # a build whose type is immutable: no hook, no fault
            continue


def _sp_describe(name: str) -> Callable[[Tuple[Any, ...], Dict[str, Any]], Dict[str, Any]]:
    def describe(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
        return {"infersight.tokenizer.api": "sentencepiece." + name}

    return describe


def install_hf() -> None:
    """transformers or tokenizers was imported: hook the modules that hold the entry points."""
    bs = _build()
    if bs.hf_done:
        return
    bs.hf_done = True
    cs.add_run_source(flush, open_runs)  # a model_build left open is closed at the end
    cs.on_import("transformers.modeling_utils", _install_modeling)
    cs.on_import("transformers.tokenization_utils_base", _install_tok_base)
    cs.on_import("transformers.models.auto.tokenization_auto", _install_auto("AutoTokenizer"))
    cs.on_import("transformers.models.auto.processing_auto", _install_auto("AutoProcessor"))
    tok = sys.modules.get("tokenizers")
    if tok is not None and getattr(tok, "Tokenizer", None) is not None:
        _install_tokenizers(tok)  # we run from tokenizers' own post-import callback
    else:
        cs.on_import("tokenizers", _install_tokenizers)
