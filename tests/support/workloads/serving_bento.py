"""A BentoML service serving a tiny GPT-2 (STACK_MODELS names ``library_stacks.py build``'s
directory), run with ``bentoml serve serving_bento:Generator``."""

from __future__ import annotations

import os

import bentoml
from serving_stacks import generate, load_gpt


@bentoml.service(workers=1)
class Generator:
    def __init__(self) -> None:
        self.model = load_gpt(os.environ["STACK_MODELS"])

    @bentoml.api  # type: ignore[misc]
    def generate(self, n: int = 8) -> list[int]:
        return generate(self.model, n)
