"""A small, pure rule engine for OOM verdicts, driven by TOML rule files.

A rule file declares the ``engine_version`` it needs and a list of ``[[rule]]`` tables. Each
rule has an ``id``, a ``version``, a ``class``, a ``priority``, a ``condition`` written in a
tiny expression language, a ``remedy``, optional ``notes`` and example cases. Rules run in
ascending priority (ties: load order); the first whose condition is true decides. A
condition that cannot be decided because a number is missing either stops the run
(``when_unknown = "stop"``, what the ordered rubric needs) or is skipped (the default).
When the run stops, or nothing fires, the first rule of class ``unknown`` gives the verdict
and ``missing`` names the numbers that were needed.

The expression language is parsed here into a small AST and evaluated by a tree walk; it
never reaches ``eval``. Grammar::

    expr  := or ;  or := and ("or" and)* ;  and := not ("and" not)* ;  not := "not" not | cmp
    cmp   := sum [("<" | "<=" | ">" | ">=" | "==" | "!=") sum]
    sum   := prod (("+" | "-") prod)* ;  prod := unary (("*" | "/") unary)*
    unary := "-" unary | atom
    atom  := NUMBER [UNIT] | NAME | "true" | "false" | "(" expr ")"
           | ("max" | "min") "(" sum ("," sum)+ ")" | "abs" "(" sum ")" | "known" "(" NAME ")"

Units are B, KiB, MiB, GiB, TiB (and KB, MB, GB, TB). Unknown numbers propagate: arithmetic
on an unknown is unknown, and ``and``/``or``/``not`` use three-valued (Kleene) logic, so
``known(L) and F + C >= R`` is false, not unknown, when no cap was printed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeAlias

from infersight.bytesize import BYTE_UNITS, parse_bytes, torch_bytes
from infersight.errors import Location, SourceError, undecodable
from infersight.rules.oom_parse import NUMBER_KEYS, OomMessage, find_ooms
from infersight.rules.rulefile import ENGINE_VERSION_KEY, SITE_RULES_DIR, FileLoader, RulesError, env_rules_dirs

__all__ = [
    "BASE_QUANTITIES",
    "CLASSES",
    "DERIVED_QUANTITIES",
    "ENGINE_VERSION",
    "ExpressionError",
    "Rule",
    "RuleFileError",
    "RuleSet",
    "Verdict",
    "builtin_rule_set",
    "builtin_rules_path",
    "classify",
    "classify_message",
    "default_rule_paths",
    "derive",
    "evaluate",
    "load_default_rules",
    "load_rules",
    "parse_expression",
    "parse_template",
    "render",
    "site_rule_dirs",
]

ENGINE_VERSION = (1, 0)
CLASSES = ("capacity", "fragmentation", "reservation_conflict", "unknown")
BASE_QUANTITIES = NUMBER_KEYS  # R T F A P U O L, printed (or read) in bytes
# Derived by the engine (DESIGN, "The OOM rubric"); each maps to the base numbers it uses.
DERIVED_QUANTITIES: dict[str, tuple[str, ...]] = {
    "C": ("P", "A"),
    "N": ("U", "P", "A"),
    "N_prime": ("U", "P", "A"),
    "F_prime": ("F", "L", "P", "A"),
    "X": ("T", "F", "P", "A"),
}
GIB = 1 << 30

Value: TypeAlias = float | bool | None
Numbers: TypeAlias = Mapping[str, "int | float | None"]


# --------------------------------------------------------------------------------------
# Expressions


class ExpressionError(RulesError, ValueError):
    """A condition or template that does not parse or type-check; ``pos`` is the 0-based
    offset in the expression text where it went wrong, when known."""

    def __init__(self, msg: str, pos: int | None = None) -> None:
        super().__init__(msg)
        self.pos = pos


@dataclass(frozen=True, slots=True)
class Num:
    value: float


@dataclass(frozen=True, slots=True)
class BoolLit:
    value: bool


@dataclass(frozen=True, slots=True)
class Name:
    id: str


@dataclass(frozen=True, slots=True)
class Neg:
    operand: Expr


@dataclass(frozen=True, slots=True)
class Arith:
    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True, slots=True)
class Compare:
    op: str
    left: Expr
    right: Expr


@dataclass(frozen=True, slots=True)
class Logic:
    op: str  # "and" | "or"
    items: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Not:
    operand: Expr


@dataclass(frozen=True, slots=True)
class Call:
    fn: str  # max | min | abs
    args: tuple[Expr, ...]


@dataclass(frozen=True, slots=True)
class Known:
    name: str


Expr: TypeAlias = Num | BoolLit | Name | Neg | Arith | Compare | Logic | Not | Call | Known

# Units a number may carry in an expression (``2 GiB``), as written: reserved names.
_UNIT_BYTES = {u: BYTE_UNITS[u.lower()] for u in ("B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB")}
_KEYWORDS = frozenset({"and", "or", "not", "true", "false", "max", "min", "abs", "known"})
_MAX_EXPR_CHARS = 4000
# Depth of the expression tree: parentheses, unary operators and each operator of a chain
# such as R*R*R count. Evaluation and type checks recurse once per level, so this keeps them
# far below Python's recursion limit; real rules are under 10 deep.
_MAX_DEPTH = 64
_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d{1,18}(?:\.\d{1,12})?)|(?P<name>[A-Za-z_][A-Za-z0-9_]{0,63})"
    r"|(?P<op><=|>=|==|!=|[-+*/(),<>]))"
)


def _tokenize(src: str) -> tuple[list[tuple[str, str]], list[int]]:
    """Tokens (kind, text) and, beside them, the offset where each starts."""
    if len(src) > _MAX_EXPR_CHARS:
        raise ExpressionError(f"expression longer than {_MAX_EXPR_CHARS} characters", _MAX_EXPR_CHARS)
    out: list[tuple[str, str]] = []
    starts: list[int] = []
    pos = 0
    end = len(src.rstrip())
    while pos < end:
        m = _TOKEN.match(src, pos)
        if m is None or m.end() == pos:
            at = len(src) - len(src[pos:].lstrip())
            raise ExpressionError(f"unexpected character {src[at:at + 1]!r}", at)
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        starts.append(m.start(kind))
        pos = m.end()
    return out, starts


class _Parser:
    def __init__(self, src: str, names: frozenset[str]) -> None:
        self.toks, self.starts = _tokenize(src)
        self.end = len(src.rstrip())
        self.i = 0
        self.names = names
        self.depth = 0
        self.tree_depth: dict[int, int] = {}  # id(node) -> height; leaves are 1

    def pos(self, back: int = 0) -> int:
        """Offset of the current token (or of one ``back`` tokens earlier)."""
        i = self.i - back
        return self.starts[i] if 0 <= i < len(self.starts) else self.end

    def error(self, msg: str, back: int = 0) -> ExpressionError:
        return ExpressionError(msg, self.pos(back))

    def node(self, e: Expr, *children: Expr) -> Expr:
        """Record ``e``'s height in the tree; refuse a tree deeper than _MAX_DEPTH."""
        h = 1 + max((self.tree_depth.get(id(c), 1) for c in children), default=0)
        if h > _MAX_DEPTH:
            raise self.error(f"expression nested deeper than {_MAX_DEPTH} levels "
                             "(each operator of a chain counts one); split it or use max()/min()", 1)
        self.tree_depth[id(e)] = h
        return e

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise self.error(f"expected {value!r}, found end of expression")
        if value is not None and tok[1] != value:
            raise self.error(f"expected {value!r}, found {tok[1]!r}")
        self.i += 1
        return tok

    def at(self, *values: str) -> bool:
        tok = self.peek()
        return tok is not None and tok[0] in ("op", "name") and tok[1] in values

    def parse(self) -> Expr:
        e = self.or_()
        extra = self.peek()
        if extra is not None:
            raise self.error(f"unexpected {extra[1]!r}")
        return e

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise self.error(f"expression nested deeper than {_MAX_DEPTH} levels", 1)

    def or_(self) -> Expr:
        items = [self.and_()]
        while self.at("or"):
            self.take()
            items.append(self.and_())
        return items[0] if len(items) == 1 else self.node(Logic("or", tuple(items)), *items)

    def and_(self) -> Expr:
        items = [self.not_()]
        while self.at("and"):
            self.take()
            items.append(self.not_())
        return items[0] if len(items) == 1 else self.node(Logic("and", tuple(items)), *items)

    def not_(self) -> Expr:
        if self.at("not"):
            self.take()
            self._enter()
            inner = self.not_()
            self.depth -= 1
            return self.node(Not(inner), inner)
        return self.cmp()

    def cmp(self) -> Expr:
        left = self.sum()
        if self.at("<", "<=", ">", ">=", "==", "!="):
            op = self.take()[1]
            right = self.sum()
            if self.at("<", "<=", ">", ">=", "==", "!="):
                raise self.error("chained comparisons are not supported; use 'and'")
            return self.node(Compare(op, left, right), left, right)
        return left

    def sum(self) -> Expr:
        e = self.prod()
        while self.at("+", "-"):
            op = self.take()[1]
            right = self.prod()
            e = self.node(Arith(op, e, right), e, right)
        return e

    def prod(self) -> Expr:
        e = self.unary()
        while self.at("*", "/"):
            op = self.take()[1]
            right = self.unary()
            e = self.node(Arith(op, e, right), e, right)
        return e

    def unary(self) -> Expr:
        if self.at("-"):
            self.take()
            self._enter()
            inner = self.unary()
            self.depth -= 1
            return self.node(Neg(inner), inner)
        return self.atom()

    def atom(self) -> Expr:
        kind, text = self.take()
        if kind == "num":
            value = float(text)
            nxt = self.peek()
            if nxt is not None and nxt[0] == "name" and nxt[1] in _UNIT_BYTES:
                self.take()
                value *= _UNIT_BYTES[nxt[1]]
            return Num(value)
        if kind == "op" and text == "(":
            self._enter()
            e = self.or_()
            self.take(")")
            self.depth -= 1
            return e
        if kind == "name":
            if text in ("true", "false"):
                return BoolLit(text == "true")
            if text == "known":
                self.take("(")
                k, arg = self.take()
                if k != "name" or arg in _KEYWORDS:
                    raise self.error("known() takes one quantity name", 1)
                self._check_name(arg)
                self.take(")")
                return Known(arg)
            if text in ("max", "min", "abs"):
                self.take("(")
                self._enter()
                args = [self.sum()]
                while self.at(","):
                    self.take()
                    args.append(self.sum())
                self.take(")")
                self.depth -= 1
                if text == "abs" and len(args) != 1:
                    raise self.error("abs() takes one argument", 1)
                if text != "abs" and len(args) < 2:
                    raise self.error(f"{text}() takes two or more arguments", 1)
                return self.node(Call(text, tuple(args)), *args)
            if text in _KEYWORDS:
                raise self.error(f"unexpected {text!r}", 1)
            self._check_name(text)
            return Name(text)
        raise self.error(f"unexpected {text!r}", 1)

    def _check_name(self, name: str) -> None:
        if name not in self.names:
            raise self.error(f"unknown quantity {name!r} (known: {', '.join(sorted(self.names))})", 1)


