"""Stage rules (rules/stages.toml, site ``*.toml``): validated at file:line, read alike by the
agent (tomllib) and the hooks (no tomllib), applied on import in a launched process, and every
shipped rule's examples run: ``release`` targets checked in the released wheel (fetched with
``pip download --no-deps``, never installed), ``source`` targets in a checkout when one is given.
The ``run`` examples run in tests/e2e/test_coldstart_library_stacks.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import INFERSIGHT, launch, stage_name  # noqa: E402

from infersight.agent.coldstart.stage_rules_check import check_files  # noqa: E402
from infersight.hooks import _stagerules  # noqa: E402
from infersight.rules.engine import default_rule_paths, load_rules  # noqa: E402
from infersight.rules.stage_rules import (  # noqa: E402
    StageRuleFileError,
    builtin_stage_rules_path,
    load_stage_rules,
    module_paths,
    split_target,
    target_in_source,
)

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".cache" / "stage-rule-wheels"  # git-ignored: fetched once, kept between runs
BUILTIN = Path(str(builtin_stage_rules_path()))
SHIPPED = load_stage_rules([BUILTIN])

GOOD = """\
engine_version = "1.0"

[[stage]]
id = "site.asset_load"
stage = "asset_load"
targets = ["userlib:Loader.load", "userlib:Loader.inner"]
[[stage.examples]]
run = "userlib"
"""


def write(tmp: Path, name: str, text: str) -> Path:
    p = tmp / name
    p.write_text(textwrap.dedent(text))
    return p


def test_shipped_rules_load_and_the_hooks_read_them_alike() -> None:
    rs = check_files([BUILTIN])  # tomllib's reading, checked against the hooks' own reader
    assert len(rs.rules) == len(SHIPPED.rules) >= 20
    stages = {r.id: r.stage for r in rs.rules}
    for lib in ("accelerate.", "peft.", "diffusers.", "ray.", "vllm.", "sglang.", "tgi."):
        assert any(i.startswith(lib) for i in stages), lib
    vllm = {s for i, s in stages.items() if i.startswith("vllm.")}
    assert {"weights_load", "memory_profile", "kv_cache_alloc", "graph_capture", "graph_compile"} <= vllm
    assert {"ray_init", "serve_start", "serve_replicas_wait", "serve_proxy_wait"} <= set(stages.values())
    assert all(r.examples for r in rs.rules)
    hooks_view, problems = _stagerules.parse(BUILTIN.read_text())
    assert problems == []
    assert hooks_view == [(r.id, r.stage, r.targets, r.ready, r.until) for r in rs.rules]
    assert {r.id for r in rs.rules if r.ready == "return"} == {"ray.serve.run", "ray.serve.replica_init",
                                                               "ray.serve.controller_init", "ray.serve.http_start",
                                                               "bentoml.service_init"}
    assert {r.id for r in rs.rules if r.ready == "entry"} == {"litserve.serving_loop", "ray.log_monitor.loop",
                                                              "ray.autoscaler.monitor.loop", "ray.dashboard.serving",
                                                              "gunicorn.worker_loop"}
    assert {r.id for r in rs.rules if r.until} == {"ray.worker.task_wait", "ray.worker.log_setup",
                                                   "ray.serve.proxy_init", "python.multiprocessing.bootstrap",
                                                   "hypercorn.lifespan_startup"}


def test_errors_name_file_and_line(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.toml", """\
        engine_version = "1.0"

        [[stage]]
        id = "a"
        stage = "Bad Name"
        targets = ["mod:f"]
        [[stage.examples]]
        run = "x"

        [[stage]]
        id = "b"
        stage = "ready_wait"
        targets = ["no-colon"]
        extra = 1

        [[stage]]
        id = "c"
        stage = "fine"
        targets = ["m:f"]

        [[stage]]
        id = "a"
        stage = "fine"
        targets = ["m:g"]
        [[stage.examples]]
        release = "not a release"
        """)
    with pytest.raises(StageRuleFileError) as ei:
        load_stage_rules([bad])
    text = str(ei.value)
    assert f"{bad}:5: a: stage must be a lower-case name" in text
    assert f"{bad}:12: b: stage 'ready_wait' is derived by the hooks" in text
    assert f"{bad}:13: b: target 'no-colon' is not module:qualname" in text
    assert f"{bad}:14: unknown stage rule key 'extra'" in text
    assert f"{bad}:16: c: needs at least one example" in text
    assert f"{bad}:25: a: example 1: release must be PKG==VERSION" in text  # the example's table
    assert len(ei.value.errors) == 6


def test_engine_version_is_checked_by_both_readers(tmp_path: Path) -> None:
    newer = write(tmp_path, "newer.toml", GOOD.replace('"1.0"', '"2.0"'))
    with pytest.raises(StageRuleFileError, match=r"newer.toml:1: needs engine 2.0, this engine is 1.0"):
        load_stage_rules([newer])
    assert _stagerules.parse(newer.read_text()) == ([], [(1, "engine_version: not 1.x")])


def test_what_the_hooks_cannot_read_is_refused_at_its_line(tmp_path: Path) -> None:
    """Valid TOML the hooks' reader would read otherwise (an escape) is an error, not a rule
    that silently never applies."""
    escaped = write(tmp_path, "escaped.toml", GOOD.replace('"userlib:Loader.load"', '"userlib:Loader.\\u006coad"'))
    import tomllib

    assert tomllib.loads(escaped.read_text())["stage"][0]["targets"][0] == "userlib:Loader.load"  # valid TOML
    assert _stagerules.parse(escaped.read_text()) == ([], [(6, "targets: not an array of plain strings"),
                                                           (3, "a [[stage]] needs id, stage and targets")])
    with pytest.raises(StageRuleFileError, match=r"escaped.toml:6: site.asset_load: targets: write plain strings"):
        check_files([escaped])
    multi = write(tmp_path, "multi.toml", GOOD.replace(
        'targets = ["userlib:Loader.load", "userlib:Loader.inner"]',
        'targets = [\n  "userlib:Loader.load",  # the classmethod\n  "userlib:Loader.inner",\n]'))
    assert check_files([multi]).rules[0].targets == ("userlib:Loader.load", "userlib:Loader.inner")


def test_oom_and_stage_rules_share_a_rules_directory(tmp_path: Path) -> None:
    """The OOM classifier and the stage rules read the same directories: each skips the other's files."""
    d = tmp_path / "rules.d"
    d.mkdir()
    write(d, "10-stages.toml", GOOD)
    write(d, "20-oom.toml", """\
        engine_version = "1.0"
        [[rule]]
        id = "site.never"
        version = 1
        class = "capacity"
        priority = 1
        condition = "R > 1000 TiB"
        remedy = "nothing"
        [[rule.examples]]
        kind = "positive"
        numbers = { R = "2000 TiB", T = 1, F = 0, A = 0, P = 0 }
        [[rule.examples]]
        kind = "negative"
        numbers = { R = 1, T = 1, F = 0, A = 0, P = 0 }
        """)
    oom = load_rules(default_rule_paths([d], site_dir=tmp_path / "none"))
    assert oom.get("site.never") is not None
    stage = load_stage_rules(sorted(d.glob("*.toml")))
    assert [r.id for r in stage.rules] == ["site.asset_load"]


