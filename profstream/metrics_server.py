"""The HTTP server of every profstream ``/metrics`` endpoint (the exporter's and the
processors' health).

Built for many scrapers at once (several Prometheus replicas, federation, dashboards
that scrape directly): a listen backlog of 1,024 instead of socketserver's 5 (a full
backlog drops SYNs, and the client retries after a whole second), a thread per request,
and one rendering of the exposition shared by every scrape that arrives while it is
being written or within ``max_age_s`` after it, gzip included. Rendering holds the GIL
for milliseconds; rendered once per scrape, a burst of 200 scrapes was served one every
~5 ms (the accept loop waits for the GIL), p99 over a second.
"""

from __future__ import annotations

import gzip
import queue
import socket
import socketserver
import threading
import time
from collections.abc import Callable

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from profstream.web_config import WebConfig

LISTEN_BACKLOG = 1024
MAX_AGE_S = 0.05  # a scrape's figures are at most this much older than the scrape
WORKERS = 4  # threads answering scrapes; a slow or silent client holds one of them for up to 10 s


class _Rendering:
    __slots__ = ("done", "body", "error", "_gzipped", "_lock")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.body = b""
        self.error: BaseException | None = None
        self._gzipped: bytes | None = None
        self._lock = threading.Lock()

    def gzipped(self) -> bytes:
        with self._lock:
            if self._gzipped is None:
                self._gzipped = gzip.compress(self.body, compresslevel=1)  # ~25x smaller in ~1 ms
            return self._gzipped


class SharedRendering:
    """``render()`` called once for all the callers that arrive while it runs or within
    ``max_age_s`` after it finished."""

    def __init__(self, render: Callable[[], bytes], max_age_s: float = 0.0) -> None:
        self._render = render
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._current: _Rendering | None = None
        self._last: _Rendering | None = None
        self._last_at = -1e18

    def get(self) -> _Rendering:
        with self._lock:
            if self._last is not None and time.monotonic() - self._last_at < self._max_age_s:
                return self._last
            job = self._current
            owner = job is None
            if owner:
                job = self._current = _Rendering()
        if owner:
            try:
                job.body = self._render()
            except BaseException as e:  # handed to every waiter
                job.error = e
            finally:
                with self._lock:
                    self._current = None
                    if job.error is None:
                        self._last, self._last_at = job, time.monotonic()
                job.done.set()
        else:
            job.done.wait()
        if job.error is not None:
            raise job.error
        return job


class _Handler(socketserver.StreamRequestHandler):
    """One GET of /metrics, answered as HTTP/1.0 with the shared rendering. Lean on
    purpose: wsgiref's handler cost about 1 ms of Python a scrape, under the GIL."""

    timeout = 10.0  # a client that sends no request in time is dropped

    def handle(self) -> None:
        request = self.rfile.readline(8192).split()
        gzip_ok = False
        authorization = None
        while True:  # the headers: Accept-Encoding, and Authorization where a web config asks for it
            line = self.rfile.readline(8192)
            if line in (b"\r\n", b"\n", b""):
                break
            if line[:16].lower() == b"accept-encoding:" and b"gzip" in line.lower():
                gzip_ok = True
            elif line[:14].lower() == b"authorization:":
                authorization = line[14:].strip()
        if len(request) < 2 or request[0] not in (b"GET", b"HEAD"):
            self._answer(b"405 Method Not Allowed", b"text/plain", b"GET /metrics\n")
            return
        web = self.server.web
        if web is not None and not web.authorized(authorization):
            self._answer(b"401 Unauthorized", b"text/plain", b"Unauthorized\n",
                         extra=b"\r\nWWW-Authenticate: Basic realm=\"" + self.server.name.encode() + b"\"")
            return
        if request[1].split(b"?", 1)[0] not in (b"/", b"/metrics"):
            self._answer(b"404 Not Found", b"text/plain", f"the {self.server.name} endpoint serves /metrics\n".encode())
            return
        job = self.server.shared.get()
        body = job.gzipped() if gzip_ok else job.body
        self._answer(b"200 OK", self.server.content_type, body, gzip_ok, head_only=request[0] == b"HEAD")

    def _answer(self, status: bytes, content_type: bytes, body: bytes, gzipped: bool = False,
                head_only: bool = False, extra: bytes = b"") -> None:
        head = (b"HTTP/1.0 " + status + b"\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
                + str(len(body)).encode() + (b"\r\nContent-Encoding: gzip" if gzipped else b"") + extra
                + b"\r\nConnection: close\r\n\r\n")
        self.wfile.write(head if head_only else head + body)


class MetricsServer(socketserver.TCPServer):
    """Accepts on one thread and answers on a few worker threads. A thread per request
    (socketserver's ThreadingMixIn) cost ~0.5 ms of Python a scrape to start; serially,
    one slow client would hold every other scrape."""

    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, addr: str, port: int, shared: SharedRendering, name: str, content_type: str,
                 workers: int = WORKERS, web: WebConfig | None = None) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.shared, self.name, self.content_type = shared, name, content_type.encode()
        self.web = web  # TLS and basic auth (profstream/web_config.py), or None
        super().__init__((addr, port), _Handler)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-http-{i}", daemon=True).start()

    @property
    def server_port(self) -> int:
        return self.server_address[1]

    def process_request(self, request, client_address) -> None:
        self._requests.put((request, client_address))

    def _work(self) -> None:
        while True:
            request, client_address = self._requests.get()
            try:
                if self.web is not None:  # the TLS handshake here, never on the accept loop
                    request = self.web.wrap(request)
                self.finish_request(request, client_address)
            except Exception:  # a client that went away: not worth a traceback
                pass
            finally:
                self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        pass


def serve_metrics(addr: str, port: int, render: Callable[[], bytes], name: str = "profstream",
                  content_type: str = CONTENT_TYPE_PLAIN_0_0_4, max_age_s: float = MAX_AGE_S,
                  web: WebConfig | None = None) -> MetricsServer:
    """Serve ``render()`` on http://addr:port/metrics (and /) from a daemon thread; raises
    OSError when the port cannot be bound. ``server.shutdown()`` stops it. A scrape sees
    figures at most ``max_age_s`` older than its own arrival. ``web``: TLS and basic auth
    (https, 401 without a user of its basic_auth_users)."""
    server = MetricsServer(addr, port, SharedRendering(render, max_age_s), name, content_type, web=web)
    threading.Thread(target=server.serve_forever, name=f"{name}-http", daemon=True).start()
    return server
