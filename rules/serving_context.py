"""Live context for a serving engine's memory error: what the agent knows that the message does not.

At a memory error seen live (a hooked engine's log, or its stderr under ``launch``), the agent
can read NVML's per-process view of the devices the engine's process tree holds (the device's
size, this tree's bytes, every other process's bytes) and the engine's configured knobs from
the producer's command line. :func:`refine` (pure) turns a message-only :class:`Finding` and
that :class:`LiveContext` into a :class:`Refined` verdict, and decides a class only where the
context decides it by the rubric:

- **another process** (not of this engine's process tree) holds a material share of a device
  the engine uses: ``reservation_conflict``, naming the pid and its GiB;
- the engine's pool is sized by a **whole-device fraction** (``--gpu-memory-utilization``,
  ``--mem-fraction-static``, ``--cuda-memory-fraction``) that fenced off a material share of a
  device nobody else uses: ``reservation_conflict``, naming the knob and its value;
- the printed **request alone is at least the device's total**, or XLA's buffer assignment for
  the whole program ('total allocation') is: ``capacity`` (no share of any device would do);
- llama.cpp's **compute buffer does not fit beside its own weights and KV cache** on the device,
  whatever other processes hold (llama.cpp sizes nothing to the device; not under ollama):
  ``capacity``;
- vLLM's KV cache **1.2x or more short of one request** (``vllm.kv.max-model-len``'s far-beyond-pool case,
  ``capacity`` from the default 0.9) with ``--gpu-memory-utilization`` f below 0.9 on the command line: the pool
  is at most f of the device, so 0.9 covers the gap when (ratio - 1) f <= 0.9 - f, or when the bytes lacking fit
  in (0.9 - f) of the device (NVML): ``reservation_conflict``; undecided: ``unknown``. The one case where the
  context changes a class the message decided: the command line breaks the premise it was decided on;
- vLLM's KV cache **a little short of one request** (``vllm.kv.max-model-len``'s small gap, at most
  15% of the pool) with ``--gpu-memory-utilization`` on the command line: at 0.95 or more
  ``capacity`` (no room left to raise it), at 0.82 or less ``reservation_conflict`` (raising it to
  0.95 adds at least that gap); between, it stays ``unknown``.

It decides only for messages that the rules left ``unknown`` *and* that report a device memory
shortage whose cause the text does not show (:data:`DEVICE_SHORTAGE_RULES`); an ``unknown``
that says "not a shortage" (an impossible size, a pool's bookkeeping, on-chip scratch, host
RAM) stays as it is. A class the message decided is never changed: the context goes into the
note, and a note says so when it points elsewhere. Otherwise the reason gains what the context
showed. Attribute names: ``infersight.oom.context.*`` and ``infersight.oom.context_decided``.

:func:`parse_knobs` reads the knobs from an argv: text only, bounded, numbers checked against
their ranges; a value that does not parse is ignored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from infersight.bytesize import torch_bytes
from infersight.rules.serving import Finding

__all__ = [
    "DEVICE_SHORTAGE_RULES",
    "DeviceContext",
    "LiveContext",
    "Refined",
    "Tenant",
    "material_bytes",
    "parse_knobs",
    "refine",
]

GIB = 1 << 30

# A tenant is material when it holds at least 1 GiB and 5% of the device. A bare CUDA context (a
# monitor, an exporter, a sidecar that touched the GPU) is 0.3-0.6 GiB: below the floor. 5% is half
# of the 10% headroom the engines' default fractions leave (vLLM's 0.9): the margin they need for
# CUDA graphs, NCCL and non-torch memory, so a tenant of that size takes what the engine counted on.
MATERIAL_FLOOR = GIB
MATERIAL_SHARE = 0.05
# A configured fraction fences memory off when it leaves at least 20% of the device and 4 GiB
# unused: twice the headroom of the defaults (vLLM 0.9, SGLang about 0.88, TGI 1.0), measured
# unused by NVML as well, on a device with no material tenant.
FENCED_SHARE = 0.20
FENCED_FLOOR = 4 * GIB

# Rules (and their cases) whose ``unknown`` means: a device allocation failed, and the text
# does not show why. Only these are refined: the others say it was no device shortage.
DEVICE_SHORTAGE_RULES = frozenset({
    "gpu.cuda-runtime-oom", "gpu.cuda-runtime-oom/vllm-loading-weights", "gpu.bare-oom",
    "ggml.cuda-error", "llama.cpp.compute-buffer", "llama.cpp.compute-buffer/estimate",
    "llama.cpp.model-buffer/estimate", "tensorrt-llm.cuda-runtime", "tensorrt-llm.alloc.requested",
    "lmdeploy.turbomind.cuda-oom", "onnxruntime.cuda-failure", "xla.gpu.out-of-memory",
    "xla.gpu.out-of-memory/outside-pool", "xla.gpu.out-of-memory/over-pool-limit", "tgi.warmup.tokens/small-batch",
    # SGLang's token pool, full, its counts not printed (not the cases that show the pool had room
    # or the scheduler had admitted the batch: those are bookkeeping): mem-fraction-static sizes it
    "sglang.pool.out-of-tokens",
})
# XLA's memory error on a GPU: its BufferAssignment stats ('total allocation') give what the whole program needs.
XLA_POOL_RULE = "xla.gpu.out-of-memory"
# ... and the request is more than the pool's limit, which the scheduler printed (its base limit): the device decides.
XLA_OVER_POOL_RULE = "xla.gpu.out-of-memory/over-pool-limit"
XLA_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# The pool and the request together within this share of what the other processes leave of the device: a larger
# fraction would have held the request even with the pool full (its use was not printed), the CUDA context aside.
XLA_ROOM_SHARE = 0.95
# llama.cpp's compute buffer, reserved after the weights and the KV cache: llama.cpp sizes nothing to the device (no
# fraction, no pool), so when the buffer does not fit in what the engine's own processes leave of the device (other
# processes aside), its own weights, KV cache and buffer exceed it (-ngl, -c, -ub as set). Not under ollama, which
# picks the layers from its own estimate and whose tree holds the runners of other loaded models.
SELF_SIZED_RULES = frozenset({"llama.cpp.compute-buffer"})
# Accelerators NVML does not see: a message that names one is never set against NVML's devices.
# (Not a letter before it: INPUT and OUTPUT name no NPU or TPU.)
_NOT_NVML = re.compile(r"(?<![A-Za-z])(?:NPU|TPU|Vulkan|Metal|HIP|ROCm|hipMalloc)")


def names_other_accelerator(text: str) -> bool:
    """The message names an accelerator NVML does not see."""
    return _NOT_NVML.search(text) is not None

# Whole-device fractions that size an engine's pool: (knob, the engine's flag).
FRACTION_KNOBS: dict[str, str] = {
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "mem_fraction_static": "--mem-fraction-static",
    "cuda_memory_fraction": "--cuda-memory-fraction",
}
_ENGINE_FRACTION = {"vllm": "gpu_memory_utilization", "sglang": "mem_fraction_static", "tgi": "cuda_memory_fraction"}

# -- argv --------------------------------------------------------------------------------------

MAX_ARGS = 512  # arguments looked at
MAX_ARG_CHARS = 256  # a longer argument is skipped: no knob is that long
MAX_INT = 1 << 40

Number = int | float | bool
# flag (dashes and underscores folded to '-') -> (knob, kind)
_FLAGS: dict[str, tuple[str, str]] = {
    # vLLM
    "--gpu-memory-utilization": ("gpu_memory_utilization", "fraction"),
    "--max-model-len": ("max_model_len", "int"),
    "--max-num-seqs": ("max_num_seqs", "int"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", "int"),
    "--enforce-eager": ("enforce_eager", "flag"),
    "--tensor-parallel-size": ("tensor_parallel_size", "int"),
    "-tp": ("tensor_parallel_size", "int"),
    # set the KV pool's size whatever gpu_memory_utilization says (vLLM logs that it is not respected)
    "--num-gpu-blocks-override": ("num_gpu_blocks_override", "set"),
    "--kv-cache-memory-bytes": ("kv_cache_memory_bytes", "set"),
    "--kv-cache-memory": ("kv_cache_memory_bytes", "set"),
    # SGLang
    "--mem-fraction-static": ("mem_fraction_static", "fraction"),
    "--chunked-prefill-size": ("chunked_prefill_size", "int"),
    "--max-running-requests": ("max_running_requests", "int"),
    "--context-length": ("context_length", "int"),
    "--tp-size": ("tp_size", "int"),
    # TGI
    "--cuda-memory-fraction": ("cuda_memory_fraction", "fraction"),
    "--max-batch-prefill-tokens": ("max_batch_prefill_tokens", "int"),
    "--max-batch-total-tokens": ("max_batch_total_tokens", "int"),
    "--max-total-tokens": ("max_total_tokens", "int"),
    "--num-shard": ("num_shard", "int"),
    # llama.cpp, llama-cpp-python
    "-ngl": ("n_gpu_layers", "int"),
    "--n-gpu-layers": ("n_gpu_layers", "int"),
    "--gpu-layers": ("n_gpu_layers", "int"),
    "--ctx-size": ("ctx_size", "int"),
    "--n-ctx": ("ctx_size", "int"),
    "--ubatch-size": ("ubatch_size", "int"),
    "-ub": ("ubatch_size", "int"),
    # lmdeploy
    "--cache-max-entry-count": ("cache_max_entry_count", "fraction"),
    "--session-len": ("session_len", "int"),
    # TensorRT-LLM (trtllm-serve)
    "--kv-cache-free-gpu-memory-fraction": ("kv_cache_free_gpu_memory_fraction", "fraction"),
    "--max-batch-size": ("max_batch_size", "int"),
    "--max-num-tokens": ("max_num_tokens", "int"),
    "--max-seq-len": ("max_seq_len", "int"),
}
# -c is llama.cpp's context size, and many programs' something else (python -c CODE): read only
# when the program is llama.cpp's.
_LLAMA_ONLY = {"-c": ("ctx_size", "int")}


def _fold(flag: str) -> str:
    dashes = len(flag) - len(flag.lstrip("-"))
    return flag[:dashes] + flag[dashes:].replace("_", "-").lower()


def _value(kind: str, raw: str | None) -> Number | None:
    if kind == "flag":
        if raw is None or raw.lower() in ("1", "true", "yes"):
            return True
        return False if raw.lower() in ("0", "false", "no") else None
    if raw is None or not raw or len(raw) > 24:
        return None
    if kind == "set":  # present with a value: what the value is does not matter here (8G, 1000...)
        return True
    try:
        if kind == "int":
            n = int(raw, 10)
            return n if 0 <= n <= MAX_INT else None
        x = float(raw)
    except ValueError:
        return None
    return x if 0.0 < x <= 1.0 else None  # a fraction; nan and inf fail the compare


def parse_knobs(argv: Sequence[str]) -> dict[str, Number]:
    """The engine knobs in ``argv`` (``--k v``, ``--k=v``, ``--k_v`` spellings); the last wins.
    Values that do not parse as the knob's kind (or fall outside its range) are ignored."""
    args = [a for a in list(argv[:MAX_ARGS]) if isinstance(a, str)]
    flags = dict(_FLAGS)
    if args and "llama" in args[0].rsplit("/", 1)[-1].lower():
        flags.update(_LLAMA_ONLY)
    out: dict[str, Number] = {}
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if len(a) > MAX_ARG_CHARS or not a.startswith("-"):
            continue
        name, eq, inline = a.partition("=")
        spec = flags.get(_fold(name))
        if spec is None:
            continue
        knob, kind = spec
        raw: str | None = inline if eq else None
        if raw is None and kind != "flag" and i < len(args) and len(args[i]) <= MAX_ARG_CHARS:
            raw = args[i]
            i += 1
        v = _value(kind, raw)
        if v is not None:
            out[knob] = v
    return out


