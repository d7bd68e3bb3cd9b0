"""The /metrics server under many scrapers at once (the exporter and the processors use it)."""

from __future__ import annotations

import contextlib
import gzip
import socket
import threading
import time
import urllib.request

from profstream.metrics_server import LISTEN_BACKLOG, MetricsServer, SharedRendering, serve_metrics


def test_concurrent_scrapes_share_one_rendering_and_all_get_the_whole_exposition():
    renders = []

    def render() -> bytes:
        renders.append(time.monotonic())
        time.sleep(0.05)  # an exposition that takes a while to write
        return b"".join(b"profstream_demo_metric{rank=\"%d\"} %d\n" % (i, len(renders)) for i in range(500))

    server = serve_metrics("127.0.0.1", 0, render, "test")
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    bodies: list[bytes] = []
    errors: list[BaseException] = []
    start = threading.Barrier(100)

    def scrape(i: int) -> None:
        try:
            start.wait(10)
            request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"} if i % 2 else {})
            with urllib.request.urlopen(request, timeout=10) as response:
                body = response.read()
                if response.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                bodies.append(body)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=scrape, args=(i,)) for i in range(100)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        server.shutdown()
        server.server_close()
    assert not errors, errors[:3]
    assert len(bodies) == 100 and all(b.count(b"\n") == 500 for b in bodies)
    # 100 scrapes, each rendering alone, would take 100 renderings (5 s of them back to back)
    assert len(renders) <= 10, len(renders)


def test_the_listen_backlog_holds_a_burst_of_connections():
    server = serve_metrics("127.0.0.1", 0, lambda: b"x 1\n", "test")
    try:
        assert server.request_queue_size == LISTEN_BACKLOG >= 1024
    finally:
        server.shutdown()
        server.server_close()



@contextlib.contextmanager
def held_open(server: MetricsServer, clients: int, request: bytes = b"GET /metr", rcvbuf: int = 0):
    """``server`` with ``clients`` connections that sent ``request`` and then nothing (nor
    read anything); all closed, and the server stopped, at the end."""
    held = []
    try:
        for _ in range(clients):
            s = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
            if rcvbuf:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            s.sendall(request)
            held.append(s)
        yield held
    finally:
        for s in held:
            s.close()
        server.shutdown()
        server.server_close()


def scrape(server: MetricsServer) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as response:
        return response.read()


def test_idle_half_requests_do_not_delay_a_scrape():
    # 8 of them held every scrape of the exporter for 20 s (issue 37): each took a worker
    server = serve_metrics("127.0.0.1", 0, lambda: b"profstream_x 1\n" * 1000, "test")
    with held_open(server, 64):
        for _ in range(5):
            started = time.monotonic()
            body = scrape(server)
            took = time.monotonic() - started
            assert body.count(b"\n") == 1000
            assert took < 2.0, f"a scrape took {took:.1f} s with 64 idle clients open"


def test_a_client_that_does_not_read_its_answer_holds_no_one_else():
    body = b"profstream_x 1\n" * 400_000  # 6 MB: more than a socket buffer takes at once
    server = serve_metrics("127.0.0.1", 0, lambda: body, "test")
    with held_open(server, 8, b"GET /metrics HTTP/1.0\r\n\r\n", rcvbuf=4096):  # ask and never read
        started = time.monotonic()
        assert len(scrape(server)) == len(body)
        assert time.monotonic() - started < 5.0


def test_a_client_silent_past_the_timeout_is_dropped():
    server = MetricsServer("127.0.0.1", 0, SharedRendering(lambda: b"x 1\n"), "test", "text/plain",
                           io_timeout_s=0.5).start()
    with held_open(server, 3) as held:
        deadline = time.monotonic() + 10
        while server.dropped_slow < 3:
            assert time.monotonic() < deadline, f"dropped {server.dropped_slow} of 3 silent clients"
            time.sleep(0.05)
        for s in held:  # each sees its connection closed
            s.settimeout(5)
            assert s.recv(100) == b""


def test_past_the_connection_limit_the_longest_silent_client_makes_room():
    server = MetricsServer("127.0.0.1", 0, SharedRendering(lambda: b"x 1\n"), "test", "text/plain",
                           max_connections=16).start()
    with held_open(server, 16):
        assert scrape(server) == b"x 1\n"
        assert server.dropped_slow >= 1


def test_bad_requests_get_their_status():
    server = serve_metrics("127.0.0.1", 0, lambda: b"x 1\n", "test")
    with held_open(server, 0):
        for request, status in ((b"POST /metrics HTTP/1.0\r\n\r\n", b"405"), (b"GET /other HTTP/1.0\r\n\r\n", b"404"),
                                (b"GET /metrics HTTP/1.0\r\n" + b"X: " + b"a" * 20000, b"431"),
                                (b"HEAD /metrics HTTP/1.0\r\n\r\n", b"200")):
            with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as s:
                s.sendall(request)
                answer = b""
                while chunk := s.recv(65536):
                    answer += chunk
            assert answer.split()[1] == status, answer[:80]
            if request.startswith(b"HEAD"):
                assert answer.endswith(b"\r\n\r\n")  # no body
