"""A bounded, crash-safe history of finished cold starts per service key.

One JSON object per line in ``coldstart-history.jsonl`` in the state directory, so that the
daemon and ``launch`` share it. The newest ``MAX_RUNS`` runs per key and ``MAX_KEYS`` keys
are kept, at most ``MAX_KEYS_PER_UID`` of one uid (the least recently used go first), so
that one user's many command lines never push another's history out. A finished run is
appended as one line (one ``write`` with ``O_APPEND``: cheap, and writers do not
interleave); once the file holds about twice what is kept, it is compacted: re-read,
bounded, and rewritten through a temporary file and ``rename``, so a reader never sees half
a file and a crash leaves the old one. Lines that do not parse (a crash mid-append, say) are
skipped and counted, never fatal.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from infersight.agent.coldstart.eta import MAX_STAGES, Run
from infersight.statefiles import open_state_dir, open_state_file
from infersight.weights_files import COLD_BELOW

log = logging.getLogger("infersight.coldstart.history")
FILE_NAME = "coldstart-history.jsonl"
MAX_RUNS = 50
MAX_KEYS = 256
MAX_KEYS_PER_UID = MAX_KEYS // 4
MAX_FILE_BYTES = 8 << 20  # a history file larger than this is read only up to here


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


def run_to_json(key: str, run: Run) -> dict[str, Any]:
    return {
        "key": key, "total_s": round(run.total_s, 6), "cache": run.cache, "ended_at": run.ended_at,
        "stages": [[s, round(d, 6), round(e, 6)] for s, d, e in run.stages],
    }


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
    stages = tuple((str(s), _seconds(d), _seconds(e)) for s, d, e in obj["stages"][:MAX_STAGES])
    ended_at = obj.get("ended_at", 0.0)
    if isinstance(ended_at, bool) or not isinstance(ended_at, (int, float)) or not math.isfinite(ended_at):
        raise ValueError("ended_at is not a finite number")
    return obj["key"], Run(stages, _seconds(obj["total_s"]), str(obj.get("cache", "unknown")), float(ended_at))


@dataclass
class History:
    """Runs per key, newest last. ``corrupt_lines`` counts what a load skipped."""

    runs: dict[str, list[Run]] = field(default_factory=dict)
    corrupt_lines: int = 0
    lines_read: int = 0  # lines the file held when it was loaded (for compaction)

    def add(self, key: str, run: Run) -> None:
        new = key not in self.runs
        runs = self.runs.pop(key, [])  # re-insert: the dict's order is recency of use
        runs.append(run)
        self.runs[key] = runs[-MAX_RUNS:]
        uid = key_uid(key) if new else None
        if uid is not None:  # a key more for this uid: past its share, its least recently used goes
            mine = [k for k in self.runs if key_uid(k) == uid]
            for k in mine[: max(0, len(mine) - MAX_KEYS_PER_UID)]:
                del self.runs[k]
        while len(self.runs) > MAX_KEYS:
            del self.runs[next(iter(self.runs))]

    def of(self, key: str) -> list[Run]:
        return list(self.runs.get(key, ()))

    def lines(self) -> list[str]:
        return [json.dumps(run_to_json(k, r), separators=(",", ":")) for k, runs in self.runs.items() for r in runs]


def parse(text: str) -> History:
    history = History()
    for line in text.splitlines():
        if not line.strip():
            continue
        history.lines_read += 1
        try:
            key, run = run_from_json(json.loads(line))
        except BAD_RECORD:  # a nested, cut or hand-edited line costs only itself
            history.corrupt_lines += 1
            continue
        history.add(key, run)
    return history


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
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_FILE_BYTES)
    history = parse(data.decode("utf-8", "replace"))
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


def append(path: str, key: str, run: Run) -> None:
    """Add one run at the end of the file: one line, one ``write``; never through a link."""
    directory, name = os.path.split(path)
    directory = directory or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    line = (json.dumps(run_to_json(key, run), separators=(",", ":")) + "\n").encode()
    fd = open_state_file(directory, name, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # after a torn line (a crash mid-append): lose only that one
        os.write(fd, line)
    finally:
        os.close(fd)


def needs_compaction(lines_on_disk: int, history: History) -> bool:
    kept = sum(len(r) for r in history.runs.values())
    return lines_on_disk > 2 * kept + 64


def record(path: str, key: str, run: Run) -> History:
    """Append one run; compact the file when it has grown to twice what is kept.
    Returns the history as it now reads."""
    append(path, key, run)
    history = load(path)
    if needs_compaction(history.lines_read, history):
        save(path, history)
    return history
