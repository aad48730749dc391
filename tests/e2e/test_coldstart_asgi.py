"""The ASGI middleware records the first request's time to first body byte."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "support", "workloads"))
from launchutil import HERE, assert_well_formed, launch, stage_name  # noqa: E402

pytest.importorskip("starlette")


def test_asgi_first_byte(tmp_path) -> None:
    run = launch(str(tmp_path), [sys.executable, os.path.join(HERE, "asgi_app.py")])
    assert run.rc == 0, run.output
    r = run.result
    assert r["status"] == 200 and r["body"] == "firstrest" and r["second_status"] == 200
    root = run.root_of(r["pid"])
    stages = run.stages(root)
    fr = [s for s in stages if stage_name(s) == "first_request"]
    assert len(fr) == 1  # the second request passed through
    fr0 = fr[0]
    assert fr0.attributes["infersight.first_request.source"] == "asgi"
    assert fr0.attributes["http.response.status_code"] == 200
    assert fr0.attributes["url.path"] == "/generate"
    ttfb = float(fr0.attributes["infersight.first_request.ttfb_s"])
    # first chunk after ~0.15 s, the whole stream after ~0.45 s: the span ends at the first byte
    assert 0.14 <= ttfb < (r["t_done_ns"] - r["t_request_ns"]) / 1e9
    assert abs(fr0.end_ns - r["t_first_byte_ns"]) < 50_000_000
    assert root.end_ns == fr0.end_ns
    assert root.attributes["infersight.ready.source"] == "request"
    assert_well_formed(root, stages)


def test_middleware_passes_through_when_inactive() -> None:
    import asyncio

    from infersight.hooks.asgi import ColdStartMiddleware

    seen = []

    async def app(scope, receive, send) -> None:
        seen.append(scope["type"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent = []

    async def send(m) -> None:
        sent.append(m["type"])

    async def receive():
        return {"type": "http.request"}

    asyncio.run(ColdStartMiddleware(app)({"type": "http", "method": "GET", "path": "/"}, receive, send))
    assert seen == ["http"] and sent == ["http.response.start", "http.response.body"]
