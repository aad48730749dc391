"""Shared fixtures: a real agent process, hook environments, free ports; each test's kind marker.

Tests live by kind: ``unit/`` (pure, in-process), ``integration/`` (a real peer: mosquitto, an
OTLP receiver, promtool, Prometheus, HAProxy, a socket, the agent in-process) and ``e2e/``
(spawned processes: the agent, launch, hooked workloads, real stacks, Chromium). The folder
sets the marker (``pytest -m unit``); helper modules and data are in ``support/``, on the
import path (pyproject's ``pythonpath``). This is the only conftest.py: tests import its
helpers as ``from conftest import ...``, which a second one would shadow.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ports import free_port  # noqa: F401 - tests import it from here too
from short_tmp import remove_short_tmpdirs

REPO = Path(__file__).resolve().parent.parent

# What the agents and hooks that tests start keep in the user's home (the ETA history, producer sequences,
# the storage ceiling cache, a private spool) goes to a directory of this run, removed at its end: a
# developer's own history stays out of the tests, and the tests' runs out of it.
_XDG = tempfile.mkdtemp(prefix="infersight-tests-xdg-")
os.environ["XDG_STATE_HOME"] = os.path.join(_XDG, "state")
os.environ["XDG_CACHE_HOME"] = os.path.join(_XDG, "cache")
atexit.register(shutil.rmtree, _XDG, True)
BOOTSTRAP = REPO / "hooks" / "bootstrap"
KINDS = ("unit", "integration", "e2e")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its folder's kind; a test outside the kind folders is an error."""
    tests = Path(__file__).resolve().parent
    for item in items:
        try:
            parts = item.path.resolve().relative_to(tests).parts
        except ValueError:  # collected from outside tests/
            continue
        if len(parts) < 2 or parts[0] not in KINDS:
            raise pytest.UsageError("%s: a test belongs in tests/unit, tests/integration or tests/e2e"
                                    % item.nodeid)
        item.add_marker(parts[0])


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory under /tmp that other users can enter (pytest's tmp is root's only), removed afterwards."""
    made = Path(tempfile.mkdtemp(prefix="infersight-open-"))
    os.chmod(made, 0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


@pytest.fixture(autouse=True)
def _remove_short_tmpdirs() -> Iterator[None]:
    """launch's short TMPDIRs (``short_tmp``) go when their test ends, with what CMD left in them."""
    yield
    remove_short_tmpdirs()


def pytest_report_header() -> str | None:
    """Warn when an agent already listens where the tests' hooked processes look by default: tests that
    start them without ``INFERSIGHT_SOCKET`` (launch's embedded default among them) would reach it."""
    import socket

    from infersight.hooks._paths import socket_path

    path = socket_path({k: v for k, v in os.environ.items() if k != "INFERSIGHT_SOCKET"})
    with socket.socket(socket.AF_UNIX) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except OSError:
            return None
    return ("WARNING: an agent listens at %s: tests that expect no agent there will join it and fail; "
            "stop it (systemctl stop infersight) before running the suite" % path)


def launch_tmpdir(path: Path) -> str:
    """A TMPDIR of the test's own for launch: its private directories and leftovers stay in it. (Under a
    TMPDIR too deep for launch's socket path they would go to /tmp, which parallel tests share.)"""
    from infersight.agent.commands.launch_base import temp_root

    path.mkdir(exist_ok=True)
    assert temp_root({"TMPDIR": str(path)}) == str(path), "run pytest with a shorter --basetemp: %s is too deep" % path
    return str(path)


def wait_for(pred, timeout: float = 10.0, interval: float = 0.02) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


class FlatQueue:
    """FAKE hook client for ``hooks.stage`` and ``hooks.request``: keeps the flat events they
    queue (``(seq, t_ns, kind, *args)``), as the client's buffer would."""

    enabled = True
    calm = 1 << 30  # the callers append to ``_buf`` directly in the calm ranges
    calm_from = calm_to = 0

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []
        self._buf = self.events
        self._seq = itertools.count(1)
        self.queue = self._queue
        self.held: dict[int, dict[str, object]] = {}  # attributes of events queued ``HELD``

    def _queue(self, event: tuple[object, ...]) -> bool:
        self.events.append(event)
        return True  # queued (a full buffer returns False)


def hook_env(sock: Path, spool: Path, **extra: str) -> dict[str, str]:
    """Environment of a hooked Python process talking to ``sock``."""
    env = dict(os.environ)
    env.update(
        INFERSIGHT_SOCKET=str(sock),
        INFERSIGHT_SPOOL_DIR=str(spool),
        PYTHONPATH=str(BOOTSTRAP),
        PYTHONUNBUFFERED="1",
        # this test's own private spool: a hooked process adopts what ended processes left in its user's private
        # spool into the agent's, and another test's leftover (a `python -c` that had no agent) was replayed as
        # a second cold start in this test's file
        XDG_STATE_HOME=str(Path(spool).parent / "xdg-state"),
    )
    env.pop("TRACEPARENT", None)
    env.update(extra)
    return env


