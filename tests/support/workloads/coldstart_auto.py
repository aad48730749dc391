"""Cold-start workload with no infersight call: every stage must be found by the hooks.

Usage: python coldstart_auto.py OUT.json [WORKDIR]
Writes {"t_first_ns", "t_end_ns", "pid", "inductor"} to OUT.json.
"""

import time

T_FIRST = time.time_ns()

import ctypes  # noqa: E402
import http.server  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import urllib.request  # noqa: E402

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def save_safetensors(state: dict, path: str) -> None:
    """safetensors' save_file needs numpy; the format is simple enough to write here."""
    header, blobs, off = {}, [], 0
    for k, t in state.items():
        t = t.detach().contiguous()
        n = t.numel() * t.element_size()
        header[k] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + n]}
        blobs.append(ctypes.string_at(t.data_ptr(), n))
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


out_path = sys.argv[1]
workdir = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp()
torch.manual_seed(0)

model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 16))
pt_path = os.path.join(workdir, "model.pt")
st_path = os.path.join(workdir, "model.safetensors")
torch.save(model.state_dict(), pt_path)
save_safetensors(model.state_dict(), st_path)
model.load_state_dict(torch.load(pt_path, weights_only=True))
model.load_state_dict(load_file(st_path))
with safe_open(st_path, framework="pt") as f:
    model.load_state_dict({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
model.eval()

x = torch.randn(4, 256)
traced = torch.jit.trace(model, x)
inductor = os.environ.get("WORKLOAD_INDUCTOR") == "1"
compiled = torch.compile(model, backend="inductor" if inductor else "eager")
with torch.no_grad():
    for _ in range(3):
        compiled(x)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        with torch.no_grad():
            y = compiled(torch.randn(1, 256))
        body = json.dumps({"sum": float(y.sum())}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


server = http.server.HTTPServer(("127.0.0.1", 0), Handler)  # bind + listen()
worker = threading.Thread(target=server.handle_request)
worker.start()
with urllib.request.urlopen("http://127.0.0.1:%d/" % server.server_port, timeout=30) as resp:
    resp.read()
worker.join()
server.server_close()
with open(out_path, "w") as f:
    json.dump({"t_first_ns": T_FIRST, "t_end_ns": time.time_ns(), "pid": os.getpid(), "inductor": inductor}, f)
