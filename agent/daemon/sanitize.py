"""The one place where a producer's frame is decoded: JSON, then every string made safe.

:mod:`infersight.sanitize` holds the rules; this applies them to each frame the socket or a
spool file hands the agent, so that no sink downstream sees a control character, a lone
surrogate or an unbounded string from another user.
"""

from __future__ import annotations

from typing import Any

from infersight.hooks import _wire
from infersight.sanitize import TooDeepError, clean_tree, needs_cleaning


def decode_frame(payload: bytes) -> dict[str, Any] | None:
    """The frame's object with clean strings; None when it is not a JSON object (or nests
    deeper than any schema of ours). A hello (one per connection) is always walked, so that
    its strings are bounded too."""
    msg: dict[str, Any] | None = _wire.decode_payload(payload)
    if msg is None or (not needs_cleaning(payload) and msg.get("t") != "hello"):
        return msg  # events: plain ASCII, and the assembler bounds each string's length
    try:
        cleaned: dict[str, Any] = clean_tree(msg)
    except (TooDeepError, RecursionError):
        return None
    return cleaned
