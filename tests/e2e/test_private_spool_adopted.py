"""Events a user's process spooled before the user was in the socket's group reach the agent.

Not yet in the group, a served process cannot write the system spool: its hooks spool under the
user's own state directory, which the agent never reads. After the documented fix (the user added
to the group, the server restarted) those events stayed there for good (a review of the systemd
path). A later process of the user that reaches the agent now moves the files of ended processes
into the agent's spool, where the agent replays them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import hook_env, read_otlp_lines, spans, wait_for

EARLY = """
from infersight import hooks
with hooks.stage("early_build"):
    pass
hooks.mark_ready()
hooks.first_response()
"""

LATER = """
import time
from infersight import hooks
with hooks.stage("later_build"):
    pass
hooks.mark_ready()
hooks.first_response()
hooks.flush(5)
time.sleep(1.0)
"""


def test_a_later_process_moves_what_an_earlier_one_spooled_where_the_agent_does_not_look(
        agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory().start()
    agent.spool.mkdir(mode=0o700, exist_ok=True)  # as tmpfiles.d makes /var/lib/infersight/spool
    state_home = tmp_path / "home-state"
    private = state_home / "infersight" / "spool"
    early = hook_env(tmp_path / "no-agent.sock", agent.spool, XDG_STATE_HOME=str(state_home))
    early.pop("INFERSIGHT_SPOOL_DIR")  # as a service that names none: the system spool, else the private one
    r = subprocess.run([sys.executable, "-c", EARLY], env=early, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    left = list(private.glob("*.spool"))
    assert len(left) == 1, (r.stderr, list(private.iterdir()) if private.exists() else None)
    later = hook_env(agent.sock, agent.spool, XDG_STATE_HOME=str(state_home))
    r = subprocess.run([sys.executable, "-c", LATER], env=later, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "moved 1 spool file(s)" in r.stderr and str(private) in r.stderr, r.stderr
    assert not list(private.glob("*.spool"))
    assert wait_for(lambda: {"coldstart.early_build", "coldstart.later_build"}
                    <= {s["name"] for s in spans(read_otlp_lines(agent.out))}, 30), agent.status()["counters"]
    assert agent.status()["counters"]["spool_files_replayed"] >= 1
