"""Figures of issue 24 on the labelled serving-engine messages in tests/data.

    python bench/serving_oom_measure.py

Three sets: the 30 given messages (``serving_ooms_given.jsonl``), the messages collected
from other public threads (``serving_ooms_collected.jsonl``) that no rule example quotes,
and all of them. Prints recognised share, right share on the clear ones with each class's
recall, the share of unclear ones answered ``unknown`` with a reason, and false alarms on
the real non-memory errors; then every miss.
"""

from __future__ import annotations

import json
from pathlib import Path

from infersight.rules.serving_measure import score

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


def load(name: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(x) for x in (DATA / name).read_text(encoding="utf-8").splitlines() if x.strip()]


def main() -> None:
    given = load("serving_ooms_given.jsonl")
    collected = load("serving_ooms_collected.jsonl")
    unseen = [r for r in collected if not r.get("in_rule_examples")]
    for title, recs in (("given (30)", given), (f"collected, in no rule example ({len(unseen)})", unseen),
                        (f"all ({len(given) + len(collected)})", given + collected)):
        s = score(recs)
        print(f"== {title}")
        for line in s.lines():
            print("  " + line)
        for m in s.misses:
            print("  miss: " + m)


if __name__ == "__main__":
    main()