def _type_of(e: Expr) -> Literal["num", "bool"]:
    """Type-check: arithmetic on numbers, logic on booleans, comparisons in between."""
    if isinstance(e, Num | Name):
        return "num"
    if isinstance(e, BoolLit | Known):
        return "bool"
    if isinstance(e, Neg):
        _want(e.operand, "num", "'-'")
        return "num"
    if isinstance(e, Arith):
        _want(e.left, "num", repr(e.op))
        _want(e.right, "num", repr(e.op))
        return "num"
    if isinstance(e, Call):
        for a in e.args:
            _want(a, "num", f"{e.fn}()")
        return "num"
    if isinstance(e, Compare):
        _want(e.left, "num", repr(e.op))
        _want(e.right, "num", repr(e.op))
        return "bool"
    if isinstance(e, Not):
        _want(e.operand, "bool", "'not'")
        return "bool"
    for item in e.items:
        _want(item, "bool", repr(e.op))
    return "bool"


def _want(e: Expr, kind: str, where: str) -> None:
    got = _type_of(e)
    if got != kind:
        noun = "a number" if kind == "num" else "a true/false test"
        raise ExpressionError(f"{where} needs {noun}")


def parse_expression(src: str, names: Iterable[str] = (), want: Literal["num", "bool"] = "bool") -> Expr:
    """Parse and type-check ``src``; ``names`` are the quantities it may use."""
    allowed = frozenset(names) or frozenset(BASE_QUANTITIES) | frozenset(DERIVED_QUANTITIES)
    expr = _Parser(src, allowed).parse()
    _want(expr, want, "the expression")
    return expr


