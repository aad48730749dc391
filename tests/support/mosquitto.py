"""A real mosquitto for tests: own config in a tmp dir, a free 127.0.0.1 port, stop/restart.

Never relies on a broker that happens to run on 1883. Optional: a TLS listener with a
self-signed CA made with the ``openssl`` CLI, a password file made with
``mosquitto_passwd``, and persistence (so that a subscriber's queued QoS 1 messages survive
a broker restart, as a production broker's would).

Also an aiomqtt :class:`Collector` that subscribes and keeps every message, reconnecting
with a persistent session when the broker goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from ports import free_port

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")

needs_mosquitto = pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto not installed (apt-get install mosquitto)")


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls(root: Path) -> TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost (openssl CLI)."""
    root.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (root / n for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt"))
    ext = root / "server.ext"
    ext.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "2", "-subj", "/CN=infersight test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    run("req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", "2", "-extfile", str(ext))
    for p in (ca_key, key):
        p.chmod(0o600)
    return TlsFiles(ca, cert, key)


def make_passwd(path: Path, users: dict[str, str]) -> Path:
    assert MOSQUITTO_PASSWD, "mosquitto_passwd not installed"
    path.unlink(missing_ok=True)
    for i, (user, pw) in enumerate(users.items()):
        args = [MOSQUITTO_PASSWD, "-b"] + (["-c"] if i == 0 else []) + [str(path), user, pw]
        subprocess.run(args, check=True, capture_output=True)
    path.chmod(0o600)
    return path


class Mosquitto:
    """One mosquitto process with its own config; the port stays the same across restarts."""

    def __init__(
        self,
        root: Path,
        *,
        persistence: bool = True,
        tls: TlsFiles | None = None,
        users: dict[str, str] | None = None,
        tcp_nodelay: bool = True,
        extra: tuple[str, ...] = (),
    ) -> None:
        assert MOSQUITTO, "mosquitto not installed"
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.tls = tls
        self.conf = root / "mosquitto.conf"
        self.log = root / "mosquitto.log"
        lines = [
            "per_listener_settings false",
            "user %s" % getpass.getuser(),  # as root, mosquitto would drop to 'mosquitto' and lose the tmp dir
            "log_dest file %s" % self.log,
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "connection_messages true",
            "max_queued_messages 1000000",
            "persistence %s" % ("true" if persistence else "false"),
            "persistence_location %s/" % root,
            "autosave_interval 3600",
            # Nagle on the broker holds PUBACKs behind the client's delayed ACK (~40 ms stalls
            # for small batches); production brokers that want low latency set this too.
            "set_tcp_nodelay %s" % ("true" if tcp_nodelay else "false"),
            "listener %d 127.0.0.1" % self.port,
        ]
        if tls is not None:
            lines += ["cafile %s" % tls.ca, "certfile %s" % tls.cert, "keyfile %s" % tls.key]
        if users:
            lines += ["allow_anonymous false", "password_file %s" % make_passwd(root / "passwd", users)]
        else:
            lines.append("allow_anonymous true")
        lines += extra  # more broker settings: message_size_limit, acl_file, ...
        self.conf.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return "%s://127.0.0.1:%d" % ("mqtts" if self.tls else "mqtt", self.port)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> Mosquitto:
        assert not self.running()
        self.proc = subprocess.Popen([str(MOSQUITTO), "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.root / "stderr.log", "ab"))  # noqa: SIM115
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("mosquitto exited %s: %s" % (self.proc.returncode, self.logs()))
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return self
            time.sleep(0.02)
        raise RuntimeError("mosquitto did not listen on %d: %s" % (self.port, self.logs()))

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM: a clean stop (persistence is saved)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def restart(self) -> Mosquitto:
        self.stop()
        return self.start()

    def logs(self) -> str:
        out = ""
        for p in (self.log, self.root / "stderr.log"):
            with contextlib.suppress(OSError):
                out += p.read_text(errors="replace")[-4000:]
        return out

    def client_tls_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=str(self.tls.ca)) if self.tls else None

    def __enter__(self) -> Mosquitto:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_broker(root: Path, **kw: Any) -> Iterator[Mosquitto]:
    """A started broker for the ``with`` block (tests use it from a fixture)."""
    if MOSQUITTO is None:
        pytest.skip("mosquitto not installed")
    b = Mosquitto(root, **kw).start()
    try:
        yield b
    finally:
        b.stop()


# -- a subscriber --------------------------------------------------------------------------------


@dataclass
class Received:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    at: float = field(default_factory=time.monotonic)

    def json(self) -> Any:
        import json

        return json.loads(self.payload)


class Collector:
    """Subscribes (QoS 1) and keeps every message; reconnects with a persistent session.

    Use ``async with Collector(broker, "infersight/#") as c:`` inside a test's event loop.
    """

    def __init__(self, broker: Mosquitto, topic: str = "infersight/#", *, client_id: str | None = None,
                 persistent: bool = True, username: str | None = None, password: str | None = None) -> None:
        self.broker = broker
        self.topic = topic
        self.client_id = client_id or "test-collector-%d" % os.getpid()
        self.persistent = persistent
        self.username, self.password = username, password
        self.messages: list[Received] = []
        self.connected = asyncio.Event()
        self.connects = 0
        self._task: asyncio.Task[None] | None = None
        self._stop = False

    def _client(self) -> Any:
        import aiomqtt
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 600 if self.persistent else 0
        return aiomqtt.Client("127.0.0.1", self.broker.port, identifier=self.client_id,
                              protocol=aiomqtt.ProtocolVersion.V5, clean_start=not self.persistent,
                              properties=props, tls_context=self.broker.client_tls_context(),
                              username=self.username, password=self.password, timeout=5)

    async def _run(self) -> None:
        import aiomqtt

        first = True
        while not self._stop:
            try:
                async with self._client() as client:
                    if first or not self.persistent:
                        await client.subscribe(self.topic, qos=1)
                    first = False
                    self.connects += 1
                    self.connected.set()
                    async for m in client.messages:
                        payload = m.payload if isinstance(m.payload, bytes) else str(m.payload).encode()
                        self.messages.append(Received(str(m.topic), payload, m.qos, bool(m.retain)))
            except aiomqtt.MqttError:
                self.connected.clear()
                await asyncio.sleep(0.1)

    async def __aenter__(self) -> Collector:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await asyncio.wait_for(self.connected.wait(), 10)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def on(self, topic: str) -> list[Received]:
        return [m for m in self.messages if m.topic == topic]

    async def wait_for(self, pred: Any, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return True
            await asyncio.sleep(0.02)
        return bool(pred())


async def retained(broker: Mosquitto, topic: str, timeout: float = 1.0, **auth: Any) -> bytes | None:
    """The retained message on ``topic`` as a fresh subscriber sees it (None when there is none)."""
    c = Collector(broker, topic, client_id="test-retained-%d-%d" % (os.getpid(), time.monotonic_ns()),
                  persistent=False, **auth)
    async with c:
        await c.wait_for(lambda: any(m.retain for m in c.messages), timeout)
    got = [m for m in c.messages if m.retain]
    return got[-1].payload if got else None
