"""Events the agent cannot take do not turn the hooks off, nor hold back the events after them.

A 2 MB log made a batch frame over the wire's 1 MiB bound: the agent refused it, the hooks resent it at
every reconnect, and every later event of the process was lost, uncounted. One attribute JSON cannot hold
(a dict with a tuple key, an object whose ``__str__`` raises, ...) disabled the drain thread. Now: ``hooks.log``
cuts and converts on the caller's thread, an event no frame can hold (a stage attribute of 2 MB, one that
cannot be encoded) is dropped alone and counted, and the count reaches the agent.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import attr, hook_env, log_records, read_otlp_lines, wait_for

CODE = r'''
import sys
from infersight import hooks
from infersight.hooks import _runtime

class Raises:
    def __str__(self):
        raise RuntimeError("boom")
    __repr__ = __str__

cycle = {}
cycle["self"] = cycle
for i in range(5):
    hooks.log("before", i=i)
hooks.log("x" * 2_000_000, i=100)                          # cut, sent
hooks.log("tuplekey", i=101, attr={(1, 2): 3})             # converted, sent
hooks.log("obj", i=102, attr=Raises())
hooks.log("cycle", i=103, attr=cycle)
hooks.log("bigint", i=104, attr=10**5000)
hooks.metric("m.bad", 1.0, attr=Raises())
with hooks.stage("huge", big="y" * 2_000_000):             # no frame holds it: dropped, counted
    pass
with hooks.stage("bad", obj=Raises()):                     # cannot be encoded: dropped, counted
    pass
for i in range(1000, 2000):
    hooks.log("after " + "z" * 3000, i=i)                  # ~3 MB after: several frames
assert hooks.flush(30), "flush"
c = _runtime.state().client
print("active", hooks.active(), c.enabled, c._thread.is_alive(), c.unencodable, c.dropped_buffer)
'''


def test_big_and_bad_events_leave_the_hooks_working_and_are_counted(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    script = tmp_path / "w.py"
    script.write_text(CODE)
    r = subprocess.run([sys.executable, str(script)], env=hook_env(agent.sock, agent.spool, INFERSIGHT_SAMPLER="0"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["active", "True", "True", "True", "2", "2"], (r.stdout, r.stderr)
    assert "drain thread disabled" not in r.stderr and "hooks disabled" not in r.stderr, r.stderr
    assert r.stderr.count("could not be sent") == 2, r.stderr  # one line per reason
    assert wait_for(lambda: agent.status()["dropped_by_producers"] == 2, 20), agent.status()
    st = agent.status()
    assert st["counters"].get("oversized_frames", 0) == 0, st
    assert agent.stop() == 0
    recs = log_records(read_otlp_lines(agent.out))
    got = {int(attr(rec, "i")): rec for rec in recs if attr(rec, "i") is not None}
    assert set(got) == set(range(5)) | {100, 101, 102, 103, 104} | set(range(1000, 2000))
    body = got[100]["body"]["stringValue"]
    assert body.startswith("xxx") and body.endswith("chars]") and len(body) <= 4096
    assert attr(got[101], "attr") is not None
