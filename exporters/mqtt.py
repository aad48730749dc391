"""MQTT export with aiomqtt: QoS 1 events, retained status with last will, reconnect with backoff.

One background task owns the connection. aiomqtt 2.x does not reconnect by itself, so the
task loops around ``async with aiomqtt.Client(...)`` with jittered, capped exponential backoff,
building a fresh client for every attempt (inside the running loop, and so that no stale paho
state survives a broken connection). On connect it publishes ``online`` (retained) on its
status topic and the birth message; its last will is ``offline`` (retained).

``export()`` publishes every message of a batch at the configured QoS and returns once the
broker acknowledged them all (PUBACK for QoS 1). While the connection is down, or if it drops
before every acknowledgement came back, it raises :class:`ExportError`: the agent's
:class:`~infersight.agent.daemon.broadcast.ExporterWorker` then spools the batch to disk and replays it
in order once we are back. A batch that failed half way is published again as a whole, so
delivery is **at least once**; subscribers dedupe on ``(producer, seq)`` of the payload.

Two identities:

- daemon (``embedded=False``): client id ``infersight-<host>-agent``, persistent session
  (v5 session expiry / 3.1.1 ``clean_session=False``), status ``<prefix>/<host>/status``,
  retained birth on ``<prefix>/<host>/birth``; ``offline`` (retained) on clean shutdown.
- ``infersight launch`` (``embedded=True``): client id ``infersight-<host>-launch-<pid>``,
  clean session, status ``<prefix>/<host>/launch/<pid>/status``; on clean exit it publishes
  ``offline`` (not retained) and clears the retained status.

TLS (``mqtts://``) verifies the server against the system store or ``ca_file`` by default.
Passwords never appear in logs, errors or ``state()``: URLs go through ``mask_url``.

The exporter takes one :class:`~infersight.exporters.mqtt_settings.MqttSettings`, validated
when it was made; :func:`from_config` makes both from a configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import os
import random
import ssl
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import aiomqtt
from aiomqtt.exceptions import MqttCodeError, MqttConnectError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from infersight import __version__
from infersight.exporters.base import ExportError
from infersight.exporters.mqtt_payload import OFFLINE, ONLINE, Outgoing, birth_payload, dumps, encode_batch
from infersight.exporters.mqtt_settings import (
    MQTT_KEYS,
    MqttConfigError,
    MqttSettings,
    mqtt_requested,
    parse_url,
    settings_from_config,
)
from infersight.redact import mask_url
from infersight.sanitize import log_text
from infersight.settings import Config, ConfigError
from infersight.telemetry import ColdStartProgress, Item, MetricItem, RoutingHint

log = logging.getLogger("infersight.exporters.mqtt")
ENCODE_CHUNK_ITEMS = 256  # a large batch is encoded this many items at a time, while publishing


def _group_key(item: Item) -> tuple[object, ...] | None:
    """What encode_batch merges across items: metric snapshots (resource, time) and the
    newest retained progress per service."""
    if isinstance(item, MetricItem):
        return ("m", item.resource, item.time_ns)
    if isinstance(item, ColdStartProgress):
        return ("p", item.service)
    if isinstance(item, RoutingHint):
        return ("r", item.service, item.port)
    return None


def split_batch(batch: Sequence[Item], size: int) -> Iterator[Sequence[Item]]:
    """The batch in chunks of about ``size`` items, each ending only where no group that
    :func:`encode_batch` merges continues after it (so encoding chunk by chunk gives the
    same messages as encoding the whole)."""
    if len(batch) <= size:
        yield batch
        return
    keys = [_group_key(it) for it in batch]
    last = {k: i for i, k in enumerate(keys) if k is not None}
    if not last:  # events only: any cut will do
        for start in range(0, len(batch), size):
            yield batch[start : start + size]
        return
    start, reach = 0, -1
    for i, k in enumerate(keys):
        if k is not None:
            reach = max(reach, last[k])
        if i + 1 - start >= size and reach <= i:
            yield batch[start : i + 1]
            start = i + 1
    if start < len(batch):
        yield batch[start:]


PROTOCOLS = {"5": aiomqtt.ProtocolVersion.V5, "3.1.1": aiomqtt.ProtocolVersion.V311}
AUTH_REASONS = {4, 5, 134, 135}  # 3.1.1 and v5 codes for bad credentials / not authorised
CONTROL_TIMEOUT_S = 5.0  # status, birth and the final offline publish


def _retrieve_disconnect(client: Any) -> None:
    """aiomqtt sets its client's disconnect future's exception when a link breaks; a client we leave (a stalled
    broker's, after a connect timeout) never has it awaited, and asyncio logged "Future exception was never
    retrieved" at the agent's stop. Read it: its error is already said (``last_error``)."""
    fut = getattr(client, "_disconnected", None)
    if isinstance(fut, asyncio.Future):
        fut.add_done_callback(_read_exception)  # now if done, else when paho says the link is gone


def _read_exception(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, MqttConnectError) and exc.rc is not None:
        code = getattr(exc.rc, "value", exc.rc)
        reason = str(exc.rc) if not isinstance(exc.rc, int) else str(exc).split(": ", 1)[-1]
        text = "broker refused the connection: %s (code %s)" % (reason, code)
        if code in AUTH_REASONS:
            text += "; check exporters.mqtt.username / password"
        return text
    if isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return "TLS: the broker's certificate did not verify (%s); set exporters.mqtt.ca_file" % (
            getattr(exc, "verify_message", None) or exc
        )
    return str(exc) or type(exc).__name__


def _properties(packet_type: int) -> Properties:
    return Properties(packet_type)  # type: ignore[no-untyped-call]


MAX_REFUSALS_HELD = 4096  # refusals of publishes whose task went away before it looked
# The message id of the last publish made in this task (each publisher is its own task).
_last_mid: contextvars.ContextVar[int] = contextvars.ContextVar("infersight_mqtt_last_mid", default=-1)



def tls_context(st: MqttSettings) -> ssl.SSLContext:
    """The TLS context of ``st``'s files; MqttConfigError when one cannot be read (a reload checks
    it too, so that a file the next start would refuse is refused at once)."""
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=st.ca_file)
        if st.cert_file:
            ctx.load_cert_chain(st.cert_file, st.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise MqttConfigError("MQTT TLS files: %s" % exc) from None
    if not st.tls_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx

class Refusals:
    """The broker's refusals (a PUBACK/PUBREC reason code >= 0x80), by message id.

    aiomqtt 2.x completes a publish on any acknowledgement and drops its reason code, so a
    message the broker refused (not authorised, too large, quota exceeded...) would count as
    delivered. This wraps the paho client under one aiomqtt client: its ``publish`` notes the
    message id in the calling task, its ``on_publish`` notes each refusal; :meth:`take` tells
    the publishing task, once its publish returned, whether the broker refused it."""

    def __init__(self, client: aiomqtt.Client) -> None:
        self.refused: dict[int, object] = {}
        paho = getattr(client, "_client", None)  # aiomqtt exposes no acknowledgement's reason code
        if paho is None:  # another aiomqtt: refusals count as delivered, as aiomqtt says
            log.warning("aiomqtt %s: cannot read the broker's refusals", getattr(aiomqtt, "__version__", "?"))
            return
        publish = paho.publish
        on_publish: Any = paho.on_publish  # aiomqtt's own (paho types it as either callback version)

        def noting_publish(*args: Any, **kwargs: Any) -> Any:
            info = publish(*args, **kwargs)
            _last_mid.set(info.mid)
            return info

        def noting_on_publish(c: Any, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
            if getattr(reason_code, "is_failure", False):
                if len(self.refused) >= MAX_REFUSALS_HELD:  # refusals no publisher asked about
                    self.refused.clear()
                self.refused[mid] = reason_code
            on_publish(c, userdata, mid, reason_code, properties)

        paho.publish = noting_publish  # type: ignore[method-assign]
        paho.on_publish = noting_on_publish

    def take(self) -> object | None:
        """The refusal of this task's last publish, or None when the broker took it."""
        return self.refused.pop(_last_mid.get(), None) if self.refused else None


class _Conn:
    __slots__ = ("client", "lost", "refusals")

    def __init__(self, client: aiomqtt.Client, refusals: Refusals | None = None) -> None:
        self.client = client
        self.lost = asyncio.Event()
        self.refusals = refusals or Refusals(client)


class MqttExporter:
    """The MQTT sink behind the :class:`~infersight.exporters.base.Exporter` protocol."""

    def __init__(self, settings: MqttSettings) -> None:
        self.name = "mqtt"
        self.settings = settings
        self.url = mask_url(settings.url)
        self.address = settings.address
        self._username, self._password = settings.credentials
        self.qos = settings.qos
        self.protocol = settings.protocol
        self.embedded = settings.embedded
        self.pid = settings.launch_pid if settings.launch_pid is not None else os.getpid()
        self.topics = settings.topics
        if settings.client_id:
            self.client_id = settings.client_id
        elif self.embedded:
            self.client_id = "infersight-%s-launch-%d" % (self.topics.host, self.pid)
        else:
            self.client_id = "infersight-%s-agent" % self.topics.host
        self.status_topic = self.topics.launch_status(self.pid) if self.embedded else self.topics.status
        self.birth_topic = self.topics.launch_birth(self.pid) if self.embedded else self.topics.birth
        self.birth_retained = not self.embedded
        self.started_ns = time.time_ns()
        self._tls = self._tls_context() if self.address.tls else None
        # Runtime state (the loop-bound objects are made in start()).
        self._conn: _Conn | None = None
        self._attempt: asyncio.Future[bool] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing: asyncio.Event | None = None
        self._inflight = 0
        self._idle: asyncio.Event | None = None
        self._shut = False
        self._json_props: Properties | None = None
        # Counters for state().
        self.connects = 0
        self.connect_failures = 0
        self.disconnects = 0
        self.published_messages = 0
        self.delivered_items = 0
        self.skipped_items = 0
        self.failed_batches = 0
        self.oversized_messages = 0
        self.refused_messages = 0  # the broker acknowledged them with a failure reason code
        self.refused_items = 0
        self.unencodable_items = 0  # items no message could be made of (dropped, counted)
        self.undelivered_at_exit = 0
        self.last_error = ""
        self._logged_error = ""
        self._logged_at: dict[str, float] = {}

    # -- setup ---------------------------------------------------------------------------------

    def _tls_context(self) -> ssl.SSLContext:
        return tls_context(self.settings)

    def _new_client(self) -> aiomqtt.Client:
        v5 = self.protocol == "5"
        props: Properties | None = None
        if v5:
            props = _properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 0 if self.embedded else self.settings.session_expiry_s
        will = aiomqtt.Will(self.status_topic, OFFLINE, qos=1, retain=True)
        kwargs: dict[str, Any] = {}
        if v5:
            kwargs["clean_start"] = self.embedded  # daemon resumes its session
        else:
            kwargs["clean_session"] = self.embedded
        client = aiomqtt.Client(
            self.address.host,
            self.address.port,
            username=self._username,
            password=self._password,
            identifier=self.client_id,
            protocol=PROTOCOLS[self.protocol],
            will=will,
            keepalive=self.settings.keepalive,
            timeout=self.settings.connect_timeout_s,
            max_inflight_messages=self.settings.max_inflight,
            properties=props,
            tls_context=self._tls,
            logger=logging.getLogger("infersight.exporters.mqtt.client"),
            **kwargs,
        )
        client.pending_calls_threshold = 1 << 30  # a batch has many publishes in flight by design
        return client

    # -- the Exporter protocol -----------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        self._closing = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        if self.protocol == "5":
            self._json_props = _properties(PacketTypes.PUBLISH)
            self._json_props.ContentType = "application/json"
            self._json_props.PayloadFormatIndicator = 1
        loop = asyncio.get_running_loop()
        self._attempt = loop.create_future()
        self._task = loop.create_task(self._run(), name="mqtt-connection")

    async def export(self, batch: Sequence[Item]) -> None:
        """Publish the batch and wait for every acknowledgement.

        A large batch is encoded a chunk at a time while the previous chunk's messages are
        in flight, so the broker's window never waits for the whole batch to be encoded.
        Chunks end only where no metric snapshot or retained progress topic spans them, so
        the messages are the ones :func:`encode_batch` makes of the whole batch."""
        chunks = iter(split_batch(batch, ENCODE_CHUNK_ITEMS))
        skipped = [0]
        first: list[Outgoing] = []
        for chunk in chunks:  # encode up to the first message: a batch with none needs no broker
            first = self._encode(chunk, skipped)
            if first:
                break
        if not first:
            return
        failure: list[BaseException] = []
        sent = [0]

        def messages() -> Iterator[Outgoing]:
            sent[0] += len(first)
            yield from first
            try:
                for chunk in chunks:
                    msgs = self._encode(chunk, skipped)
                    sent[0] += len(msgs)
                    yield from msgs
            except Exception as exc:  # an encoding bug, not the broker's fault: raised below
                failure.append(exc)

        conn = await self._ready()
        assert self._idle is not None
        refused_before = self.refused_items
        self._inflight += 1
        self._idle.clear()
        try:
            await self._publish_all(conn, messages(), len(first) if len(batch) <= ENCODE_CHUNK_ITEMS else None)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        if failure:
            raise failure[0]
        self.published_messages += sent[0]
        self.delivered_items += max(0, len(batch) - skipped[0] - (self.refused_items - refused_before))

    def _encode(self, chunk: Sequence[Item], skipped: list[int]) -> list[Outgoing]:
        try:
            msgs, n_skipped = encode_batch(chunk, self.topics)
            for m in msgs:
                m.topic.encode()  # paho raises on a topic that is not UTF-8, on the loop
        except Exception:  # one bad item: it alone is dropped, the items behind it go on
            msgs, n_skipped = self._encode_each(chunk, skipped)
        self.skipped_items += n_skipped
        skipped[0] += n_skipped
        if any(len(m.payload) > self.settings.max_payload_bytes for m in msgs):
            # A message the broker would refuse must not block the spool forever: drop, count, say.
            big = [m for m in msgs if len(m.payload) > self.settings.max_payload_bytes]
            self.oversized_messages += len(big)
            log.warning(
                "mqtt %s: dropped %d message(s) over max_payload_bytes=%d (first on %s, %d bytes)",
                self.url,
                len(big),
                self.settings.max_payload_bytes,
                big[0].topic,
                len(big[0].payload),
            )
            msgs = [m for m in msgs if len(m.payload) <= self.settings.max_payload_bytes]
        return msgs

    def _encode_each(self, chunk: Sequence[Item], skipped: list[int]) -> tuple[list[Outgoing], int]:
        """:func:`encode_batch` item by item, dropping and counting the items that fail (a value
        no JSON or topic can carry). Slower, and metric snapshots are not merged across items:
        only a chunk that failed as a whole comes here."""
        msgs: list[Outgoing] = []
        n_skipped = 0
        for item in chunk:
            try:
                one, n = encode_batch([item], self.topics)
                for m in one:
                    m.topic.encode()
            except Exception as exc:
                self.unencodable_items += 1
                skipped[0] += 1  # not delivered: not counted as delivered either
                self._rlog("unencodable", "dropped an item no MQTT message can carry (%s: %s)",
                           type(exc).__name__, exc)
                continue
            msgs += one
            n_skipped += n
        return msgs, n_skipped

    def _rlog(self, key: str, msg: str, *args: object) -> None:
        """One warning per key per minute: a hostile producer must not flood the log."""
        now = time.monotonic()
        if now - self._logged_at.get(key, -1e9) >= 60.0:
            self._logged_at[key] = now
            # a topic or an error quotes producers' text: one bounded line each (infersight.sanitize.log_text)
            log.warning("mqtt %s: " + msg, self.url,
                        *(a if isinstance(a, (int, float)) else log_text(a) for a in args))

    async def settle(self, worker: _Worker) -> None:
        """An embedded agent's session ended (``launch`` at exit): :func:`wait_delivered`."""
        await wait_delivered(self, worker)

    async def force_flush(self, timeout_s: float) -> bool:
        """Wait for exports in flight. ``export`` itself awaits every acknowledgement."""
        if self._idle is None:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
        except TimeoutError:
            return False
        return True

    async def shutdown(self) -> None:
        """Say goodbye on the status topic, then disconnect cleanly (so no last will). Idempotent.

        Bounded: ``CONTROL_TIMEOUT_S`` per step, and no more than ``exit_wait_s`` in embedded mode.
        """
        if self._shut:
            return
        self._shut = True
        limit = min(CONTROL_TIMEOUT_S, max(0.2, self.settings.exit_wait_s)) if self.embedded else CONTROL_TIMEOUT_S
        conn = self._conn
        if conn is not None and not conn.lost.is_set():
            try:
                if self.embedded:
                    # Live watchers see offline; the retained status goes away with the launch.
                    await conn.client.publish(self.status_topic, OFFLINE, qos=1, retain=False, timeout=limit)
                    await conn.client.publish(self.status_topic, b"", qos=1, retain=True, timeout=limit)
                else:
                    await conn.client.publish(self.status_topic, OFFLINE, qos=1, retain=True, timeout=limit)
            except Exception as exc:
                log.warning("mqtt %s: could not publish the final status: %s", self.url, _describe(exc))
        if self._closing is not None:
            self._closing.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), limit)
            except (TimeoutError, Exception):
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._task
        self._conn = None

    def problem(self) -> str:
        """A broker this exporter cannot use as configured, at once rather than after the
        agent's stall time: its certificate does not verify, or it refuses our credentials.
        A broker that is merely away is not one ("" then, as while connected)."""
        if self.connected or not self.last_error.startswith("cannot connect: "):
            return ""
        if "TLS:" in self.last_error or "username / password" in self.last_error:
            return self.last_error
        return ""

    def state(self) -> dict[str, int | float | str]:
        return {
            "url": self.url,
            "client_id": self.client_id,
            "protocol": self.protocol,
            "qos": self.qos,
            "status_topic": self.status_topic,
            "connected": int(self.connected),
            "connects": self.connects,
            "connect_failures": self.connect_failures,
            "disconnects": self.disconnects,
            "published_messages": self.published_messages,
            "delivered_items": self.delivered_items,
            "skipped_items": self.skipped_items,
            "failed_batches": self.failed_batches,
            "oversized_messages": self.oversized_messages,
            "refused_messages": self.refused_messages,
            "refused_items": self.refused_items,
            "unencodable_items": self.unencodable_items,
            "undelivered_at_exit": self.undelivered_at_exit,
            "last_error": self.last_error,
        }

    # -- extras --------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.lost.is_set()

    async def wait_connected(self, timeout_s: float) -> bool:
        """True once connected (for ``launch``'s bounded wait at exit, and for tests)."""
        deadline = time.monotonic() + timeout_s
        while not self.connected:
            if time.monotonic() >= deadline or self._task is None or self._task.done():
                return False
            await asyncio.sleep(0.02)
        return True

    # -- internals -----------------------------------------------------------------------------

    def _birth(self) -> bytes:
        return dumps(birth_payload(
            host=self.settings.host_name, version=__version__, mode="embedded" if self.embedded else "daemon",
            pid=self.pid, client_id=self.client_id, started_ns=self.started_ns, extra=self.settings.birth,
        ))  # fmt: skip

    async def _publish_birth(self, client: aiomqtt.Client) -> None:
        await client.publish(
            self.birth_topic,
            self._birth(),
            qos=1,
            retain=self.birth_retained,
            properties=self._json_props,
            timeout=CONTROL_TIMEOUT_S,
        )

    async def _ready(self) -> _Conn:
        """The live connection, waiting for a connect attempt in progress (not for backoff)."""
        conn = self._conn
        if conn is not None and not conn.lost.is_set():
            return conn
        if self._shut or self._task is None:
            raise ExportError("mqtt %s: exporter not running" % self.url)
        att = self._attempt
        if att is not None and not att.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(att), self.settings.connect_timeout_s)
        conn = self._conn
        if conn is not None and not conn.lost.is_set():
            return conn
        raise ExportError("mqtt %s: not connected (%s)" % (self.url, self.last_error or "connecting"))

    async def _publish_all(self, conn: _Conn, msgs: Iterator[Outgoing], count: int | None) -> None:
        """Publish in order with a window of ``max_inflight`` calls; wait for every ack.

        A few publisher coroutines pull from one iterator (which may encode as it goes), so
        paho gets the messages in batch order while up to ``max_inflight`` wait for their
        PUBACK. (One task per message would cost O(n^2): aiomqtt counts its pending calls on
        every publish.) ``count``: how many messages, when known (fewer publishers).
        """
        loop = asyncio.get_running_loop()
        client, qos = conn.client, self.qos
        it = msgs

        refusals = conn.refusals

        async def publisher() -> None:
            for m in it:
                await client.publish(m.topic, m.payload, qos=qos, retain=m.retain, timeout=math.inf)
                reason = refusals.take()
                if reason is not None:  # the broker refused it: dropped and counted, the rest go on
                    self.refused_messages += 1
                    self.refused_items += m.items
                    self._rlog("refused", "the broker refused a message on %s (%s): dropped and counted",
                               m.topic, reason)

        all_acked: asyncio.Future[None] = loop.create_future()
        remaining = n = self.settings.max_inflight if count is None else min(count, self.settings.max_inflight)

        def on_done(t: asyncio.Task[None]) -> None:
            nonlocal remaining
            if t.cancelled():  # only we cancel, after giving up on this batch
                return
            exc = t.exception()  # retrieve it, always
            if all_acked.done():
                return
            if exc is not None:
                all_acked.set_exception(exc)
            else:
                remaining -= 1
                if remaining == 0:
                    all_acked.set_result(None)

        tasks = []
        for _ in range(n):
            t = loop.create_task(publisher())
            t.add_done_callback(on_done)
            tasks.append(t)
        lost = loop.create_task(conn.lost.wait())
        try:
            waiters: set[asyncio.Future[Any]] = {all_acked, lost}
            done, _ = await asyncio.wait(
                waiters, timeout=self.settings.publish_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            lost.cancel()
            if not all_acked.done() or all_acked.exception() is not None:
                for t in tasks:
                    t.cancel()
        if all_acked in done and all_acked.exception() is None:
            return
        self.failed_batches += 1
        if all_acked in done:
            exc = all_acked.exception()
            assert exc is not None
            why = _describe(exc)
        else:
            all_acked.cancel()
            why = (
                "connection lost"
                if conn.lost.is_set()
                else "no acknowledgement within %.0f s" % (self.settings.publish_timeout_s)
            )
            conn.lost.set()  # a stuck connection: make the connection task reconnect
        raise ExportError("mqtt %s: batch not acknowledged: %s" % (self.url, why))

    def _note_error(self, text: str) -> None:
        self.last_error = text
        if text != self._logged_error:
            self._logged_error = text
            log.warning("mqtt %s: %s", self.url, log_text(text))

    async def _run(self) -> None:
        assert self._closing is not None
        loop = asyncio.get_running_loop()
        delay = self.settings.reconnect_initial_s
        while not self._closing.is_set():
            if self._attempt is None or self._attempt.done():
                self._attempt = loop.create_future()
            attempt = self._attempt
            client = self._new_client()
            refusals = Refusals(client)
            conn: _Conn | None = None
            try:
                async with client:
                    await client.publish(self.status_topic, ONLINE, qos=1, retain=True, timeout=CONTROL_TIMEOUT_S)
                    await self._publish_birth(client)
                    conn = _Conn(client, refusals)
                    self._conn = conn
                    self.connects += 1
                    delay = self.settings.reconnect_initial_s
                    if self.last_error:
                        log.info("mqtt %s: connected again", self.url)
                    self.last_error = self._logged_error = ""
                    if not attempt.done():
                        attempt.set_result(True)
                    await self._hold(conn)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if conn is None:
                    self.connect_failures += 1
                self._note_error(("connection lost: " if conn is not None else "cannot connect: ") + _describe(exc))
            finally:
                _retrieve_disconnect(client)
                if conn is not None:
                    conn.lost.set()
                    if not self._closing.is_set():
                        self.disconnects += 1
                if self._conn is conn:
                    self._conn = None
                if not attempt.done():
                    attempt.set_result(False)
            if self._closing.is_set():
                break
            wait = delay * (0.5 + random.random() / 2)
            delay = min(delay * 2, self.settings.reconnect_max_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), wait)

    async def _hold(self, conn: _Conn) -> None:
        """Return when closing (clean disconnect follows) or raise when the link breaks."""
        assert self._closing is not None

        async def watch() -> None:
            async for _ in conn.client.messages:  # we subscribe to nothing: this only ends on disconnect
                pass

        watcher = asyncio.ensure_future(watch())
        closing = asyncio.ensure_future(self._closing.wait())
        lost = asyncio.ensure_future(conn.lost.wait())
        try:
            done, _ = await asyncio.wait({watcher, closing, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (watcher, closing, lost):
                t.cancel()
        if watcher in done and not watcher.cancelled() and watcher.exception() is not None:
            exc = watcher.exception()
            assert exc is not None
            raise exc
        if lost in done and not self._closing.is_set():
            raise aiomqtt.MqttError("publish stalled; reconnecting")


class _Worker(Protocol):
    """What :func:`wait_delivered` needs of an ``ExporterWorker``."""

    def idle(self) -> bool: ...

    def state(self) -> dict[str, int | float | str]: ...


def from_config(
    config: Config,
    *,
    env: Mapping[str, str] | None = None,
    embedded: bool = False,
    launch_pid: int | None = None,
) -> MqttExporter | None:
    """The exporter a configuration asks for, or None when no MQTT URL is set.

    Raises :class:`ConfigError` naming the key (and ``file:line``) for a bad value.
    """
    settings = settings_from_config(config, env=env, embedded=embedded, launch_pid=launch_pid)
    if settings is None:
        return None
    try:
        return MqttExporter(settings)
    except MqttConfigError as exc:  # the TLS files, read now
        raise ConfigError("exporters.mqtt: %s" % exc) from None


async def wait_delivered(exporter: MqttExporter, worker: _Worker, timeout_s: float | None = None) -> int:
    """``launch`` at exit: wait, bounded by ``exit_wait_s``, for the broker to take what the
    worker still holds (queue and disk spool). Returns the items left undelivered, also kept
    in ``state()["undelivered_at_exit"]``. Call it after the last publish, before
    ``Agent.shutdown`` (which stops replaying the spool at once when the broker is away).
    """
    timeout = exporter.settings.exit_wait_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout
    while not worker.idle() and time.monotonic() < deadline:  # noqa: ASYNC110 - the worker has no event
        await asyncio.sleep(0.02)
    left = 0
    if not worker.idle():
        st = worker.state()
        left = int(st.get("spooled_items_pending", 0)) + int(getattr(worker, "queue_items", 0))
    exporter.undelivered_at_exit = left
    return left


__all__ = [
    "MQTT_KEYS",
    "MqttCodeError",
    "MqttConfigError",
    "MqttExporter",
    "MqttSettings",
    "from_config",
    "mqtt_requested",
    "parse_url",
    "wait_delivered",
]
