"""Strings from other users made safe for every sink, once, where they come in (pure).

A producer is another user: whatever its hello and events carry ends up in MQTT topics and
payloads, Prometheus labels, OTLP files, terminals and HTML pages. Each of those has its own
idea of a bad string (mosquitto drops a client that publishes a control character in a topic,
prometheus-client answers 500 for a whole scrape on one lone surrogate, a terminal obeys ESC),
so every decoded string is made plain text here, once:

- valid Unicode: a lone surrogate (``\\ud800`` in JSON, or a non-UTF-8 byte that Python
  carried as ``surrogateescape``) becomes U+FFFD;
- no control characters: C0 (bar tab and newline in values, which log bodies and OOM messages
  need; every sink escapes them), DEL, C1 and the bidirectional overrides and isolates become
  U+FFFD; keys and names keep neither tab nor newline;
- bounded: a value keeps at most :data:`MAX_TEXT` characters, a key :data:`MAX_KEY`.

:func:`needs_cleaning` looks at the raw JSON bytes first, so that the usual frame (ASCII, no
escapes) costs three scans in C and no walk. Length is bounded by the walk where it runs; the
agent's event validation bounds every event string on its own, so a frame of plain ASCII is not
walked for length alone.
"""

from __future__ import annotations

import re
from typing import Any

from infersight.errors import InfersightError

MAX_TEXT = 16384  # characters of one value: the largest field bound of the agent (an OOM message's
# text); each field's own, smaller bound still applies after
MAX_KEY = 256  # characters of one object key (an attribute name)
REPLACEMENT = "\ufffd"

# Unicode's bidirectional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069) reorder what a
# terminal or page shows after them ("Trojan Source"): a name could show another's, or hide its own end.
_BIDI = "\u202a-\u202e\u2066-\u2069"
_BAD_VALUE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff" + _BIDI + "]")
_BAD_KEY = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff" + _BIDI + "]")


class TooDeepError(InfersightError, ValueError):
    """The value nests deeper than a walk may go: the caller refuses it as malformed."""


def clean_text(s: str, limit: int = MAX_TEXT) -> str:
    """``s`` as plain, valid, bounded text (tab and newline kept)."""
    if _BAD_VALUE.search(s) is not None:
        s = _BAD_VALUE.sub(REPLACEMENT, s)
    return s if len(s) <= limit else s[:limit]


def clean_key(s: str, limit: int = MAX_KEY) -> str:
    """``s`` as a key or name: as :func:`clean_text`, and no tab or newline either."""
    if _BAD_KEY.search(s) is not None:
        s = _BAD_KEY.sub(REPLACEMENT, s)
    return s if len(s) <= limit else s[:limit]


MAX_DEPTH = 64


def clean_tree(v: Any, limit: int = MAX_TEXT, depth: int = 0) -> Any:
    """A decoded JSON value with every string cleaned (object keys by :func:`clean_key`), values
    bounded to ``limit`` characters.

    Raises :class:`TooDeepError` past :data:`MAX_DEPTH` levels (no schema of ours nests so
    deep; a recursion the caller cannot bound is refused instead)."""
    if isinstance(v, str):
        return clean_text(v, limit)
    if isinstance(v, list):
        if depth >= MAX_DEPTH:
            raise TooDeepError("nested deeper than %d levels" % MAX_DEPTH)
        return [clean_tree(x, limit, depth + 1) for x in v]
    if isinstance(v, dict):
        if depth >= MAX_DEPTH:
            raise TooDeepError("nested deeper than %d levels" % MAX_DEPTH)
        return {clean_key(k, max(limit, MAX_KEY)) if isinstance(k, str) else k: clean_tree(x, limit, depth + 1)
                for k, x in v.items()}
    return v


# In JSON text already decoded to str: an escape of a C0/C1/DEL character or of a surrogate,
# or such a character itself (raw C0 cannot be inside a JSON string: json.loads refuses it).
_TEXT_ESCAPE = re.compile(r"\\(?:u(?:00[01]|007[fF]|00[89]|[dD][89a-fA-F]|202[a-eA-E]|206[6-9])|[bfr])")
_TEXT_RAW = re.compile("[\x7f-\x9f\ud800-\udfff" + _BIDI + "]")


def text_needs_cleaning(text: str) -> bool:
    """Whether the JSON text ``text`` may decode to a string :func:`clean_text` changes (the
    length bound aside: readers of files keep long strings). Cheap for the usual line: ASCII
    without such escapes."""
    if "\\" in text and _TEXT_ESCAPE.search(text) is not None:
        return True
    if text.isascii():
        return "\x7f" in text
    return _TEXT_RAW.search(text) is not None


def needs_cleaning(raw: bytes) -> bool:
    """False only when the JSON text ``raw`` cannot decode to a string with a character
    :func:`clean_text` replaces: no escape, no non-ASCII byte (C1 characters and encoded
    surrogates are non-ASCII), no DEL (raw C0 is not valid JSON inside a string). Three scans
    in C, a few nanoseconds per event; it says nothing of length (see :func:`clean_tree`)."""
    return not raw.isascii() or b"\\" in raw or b"\x7f" in raw


MAX_LOG_TEXT = 512  # characters of another user's text in one log line or error reply (before escaping)
_LOG_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _log_char(c: str) -> str:
    if c in _LOG_ESCAPES:
        return _LOG_ESCAPES[c]
    if c.isprintable():
        return c
    n = ord(c)
    return "\\x%02x" % n if n < 0x100 else "\\u%04x" % n if n < 0x10000 else "\\U%08x" % n


def log_text(v: object, limit: int = MAX_LOG_TEXT) -> str:
    """``v`` (another user's text: a producer id, a service name, a file name) as one bounded line
    for a log or an error reply: backslash and every character that is not printable (newline, CR,
    ESC, bidirectional controls, line separators) escaped as ``repr`` does, at most ``limit``
    characters of it kept (the rest counted). Apply it once, where such text enters a log line: a
    producer id ``x\\n2026-12-04 ... ERROR ...`` had written a whole forged line into the log."""
    s = v if isinstance(v, str) else str(v)
    more = len(s) - limit
    if more > 0:
        s = s[:limit]
    if "\\" in s or not s.isprintable():
        s = "".join(_log_char(c) for c in s)
    return s + "...(%d more)" % more if more > 0 else s


ANSI_CSI = re.compile(r"\x1b\[[0-9;?]{0,32}[A-Za-z]")  # a terminal's CSI sequences: colours, cursor moves


def strip_ansi(text: str) -> str:
    """``text`` without terminal colours and cursor moves (an engine's coloured log: no meaning to the rules)."""
    return ANSI_CSI.sub("", text) if "\x1b" in text else text


def terminal_line(s: str) -> str:
    """``s`` as one line of a terminal's output (a waterfall row, a verdict line): every character that is not
    printable (newline, CR, ESC, bidirectional controls) escaped as ``repr`` does. An attribute value keeps its
    newlines at ingest (log bodies need them): another user's stage name must not print lines of its own."""
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else _log_char(c) for c in s)
