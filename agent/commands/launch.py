"""``infersight launch -- CMD``: run CMD with the hooks active, reporting to an agent.

``--agent auto`` (the default): when an agent answers on ``INFERSIGHT_SOCKET`` (or the
default socket) and accepts this uid, launch *joins* it: CMD's hooks report to that agent
(its sinks record them), and launch subscribes to its CMD's items on the agent's socket to
print the waterfall (:mod:`infersight.agent.daemon.sessions`, the joined side in
:mod:`infersight.agent.commands.launch_join`). ``--agent PATH`` joins the agent at PATH or
fails (exit 2, before CMD starts); ``--agent embedded`` never joins.

Otherwise, the embedded default: a private socket in a private directory, an OTLP JSON
file, the waterfall on the terminal, OTLP export only when an
``OTEL_EXPORTER_OTLP_*ENDPOINT`` is set. Exit status follows CMD (128+N on signal N,
127 when CMD is not found, 126 when it cannot be executed, 2 for launch's own usage or
config errors, such as an unwritable ``--otlp-file``, all before CMD starts).

This module is the cheap half, stdlib only: it checks the output path, evicts
``--evict`` files from the page cache, makes the private directory, listens on the
private socket and spawns CMD. Then it holds the agent side back while CMD starts
(:mod:`infersight.agent.commands.launch_hold`: until CMD is ready, reports an OOM, exits, or
starts workers, at most ``--agent-hold`` seconds; CMD's hooks spool meanwhile), and only then
imports it (:mod:`infersight.agent.commands.launch_session`: asyncio, the exporters, the OTel
protobufs). A hook that connects before the agent listens waits in the listen backlog; one
that gives up first spools to the private spool directory, which the agent replays.

How CMD is run:
- In its own process group, made the terminal's foreground group when launch has one,
  so that a Ctrl-C reaches CMD exactly once (from the terminal). Signals sent to launch
  itself are forwarded once: INT, TERM, HUP and QUIT to CMD's whole process group (the
  workers CMD started go with it, as on a terminal), USR1 and USR2 to CMD alone. A second
  INT or TERM sends SIGKILL to the group. Ctrl-Z stops CMD, then launch, so the shell's
  job control still works.
- With ``PR_SET_PDEATHSIG=SIGTERM``: if launch is killed with SIGKILL, CMD gets SIGTERM
  (only CMD: the kernel has no parent-death signal for a group).
- Its stderr goes through launch's relay (``agent/oom/stderr_relay.py``: a pipe, or a pty
  when launch's stderr is a terminal), which copies every byte through and hands serving
  engines' memory errors to the agent.
- The private directory holds a lock while launch lives. A later launch replays the
  spools that a killed launch left (or a daemonized grandchild that outlived it), and
  a launch that exits while a process it started still runs keeps the spool directory.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import time

from infersight.agent.cli import command_help
from infersight.agent.commands.engine_cmdline import engine_command
from infersight.agent.commands.launch_base import (
    AGENT_HOLD_S,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    ITEM_KINDS_ALL,
    ITEM_KINDS_CONSOLE,
    Child,
    Joined,
    LaunchOptions,
    Private,
    config_flags,
    fallback_distrust,
    joined_spool,
    log_events_for,
    printable_reply,
    temp_root,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any, TextIO

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1
IMPORT_NICE = 10
# why a hold ended while CMD's cold start may go on (launch_hold)
STILL_STARTING = ("workers", "spooling", "deadline", "engine")
UNCHECKED_ENV = frozenset({"OTEL_SERVICE_NAME", "INFERSIGHT_MEASURE_STORAGE"})  # no config key reads them
QUICK_EXIT_S = 0.05  # a CMD that exits this soon after its spawn may need no agent at all


def default_output_path(now: float | None = None) -> str:
    return "infersight-%s.otlp.jsonl" % time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


def check_writable(path: str) -> str | None:
    """Open the output file for appending now, as the file exporter will; the reason if not."""
    try:
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        os.close(fd)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def create_default_output(name: str) -> tuple[str, str | None]:
    """The default output file, made now in the working directory, exclusively and not through a link (a name
    taken, by a run of the same second or by another user who planted a link, a FIFO or a file of theirs there,
    gets a random suffix); the name and None, or ``name`` and the reason it could not be made."""
    from infersight.statefiles import create_own_file

    try:
        return create_own_file(name), None
    except OSError as exc:
        return name, exc.strerror or str(exc)


def fallback_output(name: str) -> tuple[str | None, list[str]]:
    """Where the default output file goes when the working directory cannot hold it (a container's
    read-only image directory): this user's state directory, else the temporary directory (made there
    0600, exclusively, never through a link: others can write /tmp). (None, reasons) when neither can:
    CMD then runs with the console waterfall alone: an unwritable default never keeps it from starting."""
    reasons: list[str] = []
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    private = os.path.join(state, "infersight")
    candidate = os.path.join(private, name)
    try:
        os.makedirs(private, mode=0o700, exist_ok=True)
        os.close(os.open(candidate, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600))
        return candidate, reasons
    except OSError as exc:
        reasons.append("%s: %s" % (private, exc.strerror or exc))
    from infersight.statefiles import create_own_file

    temp = temp_root()
    try:
        return create_own_file(os.path.join(temp, name), 0o600), reasons
    except OSError as exc:
        reasons.append("%s: %s" % (temp, exc.strerror or exc))
    return None, reasons


def bootstrap_dir() -> str:
    """The hooks' bootstrap directory, found without importing the hooks (~15 ms)."""
    import importlib.util

    spec = importlib.util.find_spec("infersight.hooks")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("infersight.hooks is not installed")
    return os.path.join(next(iter(spec.submodule_search_locations)), "bootstrap")


