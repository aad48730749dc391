"""Byte counts for people, in binary units: ``512 B``, ``1.5 KiB``, ``2.00 GiB``; and sizes
as programs print them, read back into bytes (pure)."""

from __future__ import annotations

import re

UNITS = ("B", "KiB", "MiB", "GiB", "TiB")

# A printed unit (lower case) -> bytes. Binary: KiB..., and a bare K, M, G... (XLA prints
# "15.65G"). Decimal: kB, MB, GB... as written (ggml prints MiB as "MB": its serving rules
# read those numbers as MiB counts, never through this table).
BYTE_UNITS = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50,
    "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40, "pi": 1 << 50,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "pb": 1000**5,
}  # fmt: skip
_SIZE = re.compile(r"\s{0,8}(\d{1,25}(?:\.\d{1,9})?)\s{0,8}([A-Za-z]{0,5})\s{0,8}")


def human_bytes(n: float, digits: int = 1) -> str:
    """``n`` in the largest unit it holds at least one of (TiB at most), with ``digits``
    decimals; whole bytes have none: ``human_bytes(1536)`` is ``1.5 KiB``."""
    sign = "-" if n < 0 else ""
    size, step = abs(n), 0
    while size >= 1024 and step < len(UNITS) - 1:
        size /= 1024
        step += 1
    return "%s%.*f %s" % (sign, digits if step else 0, size, UNITS[step])


def torch_bytes(n: float) -> str:
    """As PyTorch's OOM messages print sizes, two decimals: ``1.70 GiB``, ``138.00 MiB``, ``512 B``."""
    return human_bytes(n, 2)


def parse_bytes(text: str, unit: str | None = None) -> int | None:
    """``"1.70 GiB"``, ``"1.7GiB"``, ``"15.65G"`` (binary), ``"512 MB"`` (decimal), ``"0 bytes"``,
    ``"939524096"`` -> bytes; a bare number is in ``unit`` (default bytes). None when ``text``
    is no size (an unknown unit, no number)."""
    m = _SIZE.fullmatch(text)
    if m is None:
        return None
    mult = BYTE_UNITS.get((m.group(2) or unit or "").lower())
    if mult is None:
        return None
    return round(float(m.group(1)) * mult)
