"""A normal /metrics scrape while clients hold idle half-requests open (issue 37).

Clients that connect, send half a request line and then nothing (a stuck scraper, a port
scanner, a load balancer's health check gone wrong) used to hold the exporter's worker
threads: with 8 of them every scrape took 20 s. Per repeat, a child process (its own
interpreter's GIL, as the exporter has) serves an ``ExporterState`` of ``--ranks`` ranks
of one run with the exporter's HTTP server (profstream/metrics_server.py), fed one step
of every rank a second while the scrapes run (bench_exporter_ranks's child). This process
then times ``--scrapes`` GETs of /metrics with Prometheus's request headers (gzip), each
past the server's shared-rendering age so that it renders afresh, first with no other
client (``baseline``), then with ``--idle`` clients each holding a connection that sent
``GET /metr`` and nothing more (``idle``; they are opened anew every 20 scrapes, since
the server drops a client silent for 10 s). A scrape is timed from the request to its
last byte; one that fails or takes over 10 s counts as an error.

Target: p99 of a scrape with 64 idle connections open <= 50 ms.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

from _common import emit, envelope, note, percentile, summary
from bench_exporter import get
from bench_exporter_ranks import serve_child

from profstream.metrics_server import MAX_AGE_S
from profstream.sinks.rank_summary import DEFAULT_TOP_RANKS

TARGET_P99_MS = 50.0
REFRESH_EVERY = 20  # scrapes between two sets of idle clients (the server drops one silent for 10 s)


def idle_clients(port: int, n: int) -> list[socket.socket]:
    held = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /metr")
        held.append(s)
    return held


def scrapes(url: str, port: int, n: int, idle: int) -> tuple[list[float], int]:
    times, errors, held = [], 0, []
    try:
        for i in range(n):
            if idle and i % REFRESH_EVERY == 0:
                for s in held:
                    s.close()
                held = idle_clients(port, idle)
            time.sleep(MAX_AGE_S + 0.02)  # past the shared rendering: this scrape renders afresh
            try:
                ms, _body, _wire = get(url)
                times.append(ms)
            except OSError:
                errors += 1
    finally:
        for s in held:
            s.close()
    return times, errors


def one_repeat(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    port_q, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=serve_child, args=(args.ranks, args.warm_steps, DEFAULT_TOP_RANKS, 500, port_q, stop))
    child.start()
    try:
        port = port_q.get(timeout=600)
        url = f"http://127.0.0.1:{port}/metrics"
        out = {}
        for name, idle in (("baseline", 0), ("idle", args.idle)):
            times, errors = scrapes(url, port, args.scrapes, idle)
            out[name] = {"p50": statistics.median(times) if times else None,
                         "p99": percentile(times, 99) if times else None,
                         "max": max(times) if times else None, "errors": errors}
        out["loadavg_1m"] = round(os.getloadavg()[0], 2)
        return out
    finally:
        stop.set()
        child.join(60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--warm-steps", type=int, default=10, help="steps of every rank folded before timing")
    p.add_argument("--scrapes", type=int, default=200, help="timed scrapes per repeat and case")
    p.add_argument("--idle", type=int, default=64, help="idle half-request connections held open")
    args = p.parse_args(argv)
    runs = []
    for r in range(args.repeats):
        run = one_repeat(args)
        runs.append(run)
        note(f"repeat {r + 1}/{args.repeats}: baseline p99 {run['baseline']['p99']:.1f} ms, with {args.idle} idle "
             f"clients p99 {run['idle']['p99']:.1f} ms ({run['idle']['errors']} errors; load {run['loadavg_1m']})")
    results = {
        "metric": "scrape: one GET of /metrics (gzip) rendered afresh, request to last byte, with --ranks ranks "
                  "held, alone and with --idle clients holding half a request line; p50/p99 per repeat, medians "
                  "over repeats",
        "unit": "ms", "target_idle_p99_ms": TARGET_P99_MS,
        "workload": {"ranks": args.ranks, "scrapes": args.scrapes, "idle_connections": args.idle},
        "baseline_p50_ms": summary([r["baseline"]["p50"] for r in runs]),
        "baseline_p99_ms": summary([r["baseline"]["p99"] for r in runs]),
        "idle_p50_ms": summary([r["idle"]["p50"] for r in runs if r["idle"]["p50"] is not None] or [float("nan")]),
        "idle_p99_ms": summary([r["idle"]["p99"] for r in runs if r["idle"]["p99"] is not None] or [float("nan")]),
        "idle_errors": sum(r["idle"]["errors"] for r in runs),
        "repeats": runs,
    }
    results["meets_target"] = results["idle_errors"] == 0 and results["idle_p99_ms"]["median"] <= TARGET_P99_MS
    emit(envelope("bench_scrape_idle", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
