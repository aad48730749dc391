"""GPU cold-start workload for bench/gpu_check.sh: weights to the device, CUDA init inside.

Usage: python coldstart_gpu.py [WORKDIR]
No infersight call. CUDA is first touched implicitly by ``model.to("cuda")``, so the
hooks must find ``cuda_init`` nested inside ``weights_to_device``. Then a
``torch.load(map_location="cuda")``, warmup forwards, a CUDA graph captured with
``torch.cuda.graph`` (its own ``graph_capture`` stage), and one HTTP request after listen().
"""

import http.server
import os
import sys
import tempfile
import threading
import urllib.request

import torch

workdir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096))
path = os.path.join(workdir, "gpu_model.pt")
torch.save(model.state_dict(), path)
model.load_state_dict(torch.load(path, weights_only=True))
model = model.to("cuda")  # weights_to_device, with cuda_init inside
again = torch.load(path, map_location="cuda", weights_only=True)  # weights_load straight to the device
x = torch.randn(16, 4096, device="cuda")
with torch.no_grad():
    for _ in range(3):
        model(x)
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
static_x = torch.randn(16, 4096, device="cuda")
side = torch.cuda.Stream()  # warm up on a side stream before capturing, as torch's docs do
side.wait_stream(torch.cuda.current_stream())
with torch.no_grad(), torch.cuda.stream(side):
    model(static_x)
torch.cuda.current_stream().wait_stream(side)
with torch.no_grad(), torch.cuda.graph(graph):  # graph_capture (the forward is recorded, not a warmup)
    static_y = model(static_x)
graph.replay()
torch.cuda.synchronize()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        with torch.no_grad():
            y = model(torch.randn(1, 4096, device="cuda"))
        body = str(float(y.sum())).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a: object) -> None:
        pass


server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
t = threading.Thread(target=server.handle_request)
t.start()
urllib.request.urlopen("http://127.0.0.1:%d/" % server.server_port, timeout=60).read()
t.join()
server.server_close()
print("gpu workload: done on", torch.cuda.get_device_name(0))
