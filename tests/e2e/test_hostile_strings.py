"""Strings from other users are made safe once, at ingest, for every sink (issue 22, points 4 and 5).

End to end: a real agent with its file, MQTT (a real mosquitto) and Prometheus exporters, and
hooked workloads whose service names carry a control character (``\\x01``: mosquitto drops a
client that publishes it in a topic) and a byte that is not UTF-8 (``OTEL_SERVICE_NAME`` of
``b"\\xff"``: a lone surrogate, which made every ``/metrics`` scrape answer 500). Then a raw
peer sends control characters in every string of a hello and its events.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, hook_env, read_otlp_lines, wait_for
from hypothesis import given
from hypothesis import strategies as st
from mosquitto import MOSQUITTO, Collector, Mosquitto, running_broker

from infersight.agent.daemon.sanitize import decode_frame
from infersight.hooks import _wire
from infersight.sanitize import MAX_TEXT, clean_key, clean_text, clean_tree, needs_cleaning, text_needs_cleaning

PROMTOOL = shutil.which("promtool")
BIDI = {*map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A))}  # embeddings, overrides, isolates
BAD_CHARS = ({*map(chr, range(0x20)), *map(chr, range(0x7F, 0xA0))} - {"\t", "\n"}) | BIDI

WORKLOAD = """
from infersight import hooks
with hooks.stage("model_build"):
    pass
hooks.mark_ready()
assert hooks.flush(10)
"""


def _strings(v: Any) -> Iterator[str]:
    if isinstance(v, str):
        yield v
    elif isinstance(v, list):
        for x in v:
            yield from _strings(x)
    elif isinstance(v, dict):
        for k, x in v.items():
            yield k
            yield from _strings(x)


def _plain(s: str) -> bool:
    """Valid UTF-8, no control character but tab and newline."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not any(c in BAD_CHARS for c in s)


# -- the rules (pure) ---------------------------------------------------------------------------


@given(st.text(max_size=300))
def test_clean_text_is_plain_bounded_and_keeps_plain_text(s: str) -> None:
    out = clean_text(s, 100)
    assert _plain(out) and len(out) <= 100
    if _plain(s) and len(s) <= 100:
        assert out == s
    key = clean_key(s)
    assert _plain(key) and "\n" not in key and "\t" not in key


@given(st.recursive(st.text(max_size=20) | st.integers() | st.none(),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                    max_leaves=20))
def test_a_frame_that_needs_no_cleaning_is_one_cleaning_would_not_change(v: Any) -> None:
    raw = json.dumps({"v": v}, ensure_ascii=False).encode("utf-8", "surrogatepass")
    decoded = json.loads(raw.decode("utf-8", "surrogatepass"))
    if not needs_cleaning(raw):
        assert clean_tree(decoded) == decoded
    assert all(_plain(s) for s in _strings(clean_tree(decoded)))


@given(st.recursive(st.text(max_size=20), lambda kids: st.lists(kids, max_size=4), max_leaves=10),
       st.booleans())
def test_a_file_line_that_needs_no_cleaning_is_one_cleaning_would_not_change(v: Any, ascii_only: bool) -> None:
    text = json.dumps({"v": v}, ensure_ascii=ascii_only)
    decoded = json.loads(text)
    if not text_needs_cleaning(text):
        assert clean_tree(decoded, limit=1 << 20) == decoded


def test_decode_frame_cleans_escapes_raw_bytes_and_bounds_length() -> None:
    msg = decode_frame(b'{"t":"hello","p":{"service_name":"a\\u0001b\\ud800","k\\nx":"\xc2\x85\x7f"}}')
    assert msg == {"t": "hello", "p": {"service_name": "a\ufffdb\ufffd", "k\ufffdx": "\ufffd\ufffd"}}
    long = decode_frame(json.dumps({"t": "hello", "p": {"exe": "x" * (MAX_TEXT + 10)}}).encode())
    assert long is not None and len(long["p"]["exe"]) == MAX_TEXT
    assert decode_frame(b'{"a":' + b"[" * 200 + b"]" * 200 + b', "b": "\\u0001"}') is None  # too deep to walk
    plain = b'{"t":"b","e":[[1,2,"log",{"body":"fine"}]]}'
    assert not needs_cleaning(plain) and decode_frame(plain) == json.loads(plain)


# -- end to end ---------------------------------------------------------------------------------


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with running_broker(tmp_path / "mosquitto") as b:
        yield b


