"""Readiness around stage rules (issue 23, Ray Serve): a socket that starts listening inside a
rule's call (Ray's core worker RPC server inside ``ray.init``) is that call's machinery, not
readiness; a rule with ``ready = true`` makes the process ready when its outermost call
returns (``serve.run``, a Serve replica's init). Sockets are opened with ``_socket`` so that
only the kernel's listening tables can see them, as with a C++ server."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import launch, stage_name  # noqa: E402

from infersight.agent.coldstart.stage_rules_check import check_files  # noqa: E402
from infersight.rules.stage_rules import StageRuleFileError  # noqa: E402

pytestmark = pytest.mark.slow

RULES = """\
engine_version = "1.0"

[[stage]]
id = "site.rpc_start"
stage = "rpc_start"
targets = ["rpclib:start_rpc"]
[[stage.examples]]
run = "rpclib"

[[stage]]
id = "site.deploy"
stage = "deploy"
targets = ["rpclib:deploy"]
ready = {ready}
[[stage.examples]]
run = "rpclib"
"""

LIB = '''
import _socket, json, os, socket, sys, time

def listen_in_c():
    s = _socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(8)  # _socket's own listen: no Python wrapper sees it, only the kernel's tables
    return s

def start_rpc():
    s = listen_in_c()  # an RPC server a start-up call opens (Ray's core worker)
    time.sleep(0.4)  # several sampler ticks while it listens inside the call
    return s

def deploy():
    time.sleep(0.3)
'''

APP = '''
import json, sys, time
import rpclib

rpc = rpclib.start_rpc()
rpclib.deploy()
time.sleep(0.4)  # after the rule's call: ready already when the rule says so
t_server = time.time_ns()
server = rpclib.listen_in_c()  # the service's own socket
time.sleep(0.4)
with open(sys.argv[1], "w") as f:
    json.dump({"rpc_port": rpc.getsockname()[1], "server_port": server.getsockname()[1], "t_server": t_server}, f)
'''


def run(tmp_path: Path, ready: str):  # type: ignore[no-untyped-def]
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "rpc.toml").write_text(RULES.format(ready=ready))
    (tmp_path / "rpclib.py").write_text(textwrap.dedent(LIB))
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(APP))
    r = launch(str(tmp_path), [sys.executable, str(app)], "--rules-dir", str(rules),
               env={"PYTHONPATH": str(tmp_path)})
    assert r.rc == 0, r.output[-3000:]
    root = next(x for x in r.roots() if x.parent_span_id is None)
    return r, root, {stage_name(s): s for s in r.stages(root)}


def test_a_socket_listening_inside_a_rule_call_is_not_readiness(tmp_path: Path) -> None:
    r, root, stages = run(tmp_path, "false")
    ready = stages["ready_wait"]
    assert ready.attributes["infersight.ready.source"] == "listening_socket"
    assert ready.attributes["server.port"] == r.result["server_port"] != r.result["rpc_port"], (
        root.attributes, {stage_name(s): (s.start_ns, s.end_ns) for s in stages.values()}, r.result, r.output[-2000:])
    assert ready.end_ns >= r.result["t_server"]  # not inside or right after rpc_start
    assert root.attributes["infersight.coldstart.ended_by"] == "ready"


def test_a_ready_rule_makes_the_process_ready_when_its_call_returns(tmp_path: Path) -> None:
    r, root, stages = run(tmp_path, "true")
    ready = stages["ready_wait"]
    assert ready.attributes["infersight.ready.source"] == "stage_rule"
    assert ready.attributes["infersight.stage.rule"] == "site.deploy"
    assert root.end_ns == ready.end_ns and ready.end_ns >= stages["deploy"].end_ns
    assert root.attributes["infersight.coldstart.ended_by"] == "ready"
    assert root.end_ns < r.result["t_server"]  # neither the later socket nor the exit


def test_ready_must_be_a_bare_boolean_both_readers_agree(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(RULES.format(ready='"yes"'))
    with pytest.raises(StageRuleFileError,
                       match=r'bad.toml:\d+: site.deploy: ready must be true, false, "entry" or "helper"'):
        check_files([bad])
    good = tmp_path / "good.toml"
    good.write_text(RULES.format(ready="true"))
    assert [r.ready for r in check_files([good]).rules] == ["", "return"]


NEST_RULES = """\
engine_version = "1.0"

[[stage]]
id = "site.cluster_start"
stage = "cluster_start"
targets = ["clusterlib:start_cluster"]
[[stage.examples]]
run = "clusterlib"

[[stage]]
id = "site.replicas_wait"
stage = "replicas_wait"
targets = ["clusterlib:wait_for_replicas"]
[[stage.examples]]
run = "clusterlib"
"""

CLUSTER = '''
import os, subprocess, sys, time

def start_cluster(go, done):
    # a daemon that is no Python (the raylet): it starts workers later, with the environment
    # it was given now (TRACEPARENT names this stage)
    child = "%s %s %s" % (sys.executable, os.path.join(os.path.dirname(__file__), "replica.py"), done)
    return subprocess.Popen(["sh", "-c", "while [ ! -e %s ]; do sleep 0.02; done; %s" % (go, child)])

def wait_for_replicas(go, done):
    open(go, "w").close()  # the daemon starts the replica now
    while not os.path.exists(done):
        time.sleep(0.02)
'''

NEST_APP = '''
import json, os, sys
import clusterlib

go, done = os.path.join(os.path.dirname(sys.argv[1]), "go"), os.path.join(os.path.dirname(sys.argv[1]), "done")
daemon = clusterlib.start_cluster(go, done)
clusterlib.wait_for_replicas(go, done)
daemon.wait()
with open(sys.argv[1], "w") as f:
    json.dump({"daemon": daemon.pid}, f)
'''

REPLICA = '''
import json, os, sys, time
time.sleep(0.05)
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({"replica": os.getpid()}, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
'''


def test_a_worker_another_process_starts_nests_under_the_parents_span_of_the_moment(tmp_path: Path) -> None:
    """Ray's raylet (here a shell) starts the replica the driver waits for, long after it was
    itself started inside ray.init: the replica's root hangs under the driver's wait, not under
    the stage the daemon's environment names. Without the parent's ``current`` span it would."""
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "cluster.toml").write_text(NEST_RULES)
    (tmp_path / "clusterlib.py").write_text(textwrap.dedent(CLUSTER))
    (tmp_path / "replica.py").write_text(textwrap.dedent(REPLICA))
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(NEST_APP))
    r = launch(str(tmp_path), [sys.executable, str(app)], "--rules-dir", str(rules),
               env={"PYTHONPATH": str(tmp_path)})
    assert r.rc == 0, r.output[-3000:]
    driver = next(x for x in r.roots() if x.parent_span_id is None)
    stages = {stage_name(s): s for s in r.stages(driver)}
    replica = [x for x in r.roots() if x.resource.get("process.command") == "replica.py"]
    assert len(replica) == 1, [x.resource for x in r.roots()]
    assert replica[0].parent_span_id == stages["replicas_wait"].span_id
    assert replica[0].trace_id == driver.trace_id
