"""Checks on a chrome-trace document, shared by the ``show`` and hostile-report tests."""

from __future__ import annotations

from typing import Any


def complete_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def check_nesting(events: list[dict[str, Any]]) -> None:
    """Within one (pid, tid), complete events must nest: the trace viewers need it."""
    by: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        by.setdefault((e["pid"], e["tid"]), []).append(e)
    for evs in by.values():
        stack: list[float] = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1] + 1e-3, e["name"]
            stack.append(e["ts"] + e["dur"])
