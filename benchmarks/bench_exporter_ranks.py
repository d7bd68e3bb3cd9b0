"""Prometheus exporter with 1,024 ranks: series in the exposition and the time of a /metrics
scrape, in the bounded mode (``--top-ranks``, 64 by default) and with every rank's series.

Per mode and repeat, a child process (its own interpreter's GIL, as the exporter has)
holds an ``ExporterState`` fed as the exporter's consumer feeds it, encoded StepMetrics
through ``handle()`` in batches of ``--batch`` records: ``--ranks`` ranks of one run,
``--warm-steps`` steps each before timing starts, then one step of every rank a second
while the scrapes run (so a scrape can wait for the consumer's lock, as in production).
Records are bench_exporter's (11 op types, a queue, memory; step time growing with the
rank, so the slowest set is a real choice). The child serves the state with the
exporter's HTTP server (profstream/metrics_server.py). This process GETs /metrics with
Prometheus's request headers (gzip) ``--scrapes`` times, each more than the server's
shared-rendering age after the one before, so that every scrape renders the exposition
afresh; a scrape is timed from the request to its last byte.

``series``: samples in one exposition of ``--count-ranks`` ranks (1,000: the figure per
1,000 ranks of docs/metrics.md), per mode, counted from the text the exporter writes:
those with a rank label, the run's others, and the exporter's own health.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections import namedtuple
from typing import Any

from _common import emit, envelope, note, percentile, summary
from bench_exporter import get, step_metrics

from profstream.kafka.topics import Topics
from profstream.metrics_server import MAX_AGE_S, serve_metrics
from profstream.schema.codec import encode
from profstream.sinks.prometheus import ExporterState
from profstream.sinks.rank_summary import DEFAULT_TOP_RANKS

TARGET_SCRAPE_MS = 100.0  # issue 14: 1,024 ranks, bounded mode
Rec = namedtuple("Rec", "topic partition offset timestamp value")
TOPICS = Topics("bench")
MODES = {"bounded": DEFAULT_TOP_RANKS, "all": None}


def records(ranks: int, step: int) -> list[Rec]:
    now_ns = time.time_ns()
    return [Rec(TOPICS.steps, 0, 0, now_ns // 10**6, encode("StepMetrics", step_metrics("big", rank, step, now_ns)))
            for rank in range(ranks)]


def feed(state: ExporterState, recs: list[Rec], batch: int) -> None:
    for i in range(0, len(recs), batch):
        state.handle(recs[i:i + batch])


def filled(ranks: int, steps: int, top_ranks: int | None, batch: int) -> ExporterState:
    state = ExporterState(TOPICS, top_ranks=top_ranks)
    for step in range(steps):
        feed(state, records(ranks, step), batch)
    return state


def serve_child(ranks: int, steps: int, top_ranks: int | None, batch: int, port_q: Any, stop: Any) -> None:
    state = filled(ranks, steps, top_ranks, batch)
    server = serve_metrics("127.0.0.1", 0, state.exposition, "bench exporter")
    port_q.put(server.server_port)
    step = steps
    while not stop.wait(max(0.0, 1.0 - (time.monotonic() % 1.0))):
        feed(state, records(ranks, step), batch)  # one step of every rank a second
        step += 1
    server.shutdown()
    server.server_close()


def one_repeat(args: argparse.Namespace, top_ranks: int | None) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    port_q, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=serve_child, args=(args.ranks, args.warm_steps, top_ranks, args.batch, port_q, stop))
    child.start()
    try:
        url = f"http://127.0.0.1:{port_q.get(timeout=600)}/metrics"
        load_before = os.getloadavg()[0]
        times, size, wire = [], 0, 0
        for _ in range(args.scrapes):
            time.sleep(MAX_AGE_S + 0.02)  # past the shared rendering: this scrape renders afresh
            ms, body, wire = get(url)
            size = len(body)
            times.append(ms)
        return {"scrape_ms": {"p50": statistics.median(times), "p95": percentile(times, 95),
                              "p99": percentile(times, 99), "max": max(times)},
                "bytes": size, "gzip_bytes": wire,
                "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    finally:
        stop.set()
        child.join(60)


def series_count(ranks: int, top_ranks: int | None) -> dict[str, int]:
    lines = [line for line in filled(ranks, 5, top_ranks, 1000).exposition().decode().splitlines()
             if line and not line.startswith("#")]
    health = sum(x.startswith("profstream_sink_") for x in lines)
    per_rank = sum('rank="' in x.split("}", 1)[0] for x in lines)
    return {"samples": len(lines), "per_rank": per_rank, "per_run": len(lines) - per_rank - health,
            "sink_health": health}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--warm-steps", type=int, default=10, help="steps of every rank folded before timing")
    p.add_argument("--scrapes", type=int, default=30, help="timed scrapes per repeat")
    p.add_argument("--batch", type=int, default=500, help="records per handle() call (a consumer poll)")
    p.add_argument("--count-ranks", type=int, default=1000, help="ranks of the exposition whose series are counted")
    p.add_argument("--modes", default="bounded,all", help="bounded (--top-ranks 64) and/or all")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, Any] = {
        "metric": "scrape: one GET of /metrics (gzip) rendered afresh, request to last byte, with --ranks ranks "
                  "held; p50/p99 per repeat, medians over repeats",
        "unit": "ms", "workload": {"ranks": args.ranks, "warm_steps": args.warm_steps, "scrapes": args.scrapes,
                                   "steps_per_s_per_rank_while_scraping": 1},
        "series": {}, "modes": {}}
    for mode in modes:
        results["series"][mode] = series_count(args.count_ranks, MODES[mode])
        note(f"{mode}: {results['series'][mode]['samples']} series for {args.count_ranks} ranks")
        runs = []
        for r in range(args.repeats):
            run = one_repeat(args, MODES[mode])
            runs.append(run)
            note(f"{mode} repeat {r + 1}/{args.repeats}: scrape p50 {run['scrape_ms']['p50']:.1f} ms, p99 "
                 f"{run['scrape_ms']['p99']:.1f} ms ({run['bytes']} bytes, {run['gzip_bytes']} gzipped; "
                 f"load {run['loadavg_1m']})")
        results["modes"][mode] = {
            "top_ranks": MODES[mode],
            "scrape_p50_ms": summary([r["scrape_ms"]["p50"] for r in runs]),
            "scrape_p99_ms": summary([r["scrape_ms"]["p99"] for r in runs]),
            "runs": runs}
    if "bounded" in results["modes"]:
        p50 = results["modes"]["bounded"]["scrape_p50_ms"]["median"]
        results["target"] = {"max_scrape_ms_bounded": TARGET_SCRAPE_MS}
        results["meets_target"] = p50 <= TARGET_SCRAPE_MS
    results["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    emit(envelope("exporter_ranks", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
