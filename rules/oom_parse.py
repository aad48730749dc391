"""Find PyTorch out-of-memory messages in arbitrary text and extract the rubric numbers.

Pure and total: ``find_ooms`` takes any string and never raises. Formats handled:

- PyTorch >= 2.1 (CUDA, HIP, XPU): "Tried to allocate R. GPU i has a total capacity of T of
  which F is free. [Process n has X memory in use.] [Including non-PyTorch memory, this
  process has U memory in use.] [L allowed; ]Of the allocated memory A is allocated by
  PyTorch, [with Z allocated in private pools (e.g., CUDA Graphs), ]and C is reserved by
  PyTorch but unallocated." (also the "capacty" typo of 2.1);
- PyTorch 1.5 - 2.0: "Tried to allocate R (GPU i; T total capacity; A already allocated;
  F free; [L allowed; ]P reserved in total by PyTorch)";
- PyTorch < 1.5: the same with "C cached" in place of "P reserved in total by PyTorch";
- cudaMallocAsync: "Allocation on device i would exceed allowed memory. (out of memory)"
  followed by "Currently allocated : A", "Requested : R", "Device limit : T",
  "Free (according to CUDA): F", "PyTorch limit (set by user-supplied memory fraction) : L".

Linear time by construction (the text is untrusted and may be megabytes):

1. Decoding JSON escapes and HTML entities is a fixed number of linear ``str`` passes.
2. A line-oriented pre-scan keeps only *regions*: a line holding an anchor keyword (plain
   substring tests, no regex) plus at most ``_REGION_LINES`` lines after it. Regions never
   overlap, so every input line is looked at a bounded number of times.
3. Each region is joined, log prefixes are cut from continuation lines, and whitespace is
   collapsed (one linear ``re.sub`` with a single-class ``\\s+``).
4. One ``finditer`` over the region with a single alternation of clause patterns. Every
   pattern starts with a literal or a number, uses only bounded quantifiers
   (``{1,15}``, ``{0,8}``...), and adjacent quantified pieces use disjoint character
   classes (digits, then a space, then letters), so no position can be matched in more
   than one way: there is no nested or overlapping repetition, hence no catastrophic
   backtracking, and the work per start position is bounded by the pattern size.
5. Grouping tokens into messages is a single left-to-right pass over the tokens.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field

from infersight.bytesize import BYTE_UNITS

__all__ = ["NUMBER_KEYS", "OomMessage", "ProcessUse", "decoded_lines", "find_ooms"]

NUMBER_KEYS = ("R", "T", "F", "A", "P", "U", "O", "L")


# The cudaMallocAsync backend prints 2**64 bytes (17179869184.00 GiB) when no limit is set.
_NO_LIMIT_BYTES = 1 << 62

_REGION_LINES = 24  # continuation lines kept after an anchor line
_MAX_GAP = 160  # most characters of junk tolerated between two clauses of one message
_MAX_PROCESSES = 256  # "Process N has X" lines kept per message

# Lowercase substrings that start a region. Plain ``in`` tests: linear and cheap.
_ANCHORS = (
    "out of memory",
    "tried to allocate",
    "total capacity",
    "total capacty",
    "would exceed allowed",
)

# A number starts only where a digit run starts, so ``\d{1,18}`` never retries inside a run.
_NUM = r"(?<![\d.])(\d{1,18}(?:\.\d{1,6})?)"
_UNIT = r"(bytes|KiB|MiB|GiB|TiB|PiB|B)\b"
_SIZE = _NUM + r" ?" + _UNIT

# One named alternative per clause. Named groups carry the values; see _TOKEN_FIELDS.
_CLAUSES: dict[str, str] = {
    "head": r"\b(CUDA|HIP|XPU|NPU) out of memory\b",
    "async_head": r"Allocation on device (\d{1,4}) would exceed allowed memory",
    "req": r"Tried to allocate " + _SIZE,
    # The index can be missing: "GPU  has" (two spaces) is printed where the device has no index to name.
    "cap_new": r"GPU ?(\d{1,4})? has a total capac(?:i)?ty of " + _SIZE,
    "free_new": r"of which " + _SIZE + r" is free",
    "proc": r"Process (\d{1,10}) has " + _SIZE + r" memory in use",
    "this": r"this process has " + _SIZE + r" memory in use",
    "allowed": _SIZE + r" allowed;",
    "alloc_new": r"Of the allocated memory " + _SIZE,
    "private": r"with " + _SIZE + r" allocated in private pools",
    "unalloc": _SIZE + r" is reserved by PyTorch but unallocated",
    "old_open": r"\((?:GPU|NPU) (\d{1,4}); " + _SIZE + r" total capacity",
    "old_alloc": _SIZE + r" already allocated",
    "old_free": r"; " + _SIZE + r" free\b",
    "old_cached": r"; " + _SIZE + r" cached\b",
    "old_reserved": _SIZE + r" reserved in total by PyTorch",
    "async_alloc": r"Currently allocated ?: " + _SIZE,
    "async_req": r"Requested ?: " + _SIZE,
    "async_total": r"Device limit ?: " + _SIZE,
    "async_free": r"Free \(according to CUDA\) ?: " + _SIZE,
    "async_limit": r"PyTorch limit \(set by user-supplied memory fraction\) ?: " + _SIZE,
}


_GROUPS: dict[str, tuple[str, ...]] = {}  # clause -> its value groups, in order


def _compile_master() -> re.Pattern[str]:
    parts = []
    for name, pat in _CLAUSES.items():
        # Rename the anonymous groups of each clause so they stay addressable by name.
        count = 0

        def _name_group(m: re.Match[str], clause: str = name) -> str:
            nonlocal count
            count += 1
            return f"(?P<{clause}_{count}>"

        body = re.sub(r"(?<!\\)\((?!\?)", _name_group, pat)
        _GROUPS[name] = tuple(f"{name}_{i}" for i in range(1, count + 1))
        parts.append(f"(?P<{name}>{body})")
    return re.compile("|".join(parts))


_MASTER = _compile_master()

# Order of clauses inside one message. A clause whose rank is below the message's highest
# rank so far (or a repeat of a clause already seen) starts a new message.
_RANK = {
    "head": 0,
    "async_head": 0,
    "req": 1,
    "cap_new": 2,
    "old_open": 2,
    "free_new": 3,
    "old_alloc": 3,
    "old_free": 4,
    "proc": 4,
    "this": 4,
    "allowed": 5,
    "alloc_new": 6,
    "private": 7,
    "unalloc": 8,
    "old_cached": 8,
    "old_reserved": 8,
    "async_alloc": 1,
    "async_req": 2,
    "async_total": 3,
    "async_free": 4,
    "async_limit": 5,
}
_STARTS = frozenset({"head", "async_head", "req", "cap_new", "old_open"})
_REPEATABLE = frozenset({"proc"})


@dataclass(frozen=True, slots=True)
class ProcessUse:
    """One "Process N has X memory in use" line."""

    pid: int
    bytes: int


@dataclass(slots=True)
class OomMessage:
    """One OOM message and the numbers it printed (bytes; None where absent)."""

    text: str  # the message as found, whitespace collapsed
    key: str  # verbatim-normalised numeric clauses: equal keys are the same message
    device_kind: str = "CUDA"  # CUDA, HIP, XPU or NPU (torch_npu)
    device_index: int | None = None
    backend: str = "native"  # "native" or "cudaMallocAsync"
    fmt: str = "unknown"  # "2.x", "1.x-reserved", "1.x-cached", "async" or "unknown"
    R: int | None = None
    T: int | None = None
    F: int | None = None
    A: int | None = None
    P: int | None = None
    U: int | None = None
    O: int | None = None  # noqa: E741 - the rubric's name
    L: int | None = None
    processes: tuple[ProcessUse, ...] = ()
    this_process: int | None = None  # "this process has X memory in use"
    pytorch_unallocated: int | None = None  # "Y is reserved by PyTorch but unallocated"
    cached: int | None = None  # pre-1.5 "C cached"
    private_pools: int | None = None  # "with Z allocated in private pools"
    self_from_process_line: bool = False  # U taken from the only "Process N" line
    clauses: tuple[str, ...] = field(default=())
    line: int = 0  # index of the line its first clause is on (after decoding)

    def numbers(self) -> dict[str, int | None]:
        """The rubric numbers R T F A P U O L, in that order."""
        return {k: getattr(self, k) for k in NUMBER_KEYS}


def _size(num: str, unit: str) -> int:
    return round(float(num) * BYTE_UNITS[unit.lower()])


_UNICODE_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")


def _unescaped(m: re.Match[str]) -> str:
    """The character, but a surrogate half (no lone one) and a control that would split or reshape a line stay
    escaped: only a tab and ESC (terminal colours, dropped later) among the controls are undone."""
    code = int(m.group(1), 16)
    if 0xD800 <= code <= 0xDFFF or code in (0x2028, 0x2029) or (
            (code < 0x20 or 0x7F <= code <= 0x9F) and code not in (0x09, 0x1B)):
        return m.group(0)
    return chr(code)


def _decode(text: str) -> str:
    """Undo JSON-string and HTML escaping, a fixed number of linear passes."""
    if "\\" in text:
        text = (
            text.replace("\\r\\n", "\n")
            .replace("\\n", "\n")
            .replace("\\t", " ")
            .replace('\\"', '"')
            .replace("\\/", "/")
        )
        if "\\u" in text:  # a JSON string's \uXXXX (json.dumps writes non-ASCII so: vLLM's em dash)
            text = _UNICODE_ESCAPE.sub(_unescaped, text)
    if "&" in text:
        import html  # at first use: html.entities' table costs ~12 ms to import, and few texts hold "&"

        text = html.unescape(text)
    return text


_DIGIT = re.compile(r"\d")
# A log prefix ends after "] : > | )" and a space ("[rank0]: ", "ERROR ... engine.py:400] ", "> "), after an RFC 3339
# time's "Z " (``kubectl logs --timestamps``, ``docker logs -t``), after the CRI log file's "stderr F " (a node's
# /var/log/pods), after Python logging's " - " ("2026-01-01 00:00:00,123 - ERROR - train - "), or after a level
# ("2026-01-01 00:00:05 ERROR "); digits masked.
_PREFIX_END = re.compile(r"[\]:>|)] |0Z |(?:stdout|stderr) [FP] | - |\b(?:ERROR|WARNING|INFO|CRITICAL|FATAL) ")
_MAX_PREFIX = 128  # vLLM V1's worker prefix "(VllmWorker rank=0 pid=1234) ERROR 11-20 10:01:00 [multiproc_...py:487] "
_MESSAGE_WORDS = ("memory", "allocat", "gpu", "capac", "free", "process", "pytorch")
# journald's and syslog's "Nov 25 06:44:10 host " (digits masked to 0 where it is matched)
_SYSLOG_HEADER = re.compile(r"^[A-Z][a-z]{2} {1,2}\d{1,2} \d\d:\d\d:\d\d \S{1,64} ")


def prefix_ends(first: str, second: str, limit: int = 200) -> list[int]:
    """Where a log prefix that two consecutive lines share may end, shortest first: at each ``_PREFIX_END`` in their
    common start (digits masked, at most ``limit`` characters), as in "[rank0]: ",
    "ERROR 07-30 18:15:55 engine.py:400] " or "> "."""
    a = _DIGIT.sub("0", first[:limit])
    b = _DIGIT.sub("0", second[:limit])
    n = 0
    for ca, cb in zip(a, b, strict=False):
        if ca != cb:
            break
        n += 1
    return [m.end() for m in _PREFIX_END.finditer(a[:n])]


def log_prefix(first: str, second: str, words_allowed: bool = False) -> str:
    """The log prefix two consecutive lines share, digits masked ("" when none): the longest that
    :func:`prefix_ends` finds within ``_MAX_PREFIX`` characters."""
    ends = prefix_ends(first, second, _MAX_PREFIX)
    if not ends:
        return ""
    prefix = _DIGIT.sub("0", first[: ends[-1]])
    # A shared prefix that holds message words is message text (a repeated message), not a
    # log prefix: cutting it would lose numbers.
    # (a syslog header's host is a name, not message words: gpu-node-3)
    low = _SYSLOG_HEADER.sub("", prefix).lower()
    if not words_allowed and any(w in low for w in _MESSAGE_WORDS):
        return ""
    return prefix


def _regions(lines: list[str]) -> Iterator[tuple[int, str, list[int]]]:
    """Yield (first line index, joined text, where each of its lines starts in that text) of each anchor
    region (module docstring, steps 2-3)."""
    i = 0
    n = len(lines)
    while i < n:
        low = lines[i].lower()
        if not any(a in low for a in _ANCHORS):
            i += 1
            continue
        end = min(n, i + 1 + _REGION_LINES)
        # Extend while anchors keep appearing, so a message is never cut at the region end;
        # each line joins one region only, so this stays linear.
        j = i + 1
        while j < end:
            if any(a in lines[j].lower() for a in _ANCHORS):
                end = min(n, j + 1 + _REGION_LINES)
            j += 1
        chunk = lines[i:end]
        prefix = log_prefix(chunk[0], chunk[1]) if len(chunk) > 1 else ""
        if prefix:
            masked_len = len(prefix)
            cut: list[str] = [chunk[0]]
            for line in chunk[1:]:
                head = _DIGIT.sub("0", line[:masked_len])
                cut.append(line[masked_len:] if head == prefix else line)
            chunk = cut
        yield (i, *_joined_region(chunk))
        i = end


def _joined_region(chunk: list[str]) -> tuple[str, list[int]]:
    """``chunk`` joined by spaces with every run of whitespace made one space (what the tokens are read
    from), and the offset in it at which each line's text begins: a message's own line, not its region's."""
    parts: list[str] = []
    starts: list[int] = []
    n = 0
    for k, line in enumerate(chunk):
        piece = _WS.sub(" ", line)
        if k:
            if not (parts and parts[-1].endswith(" ")):
                parts.append(" ")
                n += 1
            piece = piece.lstrip(" ")  # the separator, and blanks on either side of it, are one run
        starts.append(n)
        if piece:
            parts.append(piece)
            n += len(piece)
    return "".join(parts), starts


