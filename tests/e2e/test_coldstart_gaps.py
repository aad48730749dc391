"""Every second of a cold start named, without torch: every outermost import is timed,
stages cut imports, gaps become ``unattributed`` spans explained by the sampler, helper
processes are marked, and a supervisor's cold start is its workers'. Real processes under
``infersight launch``; the pure pieces (gaps, top labels, roles, waterfall rows) directly."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import LaunchRun, assert_well_formed, launch, stage_name  # noqa: E402

from infersight.agent.commands.show import coldstarts  # noqa: E402
from infersight.coldstart_stages import tree_coverage, union_ns  # noqa: E402
from infersight.exporters.waterfall import coverage, render_waterfall  # noqa: E402
from infersight.hooks import _proc, _sampler  # noqa: E402
from infersight.telemetry import ColdStart, Resource, SpanItem  # noqa: E402

# Two packages of our own: ``alpha`` sleeps at import and imports ``beta`` (which sleeps too),
# so the breakdown has both; ``loader_app`` opens a user stage inside its own import.
PACKAGES = {
    "alpha/__init__.py": "import time\ntime.sleep(0.12)\nfrom alpha import sub  # noqa\nimport beta  # noqa\n",
    "alpha/sub.py": "X = 1\n",
    "beta/__init__.py": "import time\ntime.sleep(0.08)\n",
    "loader_app.py": textwrap.dedent("""\
        import time
        from infersight import hooks
        time.sleep(0.06)
        with hooks.stage("load_things"):
            import gamma  # noqa: F401  (an import inside a stage inside an import)
            time.sleep(0.1)
        time.sleep(0.06)
        """),
    "gamma.py": "import time\ntime.sleep(0.03)\n",
}

MAIN = textwrap.dedent("""\
    import importlib.util, json, sys, time
    spec = importlib.util.find_spec("delta")          # a find_spec() that is not an import
    loader_type = type(spec.loader).__name__
    import alpha
    time.sleep(0.3)                                  # a gap nobody names
    import loader_app
    json.dump({"loader_type": loader_type}, open(sys.argv[1], "w"))
    """)


def write_tree(tmp: str) -> None:
    for rel, text in {**PACKAGES, "delta.py": "D = 1\n", "main.py": MAIN}.items():
        path = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> LaunchRun:
    tmp = str(tmp_path_factory.mktemp("gaps"))
    write_tree(tmp)
    r = launch(tmp, [sys.executable, os.path.join(tmp, "main.py")], env={"PYTHONPATH": tmp})
    assert r.rc == 0, r.output
    return r


def _only_root(r: LaunchRun) -> SpanItem:
    roots = [x for x in r.roots() if x.attributes.get("infersight.process.role") != "helper"]
    assert len(roots) == 1, roots
    return roots[0]


def test_every_outermost_import_is_timed_with_a_package_breakdown(run: LaunchRun) -> None:
    root = _only_root(run)
    stages = run.stages(root)
    imports = [s for s in stages if stage_name(s) == "framework_import"]
    alpha = next(s for s in imports if any(p.startswith("alpha ") for p in s.attributes["infersight.import.packages"]))
    pkgs = {p.split()[0]: float(p.split()[1]) for p in alpha.attributes["infersight.import.packages"]}
    assert {"alpha", "beta"} <= set(pkgs)
    assert pkgs["alpha"] >= 0.12 and pkgs["beta"] >= 0.08  # beta's time is beta's, not alpha's
    assert alpha.end_ns - alpha.start_ns >= 0.2e9
    assert alpha.attributes["infersight.framework"] == "alpha"
    assert_well_formed(root, stages)


def test_find_spec_outside_an_import_gets_the_real_loader(run: LaunchRun) -> None:
    assert run.result["loader_type"] == "SourceFileLoader"


def test_a_stage_inside_an_import_cuts_it(run: LaunchRun) -> None:
    root = _only_root(run)
    stages = run.stages(root)
    load = next(s for s in stages if stage_name(s) == "load_things")
    assert load.parent_span_id == root.span_id  # a sibling of the import, not inside it
    around = [s for s in stages if stage_name(s) == "framework_import"
              and any(p.startswith("loader_app ") for p in s.attributes["infersight.import.packages"])]
    assert len(around) == 2, around  # before and after the stage
    assert around[0].end_ns <= load.start_ns and load.end_ns <= around[1].start_ns
    assert not any(p.startswith("gamma ") for s in around for p in s.attributes["infersight.import.packages"])
    # the stage's own import is a framework_import under it
    (inner,) = [s for s in stages if stage_name(s) == "framework_import" and s.parent_span_id == load.span_id]
    assert inner.attributes["infersight.framework"] == "gamma"
    assert load.start_ns <= inner.start_ns and inner.end_ns <= load.end_ns


def test_a_gap_becomes_an_unattributed_span_with_the_sampler_top(run: LaunchRun) -> None:
    root = _only_root(run)
    gaps = [s for s in run.stages(root) if stage_name(s) == "unattributed"]
    big = [g for g in gaps if g.end_ns - g.start_ns >= 0.25e9]
    assert len(big) == 1, gaps
    top = big[0].attributes["infersight.unattributed.top"]
    assert isinstance(top, list) and 1 <= len(top) <= 5
    assert big[0].attributes["infersight.unattributed.samples"] >= _sampler.MIN_SAMPLES
    assert top[0].startswith("__main__:<module> ") and top[0].endswith("%")
    # not covered: the root's unattributed time includes it, and the waterfall says so
    assert root.attributes["infersight.coldstart.unattributed_s"] >= 0.25
    cs = next(c for c in coldstarts(run.spans) if c.root.span_id == root.span_id)
    assert coverage(cs) < 1 - 0.25e9 / (root.end_ns - root.start_ns) + 1e-9
    text = render_waterfall(cs)
    assert "gap at" in text and "__main__:<module>" in text
    rows = [line for line in text.splitlines() if line.startswith("  framework_import")]
    assert len(rows) == 1 and " x" in rows[0]  # one top-level row, however many runs
    assert [line for line in text.splitlines() if line.startswith("    framework_import")]  # gamma's, in load_things


def test_helper_processes_are_marked_and_not_printed(tmp_path) -> None:
    code = ("import subprocess, sys\n"
            "subprocess.run([sys.executable, '-c', 'import json'], check=True)\n")
    r = launch(str(tmp_path), [sys.executable, "-c", code], result=False)
    assert r.rc == 0, r.output
    roles = sorted(str(x.attributes.get("infersight.process.role")) for x in r.roots())
    assert roles == ["None", "helper"]  # the launched `python -c` is not a helper; its probe is
    assert r.output.count("infersight cold start:") == 1


SUPERVISOR = textwrap.dedent("""\
    import multiprocessing as mp, socket, sys, time

    def worker(port):
        from infersight import hooks
        from infersight.hooks import _readiness
        # The worker tells its supervisor once the agent has acked its root (the order under
        # test), waiting REPORT_FLUSH_S at most: here, however long a loaded machine takes.
        _readiness.REPORT_FLUSH_S = 600.0
        import alpha  # noqa: F401  (a worker's own cold start: imports, then serve)
        time.sleep(0.3)             # in no stage: a gap of the worker's, covered for nobody
        with hooks.stage("bind"):   # (a stage after it, else ready_wait would run from alpha's end)
            s = None
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()                  # the worker is ready
        c, _ = s.accept()
        c.sendall(b"ok")
        hooks.first_response()      # and served its first request
        c.close()

    def request(port):              # the first request, once the worker listens
        while True:
            try:
                c = socket.create_connection(("127.0.0.1", port))
                c.recv(2)
                return
            except OSError:
                time.sleep(0.05)

    if __name__ == "__main__":      # the supervisor: starts the worker, waits
        port = int(sys.argv[1])
        p = mp.get_context("spawn").Process(target=worker, args=(port,))
        p.start()
        request(port)
        p.join()
        time.sleep(0.5)             # after its worker served: not the supervisor's cold start
    """)


def test_a_supervisor_that_exits_right_after_its_worker_served_still_ends_by_its_workers(tmp_path) -> None:
    # uvicorn's supervisor, stopped after the first response, joins its workers and exits at once: the
    # worker's report is written before the supervisor's exit, but maybe after the sampler's last tick
    from conftest import free_port

    tmp = str(tmp_path)
    write_tree(tmp)
    with open(os.path.join(tmp, "sup.py"), "w") as f:
        f.write(SUPERVISOR.replace("    time.sleep(0.5)             # after its worker served: not the supervisor's "
                                   "cold start\n", ""))
    r = launch(tmp, [sys.executable, os.path.join(tmp, "sup.py"), str(free_port())], result=False,
               env={"PYTHONPATH": tmp})
    assert r.rc == 0, r.output
    roots = [x for x in r.roots() if x.attributes.get("infersight.process.role") != "helper"]
    parent = next(x for x in roots if x.parent_span_id is None)
    child = next(x for x in roots if x.parent_span_id is not None)
    assert parent.attributes["infersight.coldstart.ended_by"] == "workers", r.output
    assert parent.end_ns == child.end_ns


NESTED = textwrap.dedent("""\
    import multiprocessing as mp, subprocess, sys
    from sup import request, worker  # SUPERVISOR's

    if __name__ == "__main__" and sys.argv[1] == "supervisor":
        # started by another hooked process (a command, not a multiprocessing child: it leaves through the
        # interpreter's exit handlers), it reports to that one in turn
        from infersight.hooks import _readiness
        _readiness.REPORT_FLUSH_S = 600.0  # report after the agent's ack (the order under test)
        # ... also when the sampler's tick, not the exit handler, ends the root (its worker's report came just
        # before the exit): the exit handler waits for that thread FINISH_WAIT_S, which a loaded machine's ack
        # outlasted (the process then exited before its report)
        _readiness.FINISH_WAIT_S = 600.0
        p = mp.get_context("spawn").Process(target=worker, args=(int(sys.argv[2]),))
        p.start()
        p.join()  # and exits at once, as uvicorn's supervisor does once stopped
    elif __name__ == "__main__":
        port = int(sys.argv[1])
        p = subprocess.Popen([sys.executable, __file__, "supervisor", str(port)])
        request(port)
        p.wait()
    """)


def test_a_supervisor_ended_by_its_workers_at_exit_still_reports_to_its_own_parent(tmp_path) -> None:
    # the middle process ends its root in its exit handler: its report to the top one is sent in line there
    # (a thread started by an exit handler is never joined)
    from conftest import free_port

    tmp = str(tmp_path)
    write_tree(tmp)
    for name, text in (("sup.py", SUPERVISOR), ("nested.py", NESTED)):
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    r = launch(tmp, [sys.executable, os.path.join(tmp, "nested.py"), str(free_port())], result=False,
               env={"PYTHONPATH": tmp})
    assert r.rc == 0, r.output
    roots = [x for x in r.roots() if x.attributes.get("infersight.process.role") != "helper"]
    assert len(roots) == 3, r.roots()
    top = next(x for x in roots if x.parent_span_id is None)
    middle = next(x for x in roots if x.parent_span_id == top.span_id)
    assert middle.attributes["infersight.coldstart.ended_by"] == "workers", r.output
    assert top.attributes["infersight.coldstart.ended_by"] == "workers", r.output


def test_process_role_rules() -> None:
    assert _proc.process_role(["-c"], launched=False, env={}) == "helper"
    assert _proc.process_role(["-c", "--multiprocessing-fork"], launched=False, env={}) == ""
    assert _proc.process_role(["-c"], launched=True, env={}) == ""
    assert _proc.process_role(["/x/torch/_inductor/compile_worker/__main__.py"], False, env={}) == "helper"
    assert _proc.process_role(["app.py"], False, env={"INFERSIGHT_PROCESS_ROLE": "helper"}) == "helper"
    assert _proc.process_role(["app.py"], False, env={}) == ""


def test_uncovered_and_top_labels() -> None:
    ms = 1_000_000
    assert _sampler.uncovered([(0, 10 * ms), (100 * ms, 120 * ms)], 0, 300 * ms) == [
        (10 * ms, 100 * ms), (120 * ms, 300 * ms)]
    assert _sampler.uncovered([(0, 10 * ms), (40 * ms, 300 * ms)], 0, 300 * ms) == []  # 30 ms: too short
    assert _sampler.uncovered([], 0, 60 * ms) == [(0, 60 * ms)]
    samples = [(t, "a:f") for t in range(6)] + [(t, "b:g") for t in range(6, 8)] + [(100, "c:h")]
    assert _sampler.top_labels(samples, 0, 10) == ["a:f 75%", "b:g 25%"]
    assert _sampler.top_labels(samples, 50, 60) == []


def test_too_few_samples_name_no_frame() -> None:
    """A 200 ms gap with one or two samples (a garbage collection that ran then) must not
    print ``regex...Group.__del__ 100%``: below the minimum no frame is named, on either side."""
    from infersight.coldstart_stages import MIN_TOP_SAMPLES

    assert MIN_TOP_SAMPLES == _sampler.MIN_SAMPLES  # the hooks and the renderers agree
    few = [(10, "regex._regex_core:Group.__del__"), (20, "regex._regex_core:Group.__del__")]
    assert _sampler.top_labels(few, 0, 200) == []
    enough = [(t, "app:load") for t in range(_sampler.MIN_SAMPLES)]
    assert _sampler.top_labels(enough, 0, 200) == ["app:load 100%"]
    r = "r" * 16
    gaps = [  # one from hooks that predate the minimum (a top for 2 samples), one with enough
        _span("coldstart.unattributed", "3" * 16, r, 1.0, 1.2, **{
            "infersight.unattributed.top": ["regex._regex_core:Group.__del__ 100%"],
            "infersight.unattributed.samples": 2}),
        _span("coldstart.unattributed", "4" * 16, r, 3.0, 3.5, **{
            "infersight.unattributed.top": ["app:load 100%"], "infersight.unattributed.samples": 48}),
    ]
    text = render_waterfall(ColdStart(_span("coldstart", r, None, 0.0, 10.0), gaps, []))
    assert "Group.__del__" not in text
    assert "gap at 1.000 s, 0.200 s: 2 samples: too few to name a frame" in text
    assert "gap at 3.000 s, 0.500 s (48 samples): app:load 100%" in text


def test_sampler_labels_skip_the_standard_library() -> None:
    import json

    s = _sampler.Sampler(0)
    captured = []

    def default(_o: object) -> str:
        captured.append(s.label(sys._getframe()))
        return "x"

    json.dumps(object(), default=default)  # json's encoder frames sit between us and the leaf
    assert captured == ["test_coldstart_gaps:test_sampler_labels_skip_the_standard_library.<locals>.default"]


def _span(name: str, sid: str, parent: str | None, s: float, e: float, pid: int = 7, **a: object) -> SpanItem:
    attrs = dict(a)
    if name.startswith("coldstart."):
        attrs["infersight.stage"] = name.split(".", 1)[1]
    return SpanItem(Resource.of({"process.pid": pid}), "a" * 32, sid, parent, name, int(s * 1e9), int(e * 1e9),
                    attrs)  # type: ignore[arg-type]


def test_waterfall_groups_runs_and_nests_workers() -> None:
    r = "r" * 16
    stages = [
        _span("coldstart.framework_import", "1" * 16, r, 0.0, 1.0,
              **{"infersight.import.packages": ["torch 0.80 s", "numpy 0.10 s"]}),
        _span("coldstart.framework_import", "2" * 16, r, 2.0, 3.0,
              **{"infersight.import.packages": ["transformers 0.90 s"]}),
        _span("coldstart.unattributed", "3" * 16, r, 1.0, 2.0,
              **{"infersight.unattributed.top": ["app:load 60%", "app:wait 40%"]}),
    ]
    worker = _span("coldstart", "w" * 16, r, 3.0, 10.0, pid=8, **{"infersight.coldstart.ended_by": "first_request"})
    root = _span("coldstart", r, None, 0.0, 10.0)
    # The worker's named stages cover 3-9 s: its last second is in no stage of anyone's.
    cs = ColdStart(root, stages, [worker], [(3 * 10**9, 9 * 10**9)])
    text = render_waterfall(cs)
    row = next(line for line in text.splitlines() if "framework_import" in line)
    assert "framework_import x2" in row and "transformers 0.90 s, torch 0.80 s, numpy 0.10 s" in row
    assert "worker pid 8" in text
    assert "gap at 1.000 s, 1.000 s: app:load 60%, app:wait 40%" in text
    assert coverage(cs) == pytest.approx(0.2)  # its own: two import seconds of ten
    assert tree_coverage(cs) == pytest.approx(0.8)  # and its worker's stages, not the worker's lifetime
    assert "covered by named stages: 20.0% own, 80.0% with its worker's stages" in text
    assert text.splitlines()[0].endswith("10.000 s, covered 20.0% own, 80.0% tree")


def test_supervisor_cold_start_is_its_workers(tmp_path) -> None:
    from conftest import free_port

    tmp = str(tmp_path)
    write_tree(tmp)
    with open(os.path.join(tmp, "sup.py"), "w") as f:
        f.write(SUPERVISOR)
    r = launch(tmp, [sys.executable, os.path.join(tmp, "sup.py"), str(free_port())], result=False,
               env={"PYTHONPATH": tmp})
    assert r.rc == 0, r.output
    roots = [x for x in r.roots() if x.attributes.get("infersight.process.role") != "helper"]
    assert len(roots) == 2, r.roots()
    parent = next(x for x in roots if x.parent_span_id is None)
    child = next(x for x in roots if x.parent_span_id is not None)
    assert child.trace_id == parent.trace_id
    assert child.attributes["infersight.coldstart.ended_by"] == "ready"  # the worker listened
    assert parent.attributes["infersight.coldstart.ended_by"] == "workers"
    assert parent.end_ns == child.end_ns  # the worker's readiness; not the half second it waited after
    cs = next(c for c in coldstarts(r.spans) if c.root.span_id == parent.span_id)
    assert [w.span_id for w in cs.workers] == [child.span_id]
    # Each figure is computed from the spans themselves: the process's own stages, and the
    # tree's (its own and its worker's named stages), never the worker's whole lifetime.
    total = parent.end_ns - parent.start_ns
    own = [(s.start_ns, s.end_ns) for s in cs.stages if stage_name(s) != "unattributed"]
    worker_stages = r.stages(child)
    named = [(s.start_ns, s.end_ns) for s in worker_stages if stage_name(s) != "unattributed"]
    own_ns = union_ns(own, parent.start_ns, parent.end_ns)
    tree_ns = union_ns(own + named, parent.start_ns, parent.end_ns)
    assert coverage(cs) == pytest.approx(own_ns / total)
    assert tree_coverage(cs) == pytest.approx(tree_ns / total)
    assert parent.attributes["infersight.coldstart.unattributed_s"] == pytest.approx((total - own_ns) / 1e9)
    assert parent.attributes["infersight.coldstart.tree_unattributed_s"] == pytest.approx((total - tree_ns) / 1e9)
    # The worker's own gap (the sleep) is in no stage of anyone's: not covered in the tree.
    gap = next(s for s in worker_stages if stage_name(s) == "unattributed" and s.end_ns - s.start_ns >= 0.25e9)
    in_gap = union_ns(own, gap.start_ns, gap.end_ns)
    assert tree_ns <= total - (gap.end_ns - gap.start_ns - in_gap)
    assert own_ns < tree_ns  # the worker's stages cover the supervisor's wait in the tree's figure
    assert "covered %.1f%% own, %.1f%% tree" % (100 * own_ns / total, 100 * tree_ns / total) in r.output
    assert "with its worker's stages" in r.output, r.output
    assert "worker pid %s" % child.resource.get("process.pid") in r.output


def test_children_dir_planted_by_another_uid_is_refused(tmp_path) -> None:
    """The report directory lives under the spool dir: a directory or symlink planted there
    by another user is never written to nor read."""
    from infersight.hooks import _workers

    nobody = 65534
    own = _workers.children_dir(str(tmp_path / "spool"), "p1")
    os.makedirs(own, mode=0o700)
    assert _workers.report(own, 1, 2, "first_request")
    assert _workers.reports(own) == [(1, 2, "first_request")]
    os.chown(own, nobody, nobody)  # squatted by uid nobody
    assert not _workers.report(own, 3, 4, "first_request")
    assert _workers.reports(own) == []
    assert not _workers.prepare(own)
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = _workers.children_dir(str(tmp_path / "spool"), "p2")
    os.symlink(target, link)  # a symlink in place of the directory
    assert not _workers.prepare(link)
    assert not _workers.report(link, 1, 2, "first_request")
    assert list(target.iterdir()) == []


def test_children_dir_is_removed_when_the_cold_start_ends(tmp_path) -> None:
    import subprocess

    from conftest import BOOTSTRAP

    spool = tmp_path / "spool"
    script = tmp_path / "main.py"
    script.write_text("import os\nprint(os.environ['INFERSIGHT_CHILDREN_DIR'])\n"
                      "print(os.path.isdir(os.environ['INFERSIGHT_CHILDREN_DIR']))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSIGHT")}
    env.update({"PYTHONPATH": str(BOOTSTRAP), "INFERSIGHT_SOCKET": str(tmp_path / "absent.sock"),
                "INFERSIGHT_SPOOL_DIR": str(spool), "INFERSIGHT_EXIT_FLUSH_S": "0"})
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True,
                         timeout=60).stdout.split()
    assert out[1] == "True"  # there while the cold start runs
    assert out[0].startswith(str(spool)) and not os.path.exists(out[0])  # gone after it


def test_children_dir_of_a_killed_process_is_swept_by_the_next(tmp_path) -> None:
    """A process killed before its cold start ended leaves its report directory; the next
    hooked process sweeps those whose producer is gone, and keeps a live one's."""
    import signal
    import subprocess

    from conftest import BOOTSTRAP

    from infersight.hooks import _proc, _workers

    spool = tmp_path / "spool"
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERSIGHT")}
    env.update({"PYTHONPATH": str(BOOTSTRAP), "INFERSIGHT_SOCKET": str(tmp_path / "absent.sock"),
                "INFERSIGHT_SPOOL_DIR": str(spool), "INFERSIGHT_EXIT_FLUSH_S": "0"})
    script = tmp_path / "main.py"  # a script, not ``python -c`` (a helper: no report directory)
    script.write_text("import os, time\nprint(os.environ['INFERSIGHT_CHILDREN_DIR'], flush=True)\ntime.sleep(60)\n")
    killed = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    assert killed.stdout is not None
    left = killed.stdout.readline().strip()
    killed.send_signal(signal.SIGKILL)
    killed.wait(10)
    assert os.path.isdir(left)  # no exit handler removed it
    live = _workers.children_dir(str(spool), _proc.producer_id())  # this test's own process: alive
    assert _workers.prepare(live)
    stale_boot = _workers.children_dir(str(spool), "000000000000-%d-1" % os.getpid())  # before a reboot
    os.makedirs(stale_boot, mode=0o700)
    (tmp_path / "next.py").write_text("pass\n")
    subprocess.run([sys.executable, str(tmp_path / "next.py")], env=env, check=True, timeout=60)
    assert not os.path.exists(left) and not os.path.exists(stale_boot)
    assert os.path.isdir(live)
