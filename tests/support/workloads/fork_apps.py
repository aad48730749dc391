"""Tiny apps for gunicorn and uvicorn under ``infersight launch`` (``test_coldstart_fork_readiness.py``):
``fork_apps:wsgi`` (a plain WSGI callable) and ``fork_apps:asgi`` (a plain ASGI app with a lifespan).

``FORK_APP_MODEL`` says where the model (a torch ``nn.Linear``, built and run once) is made:

- ``import``: when this module is imported (gunicorn ``--preload``: in the master; without it:
  in each worker, after the fork), with a warmup forward;
- ``lifespan``: in the ASGI app's lifespan startup, with a warmup forward;
- ``lazy``: by the first request (``import torch`` included), with no warmup;
- unset: no model, no torch.

With ``FORK_APP_STARTED_DIR`` set, the ASGI app's lifespan startup, once done, makes a file named
after the process's pid there (a test waits for every worker's start).

Every request sleeps ``FORK_APP_SLEEP`` seconds (default 0.3), runs the model if there is one,
and answers ``{"pid": ..., "served": n}`` (WSGI: and ``"threaded"``, gunicorn's gthread worker;
``/fail`` answers 503 at once)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

MODE = os.environ.get("FORK_APP_MODEL", "")
SLEEP = float(os.environ.get("FORK_APP_SLEEP", "0.3"))
state: dict[str, Any] = {"served": 0}


def load() -> None:
    import torch

    torch.set_num_threads(1)
    state["model"] = torch.nn.Linear(16, 16)
    state["x"] = torch.randn(1, 16)


def infer() -> None:
    if "model" in state:
        import torch

        with torch.no_grad():
            state["model"](state["x"])


if MODE == "import":
    load()
    infer()  # a warmup forward


def answer(**extra: Any) -> bytes:
    time.sleep(SLEEP)
    if MODE == "lazy" and "model" not in state:
        load()
    infer()
    state["served"] += 1
    return json.dumps({"pid": os.getpid(), "served": state["served"], **extra}).encode()


def wsgi(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    if environ.get("PATH_INFO") == "/fail":  # a server whose engine is down answers 503 at once
        start_response("503 Service Unavailable", [("Content-Length", "0")])
        return []
    body = answer(threaded=bool(environ.get("wsgi.multithread")))  # gunicorn's gthread worker
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if MODE == "lifespan":
                    load()
                    infer()  # a warmup forward
                started = os.environ.get("FORK_APP_STARTED_DIR")
                if started:
                    open(os.path.join(started, str(os.getpid())), "w").close()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    body = answer()  # on the event loop: a tiny app
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
