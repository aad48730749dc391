"""Byte counts for people, in binary units: ``512 B``, ``1.5 KiB``, ``2.00 GiB`` (pure)."""

from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


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
