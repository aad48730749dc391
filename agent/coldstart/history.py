"""A bounded, crash-safe history of finished cold starts per service key.

One JSON object per line in ``coldstart-history.jsonl`` in the state directory, so that the
daemon and ``launch`` share it. The newest ``MAX_RUNS`` runs per key and ``MAX_KEYS`` keys
are kept, at most ``MAX_KEYS_PER_UID`` of one uid (the least recently used go first), so
that one user's many command lines never push another's history out. Bytes are bounded the
same way: a run is at most ``MAX_RUN_BYTES`` as a line (stage names cut, the stages past that
dropped: ``runs_cut``), the history at most ``MAX_HISTORY_BYTES`` of lines and one uid at most
``MAX_BYTES_PER_UID`` (its least recently used key's oldest runs go first: ``runs_pushed_out``).
A finished run is appended as one line (one ``write`` with ``O_APPEND``: cheap, and writers
do not interleave); once the file holds about twice what is kept, or would pass
``MAX_FILE_BYTES``, it is compacted: re-read, bounded, and rewritten through a temporary file
and ``rename``, so a reader never sees half a file and a crash leaves the old one. A load
reads the whole file, line by line, so a compaction or a restart keeps every run written.
Lines that do not parse (a crash mid-append, say) are skipped and counted, never fatal.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from infersight.agent.coldstart.eta import MAX_STAGES, Run
from infersight.statefiles import open_state_dir, open_state_file
from infersight.weights_files import COLD_BELOW

log = logging.getLogger("infersight.coldstart.history")
FILE_NAME = "coldstart-history.jsonl"
MAX_RUNS = 50
MAX_KEYS = 256
MAX_KEYS_PER_UID = MAX_KEYS // 4
# Bytes, as the lines of the file count them (in memory a run takes a small multiple of its line).
# Stage names are free text of the hooks (4 KB each): unbounded, one run was a 1 MB line.
MAX_STAGE_NAME = 64  # characters of a stage name kept (live progress cuts them alike)
MAX_SERVICE_KEY = 128  # characters of the service name in a key (the hash tells longer ones apart)
MAX_CACHE = 64  # characters of a run's cache state (the compile part is the hooks' word)
MAX_KEY = 256  # a longer key in the file is junk: service_key never makes one
MAX_RUN_BYTES = 16 << 10  # one run's line: 256 stages of ordinary names fit
MAX_HISTORY_BYTES = 4 << 20
MAX_BYTES_PER_UID = MAX_HISTORY_BYTES // 4  # >= MAX_RUNS * MAX_RUN_BYTES: one key always fits
MAX_FILE_BYTES = 2 * MAX_HISTORY_BYTES  # writers compact before the file passes this
MAX_LINE_BYTES = 256 << 10  # a longer line (an older agent's 4 KB stage names) is skipped unread


# Options whose argument is only a value: where the instance listens or logs, not what it
# loads. Their argument does not split a service's history.
VALUE_OPTIONS = frozenset({
    "--port", "-p", "--host", "--bind", "-b", "--uds", "--fd", "--root-path",
    "--log-file", "--logfile", "--log-dir", "--log-level", "--log-config", "--access-logfile",
    "--error-logfile", "--pid", "--pidfile", "--metrics-port", "--grpc-port", "--http-port",
})
LOG_SUFFIXES = (".log", ".out", ".err", ".pid", ".sock")
_NUMBER = re.compile(r"[-+]?\d+(\.\d+)?\Z")
_HOST_PORT = re.compile(r"(\[[0-9a-fA-F:]*\]|[\w.-]*):\d+\Z")
_IPV4 = re.compile(r"\d{1,3}(\.\d{1,3}){3}\Z")


def is_value(arg: str) -> bool:
    """An argument that is only a value: a number, an address (``host:port``, an IP, a URL),
    ``localhost``, or a log/pid/socket file path."""
    return bool(
        _NUMBER.match(arg) or _HOST_PORT.match(arg) or _IPV4.match(arg) or "://" in arg
        or arg in ("localhost", "::", "::1") or arg.endswith(LOG_SUFFIXES)
    )


def command_shape(argv: Sequence[str]) -> list[str]:
    """The command line as far as it decides a cold start: the program's base name, the
    options, and the arguments that are not only values (see :func:`is_value`). A
    :data:`VALUE_OPTIONS` option (``--port 8001``, ``--host=h``) is left out with its value,
    and so is a value (``--opt=8001``'s, or a bare ``8001``): a changed port, host or log
    path keeps the same history; another model path or script does not."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if i == 0:
            out.append(os.path.basename(arg))
        elif arg.startswith("-") and not _NUMBER.match(arg):
            name, eq, value = arg.partition("=")
            if name in VALUE_OPTIONS:
                skip = not eq  # the option and its value say where, not what: left out
                continue
            out.append(name if eq and is_value(value) else arg)
        elif not is_value(arg):
            out.append(arg)
    return out


def service_key(
    service: str, command: Sequence[str] | str, weights_paths: Iterable[str] = (), uid: int | None = None
) -> str:
    """The history key: ``service.name``, the uid of the processes that write it, and a stable
    hash of the command's shape (:func:`command_shape`) and the weights paths:
    ``<service>#u<uid>#<hash>`` (``<service>#<hash>`` when the uid is unknown)."""
    shape = command_shape([command] if isinstance(command, str) else command)
    digest = hashlib.sha256("\0".join(shape).encode("utf-8", "replace"))
    for path in sorted(set(weights_paths)):
        digest.update(b"\1" + path.encode("utf-8", "replace"))
    if len(service) > MAX_SERVICE_KEY:  # cut in the key, whole in the hash (shorter names keep their keys)
        digest.update(b"\2" + service.encode("utf-8", "replace"))
        service = service[:MAX_SERVICE_KEY]
    owner = "" if uid is None else "u%d#" % uid
    return "%s#%s%s" % (service, owner, digest.hexdigest()[:12])


def key_uid(key: str) -> int | None:
    """The uid a :func:`service_key` names (``<service>#u<uid>#<hash>``); None without one."""
    parts = key.rsplit("#", 2)
    if len(parts) == 3 and parts[1][:1] == "u" and parts[1][1:].isdigit():
        return int(parts[1][1:])
    return None


def cache_state(weights_page_cache_ratio: float | None, compile_cache: str | None) -> str:
    """The part of a run's conditions that changes its duration most: page cache, compile cache."""
    ratio = weights_page_cache_ratio
    weights = "none" if ratio is None else ("warm" if ratio >= COLD_BELOW else "cold")
    return "weights=%s,compile=%s" % (weights, compile_cache or "none")


def stage_label(name: str) -> str:
    """A stage name as history keeps it, and live progress matches it against history."""
    return name[:MAX_STAGE_NAME]


def _stage_json(stage: tuple[str, float, float]) -> list[Any]:
    s, d, e = stage
    return [s, round(d, 6), round(e, 6)]


def run_to_json(key: str, run: Run) -> dict[str, Any]:
    return {
        "key": key, "total_s": round(run.total_s, 6), "cache": run.cache, "ended_at": run.ended_at,
        "stages": [_stage_json(s) for s in run.stages],
    }


def encode(key: str, run: Run) -> bytes:
    """The run's line in the file, newline included (ASCII: ``json`` escapes the rest)."""
    return (json.dumps(run_to_json(key, run), separators=(",", ":")) + "\n").encode()


def run_bytes(key: str, run: Run) -> int:
    return len(encode(key, run))


def bounded_run(key: str, run: Run) -> tuple[Run, int]:
    """``run`` within :data:`MAX_RUN_BYTES`: stage names and the cache state cut, then its first
    stages that fit. Returns the run (``run`` itself when nothing was cut) and its line's bytes."""
    stages = tuple((stage_label(s), d, e) for s, d, e in run.stages[:MAX_STAGES])
    out = Run(stages, run.total_s, run.cache[:MAX_CACHE], run.ended_at)
    size = run_bytes(key, out)
    if size <= MAX_RUN_BYTES:
        return (run if out == run else out), size
    used = run_bytes(key, Run((), out.total_s, out.cache, out.ended_at))
    n = 0
    for stage in stages:
        used += len(json.dumps(_stage_json(stage), separators=(",", ":"))) + 1  # and its comma
        if used > MAX_RUN_BYTES:
            break
        n += 1
    out = Run(stages[:n], out.total_s, out.cache, out.ended_at)
    return out, run_bytes(key, out)


MAX_RUN_S = 30 * 86400.0  # a duration past this (or NaN, or an infinity) is no cold start: the line is junk
BAD_RECORD = (ValueError, TypeError, KeyError, OverflowError, RecursionError)  # what a junk line raises


def _seconds(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("a duration is not a number")
    x = float(v)
    if not 0 <= x <= MAX_RUN_S:  # False for NaN too
        raise ValueError("duration out of range: %r" % x)
    return x


def run_from_json(obj: Any) -> tuple[str, Run]:
    """Raises one of :data:`BAD_RECORD` on anything but a well-formed record: durations are
    finite seconds in [0, MAX_RUN_S] (``Infinity`` in a total would make every ETA infinite)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("key"), str) or not isinstance(obj.get("stages"), list):
        raise ValueError("record without a key or stages")
    if len(obj["key"]) > MAX_KEY:
        raise ValueError("key too long")
    stages = tuple((str(s), _seconds(d), _seconds(e)) for s, d, e in obj["stages"][:MAX_STAGES])
    ended_at = obj.get("ended_at", 0.0)
    if isinstance(ended_at, bool) or not isinstance(ended_at, (int, float)) or not math.isfinite(ended_at):
        raise ValueError("ended_at is not a finite number")
    return obj["key"], Run(stages, _seconds(obj["total_s"]), str(obj.get("cache", "unknown")), float(ended_at))


@dataclass
class History:
    """Runs per key, newest last. ``corrupt_lines`` counts what a load skipped, ``runs_cut`` the
    runs kept shorter (:func:`bounded_run`), ``runs_pushed_out`` those dropped for bytes."""

    runs: dict[str, list[Run]] = field(default_factory=dict)
    corrupt_lines: int = 0
    lines_read: int = 0  # lines the file held when it was loaded (for compaction)
    bytes_read: int = 0  # and its bytes
    runs_cut: int = 0
    runs_pushed_out: int = 0
    key_bytes: dict[str, int] = field(default_factory=dict)  # each key's runs, as lines

    def __post_init__(self) -> None:
        for key, runs in self.runs.items():
            self.key_bytes.setdefault(key, sum(run_bytes(key, r) for r in runs))

    @property
    def bytes(self) -> int:
        return sum(self.key_bytes.values())

    def add(self, key: str, run: Run) -> Run:
        """Keep ``run`` (bounded: :func:`bounded_run`) as the newest of ``key``; returns it as kept."""
        kept, size = bounded_run(key, run)
        self.runs_cut += int(kept is not run)
        run = kept
        new = key not in self.runs
        runs = self.runs.pop(key, [])  # re-insert: the dict's order is recency of use
        runs.append(run)
        self.runs[key] = runs
        self.key_bytes[key] = self.key_bytes.get(key, 0) + size
        while len(runs) > MAX_RUNS:
            self._drop_oldest(key)
        uid = key_uid(key)
        if uid is not None:  # past its share of keys or bytes, this uid's least recently used go
            mine = [k for k in self.runs if key_uid(k) == uid]
            for k in mine[: max(0, len(mine) - MAX_KEYS_PER_UID)] if new else ():
                self._drop_key(k)
            self._push_out([k for k in mine if k in self.runs], MAX_BYTES_PER_UID)
        while len(self.runs) > MAX_KEYS:
            self._drop_key(next(iter(self.runs)))
        self._push_out(list(self.runs), MAX_HISTORY_BYTES)
        return run

    def _drop_key(self, key: str) -> None:
        del self.runs[key]
        self.key_bytes.pop(key, None)

    def _drop_oldest(self, key: str) -> int:
        """Drop ``key``'s oldest run (the key too when it was the last); returns its bytes."""
        runs = self.runs[key]
        size = run_bytes(key, runs.pop(0))
        self.key_bytes[key] -= size
        if not runs:
            self._drop_key(key)
        return size

    def _push_out(self, keys: list[str], budget: int) -> None:
        """Drop the oldest runs of the least recently used of ``keys`` (in recency order) until
        they hold at most ``budget`` bytes. The key just used is last: one key's runs fit any
        budget (MAX_RUNS * MAX_RUN_BYTES), so it never loses its new run."""
        held = sum(self.key_bytes[k] for k in keys)
        for k in keys:
            while held > budget and k in self.runs:
                held -= self._drop_oldest(k)
                self.runs_pushed_out += 1
            if held <= budget:
                return

    def of(self, key: str) -> list[Run]:
        return list(self.runs.get(key, ()))

    def lines(self) -> list[str]:
        return [json.dumps(run_to_json(k, r), separators=(",", ":")) for k, runs in self.runs.items() for r in runs]


def parse(text: str) -> History:
    history = History()
    _add_lines(history, text.splitlines())
    return history


def _add_lines(history: History, lines: Iterable[str | bytes | None]) -> None:
    """Add each line's run; a line that is None (too long) or does not parse is counted."""
    for line in lines:
        if line is not None and not line.strip():
            continue
        history.lines_read += 1
        try:
            if line is None:
                raise ValueError("line too long")
            key, run = run_from_json(json.loads(line))
        except BAD_RECORD:  # a nested, cut or hand-edited line costs only itself
            history.corrupt_lines += 1
            continue
        history.add(key, run)


def _file_lines(f: IO[bytes]) -> Iterator[bytes | None]:
    """The file's lines, None for one longer than :data:`MAX_LINE_BYTES` (read past, never held)."""
    while line := f.readline(MAX_LINE_BYTES + 1):
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = f.readline(MAX_LINE_BYTES)
        yield None


def load(path: str) -> History:
    """The history at ``path``; a missing file is an empty history. Opened through the checked
    state directory, never through a link (:mod:`infersight.statefiles`)."""
    directory, name = os.path.split(path)
    try:
        fd = open_state_file(directory or ".", name, os.O_RDONLY)
    except FileNotFoundError:
        return History()
    except OSError as exc:
        h = History()
        h.corrupt_lines = 1  # unreadable (a planted symlink, a directory others may write): say so, start afresh
        log.warning("cold-start history %s is unreadable (%s): starting without it", path, exc)
        return h
    history = History()
    with os.fdopen(fd, "rb") as f:  # all of it: a run past any limit here would be lost at compaction
        _add_lines(history, _file_lines(f))
        history.bytes_read = f.tell()
    if history.corrupt_lines:
        log.warning("cold-start history %s: skipped %d unreadable line(s) of %d (counted; the rest is used)",
                    path, history.corrupt_lines, history.lines_read)
    return history


def save(path: str, history: History) -> None:
    """Write ``history`` atomically: a temporary file in the same directory, fsync, rename."""
    directory, name = os.path.split(path)
    directory = directory or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    tmp = ".%s-%s.tmp" % (name, os.urandom(6).hex())
    fd = open_state_file(directory, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    dfd = open_state_dir(directory, create=False)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for line in history.lines():
                f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise
    finally:
        os.close(dfd)


def append(path: str, key: str, run: Run) -> int | None:
    """Add one run (bounded) at the end of the file: one line, one ``write``; never through a
    link. Returns the file's size after it, or None, writing nothing, when the line would take
    the file past :data:`MAX_FILE_BYTES`: the caller compacts instead."""
    directory, name = os.path.split(path)
    directory = directory or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    line = encode(key, bounded_run(key, run)[0])
    fd = open_state_file(directory, name, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # after a torn line (a crash mid-append): lose only that one
        if size + len(line) > MAX_FILE_BYTES:
            return None
        return size + os.write(fd, line)
    finally:
        os.close(fd)


def needs_compaction(lines_on_disk: int, history: History, bytes_on_disk: int = 0) -> bool:
    """Twice the lines kept, or too near :data:`MAX_FILE_BYTES` for the next run's line."""
    kept = sum(len(r) for r in history.runs.values())
    return lines_on_disk > 2 * kept + 64 or bytes_on_disk > MAX_FILE_BYTES - MAX_RUN_BYTES


def compact(path: str, key: str | None = None, run: Run | None = None) -> History:
    """Re-read the file (what every writer appended), add ``run`` if given, rewrite it bounded."""
    history = load(path)
    if key is not None and run is not None:
        history.add(key, run)
    save(path, history)
    return history


def record(path: str, key: str, run: Run) -> History:
    """Append one run; compact the file when it has grown to twice what is kept, or when the
    line does not fit. Returns the history as it now reads."""
    if append(path, key, run) is None:
        return compact(path, key, run)
    history = load(path)
    if needs_compaction(history.lines_read, history, history.bytes_read):
        save(path, history)
    return history
