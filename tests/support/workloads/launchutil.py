"""Helpers for the cold-start tests: run a workload under ``infersight launch``, or a server that a
test drives while it runs (``launch_server``), and read spans."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from short_tmp import short_tmpdir

from infersight.agent.commands.show import coldstarts, spans_from_lines
from infersight.telemetry import ColdStart, SpanItem

HERE = os.path.dirname(os.path.abspath(__file__))
INFERSIGHT = [os.path.join(os.path.dirname(sys.executable), "infersight")]


@dataclass
class LaunchRun:
    rc: int
    output: str
    spans: list[SpanItem]
    result: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    def roots(self) -> list[SpanItem]:
        return [s for s in self.spans if s.name == "coldstart"]

    def root_of(self, pid: int) -> SpanItem:
        found = [r for r in self.roots() if r.resource.get("process.pid") == pid]
        assert len(found) == 1, "expected one coldstart root for pid %d, got %r" % (pid, found)
        return found[0]

    def stages(self, root: SpanItem) -> list[SpanItem]:
        for cs in coldstarts(self.spans):
            if cs.root.span_id == root.span_id:
                return cs.stages
        raise AssertionError("no stages for root")


def launch(tmp: str, argv: list[str], *flags: str, result: bool = True, timeout: float = 300,
           env: dict[str, str] | None = None) -> LaunchRun:
    otlp = os.path.join(tmp, "out.otlp.jsonl")
    res_path = os.path.join(tmp, "result.json")
    cmd = [*INFERSIGHT, "launch", "--otlp-file", otlp, *flags, "--", *argv]
    if result:
        cmd.append(res_path)
    tmpdir = short_tmpdir(tmp)
    e = launch_env(tmp, env or {})
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=e)
    wall = time.monotonic() - t0
    try:
        os.rmdir(tmpdir)  # empty unless launch kept a directory for a later replay
    except OSError:
        pass
    with open(otlp, encoding="utf-8") as f:
        spans = spans_from_lines(f.readlines())
    data: dict[str, Any] = {}
    if result and os.path.exists(res_path):
        with open(res_path, encoding="utf-8") as f:
            data = json.load(f)
    return LaunchRun(p.returncode, p.stdout + p.stderr, spans, data, wall)


def launch_env(tmp: str, env: dict[str, str], unset: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a launch in the test whose tmp path is ``tmp``: this one, with ``env``,
    less ``unset``. launch replays the leftover directories of dead launches (same uid) in $TMPDIR
    into its output: a test's own TMPDIR keeps other tests' and other runs' leftovers out of it
    (short: the socket path must fit AF_UNIX's 108 bytes)."""
    e = dict(os.environ, XDG_CACHE_HOME=os.path.join(tmp, "cache"), INFERSIGHT_MEASURE_STORAGE="0",
             TMPDIR=short_tmpdir(tmp))
    e.update(env)
    for name in unset:
        e.pop(name, None)
    return e


def cmd_group(launch_pid: int) -> int:
    """CMD, launch's child (it leads its own process group); 0 while there is none."""
    for tid in os.listdir("/proc/%d/task" % launch_pid):
        with open("/proc/%d/task/%s/children" % (launch_pid, tid)) as f:
            for w in f.read().split():
                if os.getpgid(int(w)) == int(w):
                    return int(w)
    return 0


def bare_connect(port: int) -> bool:
    """A TCP connect that carries no request (a load balancer's check, a k8s tcpSocket probe)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def get_json(port: int) -> Any:
    """One GET of ``/`` on ``port``: its JSON answer."""
    with urllib.request.urlopen("http://127.0.0.1:%d/" % port, timeout=60) as resp:
        return json.load(resp)


class Served:
    """A server under ``infersight launch`` while a test drives it (``launch_server``)."""

    def __init__(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        self.proc = proc
        self.deadline = time.monotonic() + timeout
        self.group = 0  # CMD's process group, once ``until`` saw it ready

    def alive(self, before: str, never: str) -> None:
        """Between two polls: the stack still runs (else it exited ``before`` what the test waits
        for) and the test's time is not up (else ``never`` says what never came)."""
        assert self.proc.poll() is None, "the stack exited before %s" % before
        assert time.monotonic() < self.deadline, never

    def until(self, ready: Callable[[], bool], before: str, never: str, every: float = 0.05) -> None:
        """Poll ``ready`` every ``every`` seconds (as ``alive`` says) until it is true; then find
        CMD's process group."""
        while not ready():
            self.alive(before, never)
            time.sleep(every)
        self.group = cmd_group(self.proc.pid)

    def find_group(self) -> int:
        """CMD's process group, also where the test failed before ``until`` found it."""
        if not self.group and self.proc.poll() is None:
            try:
                self.group = cmd_group(self.proc.pid)
            except OSError:  # launch ended meanwhile
                pass
        return self.group


T = TypeVar("T")


