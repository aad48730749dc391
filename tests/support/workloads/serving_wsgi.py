"""A Flask WSGI app serving a tiny GPT-2 loaded at import (STACK_MODELS names ``library_stacks.py
build``'s directory), for ``gunicorn --preload -w 2 serving_wsgi:app``: the master loads the
model once, its forked workers share it."""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, jsonify, request
from serving_stacks import generate, load_gpt

model = load_gpt(os.environ["STACK_MODELS"])
app = Flask(__name__)


@app.post("/generate")
def serve() -> Any:
    return jsonify(tokens=generate(model, int((request.get_json(silent=True) or {}).get("n", 8))), pid=os.getpid())
