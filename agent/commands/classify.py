"""infersight classify: find every OOM message in text and say which of the three it was.

Usage: infersight classify [--json] [--snapshot FILE] [--request SIZE] [--rules-dir DIR]...
[PATH|-]. Exit status: 0 when at least one OOM was found (or a snapshot was summarised),
1 when none, 2 on bad usage, an unreadable file or an invalid rule file (file:line).
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from infersight.agent.cli import command_help
from infersight.bytesize import parse_bytes, torch_bytes
from infersight.rules.engine import (
    RuleFileError,
    default_rule_paths,
    load_rules,
)
from infersight.rules.oom_parse import NUMBER_KEYS
from infersight.rules.serving import Finding, ServingRulesError, analyse, load_serving_rules, quiet_lines
from infersight.rules.snapshot import (
    SnapshotError,
    SnapshotSummary,
    SnapshotVerdict,
    load_snapshot,
    summarize,
    verdict_for,
)

__all__ = ["add_parser", "build_parser", "main", "run"]

_PROG = "infersight classify"
_WIDTH = 100
_LABELS = {"F_prime": "F'", "N_prime": "N'"}


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object per line")
    p.add_argument("--snapshot", metavar="FILE", help="a torch.cuda.memory._dump_snapshot file")
    p.add_argument(
        "--request",
        metavar="SIZE",
        help="request size for the snapshot verdict, e.g. 1.5GiB, 512MiB or bytes",
    )
    p.add_argument(
        "--rules-dir",
        metavar="DIR",
        action="append",
        default=[],
        help="extra rule files (DIR/*.toml), loaded after the builtin rules and "
        "the site directories ($INFERSIGHT_RULES_DIRS, as the agent's rules.dirs; default "
        "/etc/infersight/rules.d); repeatable",
    )
    p.add_argument("path", nargs="?", metavar="PATH|-", help="text to scan; - or absent: stdin")
    p.set_defaults(func=run)


def add_parser(subparsers: Any, help_line: str | None = None) -> argparse.ArgumentParser:
    """Register ``classify`` on an ``argparse`` subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "classify",
        help=help_line or command_help("classify"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser, for ``main`` and tests."""
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__)
    _configure(p)
    return p


def _fail(msg: str, err: TextIO) -> int:
    print(f"{_PROG}: {msg}", file=err)
    return 2


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    request: int | None = None
    if args.request is not None:
        if args.snapshot is None:
            return _fail("--request needs --snapshot", err)
        request = parse_bytes(args.request)
        if request is None:
            return _fail(f"--request {args.request!r} is not a size (e.g. 1.5GiB)", err)
    for d in args.rules_dir:
        if not Path(d).is_dir():
            return _fail(f"--rules-dir {d}: not a directory", err)
    try:
        rules = load_rules(default_rule_paths(args.rules_dir))
        serving = load_serving_rules(rubric=rules)
    except (RuleFileError, ServingRulesError) as exc:
        for loc, problem in exc.errors:
            print(f"{loc}: {problem}", file=err)
        return 2

    if args.snapshot is not None:
        try:
            summary = summarize(load_snapshot(args.snapshot))
        except SnapshotError as exc:
            return _fail(f"{args.snapshot}: {exc}", err)
        sv = verdict_for(summary, request, rules) if request is not None else None
        _print_snapshot(summary, sv, args.json, out)
        if args.path is None:
            return 0

    try:
        text = _read_text(args.path)
    except OSError as exc:
        return _fail(f"cannot read {args.path}: {exc.strerror or exc}", err)
    findings = analyse(text, serving)
    if not findings:
        print(f"{_PROG}: no OOM message found", file=err)
        for line, entry in quiet_lines(text, serving):
            print(f"  line {line + 1}: not an out-of-memory error ({entry.id}): {first_sentence(entry.mechanism)}",
                  file=err)
        return 1
    for i, f in enumerate(findings, 1):
        if args.json:
            print(json.dumps(f.to_json(), sort_keys=False), file=out)
        else:
            _print_human(i, len(findings), f, out)
    return 0


def first_sentence(text: str) -> str:
    """The first sentence of a rule's prose, on one line (pure)."""
    flat = " ".join(text.split())
    end = flat.find(". ")
    return flat if end < 0 else flat[: end + 1]


def _read_text(path: str | None) -> str:
    data = sys.stdin.buffer.read() if path is None or path == "-" else Path(path).read_bytes()
    return decode_log(data)


def decode_log(data: bytes) -> str:
    """A log's text: UTF-8, or UTF-16 where it says so (a byte-order mark: what Windows
    PowerShell's ``>`` writes) or looks so (every other byte NUL in its first KiB, either way); bytes that
    do not decode are replaced, never fatal (pure)."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return data.decode("utf-16", errors="replace")
    head = data[:1024]
    if len(head) >= 16:
        even, odd = head[0::2], head[1::2]
        if odd.count(0) > 0.9 * len(odd) and even.count(0) < len(even) // 4:
            return data.decode("utf-16-le", errors="replace")
        if even.count(0) > 0.9 * len(even) and odd.count(0) < len(odd) // 4:
            return data.decode("utf-16-be", errors="replace")
    return data.decode("utf-8-sig", errors="replace")


def _fmt(n: int | None) -> str:
    return "-" if n is None else torch_bytes(n)


def _wrap(label: str, text: str) -> str:
    return textwrap.fill(
        text,
        width=_WIDTH,
        initial_indent=f"  {label:<8}",
        subsequent_indent=" " * 10,
        break_on_hyphens=False,
    )


def _print_human(i: int, n: int, f: Finding, out: TextIO) -> None:
    msg = f.message
    if msg is not None:
        where = f" on GPU {msg.device_index}" if msg.device_index is not None else ""
        backend = ", cudaMallocAsync" if msg.backend == "cudaMallocAsync" else ""
        what = f"{msg.device_kind} out of memory{where} ({msg.fmt} format{backend})"
    else:
        what = f"memory error: {f.text[:80]}"
    print(f"OOM {i} of {n} [{f.engine}]: {what}", file=out)
    print(f"  class   {f.cls}", file=out)
    print(f"  rule    {f.rule} v{f.rule_version}", file=out)
    nums = "  ".join(f"{k}={_fmt(f.numbers.get(k))}" for k in NUMBER_KEYS)
    print(f"  numbers {nums}", file=out)
    if f.extra:
        extra = "  ".join(f"{k}={_fmt_extra(k, v)}" for k, v in f.extra.items())
        print(_wrap("engine", extra), file=out)
    derived = [k for k in f.used if k not in NUMBER_KEYS]
    if derived:
        used = "  ".join(f"{_LABELS.get(k, k)}={_fmt(f.used[k])}" for k in derived)
        print(_wrap("derived", used), file=out)
    if f.missing:
        print(_wrap("missing", ", ".join(f.missing)), file=out)
    if f.reason:
        print(_wrap("reason", f.reason), file=out)
    if f.knob:
        print(_wrap("knob", f.knob), file=out)
    if f.mechanism:
        print(_wrap("why", f.mechanism), file=out)
    print(_wrap("remedy", f.remedy), file=out)
    if f.note:
        print(_wrap("note", f.note), file=out)
    print(file=out)


def _fmt_extra(key: str, v: float) -> str:
    if key.endswith("_bytes"):
        return str(torch_bytes(v))
    return f"{v:g}"


def _snapshot_json(s: SnapshotSummary, sv: SnapshotVerdict | None) -> dict[str, Any]:
    d: dict[str, Any] = {
        "segments": s.segments,
        "reserved_bytes": s.reserved_bytes,
        "allocated_bytes": s.allocated_bytes,
        "active_bytes": s.active_bytes,
        "free_bytes": s.free_bytes,
        "largest_free_block": s.largest_free_block,
        "inactive_split_bytes": s.inactive_split_bytes,
        "fragmentation_ratio": round(s.fragmentation_ratio, 6),
        "expandable_segments": s.expandable_segments,
        "blocks": s.blocks,
        "truncated": s.truncated,
        "pools": [
            {
                "pool": p.name,
                "segment_type": p.segment_type,
                "pool_id": list(p.pool_id),
                "segments": p.segments,
                "reserved_bytes": p.reserved_bytes,
                "allocated_bytes": p.allocated_bytes,
                "free_bytes": p.free_bytes,
                "largest_free_block": p.largest_free_block,
                "inactive_split_bytes": p.inactive_split_bytes,
                "fragmentation_ratio": round(p.fragmentation_ratio, 6),
            }
            for p in s.pools
        ],
        "top_allocations": [
            {"size": a.size, "requested_size": a.requested_size, "frame": a.frame} for a in s.top_allocations
        ],
    }
    if sv is not None:
        d["verdict"] = {
            "request_bytes": sv.request_bytes,
            "pool": sv.pool,
            "outcome": sv.outcome,
            "explanation": sv.explanation,
            "rubric": sv.rubric.to_json() if sv.rubric is not None else None,
        }
    return {"snapshot": d}


def _print_snapshot(s: SnapshotSummary, sv: SnapshotVerdict | None, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(json.dumps(_snapshot_json(s, sv)), file=out)
        return
    print(f"Snapshot: {s.segments} segments", file=out)
    if s.truncated:
        print(f"  TRUNCATED: summarised the first {s.segments} segments and {s.blocks} blocks only", file=out)
    print(
        f"  reserved {torch_bytes(s.reserved_bytes)}, allocated {torch_bytes(s.allocated_bytes)}"
        f", free in cache {torch_bytes(s.free_bytes)}, inactive split "
        f"{torch_bytes(s.inactive_split_bytes)}",
        file=out,
    )
    print(
        f"  fragmentation ratio {s.fragmentation_ratio:.2f} (1 - largest free block / free)"
        + (", expandable segments" if s.expandable_segments else ""),
        file=out,
    )
    for p in s.pools:
        print(
            f"  pool {p.name:<14} {p.segments:>5} segments, largest free block "
            f"{torch_bytes(p.largest_free_block)} of {torch_bytes(p.free_bytes)} free, "
            f"ratio {p.fragmentation_ratio:.2f}",
            file=out,
        )
    for a in s.top_allocations[:5]:
        print(f"  live {torch_bytes(a.size):>12}  {a.frame or '(no frames recorded)'}", file=out)
    if sv is not None:
        print(f"  request {torch_bytes(sv.request_bytes)}: {sv.outcome}", file=out)
        print(_wrap("", sv.explanation), file=out)
        if sv.rubric is None:
            print("  rubric  none: the cache serves this request, no OOM to classify", file=out)
        else:
            print(
                f"  rubric  {sv.rubric.cls} ({sv.rubric.rule})"
                + (f", missing {', '.join(sv.rubric.missing)}" if sv.rubric.missing else ""),
                file=out,
            )
    print(file=out)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``classify`` standalone: ``python -m infersight.agent.commands.classify ...``."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage
        return exc.code if isinstance(exc.code, int) else 2
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
