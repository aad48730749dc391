"""Smoke test against rotel, a Rust OTLP collector we did not write (PyPI ``rotel``).

OtlpExporter --OTLP (HTTP/protobuf or gRPC)--> rotel --OTLP/gRPC (gzip)--> tests/support/otlp_receiver.
What arrives at the end must be what we sent: rotel parsed our requests as OTLP.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from otlp_receiver import OtlpReceiver, attrs, free_port
from otlp_samples import RES, make_logs, make_metrics, make_spans

from infersight.exporters.otlp import OtlpExporter

rotel = pytest.importorskip("rotel")
ROTEL_BIN = Path(rotel.__file__).parent / "rotel-agent"


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            pytest.fail("rotel exited with %s: %s" % (proc.returncode, out[-2000:]))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    pytest.fail("rotel did not listen on %d within %.0f s" % (port, timeout_s))


@pytest.fixture
def rotel_pipeline(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)
    assert ROTEL_BIN.exists(), "rotel package without its rotel-agent binary"
    rx = OtlpReceiver(http=False).start()
    http_port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [
            str(ROTEL_BIN), "start",
            "--otlp-http-endpoint", "127.0.0.1:%d" % http_port,
            "--otlp-grpc-endpoint", "127.0.0.1:%d" % grpc_port,
            "--exporter", "otlp",
            "--otlp-exporter-endpoint", rx.grpc_endpoint,
            "--otlp-exporter-protocol", "grpc",
            "--batch-timeout", "50ms",
            "--pid-file", str(tmp_path / "rotel.pid"),
            "--log-file", str(tmp_path / "rotel.log"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        _wait_port(http_port, proc)
        _wait_port(grpc_port, proc)
        yield rx, http_port, grpc_port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        rx.stop()


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
async def test_spans_logs_metrics_pass_through_rotel(rotel_pipeline, protocol):
    rx, http_port, grpc_port = rotel_pipeline
    port = grpc_port if protocol == "grpc" else http_port
    exp = OtlpExporter("http://127.0.0.1:%d" % port, protocol=protocol, timeout_s=5)
    spans, logs, metrics = make_spans(2), make_logs(), make_metrics()
    await exp.export([*spans, *logs, *metrics])
    assert exp.state()["spans_exported"] == 3

    assert rx.wait_for(
        lambda: rx.span_count() >= 3 and rx.log_count() >= 2 and rx.point_count() >= 4, 20
    ), "rotel forwarded %d spans, %d logs, %d points" % (rx.span_count(), rx.log_count(), rx.point_count())
    got = {s.span_id.hex(): (res, scope, s) for res, scope, s in rx.spans()}
    assert set(got) == {s.span_id for s in spans}
    for s in spans:
        res, scope, p = got[s.span_id]
        assert p.name == s.name
        assert p.trace_id.hex() == s.trace_id
        assert p.parent_span_id.hex() == (s.parent_span_id or "")
        assert attrs(p.attributes) == s.attributes
        assert scope == "infersight"
        for k, v in RES.attributes:
            assert res[k] == v
    assert sorted(lr.body.string_value for _, _, lr in rx.log_records()) == ["CUDA out of memory", "model loaded"]
    names = {m.name for _, _, m in rx.metrics()}
    assert names == {m.name for m in metrics}
    await exp.shutdown()
