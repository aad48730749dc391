"""A Prometheus endpoint that could not bind is not "delivering now" until it listens.

Its export only fills a registry, so it succeeds without a listener: the first export after a
failed bind logged "exporter prometheus: delivering now" while the port was still taken and
`status` still failed (a review of the systemd path)."""

from __future__ import annotations

import logging
import socket

import pytest

from infersight.agent.daemon import broadcast
from infersight.agent.daemon.broadcast import ExporterWorker
from infersight.exporters import prometheus_endpoint
from infersight.exporters.base import ExportError
from infersight.exporters.prometheus_endpoint import PrometheusExporter


async def test_delivering_only_once_it_listens(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    exp = PrometheusExporter(host="127.0.0.1", port=port)
    w = ExporterWorker(exp)
    with pytest.raises(ExportError):
        await exp.start()
    w.start_error = "cannot listen on 127.0.0.1:%d" % port  # as the agent records a failed start
    monkeypatch.setattr(prometheus_endpoint, "REBIND_INTERVAL_S", 0.0)
    with caplog.at_level(logging.INFO, logger=broadcast.log.name):
        assert await w._export([]) == broadcast.OK
        assert "delivering now" not in caplog.text and w.problem() is not None
        holder.close()  # the port is free: the next export binds it
        assert await w._export([]) == broadcast.OK
    assert exp.listening and "delivering now" in caplog.text and w.problem() is None
    await exp.shutdown()
