"""A hooked process whose hooks' files change on disk under it (infersight upgraded in place: pip replaces
them) and that then needs a submodule the hooks import lazily: that one feature is off, said in one stderr
line, and the rest of the hooks (the events, the connection to the agent) work on. It imported the new file
next to its old modules before, which need not fit them: "hooks disabled after an internal error:
AttributeError(...)", and every later event of the process was lost.

The hooks run from a copy of the package on a temporary path (the bootstrap loads it from there, as from
infersight's install), whose ``_build.py`` the child replaces after the hooks loaded, as an upgrade would,
before it imports a sentencepiece (a small fake: the hooks load ``_build`` for it).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import attr, hook_env, log_records, read_otlp_lines, spans

import infersight.hooks

HOOKS = Path(infersight.hooks.__file__).parent
TICKS = 50

# A _build.py of another version: it needs the state its own version's modules keep, which this process's lack.
NEW_BUILD = "from . import _state\n\nBUILD = _state.current.build_of_a_later_version\n"

SENTENCEPIECE = """\
class SentencePieceProcessor:
    def Load(self, path):
        return True
"""

CHILD = """\
import os, sys
hooks_dir, mode = sys.argv[1], sys.argv[2]
boot = os.path.join(hooks_dir, "bootstrap", "sitecustomize.py")
exec(compile(open(boot).read(), boot, "exec"), {"__name__": "_infersight_boot", "__file__": boot})
from infersight import hooks
assert hooks.active()
if mode == "changed":  # a new file in the old one's place
    path = os.path.join(hooks_dir, "_build.py")
    with open(path + ".new", "w") as f:
        f.write(sys.argv[3])
    os.replace(path + ".new", path)
elif mode == "reinstalled":  # as pip does: every file anew (times kept, as a copy of the wheel's may be)
    import shutil
    shutil.copytree(hooks_dir, hooks_dir + ".new", copy_function=shutil.copy2)
    with open(os.path.join(hooks_dir + ".new", "_build.py"), "w") as f:
        f.write(sys.argv[3])
    shutil.rmtree(hooks_dir)
    os.rename(hooks_dir + ".new", hooks_dir)
import sentencepiece
sentencepiece.SentencePieceProcessor().Load("tokenizer.model")
hooks.mark_ready()
for i in range(%d):
    hooks.log("tick", name="tick", i=i)
loaded = sorted(m for m in ("_build", "_listening") if "infersight.hooks." + m in sys.modules)
print("loaded: %%s" %% loaded, flush=True)
""" % TICKS


def _run(tmp_path: Path, agent, mode: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:  # type: ignore[no-untyped-def,type-arg]
    hooks_dir = tmp_path / "site" / "infersight" / "hooks"
    shutil.copytree(HOOKS, hooks_dir, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "fakes").mkdir()
    (tmp_path / "fakes" / "sentencepiece.py").write_text(SENTENCEPIECE)
    (tmp_path / "child.py").write_text(CHILD)
    env = hook_env(agent.sock, agent.spool, PYTHONPATH=str(tmp_path / "fakes"))
    # -S: no site-packages, so that infersight's own install (this checkout) is not what the bootstrap finds
    r = subprocess.run([sys.executable, "-S", str(tmp_path / "child.py"), str(hooks_dir), mode, NEW_BUILD],
                       capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert agent.stop() == 0
    return r, read_otlp_lines(agent.out)


def test_a_changed_submodule_turns_off_its_feature_only(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    r, lines = _run(tmp_path, agent_factory().start(), "changed")
    said = [x for x in r.stderr.splitlines() if x.startswith("infersight:")]
    assert said == ["infersight: the hooks' files changed under this process (an upgrade?): tokenizer_load "
                    "timing is off until it restarts"], r.stderr
    assert "loaded: ['_listening']" in r.stdout  # mark_ready's port lookup: its file did not change
    ticks = sorted(int(attr(rec, "i")) for rec in log_records(lines) if attr(rec, "i") is not None)
    assert ticks == list(range(TICKS)), "the process's later events reach the agent"
    assert not [s for s in spans(lines) if s["name"].endswith("tokenizer_load")]
    assert [s for s in spans(lines) if s["name"] == "coldstart"], "the cold start's root ends as ever"


def test_unchanged_files_load_the_feature(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    r, lines = _run(tmp_path, agent_factory().start(), "unchanged")
    assert "infersight:" not in r.stderr, r.stderr
    assert "loaded: ['_build', '_listening']" in r.stdout
    ticks = sorted(int(attr(rec, "i")) for rec in log_records(lines) if attr(rec, "i") is not None)
    assert ticks == list(range(TICKS))
    assert [s for s in spans(lines) if s["name"].endswith("tokenizer_load")], [s["name"] for s in spans(lines)]


def test_a_reinstalled_package_turns_off_what_it_had_not_loaded(tmp_path: Path, agent_factory) -> None:  # type: ignore[no-untyped-def]
    """Every file replaced (pip's way), their modification times those of the files before: each lazy import
    after it is off (the ``__init__`` is another file), and the events go on."""
    r, lines = _run(tmp_path, agent_factory().start(), "reinstalled")
    said = [x for x in r.stderr.splitlines() if x.startswith("infersight:")]
    prefix = "infersight: the hooks' files changed under this process (an upgrade?): "
    # (the port lookup's _listening too, unless the sampler's first poll loaded it before the files changed)
    assert said[0] == prefix + "tokenizer_load timing is off until it restarts", r.stderr
    assert all(x.startswith(prefix) for x in said) and len(set(said)) == len(said), r.stderr
    assert "_build" not in r.stdout.partition("loaded: ")[2], r.stdout
    ticks = sorted(int(attr(rec, "i")) for rec in log_records(lines) if attr(rec, "i") is not None)
    assert ticks == list(range(TICKS))