def _names_in(e: Expr, tests: bool = True) -> set[str]:
    """Quantities ``e`` uses; ``tests=False`` leaves out those only seen by known()."""
    if isinstance(e, Name):
        return {e.id}
    if isinstance(e, Known):
        return {e.name} if tests else set()
    if isinstance(e, Neg | Not):
        return _names_in(e.operand, tests)
    if isinstance(e, Arith | Compare):
        return _names_in(e.left, tests) | _names_in(e.right, tests)
    if isinstance(e, Logic):
        return set().union(*(_names_in(i, tests) for i in e.items))
    if isinstance(e, Call):
        return set().union(*(_names_in(a, tests) for a in e.args))
    return set()


def _eval(e: Expr, env: Mapping[str, float | None]) -> Value:
    """Evaluate with unknown (None) propagation and three-valued logic."""
    if isinstance(e, Num):
        return e.value
    if isinstance(e, BoolLit):
        return e.value
    if isinstance(e, Name):
        return env.get(e.id)
    if isinstance(e, Known):
        return env.get(e.name) is not None
    if isinstance(e, Neg):
        v = _eval(e.operand, env)
        return None if v is None else -float(v)
    if isinstance(e, Arith):
        a, b = _eval(e.left, env), _eval(e.right, env)
        if a is None or b is None:
            return None
        x, y = float(a), float(b)
        if e.op == "+":
            return x + y
        if e.op == "-":
            return x - y
        if e.op == "*":
            return x * y
        return None if y == 0 else x / y
    if isinstance(e, Call):
        vals = [_eval(a, env) for a in e.args]
        if any(v is None for v in vals):
            return None
        nums = [float(v) for v in vals if v is not None]
        if e.fn == "abs":
            return abs(nums[0])
        return max(nums) if e.fn == "max" else min(nums)
    if isinstance(e, Compare):
        a, b = _eval(e.left, env), _eval(e.right, env)
        if a is None or b is None:
            return None
        x, y = float(a), float(b)
        return {
            "<": x < y,
            "<=": x <= y,
            ">": x > y,
            ">=": x >= y,
            "==": x == y,
            "!=": x != y,
        }[e.op]
    if isinstance(e, Not):
        v = _eval(e.operand, env)
        return None if v is None else not v
    # Kleene logic: a decided operand can settle the result even if others are unknown.
    vals = [_eval(i, env) for i in e.items]
    if e.op == "and":
        if any(v is False for v in vals):
            return False
        return None if any(v is None for v in vals) else True
    if any(v is True for v in vals):
        return True
    return None if any(v is None for v in vals) else False


