"""OTLP JSON lines file, as the Collector's file exporter writes it, with size rotation."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import IO

from infersight.agent.model import Item
from infersight.exporters.base import ExportError
from infersight.exporters.otlp_json import encode_lines


class FileExporter:
    """Appends one ``Export*ServiceRequest`` per line; rotates to ``PATH.1`` ... ``PATH.N``."""

    def __init__(self, path: str, max_bytes: int = 256 << 20, backups: int = 3) -> None:
        self.name = "file"
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._fh: IO[str] | None = None
        self._size = 0
        self.lines = 0
        self.items = 0
        self.errors = 0
        self.rotations = 0
        self.last_error = ""

    async def start(self) -> None:
        await asyncio.to_thread(self._open)

    def _open(self) -> None:
        if self._fh is None:
            d = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(d, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open
            self._size = self._fh.tell()

    def _rotate(self) -> None:
        assert self._fh is not None
        self._fh.close()
        self._fh = None
        for i in range(self.backups - 1, 0, -1):
            src = "%s.%d" % (self.path, i)
            if os.path.exists(src):
                os.replace(src, "%s.%d" % (self.path, i + 1))
        if self.backups > 0:
            os.replace(self.path, self.path + ".1")
        else:
            os.unlink(self.path)
        self.rotations += 1
        self._open()

    def _write(self, batch: Sequence[Item]) -> None:
        lines = encode_lines(batch)
        if not lines:
            return
        self._open()
        assert self._fh is not None
        data = "\n".join(lines) + "\n"
        n = len(data.encode("utf-8")) if not data.isascii() else len(data)
        if self._size and self._size + n > self.max_bytes:
            self._rotate()
            assert self._fh is not None
        self._fh.write(data)
        self._fh.flush()
        self._size += n
        self.lines += len(lines)
        self.items += len(batch)

    async def export(self, batch: Sequence[Item]) -> None:
        try:
            await asyncio.to_thread(self._write, batch)
        except OSError as exc:  # disk full, permissions: the worker counts and spools
            self.errors += 1
            self.last_error = str(exc)
            if self._fh is not None:
                try:
                    self._fh.close()
                except OSError:
                    pass
                self._fh = None
            raise ExportError("cannot write %s: %s" % (self.path, exc)) from exc

    async def force_flush(self, timeout_s: float) -> bool:
        def sync() -> None:
            if self._fh is not None:
                self._fh.flush()
                os.fsync(self._fh.fileno())

        try:
            await asyncio.wait_for(asyncio.to_thread(sync), timeout_s)
        except (OSError, TimeoutError):
            return False
        return True

    async def shutdown(self) -> None:
        await self.force_flush(5.0)
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def state(self) -> dict[str, int | float | str]:
        return {
            "path": self.path,
            "lines": self.lines,
            "items": self.items,
            "errors": self.errors,
            "rotations": self.rotations,
            "last_error": self.last_error,
        }
