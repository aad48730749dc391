"""A FastAPI/uvicorn model server for the routing tests, run with the hooks active.

FAKE DEVICE: there is no GPU here. Each backend stands in for one GPU serving one request at
a time (an asyncio lock: a device runs one batch at a time) for SERVICE_S seconds; a backend
with a four times longer SERVICE_S is the stand-in for a slow GPU.

Environment: NAME (reported in each response), PORT, SERVICE_S, COLD_S (a cold start: seconds
of "model load" before serving), EARLY_LISTEN=1 (bind and listen before the load, as vLLM
does, and declare readiness with hooks.mark_ready() after it; run with
INFERSIGHT_READY_ON_LISTEN=0), READY_FILE (gets the Unix time of readiness).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import uvicorn
from fastapi import FastAPI

NAME = os.environ.get("NAME", "backend")
PORT = int(os.environ["PORT"])
SERVICE_S = float(os.environ.get("SERVICE_S", "0.02"))
COLD_S = float(os.environ.get("COLD_S", "0"))
EARLY = os.environ.get("EARLY_LISTEN") == "1"
READY_FILE = os.environ.get("READY_FILE")

app = FastAPI()
device = asyncio.Lock()  # one request at a time on the (fake) device


@app.get("/infer")
async def infer() -> dict[str, object]:
    async with device:
        await asyncio.sleep(SERVICE_S)
    return {"backend": NAME, "pid": os.getpid(), "t": time.time()}


def ready() -> None:
    if READY_FILE:
        with open(READY_FILE + ".tmp", "w") as f:
            f.write(repr(time.time()))
        os.replace(READY_FILE + ".tmp", READY_FILE)


def main() -> None:
    config = uvicorn.Config(app, host="127.0.0.1", port=PORT, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    if EARLY:
        from infersight import hooks

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", PORT))
        sock.listen(128)  # connections queue from now on, before the model is loaded
        time.sleep(COLD_S)  # the model load
        hooks.mark_ready()
        ready()
        server.run(sockets=[sock])
        return
    time.sleep(COLD_S)
    ready()  # uvicorn listens right after: the hooks see readiness (server.port) there
    server.run()


if __name__ == "__main__":
    main()
