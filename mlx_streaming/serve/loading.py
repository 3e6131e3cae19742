"""What the server answers before its model's generator exists: ``LoadingHandler``."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler

MAX_DISCARD = 16 << 20  # a refused request's body read before the 503, up to this


class LoadingHandler(BaseHTTPRequestHandler):
    """Every request before the model's generator exists (its experts being split):
    a 503 with ``{"status": "loading"}`` and ``Retry-After``, as llama.cpp's server
    answers while it loads. Unanswered, a probe would time out (or a liveness check kill
    the first split)."""

    def _loading(self):
        n = int(self.headers.get("Content-Length") or 0)
        if 0 < n <= MAX_DISCARD:
            self.rfile.read(n)
        message = "the model is loading (its experts are being split); retry later"
        body = json.dumps({"status": "loading", "error": {"message": message, "type": "loading"}})
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Retry-After", "5")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    do_GET = do_POST = do_PUT = do_DELETE = do_OPTIONS = _loading

    def log_message(self, *a) -> None:
        pass  # a probe every second would fill the log
