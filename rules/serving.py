"""Memory errors of serving engines: recognised, classified in the engine's own terms.

``serving.toml`` holds one rule per mechanism an engine prints a memory failure for (vLLM's
KV-cache budget, SGLang's token pool, ONNX Runtime's BFC arena, XLA's program reservation...).
A rule names the engine, the fixed strings that must appear on a line (``anchors``: plain
substring tests, the cheap prefilter), regular expressions whose named groups give the
numbers (``patterns`` searched in the lines from the anchor on, ``context`` in the lines
before it too), the mechanism in words, the knob that sizes the engine's reservation, the
remedy in the engine's own knobs, and ordered ``cases`` that turn numbers (or a site in the
text) into a class. A class of ``unknown`` always carries a ``reason``: what is missing and
what to look at next. Every rule carries positive and negative examples that load-time
checks run, like ``oom.toml``.

PyTorch's own allocator messages (``oom_parse.find_ooms``) are classified by the rubric rules
(``oom.toml``); :func:`analyse` finds both kinds in one text, names the engine whose log it
was (an engine that prints PyTorch's message, ``ggml`` inside ollama, XLA inside vLLM-TPU),
and returns one :class:`Finding` per distinct message.

Linear in the text: the prefilter is one ``lower()`` and a few substring tests per line;
patterns run only on bounded windows (at most ``WINDOW_CHARS`` characters) around anchor
lines, and a rule file may not hold a quantified group that holds a quantifier.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, TypeAlias

from infersight.bytesize import parse_bytes, torch_bytes
from infersight.errors import Location, SourceError, undecodable
from infersight.rules.engine import (
    BASE_QUANTITIES,
    CLASSES,
    Expr,
    RuleSet,
    Template,
    Verdict,
    builtin_rule_set,
    builtin_rules_path,
    classify,
    derive,
    evaluate,
    load_rules,
    parse_expression,
    parse_template,
    render,
)
from infersight.rules.oom_parse import OomMessage, decoded_lines, find_ooms, log_prefix, prefix_ends
from infersight.rules.preparsed import read_shipped
from infersight.rules.rulefile import ENGINE_VERSION_KEY, FileLoader, RulesError
from infersight.sanitize import ANSI_CSI

__all__ = [
    "ENGINES",
    "Finding",
    "NotMemory",
    "ServingRule",
    "ServingRules",
    "ServingRulesError",
    "analyse",
    "builtin_serving_path",
    "detect_engine",
    "load_serving_rules",
    "prefilter_needles",
    "quiet_lines",
    "rubric_reason",
]

SERVING_ENGINE_VERSION = (1, 0)
ENGINES = (
    "pytorch", "vllm", "sglang", "tgi", "tensorrt-llm", "onnxruntime", "llama.cpp", "ollama", "lmdeploy", "xla",
    "ray",
)
WINDOW_LINES = 8  # lines from the anchor line on that patterns see (a rule may ask for up to MAX_WINDOW_LINES)
MAX_WINDOW_LINES = 40
CONTEXT_LINES = 40  # lines before the anchor that context patterns see
WINDOW_CHARS = 4000
CONTEXT_CHARS = 8000
MAX_FINDINGS = 256  # distinct memory errors one text yields (a message repeated is one)
MAX_EVENTS = 16 * MAX_FINDINGS  # events read in one text, repeats included: the work one text may cost
# A request this large is no shortage: a shape or size computation went wrong.
IMPOSSIBLE_BYTES = 1 << 50

# Lower-case substrings one of which every anchor line holds: the prefilter before any
# per-rule test. Kept in step with serving.toml by the loader (every anchor must hold one).
NEEDLES = (
    "memory", "alloc", "kv cache", "kvcache", "cache blocks", "resource_exhausted", "resource exhausted",
    "are available (after", "mem_buffer", "kv slot", "failed to create context",
    "swap space", "no space left for only one request", "not enough vram", "insufficient workspace",
    "failed to decode the batch", "cache entries", "cudnn convolution algorithm", "no enough blocks",
    "buffer maximum", "capacity of block_manager", "context size has been exceeded",
)

# Markers of the engine whose log a line comes from, most specific first. An engine that
# embeds another (ollama runs ggml, vLLM-TPU runs XLA, most engines print PyTorch's message)
# comes before it.
_ENGINE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ollama", ("ollama", "llama runner", "reported out-of-memory during startup")),
    ("lmdeploy", ("lmdeploy", "turbomind", "[TM]")),
    ("tensorrt-llm", ("[TensorRT-LLM]", "tensorrt_llm", "TensorRT-LLM", "tensorrtllm", "[TRT]", "[TRT-LLM]")),
    ("sglang", ("sglang", "sgl_jax", "sgl-jax", "mem-fraction-static", "mem_fraction_static", "torch_memory_saver",
                "Capture cuda graph")),
    ("tgi", ("text_generation_server", "text_generation_router", "text_generation_launcher",
             "text_generation_client", "text-generation-inference", "max-batch-prefill-tokens")),
    ("vllm", ("vllm", "vLLM", "VLLM", "Vllm", "EngineCore", "gpu_memory_utilization", "tpu_inference",
              "[core_client.py:", "[multiproc_executor.py:", "multiproc_worker_utils.py:", "[gpu_model_runner.py:",
              "[gpu_worker.py:", "enforce_eager",
              "Capturing cudagraphs")),
    ("onnxruntime", ("onnxruntime", "ONNXRuntime", "OnnxRuntime", "BFCArena", "onnx runtime error")),
    ("llama.cpp", ("ggml_", "llama_", "llm_load_", "load_tensors:", "llama.cpp", "ggml-cuda", "ggml-vulkan",
                   "ggml-metal")),
    ("xla", ("XlaRuntimeError", "RESOURCE_EXHAUSTED", "jaxlib", "xla_extension", "XLA:", "XLA_PYTHON_CLIENT",
             "bfc_allocator", "stream_executor", "from device: CUDA_ERROR_OUT_OF_MEMORY")),
    # Ray last: vLLM, SGLang and others run on it and name themselves too.
    ("ray", ("ray.exceptions.", "(raylet)", "ServeReplica", "ray::", "RAY_memory_")),
)
# Engines that may print (or wrap) a rule's engine's message, and so take the finding over.
_HOSTS: dict[str, tuple[str, ...]] = {
    "pytorch": ("vllm", "sglang", "tgi", "lmdeploy", "tensorrt-llm", "ray"),
    "llama.cpp": ("ollama",),
    "xla": ("vllm", "sglang"),
    "tensorrt-llm": ("onnxruntime",),  # ONNX Runtime's TensorRT execution provider relays TensorRT's errors
    "any": ENGINES[1:],
}

# A quantified group that holds a quantifier: the shape of catastrophic backtracking.
_NESTED_QUANTIFIER = re.compile(r"\((?:[^()\\]|\\.)*[*+}](?:[^()\\]|\\.)*\)[*+{]")
_WS = re.compile(r"[ \t]+")
_ANSI = ANSI_CSI  # CSI sequences: colours, cursor moves
_NEVER = re.compile(r"(?!)")  # matches nothing
_KEY_NOISE = re.compile(
    r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"  # ISO dates and times
    r"|\b\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)?"  # vLLM's "05-01 10:00:00"
    r"|\b\d\d:\d\d:\d\d(?:[.,]\d+)?"  # a time of day
    r"|\b(?:pid|tid)[=: ]\d+"  # a process or thread id
    r"|\.(?:py|cc|cpp|cu|go|rs|c|h):\d+"  # a source line
    r"|\b\d{9,}\b")  # a nanosecond stamp, a long id


class LazyPattern:
    """A regular expression compiled at its first use: the shipped rules as CI checked them (their
    pre-parsed document), where a first OOM needs only the patterns of the rules its lines anchor."""

    __slots__ = ("_compiled", "pattern")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._compiled: re.Pattern[str] | None = None

    def compiled(self) -> re.Pattern[str]:
        c = self._compiled
        if c is None:  # two threads may both compile it: the same pattern either way
            try:
                c = re.compile(self.pattern)
            except re.error:  # (another Python's re than CI's): analyse never raises; the pattern matches
                c = _NEVER  # nothing (a rule's stays silent, a not_memory line's hides nothing); `infersight
                # classify` loads the file checked and names the pattern
            self._compiled = c
        return c

    def search(self, string: str) -> re.Match[str] | None:
        return self.compiled().search(string)

    def finditer(self, string: str) -> Iterator[re.Match[str]]:
        return self.compiled().finditer(string)

    @property
    def groupindex(self) -> Mapping[str, int]:
        return self.compiled().groupindex


Pattern: TypeAlias = "re.Pattern[str] | LazyPattern"


class ServingRulesError(SourceError, RulesError):
    """Invalid serving rule file(s): one ``file:line: message`` line per problem."""

    def __init__(self, errors: list[tuple[Location, str]]) -> None:
        self.errors = errors
        super().__init__("\n".join(f"{loc}: {msg}" for loc, msg in errors))
        self.locations = [loc for loc, _ in errors]


@dataclass(frozen=True, slots=True)
class Case:
    """One way a rule decides: all of ``when`` (numbers), ``match`` (text) and ``engine`` hold."""

    cls: str
    when: Expr | None = None
    match: Pattern | None = None
    engine: str | None = None
    note: Template | None = None
    reason: str | None = None
    rule_suffix: str = ""
    knob: str | None = None  # the setting that sized the reservation, when it differs from the rule's
    # searched in the lines before the anchor too (the 40 context lines): a phase or site named by the
    # frames or log lines that precede the error
    match_before: Pattern | None = None


@dataclass(frozen=True, slots=True)
class Example:
    kind: str  # positive | negative
    text: str
    cls: str | None
    where: Location


@dataclass(frozen=True, slots=True)
class ServingRule:
    id: str
    version: int
    engine: str
    priority: int
    anchors: tuple[str, ...]
    patterns: tuple[Pattern, ...]
    context: tuple[Pattern, ...]
    window: int
    require_match: bool
    mechanism: str
    knob: str | None
    cls: str
    cases: tuple[Case, ...]
    remedy: str
    reason: str | None
    note: Template | None
    examples: tuple[Example, ...]
    where: Location
    fallback: bool = False  # used only when nothing else in the text is a memory error


@dataclass(frozen=True, slots=True)
class NotMemory:
    """Lines that hold a prefilter needle but are no memory error: a warning the engine recovers from (a
    skipped tactic, a retry, a tolerated allocation), or a failure of something other than memory. A line
    that matches one of ``lines`` anchors no rule (a PyTorch allocator message is found all the same)."""

    id: str
    engine: str
    lines: tuple[Pattern, ...]
    mechanism: str
    examples: tuple[Example, ...]  # "quiet": analyse finds nothing; "found": a memory error beside it still is
    where: Location
    # A line that says the engine retries what just failed (another way): the failure printed in the lines
    # right before it (at most this many, each holding a needle) anchors no rule either. A retry that fails
    # prints its own lines after it, which are found.
    retried_lines_before: int = 0
    # Lines the engine may print between the failure and the retry line while it recovers (freeing an idle
    # slot's cache, say): passed over (at most WINDOW_LINES of them) on the way back to the failure.
    retried_between: tuple[Pattern, ...] = ()
    # A line that refuses a setting (llama.cpp's "V cache quantization requires flash_attn") ends in a generic
    # failure that holds a needle ("failed to create context with model"): a line that matches one of
    # ``ends_in`` anchors no rule when one of ``lines`` is on it or at most ``ends_in_lines_after`` lines before.
    ends_in: tuple[Pattern, ...] = ()
    ends_in_lines_after: int = 0


@dataclass(slots=True)
class Finding:
    """One engine memory error (or PyTorch OOM) as found and classified."""

    engine: str
    cls: str
    rule: str
    rule_version: int
    numbers: dict[str, int | None]
    extra: dict[str, float]
    remedy: str
    note: str
    reason: str | None
    knob: str | None
    text: str
    key: str
    first_line: int
    last_line: int
    mechanism: str = ""
    message: OomMessage | None = None
    verdict: Verdict | None = None
    used: dict[str, int] = field(default_factory=dict)
    missing: tuple[str, ...] = ()

    @property
    def requested_bytes(self) -> int | None:
        return self.numbers.get("R")

    def to_json(self) -> dict[str, Any]:
        """The DESIGN ``classify --json`` object: engine-specific numbers join ``numbers``."""
        nums: dict[str, Any] = dict(self.numbers)
        for k, v in self.extra.items():
            nums[k] = int(v) if float(v).is_integer() and not k.endswith(("fraction", "utilization")) else v
        d: dict[str, Any] = {
            "class": self.cls,
            "rule": self.rule,
            "requested_bytes": self.requested_bytes,
            "numbers": nums,
            "remedy": self.remedy,
            "note": self.note,
            "engine": self.engine,
        }
        if self.cls == "unknown":
            d["reason"] = self.reason or "the message does not decide the class"
        if self.knob:
            d["knob"] = self.knob
        d["used"] = dict(self.used)
        d["missing"] = list(self.missing)
        return d


def detect_engine(text: str) -> str | None:
    """The engine whose markers ``text`` holds (the most specific first), or None."""
    for engine, marks in _ENGINE_MARKERS:
        if any(m in text for m in marks):
            return engine
    return None


# --------------------------------------------------------------------------------------
# Loading


def builtin_serving_path() -> resources.abc.Traversable:
    return resources.files("infersight.rules").joinpath("serving.toml")


_RULE_KEYS = frozenset({
    "id", "version", "engine", "priority", "anchors", "patterns", "context", "window", "mechanism", "knob",
    "class", "cases", "remedy", "reason", "note", "examples", "require_match", "fallback",
})
_ID = re.compile(r"[a-z0-9][a-z0-9_.\-]{0,127}")
_CASE_KEYS = frozenset({"class", "when", "match", "match_before", "engine", "note", "reason", "rule", "knob"})
_EXAMPLE_KEYS = frozenset({"kind", "text", "class", "source", "comment"})
_QUIET_EXAMPLE_KEYS = _EXAMPLE_KEYS - {"class"}


class _Loader(FileLoader):
    def __init__(self, path: str, text: str, lines: bool = True, parsed: dict[str, Any] | None = None) -> None:
        """``parsed``: the document of ``text`` as CI checked it (the shipped file's pre-parsed JSON):
        not parsed again, and its patterns compile at first use."""
        super().__init__(path, text, lines)
        self.names: frozenset[str] = frozenset(BASE_QUANTITIES)
        self.quiet: list[NotMemory] = []
        self.parsed = parsed

    def document(self) -> dict[str, Any] | None:
        return self.parsed if self.parsed is not None else super().document()

    def regex(self, src: object, line: int, rid: str, what: str) -> Pattern | None:
        if self.parsed is not None and isinstance(src, str) and src:
            return LazyPattern(src)
        if not isinstance(src, str) or not src:
            self.err(line, f"{rid}: {what} must be a non-empty string")
            return None
        if _NESTED_QUANTIFIER.search(src):
            self.err(line, f"{rid}: {what} {src!r} quantifies a group that holds a quantifier (backtracking)")
            return None
        try:
            pat = re.compile(src)
        except re.error as exc:
            self.err(line, f"{rid}: {what}: {exc}")
            return None
        for g in pat.groupindex:
            if g != "unit" and g not in self.names:
                self.err(line, f"{rid}: {what}: group {g!r} is no quantity (declare it in 'quantities')")
        return pat

    def load(self) -> tuple[list[ServingRule], dict[str, dict[str, str]]]:
        doc = self.document()
        if doc is None:
            return [], {}
        self.check_top(doc, (ENGINE_VERSION_KEY, "description", "quantities", "rule", "engine_remedies",
                             "not_memory"), SERVING_ENGINE_VERSION)
        q = doc.get("quantities", [])
        if not isinstance(q, list) or not all(isinstance(x, str) and re.fullmatch(r"[a-z][a-z0-9_]{0,63}", x)
                                              for x in q):
            self.err(self.line("quantities"), "quantities must be a list of lower-case names")
        else:
            self.names = self.names | frozenset(q)
        remedies = doc.get("engine_remedies", {})
        out_rem: dict[str, dict[str, str]] = {}
        if isinstance(remedies, dict):
            for eng, by_cls in remedies.items():
                if eng not in ENGINES or not isinstance(by_cls, dict) or any(
                        c not in CLASSES or not isinstance(t, str) for c, t in by_cls.items()):
                    self.err(self.line("engine_remedies", eng), f"engine_remedies.{eng}: engine -> class -> text")
                    continue
                out_rem[eng] = {c: " ".join(str(t).split()) for c, t in by_cls.items()}
        rules = [r for i, t in enumerate(doc.get("rule", [])) if (r := self.rule(i, t)) is not None]
        raw_quiet = doc.get("not_memory", [])
        if not isinstance(raw_quiet, list):
            self.err(self.line("not_memory"), "not_memory must be an array of tables")
            raw_quiet = []
        self.quiet = [q for i, t in enumerate(raw_quiet) if (q := self.not_memory(i, t)) is not None]
        return rules, out_rem

    def not_memory(self, i: int, t: object) -> NotMemory | None:
        start = self.line("not_memory", i)
        if not isinstance(t, dict):
            self.err(start, "a not_memory entry must be a table")
            return None
        extra = set(t) - {"id", "engine", "lines", "mechanism", "examples", "retried_lines_before", "retried_between",
                          "ends_in", "ends_in_lines_after"}
        if extra:
            self.err(start, f"not_memory: unknown keys {sorted(extra)}")
        qid = t.get("id")
        if not isinstance(qid, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_.\-]{0,80}", qid):
            self.err(start, "not_memory: id must be a short lower-case name")
            return None
        engine = t.get("engine")
        if engine not in ENGINES and engine != "any":
            self.err(start, f"{qid}: engine must be one of {', '.join(ENGINES)} or any")
        mechanism = t.get("mechanism")
        if not isinstance(mechanism, str) or not mechanism.strip():
            self.err(start, f"{qid}: mechanism says why these lines are no memory error")
        raw = t.get("lines")
        if not isinstance(raw, list) or not raw or not all(isinstance(x, str) for x in raw):
            self.err(start, f"{qid}: lines must be a non-empty list of regular expressions")
            return None
        pats = [p for x in raw if (p := self.regex(x, self.line("not_memory", i, "lines"), qid, "line")) is not None]
        retried = t.get("retried_lines_before", 0)
        if not isinstance(retried, int) or isinstance(retried, bool) or not 0 <= retried <= WINDOW_LINES * 2:
            self.err(self.line("not_memory", i, "retried_lines_before"),
                     f"{qid}: retried_lines_before must be 0..{WINDOW_LINES * 2} lines")
            retried = 0
        raw_between = t.get("retried_between", [])
        between: list[Pattern] = []
        if not isinstance(raw_between, list) or not all(isinstance(x, str) for x in raw_between) or (
                raw_between and not t.get("retried_lines_before")):
            self.err(self.line("not_memory", i, "retried_between"),
                     f"{qid}: retried_between is a list of regular expressions, with retried_lines_before")
        else:
            between = [p for x in raw_between
                       if (p := self.regex(x, self.line("not_memory", i, "retried_between"), qid, "line")) is not None]
            if any(isinstance(p, re.Pattern) and p.search("") for p in between):
                self.err(self.line("not_memory", i, "retried_between"),
                         f"{qid}: a retried_between pattern matches an empty line (it would pass over any line)")
                between = []
        ends_in, ends_after = self.ends_in(t, i, qid)
        examples = self.examples(t.get("examples", []), i, qid, section="not_memory", kinds=("quiet", "found"),
                                 keys=_QUIET_EXAMPLE_KEYS)
        if not any(e.kind == "quiet" for e in examples):
            self.err(start, f"{qid}: needs a quiet example")
        return NotMemory(qid, str(engine), tuple(pats), " ".join(str(mechanism).split()), tuple(examples),
                         Location(self.path, start), retried, tuple(between), ends_in, ends_after)

    def ends_in(self, t: dict[str, Any], i: int, qid: str) -> tuple[tuple[Pattern, ...], int]:
        """A not_memory entry's ``ends_in`` patterns and ``ends_in_lines_after`` (see NotMemory): both or neither."""
        raw, after = t.get("ends_in", []), t.get("ends_in_lines_after", 0)
        if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw) or (
                bool(raw) != ("ends_in_lines_after" in t)):
            self.err(self.line("not_memory", i, "ends_in"),
                     f"{qid}: ends_in is a list of regular expressions, with ends_in_lines_after")
            return (), 0
        if not isinstance(after, int) or isinstance(after, bool) or not 0 <= after <= WINDOW_LINES * 2:
            self.err(self.line("not_memory", i, "ends_in_lines_after"),
                     f"{qid}: ends_in_lines_after must be 0..{WINDOW_LINES * 2} lines")
            return (), 0
        pats = tuple(p for x in raw if (p := self.regex(x, self.line("not_memory", i, "ends_in"), qid, "line")))
        if any(isinstance(p, re.Pattern) and p.search("") for p in pats):
            self.err(self.line("not_memory", i, "ends_in"), f"{qid}: an ends_in pattern matches an empty line")
            return (), 0
        return pats, after

    def rule(self, i: int, t: object) -> ServingRule | None:
        start = self.line("rule", i)
        n0 = len(self.errors)
        if not isinstance(t, dict):
            self.err(start, "a rule must be a table")
            return None

        def ln(key: str) -> int:
            return self.line("rule", i, key)

        rid = self.rule_id(t, _RULE_KEYS, ln, what="rule", pattern=_ID, fallback=f"<rule {i + 1}>",
                           id_error="rule id must be lower-case letters, digits, '.', '_', '-'")
        version = self.rule_version(t, ln, rid)
        engine = t.get("engine")
        if engine not in ENGINES and engine != "any":
            self.err(ln("engine"), f"{rid}: engine must be one of {', '.join(ENGINES)} or 'any'")
        prio = t.get("priority", 50)
        if not isinstance(prio, int) or isinstance(prio, bool):
            self.err(ln("priority"), f"{rid}: priority must be an integer")
        anchors = t.get("anchors")
        if not isinstance(anchors, list) or not anchors or not all(isinstance(a, str) and a for a in anchors):
            self.err(ln("anchors"), f"{rid}: anchors must be a non-empty list of strings")
            anchors = []
        for a in anchors:
            if not any(n in a.lower() for n in NEEDLES):
                self.err(ln("anchors"), f"{rid}: anchor {a!r} holds none of the prefilter needles {NEEDLES}")
        pats = [p for j, s in enumerate(t.get("patterns", [])) if (p := self.regex(s, ln("patterns"), rid,
                                                                                     f"patterns[{j}]"))]
        ctx = [p for j, s in enumerate(t.get("context", [])) if (p := self.regex(s, ln("context"), rid,
                                                                                   f"context[{j}]"))]
        window = t.get("window", WINDOW_LINES)
        if not isinstance(window, int) or not 1 <= window <= MAX_WINDOW_LINES:
            self.err(ln("window"), f"{rid}: window must be 1..{MAX_WINDOW_LINES} lines")
            window = WINDOW_LINES
        require = t.get("require_match", False)
        if not isinstance(require, bool) or (require and not pats):
            self.err(ln("require_match"), f"{rid}: require_match is true or false, and needs patterns")
            require = False
        fallback = t.get("fallback", False)
        if not isinstance(fallback, bool):
            self.err(ln("fallback"), f"{rid}: fallback is true or false")
            fallback = False
        mechanism = t.get("mechanism")
        if not isinstance(mechanism, str) or len(mechanism.split()) < 8:
            self.err(ln("mechanism"), f"{rid}: mechanism must say, in words, how the engine fails")
        knob = t.get("knob")
        if knob is not None and not isinstance(knob, str):
            self.err(ln("knob"), f"{rid}: knob must be a string")
        cls = t.get("class")
        if cls not in CLASSES:
            self.err(ln("class"), f"{rid}: class must be one of {', '.join(CLASSES)}")
        remedy = t.get("remedy")
        if not isinstance(remedy, str) or not remedy.strip():
            self.err(ln("remedy"), f"{rid}: remedy must be a non-empty string")
        reason = t.get("reason")
        if reason is not None and not isinstance(reason, str):
            self.err(ln("reason"), f"{rid}: reason must be a string")
        if cls == "unknown" and not reason:
            self.err(ln("reason"), f"{rid}: class unknown needs a reason (what is missing, what to look at)")
        self.check_reason(reason, ln("reason"), rid)
        note = self.template(t.get("note"), ln("note"), rid)
        cases = []
        for j, c in enumerate(t.get("cases", [])):
            case = self.case(c, self.line("rule", i, "cases", j), rid, reason)
            if case is not None:
                cases.append(case)
        examples = self.examples(t.get("examples", []), i, rid)
        if len(self.errors) == n0 and {e.kind for e in examples} != {"positive", "negative"}:
            self.err(start, f"{rid}: needs at least one positive and one negative example")
        if len(self.errors) != n0:
            return None
        return ServingRule(
            id=rid, version=version, engine=str(engine),
            priority=int(prio), anchors=tuple(anchors),
            patterns=tuple(pats), context=tuple(ctx), window=window, require_match=bool(require),
            mechanism=" ".join(str(mechanism).split()),
            knob=knob, cls=str(cls), cases=tuple(cases), remedy=" ".join(str(remedy).split()),
            reason=" ".join(reason.split()) if isinstance(reason, str) else None, note=note,
            examples=tuple(examples), where=Location(self.path, start), fallback=fallback,
        )

    def check_reason(self, src: object, line: int, rid: str) -> None:
        """A reason may name the printed numbers like a note ({R}, {F:int}); they must be known names."""
        if not isinstance(src, str) or "{" not in src:
            return
        try:
            parse_template(" ".join(src.split()), self.names)
        except RulesError as exc:
            self.err(line, f"{rid}: reason: {exc}")

    def template(self, src: object, line: int, rid: str) -> Template | None:
        if src is None:
            return None
        if not isinstance(src, str):
            self.err(line, f"{rid}: note must be a string")
            return None
        try:
            return parse_template(" ".join(src.split()), self.names)
        except RulesError as exc:
            self.err(line, f"{rid}: note: {exc}")
            return None

    def case(self, c: object, line: int, rid: str, default_reason: str | None) -> Case | None:
        if not isinstance(c, dict):
            self.err(line, f"{rid}: a case must be a table")
            return None
        extra = set(c) - _CASE_KEYS
        if extra:
            self.err(line, f"{rid}: case: unknown keys {sorted(extra)}")
        cls = c.get("class")
        if cls not in CLASSES:
            self.err(line, f"{rid}: case class must be one of {', '.join(CLASSES)}")
            return None
        when = None
        if "when" in c:
            try:
                when = parse_expression(str(c["when"]), self.names)
            except RulesError as exc:
                self.err(line, f"{rid}: case when: {exc}")
                return None
        match = self.regex(c["match"], line, rid, "case match") if "match" in c else None
        before = self.regex(c["match_before"], line, rid, "case match_before") if "match_before" in c else None
        engine = c.get("engine")
        if engine is not None and engine not in ENGINES:
            self.err(line, f"{rid}: case engine must be one of {', '.join(ENGINES)}")
        reason = c.get("reason")
        if cls == "unknown" and not reason and not default_reason:
            self.err(line, f"{rid}: a case of class unknown needs a reason")
        self.check_reason(reason, line, rid)
        suffix = c.get("rule", "")
        if not isinstance(suffix, str) or not re.fullmatch(r"[a-z0-9_\-]{0,32}", suffix):
            self.err(line, f"{rid}: case rule must be a short lower-case suffix")
            suffix = ""
        knob = c.get("knob")
        if knob is not None and (not isinstance(knob, str) or not knob.strip()):
            self.err(line, f"{rid}: case knob must be a non-empty string")
            knob = None
        return Case(cls=str(cls), when=when, match=match, engine=engine,
                    note=self.template(c.get("note"), line, rid),
                    reason=" ".join(reason.split()) if isinstance(reason, str) else None, rule_suffix=suffix,
                    knob=knob, match_before=before)

    def examples(self, raw: object, i: int, rid: str, section: str = "rule",
                 kinds: tuple[str, str] = ("positive", "negative"),
                 keys: frozenset[str] = _EXAMPLE_KEYS) -> list[Example]:
        """The examples of a ``[[rule]]`` (or ``[[not_memory]]``) table; the first of ``kinds`` names its source."""
        out: list[Example] = []
        if not isinstance(raw, list):
            self.err(self.line(section, i, "examples"), f"{rid}: examples must be an array of tables")
            return out
        for j, ex in enumerate(raw):
            line = self.line(section, i, "examples", j)
            if not isinstance(ex, dict) or ex.get("kind") not in kinds or not isinstance(ex.get("text"), str):
                self.err(line, f"{rid}: example {j + 1} needs kind ({'|'.join(kinds)}) and text")
                continue
            extra = set(ex) - keys
            if extra:
                self.err(line, f"{rid}: example {j + 1}: unknown keys {sorted(extra)}")
            if ex["kind"] == kinds[0] and not isinstance(ex.get("source"), str):
                self.err(line, f"{rid}: example {j + 1}: a {kinds[0]} example names its source")
            cls = ex.get("class")
            if cls is not None and cls not in CLASSES:
                self.err(line, f"{rid}: example {j + 1}: class must be one of {', '.join(CLASSES)}")
            out.append(Example(str(ex["kind"]), ex["text"], cls, Location(self.path, line)))
        return out