_WS = re.compile(r"\s+")


@dataclass(slots=True)
class _Token:
    kind: str
    start: int
    end: int
    text: str
    values: tuple[str, ...]


# Where a clause can start: a cheap prefilter (a first-character lookahead, then short
# literals), so the full alternation runs only at candidate positions.
_CANDIDATE = re.compile(
    r"(?=[CHXNATGoPtwO(;0-9RDF])(?:CUDA |HIP |XPU |NPU |Allocation on|Tried to|GPU \d|GPU has|of which"
    r"|Process \d|this process|Of the allocated|with \d|\(GPU|\(NPU|; \d|Currently|Requested"
    r"|Device limit|Free \(|PyTorch limit|(?<![\d.])\d)"
)


def _matches(region: str) -> Iterator[re.Match[str]]:
    """Like ``_MASTER.finditer(region)``, trying the full pattern only at candidates."""
    pos = 0
    while True:
        cand = _CANDIDATE.search(region, pos)
        if cand is None:
            return
        m = _MASTER.match(region, cand.start())
        if m is None:
            pos = cand.start() + 1
            continue
        yield m
        pos = max(m.end(), cand.start() + 1)


def _tokens(region: str) -> Iterator[_Token]:
    for m in _matches(region):
        kind = m.lastgroup
        if kind is None:  # pragma: no cover - every alternative is named
            continue
        values = tuple(v for v in (m.group(g) for g in _GROUPS[kind]) if v is not None)
        yield _Token(kind, m.start(), m.end(), m.group(0), values)


