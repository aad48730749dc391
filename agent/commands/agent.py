"""``infersight agent``: run the daemon (the composition root of daemon mode)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from infersight.agent.cli import DEFAULT_CONFIG_PATH, EXIT_USAGE, command_help

TYPE_CHECKING = False
if TYPE_CHECKING:
    from infersight.agent.daemon.extension import Extension
    from infersight.exporters.base import Exporter
    from infersight.settings import Config


def add_parser(sub: Any, help_line: str | None = None) -> argparse.ArgumentParser:
    ap: argparse.ArgumentParser = sub.add_parser("agent", help=help_line or command_help("agent"))
    ap.add_argument("--config", metavar="PATH", help="TOML config (default %s)" % DEFAULT_CONFIG_PATH)
    ap.add_argument("--socket", metavar="PATH", help="listen here (overrides config and env)")
    ap.set_defaults(func=run)
    return ap


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from infersight.agent.commands.compose import build_exporters, file_is_default
    from infersight.agent.commands.extensions import build_extensions
    from infersight.agent.daemon import config as cfg
    from infersight.agent.daemon.lifecycle import check_state_dir
    from infersight.settings import ConfigError

    explicit = args.config is not None
    path = args.config or os.environ.get("INFERSIGHT_CONFIG") or cfg.DEFAULT_CONFIG_PATH
    try:
        conf = cfg.load(path, require_file=explicit, flags={"agent.socket": args.socket})
    except ConfigError as exc:
        sys.stderr.write("infersight agent: %s\n" % exc)
        return EXIT_USAGE
    logging.basicConfig(
        level=conf["agent.log_level"], format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        # The state directory is checked (and a mode of its own fixed) before anything reads it: the
        # extensions load the cold-start history there, and the exporters their spools.
        check_state_dir(conf["agent.state_dir"])
        _say_why_not_the_service_state_dir(conf)
        extensions = build_extensions(conf)  # checks their keys and rule files before anything starts
        exporters = build_exporters(conf)
        default = file_is_default(conf, exporters)
        if default:
            # "no sink configured" only where the file is the only sink (exporters.file.enabled = true beside
            # OTLP or MQTT records there too, and said so wrongly).
            alone = all(getattr(e, "path", None) == default for e in exporters)
            logging.getLogger("infersight.agent").info(
                "%s the default file %s (rotated past %d bytes, %d kept)",
                "no sink configured: recording to" if alone else "recording also to", default,
                conf["exporters.file.max_bytes"], conf["exporters.file.backups"])
        return asyncio.run(serve(conf, exporters, extensions))
    except ConfigError as exc:  # also found at start, e.g. an unsafe socket directory
        sys.stderr.write("infersight agent: %s\n" % exc)
        return EXIT_USAGE


def _say_why_not_the_service_state_dir(conf: Config) -> None:
    """An agent whose default state directory is not the service's, though that one is there (root in the
    foreground after systemd-tmpfiles: /var/lib/infersight is the infersight user's), says so: the README's
    ``show /var/lib/infersight/infersight.otlp.jsonl`` would find nothing, and the log said not why."""
    import logging

    from infersight.agent.daemon import config as cfg
    from infersight.statefiles import refusal

    service = cfg.SERVICE_STATE_DIR
    if conf.sources.get("agent.state_dir", "default") != "default" or conf["agent.state_dir"] == service:
        return
    if not os.path.isdir(service):
        return
    why = refusal(service) or "not writable by uid %d" % os.geteuid()
    logging.getLogger("infersight.agent").warning(
        "state directory %s, not the service's %s (%s): run the agent as its service (systemctl start "
        "infersight), or set agent.state_dir", conf["agent.state_dir"], service, why)


async def serve(conf: Config, exporters: list[Exporter], extensions: list[Extension]) -> int:
    """Serve until SIGTERM/SIGINT (systemd socket activation: on the socket it passed)."""
    from infersight.agent.commands.extensions import new_agent

    listen = None
    try:
        from infersight.agent.daemon.socket_activation import listen_fds

        fds = listen_fds()
        listen = fds[0] if fds else None
    except ImportError:
        pass
    await new_agent(conf, exporters, extensions, listen_sock=listen).serve()
    return 0
