"""Weights loads, measured as they really happen (stdlib only; ctypes only once a load runs).

A weights span must describe a read of the file, over the time the bytes were really read:

- **eager** loads copy the file into memory inside the call (``torch.load`` without ``mmap``,
  ``torch.jit.load``, a ``pread`` safetensors backend): ``bytes_per_s`` = file bytes / call time;
- **lazy** loads return tensors that map the file (``safetensors`` ``load_file``/``safe_open``
  with the default mmap backend, ``torch.load(mmap=True)``, transformers 5's ``from_pretrained``).
  Their span says ``lazy=true`` and carries no throughput: the bytes are read later, when the
  tensors are first touched. That later read is a span too (``api="deferred"``): an outermost
  ``nn.Module.load_state_dict`` that copies mapped tensors, or the first forward of a module
  whose parameters still map the file (``load_state_dict(assign=True)``, transformers);
- a header-only read (``safe_open`` with no tensor taken, ``get_slice`` shapes/dtypes) or a
  meta-device load (``map_location="meta"``) is not a weights span at all.

Every span says how warm the page cache was when the read began (``page_cache_ratio``, from
``mincore`` on a mapping of the file), what the kernel really fetched (``read_bytes`` from
``/proc/self/io``, ``major_faults``), and compares with the storage ceiling only for a cold read.

Nothing here raises into user code: every wrapper catches its own errors and calls ``_runtime.fail``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from . import _contract, _runtime, _state
from . import _recorder as cs
from ._pagestate import (
    file_key,
    file_mappings,
    major_faults,
    mappings_of,
    page_cache_ratio,
    present_bytes,
    read_bytes,
)

COLD_BELOW = _contract.COLD_BELOW



def _weights() -> _state.Weights:
    """This process's state here (``_state``): the files whose tensors still map them (cleared
    at the root's end), the modules a first forward looked at, the torch module."""
    return _state.current.weights


# -- the span attributes (pure) ----------------------------------------------------------


def read_attrs(
    api: str,
    path: str,
    nbytes: int,
    seconds: Optional[float],
    lazy: bool,
    ratio: Optional[float],
    read_delta: Optional[int],
    fault_delta: Optional[int],
    ceiling: Optional[float] = None,
) -> Dict[str, Any]:
    """``infersight.weights.*`` for one read. ``seconds`` None: no real reading time (lazy)."""
    a: Dict[str, Any] = {"infersight.weights.api": api, _contract.WEIGHTS_LAZY: bool(lazy)}
    if path:
        a[_contract.WEIGHTS_PATH] = path
    a[_contract.WEIGHTS_BYTES] = max(0, int(nbytes))
    if read_delta is not None:
        a["infersight.weights.read_bytes"] = max(0, read_delta)
    if fault_delta is not None:
        a["infersight.weights.major_faults"] = max(0, fault_delta)
    if ratio is not None:
        a[_contract.WEIGHTS_PAGE_CACHE_RATIO] = round(ratio, 4)
    if seconds is not None and seconds > 0 and nbytes > 0:
        rate = nbytes / seconds
        a[_contract.WEIGHTS_BYTES_PER_S] = rate
        if ceiling and ratio is not None and ratio < COLD_BELOW:
            a["infersight.weights.storage_ceiling_bytes_per_s"] = ceiling
            a[_contract.WEIGHTS_CEILING_RATIO] = rate / ceiling
    return a