class _Builder:
    """Collects the tokens of one message."""

    def __init__(self, first: _Token) -> None:
        self.tokens: list[_Token] = [first]
        self.seen: set[str] = {first.kind}
        self.rank = _RANK[first.kind]
        self.async_family = first.kind.startswith("async")

    def accepts(self, tok: _Token) -> bool:
        last = self.tokens[-1]
        if tok.start - last.end > _MAX_GAP:
            return False
        if tok.kind.startswith("async") != self.async_family:
            return False
        if tok.kind in self.seen and tok.kind not in _REPEATABLE:
            return False
        if tok.kind == "proc" and len(self.tokens) > _MAX_PROCESSES:
            return False
        return _RANK[tok.kind] >= self.rank

    def add(self, tok: _Token) -> None:
        self.tokens.append(tok)
        self.seen.add(tok.kind)
        self.rank = max(self.rank, _RANK[tok.kind])

    def build(self, region: str, line: int = 0) -> OomMessage | None:
        toks = self.tokens
        numeric = [t for t in toks if t.kind not in ("head",)]
        if not numeric:
            return None
        text = region[toks[0].start : toks[-1].end]
        key = " | ".join(t.text for t in numeric)
        msg = OomMessage(text=text, key=key, clauses=tuple(t.kind for t in toks), line=line)
        procs: list[ProcessUse] = []
        for t in toks:
            _apply(msg, t, procs)
        msg.processes = tuple(procs)
        _derive(msg)
        return msg


