"""A FastAPI app that loads a transformers model at import, as served apps do
(``uvicorn stack_app:app``; STACK_MODELS names the models directory). After its first
answer it stops its server: ``on_first_request`` when run in-process, else SIGINT to the
uvicorn supervisor (its parent) when STACK_STOP_PARENT=1."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import torch
from fastapi import BackgroundTasks, FastAPI
from transformers import AutoModel, AutoTokenizer

_path = os.path.join(os.environ["STACK_MODELS"], "bert")
tokenizer = AutoTokenizer.from_pretrained(_path)
model = AutoModel.from_pretrained(_path).eval()
app = FastAPI()
on_first_request: Callable[[], None] | None = None


def _stop() -> None:
    if on_first_request is not None:
        on_first_request()
    elif os.environ.get("STACK_STOP_PARENT") == "1":
        os.kill(os.getppid(), signal.SIGINT)


@app.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


@app.get("/")
def embed(background: BackgroundTasks, text: str = "the quick brown fox") -> dict[str, list[int]]:
    with torch.no_grad():
        out = model(**tokenizer(text, return_tensors="pt"))
    background.add_task(_stop)
    return {"shape": list(out.last_hidden_state.shape)}