def format_knobs(knobs: Mapping[str, Number]) -> str:
    """``--gpu-memory-utilization 0.95 --enforce-eager`` for a reason (the engine's spelling)."""
    flag_of = {k: f for f, (k, _kind) in _FLAGS.items() if f.startswith("--")}
    parts = []
    for k, v in sorted(knobs.items()):
        flag = flag_of.get(k, "--" + k.replace("_", "-"))
        parts.append(flag if v is True else "%s=false" % flag if v is False else "%s %s" % (flag, _num(v)))
    return " ".join(parts)


def _num(v: Number) -> str:
    return "%g" % v if isinstance(v, float) else str(v)


# -- the context -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tenant:
    """A process outside this engine's process tree that holds memory on a device."""

    pid: int
    used_bytes: int
    name: str | None = None


@dataclass(frozen=True, slots=True)
class DeviceContext:
    """One device that the engine's process tree holds memory on, as NVML read it at the error."""

    device: str  # hw.id (GPU-<uuid>), or "nvml:<index>" without one
    total_bytes: int | None
    own_bytes: int  # this engine's process tree
    others: tuple[Tenant, ...] = ()
    own_names: tuple[str, ...] = ()  # NVML's names of the tree's processes on it (at most 32 characters each)

    @property
    def other_bytes(self) -> int:
        return sum(t.used_bytes for t in self.others)


