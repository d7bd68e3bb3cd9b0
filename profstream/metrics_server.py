"""The HTTP server of every profstream ``/metrics`` endpoint (the exporter's and the
processors' health).

Built for many scrapers at once (several Prometheus replicas, federation, dashboards
that scrape directly) and for clients that do not behave: one I/O thread accepts, reads
every request head and writes every answer without blocking, so a client that sends
half a request and waits, or reads its answer slowly, holds nothing but its own socket;
it is dropped after ``IO_TIMEOUT_S``, and past ``MAX_CONNECTIONS`` the one waiting
longest for its request is dropped first. A few worker threads render; one rendering of
the exposition is shared by every scrape that arrives while it is being written or
within ``max_age_s`` after it, gzip included (rendering holds the GIL for milliseconds;
rendered once per scrape, a burst of 200 scrapes was served one every ~5 ms, p99 over a
second). A listen backlog of 1,024 instead of socketserver's 5: a full backlog drops
SYNs, and the client retries after a whole second.

With a web config (profstream/web_config.py): TLS, its handshake also done without
blocking on the I/O thread, and basic auth, checked by a worker (bcrypt costs tens of ms
on a password's first sight): 401 without a user of basic_auth_users.
"""

from __future__ import annotations

import errno
import gzip
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from profstream.web_config import WebConfig

log = logging.getLogger("profstream.metrics")

LISTEN_BACKLOG = 1024
MAX_AGE_S = 0.05  # a scrape's figures are at most this much older than the scrape
WORKERS = 4  # threads that render; no client can hold one (the I/O thread reads and writes)
IO_TIMEOUT_S = 10.0  # a client that has not sent its request, or not read its answer, by then is dropped
MAX_CONNECTIONS = 1024  # open at once; past it the client waiting longest for its request is dropped
MAX_HEAD_BYTES = 16384  # a request line and headers longer than this get 431


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


class _Request:
    """What a scrape asked: parsed from its head by ``parse_head``."""

    __slots__ = ("method", "path", "gzip_ok", "authorization")

    def __init__(self, method: bytes, path: bytes, gzip_ok: bool, authorization: bytes | None = None) -> None:
        self.method, self.path, self.gzip_ok = method, path, gzip_ok
        self.authorization = authorization


def parse_head(head: bytes) -> _Request:
    """The request line and the headers that matter: Accept-Encoding, and Authorization
    where a web config asks for it."""
    lines = head.split(b"\n")
    request = lines[0].split()
    gzip_ok = any(line[:16].lower() == b"accept-encoding:" and b"gzip" in line.lower() for line in lines[1:])
    authorization = next((line[14:].strip() for line in lines[1:] if line[:14].lower() == b"authorization:"), None)
    method = request[0] if request else b""
    path = request[1].split(b"?", 1)[0] if len(request) > 1 else b""
    return _Request(method, path, gzip_ok, authorization)


def _head_end(data: bytearray) -> int:
    """Where the request head ends (after its blank line), -1 while it has not."""
    at = data.find(b"\r\n\r\n")
    if at >= 0:
        return at + 4
    at = data.find(b"\n\n")
    return at + 2 if at >= 0 else -1


class _Conn:
    __slots__ = ("sock", "data", "out", "sent", "deadline", "reading", "handshaking")

    def __init__(self, sock: socket.socket, deadline: float, handshaking: bool = False) -> None:
        self.sock = sock
        self.data = bytearray()
        self.out = b""
        self.sent = 0
        self.deadline = deadline
        self.reading = True  # still reading its request (else rendering or writing its answer)
        self.handshaking = handshaking  # in its TLS handshake (a web config with tls_server_config)


def _answer(status: bytes, content_type: bytes, body: bytes, gzipped: bool = False, head_only: bool = False,
            extra: bytes = b"") -> bytes:
    head = (b"HTTP/1.0 " + status + b"\r\nContent-Type: " + content_type + b"\r\nContent-Length: "
            + str(len(body)).encode() + (b"\r\nContent-Encoding: gzip" if gzipped else b"") + extra
            + b"\r\nConnection: close\r\n\r\n")
    return head if head_only else head + body


