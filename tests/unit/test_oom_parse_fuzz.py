"""The OOM parser: formats, never raising (hypothesis), and 1 MB adversarial inputs."""

from __future__ import annotations

import html
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infersight.bytesize import parse_bytes
from infersight.rules import oom_parse
from infersight.rules.engine import classify_message
from infersight.rules.oom_parse import OomMessage, find_ooms

GIB = 1 << 30
MIB = 1 << 20

NEW = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.62 GiB. GPU 0 has a "
    "total capacity of 22.16 GiB of which 3.32 GiB is free. Process 1205606 has 18.83 GiB "
    "memory in use. Of the allocated memory 17.95 GiB is allocated by PyTorch, and 447.05 MiB "
    "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
    "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
OLD = (
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 10.76 GiB total "
    "capacity; 9.76 GiB already allocated; 21.12 MiB free; 9.88 GiB reserved in total by "
    "PyTorch)"
)
ASYNC = (
    "[rank0]: torch.OutOfMemoryError: Allocation on device 1 would exceed allowed memory. "
    "(out of memory)\n[rank0]: Currently allocated     : 21.55 GiB\n"
    "[rank0]: Requested               : 952.00 MiB\n[rank0]: Device limit            : 24.00 GiB\n"
    "[rank0]: Free (according to CUDA): 0 bytes\n"
    "[rank0]: PyTorch limit (set by user-supplied memory fraction)\n"
    "[rank0]:                         : 8.00 GiB"
)


def _one(text: str) -> OomMessage:
    found = find_ooms(text)
    assert len(found) == 1, [m.text for m in found]
    return found[0]


# ---------------------------------------------------------------- formats


def test_new_format_single_process_line_is_this_process() -> None:
    m = _one(NEW)
    assert m.fmt == "2.x"
    assert m.device_index == 0
    assert round(4.62 * GIB) == m.R
    assert round(22.16 * GIB) == m.T
    assert round(17.95 * GIB) == m.A
    assert round(17.95 * GIB) + round(447.05 * MIB) == m.P
    assert round(18.83 * GIB) == m.U
    assert m.self_from_process_line
    assert m.O == m.T - m.F - m.U  # type: ignore[operator]


def test_per_process_lines_and_this_process() -> None:
    text = (
        "CUDA out of memory. Tried to allocate 786.00 MiB. GPU 0 has a total capacity of "
        "44.35 GiB of which 739.50 MiB is free. Process 7668 has 28.14 GiB memory in use. "
        "Process 42562 has 536.00 MiB memory in use. Including non-PyTorch memory, this "
        "process has 12.99 GiB memory in use. Of the allocated memory 12.54 GiB is allocated "
        "by PyTorch, with 46.00 MiB allocated in private pools (e.g., CUDA Graphs), and "
        "149.96 MiB is reserved by PyTorch but unallocated."
    )
    m = _one(text)
    assert [p.pid for p in m.processes] == [7668, 42562]
    assert m.U == m.this_process == round(12.99 * GIB)
    assert round(28.14 * GIB) + 536 * MIB == m.O
    assert m.private_pools == 46 * MIB
    assert round(12.54 * GIB) + round(149.96 * MIB) == m.P
    assert not m.self_from_process_line


def test_allowed_cap_in_new_and_old_formats() -> None:
    new = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 "
        "GiB of which 38.09 GiB is free. Including non-PyTorch memory, this process has 41.06 "
        "GiB memory in use. 39.57 GiB allowed; Of the allocated memory 39.10 GiB is allocated "
        "by PyTorch, and 427.46 MiB is reserved by PyTorch but unallocated."
    )
    assert round(39.57 * GIB) == _one(new).L
    old = (
        "RuntimeError: CUDA out of memory. Tried to allocate 5.59 GiB (GPU 0; 11.17 GiB total "
        "capacity; 0 bytes already allocated; 10.91 GiB free; 5.59 GiB allowed; 0 bytes "
        "reserved in total by PyTorch)"
    )
    m = _one(old)
    assert (round(5.59 * GIB), 0, 0) == (m.L, m.A, m.P)