@dataclass(frozen=True, slots=True)
class LiveContext:
    """What the agent read at the error. ``nvml``: NVML was read; ``devices``: those it found the
    engine's process tree on (empty when NVML is absent, or saw none of the tree)."""

    pid: int | None = None
    devices: tuple[DeviceContext, ...] = ()
    nvml: bool = False
    knobs: Mapping[str, Number] = field(default_factory=dict)
    knobs_pid: int | None = None  # whose command line held the knobs (the producer, or an ancestor)
    program: str | None = None  # the producer's program (argv[0]'s base name), where it was read
    early: bool = False  # read as the error was being printed, not at its classification (the engine had gone)
    host_largest: int | None = None  # the largest device NVML lists on the host, read when none of the tree's was


@dataclass(frozen=True, slots=True)
class Refined:
    cls: str
    rule: str
    reason: str | None
    remedy: str
    note: str
    decided: bool  # the class came from the context
    attributes: dict[str, int | float | bool | str | list[str] | list[int]]


def material_bytes(total: int | None) -> int:
    """The least a tenant holds to count (see MATERIAL_FLOOR / MATERIAL_SHARE)."""
    return max(MATERIAL_FLOOR, int(MATERIAL_SHARE * total)) if total else MATERIAL_FLOOR


def _gib(n: int) -> str:
    return torch_bytes(n)


