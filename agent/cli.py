"""The ``infersight`` command line.

Start-up is kept cheap (``infersight --help`` under 60 ms): this module imports only
argparse at load time; each command imports what it needs when it runs, and a
command's own parser is built only when that command was asked for (the others get
a name and a help line). To add a command, add one line to ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any, NoReturn

    from infersight.agent import config as cfg
    from infersight.exporters.base import Exporter

EXIT_USAGE = 2
DEFAULT_CONFIG_PATH = "/etc/infersight/infersight.toml"  # = config.DEFAULT_CONFIG_PATH (a test checks)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # usage errors exit 2, as DESIGN says
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, "%s: error: %s\n" % (self.prog, message))


def _cmd_launch(args: argparse.Namespace) -> int:
    from infersight.agent.launch import LaunchOptions, run

    return run(LaunchOptions(args.cmd, otlp_file=args.otlp_file, console=args.console,
                             ready_url=args.ready_url, probe=args.probe, evict=args.evict or ()))


def _cmd_agent(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from infersight.agent import config as cfg
    from infersight.agent import extensions
    from infersight.agent.sinks import build_exporters

    explicit = args.config is not None
    path = args.config or os.environ.get("INFERSIGHT_CONFIG") or cfg.DEFAULT_CONFIG_PATH
    try:
        conf = cfg.load(path, require_file=explicit, flags={"agent.socket": args.socket})
        extensions.validate(conf)
        exporters = build_exporters(conf)
    except cfg.ConfigError as exc:
        sys.stderr.write("infersight agent: %s\n" % exc)
        return EXIT_USAGE
    logging.basicConfig(
        level=conf["agent.log_level"], format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return asyncio.run(_serve(conf, exporters))
    except cfg.ConfigError as exc:  # found at start, e.g. an unsafe socket directory
        sys.stderr.write("infersight agent: %s\n" % exc)
        return EXIT_USAGE


async def _serve(conf: cfg.Config, exporters: list[Exporter]) -> int:
    from infersight.agent import extensions
    from infersight.agent.daemon import Agent

    listen = None
    try:
        from infersight.agent.socket_activation import listen_fds

        fds = listen_fds()
        listen = fds[0] if fds else None
    except ImportError:
        pass
    agent = Agent(conf, exporters, listen_sock=listen)
    extensions.install(agent, conf)
    return await agent.serve_forever()


def query_status(path: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """Ask a running agent for its health over its socket."""
    import socket

    from infersight.hooks import _wire

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        s.sendall(_wire.encode_frame({"t": "status"}))
        buf = b""
        while True:
            frames, buf, bad = _wire.split_frames(buf)
            if bad:
                raise OSError("agent sent an oversized frame")
            if frames:
                msg = _wire.decode_payload(frames[0])
                if msg is None:
                    raise OSError("agent sent a malformed frame")
                return msg
            chunk = s.recv(65536)
            if not chunk:
                raise OSError("agent closed the connection")
            buf += chunk


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from infersight.hooks import _paths

    path = args.socket or _paths.socket_path()
    try:
        h = query_status(path)
    except OSError as exc:
        if args.json:
            print(json.dumps({"healthy": False, "socket": path, "error": str(exc)}))
        else:
            print("infersight agent: not reachable at %s (%s)" % (path, exc))
        return 1
    if h.get("t") == "refuse":
        print("infersight agent refused the status query: %s" % h.get("error"))
        return 1
    h.pop("t", None)
    if args.json:
        print(json.dumps(h, sort_keys=True))
    else:
        print("infersight agent %s (%s, pid %s): %s" % (
            h.get("version"), h.get("mode"), h.get("pid"), "healthy" if h.get("healthy") else "UNHEALTHY"))
        for k in ("uptime_s", "socket", "producers", "events_in", "items_out", "lost", "dropped_by_producers"):
            print("  %-22s %s" % (k, h.get(k)))
        for e in h.get("exporters") or []:
            print("  exporter %-12s peer_up=%s exported=%s errors=%s retries=%s queued=%s spooled=%s dropped=%s" % (
                e.get("name"), e.get("peer_up"), e.get("exported_items"), e.get("export_errors"),
                e.get("retries"), e.get("queue_depth"), e.get("spooled_items_pending"), e.get("dropped_items")))
    return 0 if h.get("healthy") else 1


def _cmd_show(args: argparse.Namespace) -> int:
    from infersight.agent.show import show_file

    return show_file(args.path, sys.stdout, args.format, sys.stderr)


def _cmd_report(args: argparse.Namespace) -> int:
    from infersight.agent.report import run_report

    return run_report(args.paths, args.output, sys.stdout, sys.stderr)


def _cmd_hooks(args: argparse.Namespace) -> int:
    from infersight.agent import hooks_install

    if args.action == "install":
        return hooks_install.install(args.python, sys.stdout)
    return hooks_install.uninstall(args.python, sys.stdout)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from infersight.agent.doctor import run_doctor

    return run_doctor(sys.stdout, as_json=args.json)


def _add_launch(sub: Any) -> argparse.ArgumentParser:
    lp: argparse.ArgumentParser = sub.add_parser("launch", help=_help("launch"))
    lp.add_argument("--otlp-file", metavar="PATH", help="output file (default: infersight-<time>.otlp.jsonl)")
    lp.add_argument("--ready-url", metavar="URL",
                    help="poll URL (2xx/3xx) as the readiness probe; ends ready_wait there")
    lp.add_argument("--probe", metavar="URL",
                    help="after readiness, GET URL once and record the time to its first byte")
    lp.add_argument("--evict", metavar="PATH", nargs="+", action="extend",
                    help="drop these files (directories recursively) from the page cache before CMD "
                         "starts, for a truly cold start without root")
    lp.add_argument("--console", action=argparse.BooleanOptionalAction, default=True,
                    help="print the cold-start waterfall (default: on)")
    lp.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")
    lp.set_defaults(func=_cmd_launch)
    return lp


def _add_agent(sub: Any) -> argparse.ArgumentParser:
    ap: argparse.ArgumentParser = sub.add_parser("agent", help=_help("agent"))
    ap.add_argument("--config", metavar="PATH", help="TOML config (default %s)" % DEFAULT_CONFIG_PATH)
    ap.add_argument("--socket", metavar="PATH", help="listen here (overrides config and env)")
    ap.set_defaults(func=_cmd_agent)
    return ap


def _add_status(sub: Any) -> argparse.ArgumentParser:
    sp: argparse.ArgumentParser = sub.add_parser("status", help=_help("status"))
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--socket", metavar="PATH")
    sp.set_defaults(func=_cmd_status)
    return sp


def _add_show(sub: Any) -> argparse.ArgumentParser:
    shp: argparse.ArgumentParser = sub.add_parser("show", help=_help("show"))
    shp.add_argument("--format", choices=("text", "json", "chrome-trace"), default="text",
                     help="text (default), json (the waterfall for scripts) or chrome-trace (Perfetto)")
    shp.add_argument("path", metavar="FILE")
    shp.set_defaults(func=_cmd_show)
    return shp


def _add_report(sub: Any) -> argparse.ArgumentParser:
    rp: argparse.ArgumentParser = sub.add_parser("report", help=_help("report"))
    rp.add_argument("-o", "--output", metavar="PATH", help="output file (default: the first FILE with .html)")
    rp.add_argument("paths", nargs="+", metavar="FILE")
    rp.set_defaults(func=_cmd_report)
    return rp


def _add_hooks(sub: Any) -> argparse.ArgumentParser:
    hp: argparse.ArgumentParser = sub.add_parser("hooks", help=_help("hooks"))
    hp.add_argument("action", choices=("install", "uninstall"))
    hp.add_argument("--python", default=sys.executable, metavar="PATH", help="target interpreter")
    hp.set_defaults(func=_cmd_hooks)
    return hp


def _add_doctor(sub: Any) -> argparse.ArgumentParser:
    dp: argparse.ArgumentParser = sub.add_parser("doctor", help=_help("doctor"))
    dp.add_argument("--json", action="store_true")
    dp.set_defaults(func=_cmd_doctor)
    return dp


# name, help line, and what builds its parser: a function here, or the name of a module
# whose ``add_parser(subparsers)`` registers the command (imported only when it runs).
COMMANDS: list[tuple[str, str, Callable[[Any], argparse.ArgumentParser] | str]] = [
    ("launch", "run CMD with the hooks active; write an OTLP JSON file", _add_launch),
    ("agent", "run the daemon", _add_agent),
    ("status", "ask a running agent for its health (exit 0 if healthy)", _add_status),
    ("show", "print the cold-start waterfall from an OTLP JSON file", _add_show),
    ("report", "write one self-contained HTML page: cold start, memory, devices, OOMs", _add_report),
    ("hooks", "install or remove the .pth bootstrap in an interpreter", _add_hooks),
    ("doctor", "check what works on this host, with fixes", _add_doctor),
    ("classify", "classify CUDA/HIP/XPU out-of-memory messages: capacity, fragmentation, reservation conflict",
     "infersight.agent.classify_cmd"),
    ("baseline", "run the same fixed requests on every visible device and compare P50/P99",
     "infersight.agent.baseline_cmd"),
    ("install-service", "install the systemd units, sysusers/tmpfiles snippets and default config",
     "infersight.agent.install_service"),
]


def _help(name: str) -> str:
    return next(h for n, h, _add in COMMANDS if n == name)


def _add_command(sub: Any, add: Callable[[Any], argparse.ArgumentParser] | str) -> None:
    if isinstance(add, str):
        import importlib

        importlib.import_module(add).add_parser(sub)
    else:
        add(sub)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with ``only``, that command in full and the others by name and help."""
    p = _Parser(prog="infersight", description=(
        "Telemetry for hosts that serve PyTorch models on GPUs: cold-start spans, "
        "OOM classification, device heterogeneity."))
    from infersight import __version__

    p.add_argument("--version", action="version", version="infersight " + __version__)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, help_line, add in COMMANDS:
        if only is None or name == only:
            _add_command(sub, add)
        else:
            sub.add_parser(name, help=help_line, add_help=False)
    return p


def _command_name(argv: Sequence[str]) -> str:
    """The command asked for: the first word that is not an option (the top level has no
    option that takes a value). "" when there is none."""
    return next((a for a in argv if not a.startswith("-")), "")


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(only=_command_name(args_in))
    args = parser.parse_args(args_in)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        rc: int = args.func(args)
        return rc
    except KeyboardInterrupt:
        return 130
