"""A model server with a Prometheus exporter of its own, started as many start one
(``test_coldstart_side_servers.py``): ``prometheus_client.start_http_server(METRICS_PORT)`` first,
then the model load (``LOAD_S`` seconds), then uvicorn on ``PORT`` with the event loop ``LOOP``
(``asyncio``: its ``listen()`` call; ``uvloop``: a socket opened in C).

Usage: python metrics_exporter_app.py METRICS_PORT PORT LOOP OUT.json
Writes when the model load ended (``loaded_ns``) to OUT.json before uvicorn starts. Every request
of the app answers JSON with the pid and the path; Ctrl-C stops it."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import prometheus_client

LOAD_S = 1.0


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = json.dumps({"pid": os.getpid(), "path": scope["path"]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    metrics_port, port, loop, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    prometheus_client.start_http_server(metrics_port, addr="127.0.0.1")
    time.sleep(LOAD_S)  # the model load
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"loaded_ns": time.time_ns()}, f)
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=port, loop=loop, log_level="warning")


if __name__ == "__main__":
    main()
