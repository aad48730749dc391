"""A tiny HTTP server for launch --ready-url/--probe: not ready for READY_DELAY_S seconds.

Usage: python ready_server.py PORT [READY_DELAY_S] [lazy]
/health answers 503 until ready, then 200; / answers after 0.05 s. Exits after serving /.
With ``lazy``, the first 200 from /health imports a slow module first (as a framework's
health handler that imports its thread pool on first use).
"""

import http.server
import sys
import time

port = int(sys.argv[1])
delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.3
lazy = sys.argv[3:4] == ["lazy"]
t0 = time.monotonic()
done = False


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        global done
        if self.path == "/health":
            code = 200 if time.monotonic() - t0 >= delay else 503
            if code == 200 and lazy:
                import slow_import  # noqa: F401
            body = b"ok" if code == 200 else b"starting"
        else:
            time.sleep(0.05)
            code, body, done = 200, b"hello", True
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


server = http.server.HTTPServer(("127.0.0.1", port), Handler)
while not done:
    server.handle_request()
server.server_close()
