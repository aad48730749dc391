"""``infersight status``: ask a running agent for its health over its socket."""

from __future__ import annotations

import argparse
from typing import Any

from infersight.agent.cli import command_help


def add_parser(sub: Any, help_line: str | None = None) -> argparse.ArgumentParser:
    sp: argparse.ArgumentParser = sub.add_parser("status", help=help_line or command_help("status"))
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--socket", metavar="PATH")
    sp.add_argument("--alive", action="store_true",
                    help="exit 0 when the agent answers, healthy or not (a liveness probe: restarting the "
                    "agent does not bring a collector back)")
    sp.set_defaults(func=run)
    return sp


def query_status(path: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """Ask a running agent for its health over its socket."""
    import socket

    from infersight.agent.commands.launch_base import fallback_distrust, printable_reply
    from infersight.hooks import _paths, _wire

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        distrust = fallback_distrust(path, s.fileno(), _paths)
        if distrust:  # another user's process at this user's fallback socket: its health is no agent's
            raise OSError(distrust)
        s.sendall(_wire.STATUS_FRAME)
        buf = b""
        while True:
            frames, buf, bad = _wire.split_frames(buf)
            if bad:
                raise OSError("agent sent an oversized frame")
            if frames:
                msg = _wire.decode_payload(frames[0])
                if msg is None:
                    raise OSError("agent sent a malformed frame")
                return dict(printable_reply(msg))
            chunk = s.recv(65536)
            if not chunk:
                raise OSError("agent closed the connection")
            buf += chunk


def run(args: argparse.Namespace) -> int:
    import json

    from infersight.hooks import _paths

    path = args.socket or _paths.socket_path()
    try:
        h = query_status(path)
    except OSError as exc:
        why = str(exc)
        if isinstance(exc, TimeoutError):  # connected, no answer: a socket held with no agent behind it
            why = ("timed out: the socket accepts but no agent answers (a hung or busy agent, or a stopped one "
                   "whose socket is held for it: under systemd the socket unit holds it while infersight.service "
                   "is stopped or starting, see systemctl status infersight.service)")
        if args.json:
            print(json.dumps({"healthy": False, "socket": path, "error": why}))
        else:
            print("infersight agent: not reachable at %s (%s)" % (path, why))
        return 1
    if h.get("t") == "refuse":
        print("infersight agent refused the status query: %s" % h.get("error"))
        return 1
    h.pop("t", None)
    stale = running_code_warning(h)
    if stale:  # a warning like the agent's own: said, and the exit status stays the health's
        h["warnings"] = [*(h.get("warnings") or []), stale]
    if args.json:
        print(json.dumps(h, sort_keys=True))
    else:
        print(describe(h))
    return 0 if h.get("healthy") or getattr(args, "alive", False) else 1


def running_code_warning(h: dict[str, Any]) -> str | None:
    """When the agent that answered shares this CLI's install and loaded other files than it holds now (a
    ``pip install`` since it started, which replaced the code but not the running process): the restart it needs."""
    from infersight.agent.daemon.health import code_predates, code_print

    return code_predates(h.get("code"), code_print())


def describe(h: dict[str, Any]) -> str:
    """The text form: the verdict, each problem (exporter and reason), warnings, the sinks."""
    lines = ["infersight agent %s (%s, pid %s): %s" % (
        h.get("version"), h.get("mode"), h.get("pid"), "healthy" if h.get("healthy") else "UNHEALTHY")]
    for p in h.get("problems") or []:
        who = "exporter %s" % p.get("exporter") if p.get("exporter") else "agent"
        lines.append("  PROBLEM %s: %s" % (who, p.get("reason")))
    lines += ["  WARNING %s" % w for w in h.get("warnings") or []]
    keys = ("uptime_s", "socket", "producers", "events_in", "items_out", "lost", "dropped_by_producers")
    shown = dict(h)
    if h.get("producers_connected") is not None:  # the table keeps producers that left: say how many are here
        shown["producers"] = "%s (%s connected)" % (h.get("producers"), h["producers_connected"])
    shown["lost"] = lost_text(h)
    lines += ["  %-22s %s" % (k, shown.get(k)) for k in keys]
    sinks = h.get("sinks")
    lines.append("  %-22s %s" % ("sinks", ", ".join(sinks) if sinks else "none"))
    nv = h.get("nvml")
    if isinstance(nv, dict):
        hung = " (for %s s)" % nv["hung_s"] if nv.get("hung_s") is not None else ""
        lines.append("  %-22s %s" % ("nvml", "driver %s, %s device(s)" % (nv.get("driver_version"), nv.get("devices"))
                                     if nv.get("available") else "not available%s: %s" % (hung, nv.get("reason"))))
        # The devices' own state (the agent's health is its pipeline's: these do not make it unhealthy).
        for key, label in (("failed_devices", "devices FAILED (lost)"), ("slow_devices", "devices slow"),
                           ("degraded_devices", "devices degraded (ECC)")):
            named = nv.get(key)
            if isinstance(named, list) and named:
                lines.append("  %-22s %s" % (label, ", ".join(str(d) for d in named)))
    oom = h.get("oom")
    if isinstance(oom, dict) and oom.get("classified") is not None:
        lines.append("  %-22s %s classified" % ("ooms", oom.get("classified")))
    lines += ["  exporter %-12s peer_up=%s exported=%s errors=%s retries=%s queued=%s spooled=%s dropped=%s" % (
        e.get("name"), e.get("peer_up"), e.get("exported_items"), e.get("export_errors"), e.get("retries"),
        e.get("queue_depth"), e.get("spooled_items_pending"), e.get("dropped_items"))
        for e in h.get("exporters") or []]
    return "\n".join(lines)


def lost_text(h: dict[str, Any]) -> str:
    """The ``lost`` line: events missing from producers' sequence numbers (they never reached the agent)
    and, beside them, items that reached it and no sink because an exporter could not hold them (a full
    disk, a full spool), with the exporters that lost some. Side by side, not added up: events are not
    items, and an item that every exporter lost counts once for each. An older agent's reply has no
    exporter figure: the first one alone."""
    line = "%s event(s) in producers' sequence gaps" % h.get("lost")
    at_exporters = h.get("lost_at_exporters")
    if at_exporters is None:
        return line
    named = ["%s %s" % (e.get("name"), e["lost_items"]) for e in h.get("exporters") or [] if e.get("lost_items")]
    return "%s; %s item(s) exporters could neither deliver nor keep%s" % (
        line, at_exporters, " (%s)" % ", ".join(named) if named else "")
