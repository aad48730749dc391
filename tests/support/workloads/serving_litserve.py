"""LitServe serving a tiny GPT-2 (``library_stacks.py build``'s directory in STACK_MODELS):
``python serving_litserve.py PORT``. LitAPI.setup runs in LitServe's inference worker, a
spawned process (so the API class lives at module level, where spawn can pickle it). No
``from __future__ import annotations``: LitServe reads decode_request's annotation as a type."""

import os
import sys
from typing import Any

import litserve as ls

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_stacks import generate, load_gpt  # noqa: E402


class GptAPI(ls.LitAPI):  # type: ignore[misc]
    def setup(self, device: str) -> None:
        self.model = load_gpt(os.environ["STACK_MODELS"])

    def decode_request(self, request: dict[str, Any]) -> int:
        return int(request.get("n", 8))

    def predict(self, n: int) -> list[int]:
        return generate(self.model, n)

    def encode_response(self, output: list[int]) -> dict[str, Any]:
        return {"tokens": output}


if __name__ == "__main__":
    ls.LitServer(GptAPI(), accelerator="cpu", workers_per_device=1).run(port=int(sys.argv[1]),
                                                                        generate_client_file=False)