def child_env(
    base: dict[str, str], sock: str, spool: str | None, spawn_ns: int, ready_file: str | None = None,
    boot: str | None = None, session: str | None = None,
) -> dict[str, str]:
    """CMD's environment: the hooks' bootstrap, the agent's socket; the private spool when
    embedded (``spool``); a joined agent's session token (``session``), the hooks then
    spooling where the agent replays (their own ``INFERSIGHT_SPOOL_DIR`` or default)."""
    env = dict(base)
    # The URL is the authority: with the file, the hooks' listening heuristics default to off (_env.ready_on_listen)
    if ready_file:
        env["INFERSIGHT_READY_FILE"] = ready_file
    else:  # a launch inside an outer --ready-url run's CMD: the outer run's file (and its default) is not this CMD's
        env.pop("INFERSIGHT_READY_FILE", None)
    env["INFERSIGHT_SOCKET"] = sock
    if spool is not None:
        env["INFERSIGHT_SPOOL_DIR"] = spool
    if session is not None:
        env["INFERSIGHT_LAUNCH_SESSION"] = session
        env.pop("INFERSIGHT_LAUNCH_EMBEDDED", None)
    else:  # launch's own agent: CMD's whole tree keeps other processes' leftovers out of its output
        env.pop("INFERSIGHT_LAUNCH_SESSION", None)
        env["INFERSIGHT_LAUNCH_EMBEDDED"] = "1"
    env["INFERSIGHT_LAUNCH_SPAWN_NS"] = str(spawn_ns)
    env.pop("INFERSIGHT", None)
    boot = boot or bootstrap_dir()
    env["PYTHONPATH"] = boot + (os.pathsep + base["PYTHONPATH"] if base.get("PYTHONPATH") else "")
    return env


LAUNCH_HOOKS_PACKAGE = "_infersight_launch_hooks"


def hooks_module(name: str) -> Any:
    """A stdlib-only module of the hooks (``_paths``, ``_wire``, ``_env``) without importing
    the hooks package, whose ``__init__`` costs ~20 ms that launch does not pay before CMD
    starts. They load as submodules of a bare stand-in package over the hooks' folder, so
    their relative imports of each other work and ``__init__`` never runs."""
    mod = sys.modules.get("infersight.hooks." + name)
    if mod is not None:
        return mod
    if LAUNCH_HOOKS_PACKAGE not in sys.modules:
        pkg = type(sys)(LAUNCH_HOOKS_PACKAGE)
        pkg.__path__ = [os.path.dirname(bootstrap_dir())]
        pkg.__package__ = LAUNCH_HOOKS_PACKAGE
        sys.modules[LAUNCH_HOOKS_PACKAGE] = pkg
    import importlib

    return importlib.import_module(LAUNCH_HOOKS_PACKAGE + "." + name)


def bare_hooks_package() -> None:
    """``infersight.hooks`` as a bare package in launch's own process, its ``__init__`` not run:
    the agent side uses only the package's stdlib-only submodules (``_contract``, ``_wire``,
    ``_paths``, ``_listening``...), and the ``__init__`` is the served process's runtime (its
    client, recorder, sampler and readiness state: 5-15 ms of CPU) that launch never runs. A
    process that imported the hooks already keeps them."""
    if "infersight.hooks" in sys.modules:
        return
    import importlib.util

    spec = importlib.util.find_spec("infersight.hooks")
    if spec is None or spec.loader is None:
        return
    pkg = importlib.util.module_from_spec(spec)  # __path__ and __spec__ set; nothing executed
    sys.modules["infersight.hooks"] = pkg
    setattr(sys.modules["infersight"], "hooks", pkg)  # noqa: B010