def test_target_in_source_reads_definitions_with_ast() -> None:
    src = textwrap.dedent("""\
        import typing
        def f(): pass
        class A:
            @classmethod
            def load(cls): pass
            async def warm(self): pass
            def gen(self):
                yield 1
            def outer(self):
                def inner():
                    yield 2
                return inner
            class B:
                def deep(self): pass
        if typing.TYPE_CHECKING:
            pass
        else:
            def late(): pass
        """)
    assert target_in_source(src, "f") == "function"
    assert target_in_source(src, "A.load") == "function"
    assert target_in_source(src, "A.warm") == "async function"
    assert target_in_source(src, "A.gen") == "generator"
    assert target_in_source(src, "A.outer") == "function"  # the yield is a nested function's
    assert target_in_source(src, "A.B.deep") == "function"
    assert target_in_source(src, "late") == "function"
    assert target_in_source(src, "A") == "not a function"
    assert target_in_source(src, "A.absent") == "missing"
    assert target_in_source(src, "f.x") == "missing"


# -- the rules at work in a launched process ---------------------------------------------------

USERLIB = """\
import asyncio
import time

INSIDE = {}


class Loader:
    @classmethod
    def load(cls):
        time.sleep(0.12)
        return cls.inner()  # a target of the same rule: passes through

    @staticmethod
    def inner():
        time.sleep(0.03)
        return "loaded"


async def warm():
    await asyncio.sleep(0.05)
    INSIDE["warm"] = time.time_ns()


def boom():
    time.sleep(0.02)
    raise ValueError("bad asset")
"""