class _Probe:
    """Counters at the start of a read; ``attrs`` turns them into the span's attributes."""

    __slots__ = ("done_ns", "elapsed", "faults", "paths", "ratio", "read", "t0")

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = [p for p in paths if p]
        self.ratio = page_cache_ratio(self.paths) if self.paths else None  # before the clock starts
        self.read = read_bytes()
        self.faults = major_faults()
        self.elapsed: Optional[float] = None
        self.done_ns: Optional[int] = None
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        """The read returned: its time, and where its span ends (what follows is our bookkeeping)."""
        self.elapsed = time.perf_counter() - self.t0
        self.done_ns = time.time_ns()

    def attrs(self, api: str, nbytes: int, lazy: bool, seconds: Optional[float] = None,
              path: str = "") -> Dict[str, Any]:
        elapsed = time.perf_counter() - self.t0 if self.elapsed is None else self.elapsed
        r1, f1 = read_bytes(), major_faults()
        path = path or (self.paths[0] if len(self.paths) == 1 else os.path.dirname(self.paths[0])
                        if self.paths else "")
        secs = None if lazy else (elapsed if seconds is None else seconds)
        ceiling = cs.storage_ceiling(self.paths[0]) if self.paths and secs else None
        return read_attrs(api, path, nbytes, secs, lazy, self.ratio,
                          r1 - self.read if r1 is not None and self.read is not None else None,
                          f1 - self.faults if f1 is not None and self.faults is not None else None, ceiling)


# -- tensors and the files they map ------------------------------------------------------


class _Mapped:
    """A file that tensors returned by a lazy load still map: its identity and where."""

    __slots__ = ("key", "path", "ranges")

    def __init__(self, path: str, key: Tuple[str, str], ranges: List[Tuple[int, int]]) -> None:
        self.path = path
        self.key = key
        self.ranges = ranges

    def holds(self, ptr: int) -> bool:
        return any(lo <= ptr < hi for lo, hi in self.ranges)

    def still_mapped(self, maps: Dict[Tuple[str, str], List[Tuple[int, int]]]) -> bool:
        """The address space may have changed since the load: are our ranges still this file?"""
        now = maps.get(self.key, [])
        return all(any(lo <= a and b <= hi for lo, hi in now) for a, b in self.ranges)