def _scrape(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode("utf-8")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


@pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto not installed")
async def test_hostile_service_names_reach_mqtt_prometheus_and_the_file_as_plain_text(
    agent_factory, broker: Mosquitto, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    host = "strings-host"
    port = free_port()
    agent = agent_factory(f'[exporters.mqtt]\nurl = "{broker.url}"\n'
                          f"[exporters.prometheus]\nenabled = true\nport = {port}\n")
    agent.config.write_text(agent.config.read_text().replace("[agent]\n", f'[agent]\nhost_name = "{host}"\n'))
    agent.start()
    script = tmp_path / "serve.py"
    script.write_text(WORKLOAD)
    names = {"ctl": "evil\x01svc", "bytes": "bad\udcffsvc", "good": "good-svc"}
    async with Collector(broker, "infersight/%s/#" % host) as sub:
        for name in names.values():
            env = {os.fsencode(k): os.fsencode(v) for k, v in
                   hook_env(agent.sock, agent.spool, OTEL_SERVICE_NAME=name).items()}  # "\udcff" is byte 0xff
            subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=60)

        def coldstarts() -> dict[str, dict[str, Any]]:
            return {m.json()["service.name"]: m.json() for m in sub.on("infersight/%s/coldstart" % host)}

        # The good service's cold start comes after the two hostile ones, on the same connection.
        assert await sub.wait_for(lambda: "good-svc" in coldstarts(), 30), agent.status()["exporters"]
        assert set(coldstarts()) == {"evil\ufffdsvc", "bad\ufffdsvc", "good-svc"}
        mqtt = next(e for e in agent.status()["exporters"] if e["name"] == "mqtt")
        # mosquitto never dropped us: one connection, no batch failed or refused
        assert mqtt["exporter.connects"] == 1 and mqtt["exporter.disconnects"] == 0, mqtt
        assert mqtt["exporter.refused_messages"] == 0 and mqtt["exporter.failed_batches"] == 0, mqtt
        assert all(_plain(m.topic) for m in sub.messages)
    # Prometheus: the whole scrape answers, with the names as plain text.
    status, text = _scrape("http://127.0.0.1:%d/metrics" % port)
    assert status == 200, text[-2000:]
    assert 'service_name="bad\ufffdsvc"' in text and 'service_name="evil\ufffdsvc"' in text
    if PROMTOOL is not None:
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                               timeout=60)
        assert "error" not in (check.stdout + check.stderr).lower(), check.stdout + check.stderr
    # The file: every string plain.
    lines = read_otlp_lines(agent.out)
    assert lines and all(_plain(s) for line in lines for s in _strings(line))
    assert agent.status()["healthy"] is True
    assert agent.stop() == 0


def test_control_characters_in_every_string_of_a_raw_peer_are_cleaned(agent_factory) -> None:  # type: ignore[no-untyped-def]
    """A raw peer, not the hooks: escapes and raw non-ASCII bytes in hello fields, attribute
    keys and values, log bodies, span names and errors."""
    agent = agent_factory().start()
    evil = "x\x1b[2J\x00\x85\x7f\ud800y\tz\n"
    hello = {"t": "hello", "schema": 1, "producer": {
        "id": "raw-1", "pid": os.getpid(), "start_ns": time.time_ns() - 10**9, "trace_id": "c" * 32,
        "root_span_id": "d" * 16, "exe": evil, "service_name": evil, "argv0": evil, "python": evil,
        "resource_attributes": "team=%1B%00" + evil.replace(",", "").replace("=", "")}}
    now = time.time_ns()
    batch = {"t": "b", "e": [
        [1, now, "log", {"name": "oom", "sev": "ERROR", "body": evil, "a": {evil: evil, "k": [evil, "ok"]}}],
        [2, now, "span", {"n": "coldstart.model_build", "id": "e" * 16, "p": "d" * 16, "s": now - 10**8, "e": now,
                          "a": {"infersight.stage": evil}, "err": evil}],
        [3, now, "span", {"n": "coldstart", "id": "d" * 16, "s": now - 10**9, "e": now}],
    ]}
    raw = _wire.encode_frame(hello) + b"".join(
        _wire.HEADER.pack(len(p)) + p for p in [json.dumps(batch, ensure_ascii=False)
                                                  .encode("utf-8", "surrogatepass")])  # raw bytes, no escapes
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(agent.sock))
        s.sendall(raw)
        assert wait_for(lambda: agent.status()["counters"]["events_in"] >= 3, 15), agent.status()
    assert wait_for(lambda: len(read_otlp_lines(agent.out)) >= 2, 15)
    lines = read_otlp_lines(agent.out)
    strings = [s for line in lines for s in _strings(line)]
    assert any("x\ufffd[2J" in s for s in strings)  # the text is there, its control characters are not
    assert all(_plain(s) for s in strings)
    c = agent.status()["counters"]
    assert c["malformed_events"] == 0 and c["malformed_frames"] == 0


