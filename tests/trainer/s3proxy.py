"""An HTTP proxy in front of the moto S3 server that adds latency per request and can answer
chosen requests with S3's ``503 SlowDown`` — the way real S3 throttles a hot prefix. Used by the
checkpoint-resume tests and the input/emergency-save benchmarks (imported from benchmarks/ by
path). Real HTTP end to end: boto3/s3fs talk to it exactly as they would to S3."""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")


class S3Proxy:
    """``S3Proxy(upstream, latency_s=0.03)``; ``.url`` is the endpoint to give clients.
    ``fail``: ``(method, path) -> bool``; True answers 503 SlowDown instead of forwarding."""

    def __init__(self, upstream: str, latency_s: float = 0.0,
                 fail: Callable[[str, str], bool] | None = None):
        u = urlsplit(upstream)
        self.up_host, self.up_port = u.hostname, u.port
        self.latency_s, self.fail = latency_s, fail
        self.requests = 0
        self.failed: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().strip().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _handle(self) -> None:
                body = self._body()
                with proxy._lock:
                    proxy.requests += 1
                if proxy.latency_s:
                    time.sleep(proxy.latency_s)
                if proxy.fail is not None and proxy.fail(self.command, self.path):
                    with proxy._lock:
                        proxy.failed.append((self.command, self.path))
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(SLOWDOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOWDOWN)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "connection")}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(proxy.up_host, proxy.up_port, timeout=120)
                try:
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                            self.send_header(k, v)
                    if self.command == "HEAD":
                        self.send_header("Content-Length", resp.getheader("Content-Length") or "0")
                    else:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "S3Proxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