JOIN_TIMEOUT_S = 3.0  # an agent that takes longer to answer is not joined (auto: embedded instead)
AGENT_WAIT_S = 30.0  # for a named socket that no agent answers yet (see choose_agent)
AGENT_POLL_S = 0.2


def _recv_exact(s: Any, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the agent closed the connection")
        buf += chunk
    return buf


def subscribe(s: Any, session: str, kinds: list[str]) -> dict[str, Any]:
    """Send the subscription on a connected socket; the agent's reply (``subscribed`` or ``refuse``)."""
    import json

    wire = hooks_module("_wire")
    try:
        s.sendall(wire.subscribe_frame(session, list(kinds), relay=True, log_events=log_events_for(kinds),
                                       relay_pending=True))  # "relaying" once launch's loop runs (launch_join)
    except (BrokenPipeError, ConnectionResetError):
        pass  # an agent that refuses this uid answers and closes before reading: read its answer
    (n,) = wire.HEADER.unpack(_recv_exact(s, wire.HEADER.size))
    if n > wire.MAX_FRAME_BYTES:
        raise ValueError("oversized reply")
    reply = json.loads(_recv_exact(s, n))
    if not isinstance(reply, dict):
        raise ValueError("malformed reply")
    return reply


def announce_cmd(joined: Joined, pid: int) -> None:
    """Name CMD to the joined agent right after its spawn (a ``cmd`` frame, docs/wire.md), while the kernel
    still shows it as launch's child: a CMD that prints its memory error and exits at once, reaped before
    launch's heavy part has started, still has its pid on the capture's stand-in producer."""
    frame = hooks_module("_wire").encode_frame({"t": "cmd", "pid": pid})
    try:
        os.write(joined.fd, frame)  # a few bytes on a fresh subscription: into the socket's buffer
    except OSError:
        pass  # the agent went away: launch re-subscribes later and names CMD again


class JoinFailure(str):
    """Why launch did not join: the text, and whether no agent listens there yet (no socket file, or one
    nobody listens on: a sidecar starting, an agent restarting), the only case worth waiting for; a
    socket this user may not connect to, or an agent too busy to answer, does not change by waiting."""

    not_there: bool

    def __new__(cls, text: str, not_there: bool) -> JoinFailure:
        out = super().__new__(cls, text)
        out.not_there = not_there
        return out


def join_agent(path: str, kinds: list[str], timeout_s: float = JOIN_TIMEOUT_S) -> Joined | str:
    """Subscribe to the agent listening at ``path``: the :class:`Joined`, or why not."""
    import _socket

    session = os.urandom(16).hex()
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        s.settimeout(timeout_s)
        s.connect(path)
        distrust = fallback_distrust(path, s.fileno(), hooks_module("_paths"))
        if distrust:  # another user's agent at this user's fallback: it gets nothing of CMD's
            s.close()
            return JoinFailure(distrust, False)
        reply = subscribe(s, session, kinds)
    except (OSError, ValueError) as exc:
        s.close()
        if isinstance(exc, PermissionError):  # the socket, or its directory, is closed to this user: say which group
            why = hooks_module("_connection").connect_failure(path, exc)
            if why:
                return JoinFailure(why, False)
        return JoinFailure("no agent answers at %s (%s)" % (path, getattr(exc, "strerror", None) or exc),
                           isinstance(exc, (ConnectionRefusedError, FileNotFoundError)))
    if reply.get("t") != "subscribed":
        s.close()
        return "the agent at %s does not take this launch: %s" % (path, reply.get("error") or reply.get("t"))
    s.settimeout(None)
    return Joined(path, int(s.detach()), session, printable_reply(reply))


# execve's errors that say CMD cannot be executed (126, as a shell says): not a binary or script this machine
# runs, a loop of links, arguments too long, a path through a file, a binary being written.
EXEC_ERRORS = frozenset({errno.ENOEXEC, errno.ELOOP, errno.E2BIG, errno.ENAMETOOLONG, errno.ENOTDIR, errno.ETXTBSY,
                         errno.EISDIR})


def _searchable(path: str) -> bool:
    """Whether this user may look into the socket's directory (``/run/infersight`` is 0750, group infersight)."""
    return os.access(os.path.dirname(path) or ".", os.X_OK)


def choose_agent(opts: LaunchOptions, kinds: list[str], err: TextIO) -> Joined | int | None:
    """``--agent``: the agent to join, None to embed one, or EXIT_USAGE (said on ``err``)."""
    if opts.agent == "embedded":
        return None
    # A named socket (INFERSIGHT_SOCKET, or --agent PATH) is waited for, AGENT_WAIT_S unless --agent-wait says:
    # a sidecar starting beside CMD, as on a cluster without native sidecars. The default one is not: a
    # workstation without an agent starts at once.
    named = opts.agent != "auto" or bool(os.environ.get("INFERSIGHT_SOCKET"))
    path = hooks_module("_paths").socket_path() if opts.agent == "auto" else os.path.abspath(opts.agent)
    wait_s = opts.agent_wait_s if opts.agent_wait_s is not None else (AGENT_WAIT_S if named else 0.0)
    if opts.agent == "auto" and not named and not os.path.exists(os.path.dirname(path)):
        return None  # the common workstation case: no agent, no wait, nothing to say
    # (a socket directory without its socket, /run/infersight on a host whose service is stopped: said below)
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        # (a directory this user may not search hides the socket from os.path.exists: connecting says so)
        joined: Joined | str = (join_agent(path, kinds) if os.path.exists(path) or not _searchable(path)
                                else JoinFailure("no agent listens at %s (no socket)" % path, True))
        # Only an agent that is not there (yet) is waited for: one that refuses this launch, a socket this user
        # may not connect to, or an agent too busy to answer will not change by waiting.
        if isinstance(joined, Joined) or not getattr(joined, "not_there", False) or time.monotonic() >= deadline:
            break
        if not said:
            err.write("infersight: waiting up to %g s for the agent at %s\n" % (wait_s, path))
            err.flush()
            said = True
        time.sleep(AGENT_POLL_S)
    if isinstance(joined, Joined):
        return joined
    if opts.agent != "auto":
        err.write("infersight launch: --agent %s: %s\n" % (path, joined))
        return EXIT_USAGE
    err.write("infersight: %s%s; running an embedded agent: this run's telemetry goes to its own file, not to "
              "that agent\n" % (joined, " after %g s" % wait_s if said else ""))
    return None


def config_error(opts: LaunchOptions, path: str | None, private: Private) -> str | None:
    """Check the configuration before CMD starts, when the environment has any (~30 ms that
    a launch without INFERSIGHT_*/OTEL_* settings does not pay: its defaults are valid).
    ``path`` is None when launch joined an agent: CMD's hooks are still checked, the
    exporters are that agent's."""
    if not any(k.startswith(("INFERSIGHT_", "OTEL_")) and k not in UNCHECKED_ENV for k in os.environ):
        return None
    from infersight.hooks import _env

    # What CMD's hooks would read, by the hooks' own parser (the switch INFERSIGHT is not CMD's:
    # the CLI drops it at its start, and CMD is always hooked). An INFERSIGHT_* name that nothing
    # of infersight reads is a typo, refused as a bad value is, with the name it likely means.
    bad = _env.problems({k: v for k, v in os.environ.items() if k != "INFERSIGHT"})
    bad += [_env.unknown_message(name, suggestion) for name, suggestion in _env.unknown(os.environ)]
    if bad:
        return "; ".join(bad)
    if path is None:
        return None
    from infersight.agent.commands.compose import check_exporter_settings
    from infersight.agent.daemon import config as cfg
    from infersight.settings import ConfigError

    try:
        check_exporter_settings(cfg.load(None, flags=config_flags(opts, path, private)), embedded=True)
    except ConfigError as exc:
        return str(exc)
    return None


def controlling_tty() -> tuple[int | None, bool]:
    """(a fd on launch's controlling terminal or None, whether launch is its foreground group)."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return fd, os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:  # a terminal, but not our controlling one
            continue
    return None, False


def _pdeathsig_setter() -> Callable[[], None] | None:
    """prctl(PR_SET_PDEATHSIG, SIGTERM), resolved before the fork; None where unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None

    def set_pdeathsig() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)

    return set_pdeathsig


