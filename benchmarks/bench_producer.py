"""Sustained op events/s that one process records with a Monitor AND delivers to the broker.

Two variants, each ``--repeats`` times with a fresh Monitor on a fresh topic prefix:

- ``bulk`` (the target): ``Monitor.ops()`` with prebuilt 1,000-op chunks for ``--duration``
  seconds, then ``flush()``.
- ``per_call``: ``Monitor.op()`` once per op (the training loop calling op once per
  kernel), in bursts of 1,000 calls, for ``--op-duration`` seconds, then ``flush()``.

By default the driver is closed-loop: when ``--high-water`` ops are buffered it sleeps
0.5 ms, so it offers as much as the Monitor's sender can deliver and never drops. With
``--rate`` it offers a fixed rate instead. A repeat counts only if nothing was dropped,
no batch failed and flush() returned True; its figure is ops / (offer time + flush time).
After the run the messages on ``<prefix>.raw`` (sum of end offsets) must equal the
batches the broker acknowledged.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from _common import (
    add_kafka_config,
    broker_bootstrap,
    drop_topics,
    emit,
    envelope,
    note,
    summary,
    unique_prefix,
    wait_connected,
)

from profstream.kafka.clients import make_consumer
from profstream.kafka.topics import Topics
from profstream.producers.monitor import Monitor

TARGET_OPS_PER_S = 1_000_000
CHUNK = 1000


def prebuilt_chunks(count: int, n: int, seed: int = 7) -> list[dict[str, list]]:
    """``count`` chunks of ``n`` ops as columns: 50 names over 10 types, increasing timestamps.

    Durations and gaps are random, so the batches compress on the wire about as real ones
    do (one chunk repeated would compress far better than a training run's ops)."""
    rng = random.Random(seed)
    t = time.time_ns()
    chunks = []
    for _ in range(count):
        names, types, kinds, streams, starts, durs = [], [], [], [], [], []
        for _ in range(n):
            k = rng.randrange(50)
            names.append(f"aten::op_{k}")
            types.append(f"type_{k % 10}")
            kinds.append(k % 3)
            streams.append(k % 4)
            dur = rng.randrange(1_000, 500_000)
            starts.append(t)
            durs.append(dur)
            t += dur + rng.randrange(100, 5_000)
        chunks.append({"names": names, "op_types": types, "kinds": kinds, "streams": streams,
                       "start_ns": starts, "dur_ns": durs})
    return chunks


def drive(monitor: Monitor, variant: str, duration: float, high_water: int, rate: float,
          distinct_chunks: int = 16) -> dict[str, Any]:
    """Offer ops for ``duration`` s; returns ops offered, time spent and back-pressure waits."""
    chunks = prebuilt_chunks(distinct_chunks, CHUNK)
    cols = [(c["names"], c["start_ns"], c["dur_ns"], c["kinds"], c["op_types"], c["streams"]) for c in chunks]
    calls = [list(zip(*c)) for c in cols]
    ops, op = monitor.ops, monitor.op
    pc, sleep = time.perf_counter, time.sleep
    pushed = waits = i = 0
    t0 = pc()
    deadline = t0 + duration
    while True:
        now = pc()
        if now >= deadline:
            break
        if monitor.buffered_ops >= high_water or (rate and pushed >= rate * (now - t0)):
            waits += 1
            sleep(0.0005)
            continue
        i = (i + 1) % distinct_chunks
        if variant == "bulk":
            names, starts, durs, kinds, types, streams = cols[i]
            ops(names, starts, durs, kinds=kinds, op_types=types, streams=streams)
        else:
            for name, start, dur, kind, op_type, stream in calls[i]:
                op(name, start, dur, kind, op_type, stream)
        pushed += CHUNK
    return {"ops_offered": pushed, "offer_s": pc() - t0, "backpressure_waits": waits}


def one_repeat(bootstrap: str, prefix: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"buffer_bytes": args.buffer_mib << 20}
    if args.batch_max_ops:
        options["batch_max_ops"] = args.batch_max_ops
    monitor = Monitor(run_id=f"bench-{variant}", connection=bootstrap, topic_prefix=prefix, **options)
    try:
        wait_connected(monitor, bootstrap)
        s0 = monitor.stats()
        duration = args.duration if variant == "bulk" else args.op_duration
        t0 = time.perf_counter()
        out = drive(monitor, variant, duration, args.high_water, args.rate, args.distinct_chunks)
        flushed = monitor.flush(args.flush_timeout)
        elapsed = time.perf_counter() - t0
        s1 = monitor.stats()
    finally:
        monitor.close(timeout=30.0)
    final = monitor.stats()

    def delta(key: str) -> int:
        return s1[key] - s0[key]

    dropped, failed, acked = delta("dropped_ops"), delta("batches_failed"), delta("batches_acked")
    valid = flushed and dropped == 0 and failed == 0
    delivered = out["ops_offered"] - dropped if failed == 0 else None
    return {
        **out,
        "flush_s": elapsed - out["offer_s"], "elapsed_s": elapsed, "flushed": flushed,
        "dropped_ops": dropped, "batches_failed": failed, "batches_acked": acked,
        "valid": valid,
        "delivered_ops_per_s": delivered / elapsed if valid else None,
        "recorded_ops_per_s_while_offering": out["ops_offered"] / out["offer_s"],
        "batches_per_s": acked / elapsed,
        "message_mb_per_s": delta("bytes_sent") / elapsed / 1e6,
        "mean_ops_per_batch": out["ops_offered"] / acked if acked else None,
        "mean_message_bytes": delta("bytes_sent") / delta("batches_sent") if delta("batches_sent") else None,
        "batches_acked_total": final["batches_acked"],
    }


def raw_messages(bootstrap: str, prefix: str) -> int:
    """Messages on ``<prefix>.raw``: the sum of its partitions' end offsets."""
    from kafka import TopicPartition

    topic = Topics(prefix).raw
    consumer = make_consumer(bootstrap, group_id=None)
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        ends = consumer.end_offsets([TopicPartition(topic, p) for p in parts])
        return sum(ends.values())
    finally:
        consumer.close()


def variant_figure(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    good = [r["delivered_ops_per_s"] for r in repeats if r["valid"]]
    return {
        "delivered_ops_per_s": [r["delivered_ops_per_s"] for r in repeats],
        "median_delivered_ops_per_s": summary(good)["median"] if good else None,
        "delivered_summary": summary(good) if good else None,
        "valid_repeats": len(good),
        "median_batches_per_s": summary([r["batches_per_s"] for r in repeats])["median"],
        "median_message_mb_per_s": summary([r["message_mb_per_s"] for r in repeats])["median"],
        "median_ops_per_batch": summary([r["mean_ops_per_batch"] or 0 for r in repeats])["median"],
        "dropped_ops": [r["dropped_ops"] for r in repeats],
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", help="broker host:port (default: start/reuse `profstream stack up`)")
    add_kafka_config(p)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--duration", type=float, default=10.0, help="seconds of offered load, bulk variant")
    p.add_argument("--op-duration", type=float, default=3.0, help="seconds of offered load, per-call variant")
    p.add_argument("--rate", type=float, default=0.0, help="offered ops/s (0: closed loop, as fast as delivered)")
    p.add_argument("--high-water", type=int, default=65_536,
                   help="closed loop: wait while this many ops are buffered")
    p.add_argument("--buffer-mib", type=int, default=256, help="Monitor buffer_bytes in MiB")
    p.add_argument("--batch-max-ops", type=int, default=None, help="Monitor batch_max_ops (default: its own)")
    p.add_argument("--distinct-chunks", type=int, default=16,
                   help="prebuilt 1,000-op chunks cycled through (distinct data, realistic compression)")
    p.add_argument("--flush-timeout", type=float, default=120.0)
    p.add_argument("--variants", default="bulk,per_call")
    p.add_argument("--keep-topics", action="store_true", help="do not delete the benchmark's topics")
    args = p.parse_args(argv)

    bootstrap = broker_bootstrap(args.bootstrap, args.kafka_config)
    prefix = unique_prefix()
    note(f"broker {bootstrap}, topic prefix {prefix}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    figures: dict[str, Any] = {}
    acked_total = 0
    try:
        for variant in variants:
            repeats = []
            for r in range(args.repeats):
                rep = one_repeat(bootstrap, prefix, variant, args)
                acked_total += rep["batches_acked_total"]
                repeats.append(rep)
                rate = rep["delivered_ops_per_s"]
                note(f"{variant} repeat {r + 1}/{args.repeats}: "
                     f"{f'{rate:.0f}' if rate else 'INVALID'} ops/s delivered, "
                     f"{rep['batches_per_s']:.1f} batches/s, {rep['message_mb_per_s']:.1f} MB/s, "
                     f"dropped {rep['dropped_ops']}, flush {rep['flush_s']:.2f} s")
            figures[variant] = variant_figure(repeats)
        on_topic = raw_messages(bootstrap, prefix)
    finally:
        if not args.keep_topics:
            drop_topics(bootstrap, prefix)

    bulk = figures.get("bulk", {})
    median = bulk.get("median_delivered_ops_per_s")
    verified = on_topic == acked_total
    results = {
        "bootstrap": str(bootstrap), "security": bootstrap.protocol, "topic_prefix": prefix,
        "metric": "bulk: op events/s recorded with Monitor.ops() and acknowledged by the broker",
        "unit": "ops/s",
        "per_repeat": bulk.get("delivered_ops_per_s"),
        "median": median,
        "target": {"min_delivered_ops_per_s": TARGET_OPS_PER_S},
        "meets_target": bool(median and median >= TARGET_OPS_PER_S and verified),
        "delivery_check": {"messages_on_raw_topic": on_topic, "batches_acked": acked_total,
                           "equal": verified},
        "variants": figures,
    }
    emit(envelope("producer", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