APP = """\
import asyncio
import json
import sys

import userlib
from infersight import hooks

result = {"wrapped": hasattr(userlib.warm, "__wrapped__"), "load": userlib.Loader.load()}
asyncio.run(userlib.warm())
result["warm_inside_ns"] = userlib.INSIDE["warm"]
try:
    userlib.boom()
except ValueError as exc:
    result["boom"] = str(exc)
hooks.mark_ready()
hooks.first_response()  # the root ends: every wrapper is taken out
result["after_root"] = [hasattr(userlib.warm, "__wrapped__"), type(userlib.Loader.__dict__["load"]).__name__,
                        hasattr(userlib.Loader.__dict__["load"].__func__, "__wrapped__")]
with open(sys.argv[1], "w") as f:
    json.dump(result, f)
"""

SITE_RULES = """\
engine_version = "1.0"

[[stage]]
id = "site.asset_load"
stage = "asset_load"
targets = ["userlib:Loader.load", "userlib:Loader.inner", "userlib:Loader.gone"]
[[stage.examples]]
run = "userlib"

[[stage]]
id = "site.cache_fill"
stage = "cache_fill"
targets = ["userlib:warm", "userlib:absent"]
[[stage.examples]]
run = "userlib"

[[stage]]
id = "site.boom"
stage = "weights_load"
targets = ["userlib:boom"]
[[stage.examples]]
run = "userlib"
"""


@pytest.fixture
def user_app(tmp_path: Path) -> tuple[Path, Path]:
    write(tmp_path, "userlib.py", USERLIB)
    app = write(tmp_path, "app.py", APP)
    rules = tmp_path / "rules.d"
    rules.mkdir()
    write(rules, "site.toml", SITE_RULES)
    return app, rules


def test_site_rules_apply_on_import_and_come_out_at_the_root_end(user_app: tuple[Path, Path], tmp_path: Path) -> None:
    app, rules = user_app
    r = launch(str(tmp_path), [sys.executable, str(app)], "--rules-dir", str(rules), env={"PYTHONPATH": str(tmp_path)})
    assert r.rc == 0, r.output[-3000:]
    res = r.result
    assert res["wrapped"] and res["load"] == "loaded" and res["boom"] == "bad asset"
    assert res["after_root"] == [False, "classmethod", False]  # originals back, the descriptor kept
    root = next(x for x in r.roots() if x.parent_span_id is None)
    stages = r.stages(root)
    loads = [s for s in stages if stage_name(s) == "asset_load"]
    assert len(loads) == 1, loads  # inner() ran inside load(): one span
    a = loads[0].attributes
    assert a["infersight.stage.rule"] == "site.asset_load"
    assert a["infersight.stage.target"] == "userlib:Loader.load"
    assert a["infersight.stage.custom"] is True
    (fill,) = [s for s in stages if stage_name(s) == "cache_fill"]
    assert fill.start_ns < res["warm_inside_ns"] <= fill.end_ns  # the span covers the await
    (boom,) = [s for s in stages if s.attributes.get("infersight.stage.rule") == "site.boom"]
    assert stage_name(boom) == "weights_load" and "infersight.stage.custom" not in boom.attributes
    assert boom.error == "ValueError"
    assert sorted(root.attributes["infersight.stage_rules.missing"]) == ["userlib:Loader.gone", "userlib:absent"]
    row = next(line for line in r.output.splitlines() if line.strip().startswith("asset_load*"))
    assert row.endswith("rule site.asset_load")  # the waterfall names the rule


