"""A real OTLP receiver for tests: gRPC and HTTP/protobuf on opentelemetry-proto's definitions.

- gRPC: the official ``TraceService`` / ``MetricsService`` / ``LogsService`` servicers from
  ``opentelemetry.proto.collector.*.v1.*_service_pb2_grpc``.
- HTTP: a stdlib ``http.server`` handler for ``POST /v1/traces``, ``/v1/metrics`` and
  ``/v1/logs`` with protobuf bodies (``Content-Encoding: gzip`` or ``deflate`` accepted; JSON
  bodies too, through ``google.protobuf.json_format``).

Both parse into ``Export*ServiceRequest`` messages and store them with the request headers.
``start()`` picks free 127.0.0.1 ports on the first call and reuses them on later calls, so
``stop()`` then ``start()`` brings the receiver back on the same ports ("receiver down" tests).

    rx = OtlpReceiver()
    rx.start()
    ... export to rx.http_endpoint or rx.grpc_endpoint ...
    rx.wait_for(lambda: rx.span_count() >= 3)
    rx.stop()
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from google.protobuf import any_pb2, json_format
from google.rpc.error_details_pb2 import RetryInfo
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from ports import free_port

REQUEST_TYPES: dict[str, tuple[Any, Any]] = {
    "traces": (trace_service_pb2.ExportTraceServiceRequest, trace_service_pb2.ExportTraceServiceResponse),
    "metrics": (
        metrics_service_pb2.ExportMetricsServiceRequest,
        metrics_service_pb2.ExportMetricsServiceResponse,
    ),
    "logs": (logs_service_pb2.ExportLogsServiceRequest, logs_service_pb2.ExportLogsServiceResponse),
}


def any_value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attrs(v.kvlist_value.values)
    return getattr(v, kind)


def attrs(kvs: Iterator[KeyValue] | Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass
class Received:
    signal: str  # traces | metrics | logs
    transport: str  # http | grpc
    request: Any  # the Export*ServiceRequest
    headers: dict[str, str] = field(default_factory=dict)  # lowercase keys


class _Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[Received] = []
        self.grpc_fail: grpc.StatusCode | None = None  # set to refuse gRPC exports with this code
        self.grpc_retry_delay_s: float | None = None  # with it, a google.rpc.RetryInfo in the refusal's status details
        self.refused_at: list[float] = []  # when exports were refused (monotonic)

    def add(self, r: Received) -> None:
        with self.lock:
            self.requests.append(r)


def _make_servicers(store: _Store) -> list[tuple[Callable[[Any, Any], None], Any]]:
    def handler(signal: str) -> Callable[[Any, Any], Any]:
        _, resp_type = REQUEST_TYPES[signal]

        def export(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            if store.grpc_fail is not None:
                store.refused_at.append(time.monotonic())
                if store.grpc_retry_delay_s is not None:  # as a throttling collector answers (OTLP specification)
                    info = RetryInfo()
                    info.retry_delay.FromNanoseconds(int(store.grpc_retry_delay_s * 1e9))
                    detail = any_pb2.Any()
                    detail.Pack(info)
                    status = Status(code=store.grpc_fail.value[0], message="refused by the test receiver",
                                    details=[detail])
                    context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
                context.abort(store.grpc_fail, "refused by the test receiver")
            md = {k.lower(): v for k, v in context.invocation_metadata() if isinstance(v, str)}
            store.add(Received(signal, "grpc", request, md))
            return resp_type()

        return export

    trace = type("TraceServicer", (trace_service_pb2_grpc.TraceServiceServicer,), {"Export": handler("traces")})
    metrics = type(
        "MetricsServicer", (metrics_service_pb2_grpc.MetricsServiceServicer,), {"Export": handler("metrics")}
    )
    logs = type("LogsServicer", (logs_service_pb2_grpc.LogsServiceServicer,), {"Export": handler("logs")})
    return [
        (trace_service_pb2_grpc.add_TraceServiceServicer_to_server, trace()),
        (metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server, metrics()),
        (logs_service_pb2_grpc.add_LogsServiceServicer_to_server, logs()),
    ]


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    store: _Store
    fail_status: int | None
    fail_headers: dict[str, str]


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.0: one request per connection, so that stop() really takes the receiver down
    # (no pooled keep-alive connection is served by a leftover handler thread).
    protocol_version = "HTTP/1.0"
    server: _HttpServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _reply(self, status: int, body: bytes = b"", ctype: str = "application/x-protobuf") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        signal = {"/v1/traces": "traces", "/v1/metrics": "metrics", "/v1/logs": "logs"}.get(
            self.path.split("?", 1)[0]
        )
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        if signal is None:
            self._reply(404, b"unknown path", "text/plain")
            return
        if self.server.fail_status is not None:
            self.server.store.refused_at.append(time.monotonic())
            self.send_response(self.server.fail_status)
            for k, v in self.server.fail_headers.items():  # e.g. Retry-After
                self.send_header(k, v)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        enc = (self.headers.get("Content-Encoding") or "").lower()
        try:
            if enc == "gzip":
                body = gzip.decompress(body)
            elif enc == "deflate":
                body = zlib.decompress(body)
            req_type, resp_type = REQUEST_TYPES[signal]
            ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            if ctype == "application/json":
                request = json_format.Parse(body.decode("utf-8"), req_type())
            else:
                request = req_type()
                request.ParseFromString(body)
        except Exception as exc:
            self._reply(400, str(exc).encode(), "text/plain")
            return
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server.store.add(Received(signal, "http", request, headers))
        self._reply(200, resp_type().SerializeToString())


class OtlpReceiver:
    """OTLP/gRPC and OTLP/HTTP receiver on 127.0.0.1, restartable on the same ports."""

    def __init__(self, http: bool = True, grpc_: bool = True, host: str = "127.0.0.1") -> None:
        self.host = host
        self.want_http = http
        self.want_grpc = grpc_
        self.http_port = free_port(host) if http else 0
        self.grpc_port = free_port(host) if grpc_ else 0
        self.store = _Store()
        self.fail_status: int | None = None  # set to e.g. 503 to refuse HTTP exports
        self.fail_headers: dict[str, str] = {}  # headers of those refusals (Retry-After)
        self._http: _HttpServer | None = None
        self._http_thread: threading.Thread | None = None
        self._grpc: grpc.Server | None = None

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def http_endpoint(self) -> str:
        return "http://%s:%d" % (self.host, self.http_port)

    @property
    def grpc_endpoint(self) -> str:
        return "http://%s:%d" % (self.host, self.grpc_port)

    @property
    def running(self) -> bool:
        return self._http is not None or self._grpc is not None

    def start(self) -> OtlpReceiver:
        if self.want_http and self._http is None:
            deadline = time.monotonic() + 5
            while True:
                try:
                    srv = _HttpServer((self.host, self.http_port), _Handler)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            srv.store = self.store
            srv.fail_status = self.fail_status
            srv.fail_headers = self.fail_headers
            self._http = srv
            self._http_thread = threading.Thread(
                target=srv.serve_forever, kwargs={"poll_interval": 0.05}, name="otlp-rx-http", daemon=True
            )
            self._http_thread.start()
        if self.want_grpc and self._grpc is None:
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            for add, servicer in _make_servicers(self.store):
                add(servicer, server)
            port = server.add_insecure_port("%s:%d" % (self.host, self.grpc_port))
            if port != self.grpc_port:
                server.stop(0)
                raise OSError("cannot bind gRPC receiver on port %d" % self.grpc_port)
            server.start()
            self._grpc = server
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            if self._http_thread is not None:
                self._http_thread.join(5)
            self._http = None
            self._http_thread = None
        if self._grpc is not None:
            self._grpc.stop(grace=None).wait(5)
            self._grpc = None

    def set_fail_status(self, status: int | None, headers: dict[str, str] | None = None) -> None:
        self.fail_status = status
        self.fail_headers = dict(headers or {})
        if self._http is not None:
            self._http.fail_status = status
            self._http.fail_headers = self.fail_headers

    def set_grpc_fail(self, code: grpc.StatusCode | None, retry_delay_s: float | None = None) -> None:
        """Refuse gRPC exports with ``code`` (None: accept again), asking for ``retry_delay_s`` (RetryInfo) if given."""
        self.store.grpc_retry_delay_s = retry_delay_s
        self.store.grpc_fail = code

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what arrived -----------------------------------------------------------------------

    def received(self, signal: str | None = None, transport: str | None = None) -> list[Received]:
        with self.store.lock:
            return [
                r
                for r in self.store.requests
                if (signal is None or r.signal == signal) and (transport is None or r.transport == transport)
            ]

    def clear(self) -> None:
        with self.store.lock:
            self.store.requests.clear()

    def spans(self, transport: str | None = None) -> list[tuple[dict[str, Any], str, Any]]:
        """(resource attributes, scope name, Span proto) for every span received."""
        out = []
        for r in self.received("traces", transport):
            for rs in r.request.resource_spans:
                res = attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    out.extend((res, ss.scope.name, s) for s in ss.spans)
        return out

    def log_records(self, transport: str | None = None) -> list[tuple[dict[str, Any], str, Any]]:
        out = []
        for r in self.received("logs", transport):
            for rl in r.request.resource_logs:
                res = attrs(rl.resource.attributes)
                for sl in rl.scope_logs:
                    out.extend((res, sl.scope.name, lr) for lr in sl.log_records)
        return out

    def metrics(self, transport: str | None = None) -> list[tuple[dict[str, Any], str, Any]]:
        out = []
        for r in self.received("metrics", transport):
            for rm in r.request.resource_metrics:
                res = attrs(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    out.extend((res, sm.scope.name, m) for m in sm.metrics)
        return out

    def span_count(self, transport: str | None = None) -> int:
        return len(self.spans(transport))

    def log_count(self, transport: str | None = None) -> int:
        return len(self.log_records(transport))

    def point_count(self, transport: str | None = None) -> int:
        n = 0
        for _, _, m in self.metrics(transport):
            kind = m.WhichOneof("data")
            if kind is not None:
                n += len(getattr(m, kind).data_points)
        return n

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return predicate()