def _tenant(t: Tenant) -> str:
    return "pid %d%s (%s)" % (t.pid, " " + t.name if t.name else "", _gib(t.used_bytes))


def summary(ctx: LiveContext) -> str:
    """What the context showed, in one clause: for a reason or a note."""
    parts: list[str] = []
    for d in ctx.devices:
        total = " of the %s device" % _gib(d.total_bytes) if d.total_bytes else ""
        others = ("; other processes: %s" % ", ".join(_tenant(t) for t in d.others[:4])) if d.others \
            else ", no other process"
        parts.append("%s: this engine's processes %s%s%s" % (d.device, _gib(d.own_bytes), total, others))
    if not parts and ctx.nvml:
        parts.append("NVML showed none of this engine's processes on a device")
    at = "as the error was printed (the engine had exited when it was classified)" if ctx.early else "at the error"
    text = ("NVML %s: %s" % (at, "; ".join(parts))) if ctx.devices else (parts[0] if parts else "")
    if ctx.knobs:
        text += ("; " if text else "") + "command line: " + format_knobs(ctx.knobs)
    return text


def attributes(ctx: LiveContext) -> dict[str, int | float | bool | str | list[str] | list[int]]:
    a: dict[str, int | float | bool | str | list[str] | list[int]] = {}
    if ctx.pid is not None:
        a["infersight.oom.context.pid"] = ctx.pid
    if ctx.nvml:
        a["infersight.oom.context.nvml"] = True
    if ctx.early:
        a["infersight.oom.context.early"] = True
    if ctx.host_largest is not None:
        a["infersight.oom.context.host_largest_bytes"] = ctx.host_largest
    if ctx.devices:
        a["infersight.oom.context.devices"] = [d.device for d in ctx.devices]
        d = _worst(ctx.devices)
        if d.total_bytes is not None:
            a["infersight.oom.context.total_bytes"] = d.total_bytes
        a["infersight.oom.context.own_bytes"] = d.own_bytes
        a["infersight.oom.context.other_bytes"] = d.other_bytes
        if d.others:
            a["infersight.oom.context.other_pids"] = [t.pid for t in d.others[:16]]
    for k, v in sorted(ctx.knobs.items()):
        a["infersight.oom.context.knob.%s" % k] = v
    if ctx.knobs_pid is not None and ctx.knobs:
        a["infersight.oom.context.knobs_pid"] = ctx.knobs_pid
    return a


def _worst(devices: Iterable[DeviceContext]) -> DeviceContext:
    """The device whose other tenants hold the most (then the fullest)."""
    return max(devices, key=lambda d: (d.other_bytes, d.own_bytes))


