"""A diffusers pipeline behind FastAPI, loaded at import as served apps do (STACK_MODELS names
the models directory of ``library_stacks.py build``). The first answer stops the server
(``on_first_request``)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from diffusers import DiffusionPipeline
from fastapi import BackgroundTasks, FastAPI

pipe = DiffusionPipeline.from_pretrained(os.path.join(os.environ["STACK_MODELS"], "ddpm"))
app = FastAPI()
on_first_request: Callable[[], None] | None = None


def _stop() -> None:
    if on_first_request is not None:
        on_first_request()


@app.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


@app.get("/")
def generate(background: BackgroundTasks) -> dict[str, list[int]]:
    with torch.no_grad():
        image = pipe(batch_size=1, num_inference_steps=2, output_type="np").images[0]
    background.add_task(_stop)
    return {"shape": list(image.shape)}
