"""Score the serving rules on a labelled set of engine messages (tests and bench/ share it).

A record has ``message`` and ``label``: ``capacity``, ``reservation_conflict``,
``fragmentation`` (clear), ``unclear`` (the evidence does not decide) or ``not_oom`` (a
non-memory error of the same engines). The figures are the ones issue 24 sets targets for, and two
that tell the misses apart: a clear message answered ``unknown`` (the text did not carry the thread's
evidence) and a confident class that is wrong (the costlier miss).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from infersight.rules.serving import Finding, ServingRules, analyse

CLEAR = ("capacity", "reservation_conflict", "fragmentation")


@dataclass
class Score:
    memory_errors: int = 0
    recognised: int = 0
    clear: int = 0
    clear_right: int = 0
    per_class: dict[str, list[int]] = field(default_factory=lambda: {c: [0, 0] for c in CLEAR})
    unclear: int = 0
    unclear_unknown: int = 0
    clear_unknown: int = 0  # clear by its thread, answered unknown
    wrong_clear: int = 0  # clear, answered another confident class
    wrong_unclear: int = 0  # unclear, answered a confident class
    negatives: int = 0
    false_alarms: int = 0
    misses: list[str] = field(default_factory=list)

    def rate(self, a: int, b: int) -> float:
        return a / b if b else 1.0

    def lines(self) -> list[str]:
        def share(a: int, b: int) -> str:
            return f"{a}/{b} ({self.rate(a, b):.0%})"

        out = [
            f"recognised      {share(self.recognised, self.memory_errors)}",
            f"clear right     {share(self.clear_right, self.clear)}",
        ]
        for c, (right, n) in self.per_class.items():
            out.append(f"  {c:<21} recall {share(right, n)}")
        out.append(f"unclear unknown {share(self.unclear_unknown, self.unclear)}")
        committed = self.clear_right + self.wrong_clear
        out.append(f"clear, when a class was given: right {share(self.clear_right, committed)}")
        out.append(f"clear answered unknown {self.clear_unknown}; confident but wrong "
                   f"{self.wrong_clear + self.wrong_unclear} (clear {self.wrong_clear}, unclear {self.wrong_unclear})")
        out.append(f"false alarms    {self.false_alarms}/{self.negatives}")
        return out


def first_finding(message: str, rules: ServingRules | None = None) -> Finding | None:
    found = analyse(message, rules)
    return found[0] if found else None


def score(records: Iterable[Mapping[str, Any]], rules: ServingRules | None = None) -> Score:
    s = Score()
    for r in records:
        label = r["label"]
        f = first_finding(r["message"], rules)
        rid = str(r.get("id"))
        if label == "not_oom":
            s.negatives += 1
            if f is not None:
                s.false_alarms += 1
                s.misses.append(f"{rid}: false alarm {f.rule}")
            continue
        s.memory_errors += 1
        if f is None:
            s.misses.append(f"{rid}: not recognised")
            if label in CLEAR:
                s.clear += 1
                s.per_class[label][1] += 1
            else:
                s.unclear += 1
            continue
        s.recognised += 1
        if label in CLEAR:
            s.clear += 1
            s.per_class[label][1] += 1
            if f.cls == label:
                s.clear_right += 1
                s.per_class[label][0] += 1
            else:
                if f.cls == "unknown":
                    s.clear_unknown += 1
                else:
                    s.wrong_clear += 1
                s.misses.append(f"{rid}: {label} answered {f.cls} ({f.rule})")
        else:
            s.unclear += 1
            if f.cls == "unknown" and f.reason:
                s.unclear_unknown += 1
            else:
                if f.cls != "unknown":
                    s.wrong_unclear += 1
                s.misses.append(f"{rid}: unclear answered {f.cls} ({f.rule})")
    return s