def _apply(msg: OomMessage, t: _Token, procs: list[ProcessUse]) -> None:
    v = t.values
    k = t.kind
    if k == "head":
        msg.device_kind = v[0]
    elif k == "async_head":
        msg.device_index = int(v[0])
        msg.backend = "cudaMallocAsync"
        msg.fmt = "async"
    elif k in ("req", "async_req"):
        msg.R = _size(v[0], v[1])
    elif k in ("cap_new", "old_open"):
        if len(v) == 3:  # "GPU  has": no index printed (the values keep only the groups that matched)
            msg.device_index = int(v[0])
        msg.T = _size(v[-2], v[-1])
        msg.fmt = "2.x" if k == "cap_new" else "1.x-reserved"
    elif k in ("free_new", "old_free", "async_free"):
        msg.F = _size(v[0], v[1])
    elif k == "proc":
        procs.append(ProcessUse(int(v[0]), _size(v[1], v[2])))
    elif k == "this":
        msg.this_process = _size(v[0], v[1])
    elif k == "allowed":
        msg.L = _size(v[0], v[1])
    elif k in ("alloc_new", "old_alloc", "async_alloc"):
        msg.A = _size(v[0], v[1])
    elif k == "private":
        msg.private_pools = _size(v[0], v[1])
    elif k == "unalloc":
        msg.pytorch_unallocated = _size(v[0], v[1])
    elif k == "old_cached":
        msg.cached = _size(v[0], v[1])
        msg.fmt = "1.x-cached"
    elif k == "old_reserved":
        msg.P = _size(v[0], v[1])
    elif k == "async_total":
        msg.T = _size(v[0], v[1])
    elif k == "async_limit":
        limit = _size(v[0], v[1])
        msg.L = None if limit >= _NO_LIMIT_BYTES else limit


