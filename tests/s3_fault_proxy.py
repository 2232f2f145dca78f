"""An HTTP proxy on 127.0.0.1 in front of the moto S3 server that answers chosen requests with S3 errors.

moto has no quotas and never throttles; real stores do. The proxy forwards every
request to moto unchanged, except those matching a rule, which get the S3 error
response a real store would send (``QuotaExceeded`` 403, ``AccessDenied`` 403,
``SlowDown`` 503 ...), always or for the first N matches. Clients (s3fs in the test
process and in Ray workers) speak plain S3 HTTP to it.
"""

from __future__ import annotations

import http.client
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


@dataclass
class Rule:
    pattern: str  # regex searched in "METHOD /bucket/key?query"
    status: int
    code: str
    times: int | None = None  # None = always
    hits: int = 0


@dataclass
class FaultProxy:
    target: str  # moto's endpoint, http://127.0.0.1:PORT
    rules: list[Rule] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)  # "METHOD path" of every request

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

            def _handle(self) -> None:
                body = self._body()
                line = f"{self.command} {self.path}"
                rule = proxy._match(line)
                if rule is not None:
                    xml = (
                        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{rule.code}</Code>'
                        f"<Message>injected by the test proxy</Message><RequestId>0</RequestId></Error>"
                    ).encode()
                    self.send_response(rule.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    self.wfile.write(xml)
                    return
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("transfer-encoding", "content-length", "connection", "expect")
                }
                headers["Content-Length"] = str(len(body))
                target = urlsplit(proxy.target)
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                # a HEAD answer has no body but carries the object's size
                self.send_header(
                    "Content-Length",
                    resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data)),
                )
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def _match(self, line: str) -> Rule | None:
        with self._lock:
            self.seen.append(line)
            for rule in self.rules:
                if re.search(rule.pattern, line) and (rule.times is None or rule.hits < rule.times):
                    rule.hits += 1
                    return rule
        return None

    def fail(self, pattern: str, code: str, status: int = 403, times: int | None = None) -> Rule:
        rule = Rule(pattern, status, code, times)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def count(self, pattern: str) -> int:
        with self._lock:
            return sum(1 for line in self.seen if re.search(pattern, line))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
