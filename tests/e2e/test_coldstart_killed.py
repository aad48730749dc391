"""A worker SIGKILLed in its cold start (LitServe, BentoML and Ray workers at shutdown) still
shows the stages it finished, the runs it had open (an import run, a warmup) and its gaps
explained by the samples it took, up to its last checkpoint (about 100 ms before it died).
Real processes, a real agent; the agent's side of the checkpoint also directly."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import attr, hook_env, read_otlp_lines, spans, wait_for

from infersight.agent.coldstart.assembly import coldstart_assembler, state_of
from infersight.agent.daemon.assemble import Assembler

PACKAGES = {
    "alpha/__init__.py": "import time\ntime.sleep(0.1)\n",
    "beta/__init__.py": "import time\ntime.sleep(0.08)\n",
}

# Everything the process did is waited for as an event (its checkpoint shipped a sample taken
# after the last step, and the agent acked it), never for a time: then it dies, with no exit
# handler, at once.
DIE_AFTER_CHECKPOINT = """
def die():
    t = time.time_ns()
    deadline = time.monotonic() + 60  # (a bound, not a speed: a hang would say nothing)
    while _coldstart.state().checkpoint is None or _coldstart.state().checkpoint.shipped_ns < t:
        if time.monotonic() > deadline:
            sys.exit("no checkpoint was shipped")
        time.sleep(0.01)
    assert hooks.flush(10)
    print("dying", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""

KILLED_IN_A_GAP = textwrap.dedent("""
    import os, signal, sys, time
    from infersight import hooks
    from infersight.hooks import _coldstart
    import alpha  # noqa: F401
    with hooks.stage("load"):   # a stage that ends: it went out when it ended
        time.sleep(0.05)
    import beta  # noqa: F401   (an import run still open when it dies: no stage after it)

    def crunch():               # in no stage: the gap its samples explain
        t = time.monotonic()
        while time.monotonic() - t < 0.4:
            pass
    crunch()
""") + DIE_AFTER_CHECKPOINT + "die()\n"

KILLED_IN_WARMUP = textwrap.dedent("""
    import os, signal, sys, time
    from infersight import hooks
    from infersight.hooks import _coldstart
    import torch
    m = torch.nn.Linear(4, 4)
    with torch.no_grad():
        m(torch.zeros(1, 4))
        m(torch.zeros(1, 4))    # two warmup forwards; readiness never came
""") + DIE_AFTER_CHECKPOINT + "die()\n"

# Killed inside a long import (a worker's ``import torch`` at shutdown): the import is still
# open, so no run of it went out; its time is a gap explained by the samples taken inside it,
# which the checkpoint ships every TICK_S there too (a slower tick inside imports once kept up
# to 300 ms of them).
KILLED_IN_AN_IMPORT_PKG = textwrap.dedent("""
    import os, signal, sys, time
    from infersight import hooks
    from infersight.hooks import _coldstart

    def crunch_in_import():
        t = time.monotonic()
        while time.monotonic() - t < 1.6:  # about 16 samples at the import's 100 ms
            pass
    crunch_in_import()
""") + DIE_AFTER_CHECKPOINT + "die()\n"

KILLED_IN_AN_IMPORT = textwrap.dedent("""
    import alpha  # noqa: F401
    import slowpkg  # noqa: F401  (it dies in its body)
""")


def _run_killed(agent_factory, tmp_path: Path, script: str) -> tuple[dict, list[dict]]:  # type: ignore[no-untyped-def,type-arg]
    for rel, text in PACKAGES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    agent = agent_factory().start()
    env = hook_env(agent.sock, agent.spool)
    env["PYTHONPATH"] += ":" + str(tmp_path)
    main = tmp_path / "worker.py"  # a script, not ``python -c``: that is a helper, with no sampler
    main.write_text(script)
    proc = subprocess.run([sys.executable, str(main)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL and "dying" in proc.stdout, proc.stderr

    def roots() -> list[dict]:  # type: ignore[type-arg]
        return [s for s in spans(read_otlp_lines(agent.out)) if s["name"] == "coldstart"]

    assert wait_for(roots, 30), agent.log.read_text()
    (root,) = roots()
    assert attr(root, "infersight.coldstart.ended_by") == "producer_lost"
    stages = [s for s in spans(read_otlp_lines(agent.out)) if s["traceId"] == root["traceId"] and s is not root
              and s["name"].startswith("coldstart.")]
    for s in stages:
        assert int(s["startTimeUnixNano"]) >= int(root["startTimeUnixNano"])
        assert int(s["endTimeUnixNano"]) <= int(root["endTimeUnixNano"])
    assert len({s["spanId"] for s in stages}) == len(stages), "one span per span id"
    assert agent.stop() == 0
    return root, stages


def _named(stages: list[dict], name: str) -> list[dict]:  # type: ignore[type-arg]
    return [s for s in stages if s["name"] == "coldstart." + name]


def test_worker_killed_in_a_gap_keeps_its_stages_open_runs_and_samples(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, stages = _run_killed(agent_factory, tmp_path, KILLED_IN_A_GAP)
    assert _named(stages, "runtime_init") and _named(stages, "load")
    imports = _named(stages, "framework_import")
    packages = [p.split()[0] for s in imports for p in attr(s, "infersight.import.packages")["values"]
                for p in [p["stringValue"]]]
    assert "alpha" in packages  # emitted when the stage started
    assert "beta" in packages, "the import run still open when it died comes from its checkpoint"
    gaps = _named(stages, "unattributed")
    crunch_gap = [g for g in gaps if any("crunch" in v["stringValue"]
                                         for v in (attr(g, "infersight.unattributed.top") or {"values": []})["values"])]
    assert crunch_gap, "the gap is explained by the samples it sent before it died: %r" % gaps
    assert int(attr(crunch_gap[0], "infersight.unattributed.samples")) > 0
    load = _named(stages, "load")[0]
    assert int(crunch_gap[0]["startTimeUnixNano"]) >= int(load["endTimeUnixNano"])


def test_worker_killed_inside_an_import_keeps_the_samples_taken_there(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "slowpkg").mkdir()
    (tmp_path / "slowpkg" / "__init__.py").write_text(KILLED_IN_AN_IMPORT_PKG)
    root, stages = _run_killed(agent_factory, tmp_path, KILLED_IN_AN_IMPORT)
    packages = [p["stringValue"].split()[0] for s in _named(stages, "framework_import")
                for p in attr(s, "infersight.import.packages")["values"]]
    assert "alpha" in packages and "slowpkg" not in packages  # slowpkg's import never ended
    named = [g for g in _named(stages, "unattributed")
             if any("crunch_in_import" in v["stringValue"]
                    for v in (attr(g, "infersight.unattributed.top") or {"values": []})["values"])]
    assert named, "the open import's time is explained by its samples: %r" % _named(stages, "unattributed")
    assert int(attr(named[0], "infersight.unattributed.samples")) >= 5


def test_worker_killed_in_its_warmup_keeps_the_warmup(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    _root, stages = _run_killed(agent_factory, tmp_path, KILLED_IN_WARMUP)
    (warm,) = _named(stages, "warmup")
    assert int(attr(warm, "infersight.warmup.forwards")) == 2
    assert any("torch" in p["stringValue"] for s in _named(stages, "framework_import")
               for p in attr(s, "infersight.import.packages")["values"])


# -- the agent's side, directly ------------------------------------------------------------


def _hello(a: Assembler):  # type: ignore[no-untyped-def]
    return a.hello({"id": "p1", "pid": 1, "start_ns": 1_000, "trace_id": "a" * 32, "root_span_id": "b" * 16})


def _tick(seq: int, t: int, open_: list, times: list[int], labels: list[str]) -> list:  # type: ignore[type-arg]
    return [seq, t, "cs_tick", {"open": open_, "t": times, "i": list(range(len(times))), "l": labels}]


def test_checkpoint_of_a_producer_that_sent_its_root_is_dropped() -> None:
    a = _hello_assembler = coldstart_assembler("h")
    p = _hello(a)
    a.events(p, [_tick(1, 2_000, [["warmup", "c" * 16, "b" * 16, 1_500, 1_900, {}]], [1_600], ["m:f"])])
    assert state_of(p).checkpoint is not None
    a.events(p, [[2, 3_000, "span", {"n": "coldstart", "id": "b" * 16, "s": 1_000, "e": 3_000}]])
    assert state_of(p).checkpoint is None
    assert not [x for x in a.producer_lost(p) if getattr(x, "name", "").startswith("coldstart")]
    assert _hello_assembler.malformed == 0


def test_a_producer_with_only_a_checkpoint_is_watched_and_gets_its_root() -> None:
    """Killed before its first stage ended: the agent still watches its process (ingest asks
    ``awaits_end``), and closes its root with the run it had open."""
    a = coldstart_assembler("h")
    p = _hello(a)
    assert not a.awaits_end(p)
    a.events(p, [_tick(1, 2_000, [["framework_import", "c" * 16, "b" * 16, 1_500, 1_900, {}]], [1_600], ["m:f"])])
    assert a.awaits_end(p)
    names = [getattr(x, "name", "") for x in a.producer_lost(p)]
    assert "coldstart" in names and "coldstart.framework_import" in names
    assert not a.awaits_end(p)


def test_lost_producer_gets_its_open_runs_once_and_its_gaps() -> None:
    a = coldstart_assembler("h")
    p = _hello(a)
    ms = 1_000_000
    run = ["framework_import", "c" * 16, "b" * 16, 1_000, 100 * ms, {"infersight.import.packages": ["x 0.10 s"]}]
    spin = [100 * ms + i * ms for i in range(1, 31)]  # 30 samples in the gap before the run went out
    a.events(p, [
        _tick(1, 150 * ms, [run], [*spin, *(140 * ms + i * ms for i in range(9))],
              ["app:spin"] * 30 + ["app:wait"] * 9),
        # The run ended and went out on the main thread after the sampler had read it open:
        [2, 150 * ms, "span", {"n": "coldstart.framework_import", "id": "c" * 16, "p": "b" * 16, "s": 1_000,
                               "e": 100 * ms, "a": {"infersight.stage": "framework_import"}}],
        _tick(3, 400 * ms, [run], [300 * ms], ["app:spin"]),
    ])
    out = a.producer_lost(p)
    names = [getattr(x, "name", "") for x in out]
    assert names.count("coldstart.framework_import") == 0, "a run already seen is not made again"
    (gap,) = [x for x in out if getattr(x, "name", "") == "coldstart.unattributed"]
    assert (gap.start_ns, gap.end_ns) == (100 * ms, 400 * ms)
    assert gap.attributes["infersight.unattributed.samples"] == 40
    top = gap.attributes["infersight.unattributed.top"]
    assert isinstance(top, list) and str(top[0]).startswith("app:spin "), top  # as the hooks' sampler says it
    (cs,) = [x for x in out if type(x).__name__ == "ColdStart"]
    assert cs.root.end_ns == 400 * ms and cs.root.attributes["infersight.coldstart.unattributed_s"] == 0.3


@pytest.mark.parametrize("data", [
    {"open": [["warmup", "C" * 16, "b" * 16, 1, 2, {}]], "t": [], "i": [], "l": []},  # bad span id
    {"open": [["warmup", "c" * 16, "b" * 16, 3, 2, {}]], "t": [], "i": [], "l": []},  # ends before it starts
    {"open": [["warmup", "c" * 16]], "t": [], "i": [], "l": []},
    {"open": [], "t": [1, 2], "i": [0], "l": ["x"]},  # lengths differ
    {"open": [], "t": [1], "i": [3], "l": ["x"]},  # label index out of range
    {"open": [], "t": ["1"], "i": [0], "l": ["x"]},
    {"open": [], "t": [1], "i": [0], "l": [7]},
    {"open": [["s", "c" * 16, "b" * 16, 1, 2, {}]] * 65, "t": [], "i": [], "l": []},  # over the bound
])
def test_bad_checkpoint_is_counted_and_changes_nothing(data: dict) -> None:  # type: ignore[type-arg]
    a = coldstart_assembler("h")
    p = _hello(a)
    assert a.events(p, [[1, 5, "cs_tick", data]]) == []
    assert a.malformed == 1 and state_of(p).checkpoint is None


def test_a_checkpoint_taken_while_build_is_still_imported_skips_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler thread checkpoints while the main thread imports ``_build``: the partly
    initialised module (no ``open_runs`` yet) holds no open run, and is no internal error
    (which disabled the hooks of a process under load)."""
    import types

    from infersight.hooks import _checkpoint

    monkeypatch.setitem(sys.modules, "infersight.hooks._build", types.ModuleType("infersight.hooks._build"))
    assert all(stage[0] != "model_build" for stage in _checkpoint.open_stages())


# A profiler set by the environment's own sitecustomize (chained after the hooks' set-up) displaces the
# watch for the program's first frame: runtime_init then waits for the root's end, which a killed worker
# never reaches. Its checkpoints carry it.
KILLED_WITH_ITS_START_UNSEEN = textwrap.dedent("""
    import os, signal, sys, time
    sys.setprofile(None)
    from infersight import hooks
    from infersight.hooks import _coldstart
    import alpha  # noqa: F401
    with hooks.stage("load"):
        time.sleep(0.05)
""") + DIE_AFTER_CHECKPOINT + "die()\n"


def test_worker_killed_with_its_program_start_unseen_keeps_runtime_init(agent_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.setprofile(lambda frame, event, arg: None)\n")
    root, stages = _run_killed(agent_factory, tmp_path, KILLED_WITH_ITS_START_UNSEEN)
    (init,) = _named(stages, "runtime_init")
    assert int(init["startTimeUnixNano"]) == int(root["startTimeUnixNano"])
    assert attr(init, "infersight.runtime_init.hooks_s") is not None
    (load,) = _named(stages, "load")
    assert int(init["endTimeUnixNano"]) <= int(load["startTimeUnixNano"])
