"""Stage rules (``stages.toml``, site ``*.toml``): typed, validated, every error at file:line.

A stage rule maps library calls (``module:qualname`` targets) to a cold-start stage; the
hooks apply it when the target's module is imported (``infersight.hooks._stagerules``, which
reads the same files without tomllib). A file declares ``engine_version`` (as every rule
file does, :mod:`infersight.rules.rulefile`) and ``[[stage]]`` tables::

    [[stage]]
    id = "vllm.kv_cache"                 # unique over every file loaded
    stage = "kv_cache_alloc"             # a builtin stage or your own name
    targets = ["vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache"]
    description = "..."                  # optional
    ready = true                         # optional: the process is ready when the call returns
                                         # ("entry": when it starts, a serving loop; no span;
                                         # "helper": as "entry", and the process serves another's
                                         # start-up, a multiprocessing manager: role helper)
    until = ["mod:f"]                    # optional: the stage runs from a target's call to the
                                         # first call of one of these (a loop's wait for work)
    [[stage.examples]]                   # at least one; each names how CI checks the rule
    release = "vllm==0.33.0"             # | run = "MODE" | source = "github:OWNER/REPO@TAG"

Files of the rules directories that hold OOM rules (``[[rule]]``) and no ``[[stage]]`` are
not stage rule files and are skipped (and the OOM loader skips stage rule files).
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from infersight.errors import Location, SourceError, undecodable
from infersight.rules.rulefile import ENGINE_VERSION_KEY, SITE_RULES_DIR, FileLoader, RulesError, env_rules_dirs

ENGINE_VERSION = (1, 0)
# Stages a rule may not produce: the lifecycle ones the hooks derive themselves.
RESERVED_STAGES = frozenset({"runtime_init", "framework_import", "ready_wait", "first_request", "unattributed",
                             "total"})
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
_STAGE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
TARGET = re.compile(rf"({_DOTTED}):({_DOTTED})")
_RELEASE = re.compile(r"([A-Za-z0-9][A-Za-z0-9._\-]*)==([A-Za-z0-9][A-Za-z0-9.+!\-]*)")
_SOURCE = re.compile(r"github:([A-Za-z0-9_.\-]+)/([A-Za-z0-9_.\-]+)@([A-Za-z0-9_.\-/]+)")
_RUN = re.compile(r"[a-z][a-z0-9_]{0,63}")
_TOP_KEYS = frozenset({ENGINE_VERSION_KEY, "description", "stage"})
_RULE_KEYS = frozenset({"id", "stage", "targets", "description", "examples", "ready", "until"})
_EXAMPLE_KEYS = frozenset({"release", "run", "source", "comment"})


def _ready(value: object) -> Literal["", "return", "entry", "helper"] | None:
    """``ready``'s TOML value as StageRule.ready (the hooks read it alike: ``_stagerules.READY_*``)."""
    if isinstance(value, bool):
        return "return" if value else ""
    if value == "return":
        return "return"
    if value == "entry":
        return "entry"
    if value == "helper":
        return "helper"
    return None


class StageRuleFileError(SourceError, RulesError):
    """Invalid stage rule file(s): one ``file:line: message`` line per problem."""

    def __init__(self, errors: list[tuple[Location, str]]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(f"{loc}: {msg}" for loc, msg in self.errors))
        self.locations = [loc for loc, _ in self.errors]


@dataclass(frozen=True, slots=True)
class StageExample:
    kind: Literal["release", "run", "source"]
    value: str  # "pkg==X.Y", a workload mode, or "github:OWNER/REPO@TAG"
    where: Location

    @property
    def dist(self) -> str:
        """The distribution of a ``release`` example."""
        return self.value.split("==", 1)[0]


@dataclass(frozen=True, slots=True)
class StageRule:
    id: str
    stage: str
    targets: tuple[str, ...]
    description: str
    examples: tuple[StageExample, ...]
    where: Location
    # readiness: "return" when an outermost call returns (Serve's replica init, serve.run; TOML
    # ``true``), "entry" when the target is called (a worker's serving loop: no span), "" never
    ready: Literal["", "return", "entry", "helper"] = ""
    # a wait: from a target's call to the first call of one of these (Ray's task loop until its first task)
    until: tuple[str, ...] = ()


@dataclass(slots=True)
class StageRuleSet:
    rules: list[StageRule]
    sources: list[str]

    def by_target(self) -> dict[str, StageRule]:
        """The rule that applies to each target (a later file's rule replaces an earlier one's)."""
        out: dict[str, StageRule] = {}
        for r in self.rules:
            for t in r.targets:
                out[t] = r
        return out


