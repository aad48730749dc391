"""``infersight report``: one self-contained HTML page from OTLP JSON files."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from infersight.agent.cli import command_help


def add_parser(sub: Any, help_line: str | None = None) -> argparse.ArgumentParser:
    rp: argparse.ArgumentParser = sub.add_parser("report", help=help_line or command_help("report"))
    rp.add_argument("-o", "--output", metavar="PATH", help="output file (default: the first FILE with .html)")
    rp.add_argument("paths", nargs="+", metavar="FILE")
    rp.set_defaults(func=run)
    return rp


def run(args: argparse.Namespace) -> int:
    from infersight.agent.coldstart.storage_ceiling import ceiling_of
    from infersight.agent.report.page import run_report

    return run_report(args.paths, args.output, sys.stdout, sys.stderr, ceiling_of)