def _preexec(parent: int, tty: int | None, pdeathsig: Callable[[], None] | None) -> Callable[[], None]:
    """In CMD before exec: its own group; the terminal, if launch is its foreground (tty set)."""

    def run_in_child() -> None:
        os.setpgid(0, 0)
        if tty is not None:
            # We are a background group until this call: ignore SIGTTOU for it, as shells do.
            old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
            try:
                os.tcsetpgrp(tty, os.getpid())
            except OSError:
                pass
            signal.signal(signal.SIGTTOU, old)
        if pdeathsig is not None:
            pdeathsig()
            if os.getppid() != parent:  # launch died before prctl: do as if it had been set
                os._exit(128 + int(signal.SIGTERM))

    return run_in_child


def spawn(cmd: list[str], env: dict[str, str]) -> Child:
    """Start CMD in its own process group (the terminal's foreground one), with a parent-death signal."""
    import subprocess

    from infersight.agent.oom.stderr_relay import open_relay

    tty, foreground = controlling_tty()
    preexec = _preexec(os.getpid(), tty if foreground else None, _pdeathsig_setter())
    relay = open_relay()  # CMD's stderr, copied through; its memory errors go to the agent
    # preexec_fn is safe here: launch has started no thread yet.
    try:
        popen = subprocess.Popen(cmd, env=env, preexec_fn=preexec,  # noqa: PLW1509
                                 stderr=relay.child_fd if relay is not None else None)
    except BaseException:
        if relay is not None:
            os.close(relay.child_fd)
            os.close(relay.read_fd)
        raise
    child = Child(popen, tty)
    if relay is not None:
        relay.started()
        child.relay = relay
        if relay.tty:
            signal.signal(signal.SIGWINCH, lambda _signum, _frame: relay.resize())
    # From here on, signals to launch go to CMD once; launch may write to the terminal
    # while CMD holds it (TOSTOP) and give it back at the end.
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: child.forward(signum))
    if tty is not None:
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        signal.signal(signal.SIGCONT, lambda _signum, _frame: child.resume())
    return child


