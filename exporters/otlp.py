"""OTLP export through the OpenTelemetry SDK exporters: HTTP/protobuf by default, gRPC optional.

Our items become SDK objects (``ReadableSpan``, ``ReadableLogRecord``, ``MetricsData``) and go
straight to each signal's SDK exporter ``export()``, in a thread. No ``BatchSpanProcessor``
(it drops silently in bursts): batching, retries with backoff and the disk spool belong to
the agent's :class:`~infersight.agent.daemon.broadcast.ExporterWorker`. A failed export raises
:class:`~infersight.exporters.base.ExportError` (retryable).

Configuration follows the standard ``OTEL_*`` variables:

- endpoint: ``OTEL_EXPORTER_OTLP_<SIGNAL>_ENDPOINT`` (used as is) wins over our ``endpoint``
  argument, which wins over ``OTEL_EXPORTER_OTLP_ENDPOINT``. For HTTP the base endpoint gets
  ``/v1/traces``, ``/v1/metrics`` or ``/v1/logs`` appended. **No implicit localhost:** a signal
  with no endpoint anywhere is not exported (counted as ``unrouted_items``), and an exporter
  with no endpoint for any signal refuses to be built.
- protocol: ``OTEL_EXPORTER_OTLP_<SIGNAL>_PROTOCOL`` > ``protocol`` argument >
  ``OTEL_EXPORTER_OTLP_PROTOCOL`` > ``http/protobuf``. ``grpc`` needs the ``grpc`` extra.
- timeout: ``timeout_s`` > ``OTEL_EXPORTER_OTLP_<SIGNAL>_TIMEOUT`` > ``OTEL_EXPORTER_OTLP_TIMEOUT``
  > 10 s, read in **seconds** as the Python SDK does, capped at :data:`MAX_TIMEOUT_S`. It bounds
  one whole ``export()`` call: the SDK exporters (1.45) retry transient failures internally
  with backoff, but never past this deadline, and signals of one batch go out concurrently.
- headers, compression, certificate, client key/certificate, insecure (gRPC): read by the SDK
  exporters themselves from ``os.environ`` (signal-specific first). Our ``headers`` argument
  (``k=v,k2=v2``) is merged over the environment's. When a custom ``env`` mapping is given
  instead of ``os.environ``, those settings are resolved from it and passed explicitly.
- ``OTEL_SDK_DISABLED=true``: :func:`otlp_requested` is false (and :class:`OtlpExporter`
  itself raises :class:`OtlpConfigError`).

Delivery is at least once: when one signal of a batch fails and another succeeded, the worker
retries the whole batch, and the retry sends only the items that did not go out
(:mod:`~infersight.exporters.otlp_delivered`, bounded: an item forgotten is sent twice).
Header values are never logged nor put in ``state()``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast
from urllib.parse import urlsplit

from infersight import __version__
from infersight.exporters.base import ExporterError, ExportError
from infersight.exporters.log_repeats import quiet
from infersight.exporters.otlp_delivered import DeliveredItems
from infersight.telemetry import (
    ColdStart,
    HistogramPoint,
    Item,
    LogItem,
    MetricItem,
    NumberPoint,
    Resource,
    SpanItem,
)

log = logging.getLogger("infersight.exporters.otlp")

Signal = Literal["traces", "metrics", "logs"]
SIGNALS: tuple[Signal, ...] = ("traces", "metrics", "logs")
PROTOCOLS = ("http/protobuf", "grpc")
DEFAULT_PROTOCOL = "http/protobuf"
DEFAULT_TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 60.0
SEVERITY_MAX = 24


class OtlpConfigError(ExporterError, ValueError):
    """OTLP export cannot be set up as configured (no endpoint, bad protocol, missing extra)."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def sdk_disabled(env: Mapping[str, str] | None = None) -> bool:
    """``OTEL_SDK_DISABLED=true`` (case-insensitive), as the SDK reads it."""
    env = os.environ if env is None else env
    return _truthy(env.get("OTEL_SDK_DISABLED"))


def _sig_var(signal: Signal, what: str) -> str:
    return "OTEL_EXPORTER_OTLP_%s_%s" % (signal.upper(), what)


def _pick(env: Mapping[str, str], signal: Signal, what: str) -> str | None:
    """Signal-specific variable, then the generic one; empty counts as unset."""
    return env.get(_sig_var(signal, what)) or env.get("OTEL_EXPORTER_OTLP_" + what) or None


