"""``infersight status``'s ``lost`` line (text): the producers' sequence gaps and, beside them, what the
exporters lost (tests/integration/test_status_lost_at_exporters.py has a real agent on a full disk)."""

from __future__ import annotations

from typing import Any

from infersight.agent.commands.status import describe


def lost_line(h: dict[str, Any]) -> str:
    (line,) = [ln for ln in describe(h).splitlines() if ln.startswith("  lost ")]
    return line.split(None, 1)[1]


def exporter(name: str, lost: int) -> dict[str, Any]:
    return {"name": name, "lost_items": lost, "dropped_items": lost + 2, "rejected_items": 2}


def test_both_figures_side_by_side_with_the_exporters_that_lost() -> None:
    h = {"healthy": False, "lost": 3, "lost_at_exporters": 120,
         "exporters": [exporter("file", 100), exporter("otlp", 0), exporter("mqtt", 20)]}
    assert lost_line(h) == ("3 event(s) in producers' sequence gaps; 120 item(s) exporters could neither deliver "
                            "nor keep (file 100, mqtt 20)")


def test_nothing_lost_says_so_for_both() -> None:
    h = {"healthy": True, "lost": 0, "lost_at_exporters": 0, "exporters": [exporter("file", 0)]}
    assert lost_line(h) == "0 event(s) in producers' sequence gaps; 0 item(s) exporters could neither deliver nor keep"


def test_an_older_agents_reply_has_the_gaps_alone() -> None:
    """An agent from before ``lost_at_exporters``: the exporters' figure is not made up from ``dropped_items``
    (which holds the peer's refusals too)."""
    h = {"healthy": True, "lost": 5, "exporters": [{"name": "file", "dropped_items": 7}]}
    assert lost_line(h) == "5 event(s) in producers' sequence gaps"
