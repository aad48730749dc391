"""The demo workload for ``infersight launch -- python examples/demo_serve.py``.

A small model server with the stages a real one has, and no infersight call: import
torch, build a model (128 MiB of fp32 weights), save and load its weights, warm it up,
listen on 127.0.0.1, answer one HTTP request, exit. A few seconds on a CPU. The weights go to a
temporary directory, removed at the end (also when the demo fails or gets Ctrl-C), unless
--weights-dir names one.

    python examples/demo_serve.py                 # sends its own request, then exits
    python examples/demo_serve.py --port 8000     # waits for one request from outside
                                                  # (e.g. launch --probe http://127.0.0.1:8000/)
    python examples/demo_serve.py --device cuda   # moves the weights to the GPU first
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import tempfile
import threading
import urllib.request

import torch


def build(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0, help="serve one outside request on this port")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--weights-dir", default=None)
    args = ap.parse_args()
    if args.weights_dir:
        serve(args, args.weights_dir)
        return
    workdir = tempfile.mkdtemp(prefix="demo-weights-")
    try:
        serve(args, workdir)
    finally:  # the weights (128 MiB by default) are not left behind in /tmp
        shutil.rmtree(workdir, ignore_errors=True)


def serve(args: argparse.Namespace, workdir: str) -> None:
    path = os.path.join(workdir, "model.pt")
    if not os.path.exists(path):
        torch.save(build(args.hidden).state_dict(), path)
    with torch.device("meta"):
        model = build(args.hidden)
    model.load_state_dict(torch.load(path, weights_only=True), assign=True)
    model = model.to(args.device).eval()

    x = torch.randn(8, args.hidden, device=args.device)
    with torch.no_grad():
        for _ in range(3):
            model(x)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with torch.no_grad():
                y = model(torch.randn(1, args.hidden, device=args.device))
            body = json.dumps({"norm": float(y.norm())}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", args.port), Handler)
    if args.port:
        server.handle_request()
    else:
        t = threading.Thread(target=server.handle_request)
        t.start()
        with urllib.request.urlopen("http://127.0.0.1:%d/" % server.server_port, timeout=60) as r:  # noqa: S310
            print("demo: served", r.read().decode())
        t.join()
    server.server_close()


if __name__ == "__main__":
    main()