def test_an_unreadable_site_file_is_named_on_the_root_and_loses_nothing_else(
        user_app: tuple[Path, Path], tmp_path: Path) -> None:
    """Without launch's check (rules directories from the environment), the hooks skip what they
    cannot read, say where on the root, and keep every other rule."""
    app, rules = user_app
    write(rules, "zz-broken.toml", 'engine_version = "1.0"\n[[stage]]\nid = "broken"\nstage = "x"\ntargets = "m:f"\n')
    r = launch(str(tmp_path), [sys.executable, str(app)],
               env={"PYTHONPATH": str(tmp_path), "INFERSIGHT_RULES_DIRS": str(rules)})
    assert r.rc == 0, r.output[-3000:]
    root = next(x for x in r.roots() if x.parent_span_id is None)
    errors = root.attributes["infersight.stage_rules.errors"]
    assert any(e.startswith(str(rules / "zz-broken.toml") + ":5: targets") for e in errors), errors
    assert any(stage_name(s) == "asset_load" for s in r.stages(root))


def test_launch_refuses_invalid_rules_with_file_and_line(user_app: tuple[Path, Path], tmp_path: Path) -> None:
    app, rules = user_app
    write(rules, "zz-bad.toml", 'engine_version = "1.0"\n[[stage]]\nid = "bad"\nstage = "first_request"\n'
                                'targets = ["m:f"]\n[[stage.examples]]\nrun = "x"\n')
    marker = tmp_path / "ran"
    p = subprocess.run([*INFERSIGHT, "launch", "--otlp-file", str(tmp_path / "o.jsonl"), "--rules-dir", str(rules),
                        "--", sys.executable, "-c", "open(%r, 'w')" % str(marker)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "%s:4: bad: stage 'first_request' is derived by the hooks" % (rules / "zz-bad.toml") in p.stderr
    assert not marker.exists()  # the command never ran


WORKERLIB = """\
import time

ARRIVED = {}


def task_loop():
    time.sleep(0.15)  # no work yet: the wait
    execute()


def execute():
    ARRIVED["task"] = time.time_ns()
    time.sleep(0.01)
"""

DAEMON = """\
import json
import sys
import time

import workerlib


class Daemon:
    def serve(self, out):
        entered = time.time_ns()
        time.sleep(0.1)  # its loop, until shutdown: not start-up
        with open(out, "w") as f:
            json.dump({"entered_ns": entered, "task_ns": workerlib.ARRIVED["task"]}, f)


if __name__ == "__main__":
    workerlib.task_loop()
    Daemon().serve(sys.argv[1])
"""

LOOP_RULES = """\
engine_version = "1.0"

[[stage]]
id = "site.task_wait"
stage = "task_wait"
targets = ["workerlib:task_loop"]
until = ["workerlib:execute"]
[[stage.examples]]
run = "userlib"

[[stage]]
id = "site.daemon_loop"
stage = "serving_loop"
targets = ["pkg.daemon:Daemon.serve"]
ready = "entry"
[[stage.examples]]
run = "userlib"
"""


def test_wait_and_entry_rules_on_a_script_that_defines_its_loop(tmp_path: Path) -> None:
    """A worker that talks through queues: its wait for its first task (``until``) is a stage,
    and it is ready when its serving loop starts (``ready = "entry"``), here a class of the main
    script itself (``python pkg/daemon.py``, as Ray runs its log monitor), which is never imported."""
    write(tmp_path, "workerlib.py", WORKERLIB)
    (tmp_path / "pkg").mkdir()
    write(tmp_path / "pkg", "__init__.py", "")
    script = write(tmp_path / "pkg", "daemon.py", DAEMON)
    rules = tmp_path / "rules.d"
    rules.mkdir()
    write(rules, "loops.toml", LOOP_RULES)
    assert [(r.ready, r.until) for r in check_files([rules / "loops.toml"]).rules] == [
        ("", ("workerlib:execute",)), ("entry", ())]
    r = launch(str(tmp_path), [sys.executable, str(script)], "--rules-dir", str(rules),
               env={"PYTHONPATH": str(tmp_path)})
    assert r.rc == 0, r.output[-3000:]
    res = r.result
    root = next(x for x in r.roots() if x.parent_span_id is None)
    stages = r.stages(root)
    (wait,) = [s for s in stages if stage_name(s) == "task_wait"]
    assert wait.attributes["infersight.stage.rule"] == "site.task_wait"
    assert wait.attributes["infersight.stage.until"] == "workerlib:execute"
    assert wait.end_ns <= res["task_ns"]  # it ends when the first task arrives
    assert not [s for s in stages if stage_name(s) == "serving_loop"]  # an entry rule opens no span
    (ready,) = [s for s in stages if stage_name(s) == "ready_wait"]
    assert ready.attributes["infersight.ready.source"] == "stage_rule"
    assert ready.attributes["infersight.stage.rule"] == "site.daemon_loop"
    assert root.attributes["infersight.coldstart.ended_by"] == "ready"
    assert root.end_ns <= res["entered_ns"]  # ready when the loop started, not at exit
    assert "stage_rules.missing" not in str(root.attributes)


ASYNCLIB = """\
import asyncio
import os
import time

from infersight import hooks


class Lifespan:
    async def run(self):  # an app's lifespan task, as an ASGI server runs it
        with hooks.stage("model_build"):  # its start-up: nests in the wait
            time.sleep(0.1)
        mode = os.environ.get("LIFESPAN_MODE", "")
        if mode == "raise":  # a lifespan that fails without a word to the server
            raise RuntimeError("lifespan failed")
        if mode == "hang":  # one whose start-up never ends
            await asyncio.sleep(3600)
        await self.started()
        await asyncio.sleep(0.05)
        with hooks.stage("cache_refresh"):  # after its start-up: the span current before the wait's
            time.sleep(0.05)

    async def started(self):
        pass
"""

ASYNC_MAIN = """\
import asyncio
import os

import asynclib
from infersight import hooks


async def main():
    with hooks.stage("server_setup"):
        task = asyncio.create_task(asynclib.Lifespan().run())
        if os.environ.get("LIFESPAN_MODE") == "hang":
            await asyncio.sleep(0.3)
        else:
            try:
                await task
            except RuntimeError:
                pass
    hooks.mark_ready()
    task.cancel()


asyncio.run(main())
"""

ASYNC_RULES = """\
engine_version = "1.0"

[[stage]]
id = "site.lifespan"
stage = "app_startup"
targets = ["asynclib:Lifespan.run"]
until = ["asynclib:Lifespan.started"]
[[stage.examples]]
run = "userlib"
"""


@pytest.mark.parametrize("mode", ["", "raise", "hang"], ids=["until", "target-raises", "root-ends-first"])
def test_a_coroutine_targets_wait_is_its_tasks_current_span_until_it_ends(tmp_path: Path, mode: str) -> None:
    """A wait whose target is a coroutine (an ASGI server's lifespan task, up to the app's startup message):
    the stages that task runs meanwhile nest in it, and once an ``until`` call in that task ended it, the span
    current before the wait is current again. A target that returns or raises first ends it there, and one
    still waiting when the root ends is ended with the root: the stages inside it keep their parent."""
    write(tmp_path, "asynclib.py", ASYNCLIB)
    script = write(tmp_path, "main.py", ASYNC_MAIN)
    rules = tmp_path / "rules.d"
    rules.mkdir()
    write(rules, "lifespan.toml", ASYNC_RULES)
    r = launch(str(tmp_path), [sys.executable, str(script)], "--rules-dir", str(rules), result=False,
               env={"PYTHONPATH": str(tmp_path), "LIFESPAN_MODE": mode})
    assert r.rc == 0, r.output[-3000:]
    root = next(x for x in r.roots() if x.parent_span_id is None)
    by_stage = {stage_name(s): s for s in r.stages(root)}
    setup, wait, build = (by_stage[n] for n in ("server_setup", "app_startup", "model_build"))
    assert wait.parent_span_id == setup.span_id  # the task's span at its start
    assert build.parent_span_id == wait.span_id and wait.start_ns <= build.start_ns <= build.end_ns <= wait.end_ns
    assert "coldstart.interrupted" not in {s.name for s in r.stages(root)}  # no parent missing
    if mode == "":
        assert wait.attributes["infersight.stage.until"] == "asynclib:Lifespan.started"
        refresh = by_stage["cache_refresh"]
        assert refresh.parent_span_id == setup.span_id and refresh.start_ns >= wait.end_ns
        assert "infersight.stage.started_in" not in refresh.attributes  # no ended stage was its parent
        return
    assert "infersight.stage.until" not in wait.attributes and "cache_refresh" not in by_stage
    if mode == "raise":  # ended where the target raised, before the setup around it
        assert wait.end_ns <= setup.end_ns < root.end_ns
    else:  # still waiting at readiness: ended with the root
        assert wait.end_ns == root.end_ns > setup.end_ns


def test_ready_and_until_are_validated(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.toml", """\
        engine_version = "1.0"

        [[stage]]
        id = "a"
        stage = "wait"
        targets = ["m:f"]
        until = ["m:f"]
        ready = "later"
        [[stage.examples]]
        run = "x"

        [[stage]]
        id = "b"
        stage = "wait"
        targets = ["m:g"]
        until = ["m:h"]
        ready = true
        [[stage.examples]]
        run = "x"
        """)
    with pytest.raises(StageRuleFileError) as ei:
        load_stage_rules([bad])
    text = str(ei.value)
    assert f"{bad}:7: a: a target cannot end its own wait" in text
    assert f"{bad}:8: a: ready must be true, false, \"entry\" or \"helper\"" in text
    assert f"{bad}:17: b: a wait (until) is never readiness" in text
    assert _stagerules.parse(bad.read_text())[1] == [(8, 'ready: not true, false, "entry" or "helper"')]


# -- every shipped rule's examples ---------------------------------------------------------------

RELEASES = sorted({e.value for r in SHIPPED.rules for e in r.examples if e.kind == "release"})
SOURCES = sorted({e.value for r in SHIPPED.rules for e in r.examples if e.kind == "source"})


def _wheel(release: str) -> Path:
    """The release's wheel from the cache, else ``pip download --no-deps`` (skip when offline)."""
    dist, version = release.split("==")
    norm = dist.replace("-", "_").lower()
    WHEELS.mkdir(parents=True, exist_ok=True)
    found = [p for p in WHEELS.glob("*.whl") if p.name.lower().startswith("%s-%s-" % (norm, version))]
    if not found:
        p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                            "-d", str(WHEELS), release], capture_output=True, text=True, timeout=1800)
        found = [p for p in WHEELS.glob("*.whl") if p.name.lower().startswith("%s-%s-" % (norm, version))]
        if not found:
            pytest.skip("cannot fetch %s offline (pip download: %s)" % (release, (p.stderr.strip().splitlines()
                                                                                or ["no output"])[-1]))
    return found[0]


def _check_targets(read: dict[str, str], rules: list, label: str) -> None:
    problems = []
    for rule in rules:
        for target in (*rule.targets, *rule.until):
            module, qualname = split_target(target)
            src = next((read[p] for p in module_paths(module) if p in read), None)
            kind = "missing module" if src is None else target_in_source(src, qualname)
            if kind not in ("function", "async function"):
                problems.append("%s %s: %s in %s" % (rule.id, target, kind, label))
    assert not problems, problems


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
def test_release_examples_targets_exist_in_the_released_wheel(release: str) -> None:
    with zipfile.ZipFile(_wheel(release)) as z:
        rules = [r for r in SHIPPED.rules if any(e.value == release for e in r.examples)]
        wanted = {p for r in rules for t in (*r.targets, *r.until) for p in module_paths(split_target(t)[0])}
        read = {n: z.read(n).decode("utf-8") for n in z.namelist() if n in wanted}
    _check_targets(read, rules, release)


@pytest.mark.parametrize("source", SOURCES)
def test_source_examples_targets_exist_in_the_given_checkout(source: str) -> None:
    """Releases that are not on PyPI (TGI's Python server): checked in a checkout of the tag named
    in $INFERSIGHT_STAGE_RULE_SOURCES ("OWNER/REPO=DIR,..."), where the package sits under DIR
    or DIR/server. They were verified against the public tag when written (docs/coldstart.md)."""
    repo = source.split(":", 1)[1].split("@", 1)[0]
    given = dict(kv.split("=", 1) for kv in os.environ.get("INFERSIGHT_STAGE_RULE_SOURCES", "").split(",") if "=" in kv)
    if repo not in given:
        pytest.skip("%s is not on PyPI: set INFERSIGHT_STAGE_RULE_SOURCES=%s=DIR (a checkout of %s)" % (
            repo, repo, source))
    rules = [r for r in SHIPPED.rules if any(e.value == source for e in r.examples)]
    read = {}
    for base in (Path(given[repo]), Path(given[repo]) / "server"):
        for r in rules:
            for t in (*r.targets, *r.until):
                for rel in module_paths(split_target(t)[0]):
                    if (base / rel).is_file():
                        read[rel] = (base / rel).read_text(encoding="utf-8")
    _check_targets(read, rules, "%s at %s" % (source, given[repo]))


def test_the_hooks_apply_rules_on_python39_without_tomllib(user_app: tuple[Path, Path], tmp_path: Path) -> None:
    import glob

    found = glob.glob(os.path.expanduser("~/.pyenv/versions/3.9*/bin/python"))
    if not found:
        pytest.skip("no python 3.9 here")
    _app, rules = user_app
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "hooks" / "bootstrap"), str(tmp_path)]),
           "INFERSIGHT_SOCKET": str(tmp_path / "none.sock"), "INFERSIGHT_SPOOL_DIR": str(tmp_path / "spool"),
           "INFERSIGHT_EXIT_FLUSH_S": "0", "INFERSIGHT_RULES_DIRS": str(rules)}
    code = ("import sys\nassert sys.version_info[:2] == (3, 9)\nassert 'tomllib' not in sys.modules\n"
            "from infersight.hooks import _coldstart\n"
            "assert 'vllm.v1.worker.gpu_model_runner' in _coldstart.state().watched  # the shipped file\n"
            "import userlib\n"
            "assert userlib.Loader.load.__func__.__wrapped__ and userlib.warm.__wrapped__  # the site file\n"
            "assert userlib.Loader.load() == 'loaded'\n")
    script = write(tmp_path, "check39.py", code)  # a script, not `python -c` (a helper: no rules)
    p = subprocess.run([found[0], str(script)], env=env, timeout=60, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "hooks disabled" not in p.stderr
    helper = ("from infersight.hooks import _coldstart\nassert _coldstart.state().role == 'helper'\n"
              "assert 'vllm.v1.worker.gpu_model_runner' not in _coldstart.state().watched\n")
    p = subprocess.run([found[0], "-c", helper], env=env, timeout=60, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr  # a `python -c` probe is a helper: it reads no rule file