def test_pre_15_cached_format() -> None:
    m = _one(
        "RuntimeError: CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 10.92 GiB total "
        "capacity; 8.57 MiB already allocated; 9.28 GiB free; 4.68 MiB cached)"
    )
    assert m.fmt == "1.x-cached"
    assert m.cached == round(4.68 * MIB)
    assert round(8.57 * MIB) + round(4.68 * MIB) == m.P


def test_async_format_with_rank_prefixes() -> None:
    m = _one(ASYNC)
    assert m.backend == "cudaMallocAsync"
    assert m.device_index == 1
    assert (round(21.55 * GIB), 952 * MIB, 24 * GIB, 0, 8 * GIB) == (m.A, m.R, m.T, m.F, m.L)
    assert m.P is None
    unlimited = ASYNC.replace(": 8.00 GiB", ": 17179869184.00 GiB")
    assert _one(unlimited).L is None


def test_hip_xpu_and_capacty_typo() -> None:
    hip = NEW.replace("CUDA out", "HIP out").replace("capacity", "capacty")
    m = _one(hip)
    assert m.device_kind == "HIP"
    assert round(22.16 * GIB) == m.T
    xpu = (
        "torch.OutOfMemoryError: XPU out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
        "total capacity of 11.93 GiB of which 5.62 MiB is free. Of the allocated memory "
        "10.43 GiB is allocated by PyTorch, and 94.57 MiB is reserved by PyTorch but "
        "unallocated. Please use `empty_cache` to release all unoccupied cached memory."
    )
    m = _one(xpu)
    assert m.device_kind == "XPU"
    assert round(10.43 * GIB) + round(94.57 * MIB) == m.P
    assert classify_message(m).cls == "fragmentation"


def test_a_device_printed_without_its_index_keeps_its_total() -> None:
    # TGI's shard (text-generation-inference#2246) printed "GPU  has a total capacity of 44.53 GiB": the
    # total, and the other processes' use derived from it, were lost
    m = _one(NEW.replace("GPU 0 has", "GPU  has"))
    assert (m.device_index, m.T) == (None, round(22.16 * GIB))
    assert m.O is not None and m.clauses[:3] == ("head", "req", "cap_new")
    assert _one(NEW).device_index == 0


def test_json_html_and_markdown_wrappers() -> None:
    body = json.dumps({"error": {"message": NEW.replace(". ", ".\n")}})
    assert round(4.62 * GIB) == _one(body).R
    page = "<pre>" + html.escape(OLD.replace("(", "\n(")) + "</pre>"
    assert round(9.88 * GIB) == _one(page).P
    quoted = "> " + OLD.replace("; ", ";\n> ")
    assert round(21.12 * MIB) == _one(quoted).F


def test_log_prefix_splitting_a_number_from_its_unit() -> None:
    text = (
        "ERROR 07-30 18:15:55 engine.py:400] torch.OutOfMemoryError: CUDA out of memory. "
        "Tried to allocate 786.00\n"
        "ERROR 07-30 18:15:56 engine.py:400] MiB. GPU 0 has a total capacity of 44.35 GiB of "
        "which 739.50 MiB is free. Of the allocated memory 12.54 GiB is allocated by PyTorch, "
        "and 149.96\n"
        "ERROR 07-30 18:15:57 engine.py:400] MiB is reserved by PyTorch but unallocated."
    )
    m = _one(text)
    assert m.R == 786 * MIB
    assert round(12.54 * GIB) + round(149.96 * MIB) == m.P