# --------------------------------------------------------------------------------------
# Note templates: "{expr}" or "{expr:fmt}" with fmt bytes | pct | int | num; "{missing}".

_FMTS = ("bytes", "pct", "int", "num")


@dataclass(frozen=True, slots=True)
class Template:
    parts: tuple[str | tuple[Expr, str] | None, ...]  # None renders the missing names


def parse_template(src: str, names: Iterable[str]) -> Template:
    parts: list[str | tuple[Expr, str] | None] = []
    i = 0
    buf: list[str] = []
    while i < len(src):
        ch = src[i]
        if ch in "{}" and src[i : i + 2] in ("{{", "}}"):
            buf.append(ch)
            i += 2
            continue
        if ch == "}":
            raise ExpressionError("unmatched '}' in template (write '}}' for a brace)", i)
        if ch != "{":
            buf.append(ch)
            i += 1
            continue
        close = src.find("}", i)
        if close < 0:
            raise ExpressionError("unclosed '{' in template", i)
        body = src[i + 1 : close]
        if buf:
            parts.append("".join(buf))
            buf = []
        if body.strip() == "missing":
            parts.append(None)
        else:
            expr_src, _, fmt = body.rpartition(":") if ":" in body else (body, "", "bytes")
            fmt = fmt.strip() or "bytes"
            if fmt not in _FMTS:
                raise ExpressionError(f"unknown format {fmt!r} (use {', '.join(_FMTS)})", i)
            try:
                parts.append((parse_expression(expr_src, names, want="num"), fmt))
            except ExpressionError as exc:  # the offset within the whole template
                raise ExpressionError(str(exc), i + 1 + (exc.pos or 0)) from None
        i = close + 1
    if buf:
        parts.append("".join(buf))
    return Template(tuple(parts))


def evaluate(e: Expr, env: Mapping[str, float | None]) -> Value:
    """Evaluate a parsed expression (unknowns propagate; three-valued logic)."""
    return _eval(e, env)


def render(t: Template, env: Mapping[str, float | None], missing: Sequence[str] = ()) -> str:
    """Render a note template; an unknown value prints as "?"."""
    return _render(t, env, missing)


def _render(t: Template, env: Mapping[str, float | None], missing: Sequence[str]) -> str:
    out: list[str] = []
    for p in t.parts:
        if p is None:
            out.append(", ".join(missing) if missing else "none")
        elif isinstance(p, str):
            out.append(p)
        else:
            v = _eval(p[0], env)
            if v is None or isinstance(v, bool):
                out.append("?")
            elif p[1] == "pct":
                out.append(f"{100 * float(v):.0f}%")
            elif p[1] == "int":
                out.append(f"{float(v):.0f}")
            elif p[1] == "num":  # a plain number as an engine prints a fraction: up to 4 decimals
                out.append(f"{float(v):.4f}".rstrip("0").rstrip("."))
            else:
                out.append(torch_bytes(float(v)))
    return "".join(out)


# --------------------------------------------------------------------------------------
# Quantities


def derive(
    numbers: Numbers, backend: str = "native", extra: Mapping[str, float | None] | None = None
) -> dict[str, float | None]:
    """The rubric's environment: base numbers plus C, N, N_prime, F_prime and X."""
    env: dict[str, float | None] = {k: _num(numbers.get(k)) for k in BASE_QUANTITIES}
    if extra:
        env.update({k: _num(v) for k, v in extra.items() if k not in env})
    t, f, a, p, u, cap = (env[k] for k in ("T", "F", "A", "P", "U", "L"))
    c: float | None
    if backend == "cudaMallocAsync":
        # No cache with cudaMallocAsync: C = 0 and P = A.
        p = env["P"] = p if p is not None else a
        c = 0.0
    else:
        c = None if p is None or a is None else max(0.0, p - a)
    n = None if u is None or p is None else u - p
    env["C"] = c
    env["N"] = n
    env["N_prime"] = None if n is None else max(0.0, n - GIB)
    if cap is None:
        env["F_prime"] = f
    else:
        env["F_prime"] = None if f is None or p is None else min(f, cap - p)
    env["X"] = None if t is None or f is None or p is None else t - f - p
    return env


