"""Reading the live context of an engine's memory error (the I/O edge of rules/serving_context.py).

Two reads, both bounded, both skipped when they fail:

- **The engine's knobs** from the producer's command line: ``/proc/<pid>/cmdline`` (at most
  ``MAX_CMDLINE`` bytes, NUL-split, decoded with replacement; text only, never run or
  interpreted beyond :func:`~infersight.rules.serving_context.parse_knobs`). The pid is the
  producer's kernel-checked one; a hooks-made producer id carries the process's start ticks,
  and a pid whose start differs (reused) is not read. Without knobs there (a vLLM engine core
  or worker runs ``python -c ...``), up to ``MAX_ANCESTORS`` parents of the same uid are read:
  the server that spawned it holds the flags. launch's stand-in producer (a CMD without hooks)
  also carries CMD's argv.
- **NVML** (the devices feature's, under its lock, off the event loop): every device NVML
  lists (at most ``MAX_DEVICES``); a device counts when a process of the engine's tree holds
  memory on it. The tree: the producer, its ancestors below pid 1, and every process whose
  chain of parents reaches the producer (its workers). Every other process on that device is a
  tenant.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from infersight.agent.daemon.identity import id_parts, parent_pid, proc_start_ticks, proc_uids
from infersight.rules.serving_context import DeviceContext, LiveContext, Number, Tenant, parse_knobs

if TYPE_CHECKING:
    from infersight.agent.daemon.assemble import Producer
    from infersight.agent.oom.nvml_views import NvmlLike

log = logging.getLogger("infersight.agent.oom")

MAX_CMDLINE = 65536
MAX_ANCESTORS = 4  # parents read for knobs
MAX_DEPTH = 32  # parents walked to place a GPU process in the tree
MAX_DEVICES = 64
MAX_SENT_ARGS = 128  # = hooks._enginelog.MAX_ARGS
MAX_SENT_ARG_CHARS = 64


def read_cmdline(pid: int, proc_root: str = "/proc", limit: int = MAX_CMDLINE) -> list[str] | None:
    """A process's argv as text (at most ``limit`` bytes); None when it cannot be read."""
    try:
        with open("%s/%d/cmdline" % (proc_root, pid), "rb") as f:
            raw = f.read(limit)
    except OSError:
        return None
    if not raw:
        return None  # a kernel thread, or a zombie
    return [a.decode("utf-8", "replace") for a in raw.rstrip(b"\0").split(b"\0")]



def same_process(p: Producer, pid: int, proc_root: str = "/proc") -> bool:
    """The pid names the producer's process here: its start ticks match the producer id's (a
    reused pid, or a pid of another pid namespace, does not). A producer made in-process
    (launch's stand-in for CMD: no uid) is trusted; another id without ticks is not."""
    parts = id_parts(str(p.info.get("id") or p.id))
    if parts is None or parts[0] != pid:
        return p.uid is None
    return proc_start_ticks(pid, proc_root) == parts[1]


def sent_args(v: Any) -> list[str] | None:
    """The ``args`` an oom event carries (the hooks' ``knob_args``), bounded; None when malformed."""
    if not isinstance(v, list) or len(v) > MAX_SENT_ARGS or not all(isinstance(a, str) for a in v):
        return None
    return [a[:MAX_SENT_ARG_CHARS] for a in v]


def producer_knobs(p: Producer, proc_root: str = "/proc",
                   sent: Sequence[str] | None = None) -> tuple[dict[str, Number], int | None]:
    """The engine knobs of the producer's command line (``/proc``; once it is gone, what its
    hooks ``sent`` with the event), else of its nearest same-uid parent that has some; and
    whose they were."""
    pid = p.info.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return {}, None
    alive = same_process(p, pid, proc_root)  # else gone, reused, or not this namespace's pid
    argv = read_cmdline(pid, proc_root) if alive else None
    if argv is None:
        given = p.info.get("argv") if p.uid is None else None  # launch's stand-in: CMD's argv
        if isinstance(given, list) and all(isinstance(a, str) for a in given):
            argv = list(given)
        elif sent is not None:
            argv = list(sent)
    knobs = parse_knobs(argv or [])
    if knobs:
        return knobs, pid
    if not alive:
        return {}, None
    uid = p.uid if p.uid is not None else _uid(pid, proc_root)
    cur = pid
    for _ in range(MAX_ANCESTORS):
        parent = parent_pid(cur, proc_root)
        if parent is None or parent <= 1 or uid is None or _uid(parent, proc_root) != uid:
            break
        knobs = parse_knobs(read_cmdline(parent, proc_root) or [])
        if knobs:
            return knobs, parent
        cur = parent
    return {}, None


def _uid(pid: int, proc_root: str) -> int | None:
    uids = proc_uids(pid, proc_root)
    return uids[0] if uids else None


