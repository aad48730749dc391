"""The ``infersight`` command line.

Start-up is kept cheap (``infersight --help`` under 60 ms): this module imports only
argparse at load time; each command imports what it needs when it runs, and a
command's own parser is built only when that command was asked for (the others get
a name and a help line). Every command is a module in ``agent/commands/``; to add one, add one line to
``COMMANDS``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any, NoReturn

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for cat whose reader left
DEFAULT_CONFIG_PATH = "/etc/infersight/infersight.toml"  # = config.DEFAULT_CONFIG_PATH (a test checks)


# reStructuredText in a module docstring used as a command's description: ``literal`` and
# :role:`target` (with an optional ~); --help prints them plain.
_RST_LITERAL = re.compile(r"``(.+?)``", re.S)
_RST_ROLE = re.compile(r":(?:py:)?(func|meth|class|mod|attr|data|obj|exc|ref|doc|envvar|term):`~?([^`]+)`")


def plain_text(text: str) -> str:
    """``text`` with the reStructuredText markup of docstrings removed: what --help prints."""

    def role(m: re.Match[str]) -> str:
        target = m.group(2)
        if "<" in target and target.endswith(">"):  # :ref:`title <target>`
            return target.split("<", 1)[0].strip()
        return target + "()" if m.group(1) in ("func", "meth") else target

    return _RST_LITERAL.sub(r"\1", _RST_ROLE.sub(role, text))


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("description"):
            kwargs["description"] = plain_text(kwargs["description"])
        super().__init__(*args, **kwargs)
        self.commands: Mapping[str, argparse.ArgumentParser] = {}  # the top level's: name -> its parser

    def error(self, message: str) -> NoReturn:  # usage errors exit 2, as DESIGN says
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, "%s: error: %s\n" % (self.prog, message))


# name, help line, and the module under agent/commands/ whose ``add_parser(subparsers,
# help_line)`` registers the command and sets ``func=run`` (imported only when asked for).
COMMANDS: list[tuple[str, str, str]] = [
    ("launch", "run CMD with the hooks active; write an OTLP JSON file",
     "infersight.agent.commands.launch"),
    ("agent", "run the daemon",
     "infersight.agent.commands.agent"),
    ("status", "ask a running agent for its health (exit 0 if healthy)",
     "infersight.agent.commands.status"),
    ("show", "print the cold-start waterfall from an OTLP JSON file",
     "infersight.agent.commands.show"),
    ("report", "write one self-contained HTML page: cold start, memory, devices, OOMs",
     "infersight.agent.commands.report"),
    ("hooks", "install or remove the .pth bootstrap in an interpreter",
     "infersight.agent.commands.hooks_install"),
    ("doctor", "check what works on this host, with fixes",
     "infersight.agent.commands.doctor"),
    ("classify", "classify CUDA/HIP/XPU out-of-memory messages: capacity, fragmentation, reservation conflict",
     "infersight.agent.commands.classify"),
    ("baseline", "run the same fixed requests on every visible device and compare P50/P99",
     "infersight.agent.commands.baseline"),
    ("install-service", "install the systemd units, sysusers/tmpfiles snippets and default config",
     "infersight.agent.commands.install_service"),
]


def command_help(name: str) -> str:
    """The help line of a command, from ``COMMANDS``."""
    return next(h for n, h, _module in COMMANDS if n == name)


def _add_command(sub: Any, module: str, help_line: str) -> None:
    import importlib

    importlib.import_module(module).add_parser(sub, help_line)


def build_parser(only: str | None = None) -> _Parser:
    """The full parser; with ``only``, that command in full and the others by name and help."""
    p = _Parser(prog="infersight", description=(
        "Telemetry for hosts that serve PyTorch models on GPUs: cold-start spans, "
        "OOM classification, device heterogeneity."))
    from infersight import __version__

    p.add_argument("--version", action="version", version="infersight " + __version__)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, help_line, module in COMMANDS:
        if only is None or name == only:
            _add_command(sub, module, help_line)
        else:
            sub.add_parser(name, help=help_line, add_help=False)
    p.commands = sub.choices
    return p


def _command_name(argv: Sequence[str]) -> str:
    """The command asked for: the first word that is not an option (the top level has no
    option that takes a value). "" when there is none."""
    return next((a for a in argv if not a.startswith("-")), "")


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    # INFERSIGHT=1 in a service's environment turns the hooks on in its Python processes: not
    # in infersight's own (the bootstrap skips this one), nor in the ones it starts (a probe).
    os.environ.pop("INFERSIGHT", None)
    parser = build_parser(only=_command_name(args_in))
    args, unknown = parser.parse_known_args(args_in)
    if unknown:  # after the command's name: said by that command's parser, with its usage
        name = getattr(args, "command", None) or ""
        top = args_in[:args_in.index(name)] if name in args_in else args_in
        owner = parser if any(u in top for u in unknown) else parser.commands.get(name, parser)
        owner.error("unrecognized arguments: %s" % " ".join(unknown))
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        rc: int = args.func(args)
        return rc
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of our output went away (``| head``): end quietly, as cat does, instead of a
        # traceback; what is still buffered goes nowhere (the interpreter's last flush would raise).
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_BROKEN_PIPE