def _num(v: object) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int | float):
        return float(v)
    return None


def _missing(names: Iterable[str], env: Mapping[str, float | None]) -> list[str]:
    """Base numbers behind ``names`` that are absent, in rubric order."""
    base: set[str] = set()
    for n in names:
        if env.get(n) is not None:
            continue
        if n == "F_prime" and env.get("L") is None:
            base.add("F")  # no cap printed: F' is F
        else:
            base.update(d for d in DERIVED_QUANTITIES.get(n, (n,)) if d != "L")
    order = {k: i for i, k in enumerate(BASE_QUANTITIES)}
    return sorted((b for b in base if env.get(b) is None), key=lambda b: (order.get(b, 99), b))


# --------------------------------------------------------------------------------------
# Rules and rule files


class RuleFileError(SourceError, RulesError):
    """Invalid rule file(s). ``errors`` holds (location, message) for every problem, and
    the text is one ``file:line[:col]: message`` line for each."""

    def __init__(self, errors: Sequence[tuple[Location, str]]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(f"{loc}: {msg}" for loc, msg in self.errors))
        self.locations = [loc for loc, _ in self.errors]


@dataclass(frozen=True, slots=True)
class Note:
    when: Expr | None
    text: Template


@dataclass(frozen=True, slots=True)
class Example:
    kind: Literal["positive", "negative"]
    numbers: dict[str, int | None]
    backend: str
    expect_class: str | None
    where: Location


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    version: int
    cls: str
    priority: int
    condition_src: str
    condition: Expr
    remedy: str
    notes: tuple[Note, ...]
    when_unknown: Literal["stop", "skip"]
    description: str
    examples: tuple[Example, ...]
    where: Location
    order: int = 0  # load order, breaks priority ties

    @property
    def names(self) -> set[str]:
        return _names_in(self.condition)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One classification. ``numbers`` are the base numbers R T F A P U O L (bytes)."""

    cls: str
    rule: str
    rule_version: int
    requested_bytes: int | None
    numbers: dict[str, int | None]
    used: dict[str, int]
    remedy: str
    note: str
    missing: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The DESIGN ``classify --json`` object (plus ``used`` and ``missing``)."""
        return {
            "class": self.cls,
            "rule": self.rule,
            "requested_bytes": self.requested_bytes,
            "numbers": dict(self.numbers),
            "remedy": self.remedy,
            "note": self.note,
            "used": dict(self.used),
            "missing": list(self.missing),
        }


_FALLBACK = Rule(
    id="engine.unknown",
    version=1,
    cls="unknown",
    priority=1 << 30,
    condition_src="true",
    condition=BoolLit(True),
    remedy="Capture the full OOM message (or the observer's numbers) and classify again.",
    notes=(Note(None, Template(("missing: ", None))),),
    when_unknown="skip",
    description="built-in fallback when no rule of class unknown is loaded",
    examples=(),
    where=Location("<engine>", 0),
)


@dataclass(slots=True)
class RuleSet:
    """Rules in evaluation order, plus the files they came from."""

    rules: list[Rule] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    quantities: frozenset[str] = field(
        default_factory=lambda: frozenset(BASE_QUANTITIES) | frozenset(DERIVED_QUANTITIES)
    )

    def ordered(self) -> list[Rule]:
        return sorted(self.rules, key=lambda r: (r.priority, r.order))

    def get(self, rule_id: str) -> Rule | None:
        return next((r for r in self.rules if r.id == rule_id), None)

    def classify(
        self,
        numbers: Numbers,
        *,
        backend: str = "native",
        extra: Mapping[str, float | None] | None = None,
    ) -> Verdict:
        env = derive(numbers, backend, extra)
        base = {k: _as_int(numbers.get(k)) for k in BASE_QUANTITIES}
        needed: list[str] = []
        stopped: Rule | None = None
        ordered = self.ordered()
        for rule in ordered:
            if rule.cls == "unknown":
                continue
            v = _eval(rule.condition, env)
            if v is True:
                return self._verdict(rule, env, base, ())
            if v is None:
                gaps = _missing(_names_in(rule.condition, tests=False), env)
                needed.extend(n for n in gaps if n not in needed)
                if rule.when_unknown == "stop":
                    stopped = rule
                    break
        fallback = next(
            (r for r in ordered if r.cls == "unknown" and _eval(r.condition, env) is True),
            _FALLBACK,
        )
        used_from = stopped.names if stopped is not None else set()
        return self._verdict(fallback, env, base, tuple(needed), used_from)

    def _verdict(
        self,
        rule: Rule,
        env: Mapping[str, float | None],
        base: dict[str, int | None],
        missing: tuple[str, ...],
        used_from: set[str] | None = None,
    ) -> Verdict:
        names = set(rule.names) | (used_from or set())
        for n in list(names):
            names.update(DERIVED_QUANTITIES.get(n, ()))
        used = {n: round(v) for n in sorted(names) if (v := env.get(n)) is not None}
        notes = [_render(n.text, env, missing) for n in rule.notes if n.when is None or _eval(n.when, env) is True]
        return Verdict(
            cls=rule.cls,
            rule=rule.id,
            rule_version=rule.version,
            requested_bytes=base["R"],
            numbers=base,
            used=used,
            remedy=rule.remedy,
            note="; ".join(x for x in notes if x),
            missing=missing,
        )