def exited_within(child: Child, timeout_s: float | None, other_fd: int = -1) -> bool:
    """Whether CMD exits within ``timeout_s`` (None: no limit), and before ``other_fd`` is
    readable (its exit time noted; not reaped). False where pidfd_open is missing (Linux < 5.3):
    launch then takes the agent's path."""
    pidfd_open = getattr(os, "pidfd_open", None)
    try:
        pidfd = pidfd_open(child.pid) if pidfd_open is not None else -1
    except OSError:  # an old kernel, or CMD was reaped already
        return False
    if pidfd < 0:
        return False
    import select

    try:
        ready, _, _ = select.select([pidfd, *([other_fd] if other_fd >= 0 else [])], [], [], timeout_s)
    finally:
        os.close(pidfd)
    if pidfd not in ready or other_fd in ready:
        return False
    child.exit_ns = time.time_ns()
    return True


class AgentSide:
    """Imports the agent side on a thread at low CPU priority, so that on a busy host it does
    not compete with CMD's own start. Only that thread is niced (Linux priorities are per
    thread), and it ends with the import: the agent itself runs at launch's priority."""

    def __init__(self, module_name: str = "launch_session", nice: bool = True) -> None:
        import threading

        bare_hooks_package()  # here, on the main thread: before any import of the agent side
        self.module_name = module_name
        self.nice = nice
        self.box: dict[str, Any] = {}
        self.done_r, self.done_w = os.pipe()  # written when the import ends: select()able
        self.thread = threading.Thread(target=self._load, name="infersight-import", daemon=True)
        self.thread.start()

    def _load(self) -> None:
        import threading

        try:
            if self.nice:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IMPORT_NICE)
        except (OSError, AttributeError):
            pass
        try:
            import importlib

            self.box["module"] = importlib.import_module("infersight.agent.commands." + self.module_name)
        except BaseException as exc:  # re-raised on the main thread
            self.box["error"] = exc
        finally:
            os.write(self.done_w, b"x")

    def wait_or_exit(self, child: Child) -> bool:
        """Wait until the import ends or CMD exits, whichever comes first; True if CMD exited
        first (its exit time noted)."""
        return exited_within(child, None, self.done_r)

    def module(self) -> Any:
        self.thread.join()
        for fd in (self.done_r, self.done_w):
            os.close(fd)
        if "error" in self.box:
            raise self.box["error"]
        return self.box["module"]


def _quick_end(opts: LaunchOptions, path: str, private: Private, listen_fd: int, child: Child, spawn_ns: int,
               err: TextIO) -> int | None:
    """CMD exited: write what launch saw and exit, when nothing is left for an agent (None otherwise)."""
    bare_hooks_package()
    from infersight.agent.commands import launch_quick

    if not launch_quick.eligible(opts, private, listen_fd, child):
        return None
    return launch_quick.run(opts, path, private, child, spawn_ns, err)


def _hold_s(opts: LaunchOptions, err: TextIO) -> float:
    """How long launch holds its embedded agent back while CMD starts (``launch_hold``); 0 where
    launch's agent has work during the cold start (``--ready-url``/``--probe`` poll CMD; a serving
    engine, whose memory errors come while it starts) or the hold is off."""
    if opts.ready_url or opts.probe:
        return 0.0
    hold_s = opts.hold_s
    if hold_s is None:  # the default: a terminal shows the agent's live "warming:" line, so no hold there
        hold_s = 0.0 if opts.console and _isatty(err) else AGENT_HOLD_S
        if engine_command(opts.cmd) is not None:  # ~0.2 s of CPU against a cold start of tens of seconds
            hold_s = 0.0
    return max(hold_s, 0.0)