def resolve_protocol(signal: Signal, protocol: str | None, env: Mapping[str, str]) -> str:
    value = (
        env.get(_sig_var(signal, "PROTOCOL"))
        or protocol
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or DEFAULT_PROTOCOL
    ).strip().lower()
    if value not in PROTOCOLS:
        raise OtlpConfigError(
            "OTLP protocol %r for %s is not supported (use http/protobuf or grpc)" % (value, signal)
        )
    return value


def resolve_endpoint(
    signal: Signal, endpoint: str | None, protocol: str, env: Mapping[str, str]
) -> str | None:
    """The URL one signal goes to, or None when nothing configures one (no implicit localhost)."""
    specific = env.get(_sig_var(signal, "ENDPOINT"))
    if specific:
        return specific.strip()
    base = endpoint or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not base:
        return None
    base = base.strip()
    if protocol == "grpc":
        return base
    return "%s/v1/%s" % (base.rstrip("/"), signal)


def otlp_requested(endpoint: str | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Whether OTLP export is asked for: the SDK is not disabled and some signal has an endpoint
    (``endpoint``, or an ``OTEL_EXPORTER_OTLP_*ENDPOINT`` variable); no implicit localhost."""
    env = os.environ if env is None else env
    if sdk_disabled(env):
        return False
    return bool(endpoint) or any(
        env.get(v) for v in ["OTEL_EXPORTER_OTLP_ENDPOINT"] + [_sig_var(s, "ENDPOINT") for s in SIGNALS]
    )


def resolve_timeout(signal: Signal, timeout_s: float | None, env: Mapping[str, str]) -> float:
    if timeout_s is None:
        raw = _pick(env, signal, "TIMEOUT")
        try:
            timeout_s = float(raw) if raw is not None else DEFAULT_TIMEOUT_S
        except ValueError:
            raise OtlpConfigError(
                "bad OTLP timeout for %s: %r (seconds expected)" % (signal, raw)
            ) from None
    if not timeout_s > 0:
        raise OtlpConfigError("OTLP timeout must be positive, got %r" % timeout_s)
    if timeout_s > MAX_TIMEOUT_S:
        log.warning("OTLP %s timeout %.0f s capped at %.0f s", signal, timeout_s, MAX_TIMEOUT_S)
        timeout_s = MAX_TIMEOUT_S
    return timeout_s


def parse_headers(value: str | None) -> dict[str, str]:
    """``k=v,k2=v2`` (values percent-decoded), as ``OTEL_EXPORTER_OTLP_HEADERS``."""
    if not value:
        return {}
    from opentelemetry.util.re import parse_env_headers

    return {k.lower(): v for k, v in parse_env_headers(value, liberal=True).items()}


def safe_url(url: str) -> str:
    """The URL without credentials or query, for logs and ``state()``."""
    try:
        parts = urlsplit(url if "//" in url else "//" + url)
        host = parts.hostname or ""
        if ":" in host:
            host = "[%s]" % host
        netloc = host + (":%d" % parts.port if parts.port else "")
    except ValueError:
        return "<unparsable endpoint>"
    scheme = parts.scheme + "://" if parts.scheme else ""
    return scheme + netloc + parts.path


@dataclass
class _Route:
    signal: Signal
    protocol: str
    endpoint: str
    timeout_s: float
    exporter: Any  # the SDK exporter for this signal


def _read_file(path: str | None) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _build_sdk_exporter(
    signal: Signal,
    protocol: str,
    endpoint: str,
    timeout_s: float,
    headers: dict[str, str] | None,
    env: Mapping[str, str],
    custom_env: bool,
) -> Any:
    kwargs: dict[str, Any] = {"endpoint": endpoint, "timeout": timeout_s}
    if headers is not None:
        kwargs["headers"] = headers
    if protocol == "grpc":
        try:
            import grpc

            if signal == "traces":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcSpan,
                )

                cls: Any = GrpcSpan
            elif signal == "metrics":
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                    OTLPMetricExporter as GrpcMetric,
                )

                cls = GrpcMetric
            else:
                from opentelemetry.exporter.otlp.proto.grpc._log_exporter import (
                    OTLPLogExporter as GrpcLog,
                )

                cls = GrpcLog
        except ImportError as exc:
            raise OtlpConfigError(
                "OTLP protocol grpc needs the grpc extra (pip install 'infersight[grpc]'): %s" % exc
            ) from None
        if custom_env:
            comp = (_pick(env, signal, "COMPRESSION") or "none").strip().lower()
            if comp not in ("none", "gzip"):
                raise OtlpConfigError("unsupported OTLP gRPC compression %r" % comp)
            kwargs["compression"] = grpc.Compression.Gzip if comp == "gzip" else grpc.Compression.NoCompression
            insecure = _pick(env, signal, "INSECURE")
            if insecure is not None:
                kwargs["insecure"] = _truthy(insecure)
            cert = _pick(env, signal, "CERTIFICATE")
            if cert and not _truthy(insecure):
                try:
                    kwargs["credentials"] = grpc.ssl_channel_credentials(
                        root_certificates=_read_file(cert),
                        private_key=_read_file(_pick(env, signal, "CLIENT_KEY")),
                        certificate_chain=_read_file(_pick(env, signal, "CLIENT_CERTIFICATE")),
                    )
                except OSError as exc:
                    raise OtlpConfigError("OTLP %s certificate: %s" % (signal, exc)) from None
        return _record_grpc_status(cls(**kwargs), grpc.RpcError)

    from opentelemetry.exporter.otlp.proto.http import Compression

    if signal == "traces":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        cls = OTLPSpanExporter
    elif signal == "metrics":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        cls = OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter

        cls = OTLPLogExporter
    if custom_env:
        comp = (_pick(env, signal, "COMPRESSION") or "none").strip().lower()
        try:
            kwargs["compression"] = Compression(comp)
        except ValueError:
            raise OtlpConfigError("unsupported OTLP compression %r" % comp) from None
        for arg, what in (
            ("certificate_file", "CERTIFICATE"),
            ("client_key_file", "CLIENT_KEY"),
            ("client_certificate_file", "CLIENT_CERTIFICATE"),
        ):
            value = _pick(env, signal, what)
            if value:
                kwargs[arg] = value
    return _record_http_status(cls(**kwargs))


# The HTTP status of the last export on this thread: the SDK exporters return only
# SUCCESS/FAILURE, and the worker must tell a refused batch from a peer that is away.
_http_status = threading.local()
# Answers that mean "this batch is bad": the OTLP spec says drop, do not retry.
HTTP_FINAL = frozenset({400, 413, 415, 422})
# Answers that mean "the peer or its configuration is away": keep spooling, retry.
HTTP_AWAY = frozenset({401, 403, 404, 407, 408, 429, 502, 503, 504})


SDK_LOGGERS = tuple("opentelemetry.exporter.otlp.proto." + m for m in (
    "http._common", "http.trace_exporter", "http._log_exporter", "http.metric_exporter",
    "grpc.exporter", "grpc.trace_exporter", "grpc.metric_exporter", "grpc._log_exporter"))

_ERRNO = re.compile(r"\[Errno -?\d+\] [^'\")]{1,120}")


MAX_RETRY_AFTER_S = 300.0  # a longer (or odd) Retry-After is taken as this


def retry_after_s(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """A ``Retry-After`` header in seconds (delay-seconds or an HTTP-date), at most MAX_RETRY_AFTER_S; None
    when absent or unreadable."""
    raw = headers.get("Retry-After") if hasattr(headers, "get") else None
    if not raw:
        return None
    raw = str(raw).strip()
    if raw.isdigit():
        return min(float(raw), MAX_RETRY_AFTER_S)
    try:
        from email.utils import parsedate_to_datetime

        when = parsedate_to_datetime(raw).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return max(0.0, min(when - (time.time() if now is None else now), MAX_RETRY_AFTER_S))


GRPC_STATUS_DETAILS = "grpc-status-details-bin"  # a google.rpc.Status: OTLP's place for RetryInfo
GRPC_RETRY_INFO = "google.rpc.retryinfo-bin"  # RetryInfo alone, as the OTel SDK's exporter also reads it


def grpc_retry_delay_s(metadata: Any) -> float | None:
    """The delay a refused gRPC export asks for: ``google.rpc.RetryInfo`` in the status details of the answer's
    trailing metadata (the OTLP specification's throttling signal) or under its own key; at most
    MAX_RETRY_AFTER_S; None when there is none or it does not parse."""
    try:
        from google.rpc.error_details_pb2 import RetryInfo
        from google.rpc.status_pb2 import Status

        for key, value in metadata or ():
            info = None
            if key == GRPC_STATUS_DETAILS and isinstance(value, bytes):
                for detail in Status.FromString(value).details:
                    if detail.Is(RetryInfo.DESCRIPTOR):
                        info = RetryInfo()
                        detail.Unpack(info)
                        break
            elif key == GRPC_RETRY_INFO and isinstance(value, bytes):
                info = RetryInfo.FromString(value)
            if info is not None and info.HasField("retry_delay"):
                delay = float(info.retry_delay.seconds + info.retry_delay.nanos / 1e9)
                return max(0.0, min(delay, MAX_RETRY_AFTER_S))
    except Exception:  # a malformed detail is no delay: the worker's own backoff applies
        return None
    return None


def proxy_for(url: str) -> str | None:
    """The proxy (without credentials) that the environment's ``HTTP(S)_PROXY``/``NO_PROXY`` put between
    us and ``url`` (requests and gRPC both take it from there); None when there is none."""
    from urllib.request import getproxies, proxy_bypass  # (what requests consults too)

    try:
        u = urlsplit(url)
        proxies = getproxies()
        proxy = proxies.get("https" if u.scheme in ("https", "grpcs") else "http") or proxies.get("all")
        if not proxy or not u.hostname or proxy_bypass(u.hostname):
            return None
    except ValueError:
        return None
    return safe_url(proxy)


def _headers_of(result: Any) -> Mapping[str, str]:
    """A response's headers: a method of the SDK's transport result, an attribute of requests' response."""
    try:
        h = getattr(result, "headers", None)
        h = h() if callable(h) else h
    except Exception:  # "may raise if the returned headers are malformed"
        return {}
    return cast("Mapping[str, str]", h) if isinstance(h, Mapping) or hasattr(h, "get") else {}


def transport_error(exc: BaseException) -> str:
    """A transport failure in a few words: the OS error inside requests' wrapping when there is one
    ("[Errno 111] Connection refused"), else the exception's type and the start of its text."""
    text = str(exc)
    m = _ERRNO.search(text)
    if m is not None:
        return m.group(0).strip()
    return ("%s: %s" % (type(exc).__name__, text))[:160]


def _record_http_status(sdk: Any) -> Any:
    client: Any = getattr(sdk, "_client", None)
    export = getattr(client, "export", None)
    if client is None or export is None:  # another SDK version: every failure counts as "away"
        return sdk

    def recording_export(data: bytes) -> Any:
        _http_status.sent = True
        try:
            result = export(data)
        except Exception as exc:  # the SDK catches it, logs it and retries: status shows why
            _http_status.error = transport_error(exc)
            raise
        _http_status.code = getattr(result, "status_code", None)
        err = getattr(result, "error", None)  # the SDK's result carries the transport's exception
        if isinstance(err, BaseException) and _http_status.code is None:
            _http_status.error = transport_error(err)
        return result

    client.export = recording_export
    transport: Any = getattr(client, "_transport", None)
    request = getattr(transport, "request", None)
    if request is not None:  # each HTTP answer (the SDK's result keeps none of its headers)

        def recording_request(*args: Any, **kwargs: Any) -> Any:
            result = request(*args, **kwargs)
            if getattr(result, "status_code", None) in (429, 503):  # throttled, overloaded: when to call again
                _http_status.retry_after = retry_after_s(_headers_of(result))
            return result

        transport.request = recording_request
    sdk._infersight_records_status = True
    return sdk


# gRPC codes (OTLP spec): the batch is bad, or the collector failed on it.
GRPC_FINAL = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION"})
GRPC_REJECTED = frozenset({"INTERNAL", "UNKNOWN"})


class _RecordingStub:
    """The gRPC stub, recording whether a request went out and the status that came back."""

    def __init__(self, stub: Any, rpc_error: type[Exception]) -> None:
        self._stub = stub
        self._rpc_error = rpc_error
        self._asked_delay: type[_AskedDelayError] = type("AskedDelayError", (_AskedDelayError, rpc_error), {})

    def Export(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - the stub's name
        _http_status.sent = True
        try:
            return self._stub.Export(*args, **kwargs)
        except self._rpc_error as exc:
            code = getattr(exc, "code", None)
            _http_status.grpc = getattr(code(), "name", None) if callable(code) else None
            trailing = getattr(exc, "trailing_metadata", None)
            metadata = tuple(trailing() or ()) if callable(trailing) else ()
            asked = _http_status.retry_after = grpc_retry_delay_s(metadata)
            if asked is not None and not any(k == GRPC_RETRY_INFO for k, _ in metadata):
                # The SDK's own retry loop reads RetryInfo only under its own key: hand it the delay there, so
                # that it waits as asked (or leaves the wait to the worker) instead of calling back within 1 s.
                raise self._asked_delay(exc, metadata, asked) from exc
            raise


class _AskedDelayError(ExporterError):
    """A refused gRPC export whose answer asked for a delay, as the SDK's retry loop reads it (each stub makes it a
    subclass of the transport's ``RpcError``, so that the SDK catches it)."""

    def __init__(self, exc: Exception, metadata: tuple[Any, ...], delay_s: float) -> None:
        super().__init__(str(exc))
        self._exc = exc
        self._metadata = (*metadata, (GRPC_RETRY_INFO, _retry_info_bytes(delay_s)))

    def code(self) -> Any:
        return self._exc.code()  # type: ignore[attr-defined]

    def details(self) -> Any:
        return self._exc.details()  # type: ignore[attr-defined]

    def trailing_metadata(self) -> tuple[Any, ...]:
        return self._metadata


def _retry_info_bytes(delay_s: float) -> bytes:
    from google.rpc.error_details_pb2 import RetryInfo

    info = RetryInfo()
    info.retry_delay.FromNanoseconds(int(delay_s * 1e9))
    return bytes(info.SerializeToString())


def _record_grpc_status(sdk: Any, rpc_error: type[Exception]) -> Any:
    stub_cls = getattr(sdk, "_stub", None)
    if stub_cls is None or getattr(sdk, "_client", None) is None:  # another SDK version
        return sdk
    sdk._stub = lambda channel: _RecordingStub(stub_cls(channel), rpc_error)  # the channel is rebuilt at times
    sdk._client = _RecordingStub(sdk._client, rpc_error)
    sdk._infersight_records_status = True
    return sdk


def classify_grpc_failure(code: str | None) -> str:
    if code in GRPC_FINAL:
        return "final"
    if code in GRPC_REJECTED:
        return "rejected"
    return "away"  # UNAVAILABLE, DEADLINE_EXCEEDED ..., and UNAUTHENTICATED, NOT_FOUND (configuration)


def classify_failure(status: int | None) -> str:
    """``away`` (retry without limit), ``rejected`` (retry, capped) or ``final`` (drop)."""
    if status is None or status in HTTP_AWAY or status < 400:
        return "away"
    if status in HTTP_FINAL or 400 <= status < 500:
        return "final"
    return "rejected"


class OtlpExporter:
    """Exports spans, logs and metrics over OTLP (HTTP/protobuf or gRPC) via the SDK exporters.

    Raises :class:`OtlpConfigError` at construction when OTLP export cannot work as configured:
    ``OTEL_SDK_DISABLED=true``, no endpoint for any signal, an unknown protocol, or ``grpc``
    without grpcio. :func:`otlp_requested` tells the first two cases apart beforehand.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        protocol: str | None = None,
        headers: str | None = None,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = "otlp"
        custom_env = env is not None and env is not os.environ
        env = os.environ if env is None else env
        if sdk_disabled(env):
            raise OtlpConfigError("OTEL_SDK_DISABLED=true: OTLP export is disabled")
        explicit_headers = parse_headers(headers)
        self.routes: dict[Signal, _Route] = {}
        for signal in SIGNALS:
            proto = resolve_protocol(signal, protocol, env)
            url = resolve_endpoint(signal, endpoint, proto, env)
            if url is None:
                continue
            timeout = resolve_timeout(signal, timeout_s, env)
            hdrs: dict[str, str] | None = None
            if explicit_headers or custom_env:
                hdrs = parse_headers(_pick(env, signal, "HEADERS"))
                hdrs.update(explicit_headers)
            sdk = _build_sdk_exporter(signal, proto, url, timeout, hdrs, env, custom_env)
            self.routes[signal] = _Route(signal, proto, url, timeout, sdk)
        if not self.routes:
            raise OtlpConfigError(
                "no OTLP endpoint: set OTEL_EXPORTER_OTLP_ENDPOINT (or a per-signal "
                "OTEL_EXPORTER_OTLP_<SIGNAL>_ENDPOINT); there is no implicit localhost"
            )
        # The SDK logs an error per failed request, and per retry while the collector is away: once a minute
        quiet(*SDK_LOGGERS)
        self._resources: dict[Resource, Any] = {}
        self._retry_after: float | None = None  # the longest Retry-After of the last export's answers
        self._scope: Any = None
        self._lock = threading.Lock()
        self._closed = False
        # Counters.
        self.spans_exported = 0
        self.log_records_exported = 0
        self.metric_points_exported = 0
        self.export_calls = 0
        self.export_failures = 0  # failed signal exports (one batch may count up to three)
        self.failed_items = 0
        self.skipped_items = 0  # ColdStart summaries: their spans travel as SpanItems
        self.unrouted_items = 0  # a signal without any endpoint
        self.invalid_items = 0  # bad ids that cannot be encoded
        self.not_resent_items = 0  # items of a signal that went out while another failed: not sent again on a retry
        self.last_error = ""
        # items that went out while another signal of their batch failed: the retry of that batch (from memory or
        # from the spool, regrouped or not) sends the others only
        self._delivered = DeliveredItems()

    # -- protocol ---------------------------------------------------------------------------

    async def start(self) -> None:
        for r in self.routes.values():
            log.info(
                "OTLP %s -> %s (%s, timeout %.1f s)", r.signal, safe_url(r.endpoint), r.protocol, r.timeout_s
            )

    async def export(self, batch: Sequence[Item]) -> None:
        if self._closed:
            raise ExportError("OTLP exporter is shut down")  # spooled for the next start
        self.export_calls += 1
        spans: list[SpanItem] = []
        metrics: list[MetricItem] = []
        logs: list[LogItem] = []
        for it in batch:
            if isinstance(it, SpanItem):
                spans.append(it)
            elif isinstance(it, LogItem):
                logs.append(it)
            elif isinstance(it, MetricItem):
                metrics.append(it)
            elif isinstance(it, ColdStart):
                self.skipped_items += 1
        jobs: list[tuple[Signal, Sequence[Any]]] = []
        skipped: list[bytes] = []  # items that went out on an earlier attempt of this batch
        grouped: tuple[tuple[Signal, Sequence[Any]], ...] = (
            ("traces", spans),
            ("metrics", metrics),
            ("logs", logs),
        )
        now = time.monotonic()
        for signal, all_items in grouped:
            if not all_items:
                continue
            if signal not in self.routes:
                self.unrouted_items += len(all_items)
                continue
            items, already = self._delivered.split(all_items, now)
            skipped += already
            self.not_resent_items += len(already)
            if items:
                jobs.append((signal, items))
        if not jobs:
            self._delivered.forget(skipped)
            return
        self._retry_after = None
        results = await asyncio.gather(
            *(asyncio.to_thread(self._export_signal, sig, items) for sig, items in jobs)
        )
        errors = [e for e in results if e is not None]
        if errors:
            self.last_error = "; ".join(why for why, _kind in errors)
            kinds = {kind for _why, kind in errors}
            # The items of a signal that went out are remembered, and the retry of the batch sends only the others,
            # however it is regrouped (an item forgotten, or retried after the agent restarted, is sent again:
            # at-least-once). A signal whose peer is away keeps the batch retried; otherwise a refusal decides.
            now = time.monotonic()
            self._delivered.touch(skipped, now)
            for (_sig, sent), res in zip(jobs, results, strict=True):
                if res is None:
                    self._delivered.remember(sent, now)
            if "away" in kinds:
                raise ExportError(self.last_error, retry_after_s=self._retry_after)
            raise ExportError(self.last_error, retryable="final" not in kinds, rejected=True)
        self._delivered.forget(skipped)

    async def force_flush(self, timeout_s: float) -> bool:
        # Nothing is buffered here: each export() call goes out synchronously.
        return not self._closed

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for r in self.routes.values():
            try:
                await asyncio.to_thread(r.exporter.shutdown)
            except Exception as exc:
                log.debug("OTLP %s exporter shutdown: %r", r.signal, exc)

    def state(self) -> dict[str, int | float | str]:
        out: dict[str, int | float | str] = {
            "spans_exported": self.spans_exported,
            "log_records_exported": self.log_records_exported,
            "metric_points_exported": self.metric_points_exported,
            "export_calls": self.export_calls,
            "export_failures": self.export_failures,
            "failed_items": self.failed_items,
            "skipped_items": self.skipped_items,
            "unrouted_items": self.unrouted_items,
            "invalid_items": self.invalid_items,
            "not_resent_items": self.not_resent_items,
            "last_error": self.last_error,
        }
        for r in self.routes.values():
            out["%s_endpoint" % r.signal] = "%s %s" % (r.protocol, safe_url(r.endpoint))
        return out

    # -- in a worker thread -----------------------------------------------------------------

    def _export_signal(self, signal: Signal, items: Sequence[Any]) -> tuple[str, str] | None:
        """None when delivered, else (why, how it failed: see :func:`classify_failure`)."""
        route = self.routes[signal]
        _http_status.code = None
        _http_status.grpc = None
        _http_status.sent = False
        _http_status.error = None
        _http_status.retry_after = None
        try:
            if signal == "traces":
                data: Any = self._spans(items)
                count = len(data)
            elif signal == "logs":
                data = self._logs(items)
                count = len(data)
            else:
                data, count = self._metrics(items)
            if not count:
                return None
            result = route.exporter.export(data)
            ok = getattr(result, "name", "") == "SUCCESS"
            why = "" if ok else "export result %s" % getattr(result, "name", result)
        except Exception as exc:  # the SDK may raise on odd data or transport bugs
            ok, count, why = False, len(items), type(exc).__name__ + ": " + str(exc)
        with self._lock:
            if ok:
                if signal == "traces":
                    self.spans_exported += count
                elif signal == "logs":
                    self.log_records_exported += count
                else:
                    self.metric_points_exported += count
                return None
            self.export_failures += 1
            self.failed_items += len(items)
        asked = getattr(_http_status, "retry_after", None)
        if asked is not None:
            with self._lock:
                self._retry_after = max(self._retry_after or 0.0, asked)
        status = getattr(_http_status, "code", None) if route.protocol != "grpc" else None
        grpc_code = getattr(_http_status, "grpc", None) if route.protocol == "grpc" else None
        kind = classify_grpc_failure(grpc_code) if route.protocol == "grpc" else classify_failure(status)
        if status is not None:
            why += " (HTTP %d)" % status
        elif grpc_code is not None:
            why += " (gRPC %s)" % grpc_code
        elif getattr(_http_status, "error", None):
            why += " (%s)" % _http_status.error  # no answer at all: refused, unreachable, timed out
        elif getattr(route.exporter, "_infersight_records_status", False) and not _http_status.sent:
            kind = "final"  # the SDK could not encode the batch (a lone surrogate, too large)
            why += " (not encodable)"
        if status is None and kind != "final" and (proxy := proxy_for(route.endpoint)) is not None:
            why += " through the proxy %s (HTTP(S)_PROXY; NO_PROXY does not name this host)" % proxy
        return ("OTLP %s %s to %s failed: %s" % (route.protocol, signal, safe_url(route.endpoint), why),
                kind)

    def _sdk_resource(self, r: Resource) -> Any:
        cached = self._resources.get(r)
        if cached is None:
            with self._lock:
                if len(self._resources) > 1024:
                    self._resources.clear()
                cached = self._resources[r] = self._new_resource(r)
        return cached

    @staticmethod
    def _new_resource(r: Resource) -> Any:
        from opentelemetry.sdk.resources import Resource as SdkResource

        # Our items already carry the merged resource (OTEL_RESOURCE_ATTRIBUTES, service.name):
        # send exactly it, without the SDK's defaults.
        return SdkResource(r.as_dict())

    def _scope_obj(self) -> Any:
        if self._scope is None:
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope

            self._scope = InstrumentationScope("infersight", __version__)
        return self._scope

    def _spans(self, items: Sequence[SpanItem]) -> list[Any]:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
        from opentelemetry.trace.status import Status, StatusCode

        sampled = TraceFlags(TraceFlags.SAMPLED)
        scope = self._scope_obj()
        unset = Status(StatusCode.UNSET)
        out: list[Any] = []
        for s in items:
            try:
                trace_id = int(s.trace_id, 16)
                span_id = int(s.span_id, 16)
                parent_id = int(s.parent_span_id, 16) if s.parent_span_id else 0
            except ValueError:
                trace_id = span_id = 0
            if not trace_id or not span_id:
                with self._lock:
                    self.invalid_items += 1
                continue
            ctx = SpanContext(trace_id, span_id, is_remote=False, trace_flags=sampled)
            parent = (
                SpanContext(trace_id, parent_id, is_remote=False, trace_flags=sampled) if parent_id else None
            )
            out.append(
                ReadableSpan(
                    name=s.name,
                    context=ctx,
                    parent=parent,
                    resource=self._sdk_resource(s.resource),
                    attributes=s.attributes,
                    events=[Event(e.name, e.attributes, e.time_ns) for e in s.events],
                    kind=SpanKind.INTERNAL,
                    status=Status(StatusCode.ERROR, s.error) if s.error is not None else unset,
                    start_time=s.start_ns,
                    end_time=s.end_ns,
                    instrumentation_scope=scope,
                )
            )
        return out

    def _logs(self, items: Sequence[LogItem]) -> list[Any]:
        from opentelemetry._logs import LogRecord, SeverityNumber
        from opentelemetry.context import Context
        from opentelemetry.sdk._logs import ReadableLogRecord
        from opentelemetry.trace import TraceFlags

        scope = self._scope_obj()
        empty = Context()  # never pick up a current span from this thread
        out: list[Any] = []
        for x in items:
            trace_id = span_id = 0
            if x.trace_id and x.span_id:
                try:
                    trace_id, span_id = int(x.trace_id, 16), int(x.span_id, 16)
                except ValueError:
                    trace_id = span_id = 0
            sev = x.severity_number if 0 <= x.severity_number <= SEVERITY_MAX else 0
            record = LogRecord(
                timestamp=x.time_ns,
                observed_timestamp=x.time_ns,
                context=empty,
                severity_text=x.severity_text,
                severity_number=SeverityNumber(sev),
                body=x.body,
                attributes=x.attributes,
                event_name=x.event_name,
            )
            # Set after construction: LogRecord falls back to the current span's ids for 0.
            record.trace_id = trace_id
            record.span_id = span_id
            record.trace_flags = TraceFlags(TraceFlags.SAMPLED if trace_id else TraceFlags.DEFAULT)
            out.append(
                ReadableLogRecord(
                    log_record=record, resource=self._sdk_resource(x.resource), instrumentation_scope=scope
                )
            )
        return out

    def _metrics(self, items: Sequence[MetricItem]) -> tuple[Any, int]:
        from opentelemetry.sdk.metrics.export import (
            AggregationTemporality,
            Gauge,
            Histogram,
            HistogramDataPoint,
            Metric,
            MetricsData,
            NumberDataPoint,
            ResourceMetrics,
            ScopeMetrics,
            Sum,
        )

        cumulative = AggregationTemporality.CUMULATIVE
        by_resource: dict[int, tuple[Any, list[Any]]] = {}
        count = 0
        for m in items:
            data: Gauge | Sum | Histogram
            if m.kind == "histogram":
                hps = [
                    HistogramDataPoint(
                        attributes=p.attributes,
                        start_time_unix_nano=m.start_ns,
                        time_unix_nano=m.time_ns,
                        count=p.count,
                        sum=p.sum,
                        bucket_counts=list(p.bucket_counts),
                        explicit_bounds=list(p.bounds),
                        min=cast(float, p.min),  # None leaves the optional field unset
                        max=cast(float, p.max),
                    )
                    for p in m.points
                    if isinstance(p, HistogramPoint)
                ]
                data = Histogram(data_points=hps, aggregation_temporality=cumulative)
                n = len(hps)
            else:
                nps = [
                    NumberDataPoint(
                        attributes=p.attributes,
                        start_time_unix_nano=m.start_ns,
                        time_unix_nano=m.time_ns,
                        value=p.value,
                    )
                    for p in m.points
                    if isinstance(p, NumberPoint)
                ]
                if m.kind == "sum":
                    data = Sum(data_points=nps, aggregation_temporality=cumulative, is_monotonic=m.monotonic)
                else:
                    data = Gauge(data_points=nps)
                n = len(nps)
            if not n:
                continue
            count += n
            res = self._sdk_resource(m.resource)
            _, metrics = by_resource.setdefault(id(res), (res, []))
            metrics.append(Metric(name=m.name, description=m.description, unit=m.unit, data=data))
        scope = self._scope_obj()
        data_out = MetricsData(
            resource_metrics=[
                ResourceMetrics(
                    resource=res,
                    scope_metrics=[ScopeMetrics(scope=scope, metrics=metrics, schema_url="")],
                    schema_url="",
                )
                for res, metrics in by_resource.values()
            ]
        )
        return data_out, count