def _as_int(v: object) -> int | None:
    f = _num(v)
    return None if f is None else round(f)


_RULE_KEYS = frozenset(
    {
        "id",
        "version",
        "class",
        "priority",
        "condition",
        "remedy",
        "notes",
        "when_unknown",
        "description",
        "examples",
    }
)
_TOP_KEYS = frozenset({ENGINE_VERSION_KEY, "quantities", "rule", "description"})
_EXAMPLE_KEYS = frozenset({"kind", "numbers", "text", "backend", "class", "comment"})
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


class _FileLoader(FileLoader):
    def __init__(self, path: str, text: str, names: frozenset[str], order0: int) -> None:
        super().__init__(path, text)
        self.names = names
        self.order0 = order0

    def expr_err(self, key: tuple[str | int, ...], src: str, exc: ExpressionError, msg: str) -> None:
        """An expression error at its line:column in the file, where the text of the
        expression can be found after its key as written (no escapes); else at the key's line."""
        where = self.keys.nearest(key)
        k = self.text.find(src, self.keys.offset(where)) if src else -1
        if k < 0 or exc.pos is None:
            self.err(where.line, msg)
            return
        self.errors.append((self.keys.location(k + min(exc.pos, len(src))), msg))

    def load(self) -> tuple[list[Rule], frozenset[str]]:
        doc = self.document()
        if doc is None:
            return [], self.names
        if "stage" in doc and "rule" not in doc:
            return [], self.names  # stage rules (stage_rules.py) in a shared rules directory
        self.check_top(doc, _TOP_KEYS, ENGINE_VERSION)
        names = self.names
        q = doc.get("quantities", [])
        if not isinstance(q, list) or not all(
            isinstance(x, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", x) for x in q
        ):
            self.err(self.line("quantities"), "quantities must be a list of names")
        else:
            bad = [x for x in q if x in _KEYWORDS or x in _UNIT_BYTES]
            if bad:
                self.err(self.line("quantities"), f"reserved quantity names: {bad}")
            names = names | frozenset(q)
        raw = doc.get("rule", [])
        if not isinstance(raw, list):
            self.err(self.line("rule"), "'rule' must be an array of tables ([[rule]])")
            return [], names
        rules: list[Rule] = []
        for i, table in enumerate(raw):
            rule = self._rule(i, table, names)
            if rule is not None:
                rules.append(rule)
        return rules, names

    def _rule(self, i: int, t: object, names: frozenset[str]) -> Rule | None:
        start = self.line("rule", i)
        n_errors = len(self.errors)

        def line(key: str) -> int:
            return self.line("rule", i, key)

        if not isinstance(t, dict):
            self.err(start, "a rule must be a table")
            return None
        rid = self.rule_id(t, _RULE_KEYS, line, what="rule", pattern=_ID, fallback=f"<rule {i + 1}>",
                           id_error="rule id must be a string of letters, digits, '.', '_', '-'")
        version = self.rule_version(t, line, rid)
        cls = t.get("class")
        if cls not in CLASSES:
            self.err(line("class"), f"{rid}: class must be one of {', '.join(CLASSES)}")
        prio = t.get("priority")
        if not isinstance(prio, int) or isinstance(prio, bool):
            self.err(line("priority"), f"{rid}: priority must be an integer")
        cond_src = t.get("condition")
        cond: Expr = BoolLit(False)
        if not isinstance(cond_src, str):
            self.err(line("condition"), f"{rid}: condition must be a string")
        else:
            try:
                cond = parse_expression(cond_src, names)
            except ExpressionError as exc:
                self.expr_err(("rule", i, "condition"), cond_src, exc, f"{rid}: condition: {exc}")
        remedy = t.get("remedy")
        if not isinstance(remedy, str) or not remedy.strip():
            self.err(line("remedy"), f"{rid}: remedy must be a non-empty string")
        when_unknown = t.get("when_unknown", "skip")
        if when_unknown not in ("stop", "skip"):
            self.err(line("when_unknown"), f"{rid}: when_unknown must be 'stop' or 'skip'")
        desc = t.get("description", "")
        if not isinstance(desc, str):
            self.err(line("description"), f"{rid}: description must be a string")
        notes = self._notes(rid, t.get("notes", []), names, ("rule", i, "notes"))
        examples = self._examples(rid, t.get("examples", []), ("rule", i, "examples"))
        kinds = {e.kind for e in examples}
        if len(self.errors) == n_errors and kinds != {"positive", "negative"}:
            self.err(start, f"{rid}: needs at least one positive and one negative example")
        if len(self.errors) != n_errors:
            return None
        return Rule(
            id=str(rid),
            version=version,
            cls=str(cls),
            priority=prio if isinstance(prio, int) else 0,
            condition_src=str(cond_src),
            condition=cond,
            remedy=str(remedy).strip(),
            notes=notes,
            when_unknown=when_unknown,
            description=str(desc).strip(),
            examples=examples,
            where=Location(self.path, start),
            order=self.order0 + i,
        )

    def _notes(self, rid: str, raw: object, names: frozenset[str], key: tuple[str | int, ...]) -> tuple[Note, ...]:
        if isinstance(raw, str):
            raw = [{"text": raw}]
        if not isinstance(raw, list):
            self.err(self.line(*key), f"{rid}: notes must be a list of {{when, text}} tables")
            return ()
        out: list[Note] = []
        for j, n in enumerate(raw):
            ln = self.line(*key, j)
            if not isinstance(n, dict) or not isinstance(n.get("text"), str):
                self.err(ln, f"{rid}: note {j + 1} needs a text string")
                continue
            extra = set(n) - {"when", "text"}
            if extra:
                self.err(ln, f"{rid}: note {j + 1}: unknown keys {sorted(extra)}")
            when = n.get("when")
            try:
                cond = None if when is None else parse_expression(str(when), names)
            except ExpressionError as exc:
                self.expr_err((*key, j, "when"), str(when), exc, f"{rid}: note {j + 1}: when: {exc}")
                continue
            try:
                out.append(Note(cond, parse_template(n["text"], names)))
            except ExpressionError as exc:
                self.expr_err((*key, j, "text"), n["text"], exc, f"{rid}: note {j + 1}: {exc}")
        return tuple(out)

    def _examples(self, rid: str, raw: object, key: tuple[str | int, ...]) -> tuple[Example, ...]:
        if not isinstance(raw, list):
            self.err(self.line(*key), f"{rid}: examples must be an array of tables ([[rule.examples]])")
            return ()
        out: list[Example] = []
        for j, ex in enumerate(raw):
            ln = self.line(*key, j)
            where = Location(self.path, ln)
            if not isinstance(ex, dict):
                self.err(ln, f"{rid}: example {j + 1} must be a table")
                continue
            extra = set(ex) - _EXAMPLE_KEYS
            if extra:
                self.err(ln, f"{rid}: example {j + 1}: unknown keys {sorted(extra)}")
            kind = ex.get("kind")
            if kind not in ("positive", "negative"):
                self.err(ln, f"{rid}: example {j + 1}: kind must be 'positive' or 'negative'")
                continue
            backend = ex.get("backend", "native")
            if backend not in ("native", "cudaMallocAsync"):
                self.err(ln, f"{rid}: example {j + 1}: backend must be native|cudaMallocAsync")
            expect = ex.get("class")
            if expect is not None and expect not in CLASSES:
                self.err(ln, f"{rid}: example {j + 1}: class must be one of {CLASSES}")
            numbers: dict[str, int | None] = dict.fromkeys(BASE_QUANTITIES)
            if "text" in ex:
                found = find_ooms(str(ex["text"]))
                if len(found) != 1:
                    self.err(ln, f"{rid}: example {j + 1}: text holds {len(found)} OOMs, not 1")
                    continue
                numbers = found[0].numbers()
                backend = found[0].backend
            raw_numbers = ex.get("numbers", {})
            if not isinstance(raw_numbers, dict):
                self.err(ln, f"{rid}: example {j + 1}: numbers must be a table")
                continue
            for k, v in raw_numbers.items():
                if k not in BASE_QUANTITIES:
                    self.err(ln, f"{rid}: example {j + 1}: unknown number {k!r}")
                    continue
                b = _size_value(v)
                if b is None:
                    self.err(ln, f"{rid}: example {j + 1}: {k} = {v!r} is not a size")
                numbers[k] = b
            out.append(Example(kind, numbers, str(backend), expect, where))
        return tuple(out)


def _size_value(v: object) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return round(v)
    if isinstance(v, str):
        return parse_bytes(v)
    return None


def _read(path: Path | resources.abc.Traversable | str) -> tuple[str, str]:
    if isinstance(path, str):
        path = Path(path)
    return str(path), path.read_text(encoding="utf-8")


def load_rules(paths: Iterable[Path | str | resources.abc.Traversable]) -> RuleSet:
    """Load rule files in order; raise ``RuleFileError`` naming file:line for every error.

    Each file's example cases are checked against the rules loaded so far (that file
    included), so a later site file cannot break the builtin file's examples.
    """
    rs = RuleSet()
    errors: list[tuple[Location, str]] = []
    ids: dict[str, Location] = {}
    for p in paths:
        try:
            name, text = _read(p)
        except UnicodeDecodeError as exc:  # the line and column of the bad byte
            errors.append(undecodable(str(p), exc))
            continue
        except OSError as exc:
            errors.append((Location(str(p), 1), f"cannot read rule file: {exc}"))
            continue
        loader = _FileLoader(name, text, rs.quantities, len(rs.rules))
        rules, names = loader.load()
        errors.extend(loader.errors)
        for r in rules:
            if r.id in ids:
                errors.append((r.where, f"duplicate rule id {r.id!r} (first at {ids[r.id]})"))
            else:
                ids[r.id] = r.where
        if loader.errors:
            continue
        rs.rules.extend(rules)
        rs.sources.append(name)
        rs.quantities = names
        errors.extend(check_examples(rs, rules))
    if errors:
        raise RuleFileError(errors)
    return rs


def check_examples(rs: RuleSet, rules: Iterable[Rule] | None = None) -> list[tuple[Location, str]]:
    """Run the example cases of ``rules`` (default: all) against ``rs``."""
    failures: list[tuple[Location, str]] = []
    for rule in rs.rules if rules is None else rules:
        for ex in rule.examples:
            v = rs.classify(ex.numbers, backend=ex.backend)
            fired = v.rule == rule.id
            if ex.kind == "positive" and not fired:
                failures.append((ex.where, f"{rule.id}: positive example gave {v.cls} by rule {v.rule}"))
            if ex.kind == "negative" and fired:
                failures.append((ex.where, f"{rule.id}: negative example fired the rule"))
            if ex.expect_class is not None and v.cls != ex.expect_class:
                failures.append((ex.where, f"{rule.id}: example expects {ex.expect_class}, got {v.cls}"))
    return failures


def builtin_rules_path() -> resources.abc.Traversable:
    """The rubric rule file shipped with the package."""
    return resources.files("infersight.rules").joinpath("oom.toml")


def default_rule_paths(
    extra_dirs: Iterable[str | Path] = (), site_dir: str | Path | None = None
) -> list[Path | resources.abc.Traversable]:
    """Builtin file, then ``site_dir/*.toml`` (default: the site directories, as the agent's
    ``rules.dirs`` reads them), then each of ``extra_dirs``, files sorted by name."""
    paths: list[Path | resources.abc.Traversable] = [builtin_rules_path()]
    dirs = [Path(site_dir)] if site_dir else site_rule_dirs()
    dirs = [d for d in dirs if d.is_dir()]
    dirs.extend(Path(d) for d in extra_dirs)
    for d in dirs:
        paths.extend(sorted(Path(d).glob("*.toml")))
    return paths


def site_rule_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    """``$INFERSIGHT_RULES_DIRS`` (``:`` or ``,`` separated: the variable of the agent's ``rules.dirs``),
    after ``$INFERSIGHT_RULES_DIR`` (one directory: what ``classify`` read before); neither set:
    /etc/infersight/rules.d."""
    env = os.environ if env is None else env
    one, many = env.get("INFERSIGHT_RULES_DIR"), env_rules_dirs(env)
    dirs = [Path(one)] if one else []
    if many is not None:
        dirs.extend(Path(d) for d in many)
    return dirs if one or many is not None else [Path(SITE_RULES_DIR)]


def load_default_rules(extra_dirs: Iterable[str | Path] = ()) -> RuleSet:
    return load_rules(default_rule_paths(extra_dirs))


_BUILTIN: RuleSet | None = None


def builtin_rule_set() -> RuleSet:
    """The builtin rubric rules, loaded (and checked) once per process; not to be changed."""
    global _BUILTIN
    if _BUILTIN is None:
        _BUILTIN = load_rules([builtin_rules_path()])
    return _BUILTIN


def classify(
    numbers: Numbers,
    rules: RuleSet | None = None,
    *,
    backend: str = "native",
    extra: Mapping[str, float | None] | None = None,
) -> Verdict:
    """Classify one OOM's numbers (bytes; None or absent where unknown)."""
    return (rules or builtin_rule_set()).classify(numbers, backend=backend, extra=extra)


def classify_message(msg: OomMessage, rules: RuleSet | None = None) -> Verdict:
    """Classify one parsed message, honouring its allocator backend."""
    return classify(msg.numbers(), rules, backend=msg.backend)
