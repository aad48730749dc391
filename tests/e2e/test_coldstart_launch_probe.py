"""launch --ready-url / --probe, for a hooked Python server and for a CMD without hooks."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import HERE, assert_well_formed, launch, stage_name  # noqa: E402
from ports import free_port  # noqa: E402


def test_ready_url_and_probe_hooked(tmp_path) -> None:
    port = free_port()
    base = "http://127.0.0.1:%d" % port
    run = launch(str(tmp_path), [sys.executable, os.path.join(HERE, "ready_server.py"), str(port), "0.4"],
                 "--ready-url", base + "/health", "--probe", base + "/", result=False)
    assert run.rc == 0, run.output
    root = [r for r in run.roots() if r.attributes.get("infersight.coldstart.source") != "launcher"][0]
    stages = run.stages(root)
    rw = [s for s in stages if stage_name(s) == "ready_wait"]
    assert len(rw) == 1 and rw[0].attributes["infersight.ready.source"] == "ready_url"
    assert (rw[0].end_ns - root.start_ns) / 1e9 >= 0.4  # /health said 503 for 0.4 s
    probe = [s for s in run.spans if s.name == "infersight.probe"]
    assert len(probe) == 1
    assert probe[0].parent_span_id == root.span_id and probe[0].trace_id == root.trace_id
    assert probe[0].attributes["http.response.status_code"] == 200
    assert float(probe[0].attributes["infersight.probe.ttfb_s"]) >= 0.04  # the server sleeps 0.05 s
    assert "probe GET %s/" % base in run.output
    assert_well_formed(root, stages)


def test_ready_wait_covers_the_idle_wait_before_a_health_handler_import(tmp_path) -> None:
    """The server idles between launch's polls; the successful poll's handler imports a
    module. That import is the request's work: ready_wait still covers the wait before it
    (it used to start after the import and leave the wait unattributed)."""
    port = free_port()
    base = "http://127.0.0.1:%d" % port
    run = launch(str(tmp_path), [sys.executable, os.path.join(HERE, "ready_server.py"), str(port), "0.4", "lazy"],
                 "--ready-url", base + "/health", "--probe", base + "/", result=False)
    assert run.rc == 0, run.output
    root = [r for r in run.roots() if r.attributes.get("infersight.coldstart.source") != "launcher"][0]
    stages = sorted(run.stages(root), key=lambda s: s.start_ns)
    names = [stage_name(s) for s in stages]
    i = names.index("ready_wait")
    assert "unattributed" not in names[:i], names  # (after it: the / handler's sleep, no forward)
    assert (stages[i].end_ns - stages[i].start_ns) / 1e9 >= 0.3  # /health said 503 for 0.4 s
    lazy = stages[i + 1]
    assert stage_name(lazy) == "framework_import" and lazy.start_ns >= stages[i].end_ns
    assert any(p.startswith("slow_import ") for p in lazy.attributes["infersight.import.packages"])
    assert root.attributes["infersight.coldstart.ready_s"] >= (lazy.end_ns - root.start_ns) / 1e9
    assert_well_formed(root, stages)


def test_ready_url_and_probe_without_hooks(tmp_path) -> None:
    port = free_port()
    base = "http://127.0.0.1:%d" % port
    # -I ignores PYTHONPATH: this CMD runs no hooks, so the launcher's view is all there is.
    run = launch(str(tmp_path), ["sh", "-c", 'exec "$0" -I "$1" "$2" 0.3', sys.executable,
                                 os.path.join(HERE, "ready_server.py"), str(port)],
                 "--ready-url", base + "/health", "--probe", base + "/", result=False)
    assert run.rc == 0, run.output
    (root,) = run.roots()
    assert root.attributes["infersight.coldstart.source"] == "launcher"
    stages = run.stages(root)
    ready, first = sorted(stages, key=lambda s: s.start_ns)
    assert [stage_name(ready), stage_name(first)] == ["ready_wait", "first_request"]
    assert root.end_ns == ready.end_ns  # the root ends at readiness; the probe is the first request after it
    assert first.start_ns >= root.end_ns and root.attributes["infersight.coldstart.ended_by"] == "ready"
    assert_well_formed(root, [ready])


def test_exit_status_kept_with_probe(tmp_path) -> None:
    run = launch(str(tmp_path), [sys.executable, "-c", "import sys; sys.exit(3)"],
                 "--ready-url", "http://127.0.0.1:%d/" % free_port(), result=False)
    assert run.rc == 3
    assert "never ready" in run.output