def is_stage_rule_text(text: str) -> bool:
    """A file the stage loader reads: it has ``[[stage]]`` tables, or no ``[[rule]]`` ones."""
    return "[[stage]]" in text or "[[rule]]" not in text


def split_target(target: str) -> tuple[str, str]:
    m = TARGET.fullmatch(target)
    if m is None:
        raise ValueError(f"target {target!r} is not module:qualname")
    return m.group(1), m.group(2)


class _FileLoader(FileLoader):
    def load(self) -> list[StageRule]:
        doc = self.document()
        if doc is None:
            return []
        self.check_top(doc, _TOP_KEYS, ENGINE_VERSION, " (a stage rule file holds [[stage]] tables)")
        raw = doc.get("stage", [])
        if not isinstance(raw, list):
            self.err(self.line("stage"), "'stage' must be an array of tables ([[stage]])")
            return []
        rules = [(i, r) for i, t in enumerate(raw) if (r := self._rule(i, t)) is not None]
        self._check_hooks_reading(rules)
        return [r for _, r in rules]

    def _rule(self, i: int, t: object) -> StageRule | None:
        start = self.line("stage", i)
        n_errors = len(self.errors)

        def line(key: str) -> int:
            return self.line("stage", i, key)

        if not isinstance(t, dict):
            self.err(start, "a stage rule must be a table")
            return None
        rid = self.rule_id(t, _RULE_KEYS, line, what="stage rule", pattern=_ID, fallback=f"<stage rule {i + 1}>",
                           id_error="id must be a string of letters, digits, '.', '_', '-'")
        stage = t.get("stage")
        if not isinstance(stage, str) or not _STAGE.fullmatch(stage):
            self.err(line("stage"), f"{rid}: stage must be a lower-case name ([a-z][a-z0-9_]*)")
        elif stage in RESERVED_STAGES:
            self.err(line("stage"), f"{rid}: stage {stage!r} is derived by the hooks, not by a rule")
        targets = t.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(x, str) for x in targets):
            self.err(line("targets"), f"{rid}: targets must be a non-empty array of \"module:qualname\" strings")
            targets = []
        for x in targets:
            if TARGET.fullmatch(x) is None:
                self.err(line("targets"), f"{rid}: target {x!r} is not module:qualname")
        if len(set(targets)) != len(targets):
            self.err(line("targets"), f"{rid}: a target is listed twice")
        until = t.get("until", [])
        if not isinstance(until, list) or not all(isinstance(x, str) and TARGET.fullmatch(x) for x in until):
            self.err(line("until"), f"{rid}: until must be an array of \"module:qualname\" strings")
            until = []
        elif set(until) & set(targets):
            self.err(line("until"), f"{rid}: a target cannot end its own wait")
        desc = t.get("description", "")
        if not isinstance(desc, str):
            self.err(line("description"), f"{rid}: description must be a string")
        ready = _ready(t.get("ready", False))
        if ready is None:
            self.err(line("ready"), f'{rid}: ready must be true, false, "entry" or "helper"')
        elif ready and until:
            self.err(line("ready"), f"{rid}: a wait (until) is never readiness: drop ready")
        examples = self._examples(str(rid), t.get("examples", []), i)
        if len(self.errors) == n_errors and not examples:
            self.err(start, f"{rid}: needs at least one example ([[stage.examples]] release, run or source)")
        if len(self.errors) != n_errors:
            return None
        return StageRule(str(rid), str(stage), tuple(targets), str(desc).strip(), examples, Location(self.path, start),
                         ready or "", tuple(until))

    def _examples(self, rid: str, raw: object, i: int) -> tuple[StageExample, ...]:
        if not isinstance(raw, list):
            self.err(self.line("stage", i, "examples"), f"{rid}: examples must be an array of tables")
            return ()
        out: list[StageExample] = []
        for j, ex in enumerate(raw):
            ln = self.line("stage", i, "examples", j)
            if not isinstance(ex, dict):
                self.err(ln, f"{rid}: example {j + 1} must be a table")
                continue
            extra = set(ex) - _EXAMPLE_KEYS
            if extra:
                self.err(ln, f"{rid}: example {j + 1}: unknown keys {sorted(extra)}")
            kinds = [k for k in ("release", "run", "source") if k in ex]
            if len(kinds) != 1:
                self.err(ln, f"{rid}: example {j + 1} needs exactly one of release, run, source")
                continue
            kind = kinds[0]
            value = ex[kind]
            pattern = {"release": _RELEASE, "run": _RUN, "source": _SOURCE}[kind]
            if not isinstance(value, str) or pattern.fullmatch(value) is None:
                shape = {"release": "PKG==VERSION", "run": "a workload mode", "source": "github:OWNER/REPO@TAG"}
                self.err(ln, f"{rid}: example {j + 1}: {kind} must be {shape[kind]}")
                continue
            out.append(StageExample(kind, value, Location(self.path, ln)))  # type: ignore[arg-type]
        return tuple(out)

    def _check_hooks_reading(self, rules: list[tuple[int, StageRule]]) -> None:
        """The hooks read id, stage, targets and ready without tomllib: one-line strings without
        escapes, a bare true/false or a plain string. Refuse what they would not read as tomllib does."""
        lines = self.text.split("\n")
        for i, r in rules:
            for key in ("id", "stage", "targets", "ready", "until"):
                at = self.keys.find(("stage", i, key))
                if at is None:
                    continue
                text = lines[at.line - 1]
                if "\\" in text or '"""' in text or "'''" in text:
                    self.err(at.line, f"{r.id}: {key}: write plain strings (no escapes, no multi-line strings): "
                                      "the hooks read this file without a TOML library")