def _ancestors(pid: int, proc_root: str, depth: int = MAX_DEPTH) -> list[int]:
    out: list[int] = []
    cur = pid
    for _ in range(depth):
        parent = parent_pid(cur, proc_root)
        if parent is None or parent <= 1 or parent in out:
            break
        out.append(parent)
        cur = parent
    return out


def nvml_devices(nvml: NvmlLike, pid: int, proc_root: str = "/proc",
                 ancestors: Callable[[int], Sequence[int]] | None = None) -> list[DeviceContext]:
    """The devices the process tree of ``pid`` holds memory on, with every other process there."""
    chain = ancestors or (lambda q: _ancestors(q, proc_root))
    tree_up = {pid, *chain(pid)}
    placed: dict[int, bool] = {}

    def own(g: Any) -> bool:
        for q in (g.pid, g.host_pid):
            if q is None:
                continue
            if q in tree_up:
                return True
        q = g.pid
        if q is None:
            return False
        if q not in placed:
            placed[q] = pid in chain(q)
        return placed[q]

    out: list[DeviceContext] = []
    read = _reader(nvml)
    for i in range(min(nvml.device_count(), MAX_DEVICES)):
        s = read(i)
        if s is None or not s.processes:
            continue
        mine = [g for g in s.processes if own(g)]
        if not mine:
            continue
        others = sorted((Tenant(g.pid if g.pid is not None else g.host_pid, g.used_bytes or 0,
                                _name(g)) for g in s.processes if g not in mine),
                        key=lambda t: -t.used_bytes)
        out.append(DeviceContext(s.uuid or "nvml:%d" % i, s.memory_total_bytes,
                                 sum(g.used_bytes or 0 for g in mine), tuple(others),
                                 tuple(n for g in mine[:8] if (n := _name(g)) is not None)))
    return out


def _reader(nvml: NvmlLike) -> Callable[[int], Any]:
    """The devices feature's light read (processes and memory: ``Nvml.memory_view``) where NVML has one, else a
    whole sample."""
    light = getattr(nvml, "memory_view", None)
    return light if callable(light) else nvml.sample


def host_largest_device(nvml: NvmlLike) -> int | None:
    """The largest device total NVML lists on this host (None: none read)."""
    read = _reader(nvml)
    totals = [t for i in range(min(nvml.device_count(), MAX_DEVICES))
              if (s := read(i)) is not None and isinstance(t := s.memory_total_bytes, int)]
    return max(totals) if totals else None


def _name(g: Any) -> str | None:
    name = getattr(g, "name", None)
    if not isinstance(name, str):
        return None
    clean = "".join(c for c in name[:32] if c.isprintable())
    return clean or None


def gather(p: Producer, nvml: NvmlLike | None, guard: Callable[[Callable[[], Any]], Any] | None,
           proc_root: str = "/proc", sent: Sequence[str] | None = None) -> LiveContext:
    """The live context of ``p``'s memory error (blocking: run it off the event loop)."""
    pid = p.info.get("pid")
    pid = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 1 else None
    try:
        knobs, knobs_pid = producer_knobs(p, proc_root, sent)
    except Exception as exc:  # never fatal: the message's own verdict goes out
        log.debug("reading the engine's command line failed: %s", exc)
        knobs, knobs_pid = {}, None
    devices: list[DeviceContext] = []
    read = False
    if pid is not None and not same_process(p, pid, proc_root):
        pid = None  # gone, or the pid is not the producer's here: NVML's view of it would be another's
    largest = None
    if nvml is not None:
        def sample() -> tuple[list[DeviceContext], int | None] | None:
            if nvml.device_count() <= 0:
                return None  # no NVML here (library absent, no device): nothing was read
            found = nvml_devices(nvml, pid, proc_root) if pid is not None else []
            # the engine gone (or on no device NVML shows): the host's devices still bound what any of them holds
            return found, (None if found else host_largest_device(nvml))

        try:
            got = guard(sample) if guard is not None else sample()
            if got is not None:
                devices, largest = list(got[0]), got[1]
                read = pid is not None
        except Exception as exc:
            log.debug("NVML sample for an engine OOM failed: %s", exc)
    return LiveContext(pid=pid, devices=tuple(devices), nvml=read, knobs=knobs, knobs_pid=knobs_pid,
                       program=_program(p, pid, proc_root), host_largest=largest)


def _program(p: Producer, pid: int | None, proc_root: str) -> str | None:
    """The producer's program: argv[0]'s base name (its command line, or launch's stand-in's CMD)."""
    argv = read_cmdline(pid, proc_root, 4096) if pid is not None else None
    if argv is None:
        given = p.info.get("argv") if p.uid is None else None
        argv = given if isinstance(given, list) and given and isinstance(given[0], str) else None
    if not argv:
        return None
    name = argv[0].rsplit("/", 1)[-1][:64]
    return "".join(c for c in name if c.isprintable()) or None
