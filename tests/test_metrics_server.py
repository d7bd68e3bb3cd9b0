"""The /metrics server under many scrapers at once (the exporter and the processors use it)."""

from __future__ import annotations

import gzip
import threading
import time
import urllib.request

from profstream.metrics_server import LISTEN_BACKLOG, serve_metrics


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