def _derive(msg: OomMessage) -> None:
    """P, U and O from the printed lines (see DESIGN, "The OOM rubric")."""
    if msg.P is None and msg.A is not None:
        # "A is allocated by PyTorch" already includes private pools, and the unallocated
        # figure is reserved minus that, so P = A + Y. Pre-1.5: P = A + cached.
        extra = msg.pytorch_unallocated if msg.pytorch_unallocated is not None else msg.cached
        if extra is not None:
            msg.P = msg.A + extra
    procs = msg.processes
    if msg.this_process is not None:
        msg.U = msg.this_process
        if procs:
            msg.O = sum(p.bytes for p in procs)
    elif len(procs) == 1 and (msg.P is None or procs[0].bytes >= msg.P):
        # In a container NVML reports this process under a PID of another namespace, so
        # the only "Process N" line is the failing process itself (its use covers P).
        msg.U = procs[0].bytes
        msg.self_from_process_line = True
    if msg.U is not None and msg.O is None and msg.T is not None and msg.F is not None:
        msg.O = max(0, msg.T - msg.F - msg.U)


def find_ooms(text: str) -> list[OomMessage]:
    """Every distinct OOM message in ``text``, in order of first appearance. Never raises."""
    try:
        return _find(text)
    except Exception:  # defensive: the contract is "never raises"
        return []


def decoded_lines(text: str) -> list[str]:
    """The lines ``find_ooms`` scans: JSON and HTML escapes undone (line indexes match ``line``)."""
    return _decode(text).splitlines()


def _find(text: str) -> list[OomMessage]:
    if not isinstance(text, str) or not text:
        return []
    lines = decoded_lines(text)
    out: list[OomMessage] = []
    keys: set[str] = set()
    for first, region, starts in _regions(lines):
        builder: _Builder | None = None
        for tok in _tokens(region):
            if builder is not None and builder.accepts(tok):
                builder.add(tok)
                continue
            if builder is not None:
                _emit(_built(builder, region, first, starts), out, keys)
                builder = None
            if tok.kind in _STARTS:
                builder = _Builder(tok)
        if builder is not None:
            _emit(_built(builder, region, first, starts), out, keys)
    return out


def _built(builder: _Builder, region: str, first: int, starts: list[int]) -> OomMessage | None:
    """The message ``builder`` holds, with the line its first clause is on (``starts``: each line's offset)."""
    return builder.build(region, first + bisect_right(starts, builder.tokens[0].start) - 1)


def _emit(msg: OomMessage | None, out: list[OomMessage], keys: set[str]) -> None:
    if msg is None or msg.key in keys:
        return
    keys.add(msg.key)
    out.append(msg)