def load_stage_rules(paths: Iterable[Path | str | resources.abc.Traversable]) -> StageRuleSet:
    """Load stage rule files in order; raise ``StageRuleFileError`` naming file:line for every
    problem. Files with OOM rules (``[[rule]]``) and no ``[[stage]]`` are skipped."""
    rs = StageRuleSet([], [])
    errors: list[tuple[Location, str]] = []
    ids: dict[str, Location] = {}
    for p in paths:
        name = str(p)
        try:
            text = (Path(p) if isinstance(p, str) else p).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            errors.append(undecodable(name, exc))
            continue
        except OSError as exc:
            errors.append((Location(name, 1), f"cannot read stage rule file: {exc}"))
            continue
        if not is_stage_rule_text(text):
            continue
        loader = _FileLoader(name, text)
        rules = loader.load()
        errors.extend(loader.errors)
        for r in rules:
            if r.id in ids:
                errors.append((r.where, f"duplicate stage rule id {r.id!r} (first at {ids[r.id]})"))
            else:
                ids[r.id] = r.where
        if not loader.errors:
            rs.rules.extend(rules)
            rs.sources.append(name)
    if errors:
        raise StageRuleFileError(errors)
    return rs


def builtin_stage_rules_path() -> resources.abc.Traversable:
    return resources.files("infersight.rules").joinpath("stages.toml")


def rules_dirs(extra: Iterable[str | Path] = (), env: dict[str, str] | None = None) -> list[Path]:
    """The rules directories as the hooks see them: ``$INFERSIGHT_RULES_DIRS`` (``:`` or ``,``
    separated) else /etc/infersight/rules.d, then ``extra``."""
    named = env_rules_dirs(os.environ if env is None else env)
    dirs = [Path(d) for d in named] if named is not None else [Path(SITE_RULES_DIR)]
    return [*dirs, *(Path(d) for d in extra)]


def default_stage_rule_paths(dirs: Iterable[str | Path]) -> list[Path | resources.abc.Traversable]:
    """The shipped file, then each directory's ``*.toml``, sorted by name."""
    paths: list[Path | resources.abc.Traversable] = [builtin_stage_rules_path()]
    for d in dirs:
        if Path(d).is_dir():
            paths.extend(sorted(Path(d).glob("*.toml")))
    return paths


# -- static checks against released source ---------------------------------------------------

TargetKind = Literal["function", "async function", "missing", "generator", "not a function"]


def target_in_source(source: str, qualname: str) -> TargetKind:
    """What ``qualname`` is in one module's source (read with ast, never imported): a
    function or method the hooks can wrap, or why not."""
    body: list[ast.stmt] = ast.parse(source).body
    parts = qualname.split(".")
    for k, part in enumerate(parts):
        found: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | None = None
        for node in body:  # the last definition wins, as at run time
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, (ast.If, ast.Try)):  # definitions under `if TYPE_CHECKING:` / try
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub.name == part:
                        found = sub
        if found is None:
            return "missing"
        if k < len(parts) - 1:
            if not isinstance(found, ast.ClassDef):
                return "missing"
            body = found.body
            continue
        if isinstance(found, ast.ClassDef):
            return "not a function"
        if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in _own_nodes(found)):
            return "generator"
        return "async function" if isinstance(found, ast.AsyncFunctionDef) else "function"
    return "missing"


def _own_nodes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterable[ast.AST]:
    """The nodes of ``fn``'s body outside nested functions, classes and lambdas."""
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
    stack: list[ast.AST] = [n for n in fn.body if not isinstance(n, scopes)]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if not isinstance(child, scopes))


def module_paths(module: str) -> tuple[str, str]:
    """The two files a module may be in a wheel or a source tree: ``a/b.py``, ``a/b/__init__.py``."""
    base = module.replace(".", "/")
    return base + ".py", base + "/__init__.py"