@dataclass(slots=True)
class ServingRules:
    """The serving rules in priority order, the engines' remedies, and the rubric rules."""

    rules: list[ServingRule]
    engine_remedies: dict[str, dict[str, str]]
    rubric: RuleSet
    sources: list[str] = field(default_factory=list)
    not_memory: list[NotMemory] = field(default_factory=list)
    # (the ``rules`` list it was built for, needle -> the indices in it of the rules one of whose anchors holds
    # that needle): built at first use, again when ``rules`` is another list (the loader replaces it per file)
    _by_needle: tuple[list[ServingRule], dict[str, tuple[int, ...]]] | None = field(
        default=None, repr=False, compare=False)

    def rules_for(self, line: str) -> list[ServingRule]:
        """The rules one of whose anchors may be in ``line``, in priority order: those with an anchor that
        holds a needle the line holds (every anchor holds one, a load check), never more than ``rules``."""
        rules = self.rules
        cached = self._by_needle
        if cached is not None and cached[0] is rules:
            index = cached[1]
        else:
            built: dict[str, list[int]] = {n: [] for n in NEEDLES}
            for k, rule in enumerate(rules):
                for n in NEEDLES:
                    if any(n in a.lower() for a in rule.anchors):
                        built[n].append(k)
            index = {n: tuple(ks) for n, ks in built.items()}
            self._by_needle = (rules, index)
        low = line.lower()
        picked: set[int] = set()
        for n, ks in index.items():
            if ks and n in low:
                picked.update(ks)
        return [rules[k] for k in sorted(picked)]

    def check_not_memory(self, entries: Iterable[NotMemory] | None = None) -> list[tuple[Location, str]]:
        failures: list[tuple[Location, str]] = []
        for q in self.not_memory if entries is None else entries:
            for ex in q.examples:
                found = analyse(ex.text, self)
                if ex.kind == "quiet" and found:
                    failures.append((ex.where, f"{q.id}: quiet example gave {', '.join(f.rule for f in found)}"))
                elif ex.kind == "found" and not found:
                    failures.append((ex.where, f"{q.id}: the memory error beside these lines was not found"))
        return failures

    def check_examples(self, rules: Iterable[ServingRule] | None = None) -> list[tuple[Location, str]]:
        failures: list[tuple[Location, str]] = []
        for rule in self.rules if rules is None else rules:
            for ex in rule.examples:
                found = analyse(ex.text, self)
                mine = [f for f in found if f.rule.split("/")[0] == rule.id]
                if ex.kind == "negative":
                    if mine:
                        failures.append((ex.where, f"{rule.id}: negative example fired the rule"))
                    continue
                if not mine:
                    got = ", ".join(f.rule for f in found) or "nothing"
                    failures.append((ex.where, f"{rule.id}: positive example gave {got}"))
                elif ex.cls is not None and mine[0].cls != ex.cls:
                    failures.append((ex.where, f"{rule.id}: example expects {ex.cls}, got {mine[0].cls}"))
        return failures