def _hold_mark(private: Private) -> str:
    """``launch_hold.mark_path``, without importing the agent side before CMD starts."""
    return os.path.join(private.path, hooks_module("_wire").AGENT_HELD_MARK)


def _mark_hold(private: Private) -> bool:
    """The hold's mark, down before CMD starts (``launch_hold.hold`` writes it again): a hook that
    looked for it before it was there connected, and waited for a welcome that the held agent never
    sends; CMD's exit then waited out the hooks' flush (2 s). False where there is no hold to mark."""
    if not hasattr(os, "pidfd_open"):
        return False  # no hold (``launch_hold``: "no pidfd")
    try:
        with open(_hold_mark(private), "w", encoding="ascii") as f:
            f.write(str(os.getpid()))
    except OSError:
        return False
    return True


def _clear_hold_mark(private: Private) -> None:
    try:
        os.unlink(_hold_mark(private))
    except OSError:
        pass


def _hold(opts: LaunchOptions, child: Child, listen_fd: int, spawn_ns: int, private: Private, hold_s: float) -> Any:
    """Hold the embedded agent back while CMD starts (``launch_hold``) for at most ``hold_s``
    (``_hold_s``); None where it is 0."""
    if hold_s <= 0:
        return None
    bare_hooks_package()
    from infersight.agent.commands import launch_hold

    return launch_hold.hold(child, listen_fd, spawn_ns, private.path, hold_s)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def check_stage_rules(dirs: Sequence[str]) -> str | None:
    """The stage rules the child's hooks will read, ``dirs`` included: None when valid, else
    one ``file:line: problem`` line each."""
    for d in dirs:
        if not os.path.isdir(d):
            return "%s: not a directory" % d
    from infersight.agent.coldstart.stage_rules_check import check_dirs
    from infersight.rules.stage_rules import StageRuleFileError

    try:
        check_dirs(dirs)
    except StageRuleFileError as exc:
        return str(exc)
    return None


