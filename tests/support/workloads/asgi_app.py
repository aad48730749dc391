"""A streaming Starlette app behind ColdStartMiddleware, driven as an ASGI server would.

Usage: python asgi_app.py OUT.json
The first body chunk leaves after ~0.15 s, the response ends after ~0.45 s.
"""

import asyncio
import json
import os
import sys
import time

from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from infersight.hooks.asgi import ColdStartMiddleware


async def stream(request):  # type: ignore[no-untyped-def]
    async def body():  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.15)
        yield b"first"
        await asyncio.sleep(0.3)
        yield b"rest"

    return StreamingResponse(body(), media_type="text/plain")


app = Starlette(routes=[Route("/generate", stream)])
app.add_middleware(ColdStartMiddleware)


async def call(path: str) -> tuple:
    """One request straight into the ASGI app; returns (status, body, first body time, end time)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"host", b"app")], "client": ("127.0.0.1", 5000),
             "server": ("app", 80)}
    got = {"status": 0, "body": b"", "first": 0, "asked": 0}
    finished = asyncio.Event()

    async def receive() -> dict:
        got["asked"] += 1
        if got["asked"] == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await finished.wait()  # as a server does: disconnect only once the response is over
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            got["status"] = message["status"]
        elif message["type"] == "http.response.body":
            if message.get("body") and not got["first"]:
                got["first"] = time.time_ns()
            got["body"] += message.get("body", b"")
            if not message.get("more_body"):
                finished.set()

    await app(scope, receive, send)
    return got["status"], got["body"].decode(), got["first"], time.time_ns()


async def main() -> dict:
    t0 = time.time_ns()
    status, body, first_ns, end_ns = await call("/generate")
    status2, _, _, _ = await call("/generate")  # passes straight through
    return {"t_request_ns": t0, "t_first_byte_ns": first_ns, "t_done_ns": end_ns, "status": status,
            "body": body, "second_status": status2}


result = asyncio.run(main())
result["pid"] = os.getpid()
with open(sys.argv[1], "w") as f:
    json.dump(result, f)