WRAPPED = (  # the corpus's oom-006: a message wrapped over eight lines
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 138.00 MiB.\n"
    "GPU 0 has a total capacty of 15.90 GiB of which 8.44 MiB is free.\n"
    "Process 1246069 has 577.00 MiB memory in use. Including non-PyTorch memory,\n"
    "this process has 15.32 GiB memory in use. Of the allocated memory\n"
    "14.12 GiB is allocated by PyTorch, and 410.41 MiB is reserved\n"
    "by PyTorch but unallocated. If reserved but unallocated memory is large\n"
    "try setting max_split_size_mb to avoid fragmentation.  See documentation\n"
    " for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)


@pytest.mark.parametrize("prefix", [
    "{s:02d}.{n:09d}Z ".join(("2026-01-01T00:00:", "")),  # kubectl logs --timestamps, docker logs -t
    "2026-01-01T00:00:{s:02d}.{n:09d}Z stderr F ",  # the CRI log file of a node's /var/log/pods
    "2026-01-01 00:00:00,{n3:03d} - ERROR - train - ",  # Python logging's default-like format
    "2026-01-01 00:00:{s:02d} ERROR ",
    "(VllmWorker rank=0 pid=1234) ERROR 11-20 10:01:{s:02d} [multiproc_executor.py:487] ",  # over 64 characters
])
def test_a_wrapped_message_under_a_per_line_log_prefix_is_rejoined(prefix: str) -> None:
    """Each line of a wrapped message under a log prefix that changes only in its digits reads as the message
    does bare (these prefixes ended in no "] : > | )" or ran past 64 characters: T, A and P were lost)."""
    bare = _one(WRAPPED)
    text = "\n".join(prefix.format(s=i, n=i * 7919, n3=i * 37) + line for i, line in enumerate(WRAPPED.splitlines()))
    m = _one(text)
    assert (m.R, m.T, m.F, m.A, m.P) == (bare.R, bare.T, bare.F, bare.A, bare.P)
    assert None not in (m.T, m.A, m.P)


def test_repeated_messages_count_once_distinct_ones_do_not() -> None:
    text = "\n".join([OLD, "noise", OLD, "**" + OLD.split("memory. ")[1] + "**"])
    assert len(find_ooms(text)) == 1
    other = OLD.replace("20.00 MiB", "40.00 MiB")
    assert [m.R for m in find_ooms(OLD + "\n" + other + "\n" + OLD)] == [20 * MIB, 40 * MIB]


def test_a_message_is_placed_on_its_own_line_not_on_its_regions_first() -> None:
    """An engine's "... cudaMalloc failed: out of memory" on the line before opened the region the PyTorch
    message was read from, and the message was placed on that line: classify then took the engine's line as
    part of the PyTorch event and dropped the engine's own error."""
    ggml = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 16384.00 MiB on device 0: cudaMalloc failed: "
            "out of memory")
    for between in ([], ["  some other line", ""]):
        lines = [ggml, *between, "torch.OutOfMemoryError: " + OLD]
        (m,) = find_ooms("\n".join(lines))
        assert m.line == len(lines) - 1
    wrapped = ["noise: out of memory", "RuntimeError: CUDA out of memory.", "  Tried to allocate 20.00 MiB (GPU 0;",
               "  8.00 GiB total capacity; 1.00 GiB already allocated; 10.00 MiB free; 2.00 GiB reserved in total)"]
    (m,) = find_ooms("\n".join(wrapped))
    assert m.line == 1 and m.R == 20 * MIB


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(alphabet=st.sampled_from(list("ab \t\x0b\u00a0\u2003")), max_size=8), min_size=1, max_size=6))
def test_a_region_is_joined_as_before_and_knows_where_each_line_starts(chunk: list[str]) -> None:
    text, starts = oom_parse._joined_region(chunk)
    assert text == oom_parse._WS.sub(" ", " ".join(chunk))
    for line, at in zip(chunk, starts):
        body = oom_parse._WS.sub(" ", line).strip(" ")
        assert text[at:].lstrip(" ").startswith(body)


def test_no_oom_in_prose() -> None:
    assert find_ooms("The GPU ran out of memory; 1.72G reserved in total by PyTorch?") == []
    assert find_ooms("") == []


def test_parse_size() -> None:
    assert parse_bytes("1.70 GiB") == round(1.7 * GIB)
    assert parse_bytes("1.5GiB") == round(1.5 * GIB)
    assert parse_bytes("512") == 512
    assert parse_bytes("0 bytes") == 0
    assert parse_bytes("2 furlongs") is None
    assert parse_bytes("GiB") is None
    # The serving rules' sizes read through the same parser: binary letters, decimal xB (ggml's
    # "MB", which means MiB, is read by its rules as a MiB count, not here).
    assert parse_bytes("15.65G") == round(15.65 * GIB)
    assert parse_bytes(" 512 MB ") == 512 * 1000**2
    assert parse_bytes("3 PiB") == 3 << 50 and parse_bytes("2 pb") == 2 * 1000**5
    assert parse_bytes("0.5", "MiB") == MIB // 2 and parse_bytes("1 KiB", "GiB") == 1024