def _send_and_show(agent: Any, hello: dict[str, Any], batch: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """A raw peer's hello and one batch of a cold start, then ``infersight show`` of the agent's file."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(agent.sock))
        s.sendall(_wire.encode_frame(hello) + _wire.encode_frame(batch))
        assert wait_for(lambda: agent.status()["counters"]["events_in"] >= 2, 15), agent.status()
    assert wait_for(lambda: "coldstart" in agent.out.read_text() if agent.out.exists() else False, 15)
    return subprocess.run([sys.executable, "-m", "infersight", "show", str(agent.out)], capture_output=True,
                          text=True, timeout=60)


def test_a_name_cannot_forge_lines_or_reorder_what_show_prints(agent_factory) -> None:  # type: ignore[no-untyped-def]
    """A member's service and span names with a newline, a forged waterfall line and a right-to-left
    override (U+202E): ``infersight show`` printed them as they were, so the operator read a line that
    no process wrote, and the override reordered the rest of the header. Names are one line now, and
    the bidirectional controls are gone from every string."""
    agent = agent_factory().start()
    forged = "  victim-svc  ready in 0.001 s  (all good)"
    evil = "victim-svc\n" + forged + "\u202egnp.x"
    now = time.time_ns()
    hello = {"t": "hello", "schema": 1, "producer": {
        "id": "raw-2", "pid": os.getpid(), "start_ns": now - 10**9, "trace_id": "e" * 32, "root_span_id": "f" * 16,
        "exe": "python3", "service_name": evil}}
    batch = {"t": "b", "e": [
        [1, now, "span", {"n": "coldstart.x\n" + forged, "id": "a" * 16, "p": "f" * 16, "s": now - 10**8, "e": now}],
        [2, now, "span", {"n": "coldstart", "id": "f" * 16, "s": now - 10**9, "e": now}],
    ]}
    r = _send_and_show(agent, hello, batch)
    assert "victim-svc" in r.stdout, r.stdout + r.stderr
    assert not any(line.startswith(forged) for line in r.stdout.splitlines()), r.stdout
    assert "\u202e" not in r.stdout and not BIDI & set(r.stdout)
    strings = [x for line in read_otlp_lines(agent.out) for x in _strings(line)]
    assert all(_plain(x) for x in strings)
    assert not any(forged in x and "\n" in x for x in strings)


def test_point_attributes_cannot_pass_a_series_off_as_another_service_or_host(agent_factory) -> None:  # type: ignore[no-untyped-def]
    """A producer's metric point says ``service.name=victim``, ``host.name=other-host``: the
    series keeps the producer's own labels; its claims stay visible as ``exported_*``."""
    port = free_port()
    agent = agent_factory(f"[exporters.prometheus]\nenabled = true\nport = {port}\n")
    agent.config.write_text(agent.config.read_text().replace("[agent]\n", '[agent]\nhost_name = "real-host"\n'))
    agent.start()
    hello = {"t": "hello", "schema": 1, "producer": {
        "id": "liar-1", "pid": os.getpid(), "start_ns": time.time_ns() - 10**9, "trace_id": "c" * 32,
        "root_span_id": "d" * 16, "service_name": "liar-svc"}}
    batch = {"t": "b", "e": [[1, time.time_ns(), "metric", {
        "n": "liar.queue.depth", "v": 7, "a": {"service.name": "victim", "host.name": "other-host", "q": "a"}}]]}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(agent.sock))
        s.sendall(_wire.encode_frame(hello) + _wire.encode_frame(batch))
        assert wait_for(lambda: "liar_queue_depth{" in _scrape("http://127.0.0.1:%d/metrics" % port)[1], 15)
    status, text = _scrape("http://127.0.0.1:%d/metrics" % port)
    assert status == 200
    [line] = [x for x in text.splitlines() if x.startswith("liar_queue_depth{")]
    assert 'service_name="liar-svc"' in line and 'host_name="real-host"' in line, line
    assert 'exported_service_name="victim"' in line and 'exported_host_name="other-host"' in line, line
    assert 'service_name="victim"' not in line.replace("exported_service_name", "")
    if PROMTOOL is not None:
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                               timeout=60)
        assert "error" not in (check.stdout + check.stderr).lower(), check.stdout + check.stderr


def test_an_attribute_value_cannot_forge_lines_in_what_show_prints(agent_factory) -> None:  # type: ignore[no-untyped-def]
    """Attribute values keep their newlines at ingest (log bodies need them): a member's stage attribute
    ``weights_load\\r\\n<forged line>`` printed a whole line of its own in the waterfall's "biggest stages"
    (review finding). Every line ``show`` prints is one line now, with the newline escaped."""
    agent = agent_factory().start()
    forged = "2026-12-05 06:00:00 ERROR infersight.agent: forged"
    now = time.time_ns()
    hello = {"t": "hello", "schema": 1, "producer": {
        "id": "raw-3", "pid": os.getpid(), "start_ns": now - 10**9, "trace_id": "d" * 32, "root_span_id": "c" * 16,
        "exe": "python3", "service_name": "svc"}}
    stage = "weights_load\x1b[31m\r\n" + forged
    batch = {"t": "b", "e": [
        [1, now, "span", {"n": "coldstart.weights_load", "id": "a" * 16, "p": "c" * 16, "s": now - 10**8, "e": now,
                          "a": {"infersight.stage": stage}}],
        [2, now, "span", {"n": "coldstart", "id": "c" * 16, "s": now - 10**9, "e": now}],
    ]}
    r = _send_and_show(agent, hello, batch)
    assert "weights_load" in r.stdout, r.stdout + r.stderr
    assert not any(line.startswith(forged) for line in r.stdout.splitlines()), r.stdout
    assert "\\n" + forged in r.stdout  # (CR was made U+FFFD at ingest; the newline is kept there)