def end_launch(p: subprocess.Popen[Any], group: int) -> None:
    """A test leaves no process behind: launch killed if it still runs, and whatever is left of CMD's process
    group ``group`` (0: none found; never killpg(0), the test's own group)."""
    if p.poll() is None:
        p.kill()
        p.wait()
    if group:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch_server(tmp: str, argv: list[str], drive: Callable[[Served], T], *flags: str,
                  env: dict[str, str] | None = None, unset: tuple[str, ...] = (), cwd: str = HERE,
                  timeout: float = 120, stop_timeout: float = 60) -> tuple[LaunchRun, T]:
    """Launch the server ``argv`` (``flags`` go to launch; ``env`` and ``unset`` as ``launch_env``),
    let ``drive`` wait for it and talk to it (``timeout`` seconds from the start for its waits),
    then Ctrl-C as a terminal sends it (SIGINT to CMD's process group, the terminal's foreground
    one under launch), and read what launch wrote; what ``drive`` returned comes with it. Whatever
    of CMD's group is still there after launch has ended is killed (a test leaves no process
    behind)."""
    otlp = os.path.join(tmp, "out.otlp.jsonl")
    log = open(os.path.join(tmp, "launch.log"), "w+", encoding="utf-8")  # noqa: SIM115 (a pipe would wait for CMD's orphans)
    p = subprocess.Popen([*INFERSIGHT, "launch", "--otlp-file", otlp, *flags, "--", *argv], cwd=cwd,
                         env=launch_env(tmp, env or {}, unset), stdout=log, stderr=subprocess.STDOUT)
    served = Served(p, timeout)
    stuck = False
    try:
        answer = drive(served)
        group = served.find_group()
        assert group, "launch's CMD is gone"  # (never killpg(0): the test's own group)
        os.killpg(group, signal.SIGINT)
        try:
            p.wait(timeout=stop_timeout)
        except subprocess.TimeoutExpired:
            stuck = True
    finally:
        end_launch(p, served.find_group())
        log.seek(0)
        out = log.read()
        log.close()
    assert not stuck, "launch did not end within %g s of the Ctrl-C:\n%s" % (stop_timeout, out[-3000:])
    with open(otlp, encoding="utf-8") as f:
        spans = spans_from_lines(f.readlines())
    return LaunchRun(p.returncode, out, spans), answer


@dataclass
class Answers:
    """What ``serve`` sent and got: when its first request was sent, and each answer (status, body)."""

    sent_ns: int
    answers: list[tuple[int, bytes]]


def serve(tmp: str, argv: list[str], port: int, paths: tuple[str, ...] = ("/",), flags: tuple[str, ...] = (),
          env: dict[str, str] | None = None, cwd: str = HERE, idle_s: float = 0.3,
          timeout: float = 120) -> tuple[LaunchRun, Answers]:
    """Launch the server ``argv`` (``launch_server``); wait for its port with bare connects (probes that
    carry no request); ``idle_s`` of waiting for traffic; then one GET of each of ``paths`` in turn."""

    def drive(served: Served) -> Answers:
        served.until(lambda: bare_connect(port), "listening", "port %d never listened" % port)
        time.sleep(idle_s)
        sent_ns = time.time_ns()
        answers: list[tuple[int, bytes]] = []
        for path in paths:
            with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=60) as resp:
                answers.append((int(resp.status), resp.read()))
        return Answers(sent_ns, answers)

    return launch_server(tmp, argv, drive, *flags, env=env, cwd=cwd, timeout=timeout)


def stage_name(s: SpanItem) -> str:
    return str(s.attributes.get("infersight.stage"))


def pid(cs: ColdStart) -> int:
    """The process whose cold start ``cs`` is."""
    return int(cs.root.resource.get("process.pid") or 0)


def the(cs: ColdStart, stage: str) -> list[SpanItem]:
    """``cs``'s stages named ``stage``."""
    return [s for s in cs.stages if stage_name(s) == stage]


def one(cs: ColdStart, stage: str, r: LaunchRun) -> SpanItem:
    """``cs``'s one stage named ``stage`` (else the test fails with its stages and ``r``'s output)."""
    found = the(cs, stage)
    assert len(found) == 1, (stage, [stage_name(s) for s in cs.stages], r.output[-3000:])
    return found[0]


def assert_well_formed(root: SpanItem, stages: list[SpanItem]) -> None:
    """Names, nesting under the root, no negative durations, no overlap unless nested. A root
    that ended at readiness may be followed by its first request (and what nests in it), which
    then lies wholly after the root."""
    by_id = {s.span_id: s for s in stages}
    at_ready = root.attributes.get("infersight.coldstart.ended_by") == "ready"

    def after_root(s: SpanItem) -> bool:
        cur: SpanItem | None = s
        while cur is not None:
            if cur.parent_span_id == root.span_id:
                return at_ready and cur.start_ns >= root.end_ns
            cur = by_id.get(cur.parent_span_id or "")
        return False

    for s in stages:
        assert s.name == "coldstart." + stage_name(s), s.name
        assert s.trace_id == root.trace_id
        assert s.end_ns >= s.start_ns, "negative duration: %s" % s.name
        if after_root(s):
            assert s.start_ns >= root.end_ns, "%s straddles the root's end" % s.name
        else:
            assert s.start_ns >= root.start_ns and s.end_ns <= root.end_ns, "%s outside the root" % s.name
        parent = by_id.get(s.parent_span_id or "")
        if parent is not None:
            assert parent.start_ns <= s.start_ns and s.end_ns <= parent.end_ns, "%s outside its parent" % s.name
        else:
            assert s.parent_span_id == root.span_id, "%s does not descend from the root" % s.name

    def ancestors(s: SpanItem) -> set[str]:
        out, cur = set(), s
        while cur.parent_span_id in by_id:
            cur = by_id[cur.parent_span_id]
            out.add(cur.span_id)
        return out

    for i, a in enumerate(stages):
        for b in stages[i + 1:]:
            overlap = min(a.end_ns, b.end_ns) - max(a.start_ns, b.start_ns)
            if overlap > 0:
                assert a.span_id in ancestors(b) or b.span_id in ancestors(a), (
                    "%s and %s overlap by %d ns without nesting" % (a.name, b.name, overlap))