# ---------------------------------------------------------------- never raises

FRAGMENTS = st.sampled_from(
    [
        "CUDA out of memory.",
        "HIP out of memory. ",
        "Tried to allocate ",
        "GPU 0 has a total capacity of ",
        "GPU 0 has a total capacty of ",
        " of which ",
        " is free. ",
        "Process 12 has ",
        " memory in use. ",
        "Including non-PyTorch memory, this process has ",
        "Of the allocated memory ",
        " is allocated by PyTorch, and ",
        " is reserved by PyTorch but unallocated.",
        "(GPU 1; ",
        " total capacity; ",
        " already allocated; ",
        " free; ",
        " allowed; ",
        " cached)",
        " reserved in total by PyTorch)",
        "Allocation on device 0 would exceed allowed memory. (out of memory)",
        "\nCurrently allocated     : ",
        "\nRequested               : ",
        "\nPyTorch limit (set by user-supplied memory fraction)\n   : ",
        "1.70",
        "0",
        "17179869184.00",
        "99999999999999999999.999999999",
        " GiB",
        " MiB",
        " KiB",
        " bytes",
        "\n",
        "\\n",
        "&quot;",
        "&#",
        "[rank0]: ",
        "ERROR 07-30 18:15:55 engine.py:400] ",
        "\u00a0",
        "\x00",
        "(",
        ")",
        ";",
    ]
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.one_of(FRAGMENTS, st.text(max_size=20)), max_size=60))
def test_parser_never_raises_on_fragment_soup(parts: list[str]) -> None:
    # The internal parser, not the public wrapper and its last-resort ``except``.
    found = oom_parse._find("".join(parts))
    assert isinstance(found, list)
    keys = [m.key for m in found]
    assert len(keys) == len(set(keys))
    for m in found:
        for v in m.numbers().values():
            assert v is None or (isinstance(v, int) and v >= 0)
        classify_message(m)  # the engine accepts whatever the parser produced


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=2000))
def test_parser_never_raises_on_any_text(text: str) -> None:
    assert isinstance(oom_parse._find(text), list)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200), st.text(max_size=200))
def test_message_is_found_inside_noise(before: str, after: str) -> None:
    found = find_ooms(before + "\n" + OLD + "\n" + after)
    assert any(m.R == 20 * MIB and round(9.88 * GIB) == m.P for m in found)


def test_non_string_input_returns_empty() -> None:
    assert find_ooms(None) == []  # type: ignore[arg-type]
    assert find_ooms(b"CUDA out of memory") == []  # type: ignore[arg-type]


# ---------------------------------------------------------------- 1 MB adversarial text
# Linear time holds by construction (see rules/oom_parse.py). These inputs are the classic
# backtracking traps for the shapes we match; the assertions are on the results (counts),
# never on the clock: each call completing is the check.

MB = 1 << 20


def test_adversarial_digits_and_spaces() -> None:
    assert find_ooms("Tried to allocate " + "9" * MB) == []
    assert find_ooms("Tried to allocate " + "1." * (MB // 2)) == []
    assert find_ooms("(GPU 0; " + " " * MB + "GiB total capacity") == []


def test_adversarial_many_anchor_lines() -> None:
    text = "CUDA out of memory. Tried to allocate\n" * (MB // 38)
    assert find_ooms(text) == []


def test_adversarial_one_long_line_of_clauses() -> None:
    unit = "Tried to allocate 1.00 GiB. "
    found = find_ooms(unit * (MB // len(unit)))
    assert len(found) == 1
    assert found[0].R == GIB


def test_adversarial_distinct_messages_scale_with_input() -> None:
    parts = [f"Tried to allocate {i}.00 MiB (GPU 0; 8.00 GiB total capacity; " for i in range(20000)]
    found = find_ooms("".join(parts))
    assert len(found) == 20000


def test_adversarial_escapes_and_entities() -> None:
    assert find_ooms("\\n&amp;" * (MB // 7)) == []
    assert find_ooms("&" * MB + "CUDA out of memory") == []


def test_adversarial_prefixes() -> None:
    line = "[" * 60 + "] out of memory " + "GiB " * 20 + "\n"
    assert find_ooms(line * (MB // len(line))) == []