def _fraction_knob(f: Finding, ctx: LiveContext, engine_default: bool = True) -> tuple[str, float] | None:
    """The whole-device fraction that sizes the pool of the finding's rule (with
    ``engine_default``: else the engine's), when the command line set it."""
    names = [(f.knob or "").replace("-", "_")] + ([_ENGINE_FRACTION.get(f.engine, "")] if engine_default else [])
    for n in names:
        v = ctx.knobs.get(n)
        if n in FRACTION_KNOBS and isinstance(v, float):
            return n, v
    return None


# vLLM's "max seq len N is larger than ... KV cache (K)" with N <= 1.15 K: the gap is at most 15% of a pool of at most
# f x the device. Raising f to KV_GAP_TOP adds (KV_GAP_TOP - f) of the device, at least 0.15 f of it while
# f <= KV_GAP_TOP / 1.15 (KV_GAP_ROOM); above KV_GAP_TOP the rest of the device is CUDA graphs', activations' and
# the context's (vLLM's own advice: lower it when graph capture runs out).
KV_GAP_RULE = "vllm.kv.max-model-len/within-fraction-headroom"
KV_GAP_TOP = 0.95
KV_GAP_ROOM = 0.82


def _kv_gap(f: Finding, frac: float, shown: str,
            attrs: dict[str, int | float | bool | str | list[str] | list[int]],
            engine_remedies: Mapping[str, str] | None) -> Refined | None:
    """The small max-model-len gap decided by the utilization on vLLM's command line (see KV_GAP_TOP)."""
    if frac >= KV_GAP_TOP:
        reason = ("--gpu-memory-utilization is already %g (the command line): no room is left to raise it, so one "
                  "request of the configured length does not fit beside the weights. %s" % (frac, shown)).strip()
        remedy = " ".join(("Lower --max-model-len to at most the tokens the KV cache holds, or give each sequence more "
                           "memory (a quantised model or KV cache, --tensor-parallel-size).",
                           (engine_remedies or {}).get("capacity", ""))).strip()
        return _decided(f, "capacity", "context.fraction-at-top", reason, remedy, attrs)
    if frac <= KV_GAP_ROOM:
        reason = ("--gpu-memory-utilization is %g (the command line): raising it to %g adds more than the at most 15%% "
                  "of the KV pool that one request lacks. %s" % (frac, KV_GAP_TOP, shown)).strip()
        remedy = ("Raise --gpu-memory-utilization from %g towards 0.9 (up to %g): the KV cache then holds one request "
                  "of the configured length." % (frac, KV_GAP_TOP))
        return _decided(f, "reservation_conflict", "context.fraction-has-room", reason, remedy, attrs,
                        knob="gpu_memory_utilization")
    return None


# vLLM's max-model-len error with a gap of 1.2x or more: the message alone answers capacity, reasoning from the
# default gpu_memory_utilization of 0.9 (a few points left to raise it). A command line that sets it lower breaks
# that premise: raising it to 0.9 adds (0.9 - f) of the device, which the rule's own low-fraction case compares with
# the KV cache one request lacks when the profiling line prints the fraction and the device's size.
KV_FAR_RULE = "vllm.kv.max-model-len/far-beyond-pool"
KV_POOL_FIXED_KNOBS = ("num_gpu_blocks_override", "kv_cache_memory_bytes")  # the pool's size set outright
KV_DEFAULT_FRACTION = 0.9


def _kv_ratio_and_lacks(f: Finding) -> tuple[float | None, int | None]:
    """From vLLM's message: how many times the pool one request needs (length / tokens, or needed / available),
    and the KV cache bytes it lacks (needed - available, or the tokens' share of the pool's bytes)."""
    needed, avail = f.extra.get("kv_needed_bytes"), f.extra.get("kv_available_bytes")
    tokens, length = f.extra.get("kv_tokens"), f.extra.get("max_model_len")
    ratio = length / tokens if tokens and length else needed / avail if needed and avail else None
    lacks = int(needed - avail) if needed is not None and avail is not None else (
        int((ratio - 1) * avail) if ratio is not None and avail is not None else None)
    return ratio, lacks


