"""infersight's root exception and the one way to say where in a file a problem is.

Every package derives its own base from :class:`InfersightError` (``RulesError``,
``AgentError``, ...), so ``except InfersightError`` catches what infersight raises on
purpose. A problem in a source file (the agent's config, an OOM rule file,
``devices.toml``) is a :class:`SourceError` carrying :class:`Location` s; its text is
``file:line:col: message``, or ``file:line: message`` where the column adds nothing
(the problem is a key or its whole value, which the line names).

Neutral: imports nothing of ours, so every package can use it.
"""

from __future__ import annotations

from dataclasses import dataclass


class InfersightError(Exception):
    """Root of the exceptions infersight raises on purpose."""


@dataclass(frozen=True, order=True, slots=True)
class Location:
    """A place in a source file; sorts by file, line, column."""

    file: str
    line: int  # 1-based
    column: int = 0  # 1-based; 0 when the line says enough

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}" if self.column else f"{self.file}:{self.line}"


class SourceError(InfersightError):
    """A problem in a source file. ``locations[0]`` is where it is; any further ones are
    related places. Without a location (a value from the environment or a flag, which the
    message names) the text is the bare message."""

    def __init__(self, message: str, *locations: Location) -> None:
        super().__init__(f"{locations[0]}: {message}" if locations else message)
        self.message = message
        self.locations: list[Location] = list(locations)


def undecodable(file: str, exc: UnicodeDecodeError) -> tuple[Location, str]:
    """Where a file that is not UTF-8 has its first bad byte (line and column), and what to do."""
    data = exc.object if isinstance(exc.object, (bytes, bytearray)) else b""
    head = bytes(data[: exc.start])
    line = head.count(b"\n") + 1
    column = exc.start - (head.rfind(b"\n") + 1) + 1
    byte = f"byte 0x{data[exc.start]:02x}" if exc.start < len(data) else "a byte"
    return Location(file, line, column), f"not UTF-8: {byte} cannot be read (save the file as UTF-8)"
