"""Real serving stacks that nobody here wrote, each serving a tiny torch model (a GPT-2 from
``library_stacks.py build DIR``) the way its users write it. No infersight call in any.

    python serving_stacks.py peft_flask DIR PORT   a PEFT LoRA merged (merge_and_unload), served by Flask
    python serving_stacks.py ray DIR PORT          Ray Serve: ray.init, serve.run, one request, shutdown
    bentoml serve serving_bento:Generator --port PORT          (STACK_MODELS=DIR, cwd = this folder)
    gunicorn --preload -w 2 -b 127.0.0.1:PORT serving_wsgi:app (STACK_MODELS=DIR, cwd = this folder)
    python serving_litserve.py PORT                            LitServe (STACK_MODELS=DIR)

The servers run until SIGTERM (the test sends its request first); the Ray driver sends its own
request through Serve's HTTP proxy and shuts the cluster down, as a script run by a user does
(with another request sent as soon as the proxy answers, while serve.run still deploys, as a
load balancer's).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from typing import Any


def load_gpt(models: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.join(models, "base")).eval()


def generate(model: Any, n: int) -> list[int]:
    import torch

    with torch.no_grad():
        logits = model(torch.arange(n, dtype=torch.long).unsqueeze(0) % 256).logits
    return [int(t) for t in logits[0].argmax(-1)]


def peft_flask_stack(models: str, port: str) -> None:
    from flask import Flask, jsonify, request
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(os.path.join(models, "base"))
    model = PeftModel.from_pretrained(base, os.path.join(models, "adapter")).merge_and_unload().eval()
    app = Flask(__name__)

    @app.post("/generate")
    def serve() -> Any:
        return jsonify(tokens=generate(model, int((request.get_json(silent=True) or {}).get("n", 8))))

    app.run(host="127.0.0.1", port=int(port))


def ray_stack(models: str, port: str) -> None:
    import ray
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Generator:
        def __init__(self, where: str) -> None:
            self.model = load_gpt(where)

        async def __call__(self, request: Any) -> dict[str, Any]:
            body = await request.json()
            return {"tokens": generate(self.model, int(body.get("n", 8)))}

    def ask() -> int:
        req = urllib.request.Request("http://127.0.0.1:%s/generate" % port, data=json.dumps({"n": 8}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return len(json.load(resp)["tokens"])

    def eager_client() -> None:
        """A load balancer's request, sent as soon as the proxy answers for the route: while serve.run
        still deploys, the proxy holds it until a replica can serve it."""
        for _ in range(6000):
            try:
                print("ray: early tokens", ask(), flush=True)
                return
            except (OSError, ValueError):  # not listening yet, or 404/503 before the route exists
                time.sleep(0.02)

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": int(port)})
    early = threading.Thread(target=eager_client, daemon=True)
    early.start()
    serve.run(Generator.bind(models), route_prefix="/generate")
    print("ray: tokens", ask())
    early.join(120)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    mode, where = sys.argv[1], sys.argv[2]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if mode == "peft_flask":
        peft_flask_stack(where, sys.argv[3])
    elif mode == "ray":
        ray_stack(where, sys.argv[3])
    else:
        raise SystemExit("unknown mode %r" % mode)
