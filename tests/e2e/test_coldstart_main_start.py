"""``runtime_init`` runs to the main program's first line, not to the end of the hooks' set-up:
what the interpreter does between the two (compiling a large main script, ``-m``'s ``runpy``,
the zip-application check on the script) is start-up, named, never an ``unattributed`` gap.
Real interpreters under ``infersight launch``."""

from __future__ import annotations

import os
import sys
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import LaunchRun, assert_well_formed, launch, stage_name  # noqa: E402

from infersight.telemetry import SpanItem  # noqa: E402

# The first line notes the time (``time`` is loaded at start-up: no import to wait for); then
# 60,000 assignments: about half a second of compiling here, done before that line runs (a main
# script is compiled whole and never cached as bytecode).
FIRST = "import time\nT0 = time.time_ns()\nimport json, os, sys\n"
LAST = 'json.dump({"pid": os.getpid(), "t_first_line_ns": T0}, open(sys.argv[1], "w"))\n'


def write(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def one(run: LaunchRun, name: str) -> tuple[SpanItem, list[SpanItem], SpanItem]:
    assert run.rc == 0, run.output
    root = run.root_of(run.result["pid"])
    stages = run.stages(root)
    assert_well_formed(root, stages)
    (init,) = [s for s in stages if stage_name(s) == name]
    return root, stages, init


def test_a_large_script_compiles_inside_runtime_init(tmp_path) -> None:
    body = "".join("v%d = %d\n" % (i, i) for i in range(60_000))
    script = write(str(tmp_path / "big_main.py"), FIRST + body + LAST)
    run = launch(str(tmp_path), [sys.executable, script])
    root, stages, init = one(run, "runtime_init")
    first_line = run.result["t_first_line_ns"]
    # ends at the program's first frame, before its first line ran (the compile, ~0.5 s, is before it):
    # no other stage starts before it ends, and no unnamed stretch lies before the first line (below)
    assert init.end_ns <= first_line, (init.end_ns, first_line)
    assert all(s.start_ns >= init.end_ns for s in stages if s is not init), [
        (stage_name(s), s.start_ns - init.end_ns) for s in stages if s.start_ns < init.end_ns]
    after = float(init.attributes["infersight.runtime_init.after_hooks_s"])
    hooks = float(init.attributes["infersight.runtime_init.hooks_s"])
    assert after > 0.05  # the compile: ~0.5 s here, a fraction of it on any machine
    assert hooks + after <= (init.end_ns - init.start_ns) / 1e9
    gaps = [s for s in stages if stage_name(s) == "unattributed" and s.start_ns < first_line]
    assert not gaps, [(g.start_ns, g.end_ns, g.attributes) for g in gaps]


def test_dash_m_runs_runpy_inside_runtime_init(tmp_path) -> None:
    """``python -m pkg``: runtime_init ends when runpy starts the module; the package's own
    import (its ``__init__``, run by runpy) is a framework_import after it, never before."""
    write(str(tmp_path / "slowpkg" / "__init__.py"), "import time\ntime.sleep(0.05)\n")
    write(str(tmp_path / "slowpkg" / "__main__.py"), FIRST + LAST)
    run = launch(str(tmp_path), [sys.executable, "-m", "slowpkg"], env={"PYTHONPATH": str(tmp_path)})
    root, stages, init = one(run, "runtime_init")
    assert "infersight.runtime_init.after_hooks_s" in init.attributes
    imports = [s for s in stages if stage_name(s) == "framework_import"]
    mine = [s for s in imports if any(str(p).startswith("slowpkg ")
                                      for p in s.attributes.get("infersight.import.packages", []))]
    assert mine, [s.attributes for s in imports]
    assert all(s.start_ns >= init.end_ns for s in imports), [(s.start_ns - init.end_ns) for s in imports]
    assert init.end_ns <= run.result["t_first_line_ns"]


def test_a_profiler_set_first_keeps_the_old_end(tmp_path) -> None:
    """A profile function set by the site's own sitecustomize (chained after ours) displaces the
    watch: runtime_init then ends where the hooks' set-up did, and imports are timed as ever."""
    site = tmp_path / "site"
    write(str(site / "sitecustomize.py"), "import sys\nsys.setprofile(lambda frame, event, arg: None)\n")
    write(str(tmp_path / "slowpkg2" / "__init__.py"), "import time\ntime.sleep(0.05)\n")
    script = write(str(tmp_path / "prof_main.py"), textwrap.dedent("""\
        import sys
        sys.setprofile(None)
        import slowpkg2  # noqa: F401
        """) + FIRST + LAST)
    run = launch(str(tmp_path), [sys.executable, script], env={"PYTHONPATH": "%s:%s" % (site, tmp_path)})
    root, stages, init = one(run, "runtime_init")
    assert "infersight.runtime_init.after_hooks_s" not in init.attributes
    assert init.end_ns < run.result["t_first_line_ns"]
    packages = [p for s in stages if stage_name(s) == "framework_import"
                for p in s.attributes.get("infersight.import.packages", [])]
    assert any(str(p).startswith("slowpkg2 ") for p in packages), packages


def test_a_busy_site_sitecustomize_does_not_use_up_the_watch(tmp_path) -> None:
    """The environment's own sitecustomize (chained after ours) runs more Python calls than the watch's
    whole budget (a large package imported there): the watch is paused meanwhile, so it still sees the
    program's first frame; that work is start-up, inside runtime_init, and no import is timed before it."""
    site = tmp_path / "site"
    write(str(site / "busy_site_pkg.py"), "def f():\n    return 1\nfor _ in range(250_000):\n    f()\n")
    write(str(site / "sitecustomize.py"), "import busy_site_pkg  # noqa: F401\n")
    script = write(str(tmp_path / "busy_main.py"), FIRST + LAST)
    run = launch(str(tmp_path), [sys.executable, script], env={"PYTHONPATH": str(site)})
    root, stages, init = one(run, "runtime_init")
    assert "infersight.runtime_init.program_start_seen" not in init.attributes, init.attributes  # seen
    assert init.end_ns <= run.result["t_first_line_ns"]
    assert all(s.start_ns >= init.end_ns for s in stages if s is not init), [
        (stage_name(s), s.attributes.get("infersight.import.packages")) for s in stages if s.start_ns < init.end_ns]


def pth_run(tmp_path, extra_pth: dict[str, str], **env_extra: str) -> dict:  # type: ignore[type-arg]
    """A venv whose site-packages holds ``hooks install``'s ``.pth`` line and ``extra_pth`` (other files
    there too: a ``.pth`` name is read by ``site``); runs a script there that reads its own process's
    hook state at its first lines (no agent: nothing to send to). ``stderr`` holds the run's."""
    import json
    import subprocess

    from conftest import BOOTSTRAP, hook_env

    from infersight.agent.commands.hooks_install import pth_line

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    write(os.path.join(purelib, "infersight-hooks.pth"), pth_line(str(BOOTSTRAP)))
    for name, line in extra_pth.items():
        write(os.path.join(purelib, name), line)
    script = write(str(tmp_path / "pth_main.py"), FIRST + textwrap.dedent("""\
        profiled = sys.getprofile() is not None
        sys.setprofile(None)
        from infersight.hooks import _recorder, _state
        cs = _state.current.coldstart
        rs = _state.current.runtime
        print(json.dumps({"t_first_line_ns": T0, "pending": cs.init_pending, "gave_up": cs.init_gave_up,
                          "collecting": cs.collecting, "profile": profiled, "root_start": rs.root_start_ns,
                          "pairs": _recorder.covered_pairs(cs),
                          "callbacks": {k: [cb.__qualname__ for cb in v] for k, v in cs.post_import.items()}}))
        """))
    env = hook_env(tmp_path / "none.sock", tmp_path / "spool", INFERSIGHT="1", INFERSIGHT_EXIT_FLUSH_S="0",
                   **env_extra)
    env.pop("PYTHONPATH")  # the .pth line, not launch's PYTHONPATH, loads the hooks
    p = subprocess.run([python, script], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    got: dict = json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[type-arg]
    assert got["collecting"], got
    # the bootstrap runs twice (the .pth line, then site's import of sitecustomize): set up once
    assert all(len(set(names)) == len(names) for names in got["callbacks"].values()), got["callbacks"]
    got["stderr"] = p.stderr
    return got


def test_the_pth_line_watches_from_inside_site(tmp_path) -> None:
    """``hooks install``'s ``.pth`` line starts the hooks while ``site`` still reads ``.pth``
    files: a later one that imports (here ``ssl``, ``urllib.request`` and more, as certificate
    helpers do: over 10,000 callbacks) is start-up, inside the watch's budget, and runtime_init
    still ends at the program's first frame."""
    got = pth_run(tmp_path, {"zz-later.pth": "import ipaddress, typing, ssl, http.client, email.message, "
                                             "urllib.request\n"})
    assert not got["profile"], got
    assert got["pending"] == [] and got["gave_up"] == [], got  # emitted, at the program's first frame
    init = [(s, e) for s, e in got["pairs"] if s == got["root_start"]]
    assert len(init) == 1, got["pairs"]
    # the last thing before the first line: no other stage started before runtime_init ended
    assert init[0][1] <= got["t_first_line_ns"], (init, got["t_first_line_ns"])
    assert all(s >= init[0][1] for s, e in got["pairs"] if (s, e) != tuple(init[0])), got["pairs"]


def test_the_pth_line_beside_a_profiler_emits_runtime_init_once(tmp_path) -> None:
    """A profile function set by an earlier ``.pth`` file: no watch, runtime_init ends with the
    hooks' set-up, and the bootstrap's second run (site's own import of sitecustomize) neither
    emits it again nor registers its callbacks twice."""
    got = pth_run(tmp_path, {"a-profiler.pth": "import sys; sys.setprofile(lambda frame, event, arg: None)\n"})
    assert got["profile"], got  # the profiler's, left in place
    assert got["pending"] == [] and got["gave_up"] == [], got
    init = [(s, e) for s, e in got["pairs"] if s == got["root_start"]]
    assert len(init) == 1, got["pairs"]


def test_the_pth_line_chains_the_sites_sitecustomize_once_after_every_pth(tmp_path) -> None:
    """The environment's own ``sitecustomize`` (shadowed by the bootstrap) runs once, as ``site`` would
    run it: after every ``.pth`` file, so a path a later one adds is there. The ``.pth`` line's run of
    the bootstrap (inside ``site``'s reading of ``.pth`` files) used to chain it too: twice in all, the
    first time before the later paths existed."""
    later = tmp_path / "later"
    write(str(later / "laterlib.py"), "VALUE = 1\n")
    log = tmp_path / "chain.log"
    got = pth_run(tmp_path, {
        "sitecustomize.py": "import os, laterlib\nopen(os.environ['CHAIN_LOG'], 'a').write('ran\\n')\n",
        "zz-later.pth": str(later) + "\n",
    }, CHAIN_LOG=str(log))
    assert log.read_text() == "ran\n", (log.read_text(), got["stderr"])
    assert "chained sitecustomize failed" not in got["stderr"], got["stderr"]
    assert got["pending"] == [] and got["gave_up"] == [], got