def _tensors(obj: Any, depth: int = 0) -> Iterator[Any]:
    """The tensors in a load's result: a dict/list/tuple of them, or a module's params and buffers."""
    tensor = _weights().module.Tensor
    if isinstance(obj, tensor):
        yield obj
    elif isinstance(obj, dict):
        if depth < 3:
            for v in obj.values():
                yield from _tensors(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        if depth < 3:
            for v in obj:
                yield from _tensors(v, depth + 1)
    elif isinstance(obj, _weights().module.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()


def _extent(t: Any) -> Tuple[int, int]:
    """(address on the CPU or 0, bytes) of a tensor's data; (0, 0) on the meta device."""
    try:
        kind = t.device.type
        if kind == "meta":
            return 0, 0
        return (int(t.data_ptr()) if kind == "cpu" else 0), int(t.numel()) * int(t.element_size())
    except Exception:
        return 0, 0


def _all_meta(tensors: List[Any]) -> bool:
    return bool(tensors) and all(getattr(t, "is_meta", False) for t in tensors)


def _remember(path: str, key: Tuple[str, str], used: List[Tuple[int, int]]) -> None:
    m = _Mapped(path, key, used)
    ws = _weights()
    with ws.lock:  # a mapping at the same addresses as an older one replaces it
        ws.mapped[:] = [old for old in ws.mapped
                      if not any(lo < h and l0 < hi for lo, hi in used for l0, h in old.ranges)]
        ws.mapped.append(m)


def _any_in(sorted_ptrs: List[int], lo: int, hi: int) -> bool:
    import bisect

    i = bisect.bisect_left(sorted_ptrs, lo)
    return i < len(sorted_ptrs) and sorted_ptrs[i] < hi


def _register(paths: Sequence[str], tensors: List[Any]) -> bool:
    """Note which of ``tensors`` map one of ``paths``; True if any does (the load was lazy)."""
    lazy = False
    ptrs = sorted(p for p in (_extent(t)[0] for t in tensors) if p)
    keys = [file_key(p) for p in paths]
    maps = mappings_of(keys)
    for i, path in enumerate(paths):  # no zip(strict=): the hooks run on Python 3.9
        key = keys[i]
        if key is None:
            continue
        used = [(lo, hi) for lo, hi in maps.get(key, []) if _any_in(ptrs, lo, hi)]
        if used:
            lazy = True
            _remember(path, key, used)
    return lazy


def _mapped_chunks(tensors: Iterator[Any]) -> Tuple[List[Tuple[int, int]], List[_Mapped]]:
    """(address ranges of the tensors that map a registered file, those files)."""
    ws = _weights()
    with ws.lock:
        files = list(ws.mapped)
    if not files:
        return [], []
    chunks: List[Tuple[int, int, _Mapped]] = []
    seen = set()
    for t in tensors:
        ptr, n = _extent(t)
        if not n or not ptr or ptr in seen:
            continue
        for m in files:
            if m.holds(ptr):
                seen.add(ptr)
                chunks.append((ptr, n, m))
                break
    hit = []
    found = list({id(c[2]): c[2] for c in chunks}.values())
    maps = mappings_of([m.key for m in found])
    for m in found:
        if m.still_mapped(maps):
            hit.append(m)
        else:
            with ws.lock:
                if m in ws.mapped:
                    ws.mapped.remove(m)
    return [(p, n) for p, n, m in chunks if m in hit], hit


# -- deferred reads: load_state_dict copies, first forwards --------------------------------


class _Deferred:
    """A read of file-mapped tensors in progress: a ``load_state_dict`` copy or a first forward.

    A copy reads every mapped byte it is given, at most at memcpy speed: its throughput is real.
    A forward reads through page faults amid its compute: the bytes are those it faulted in
    (pagemap), and the time is a throughput only when the disk dominated (a cold read).
    """

    __slots__ = ("by", "chunks", "files", "o", "present0", "probe")

    def __init__(self, by: str, chunks: List[Tuple[int, int]], files: List[_Mapped], present0: Optional[int]) -> None:
        self.by = by
        self.chunks = chunks
        self.files = files
        self.present0 = present0
        self.probe = _Probe([m.path for m in files])
        self.o = cs.begin("weights_load")

    def finish(self, err: Optional[BaseException] = None) -> None:
        mapped = sum(n for _, n in self.chunks)
        nbytes = mapped
        seconds: Optional[float] = None  # the whole call
        if self.by == "forward":
            present1 = present_bytes(self.chunks)
            if present1 is not None and self.present0 is not None:
                nbytes = max(0, min(mapped, present1 - self.present0))
            ratio = self.probe.ratio
            if ratio is None or ratio >= COLD_BELOW:
                seconds = 0.0  # warm: page faults amid compute, no reading time to divide by
        attrs = self.probe.attrs("deferred", nbytes, False, seconds=seconds)
        attrs["infersight.weights.deferred_by"] = self.by
        attrs["infersight.weights.mapped_bytes"] = mapped
        if len(self.files) > 1:
            attrs["infersight.weights.files"] = len(self.files)
        cs.end(self.o, attrs, err=err)


def _deferred_begin(by: str, tensors: Iterator[Any]) -> Optional[_Deferred]:
    """A deferred-read span if ``tensors`` map a registered file (a forward: pages not in yet)."""
    chunks, files = _mapped_chunks(tensors)
    if not chunks:
        return None
    present0 = None
    if by == "forward":
        present0 = present_bytes(chunks)
        if present0 is not None and present0 >= sum(n for _, n in chunks):
            return None  # every page already faulted in: this forward reads nothing of the file
    return _Deferred(by, chunks, files, present0)


def forward_begin(module: Any) -> Optional[_Deferred]:
    """At an outermost forward: the first one of a module that still maps weights reads them."""
    try:
        if not _weights().mapped or not cs.root_open() or _flag() or cs.state().tls.__dict__.get("compile", 0):
            return None  # a forward run by jit.trace or a compiler: its ops would be recorded
        tracing = getattr(getattr(_weights().module, "jit", None), "is_tracing", None)
        if tracing is not None and tracing():
            return None
        key = id(module)
        scanned = _weights().scanned
        if key in scanned:
            return None
        scanned[key] = True
        d = _deferred_begin("forward", _tensors(module))
        if d is not None:
            _weights().tls.busy = 1
        return d
    except Exception as exc:
        _runtime.fail(exc)
        return None


def forward_end(d: Optional[_Deferred], err: Optional[BaseException] = None) -> None:
    if d is None:
        return
    _weights().tls.busy = 0
    try:
        d.finish(err)
    except Exception as exc:
        _runtime.fail(exc)


def move_begin(module: Any) -> Optional[Tuple[_Probe, int]]:
    """Before an outermost ``nn.Module._apply`` (``.to(device)``, ``.half()``): the bytes of the
    module's tensors that still map a file, which the move or conversion is about to read."""
    try:
        if not _weights().mapped:
            return None
        chunks, files = _mapped_chunks(_tensors(module))
        if not chunks:
            return None
        return _Probe([m.path for m in files]), sum(n for _, n in chunks)
    except Exception as exc:
        _runtime.fail(exc)
        return None


def move_attrs(token: Optional[Tuple[_Probe, int]], module: Any, seconds: float, to_device: bool) -> Dict[str, Any]:
    """After it: what was read of the mapped files (nothing if the tensors still map them).

    A move to a device keeps its own bytes and throughput and gains where the bytes came from;
    a conversion on the CPU (returned as a whole deferred-read attribute set) is that read.
    """
    if token is None:
        return {}
    try:
        probe, before = token
        after = sum(n for _, n in _mapped_chunks(_tensors(module))[0])
        if before - after <= 0:
            return {}  # a no-op conversion: the tensors still map the file, nothing was read
        a = probe.attrs("deferred", before - after, False, seconds=0.0 if to_device else seconds)
        a["infersight.weights.mapped_bytes"] = before
        if to_device:
            keep = ("path", "page_cache_ratio", "read_bytes", "major_faults", "mapped_bytes")
            a = {k: v for k, v in a.items() if k.rpartition(".")[2] in keep}
            a["infersight.weights.deferred_read"] = True
        else:
            a["infersight.weights.deferred_by"] = "convert"
        return a
    except Exception as exc:
        _runtime.fail(exc)
        return {}


def converted(o: cs.Open, attrs: Dict[str, Any]) -> bool:
    """Turn an ``_apply`` span that moved nothing to a device into the deferred read it was."""
    if not attrs:
        return False
    o.name = "weights_load"
    o.attrs.update(attrs)
    return True


def _make_load_state_dict(orig: Callable[..., Any]) -> Callable[..., Any]:
    def load_state_dict(self: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        d = None
        try:
            assign = kwargs.get("assign", args[1] if len(args) > 1 else False)
            if _weights().mapped and not assign and not _flag() and cs.root_open() and isinstance(state_dict, dict):
                d = _deferred_begin("load_state_dict", _tensors(state_dict))
                if d is not None:
                    _weights().tls.busy = 1
        except Exception as exc:
            _runtime.fail(exc)
        if d is None:
            return orig(self, state_dict, *args, **kwargs)
        try:
            result = orig(self, state_dict, *args, **kwargs)
        except BaseException as e:
            forward_end(d, e)
            raise
        forward_end(d)
        return result

    return _wrap_meta(load_state_dict, orig)


# -- loads -------------------------------------------------------------------------------


def _flag() -> int:
    v: int = getattr(_weights().tls, "busy", 0)
    return v


def describe_file(f: Any) -> Tuple[str, int]:
    """(absolute path or "", size in bytes or 0) for a path, file object or buffer."""
    if isinstance(f, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(f))
        try:
            return str(path), os.stat(path).st_size
        except OSError:
            return str(path), 0
    if isinstance(f, (bytes, bytearray, memoryview)):
        return "", len(f)
    name = getattr(f, "name", None)
    try:
        size = os.fstat(f.fileno()).st_size
    except Exception:
        try:
            size = f.getbuffer().nbytes
        except Exception:
            size = 0
    return (os.path.abspath(name) if isinstance(name, str) else ""), size


def _is_meta(where: Any) -> bool:
    return where is not None and str(where) == "meta"


def _wrap_meta(wrapper: Callable[..., Any], orig: Callable[..., Any]) -> Callable[..., Any]:
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(orig, "__name__", "wrapper")
    wrapper.__qualname__ = getattr(orig, "__qualname__", wrapper.__name__)
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    return wrapper


def _failed(o: cs.Open, probe: _Probe, api: str, size: int, err: BaseException) -> None:
    """The load raised: end its span with the error (the caller re-raises the user's error)."""
    _weights().tls.busy = 0
    try:
        cs.end(o, probe.attrs(api, size, False), err=err)
    except Exception as exc:
        _runtime.fail(exc)


def _load_wrapper(orig: Callable[..., Any], api: str, key: str, check_mapped: bool = True) -> Callable[..., Any]:
    """Wrap a function that loads one file (its first argument or ``key``) and returns tensors."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        o = probe = None
        path = ""
        size = 0
        try:
            if cs.state().collecting and not _flag() and cs.root_open() and not _is_meta(
                    kwargs.get("map_location", kwargs.get("device"))):
                f = args[0] if args else kwargs.get(key)
                path, size = describe_file(f)
                probe = _Probe([path])
                o = cs.begin("weights_load")
                probe.t0 = time.perf_counter()  # the span and the rate's clock start together
                _weights().tls.busy = 1
        except Exception as exc:
            _runtime.fail(exc)
        if o is None or probe is None:
            return orig(*args, **kwargs)
        try:
            result = orig(*args, **kwargs)
        except BaseException as e:
            _failed(o, probe, api, size, e)
            raise
        probe.stop()
        _weights().tls.busy = 0
        try:
            tensors = list(_tensors(result)) if check_mapped else []
            if _all_meta(tensors):
                cs.end(o, keep=False)  # a header read onto the meta device
                return result
            lazy = bool(path) and check_mapped and _register([path], tensors)
            # the span is the call: its end where the rate's clock stopped, so the two agree
            cs.end(o, probe.attrs(api, size, lazy), end_ns=probe.done_ns)
        except Exception as exc:
            _runtime.fail(exc)
            cs.end(o, keep=False)  # put the current span back; what we measured is unsure
        return result

    return _wrap_meta(wrapper, orig)


class _Slice:
    """A ``get_slice`` result: materialising it (``[...]``) takes tensor bytes."""

    __slots__ = ("_owner", "_real")

    def __init__(self, real: Any, owner: _SafeOpen) -> None:
        self._real = real
        self._owner = owner

    def __getitem__(self, item: Any) -> Any:
        t0 = time.perf_counter()
        t = self._real[item]
        self._owner._took(t, time.perf_counter() - t0)
        return t

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _SafeOpen:
    """A ``safe_open`` handle: a weights span if tensors are taken, with or without ``with``.

    With ``with``, the span is the block (a ``load_state_dict`` copy inside it is a nested
    deferred read). Without (transformers opens, takes slices and calls ``__exit__`` itself),
    the span runs from the open to the close, emitted at the close when no other stage began
    in between. Header-only use (keys, shapes, dtypes) is no span.
    """

    __slots__ = ("_key", "_lazy", "_nbytes", "_o", "_path", "_probe", "_quiet", "_ranges", "_read_s", "_real",
                 "_start")

    def __init__(self, real: Any, filename: Any) -> None:
        self._real = real
        self._path = describe_file(filename)[0]
        self._o: Optional[cs.Open] = None
        self._nbytes = 0
        self._read_s = 0.0  # time inside get_tensor / slicing: the reading time of an eager backend
        self._lazy = False
        self._ranges: Optional[List[Tuple[int, int]]] = None
        self._key: Optional[Tuple[str, str]] = None
        self._probe: Optional[_Probe] = None
        self._start = 0
        self._quiet: Tuple[Any, ...] = ()

    def _opening(self) -> None:
        self._probe = _Probe([self._path])
        self._start = time.time_ns()
        self._quiet = _activity()

    def _took(self, t: Any, seconds: float) -> None:
        """A tensor was taken: count it; if it maps the file, later copies of it are deferred reads."""
        try:
            if self._probe is None:
                return
            ptr, n = _extent(t)
            self._nbytes += n
            self._read_s += seconds
            if not n:
                return
            if self._ranges is None:  # one look at /proc/self/maps per handle
                self._key = file_key(self._path)
                self._ranges = file_mappings(self._key)
                used = [(lo, hi) for lo, hi in self._ranges if lo <= ptr < hi]
                if self._key is not None and used:
                    _remember(self._path, self._key, used)
            if not self._lazy:
                self._lazy = any(lo <= ptr < hi for lo, hi in self._ranges)
        except Exception as exc:
            _runtime.fail(exc)

    def get_tensor(self, name: str) -> Any:
        t0 = time.perf_counter()
        t = self._real.get_tensor(name)
        self._took(t, time.perf_counter() - t0)
        return t

    def get_slice(self, name: str) -> Any:
        s = self._real.get_slice(name)
        try:
            return _Slice(s, self)
        except Exception:
            return s

    def __enter__(self) -> Any:
        entered = self._real.__enter__()
        try:
            if self._probe is not None and cs.root_open():
                self._o = cs.begin("weights_load", start=self._start)
        except Exception as exc:
            _runtime.fail(exc)
        return self if entered is self._real else entered

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self._real.__exit__(*exc)
        finally:
            try:
                self._close(exc[1] if len(exc) > 1 else None)
            except Exception as e:
                _runtime.fail(e)

    def _attrs(self) -> Optional[Dict[str, Any]]:
        probe = self._probe
        self._probe = None
        if probe is None or not self._nbytes:
            return None  # header only: keys, shapes, dtypes
        return probe.attrs("safetensors.safe_open", self._nbytes, self._lazy, seconds=self._read_s)

    def _close(self, err: Optional[BaseException]) -> None:
        o = self._o
        if o is not None:
            self._o = None
            attrs = self._attrs()
            cs.end(o, attrs, err=err, keep=attrs is not None)
            return
        if self._probe is None:
            return
        quiet = self._quiet
        attrs = self._attrs()
        if attrs is None or not cs.root_open() or quiet != _activity() or cs.last_end() > self._start:
            return  # other spans began or ended meanwhile: one from the open would overlap them
        end = time.time_ns()
        cs.note_begin(end)  # a stage began (warmups and import runs split here) and ends at once:
        cs.emit_stage("weights_load", _runtime.new_span_id(), quiet[0] or _runtime.state().root_span_id,
                      self._start, end, attrs)
        cs.note_stage_exit(end)  # the thread's imports are timed again

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __iter__(self) -> Any:
        return iter(self._real)


def _activity() -> Tuple[Any, ...]:
    """What changes when a span begins anywhere in the cold start: the current span, stage
    starts, the warmup run in progress and its forwards, the first request."""
    st = cs.state()
    warm = st.warm
    return (_runtime.current_span.get(), st.stage_mark, id(warm), getattr(warm, "n", 0), id(st.first))


def _install_safetensors(mod: Any) -> None:
    orig = getattr(mod, "safe_open", None)
    if orig is None:
        return

    def safe_open(filename: Any, *args: Any, **kwargs: Any) -> Any:
        h = None
        try:
            if cs.state().collecting and not _flag() and cs.root_open():
                h = _SafeOpen(None, filename)
                h._opening()  # the page cache as it was before the open's own readahead
        except Exception as exc:
            _runtime.fail(exc)
        real = orig(filename, *args, **kwargs)
        if h is None:
            return real
        h._real = real
        return h

    _patch(mod, "safe_open", _wrap_meta(safe_open, orig))


def _install_safetensors_torch(mod: Any) -> None:
    for name, key in (("load_file", "filename"), ("load", "data")):
        orig = getattr(mod, name, None)
        if orig is not None:
            _patch(mod, name, _load_wrapper(orig, "safetensors.torch." + name, key, check_mapped=name == "load_file"))


def _install_transformers(mod: Any) -> None:
    """transformers' real read: ``PreTrainedModel._load_pretrained_model`` (checkpoint files -> model)."""
    cls: Any = getattr(mod, "PreTrainedModel", None)
    raw = getattr(cls, "__dict__", {}).get("_load_pretrained_model")
    if cls is None or raw is None:
        return
    kind = type(raw)
    func = getattr(raw, "__func__", raw)

    def load(*args: Any, **kwargs: Any) -> Any:
        o = probe = None
        files: List[str] = []
        model = None
        try:
            if cs.state().collecting and not _flag() and cs.root_open():
                ckpt = kwargs.get("checkpoint_files")
                for a in args:
                    if model is None and isinstance(a, _weights().module.nn.Module):
                        model = a
                    elif ckpt is None and isinstance(a, (list, tuple)) and a and all(isinstance(x, str) for x in a):
                        ckpt = a
                files = [os.path.abspath(p) for p in ckpt or () if isinstance(p, str) and os.path.isfile(p)]
                if files and model is not None:
                    probe = _Probe(files)
                    o = cs.begin("weights_load")
                    _weights().tls.busy = 1
        except Exception as exc:
            _runtime.fail(exc)
        if o is None or probe is None:
            return func(*args, **kwargs)
        size = 0
        for p in files:
            try:
                size += os.path.getsize(p)
            except OSError:
                pass
        try:
            result = func(*args, **kwargs)
        except BaseException as e:
            _failed(o, probe, "transformers.from_pretrained", size, e)
            raise
        _weights().tls.busy = 0
        try:
            lazy = _register(files, list(_tensors(model)))
            attrs = probe.attrs("transformers.from_pretrained", size, lazy)
            if len(files) > 1:
                attrs["infersight.weights.files"] = len(files)
            cs.end(o, attrs)
        except Exception as exc:
            _runtime.fail(exc)
            cs.end(o, keep=False)
        return result

    new = _wrap_meta(load, func)
    cls._load_pretrained_model = kind(new) if kind in (staticmethod, classmethod) else new

    def undo() -> None:
        if cls.__dict__.get("_load_pretrained_model") is not raw:
            cls._load_pretrained_model = raw

    cs.add_undo(undo)


# -- install -----------------------------------------------------------------------------


_patch = cs.patch


def _forget() -> None:
    ws = _weights()
    with ws.lock:
        del ws.mapped[:]
    ws.scanned.clear()


def install(torch: Any) -> None:
    """Wrap torch's loaders now; safetensors and transformers when (if) they are imported."""
    _weights().module = torch
    ser = getattr(torch, "serialization", None)
    if ser is not None and hasattr(ser, "load"):
        orig_load = ser.load
        wrapped = _load_wrapper(orig_load, "torch.load", "f")
        _patch(ser, "load", wrapped)
        if getattr(torch, "load", None) is orig_load:
            _patch(torch, "load", wrapped)
    jit = getattr(torch, "jit", None)
    if jit is not None and hasattr(jit, "load"):
        _patch(jit, "load", _load_wrapper(jit.load, "torch.jit.load", "f", check_mapped=False))
    export = vars(torch).get("export")  # never torch's lazy __getattr__: no import here
    if export is not None and hasattr(export, "load"):  # a .pt2 archive: its weights read through the zip reader
        _patch(export, "load", _load_wrapper(export.load, "torch.export.load", "f", check_mapped=False))
    module = getattr(getattr(torch, "nn", None), "Module", None)
    if module is not None and hasattr(module, "load_state_dict"):
        _patch(module, "load_state_dict", _make_load_state_dict(module.load_state_dict))
    cs.add_undo(_forget)
    cs.on_import("safetensors", _install_safetensors)
    cs.on_import("safetensors.torch", _install_safetensors_torch)
    cs.on_import("transformers.modeling_utils", _install_transformers)