def launch(opts: LaunchOptions, out: TextIO | None = None) -> int:
    err = out or sys.stderr
    cmd = list(opts.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        err.write("infersight launch: missing command: infersight launch -- CMD...\n")
        return EXIT_USAGE
    opts.cmd = cmd
    joined = choose_agent(opts, ITEM_KINDS_ALL if opts.otlp_file else ITEM_KINDS_CONSOLE, err)
    if isinstance(joined, int):
        return joined
    try:
        return _launch(opts, cmd, joined, err)
    finally:
        if joined is not None:
            try:
                os.close(joined.fd)
            except OSError:
                pass  # the joined session took it over and closed it


def _launch(opts: LaunchOptions, cmd: list[str], joined: Joined | None, err: TextIO) -> int:
    # Joined: the agent's sinks record; a local file only when asked for (--otlp-file).
    path = opts.otlp_file or (None if joined is not None else default_output_path())
    if path is not None and not opts.otlp_file:  # the default: a new file of this run's, whatever others planted
        path, reason = create_default_output(path)
    else:
        reason = check_writable(path) if path is not None else None
    if reason is not None and opts.otlp_file:
        err.write("infersight launch: cannot write the output file %s: %s\n" % (path, reason))
        return EXIT_USAGE
    if reason is not None and path is not None:  # the default, in a working directory it cannot write
        elsewhere, tried = fallback_output(os.path.basename(path))
        err.write("infersight: cannot write %s in the working directory (%s); %s\n" % (
            os.path.basename(path), reason, "writing the cold start to %s" % elsewhere if elsewhere else
            "no OTLP file this run (%s): the waterfall is printed below" % "; ".join(tried)))
        path = elsewhere or ""  # "": none to keep; the embedded agent writes into launch's private directory
    if opts.evict:
        from infersight.agent.commands import pagecache

        try:
            evicted = pagecache.evict(opts.evict)
        except OSError as exc:
            err.write("infersight launch: --evict: %s\n" % exc)
            return EXIT_USAGE
        for line in pagecache.describe(evicted):
            err.write("infersight: %s\n" % line)
        err.flush()
    if opts.rules_dirs:
        bad_rules = check_stage_rules(opts.rules_dirs)
        if bad_rules is not None:
            err.write("infersight launch: --rules-dir: invalid stage rules:\n%s\n" % bad_rules)
            return EXIT_USAGE
    try:
        private = Private(command=list(cmd))
    except OSError as exc:
        err.write("infersight launch: cannot make a private directory in %s: %s\n" % (temp_root(), exc))
        return EXIT_USAGE
    if path == "":
        path = os.path.join(private.path, default_output_path())  # removed with the directory at the end
    child: Child | None = None
    marked = False
    try:
        listen_fd = -1
        if joined is None:
            try:  # first: the configuration check refuses a socket path that is too long, less clearly
                listen_fd = private.listen()
            except OSError as exc:  # AF_UNIX paths are limited to 107 bytes: a long $TMPDIR
                err.write("infersight launch: cannot listen on %s: %s\n" % (private.sock, exc))
                return EXIT_USAGE
        bad = config_error(opts, path if joined is None else None, private)
        if bad is not None:
            if listen_fd >= 0:
                os.close(listen_fd)
            err.write("infersight launch: %s\n" % bad)
            return EXIT_USAGE
        hold_s = _hold_s(opts, err) if joined is None else 0.0
        marked = hold_s > 0 and _mark_hold(private)
        ready_file = os.path.join(private.path, "ready") if opts.ready_url else None
        spawn_ns = time.time_ns()
        if joined is None:
            env = child_env(dict(os.environ), private.sock, private.spool, spawn_ns, ready_file)
        else:
            spool = joined_spool(joined, hooks_module("_paths"))
            env = child_env(dict(os.environ), joined.path, spool, spawn_ns, ready_file, session=joined.session)
        if opts.rules_dirs:
            from infersight.rules.stage_rules import rules_dirs

            env["INFERSIGHT_RULES_DIRS"] = ":".join(str(d) for d in rules_dirs(opts.rules_dirs))
        try:
            child = spawn(cmd, env)
        except FileNotFoundError:
            err.write("infersight: command not found: %s\n" % cmd[0])
            return EXIT_NOT_FOUND
        except PermissionError:
            err.write("infersight: permission denied: %s\n" % cmd[0])
            return EXIT_NOT_EXECUTABLE
        except OSError as exc:
            if exc.errno not in EXEC_ERRORS:  # the spawn itself failed (EMFILE, EAGAIN, ENOMEM): not CMD's fault
                err.write("infersight launch: cannot start %s: %s\n" % (cmd[0], exc.strerror or exc))
                return EXIT_USAGE
            err.write("infersight: cannot execute %s: %s%s\n" % (
                cmd[0], exc.strerror or exc,
                " (a script needs a #! line, or run it as: infersight launch -- sh %s)" % cmd[0]
                if exc.errno == errno.ENOEXEC else ""))
            return EXIT_NOT_EXECUTABLE
        if joined is not None:  # CMD runs and reports to the joined agent: now the heavy part
            announce_cmd(joined, child.pid)
            joined_rc: int = AgentSide("launch_join").module().run(opts, path, private, joined, child, spawn_ns, err)
            return _ended(joined_rc, child, joined, path, err)
        assert path is not None
        # A CMD that is done at once (``true``, a failed exec) leaves nothing for an agent: a
        # short grace before the heavy import, so that it need not compete with the quick end.
        if exited_within(child, QUICK_EXIT_S):
            quick = _quick_end(opts, path, private, listen_fd, child, spawn_ns, err)
            if quick is not None:
                return _ended(quick, child, None, path, err)
        held = _hold(opts, child, listen_fd, spawn_ns, private, hold_s) if child.exit_ns == 0 else None
        if marked and held is None:
            _clear_hold_mark(private)  # CMD exited at once: no hold, what it left goes to the agent now
        if held is not None and held.why == "exited" and not held.connections:
            quick = _quick_end(opts, path, private, listen_fd, child, spawn_ns, err)
            if quick is not None:
                return _ended(quick, child, None, path, err)
        # CMD runs (or is done): now the heavy part; at low priority while CMD may still start
        agent_side = AgentSide(nice=held is None or held.why in STILL_STARTING)
        if child.exit_ns == 0 and agent_side.wait_or_exit(child) and not (held is not None and held.connections):
            quick = _quick_end(opts, path, private, listen_fd, child, spawn_ns, err)
            if quick is not None:
                opts.import_abandoned = True  # the agent side is still being imported: not needed
                return _ended(quick, child, None, path, err)
        launch_session = agent_side.module()
        rc: int = launch_session.run(opts, path, private, listen_fd, child, spawn_ns, err, held)
        return _ended(rc, child, None, path, err)
    finally:
        if child is not None:
            child.restore_tty()
        if marked:
            _clear_hold_mark(private)
        if os.path.isdir(private.path) and not os.path.exists(os.path.join(private.path, "spool")):
            import shutil

            shutil.rmtree(private.path, ignore_errors=True)
        private.release()


def end_lines(returncode: int | None, joined: Joined | None, path: str | None) -> list[str]:
    """The summary's last lines: how CMD failed (not when it succeeded), and, joined without a local
    copy, where this run's events went instead of the file that the embedded default writes."""
    lines = []
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "signal %d" % -returncode
        lines.append("CMD was killed by %s (exit status %d)" % (name, 128 - returncode))
    elif returncode:
        lines.append("CMD exited with status %d" % returncode)
    if joined is not None and not path:
        sinks = ", ".join(joined.info.get("sinks") or []) or "none"
        lines.append("no local file written; events went to the agent at %s (its sinks: %s; --otlp-file PATH "
                     "writes a local copy too)" % (joined.path, sinks))
    return ["infersight: " + line for line in lines]


def _ended(rc: int, child: Child, joined: Joined | None, path: str | None, err: TextIO) -> int:
    """``rc``, once the summary's last lines (:func:`end_lines`) are written."""
    for line in end_lines(child.returncode, joined, path):
        err.write(line + "\n")
    err.flush()
    return rc


def add_parser(sub: Any, help_line: str | None = None) -> argparse.ArgumentParser:
    lp: argparse.ArgumentParser = sub.add_parser("launch", help=help_line or command_help("launch"))
    lp.add_argument("--otlp-file", metavar="PATH", help="output file (default: infersight-<time>.otlp.jsonl)")
    lp.add_argument("--ready-url", metavar="URL", type=_http_url,
                    help="poll URL (http:// or https://; 2xx/3xx) as the readiness probe; ends ready_wait there")
    lp.add_argument("--probe", metavar="URL", type=_http_url,
                    help="after readiness, GET URL (http:// or https://) once and record the time to its first byte")
    lp.add_argument("--evict", metavar="PATH", nargs="+", action="extend",
                    help="drop these files (directories recursively) from the page cache before CMD "
                         "starts, for a truly cold start without root")
    lp.add_argument("--agent", default="auto", metavar="auto|embedded|PATH",
                    help="auto (default): join the agent on INFERSIGHT_SOCKET or the default socket when "
                         "one answers and accepts this uid, else embed one; embedded: always embed; "
                         "PATH: join the agent at PATH or fail")
    lp.add_argument("--agent-wait", metavar="SECONDS", type=_seconds, default=None,
                    help="wait up to this long for an agent that is not up yet (a sidecar starting beside CMD) "
                         "before embedding one (auto) or failing (PATH); default %g when INFERSIGHT_SOCKET or "
                         "--agent PATH names the socket, else 0" % AGENT_WAIT_S)
    lp.add_argument("--rules-dir", metavar="DIR", action="append", default=[],
                    help="also read stage rules (*.toml with [[stage]] tables) from DIR, after the shipped "
                         "rules and $INFERSIGHT_RULES_DIRS (default /etc/infersight/rules.d); repeatable")
    lp.add_argument("--agent-hold", metavar="SECONDS", type=_seconds, default=None,
                    help="embedded agent: start it only once CMD is ready, reports an OOM or exits, or at "
                         "most this long after CMD starts, so that it does not compete with CMD's cold "
                         "start (default 20, or 0 when the console shows the live 'warming:' line on a "
                         "terminal; 0: start it at once)")
    lp.add_argument("--console", action=argparse.BooleanOptionalAction, default=True,
                    help="print the cold-start waterfall (default: on)")
    lp.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")
    lp.set_defaults(func=run)
    return lp


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError("expected a number of seconds >= 0, got %r" % text)
    return v


def _http_url(text: str) -> str:
    """An http:// or https:// URL with a host (what ``launch_session.http_get`` can request)."""
    import urllib.parse

    try:
        u = urllib.parse.urlsplit(text)
        # .port raises ValueError on a port that is not a number in 0-65535
        ok = u.scheme in ("http", "https") and bool(u.hostname) and (u.port is None or u.port >= 0)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError("expected an http:// or https:// URL with a host, got %r" % text)
    return text


def run(args: argparse.Namespace) -> int:
    opts = LaunchOptions(args.cmd, otlp_file=args.otlp_file, console=args.console,
                         ready_url=args.ready_url, probe=args.probe, evict=args.evict or (),
                         agent=args.agent, rules_dirs=args.rules_dir or ())
    if args.agent_hold is not None:
        opts.hold_s = args.agent_hold
    opts.agent_wait_s = args.agent_wait
    rc = launch(opts)
    if opts.import_abandoned:
        # Everything is written and launch's directory is gone: exit now, not after an
        # import nobody needs (nor in the middle of it, at interpreter shutdown).
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(rc)
    return rc
