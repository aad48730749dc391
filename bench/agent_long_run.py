"""Agent CPU and memory for a process that opens stages for ever: late rounds against early ones.

A served process may open a stage per request, here before any readiness (its cold start
never ends: the heavier case; stages after readiness are covered by the tests). The agent must
not track, keep or re-estimate more per span as their number grows: each round sends the same
20,000 stage spans through real hooks to a real
agent process; the agent's CPU per span (the run time of all its threads) in the last rounds is
compared with the first ones (medians of 8 rounds each), in the same run, and its RSS is
read after each round.

Before the fix, this bench gave late/early 5.7x (25 -> 145 us per span) and an RSS from 46
to 224 MiB over 800k spans: the progress tracker kept every top-level stage, every estimate
walked all of them in every run of the history, and the assembler kept spans pending for a
root that had long ended. After: 0.83-1.42 over three runs (no trend: this is the host's
noise), RSS 40.2 -> 40.7 MiB.

Run: python bench/agent_long_run.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from emit_vs_span import activate, start_agent_process  # bench/ is on sys.path when run as a script
from quiet_fleet import cpu_s  # nanosecond run time of the agent's threads

SPANS_PER_ROUND = 20_000
EDGE = 8  # rounds at each end (their median); the first round warms up


def agent_rss_mib(pid: int) -> float:
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    sock, spool, pid = start_agent_process()
    activate(sock, spool)
    from infersight import hooks
    from infersight.hooks import _runtime

    client = _runtime.state().client
    assert client is not None
    cpu_per_span: list[float] = []
    rss: list[float] = []
    for _ in range(max(args.rounds, 2 * EDGE + 1)):
        c0 = cpu_s(pid)[0]
        for i in range(SPANS_PER_ROUND):
            with hooks.stage("preprocess", request=i):
                pass
        assert client.flush(120), "the agent did not take a round within 120 s"
        time.sleep(0.3)  # the agent's progress tick runs after the last ack
        cpu_per_span.append((cpu_s(pid)[0] - c0) / SPANS_PER_ROUND)
        rss.append(agent_rss_mib(pid))
    early, late = statistics.median(cpu_per_span[1:EDGE + 1]), statistics.median(cpu_per_span[-EDGE:])
    print(json.dumps({
        "spans": SPANS_PER_ROUND * len(cpu_per_span),
        "agent_cpu_us_per_span_early": round(early * 1e6, 1),
        "agent_cpu_us_per_span_late": round(late * 1e6, 1),
        "late_over_early": round(late / early, 2),
        "agent_rss_mib_after_first_round": round(rss[0], 1),
        "agent_rss_mib_at_end": round(rss[-1], 1),
        "dropped": client.dropped_buffer + client.dropped_spool,
        "goal": "late_over_early about 1 and a flat RSS: nothing grows with the spans a process sends",
    }))


if __name__ == "__main__":
    main()