def _kv_far(f: Finding, frac: float, devices: Sequence[DeviceContext], shown: str,
            attrs: dict[str, int | float | bool | str | list[str] | list[int]]) -> Refined | None:
    """The far-beyond-pool verdict re-read with a command-line fraction below the default (see KV_FAR_RULE). The
    pool is part of what the fraction gives, so it is at most f x the device, and one request lacks at most
    (ratio - 1) x f of it. Raising the fraction to 0.9 adds (0.9 - f) of the device, and never more than NVML saw
    free beside this engine and the other processes. None: the message's verdict stands (with the context's
    notes, a tenant's among them)."""
    if frac >= KV_DEFAULT_FRACTION:
        return None
    ratio, lacks = _kv_ratio_and_lacks(f)
    if ratio is None:
        return None
    measured = [d for d in devices if d.total_bytes]
    if measured:
        adds = min(min(int((KV_DEFAULT_FRACTION - frac) * (d.total_bytes or 0)),
                       max(0, (d.total_bytes or 0) - d.own_bytes - d.other_bytes)) for d in measured)
        total = min(d.total_bytes or 0 for d in measured)
        needs = int((ratio - 1) * frac * total) if lacks is None else lacks
        if needs > adds:
            return None
        how = "; NVML: raising it to %g adds %s of the %s device (what is free beside the others), against %s %s" % (
            KV_DEFAULT_FRACTION, _gib(adds), _gib(total), "at most" if lacks is None else "", _gib(needs))
    elif (ratio - 1) * frac <= KV_DEFAULT_FRACTION - frac:
        how = "; raising it to %g adds %g of the device, more than that" % (KV_DEFAULT_FRACTION,
                                                                            KV_DEFAULT_FRACTION - frac)
    else:
        reason = ("--gpu-memory-utilization is %g on the command line, not the default %g the message's verdict "
                  "assumes; one request needs %.2fx the KV pool, and whether raising the fraction covers that "
                  "depends on how much of it the weights and activations take, which the message does not print: "
                  "read vLLM's profiling line ('model weights take ...; the rest of the memory reserved for KV Cache "
                  "is ...'). %s" % (frac, KV_DEFAULT_FRACTION, ratio, shown)).strip()
        return Refined("unknown", "%s+context.fraction-below-default" % f.rule, reason, f.remedy, f.note, True,
                       dict(attrs, **{"infersight.oom.context.fraction_knob": "gpu_memory_utilization"}))
    reason = ("--gpu-memory-utilization is %g (the command line), not the default %g the message's verdict assumes: "
              "one request needs %.2fx the KV pool, which is at most %g of the device%s. %s" % (
                  frac, KV_DEFAULT_FRACTION, ratio, frac, how.replace("  ", " "), shown)).strip()
    remedy = ("Raise --gpu-memory-utilization from %g towards %g: the KV cache then holds one request of the "
              "configured length." % (frac, KV_DEFAULT_FRACTION))
    return Refined("reservation_conflict", "%s+context.fraction-below-default" % f.rule, reason, remedy,
                   "re-decided with the command line's fraction (the message alone: capacity, from the default %g)"
                   % KV_DEFAULT_FRACTION, True,
                   dict(attrs, **{"infersight.oom.context.fraction_knob": "gpu_memory_utilization"}))


CAPACITY_REMEDY = ("Plan capacity: a smaller or quantised model, a shorter context or smaller batch, or more or "
                   "larger devices (tensor parallelism).")


