"""``analyse`` with the needle index against trying every serving rule on every candidate line, side by side.

    python bench/analyse_index.py [--rounds 7]

Two inputs: a 16 KiB capture of a busy needle stream (llama-server's per-request KV-cache lines, what launch's
stderr relay hands over while CMD logs flat out) and every message of the labelled sets in tests/support/data
(1,000+ engine and PyTorch texts, each analysed once). Each round times both ways in alternation (the index,
then every rule tried by replacing ``ServingRules.rules_for``); prints the median of each and their ratio, and
checks that both ways found the same things.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from infersight.rules import serving

DATA = Path(__file__).resolve().parent.parent / "tests" / "support" / "data"


def stream_capture() -> str:
    lines = ["slot update_slots: id  0 | task %d | kv cache rm [%d, end)" % (i, i) for i in range(400)]
    return "\n".join(lines)[: 16 * 1024]


def labelled() -> list[str]:
    out: list[str] = []
    for f in sorted(DATA.glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                d = json.loads(line)
                text = d.get("message") or d.get("text")
                if isinstance(text, str):
                    out.append(text)
    return out


def timed(texts: list[str], rs: serving.ServingRules) -> tuple[float, list[Any]]:
    t0 = time.perf_counter()
    found = [[(f.rule, f.cls, f.key) for f in serving.analyse(t, rs)] for t in texts]
    return time.perf_counter() - t0, found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    rs = serving.builtin()
    indexed = serving.ServingRules.rules_for
    every = lambda self, line: self.rules  # noqa: E731 - the behaviour before the index
    for name, texts in (("16 KiB needle-stream capture", [stream_capture()]), ("labelled sets", labelled())):
        a: list[float] = []
        b: list[float] = []
        same = True
        timed(texts, rs)  # patterns compiled, caches warm
        for _ in range(args.rounds):
            serving.ServingRules.rules_for = indexed  # type: ignore[method-assign]
            ta, fa = timed(texts, rs)
            serving.ServingRules.rules_for = every  # type: ignore[method-assign,assignment]
            tb, fb = timed(texts, rs)
            serving.ServingRules.rules_for = indexed  # type: ignore[method-assign]
            a.append(ta)
            b.append(tb)
            same = same and fa == fb
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{name} ({len(texts)} text(s)): index {ma * 1e3:.1f} ms, every rule {mb * 1e3:.1f} ms, "
              f"ratio {ma / mb:.2f}; same findings: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
