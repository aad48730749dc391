"""Figures of issue 24 on the labelled serving-engine messages in tests/support/data.

    python bench/serving_oom_measure.py

Four sets: the 30 given messages (``serving_ooms_given.jsonl``), the messages collected
in the first pass (``serving_ooms_collected.jsonl``) that no rule example quotes, the messages
collected and labelled in the second pass before its rule changes (``serving_ooms_unseen.jsonl``,
again without those a rule example quotes: the honest estimate on unseen messages), and all of
them. Prints recognised share, right share on the clear ones with each class's
recall, the share of unclear ones answered ``unknown`` with a reason, and false alarms on
the real non-memory errors; then every miss.
"""

from __future__ import annotations

import json
from pathlib import Path

from infersight.rules.serving_measure import score

DATA = Path(__file__).resolve().parent.parent / "tests" / "support" / "data"


def load(name: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(x) for x in (DATA / name).read_text(encoding="utf-8").splitlines() if x.strip()]


def main() -> None:
    given = load("serving_ooms_given.jsonl")
    collected = load("serving_ooms_collected.jsonl")
    second = load("serving_ooms_unseen.jsonl")
    unseen = [r for r in collected if not r.get("in_rule_examples")]
    unseen2 = [r for r in second if not r.get("in_rule_examples")]
    everything = given + collected + second
    for title, recs in (("given (30)", given), (f"collected, in no rule example ({len(unseen)})", unseen),
                        (f"second pass, labelled before its rules, in no rule example ({len(unseen2)})", unseen2),
                        (f"all ({len(everything)})", everything)):
        s = score(recs)
        print(f"== {title}")
        for line in s.lines():
            print("  " + line)
        for m in s.misses:
            print("  miss: " + m)


if __name__ == "__main__":
    main()