def refine(f: Finding, ctx: LiveContext, engine_remedies: Mapping[str, str] | None = None) -> Refined:
    """The verdict for ``f`` with ``ctx`` (see the module's doc): decided by the context only
    where it decides by the rubric; else the message's, with what the context showed.
    ``engine_remedies``: the engine's remedy per class (serving.toml's ``engine_remedies``)."""
    attrs = attributes(ctx)
    shown = summary(ctx)
    devices = ctx.devices if ctx.nvml and not names_other_accelerator(f.text) else ()
    if (f.rule == KV_FAR_RULE and (frac := _fraction_knob(f, ctx)) is not None and frac[0] == "gpu_memory_utilization"
            and not any(k in ctx.knobs for k in KV_POOL_FIXED_KNOBS)):
        far = _kv_far(f, frac[1], devices, shown, attrs)
        if far is not None:
            return far
    if f.cls != "unknown":
        return _kept(f, shown, _conflict(f, devices), attrs)
    if f.rule == KV_GAP_RULE and (frac := _fraction_knob(f, ctx)) is not None and frac[0] == "gpu_memory_utilization":
        gap = _kv_gap(f, frac[1], shown, attrs, engine_remedies)
        if gap is not None:
            return gap
    r_any = f.numbers.get("R")
    if (f.rule in DEVICE_SHORTAGE_RULES and not devices and ctx.host_largest and r_any is not None
            and r_any >= ctx.host_largest and not names_other_accelerator(f.text)):
        return _decided(f, "capacity", "context.request-exceeds-every-device",
                        "the request of %s is at least the largest device on this host (%s, NVML; the engine's own "
                        "device was not read: it had exited, or NVML could not place its processes): no share of any "
                        "of them would do. %s" % (
                            _gib(r_any), _gib(ctx.host_largest), shown),
                        " ".join((CAPACITY_REMEDY, (engine_remedies or {}).get("capacity", ""))).strip(), attrs)
    if f.rule in DEVICE_SHORTAGE_RULES and devices:
        r = f.numbers.get("R")
        top = max(d.total_bytes or 0 for d in devices)
        if r is not None and top and r >= top:
            return _decided(f, "capacity", "context.request-exceeds-device",
                            "the request of %s is at least the whole device (%s, NVML): no share of it would "
                            "do. %s" % (_gib(r), _gib(top), shown),
                            " ".join((CAPACITY_REMEDY, (engine_remedies or {}).get("capacity", ""))).strip(), attrs)
        program = f.extra.get("program_bytes") if f.rule.startswith(XLA_POOL_RULE) else None
        if program is not None and top and program >= top:
            return _decided(f, "capacity", "context.program-exceeds-device",
                            "XLA's buffer assignment for the program totals %s, at least the whole device (%s, "
                            "NVML): no XLA_PYTHON_CLIENT_MEM_FRACTION would hold it. %s" % (
                                _gib(int(program)), _gib(top), shown),
                            " ".join((CAPACITY_REMEDY, (engine_remedies or {}).get("capacity", ""))).strip(), attrs)
        tenants = [(d, t) for d in devices for t in d.others if t.used_bytes >= material_bytes(d.total_bytes)]
        if tenants and not (r is not None and all(d.total_bytes and r > d.total_bytes - d.own_bytes
                                                  for d in devices)):
            d, t = max(tenants, key=lambda x: x[1].used_bytes)
            frac = _fraction_knob(f, ctx)
            fit = ""
            if frac is not None and d.total_bytes:
                room = max(0.0, (d.total_bytes - d.other_bytes) / d.total_bytes)
                fit = " (%s %g of %s is %s; %s is left beside the other processes: at most %.2f)" % (
                    FRACTION_KNOBS[frac[0]], frac[1], _gib(d.total_bytes), _gib(int(frac[1] * d.total_bytes)),
                    _gib(max(0, d.total_bytes - d.other_bytes)), room)
            knob = FRACTION_KNOBS.get(frac[0] if frac else _ENGINE_FRACTION.get(f.engine, ""), "")
            remedy = ("Move or stop pid %d%s, which holds %s of %s, or give this engine a device of its own%s%s." % (
                t.pid, " (%s)" % t.name if t.name else "", _gib(t.used_bytes), d.device,
                "; or lower %s so that the engine fits beside it" % knob if knob else "", fit))
            return _decided(f, "reservation_conflict", "context.other-process",
                            "another process holds memory on the engine's device: %s" % shown, remedy, attrs)
        limit = f.numbers.get("L")
        if f.rule == XLA_OVER_POOL_RULE and r is not None and limit:
            d = max(devices, key=lambda x: x.own_bytes)
            free_of_others = (d.total_bytes or 0) - d.other_bytes
            if d.total_bytes and r < d.total_bytes and limit + r <= XLA_ROOM_SHARE * free_of_others:
                need = min(XLA_ROOM_SHARE, (limit + r) / d.total_bytes)
                return _decided(f, "reservation_conflict", "context.pool-below-device",
                                "XLA's pool limit of %s (%s about %.2f of the %s device) is below the request of %s, "
                                "and the device has room for a full pool and the request beside the other processes' "
                                "%s: the fraction fenced it off. %s" % (
                                    _gib(limit), XLA_FRACTION, limit / d.total_bytes, _gib(d.total_bytes), _gib(r),
                                    _gib(d.other_bytes), shown),
                                "Raise %s to %.2f or more (the pool's use plus the request, over the device), or set "
                                "XLA_PYTHON_CLIENT_PREALLOCATE=false with a fraction that leaves the other frameworks "
                                "in the process what they need." % (XLA_FRACTION, need), attrs, knob=XLA_FRACTION)
        if (f.rule in SELF_SIZED_RULES and f.engine == "llama.cpp" and r is not None and not _under_ollama(ctx, devices)
                and all(d.total_bytes and r > d.total_bytes - d.own_bytes for d in devices)):
            d = max(devices, key=lambda x: x.own_bytes)
            return _decided(f, "capacity", "context.own-buffers-fill-device",
                            "the buffer of %s does not fit in the %s the engine's own weights and KV cache leave "
                            "of the %s device, whatever other processes hold: %s" % (
                                _gib(r), _gib(max(0, (d.total_bytes or 0) - d.own_bytes)),
                                _gib(d.total_bytes or 0), shown),
                            " ".join((f.remedy, (engine_remedies or {}).get("capacity", ""))).strip(), attrs)
        # only where the rule's own mechanism is a pool that this fraction sizes (its knob)
        frac = _fraction_knob(f, ctx, engine_default=False)
        if frac is not None and not any(d.others and d.other_bytes >= material_bytes(d.total_bytes)
                                         for d in devices):
            knob, value = frac
            fenced = [d for d in devices if d.total_bytes
                      and (1.0 - value) * d.total_bytes >= max(FENCED_FLOOR, FENCED_SHARE * d.total_bytes)
                      and d.total_bytes - d.own_bytes - d.other_bytes >= max(FENCED_FLOOR,
                                                                              FENCED_SHARE * d.total_bytes)]
            if fenced:
                d = fenced[0]
                unused = d.total_bytes - d.own_bytes - d.other_bytes if d.total_bytes else 0
                remedy = ("Raise %s (set to %g: %s of %s) towards 0.9: nothing else uses the device, and %s of "
                          "it was unused at the error." % (FRACTION_KNOBS[knob], value,
                                                           _gib(int(value * (d.total_bytes or 0))),
                                                           _gib(d.total_bytes or 0), _gib(unused)))
                return _decided(f, "reservation_conflict", "context.fraction-fences-device",
                                "the engine's pool is sized by %s %g, which left memory no one used: %s" % (
                                    FRACTION_KNOBS[knob], value, shown), remedy, attrs, knob=knob)
    reason = f.reason
    if shown:
        reason = "%s. %s" % (reason.rstrip(". "), shown) if reason else shown
    return Refined(f.cls, f.rule, reason, f.remedy, f.note, False, attrs)