def load_serving_rules(paths: Iterable[Path | str | resources.abc.Traversable] | None = None,
                       rubric: RuleSet | None = None, run_examples: bool = True) -> ServingRules:
    """Load serving rule files (default: the builtin one); raise ServingRulesError (file:line).
    ``run_examples=False`` skips running the rules' examples (the shipped file's run in CI) and the index of
    where each key is written (only errors need it: a file that has one is loaded again with it)."""
    todo = list(paths) if paths is not None else None
    if not run_examples:
        try:
            return _load_serving_rules(todo, rubric, run_examples=False, lines=False)
        except ServingRulesError:
            pass  # again with the lines, for the errors' file:line
    return _load_serving_rules(todo, rubric, run_examples, lines=True)


def _load_serving_rules(paths: list[Path | str | resources.abc.Traversable] | None, rubric: RuleSet | None,
                        run_examples: bool, lines: bool) -> ServingRules:
    errors: list[tuple[Location, str]] = []
    rs = ServingRules([], {}, rubric if rubric is not None else load_rules([builtin_rules_path()]))
    ids: set[str] = set()
    for p in list(paths) if paths is not None else [builtin_serving_path()]:
        name = str(p)
        try:
            text = Path(p).read_text(encoding="utf-8") if isinstance(p, (str, Path)) else p.read_text(
                encoding="utf-8")
        except UnicodeDecodeError as exc:
            errors.append(undecodable(name, exc))
            continue
        except OSError as exc:
            errors.append((Location(name, 1), f"cannot read rule file: {exc}"))
            continue
        # the shipped file, unchanged since it was pre-parsed (and checked whole by CI): its JSON document
        parsed = read_shipped(text) if paths is None and not lines else None  # (no lines: no examples run)
        loader = _Loader(name, text, lines, parsed)
        rules, remedies = loader.load()
        errors.extend(loader.errors)
        for r in rules:
            if r.id in ids:
                errors.append((r.where, f"duplicate rule id {r.id!r}"))
            ids.add(r.id)
        for q in loader.quiet:
            if q.id in ids:
                errors.append((q.where, f"duplicate id {q.id!r}"))
            ids.add(q.id)
        if loader.errors:
            continue
        rs.rules = sorted([*rs.rules, *rules], key=lambda r: r.priority)
        rs.not_memory = [*rs.not_memory, *loader.quiet]
        for eng, by_cls in remedies.items():
            rs.engine_remedies.setdefault(eng, {}).update(by_cls)
        rs.sources.append(name)
        if run_examples:
            errors.extend(rs.check_examples(rules))
            errors.extend(rs.check_not_memory(loader.quiet))
    if errors:
        raise ServingRulesError(errors)
    return rs


