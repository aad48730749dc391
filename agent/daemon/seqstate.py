"""The producers' sequence numbers, carried across an agent restart (I/O edge).

A batch is acked once every exporter has it. A restart while a collector is down (its batches
held in retries) closed the producers' connections before the acks went out; each live producer
then sent them again to the next agent, which exported them a second time beside the copy the
first agent had spooled (a restarted service exported a running server's cold start twice). The
agent writes what it had taken of each producer's numbers (``SeqTracker.state``) when it stops,
after its exporters have everything, and the next agent reads it once at start: what a producer
sends again is a duplicate there, dropped and acked, and a number the first agent was missing
still fills its gap. The file is the agent's own (its state directory, 0600), read once and removed.
"""

from __future__ import annotations

import json
import logging
import os

from infersight.statefiles import open_state_dir, open_state_file

log = logging.getLogger("infersight.agent")

FILE = "producer-sequences.json"
MAX_BYTES = 16 << 20  # 4096 producers x 64 gaps at most; a larger file is not ours


def save(state_dir: str, sequences: dict[str, object]) -> None:
    """Write ``sequences`` (the assembler's) for the next agent; a failure is logged, never raised."""
    tmp = "%s.%d.tmp" % (FILE, os.getpid())
    try:
        fd = open_state_file(state_dir, tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(sequences, f, separators=(",", ":"))
        dfd = open_state_dir(state_dir, create=False)
        try:
            os.replace(tmp, FILE, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
    except (OSError, ValueError) as exc:
        log.warning("cannot keep the producers' sequence numbers for the next agent (%s): a producer that "
                    "sends again what this agent processed but had not acked may be exported twice", exc)


def load(state_dir: str) -> dict[str, object]:
    """The previous agent's :func:`save`, removed once read; empty when there is none or it is unusable."""
    try:
        fd = open_state_file(state_dir, FILE, os.O_RDONLY)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("cannot read the previous agent's %s: %s", FILE, exc)
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
        data = json.loads(raw) if len(raw) <= MAX_BYTES else None
    except (OSError, ValueError):
        data = None
    try:
        dfd = open_state_dir(state_dir, create=False)
        try:
            os.unlink(FILE, dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    if not isinstance(data, dict):
        log.warning("ignoring the previous agent's %s: not what an agent writes", FILE)
        return {}
    return {str(k): v for k, v in data.items()}
