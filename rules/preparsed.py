"""The shipped serving rules, pre-parsed: ``serving.parsed.json`` beside ``serving.toml``.

The process that meets a launch's first OOM loads the serving rules while the user waits for
the classification. tomllib is pure Python: parsing the 3,800 lines of ``serving.toml`` takes
about 20 ms there, and compiling its ~220 patterns about 17 ms more. The JSON holds the
parsed document with the length and CRC-32 of the TOML text it came from; a loader takes it
only for that exact text (a file edited since is parsed from TOML and checked like any
other), and then compiles each pattern at its first search (CI checks the shipped file whole,
examples included: tests/unit/test_rules_preparsed.py and test_oom_serving.py).

    python -m infersight.rules.preparsed      # rewrite it after editing serving.toml
"""

from __future__ import annotations

import json
import sys
import zlib
from importlib import resources
from pathlib import Path
from typing import Any

FORMAT = 1
SOURCE = "serving.toml"
PARSED = "serving.parsed.json"


def stamp(text: str) -> tuple[int, int]:
    """(characters, CRC-32 of the UTF-8 bytes): what ties a parsed document to its text."""
    return len(text), zlib.crc32(text.encode("utf-8"))


def render(text: str, document: dict[str, Any]) -> str:
    """The JSON file's text for ``document`` parsed from ``text`` (one line, stable)."""
    chars, crc = stamp(text)
    wrapper = {"format": FORMAT, "source": SOURCE, "source_chars": chars, "source_crc32": crc,
               "document": document}
    return json.dumps(wrapper, ensure_ascii=False, separators=(",", ":")) + "\n"


def document_for(text: str, parsed_text: str | None) -> dict[str, Any] | None:
    """The pre-parsed document when ``parsed_text`` was made from exactly ``text``; else None
    (missing, stale, another format or unreadable: the caller parses the TOML)."""
    if not parsed_text:
        return None
    try:
        wrapper = json.loads(parsed_text)
    except ValueError:
        return None
    if not isinstance(wrapper, dict) or wrapper.get("format") != FORMAT:
        return None
    chars, crc = stamp(text)
    doc = wrapper.get("document")
    if wrapper.get("source_chars") != chars or wrapper.get("source_crc32") != crc or not isinstance(doc, dict):
        return None
    return doc


def read_shipped(text: str) -> dict[str, Any] | None:
    """The shipped pre-parsed document for the shipped file's ``text``, or None."""
    try:
        parsed = resources.files("infersight.rules").joinpath(PARSED).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return document_for(text, parsed)


def main(argv: list[str]) -> int:
    """Write ``serving.parsed.json`` from ``serving.toml`` in the rules' folder (or the folder given)."""
    from infersight.tomlfile import loads

    folder = Path(argv[0]) if argv else Path(__file__).resolve().parent
    text = (folder / SOURCE).read_text(encoding="utf-8")
    (folder / PARSED).write_text(render(text, loads(text, str(folder / SOURCE))), encoding="utf-8")
    print(f"wrote {folder / PARSED}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