def terminate(p: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """Stop a server the test started as an operator does (SIGTERM), killing it if it outlives ``timeout``."""
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def read_otlp_lines(path: Path) -> list[dict]:  # type: ignore[type-arg]
    """Every complete line of the file and its rotations; a line the agent is still
    writing (no newline yet) is left for the next read."""
    out = []
    for p in sorted(path.parent.glob(path.name + "*")):
        with open(p) as f:
            out += [json.loads(line) for line in f if line.endswith("\n") and line.strip()]
    return out


def log_records(lines: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    return [
        rec
        for req in lines
        for rl in req.get("resourceLogs", [])
        for sl in rl["scopeLogs"]
        for rec in sl["logRecords"]
    ]


def spans(lines: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    return [
        s
        for req in lines
        for rs in req.get("resourceSpans", [])
        for ss in rs["scopeSpans"]
        for s in ss["spans"]
    ]


def attr(obj: dict, key: str):  # type: ignore[no-untyped-def,type-arg]
    for kv in obj.get("attributes", []):
        if kv["key"] == key:
            v = kv["value"]
            return next(iter(v.values()))
    return None


@pytest.fixture(autouse=True)
def _private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each test's agents keep their state (ETA history, exporter spools) in a tmp dir of the
    test's own: never the user's state dir, and nothing one test spooled is replayed into
    another's output. Its hooked processes too: the user's private spool (``$XDG_STATE_HOME``)
    of one test is not another's (a `python -c` one test left there was adopted by a later
    test's process into its output as a second cold start)."""
    saved = {k: os.environ.get(k) for k in ("INFERSIGHT_STATE_DIR", "XDG_STATE_HOME")}
    os.environ["INFERSIGHT_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="state-", dir=_XDG)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class AgentProcess:
    """``infersight agent`` as a real subprocess with its own config in a tmp dir."""

    def __init__(self, root: Path, extra_toml: str = "") -> None:
        self.root = root
        self.sock = root / "agent.sock"
        self.spool = root / "spool"
        self.out = root / "out.otlp.jsonl"
        self.config = root / "infersight.toml"
        self.log = root / "agent.log"
        self.config.write_text(
            "[agent]\n"
            f'socket = "{self.sock}"\n'
            f'spool_dir = "{self.spool}"\n'
            "health_interval_s = 0.5\n"
            "frame_timeout_s = 2\n"
            "shutdown_timeout_s = 10\n"
            "[exporters.file]\n"
            f'path = "{self.out}"\n' + extra_toml
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> AgentProcess:
        env = dict(os.environ)
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infersight", "agent", "--config", str(self.config)],
            stdout=open(self.log, "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            env=env,
        )
        if wait:  # answering, not just a socket file (a SIGKILLed agent leaves its own behind)
            assert wait_for(self._listening, 15), self.log.read_text()
        return self

    def _listening(self) -> bool:
        """The agent answers a status query: it accepts, and has applied the socket's mode (a
        bare connect succeeds as soon as the socket listens, before that; a test that then
        widens the mode would race the agent's own chmod)."""
        from infersight.agent.commands.status import query_status

        try:
            query_status(str(self.sock), 1.0)
        except OSError:
            return False
        return True

    def status(self) -> dict:  # type: ignore[type-arg]
        from infersight.agent.commands.status import query_status

        return query_status(str(self.sock), 30.0)  # a loaded machine may keep the agent busy a while

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@pytest.fixture(scope="session")
def fake_libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FAKE libnvidia-ml.so.1 (tests/support/fake_nvml), built once per test process; skips without a C
    compiler."""
    from fake_nvml.helpers import build_fake_nvml

    try:
        return build_fake_nvml(tmp_path_factory.mktemp("fake_nvml"))
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def agent_factory(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    made: list[AgentProcess] = []

    def make(extra_toml: str = "", root: Path | None = None) -> AgentProcess:
        r = root or tmp_path / ("agent%d" % len(made))
        r.mkdir(parents=True, exist_ok=True)
        a = AgentProcess(r, extra_toml)
        made.append(a)
        return a

    yield make
    for a in made:
        if a.proc is not None and a.proc.poll() is None:
            a.proc.kill()
            a.proc.wait(5)


@pytest.fixture(autouse=True)
def _no_current_span_left() -> Iterator[None]:
    """Each test starts with no current hooks span: one that set it and never reset it (a forward begun and not
    ended) made the next test's stages nest under a span of its own."""
    from infersight.hooks import _runtime

    token = _runtime.current_span.set(None)
    yield
    _runtime.current_span.reset(token)
