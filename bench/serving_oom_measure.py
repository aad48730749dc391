"""Figures of issue 24 on the labelled serving-engine messages in tests/support/data.

    python bench/serving_oom_measure.py

The sets: the 30 given messages (``serving_ooms_given.jsonl``), the messages collected in the
first pass (``serving_ooms_collected.jsonl``) that no rule example quotes, the second pass
(``serving_ooms_unseen.jsonl``, labelled before its rule changes, again without those a rule
example quotes), the third pass (``serving_ooms_collected2.jsonl``) in its two halves, split by
URL hash before any rule ran on them (``split``: ``tune``, which rule changes could look at, and
``held_out``), the fourth pass (``serving_ooms_collected3.jsonl``, all held out, measured once with
the rules of that day before the changes its misses led to), the fifth pass
(``serving_ooms_collected4.jsonl``, split like the third by URL hash, the first hex digit of the SHA-256
of ``url`` below 8 giving ``tune``, before any rule ran on it), the sixth pass
(``serving_ooms_collected5.jsonl``, split the same way and committed before any rule ran on it), the seventh
pass (``serving_ooms_collected6.jsonl``, collected blind by another hand, split the same way and committed before any
rule ran on it), the ninth pass (``serving_ooms_collected8.jsonl``, collected blind by a hand that did not run or
read the rules, split the same way and committed before any rule ran on it), the tenth pass
(``serving_ooms_collected9.jsonl``, collected, split and committed the same way), the eleventh pass
(``serving_ooms_collected10.jsonl``, the same), the twelfth pass (``serving_ooms_collected11.jsonl``, the same),
the thirteenth (``serving_ooms_collected12.jsonl``, the same, the issue's engines only), the fourteenth
(``serving_ooms_collected13.jsonl``, the same), the fifteenth (``serving_ooms_collected14.jsonl``, the same), the
sixteenth (``serving_ooms_collected15.jsonl``, the same, mostly downstream projects), and all of them.
Prints recognised share, right share on the clear ones with each class's recall, the share of unclear ones answered
``unknown`` with a reason, and false alarms on the real non-memory errors; then every miss.
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
    third = load("serving_ooms_collected2.jsonl")
    fourth = load("serving_ooms_collected3.jsonl")
    fifth = load("serving_ooms_collected4.jsonl")
    sixth = load("serving_ooms_collected5.jsonl")
    seventh = load("serving_ooms_collected6.jsonl")
    eighth = load("serving_ooms_collected7.jsonl")
    ninth = load("serving_ooms_collected8.jsonl")
    tenth = load("serving_ooms_collected9.jsonl")
    eleventh = load("serving_ooms_collected10.jsonl")
    twelfth = load("serving_ooms_collected11.jsonl")
    thirteenth = load("serving_ooms_collected12.jsonl")
    fourteenth = load("serving_ooms_collected13.jsonl")
    fifteenth = load("serving_ooms_collected14.jsonl")
    sixteenth = load("serving_ooms_collected15.jsonl")
    unseen = [r for r in collected if not r.get("in_rule_examples")]
    unseen2 = [r for r in second if not r.get("in_rule_examples")]
    tune3 = [r for r in third if r["split"] == "tune"]
    held3 = [r for r in third if r["split"] == "held_out"]
    tune5 = [r for r in fifth if r["split"] == "tune"]
    held5 = [r for r in fifth if r["split"] == "held_out"]
    tune6 = [r for r in sixth if r["split"] == "tune"]
    held6 = [r for r in sixth if r["split"] == "held_out"]
    tune7 = [r for r in seventh if r["split"] == "tune"]
    held7 = [r for r in seventh if r["split"] == "held_out"]
    tune8 = [r for r in eighth if r["split"] == "tune"]
    held8 = [r for r in eighth if r["split"] == "held_out"]
    tune9 = [r for r in ninth if r["split"] == "tune"]
    held9 = [r for r in ninth if r["split"] == "held_out"]
    tune10 = [r for r in tenth if r["split"] == "tune"]
    held10 = [r for r in tenth if r["split"] == "held_out"]
    tune11 = [r for r in eleventh if r["split"] == "tune"]
    held11 = [r for r in eleventh if r["split"] == "held_out"]
    tune12 = [r for r in twelfth if r["split"] == "tune"]
    held12 = [r for r in twelfth if r["split"] == "held_out"]
    tune13 = [r for r in thirteenth if r["split"] == "tune"]
    held13 = [r for r in thirteenth if r["split"] == "held_out"]
    tune14 = [r for r in fourteenth if r["split"] == "tune"]
    held14 = [r for r in fourteenth if r["split"] == "held_out"]
    tune15 = [r for r in fifteenth if r["split"] == "tune"]
    held15 = [r for r in fifteenth if r["split"] == "held_out"]
    tune16 = [r for r in sixteenth if r["split"] == "tune"]
    held16 = [r for r in sixteenth if r["split"] == "held_out"]
    everything = (given + collected + second + third + fourth + fifth + sixth + seventh + eighth + ninth + tenth
                  + eleventh + twelfth + thirteenth + fourteenth + fifteenth + sixteenth)
    for title, recs in (("given (30)", given), (f"collected, in no rule example ({len(unseen)})", unseen),
                        (f"second pass, labelled before its rules, in no rule example ({len(unseen2)})", unseen2),
                        (f"third pass, tuning half ({len(tune3)})", tune3),
                        (f"third pass, held-out half ({len(held3)})", held3),
                        (f"fourth pass ({len(fourth)})", fourth),
                        (f"fifth pass, tuning half ({len(tune5)})", tune5),
                        (f"fifth pass, held-out half ({len(held5)})", held5),
                        (f"sixth pass ({len(sixth)})", sixth),
                        (f"sixth pass, tuning half ({len(tune6)})", tune6),
                        (f"sixth pass, held-out half ({len(held6)})", held6),
                        (f"seventh pass ({len(seventh)})", seventh),
                        (f"seventh pass, tuning half ({len(tune7)})", tune7),
                        (f"seventh pass, held-out half ({len(held7)})", held7),
                        (f"eighth pass ({len(eighth)})", eighth),
                        (f"eighth pass, tuning half ({len(tune8)})", tune8),
                        (f"eighth pass, held-out half ({len(held8)})", held8),
                        (f"ninth pass ({len(ninth)})", ninth),
                        (f"ninth pass, tuning half ({len(tune9)})", tune9),
                        (f"ninth pass, held-out half ({len(held9)})", held9),
                        (f"tenth pass ({len(tenth)})", tenth),
                        (f"tenth pass, tuning half ({len(tune10)})", tune10),
                        (f"tenth pass, held-out half ({len(held10)})", held10),
                        (f"eleventh pass ({len(eleventh)})", eleventh),
                        (f"eleventh pass, tuning half ({len(tune11)})", tune11),
                        (f"eleventh pass, held-out half ({len(held11)})", held11),
                        (f"twelfth pass ({len(twelfth)})", twelfth),
                        (f"twelfth pass, tuning half ({len(tune12)})", tune12),
                        (f"twelfth pass, held-out half ({len(held12)})", held12),
                        (f"thirteenth pass ({len(thirteenth)})", thirteenth),
                        (f"thirteenth pass, tuning half ({len(tune13)})", tune13),
                        (f"thirteenth pass, held-out half ({len(held13)})", held13),
                        (f"fourteenth pass ({len(fourteenth)})", fourteenth),
                        (f"fourteenth pass, tuning half ({len(tune14)})", tune14),
                        (f"fourteenth pass, held-out half ({len(held14)})", held14),
                        (f"fifteenth pass ({len(fifteenth)})", fifteenth),
                        (f"fifteenth pass, tuning half ({len(tune15)})", tune15),
                        (f"fifteenth pass, held-out half ({len(held15)})", held15),
                        (f"sixteenth pass ({len(sixteenth)})", sixteenth),
                        (f"sixteenth pass, tuning half ({len(tune16)})", tune16),
                        (f"sixteenth pass, held-out half ({len(held16)})", held16),
                        (f"all ({len(everything)})", everything)):
        s = score(recs)
        print(f"== {title}")
        for line in s.lines():
            print("  " + line)
        for m in s.misses:
            print("  miss: " + m)


if __name__ == "__main__":
    main()