_BUILTIN: ServingRules | None = None


def builtin() -> ServingRules:
    """The builtin serving rules over the builtin rubric rules, loaded (and checked) once per process."""
    global _BUILTIN
    if _BUILTIN is None:
        # The shipped file's examples run in CI (tests/unit/test_oom_serving.py), not in every
        # process: a quarter of the load, which a launched cold start's first OOM waits for.
        _BUILTIN = load_serving_rules(rubric=builtin_rule_set(), run_examples=False)
    return _BUILTIN


def prefilter_needles() -> tuple[str, ...]:
    """The lower-case needles every anchor line holds one of (hooks mirror them)."""
    return NEEDLES


# --------------------------------------------------------------------------------------
# Matching


def _candidate_lines(lines: list[str], quiet: Iterable[NotMemory] = ()) -> list[int]:
    """The lines that may anchor a rule: they hold a needle and no not_memory entry claims them (nor
    the lines of a failure that the engine retried, right before a line that says so)."""
    pats = [(p, q) for q in quiet for p in q.lines]
    refusals = [q for q in quiet if q.ends_in]
    refused: dict[tuple[int, int], bool] = {}  # (entry, line): the line refuses that entry's setting
    out: list[int] = []
    for i, line in enumerate(lines):
        if not _holds_needle(line):
            continue
        q = next((q for p, q in pats if p.search(line)), None)
        if q is None:
            if not any(_ends_a_refusal(k, r, lines, i, refused) for k, r in enumerate(refusals)):
                out.append(i)
            continue
        # the retried failure: the candidate lines right before this one (past the engine's recovery lines),
        # back to the first that is none
        claimed, j = q.retried_lines_before, i - 1
        if claimed and q.retried_between:
            floor = max(0, i - WINDOW_LINES)
            while j >= floor and any(b.search(lines[j]) for b in q.retried_between):
                if out and out[-1] == j:  # a recovery line with a needle of its own
                    out.pop()
                j -= 1
        while claimed > 0 and out and out[-1] == j:
            out.pop()
            j, claimed = j - 1, claimed - 1
    return out


def _ends_a_refusal(k: int, q: NotMemory, lines: list[str], i: int, refused: dict[tuple[int, int], bool]) -> bool:
    """Whether line ``i`` is the generic failure (``q.ends_in``) of a setting refused on it or just before it;
    ``refused`` keeps what each line was found to be (a log of many failures reads each line once)."""
    if not any(p.search(lines[i]) for p in q.ends_in):
        return False
    for j in range(max(0, i - q.ends_in_lines_after), i + 1):
        hit = refused.get((k, j))
        if hit is None:
            hit = refused[(k, j)] = any(p.search(lines[j]) for p in q.lines)
        if hit:
            return True
    return False


def _line_of(starts: list[int], base: int, offset: int) -> int:
    lo = 0
    for k, s in enumerate(starts):
        if s <= offset:
            lo = k
        else:
            break
    return base + lo


def _value(name: str, raw: str, unit: str | None) -> float | None:
    if name in BASE_QUANTITIES or name.endswith("_bytes"):
        b = parse_bytes(raw, unit)
        return None if b is None else float(b)
    try:
        return float(raw)
    except ValueError:
        return None


def _take_values(m: re.Match[str], values: dict[str, float]) -> None:
    """The quantities ``m``'s named groups hold, into ``values`` (a quantity found before is kept)."""
    groups = m.groupdict()
    unit = groups.get("unit")
    for g, raw in groups.items():
        if g == "unit" or raw is None or g in values:
            continue
        v = _value(g, raw, unit)
        if v is not None:
            values[g] = v