def _under_ollama(ctx: LiveContext, devices: Sequence[DeviceContext]) -> bool:
    """The producer is ollama, or ollama's runners hold the tree's memory (``sh -c "ollama serve"``)."""
    return (ctx.program or "").startswith("ollama") or any("ollama" in n for d in devices for n in d.own_names)


def _decided(f: Finding, cls: str, suffix: str, reason: str, remedy: str,
             attrs: dict[str, int | float | bool | str | list[str] | list[int]], knob: str | None = None) -> Refined:
    note = "decided by the live context (the message alone: unknown, %s)" % (f.reason or "no reason")
    a = dict(attrs)
    if knob is not None:
        a["infersight.oom.context.fraction_knob"] = knob
    return Refined(cls, "%s+%s" % (f.rule, suffix), reason, remedy, note, True, a)


def _conflict(f: Finding, devices: Sequence[DeviceContext]) -> str:
    """Where the context points away from the class the message decided; '' when it does not."""
    r = f.numbers.get("R")
    top = max((d.total_bytes or 0 for d in devices), default=0)
    if f.cls != "capacity" and r is not None and top and r >= top:
        return "the request of %s is at least the device's %s (NVML): that is capacity" % (_gib(r), _gib(top))
    tenants = [t for d in devices for t in d.others if t.used_bytes >= material_bytes(d.total_bytes)]
    if f.cls in ("capacity", "fragmentation") and tenants:
        t = max(tenants, key=lambda x: x.used_bytes)
        return "%s held memory on the engine's device at the error: a reservation conflict may be part of it" % (
            _tenant(t))
    return ""


def _kept(f: Finding, shown: str, conflict: str,
          attrs: dict[str, int | float | bool | str | list[str] | list[int]]) -> Refined:
    bits = [b for b in (f.note, ("live context: " + shown) if shown else "",
                        ("the context conflicts (class kept from the message): " + conflict) if conflict else "")
            if b]
    a = dict(attrs)
    if conflict:
        a["infersight.oom.context.conflict"] = conflict
    return Refined(f.cls, f.rule, f.reason, f.remedy, "; ".join(bits), False, a)
