"""Figures of issue 24 on the labelled serving-engine messages in tests/support/data.

    python bench/serving_oom_measure.py

The sets, in the order they were collected (``PASSES``): the 30 given messages (``serving_ooms_given.jsonl``);
the first pass (``serving_ooms_collected.jsonl``) and the second (``serving_ooms_unseen.jsonl``, labelled before its
rule changes), each without the messages a rule example quotes; the third pass (``serving_ooms_collected2.jsonl``),
split by URL hash before any rule ran on it (``split``: ``tune``, which rule changes could look at, and
``held_out``); the fourth (``serving_ooms_collected3.jsonl``, all held out, measured once with the rules of that day
before the changes its misses led to); and from the fifth on (``serving_ooms_collected4.jsonl`` to
``serving_ooms_collected17.jsonl``) passes collected and labelled by hands that did not run or read the rules, split
the same way (the first hex digit of the SHA-256 of ``url`` below 8 giving ``tune``) and committed before any rule
ran on them, each in its two halves and (from the sixth on) whole; then all of them together.
Prints recognised share, right share on the clear ones with each class's recall, the share of unclear ones answered
``unknown`` with a reason, and false alarms on the real non-memory errors; then every miss.
"""

from __future__ import annotations

import json
from pathlib import Path

from infersight.rules.serving_measure import score

DATA = Path(__file__).resolve().parent.parent / "tests" / "support" / "data"

ORDINALS = ("fifth", "sixth", "seventh", "eighth", "ninth", "tenth", "eleventh", "twelfth", "thirteenth",
            "fourteenth", "fifteenth", "sixteenth", "seventeenth", "eighteenth")
# The blind passes from the fifth on: serving_ooms_collected4.jsonl ... serving_ooms_collected17.jsonl.
BLIND_FILES = tuple((name, f"serving_ooms_collected{n}.jsonl") for n, name in enumerate(ORDINALS, start=4))
# Passes printed whole as well as in halves (the fifth was printed in halves only).
WHOLE_TOO = frozenset(ORDINALS[1:])


def load(name: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(x) for x in (DATA / name).read_text(encoding="utf-8").splitlines() if x.strip()]


def half(records: list[dict], split: str) -> list[dict]:  # type: ignore[type-arg]
    return [r for r in records if r["split"] == split]


def rows() -> list[tuple[str, list[dict]]]:  # type: ignore[type-arg]
    """Each printed row: its title and its records."""
    given = load("serving_ooms_given.jsonl")
    collected = load("serving_ooms_collected.jsonl")
    second = load("serving_ooms_unseen.jsonl")
    third = load("serving_ooms_collected2.jsonl")
    fourth = load("serving_ooms_collected3.jsonl")
    unseen = [r for r in collected if not r.get("in_rule_examples")]
    unseen2 = [r for r in second if not r.get("in_rule_examples")]
    tune3, held3 = half(third, "tune"), half(third, "held_out")
    out = [("given (30)", given), (f"collected, in no rule example ({len(unseen)})", unseen),
           (f"second pass, labelled before its rules, in no rule example ({len(unseen2)})", unseen2),
           (f"third pass, tuning half ({len(tune3)})", tune3), (f"third pass, held-out half ({len(held3)})", held3),
           (f"fourth pass ({len(fourth)})", fourth)]
    everything = given + collected + second + third + fourth
    for name, file in BLIND_FILES:
        records = load(file)
        everything += records
        tune, held = half(records, "tune"), half(records, "held_out")
        if name in WHOLE_TOO:
            out.append((f"{name} pass ({len(records)})", records))
        out += [(f"{name} pass, tuning half ({len(tune)})", tune), (f"{name} pass, held-out half ({len(held)})", held)]
    out.append((f"all ({len(everything)})", everything))
    return out


def main() -> None:
    for title, recs in rows():
        s = score(recs)
        print(f"== {title}")
        for line in s.lines():
            print("  " + line)
        for m in s.misses:
            print("  miss: " + m)


if __name__ == "__main__":
    main()