@dataclass(slots=True)
class _Hit:
    rule: ServingRule
    anchor: int
    first: int
    last: int
    values: dict[str, float]
    window: str
    text: str
    around: str = ""  # the context lines and the window, for cases that read the lines before the anchor
    matched: bool = True  # a pattern matched: the hit's text is a message of its own, not only an anchor


class _Unprefixed:
    """The lines with the log prefix each shares with a neighbour cut ("Nov 25 06:44:10 host ollama[95]: ",
    "vllm-1  | ", "> "), computed on demand: a pattern that spans lines, or reads a line from its start, is tried
    on them when the lines as printed do not match (line indexes are the same)."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self._cut: dict[int, str] = {}
        # each line as printed (False) and cut (True), spaces collapsed and cut at a limit: the windows of nearby
        # anchors overlap, and every rule anchored on a line reads its window and context (a few copies of the text)
        self._collapsed: dict[tuple[bool, int, int], str] = {}

    def line(self, i: int) -> str:
        got = self._cut.get(i)
        if got is None:
            got = self.lines[i]
            for j in (i - 1, i + 1):
                if 0 <= j < len(self.lines):
                    got = _cut_shared(self.lines[i], self.lines[j])
                    if got is not self.lines[i]:
                        break
            self._cut[i] = got
        return got

    def forget_before(self, line: int) -> None:
        """Drop the collapsed lines before ``line``: the anchors still to come read no window that reaches them."""
        for key in [k for k in self._collapsed if k[1] < line]:
            del self._collapsed[key]

    def joined(self, start: int, end: int, limit: int) -> tuple[str, list[int]]:
        """Lines [start, end) with their shared prefixes cut, joined by newlines (tabs and runs of spaces collapsed),
        at most ``limit`` characters, and the offset where each line starts."""
        return self._join(True, start, end, limit)

    def printed(self, start: int, end: int, limit: int) -> tuple[str, list[int]]:
        """Lines [start, end) as printed, joined as :meth:`joined` does."""
        return self._join(False, start, end, limit)

    def _join(self, cut: bool, start: int, end: int, limit: int) -> tuple[str, list[int]]:
        parts: list[str] = []
        starts: list[int] = []
        n = 0
        for i in range(start, end):
            got = self._collapsed.get((cut, i, limit))
            if got is None:
                got = self._collapsed[(cut, i, limit)] = _WS.sub(" ", (self.line(i) if cut else self.lines[i])[:limit])
            starts.append(n)
            parts.append(got)
            n += len(got) + 1
            if n >= limit:
                break
        return "\n".join(parts)[:limit], starts


# The field that holds the line in a log shipped as JSON: the container runtime's ("log"), Loki's and most
# shippers' ("message", "msg"), journalctl -o json's ("MESSAGE"), Rust tracing's (TGI's --json-output) under "fields".
RECORD_FIELDS = ("log", "message", "msg", "MESSAGE")
MAX_RECORD_CHARS = 1 << 20


def _record_messages(text: str) -> str:
    """``text`` with each line that is a JSON record holding a message field replaced by that message (a
    container's ``{"log": "...\\n", "stream": "stderr", ...}``); other lines as they are. An error body such as
    ``{"error": {"message": ...}}`` has no such field at its top and stays (the JSON unescaping reads it)."""
    import json

    out: list[str] = []
    changed = False
    for line in text.splitlines():
        s = line.strip()
        if s[:2] == '{"' and s[-1:] == "}" and len(s) <= MAX_RECORD_CHARS:
            try:
                record = json.loads(s)
            except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
                record = None
            if isinstance(record, dict):
                fields = record.get("fields")  # Rust's tracing (TGI's --json-output): {"fields": {"message": ...}}
                inner = fields if isinstance(fields, dict) and isinstance(fields.get("message"), str) else record
                key = next((k for k in RECORD_FIELDS if isinstance(inner.get(k), str)), None)
                if key is not None:
                    out.append(str(inner[key]).rstrip("\n"))
                    # the record's other text that may hold the error (exc_info, error, err, stack): after it
                    out.extend(v.rstrip("\n") for k, v in (*record.items(), *(fields.items() if inner is fields
                                                                               else ()))
                               if k not in (key, "fields") and isinstance(v, str) and _holds_needle(v))
                    changed = True
                    continue
        out.append(line)
    return "\n".join(out) if changed else text


def _holds_needle(text: str) -> bool:
    low = text.lower()
    return any(n in low for n in NEEDLES)


FOCUS_BEFORE = 600  # characters kept before a needle in a line longer than a window
FOCUS_AFTER = 1400  # and after it
FOCUS_GAP = " [...] "
MAX_FOCUS_SPANS = 64


def _focused(line: str) -> str:
    """A line longer than a rule's window (``WINDOW_CHARS``), cut to what lies around its needles, in order,
    at most a window long: a rule reads a line's first window only, and a long line (a config dump, a JSON
    record, a wrapped traceback) may hold its error past it. What lies around the last needle is always kept
    (an error ends a long record); the rest of the room goes to the first ones."""
    low = line.lower()
    spans: list[tuple[int, int]] = []
    for n in NEEDLES:
        k = low.find(n)
        while k != -1 and len(spans) < MAX_FOCUS_SPANS:
            spans.append((max(0, k - FOCUS_BEFORE), min(len(line), k + len(n) + FOCUS_AFTER)))
            k = low.find(n, k + len(n))
    if not spans:
        return line[:WINDOW_CHARS]
    spans.sort()
    merged = [spans[0]]
    for a, b in spans[1:]:
        if a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    last = merged.pop()
    room = WINDOW_CHARS - min(last[1] - last[0], WINDOW_CHARS // 2) - len(FOCUS_GAP)
    parts: list[str] = []
    for a, b in merged:
        if room <= 0:
            break
        parts.append(line[a: a + min(b - a, room)])
        room -= len(parts[-1]) + len(FOCUS_GAP)
    a, b = last
    parts.append(line[a: b][: WINDOW_CHARS - sum(len(x) + len(FOCUS_GAP) for x in parts)])
    return FOCUS_GAP.join(p for p in parts if p)


MAX_WRAPPED_ROWS = 32  # continuation rows joined to one row
MAX_WRAPPED_CHARS = 3000  # a wrapped cell's text: an error message, not a log kept in a table


def _untabled(lines: list[str]) -> list[str]:
    """The lines with each row of a text table whose last cell wraps onto continuation rows (Triton's model status
    table: "| tensorrt_llm | 1 | UNAVAILABLE: ... CUDA runtime error |", then "|   |   |  in ::cudaMallocAsync(...):
    out of memory |") joined into its first row, the wrapped cell's pieces run together as the printer cut them
    (mid-word); the continuation rows become empty lines, so that line indexes stay. A continuation row repeats the
    head row's borders, at the same places, around empty cells (a fixed-width table); at most MAX_WRAPPED_ROWS rows
    and MAX_WRAPPED_CHARS characters are joined (a cell's message, not a log kept in a table). A row loses its closing
    border (a message in a cell ends its line, as printed without the table). Other lines as they are."""
    out = list(lines)
    head, joined, rows, head_row = -1, 0, 0, ""
    pieces: list[str] = []

    def close() -> None:
        if head >= 0 and len(pieces) > 1:
            out[head] = "".join(pieces)

    for k, line in enumerate(lines):
        if line.count("|") < 2:  # no row: a row has a border on each side of a cell (most lines stop here)
            close()
            head = -1
            continue
        row = line if _table_row(line) else _prefixed_row(lines, k)
        if row is None and k + 1 < len(lines) and _table_row(lines[k + 1]) and _table_cells(
                lines[k + 1])[1]:
            row = line[line.find("|"):]  # the table's first row after text of its own (a JSON string's opening)
            row = row if _table_row(row) else None
        if row is None:
            close()
            head = -1
            continue
        prefix = line[:len(line) - len(row)]  # a log prefix before the table (docker-compose's "triton-1  | ")
        piece = _continued_cell(row, head_row) if head >= 0 else None
        if piece is not None and rows < MAX_WRAPPED_ROWS and joined + len(piece) <= MAX_WRAPPED_CHARS:
            pieces.append(piece)
            joined += len(piece)
            rows += 1
            out[k] = ""
            continue
        close()
        cells = _table_cells(row)[0]
        head, head_row, rows, joined = k, row, 0, len(cells[-1])
        pieces = [prefix + "|" + "|".join(cells[:-1]) + "| " + cells[-1]]  # without its closing border
        out[k] = pieces[0]
    close()
    return [line.rstrip() if line is not lines[k] else line for k, line in enumerate(out)]


def _prefixed_row(lines: list[str], k: int) -> str | None:
    """Line ``k`` from the first table border after a log prefix it shares with a neighbour (docker-compose's
    "triton-1  | ", journald's "... unit[pid]: "), when that is a table row; else None."""
    line = lines[k]
    for j in (k - 1, k + 1):
        if not 0 <= j < len(lines):
            continue
        for end in prefix_ends(line, lines[j]):  # the shortest prefix that leaves a table row
            row = line[end:]
            if _table_row(row):
                return row
    return None


def _continued_cell(row: str, head: str) -> str | None:
    """The text a continuation row adds to the last cell of the table row ``head`` above it, or None when ``row``
    is none: a fixed-width table repeats the head's borders, at the same places, around empty cells, and the
    wrapped text follows (it may hold bars of its own: "e == cudaSuccess || e == ...")."""
    run = len(row) - len(row.lstrip("| "))  # the row's leading borders and blanks
    bars = [i for i in range(run) if row[i] == "|"]
    head_bars = [i for i, c in enumerate(head[:run + 1]) if c == "|"]
    for n in range(len(bars), 1, -1):  # the most cells first; at least one empty cell before the text
        end = bars[n - 1]
        if [i for i in head_bars if i <= end] == bars[:n]:
            cell = row[end + 1:]
            if cell.rstrip().endswith("|"):  # one padding space each side of the text, as the printer put it
                cell = cell.rstrip()[:-1]
                cell = cell[:-1] if cell.endswith(" ") else cell
            else:  # the table's last row, its border cut off
                cell = cell.rstrip()
            return cell[1:] if cell.startswith(" ") else cell
    return None


def _table_row(line: str) -> bool:
    s = line.lstrip()
    return s.startswith("|") and s.count("|") >= 2


def _table_cells(line: str) -> tuple[list[str], bool]:
    """A table row's cells (the last with its one padding space taken off each side, the others as printed), and
    whether it continues the row above (every cell but the last empty)."""
    s = line.strip()[1:]
    if s.endswith("|"):
        s = s[:-1]
    cells = s.split("|")
    last = cells[-1]
    last = last[1:] if last.startswith(" ") else last
    last = last[:-1] if last.endswith(" ") else last
    return [*cells[:-1], last], len(cells) > 1 and all(not c.strip() for c in cells[:-1])


def _cut_shared(line: str, neighbour: str) -> str:
    """``line`` without the log prefixes it shares with ``neighbour``: up to three, one in another (journald's
    around docker's, compose's around vLLM's). A host or unit may be named gpu-node-3, so message words do not
    stop a cut: the lines as printed were tried first, and a cut that takes a repeated message's words only loses
    a match that was not there."""
    for _ in range(3):
        prefix = log_prefix(line, neighbour, words_allowed=True)
        if not prefix:
            break
        line, neighbour = line[len(prefix):], neighbour[len(prefix):]
    return line


def _scan(rule: ServingRule, lines: list[str], i: int, cut: _Unprefixed) -> _Hit | None:
    end = min(len(lines), i + rule.window)
    window, wstarts = cut.printed(i, end, WINDOW_CHARS)
    plain: tuple[str, list[int]] | None = None
    values: dict[str, float] = {}
    first = last = i
    text = ""
    for pat in rule.patterns:
        m, starts = pat.search(window), wstarts
        if m is None:
            plain = plain or cut.joined(i, end, WINDOW_CHARS)
            if plain[0] != window:
                m, starts = pat.search(plain[0]), plain[1]
        if m is None:
            continue
        if not text:
            text = m.group(0)
        last = max(last, _line_of(starts, i, m.end() - 1 if m.end() > m.start() else m.start()))
        _take_values(m, values)
    if rule.require_match and not text:
        return None
    if plain is not None and plain[0] != window:
        window = window + "\n" + plain[0]  # the cases' ``match`` reads either
    around = ""
    if rule.context or any(c.match_before is not None for c in rule.cases):
        c0 = max(0, i - CONTEXT_LINES)
        ctx, cstarts = cut.printed(c0, end, CONTEXT_CHARS)
        around = ctx
        anchor_end = cstarts[i - c0 + 1] if i - c0 + 1 < len(cstarts) else len(ctx)
        cut_ctx: tuple[str, list[int]] | None = None
        for pat in rule.context:
            found, starts = _nearest(pat, ctx, anchor_end), cstarts
            if found is None:
                cut_ctx = cut_ctx or cut.joined(c0, end, CONTEXT_CHARS)
                if cut_ctx[0] != ctx:
                    k = i - c0 + 1
                    found = _nearest(pat, cut_ctx[0], cut_ctx[1][k] if k < len(cut_ctx[1]) else len(cut_ctx[0]))
                    starts = cut_ctx[1]
            if found is None:
                continue
            ln = _line_of(starts, c0, found.start())
            first = min(first, ln)
            last = max(last, ln)
            _take_values(found, values)
        if cut_ctx is not None and cut_ctx[0] != ctx:
            around = ctx + "\n" + cut_ctx[0]
    matched = bool(text)
    if not text:
        line = lines[i].strip()
        anchor = next((a for a in rule.anchors if a in line), "")
        k = line.find(anchor) if anchor else 0
        text = line[k: k + len(anchor) + 200]
    return _Hit(rule, i, first, last, values, window, " ".join(text.split()), around, matched)


def _nearest(pat: re.Pattern[str] | LazyPattern, ctx: str, anchor_end: int) -> re.Match[str] | None:
    """The match of a context pattern nearest the anchor: the last one up to the anchor line, else the first after."""
    found = None
    for m in pat.finditer(ctx):
        if found is not None and m.start() >= anchor_end:
            break
        found = m
        if m.start() >= anchor_end:
            break
    return found


FREE_OVER_TOTAL_SLACK = 0.01  # free above total by more than print rounding: no device's numbers


def _decide(hit: _Hit, engine: str, rs: ServingRules) -> Finding:
    rule = hit.rule
    values = hit.values
    env: dict[str, float | None] = {k: values.get(k) for k in rs_names(rule, values)}
    cls, reason, note_t, suffix, knob = rule.cls, rule.reason, rule.note, "", rule.knob
    r, t, f = values.get("R"), values.get("T"), values.get("F")
    if r is not None and r >= IMPOSSIBLE_BYTES:
        cls, reason, suffix = "unknown", (
            f"the requested size ({torch_bytes(r)}) is larger than any device: a shape or size computation "
            "went wrong (an overflow, a corrupt input); this is a bug to report, not a shortage"), "impossible-size"
    elif t is not None and f is not None and f > t * (1 + FREE_OVER_TOTAL_SLACK):
        cls, reason, suffix = "unknown", (
            f"the free memory printed ({torch_bytes(round(f))}) is more than the device's total "
            f"({torch_bytes(round(t))}): the numbers are not one device's (an edited or mixed-up paste); "
            "classify the engine's own, whole message"), "free-over-total"
    else:
        for case in rule.cases:
            if case.engine is not None and case.engine != engine:
                continue
            if case.match is not None and case.match.search(hit.window) is None:
                continue
            if case.match_before is not None and case.match_before.search(hit.around) is None:
                continue
            if case.when is not None and evaluate(case.when, env) is not True:
                continue
            cls = case.cls
            reason = case.reason or rule.reason
            note_t = case.note or rule.note
            suffix = case.rule_suffix
            knob = case.knob or rule.knob
            break
    numbers: dict[str, int | None] = {k: (round(values[k]) if k in values else None) for k in BASE_QUANTITIES}
    if numbers["T"] is None and values.get("total_gpu_bytes") is not None:  # the device total, in the engine's words
        numbers["T"] = round(values["total_gpu_bytes"])
    extra = {k: v for k, v in values.items() if k not in BASE_QUANTITIES}
    note = render(note_t, env) if note_t is not None else ""
    if cls == "unknown" and reason is not None:
        reason = _render_reason(reason, env)
    if "?" in note:  # a number the note needs was not printed: no note rather than a "?"
        note = ""
    remedy = rule.remedy
    # The message's identity for "once per distinct message": its rule, its text with a log prefix's changing
    # parts masked (timestamps, a pid, a source line the match took in) and the numbers the rule read; a device
    # or rank ordinal stays: eight workers failing on eight devices are eight messages.
    key = f"{rule.id}|{_KEY_NOISE.sub('#', hit.text)}|" + ",".join(f"{k}={v:g}" for k, v in sorted(values.items()))
    return Finding(
        engine=engine, cls=cls, rule=rule.id + (f"/{suffix}" if suffix else ""), rule_version=rule.version,
        numbers=numbers, extra=extra, remedy=remedy, note=note, reason=reason if cls == "unknown" else None,
        knob=knob, text=hit.text, key=key, first_line=hit.first, last_line=hit.last,
        mechanism=rule.mechanism,
    )


def _render_reason(reason: str, env: Mapping[str, float | None]) -> str:
    """A reason with the numbers it names filled in (checked at load; an unprinted one shows as '?')."""
    if "{" not in reason:
        return reason
    try:
        return render(parse_template(reason, set(env) | set(BASE_QUANTITIES)), env)
    except RulesError:
        return reason


def rs_names(rule: ServingRule, values: Mapping[str, float]) -> set[str]:
    """Every quantity a rule's expressions may read: the base numbers and what it captured."""
    names: set[str] = set(BASE_QUANTITIES) | set(values)
    for pat in (*rule.patterns, *rule.context):
        names.update(g for g in pat.groupindex if g != "unit")
    return names


def _engine_for(rule_engine: str, lines: list[str], first: int, last: int) -> str:
    """The rule's engine, or the engine that hosts it when the lines around say so."""
    around = "\n".join(lines[max(0, first - CONTEXT_LINES): min(len(lines), last + 4)])[-CONTEXT_CHARS:]
    hosts = _HOSTS.get(rule_engine, ())
    found = detect_engine(around)
    if found is not None and (found in hosts or rule_engine == "any"):
        return found
    if rule_engine == "any":
        return found or "pytorch"
    return rule_engine


def rubric_reason(v: Verdict, msg: OomMessage | None = None) -> str:
    """Why the rubric answered ``unknown``: the numbers it lacked, and where to get them."""
    if msg is not None and msg.R is None and msg.T is None and msg.F is None:
        return ("no requested, free or total size printed: paste the whole message or run under infersight "
                "launch (the allocator observer records them)")
    missing = ", ".join(v.missing) or "the numbers a step needs"
    return (f"missing {missing} (a message cut by the log collector, or a short format): paste the whole "
            "'Tried to allocate ...' message, or run under infersight launch so the allocator observer records "
            "T, F, A and P, and NVML U and O")


# Engines that size a static pool to fill the device (vLLM's gpu_memory_utilization, SGLang's
# mem-fraction-static, TGI's warm-up budget, lmdeploy's cache_max_entry_count, TensorRT-LLM's KV
# fraction) run with the device full by design. There, cached plus free bytes that cover the
# request only within print rounding (the rubric's own "tentative" margin) mean a full device,
# not a broken-up one: the verdict comes from the steps after fragmentation.
POOL_ENGINES = frozenset({"vllm", "sglang", "tgi", "lmdeploy", "tensorrt-llm"})
_FRAGMENTATION_RULE = "oom.fragmentation"


def _rounding_margin_only(msg: OomMessage) -> bool:
    """Cached plus free bytes cover the request only within print rounding, on a device that an engine's pools
    could have filled. With half of the device or more cached or free, the pools were not there yet (the weights'
    load, the profiling run), and the rubric's fragmentation stands."""
    env = derive(msg.numbers(), msg.backend)
    r, c, f, t = env.get("R"), env.get("C"), env.get("F_prime"), env.get("T")
    if r is None or c is None or f is None:
        return False
    if t is not None and t > 0 and c + f >= POOLS_ABSENT_SLACK_SHARE * t:
        return False
    return c + f - r < min(0.1 * r, 256 * 2**20)


POOLS_ABSENT_SLACK_SHARE = 0.5  # cached plus free bytes this share of the device: an engine's pools were not there


def _held_outside_pytorch(msg: OomMessage) -> bool:
    """This process holds most of the device outside PyTorch's allocator (N >= T/2) and the cached bytes
    alone cannot serve the request: another allocator in the process (an engine's own pool such as
    TurboMind's or TensorRT's, NCCL, a library workspace) holds the device, not a broken-up cache."""
    env = derive(msg.numbers(), msg.backend)
    r, c, n, t = env.get("R"), env.get("C"), env.get("N"), env.get("T")
    if r is None or c is None or n is None or t is None:
        return False
    return n >= 0.5 * t and c < r


def _device_held_outside_allocator(msg: OomMessage) -> bool:
    """Most of the device (X = T - F - P >= T/2) is held outside this process's PyTorch allocator."""
    env = derive(msg.numbers(), msg.backend)
    x, t = env.get("X"), env.get("T")
    return x is not None and t is not None and t > 0 and x >= 0.5 * t


# An engine's pools leave it a headroom of about a tenth of the device (vLLM's 0.9 default); slack below half of
# that (the cached and free bytes together, the most any allocator setting could give back) is what is left of a
# device the pools filled. The rubric still calls it fragmentation (the PyTorch corpus is labelled by that rule
# whatever prints it), but the serving threads settle such a case as often by a lower fraction as by an allocator
# setting: the note says so, and names the engine's knob.
FULL_DEVICE_SLACK_SHARE = 0.05
_POOL_KNOB_FLAG = {"vllm": "--gpu-memory-utilization", "sglang": "--mem-fraction-static",
                   "tgi": "--cuda-memory-fraction (or --max-batch-prefill-tokens)",
                   "lmdeploy": "--cache-max-entry-count", "tensorrt-llm": "kv_cache_free_gpu_mem_fraction"}


def _full_device_note(msg: OomMessage, engine: str) -> str | None:
    """The note for a fragmentation verdict in an engine's full device (see FULL_DEVICE_SLACK_SHARE), or None."""
    env = derive(msg.numbers(), msg.backend)
    t = env.get("T")
    slack = (env.get("C") or 0.0) + (env.get("F_prime") or 0.0)
    if t is None or t <= 0 or slack >= FULL_DEVICE_SLACK_SHARE * t:
        return None
    flag = _POOL_KNOB_FLAG[engine]
    return (f"{engine} fills the device with its pools by design, and only {torch_bytes(slack)} ({slack / t:.1%} of "
            f"the device) was cached or free: if expandable_segments:True does not clear it, the pools left too "
            f"little room for what runs beside them (CUDA graphs, the batch's activations, another process): "
            f"lower {flag}")


def _pool_engine_verdict(msg: OomMessage, v: Verdict, engine: str, rs: ServingRules) -> Verdict:
    """The rubric's verdict, re-read for an engine whose pools fill the device (see POOL_ENGINES), or
    for a process whose memory is mostly outside PyTorch's allocator."""
    if v.rule != _FRAGMENTATION_RULE:
        return v
    only_why = False
    if engine != "pytorch" and _device_held_outside_allocator(msg):
        # An engine sizes its pools from the device's free memory at start; when another process, a
        # previous instance or another allocator holds most of the device, that is what the engine lacks,
        # not the few cached bytes its allocator could not reuse (the serving threads' diagnosis; a plain
        # PyTorch program keeps the rubric's fragmentation-first order).
        env = derive(msg.numbers(), msg.backend)
        x, t, c = env.get("X") or 0.0, env.get("T") or 0.0, env.get("C")
        cached = f" against {torch_bytes(c)} cached" if c is not None else ""
        why = (f"in {engine}'s log, {torch_bytes(x)} of the {torch_bytes(t)} device is held outside this "
               f"process's PyTorch allocator{cached} (another process, a previous instance, or the engine's own "
               "pool): that memory, not the cache's fragments, is what the engine lacks")
        only_why = True
    elif engine in POOL_ENGINES and _rounding_margin_only(msg):
        why = (f"{engine} fills the device with its pools by design, and cached plus free bytes cover the request "
               "only within print rounding: a full device, not fragmentation")
    elif _held_outside_pytorch(msg):
        why = ("this process holds most of the device outside PyTorch's allocator (another allocator or an "
               "engine's own pool) and the cached bytes alone cannot serve the request: not fragmentation")
    elif engine in POOL_ENGINES and (full := _full_device_note(msg, engine)) is not None:
        return replace(v, note=f"{v.note}; {full}" if v.note else full)
    else:
        return v
    rubric = replace(rs.rubric, rules=[r for r in rs.rubric.rules if r.id != _FRAGMENTATION_RULE])
    again = classify(msg.numbers(), rubric, backend=msg.backend)
    if again.cls == "unknown":
        return v
    return replace(again, note=f"{again.note}; {why}" if again.note and not only_why else why)


# vLLM and SGLang capture CUDA graphs after the weights and the KV pool took their share of the device
# (gpu_memory_utilization, mem-fraction-static); the capture's memory is outside that share, and comes from
# the graphs' private memory pool, which blocks cached in the general pool cannot serve. Both engines say
# so when they start capturing ("If out-of-memory error occurs during cudagraph capture, consider
# decreasing gpu_memory_utilization or switching to eager mode"). A PyTorch OOM raised while capturing is
# that budget's: the fraction, the captured batch sizes or eager mode decide it, whatever the cached bytes say.
# vLLM >= 0.21 estimates the graphs' memory and takes it out of the KV budget; it names the switch of that
# estimate (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS) when it sizes the KV cache just before capturing
# ("CUDA graph memory profiling is enabled ... To disable, set ...=0", or the warning that it is off) and in
# the advice it adds to an OOM of the capture (vllm#57475: "If this problem persists, try setting ...=0").
CAPTURE_ENGINES = frozenset({"vllm", "sglang"})
_CAPTURE_START = ("Capturing cudagraphs", "Capturing the model for CUDA graphs", "Capturing CUDA graph",
                  "Capture cuda graph begin", "Capture cuda graph failed", "CUDA graphs can take additional",
                  "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS")
_CAPTURE_END = ("Graph capturing finished", "Capture cuda graph end")
_CAPTURE_KNOB = {"vllm": "gpu_memory_utilization", "sglang": "mem-fraction-static"}


def _during_capture(lines: list[str], first: int, last: int) -> bool:
    """Whether the lines around an OOM (40 before, a few after: some collectors print newest first) show a
    CUDA-graph capture that had started and not finished."""
    around = lines[max(0, first - CONTEXT_LINES): min(len(lines), last + 4)]
    started = any(m in line for line in around for m in _CAPTURE_START)
    return started and not any(m in line for line in around for m in _CAPTURE_END)


def _capture_verdict(v: Verdict, engine: str) -> Verdict:
    """The rubric's verdict for an OOM raised during CUDA-graph capture (see CAPTURE_ENGINES)."""
    why = (f"raised while {engine} captured CUDA graphs: their memory is outside {_CAPTURE_KNOB[engine]}'s share "
           "and comes from the graphs' own pool, which the cached blocks cannot serve")
    if v.cls == "reservation_conflict":
        return replace(v, note=f"{v.note}; {why}" if v.note else why)
    return replace(v, cls="reservation_conflict", rule=f"{engine}.cuda-graph-capture", rule_version=1, note=why,
                   missing=(), remedy="Leave room for the CUDA graphs: capture fewer or smaller batch sizes, or "
                   "run without them (eager mode) if the latency allows.")


# vLLM (V1, since 0.11) catches a PyTorch OOM raised while it loads the weights and logs "Failed to load model -
# not enough GPU memory. Try lowering --gpu-memory-utilization ..., increasing --tensor-parallel-size, or using
# --quantization. ... (original error: <the PyTorch message>)" before re-raising it (gpu_model_runner.load_model).
# The weights load before the KV cache is sized, and after the worker's start-up check refused to start unless
# gpu_memory_utilization of the device was free ("Free memory on device ... is less than desired GPU memory
# utilization"): what fills the device then is this process's weights, unless the message shows another process
# holding memory (one started during the load). The cached bytes the rubric's first step sees are the loader's,
# and the fraction only sizes the KV cache, after the weights (the pull request vllm#38553 asks to drop vLLM's hint
# to lower it for that reason).
_WEIGHT_LOAD_FAILED = re.compile(r"Failed to load model\s*[-\u2013\u2014]+\s*not enough GPU memory")
_OTHER_TENANT_BYTES = 1 << 30


def _during_weight_load(lines: list[str], first: int, last: int) -> bool:
    """Whether vLLM's load-phase line sits on the OOM's line or within 4 lines of it (it wraps the message, or
    follows the traceback's last line)."""
    return any(_WEIGHT_LOAD_FAILED.search(line) for line in lines[max(0, first - 4): min(len(lines), last + 4)])


def _weight_load_verdict(msg: OomMessage, v: Verdict) -> Verdict:
    """The verdict for a PyTorch OOM vLLM raised while loading the weights (see _WEIGHT_LOAD_FAILED)."""
    env = derive(msg.numbers(), msg.backend)
    o, u, t, f = env.get("O"), env.get("U"), env.get("T"), env.get("F")
    if o is not None and o >= _OTHER_TENANT_BYTES:
        why = (f"raised while vLLM loaded the weights, with {torch_bytes(o)} of the device held by other processes: "
               "one started after vLLM's start-up check found the device free")
        if v.cls == "reservation_conflict":
            return replace(v, note=f"{v.note}; {why}" if v.note else why)
        return replace(v, cls="reservation_conflict", rule="vllm.load.other-tenant", rule_version=1, note=why,
                       missing=(), remedy="Give the engine its own GPU, or start the other process after the engine "
                       "has loaded and sized its KV cache (each instance checks the free memory only at its start).")
    if t is None:
        return v
    held = f"this process holds {torch_bytes(u)} of the {torch_bytes(t)} device" if u is not None else (
        f"{torch_bytes(t - f)} of the {torch_bytes(t)} device is in use" if f is not None else "")
    why = ("raised while vLLM loaded the weights, before it sizes the KV cache and after its start-up check found "
           f"gpu_memory_utilization of the device free{': ' + held if held else ''}; the weights do not fit this "
           "device at this parallelism")
    return replace(v, cls="capacity", rule="vllm.load.weights-exceed-device", rule_version=1, note=why, missing=(),
                   remedy="The weights do not fit one device: shard them (--tensor-parallel-size or "
                   "--pipeline-parallel-size), load a quantised checkpoint (--quantization), or use a larger GPU.")


def _message_start(lines: list[str], line: int) -> int:
    """The line a PyTorch message starts on: ``line`` (its first clause's), or the line before it when a hard wrap
    left the exception's name there ("torch.OutOfMemoryError: CUDA out" / "of memory. Tried ..."), so that no other
    rule reads that line as a second, bare error."""
    if 0 < line < len(lines):
        before = lines[line - 1]
        k = before.rfind("OutOfMemoryError")
        if k >= 0 and "Tried" not in before[k:]:
            return line - 1
    return line


def _pytorch_finding(msg: OomMessage, lines: list[str], rs: ServingRules) -> Finding:
    engine = _engine_for("pytorch", lines, msg.line, msg.line + 1)
    v = _pool_engine_verdict(msg, classify(msg.numbers(), rs.rubric, backend=msg.backend), engine, rs)
    knob = None
    if engine in CAPTURE_ENGINES and _during_capture(lines, msg.line, msg.line + 1):
        v = _capture_verdict(v, engine)
        knob = _CAPTURE_KNOB[engine]
    elif engine in ("vllm", "pytorch") and _during_weight_load(lines, msg.line, msg.line):
        engine = "vllm"  # the load-phase line is vLLM's own
        v = _weight_load_verdict(msg, v)
        knob = "tensor_parallel_size" if v.cls == "capacity" else None
    remedy = v.remedy
    extra_remedy = rs.engine_remedies.get(engine, {}).get(v.cls)
    if engine != "pytorch" and extra_remedy and not v.rule.startswith("vllm.load."):  # those name vLLM's knobs
        remedy = f"{remedy} {extra_remedy}"
    reason = rubric_reason(v, msg) if v.cls == "unknown" else None
    return Finding(
        engine=engine, cls=v.cls, rule=v.rule, rule_version=v.rule_version, numbers=dict(v.numbers), extra={},
        remedy=remedy, note=v.note, reason=reason, knob=knob, text=msg.text, key="pytorch|" + msg.key,
        first_line=_message_start(lines, msg.line), last_line=msg.line, message=msg, verdict=v, used=dict(v.used),
        missing=tuple(v.missing),
    )


def analyse(text: str, rs: ServingRules | None = None) -> list[Finding]:
    """Every distinct memory error in ``text``, in order of appearance. Never raises on text."""
    rs = rs if rs is not None else builtin()
    if not isinstance(text, str) or not text:
        return []
    if '{"' in text:  # a log shipped as JSON records, one per line: each record's message
        text = _record_messages(text)
    if "\x1b" in text:  # terminal colours: no meaning, and they split what patterns read
        text = _ANSI.sub("", text)
    tabled = False
    if "|" in text:  # a text table may have wrapped the message: join its rows before anything reads them
        raw = text.splitlines()
        untabled = _untabled(raw)
        if untabled != raw:
            text, tabled = "\n".join(untabled), True
    lines = decoded_lines(text)
    if any("\x1b" in line for line in lines):  # colours a JSON string held as \u001b
        lines = [_ANSI.sub("", line) for line in lines]
    if any(len(line) > WINDOW_CHARS for line in lines):  # a rule reads a line's first window only
        lines = [_focused(line) if len(line) > WINDOW_CHARS else line for line in lines]
    if not tabled and "|" in text and "\\" in text:  # a table inside a JSON string: its rows are lines once decoded
        untabled = _untabled(lines)
        if untabled != lines:
            lines, text = untabled, "\n".join(untabled)
    cut = _Unprefixed(lines)
    findings: list[Finding] = [_pytorch_finding(m, lines, rs) for m in find_ooms(text)]
    hits: list[_Hit] = []
    swept = 0
    for i in _candidate_lines(lines, rs.not_memory):
        line = lines[i]
        if i - swept > 16 * CONTEXT_LINES:  # (candidates come in order; a context reaches CONTEXT_LINES back)
            cut.forget_before(i - CONTEXT_LINES)
            swept = i
        for rule in rs.rules_for(line):
            if any(a in line for a in rule.anchors):
                hit = _scan(rule, lines, i, cut)
                if hit is not None:
                    hits.append(hit)
    # Most specific rule first; a hit whose anchor lies in lines an earlier (more specific)
    # finding used is the same event; so is a second anchor of one rule within its window.
    if findings or any(not h.rule.fallback for h in hits):
        hits = [h for h in hits if not h.rule.fallback]  # a fallback speaks only when nothing else does
    hits.sort(key=lambda h: (h.rule.priority, h.anchor))
    accepted: list[tuple[_Hit, Finding]] = []
    distinct: set[str] = {f.key for f in findings}
    # Indexed by line (an event's lines are a window of a few): whether a line lies in an event taken already,
    # and the accepted events that reach each line (their last line plus the one after): a text of thousands of
    # anchors reads each once, not against every event before it.
    covered: set[int] = {i for f in findings for i in range(f.first_line, f.last_line + 1)}
    reaching: dict[int, list[tuple[_Hit, Finding]]] = {}
    for h in hits:
        if h.anchor in covered or _goes_on(h, reaching.get(h.anchor, ())):
            same = next((f for hh, f in reaching.get(h.anchor, ()) if hh.rule is h.rule), None)
            if same is not None:
                for k, v in h.values.items():  # fold the numbers a later line of the event adds
                    if k in BASE_QUANTITIES and same.numbers.get(k) is None:
                        same.numbers[k] = round(v)
                    elif k not in BASE_QUANTITIES and k not in same.extra:
                        same.extra[k] = v
            continue
        engine = _engine_for(h.rule.engine, lines, h.first, h.last)
        f = _decide(h, engine, rs)
        accepted.append((h, f))
        covered.update(range(h.first, h.last + 1))  # the event ends on the last line its patterns read
        for i in range(h.first, h.last + 2):
            reaching.setdefault(i, []).append((h, f))
        distinct.add(f.key)  # a message repeated (a scheduler's line every step) counts once
        if len(distinct) >= MAX_FINDINGS or len(accepted) >= MAX_EVENTS:
            break
    findings.extend(f for _, f in accepted)
    findings.sort(key=lambda f: f.first_line)
    out: list[Finding] = []
    keys: set[str] = set()
    for f in findings:
        if f.key in keys:
            continue
        keys.add(f.key)
        out.append(f)
    return out


def quiet_lines(text: str, rs: ServingRules | None = None, limit: int = 8) -> list[tuple[int, NotMemory]]:
    """The lines of ``text`` (0-based) that look like a memory error but that a ``not_memory`` entry
    names as none (a warning the runtime recovers from), with that entry: what ``classify`` says when
    it finds no error. At most ``limit``; never raises on text."""
    rs = rs if rs is not None else builtin()
    if not isinstance(text, str) or not text:
        return []
    out: list[tuple[int, NotMemory]] = []
    for i, line in enumerate(decoded_lines(_ANSI.sub("", text) if "\x1b" in text else text)):
        if not _holds_needle(line):
            continue
        q = next((q for q in rs.not_memory if any(p.search(line) for p in q.lines)), None)
        if q is not None:
            out.append((i, q))
            if len(out) >= limit:
                break
    return out


def _goes_on(h: _Hit, accepted: Iterable[tuple[_Hit, Finding]]) -> bool:
    """``h`` is the closing line of an event of its rule found just before it: anchored on the line right after
    that event's lines, with no message of its own (only an anchor matched: llama-server's "Context size has been
    exceeded" after the batch that found no KV cell), or naming the same request with its lines reaching back into
    that event's (llama.cpp's "failed to initialize the context" after the allocation it could not do; a size printed
    in MiB with two decimals reads a few KiB off the same size in bytes). A line with a message of its own is another
    event (a second warmup's token count)."""
    r = h.values.get("R")
    for hh, _ in accepted:
        if hh.rule is not h.rule or h.anchor != hh.last + 1:
            continue
        if not h.matched or (r is not None and h.first <= hh.last and abs(hh.values.get("R", -1.0) - r) <= r * 1e-3):
            return True
    return False
