"""The standard library's HTTP servers, as toy and not-so-toy model servers use them
(``test_coldstart_first_request_servers.py``):

- ``http.server``: a ``BaseHTTPRequestHandler`` whose ``do_GET`` answers ``/health`` and ``/``
  (a ``ThreadingHTTPServer``, HTTP/1.1 kept alive);
- ``wsgiref``: ``wsgiref.simple_server`` serving ``fork_apps:wsgi``.

Usage: python stdlib_servers.py http.server|wsgiref PORT
Every request sleeps ``FORK_APP_SLEEP`` seconds (as ``fork_apps``'s do) and answers JSON with the
pid. Ctrl-C stops it (once the request in hand is answered)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SLEEP = float(os.environ.get("FORK_APP_SLEEP", "0.3"))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path not in ("/", "/health"):
            self.send_error(404)
            return
        time.sleep(SLEEP)
        body = json.dumps({"pid": os.getpid(), "path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        pass


def main() -> None:
    kind, port = sys.argv[1], int(sys.argv[2])
    if kind == "http.server":
        server: Any = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    else:
        from wsgiref.simple_server import WSGIRequestHandler, make_server

        from fork_apps import wsgi

        class Quiet(WSGIRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        server = make_server("127.0.0.1", port, wsgi, handler_class=Quiet)
    # Ctrl-C stops the loop from another thread: raised inside a request, wsgiref's handler would take the
    # KeyboardInterrupt for the app's error and serve on
    signal.signal(signal.SIGINT, lambda _sig, _frame: threading.Thread(target=server.shutdown).start())
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