def _not_found(name: str) -> bytes:
    return _answer(b"404 Not Found", b"text/plain", f"the {name} endpoint serves /metrics\n".encode())


class MetricsServer:
    """Serves one exposition on ``/metrics`` (and ``/``) as HTTP/1.0 (see the module).
    ``start()`` runs it on a thread of its own; ``shutdown()`` stops it and
    ``server_close()`` releases the port."""

    request_queue_size = LISTEN_BACKLOG

    def __init__(self, addr: str, port: int, shared: SharedRendering, name: str, content_type: str,
                 workers: int = WORKERS, io_timeout_s: float = IO_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS, web: WebConfig | None = None) -> None:
        self.shared, self.name, self.content_type = shared, name, content_type.encode()
        self.web = web  # TLS and basic auth (profstream/web_config.py), or None
        self.io_timeout_s = io_timeout_s
        self.max_connections = max_connections
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((addr, port))
            self._listener.listen(LISTEN_BACKLOG)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._conns: OrderedDict[int, _Conn] = OrderedDict()  # by file number, oldest first
        self._requests: queue.SimpleQueue = queue.SimpleQueue()  # (conn, request) to render
        self._answers: queue.SimpleQueue = queue.SimpleQueue()  # (conn, bytes) to write
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._workers = [threading.Thread(target=self._work, name=f"{name}-http-{i}", daemon=True)
                         for i in range(workers)]
        self.dropped_slow = 0  # clients dropped for sending or reading too slowly, or for room

    @property
    def server_port(self) -> int:
        return self.server_address[1]

    def start(self) -> MetricsServer:
        for w in self._workers:
            w.start()
        self._thread = threading.Thread(target=self._loop, name=f"{self.name}-http", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop serving (open connections are closed); returns once the I/O thread ended."""
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(10)
        for _ in self._workers:
            self._requests.put(None)

    def server_close(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            for conn in list(self._conns.values()):
                self._close(conn)
            self._selector.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()

    # -- the I/O thread -----------------------------------------------------------------

    def _loop(self) -> None:
        next_sweep = 0.0
        try:
            while not self._stopping.is_set():
                for key, _events in self._selector.select(timeout=0.5):
                    sock = key.fileobj
                    if sock is self._listener:
                        self._accept()
                    elif sock is self._wake_r:
                        self._take_answers()
                    else:
                        conn = self._conns.get(key.fd)
                        if conn is None:
                            pass
                        elif conn.handshaking:
                            self._handshake(conn)
                        elif conn.reading:
                            self._read(conn)
                        else:
                            self._write(conn)
                now = time.monotonic()
                if now >= next_sweep:
                    next_sweep = now + 0.25
                    self._sweep(now)
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)

    def _accept(self) -> None:
        for _ in range(64):  # a burst: up to 64 per wake-up, then the others get a turn
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, say: the client waits in the backlog
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._make_room()
                return
            sock.setblocking(False)
            tls = self.web.settings().tls if self.web is not None else None
            if tls is not None:  # the handshake on this thread too, without blocking (_handshake)
                try:
                    sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (ssl.SSLError, OSError):
                    sock.close()
                    continue
            if len(self._conns) >= self.max_connections:
                self._make_room()
            conn = self._conns[sock.fileno()] = _Conn(sock, time.monotonic() + self.io_timeout_s, tls is not None)
            self._selector.register(sock, selectors.EVENT_READ)
            if conn.handshaking:
                self._handshake(conn)
            else:
                self._read(conn)  # the request is often there already

    def _handshake(self, conn: _Conn) -> None:
        """The next step of ``conn``'s TLS handshake; its request is read once it is done.
        A client that does not speak TLS (plain HTTP to an https port) is dropped."""
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._selector.modify(conn.sock, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._selector.modify(conn.sock, selectors.EVENT_WRITE)
            return
        except (ssl.SSLError, OSError):
            self._close(conn)
            return
        conn.handshaking = False
        self._selector.modify(conn.sock, selectors.EVENT_READ)
        self._read(conn)

    def _make_room(self) -> None:
        """Drop the connection that has waited longest for its request."""
        for conn in self._conns.values():
            if conn.reading:
                self.dropped_slow += 1
                self._close(conn)
                return

    def _read(self, conn: _Conn) -> None:
        while True:
            try:
                chunk = conn.sock.recv(8192)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError:
                chunk = b""
            if not chunk:  # the client went away
                self._close(conn)
                return
            conn.data += chunk
            # TLS: what is decrypted and not yet read wakes no select()
            if not (isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending()) or len(conn.data) > MAX_HEAD_BYTES:
                break
        end = _head_end(conn.data)
        if end < 0:
            if len(conn.data) > MAX_HEAD_BYTES:
                self._respond(conn, _answer(b"431 Request Header Fields Too Large", b"text/plain",
                                            b"request head too long\n"))
            return
        request = parse_head(bytes(conn.data[:end]))
        conn.reading = False
        conn.deadline = time.monotonic() + self.io_timeout_s
        self._selector.unregister(conn.sock)
        if request.method not in (b"GET", b"HEAD"):
            self._respond(conn, _answer(b"405 Method Not Allowed", b"text/plain", b"GET /metrics\n"))
        elif self.web is None and request.path not in (b"/", b"/metrics"):
            self._respond(conn, _not_found(self.name))
        else:  # with a web config, a worker checks the credentials first (bcrypt: never on this thread)
            self._requests.put((conn, request))

    def _respond(self, conn: _Conn, answer: bytes) -> None:
        """Write ``answer`` (on the I/O thread), as much now as the socket takes."""
        if conn.reading:
            conn.reading = False
            self._selector.unregister(conn.sock)
        conn.out, conn.sent = answer, 0
        conn.deadline = time.monotonic() + self.io_timeout_s
        self._write(conn)
        if conn.sock.fileno() >= 0 and conn.sent < len(conn.out):
            self._selector.register(conn.sock, selectors.EVENT_WRITE)

    def _write(self, conn: _Conn) -> None:
        try:
            conn.sent += conn.sock.send(memoryview(conn.out)[conn.sent:])
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            conn.sent = len(conn.out)  # the client went away: nothing more to write
        if conn.sent >= len(conn.out):
            self._close(conn)

    def _take_answers(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            try:
                conn, answer = self._answers.get_nowait()
            except queue.Empty:
                return
            if conn.sock.fileno() >= 0:  # not dropped while it was rendered
                self._respond(conn, answer)

    def _sweep(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline <= now and (c.reading or c.out)]:
            self.dropped_slow += 1
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        self._conns.pop(fd, None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):  # the pipe is full: the loop wakes anyway
            pass

    # -- the workers ----------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            conn, request = item
            try:
                if self.web is not None and not self.web.authorized(request.authorization):
                    answer = _answer(b"401 Unauthorized", b"text/plain", b"Unauthorized\n",
                                     extra=b"\r\nWWW-Authenticate: Basic realm=\"" + self.name.encode() + b"\"")
                elif request.path not in (b"/", b"/metrics"):
                    answer = _not_found(self.name)
                else:
                    job = self.shared.get()
                    body = job.gzipped() if request.gzip_ok else job.body
                    answer = _answer(b"200 OK", self.content_type, body, request.gzip_ok, request.method == b"HEAD")
            except Exception:  # a bug in the rendering: said here, the scraper gets a 500
                log.exception("%s: rendering /metrics failed", self.name)
                answer = _answer(b"500 Internal Server Error", b"text/plain", b"rendering failed\n")
            self._answers.put((conn, answer))
            self._wake()


def serve_metrics(addr: str, port: int, render: Callable[[], bytes], name: str = "profstream",
                  content_type: str = CONTENT_TYPE_PLAIN_0_0_4, max_age_s: float = MAX_AGE_S,
                  web: WebConfig | None = None) -> MetricsServer:
    """Serve ``render()`` on http://addr:port/metrics (and /) from daemon threads; raises
    OSError when the port cannot be bound. ``server.shutdown()`` stops it. A scrape sees
    figures at most ``max_age_s`` older than its own arrival. ``web``: TLS and basic auth
    (https, 401 without a user of its basic_auth_users)."""
    return MetricsServer(addr, port, SharedRendering(render, max_age_s), name, content_type, web=web).start()
