"""A hang told while no step ends (issue #32, item 2): what a RankProgress costs the rank's
control thread, and the time from a hang's start to its TrainingHang alert.

- ``record``: in this process, a Monitor (no broker: record_only) and the reader's own
  work per RankProgress, ``--repeats`` times: ``Monitor.where()`` and the encoding, CPU time
  on the calling thread (the control thread, on a rank); and the hand-over of the encoded
  record to librdkafka (``NativeProducer.send``) against the broker, apart.
- ``latency``: ``--ranks`` rank processes (this script, ``--role rank``: a real Monitor with
  ``--interval-s`` progress, 3 steps, then every rank but 0 waits in an Event and rank 0
  sleeps, all in step 3) and a Processor (both stages) in this process with
  ``--hang-after-s``; per trial the wall time from the last rank's entering its blocking
  call (the hang's start; the ranks' clocks, same host) to the TrainingHang alert read from
  the alerts topic here, and from the first rank's entering (when the threshold starts to
  run) to the alert, minus ``--hang-after-s``: what the pipeline adds.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

import _common
from _common import broker_bootstrap, emit, envelope, note, rank_role


def rank_main(args) -> None:
    """A rank that hangs in step 3: rank 0 asleep, the others in an Event (a collective's wait)."""
    from profstream.producers.monitor import Monitor

    monitor = Monitor(bootstrap=args.bootstrap, topic_prefix=args.prefix, run_id=args.run_id, rank=args.rank,
                      world_size=args.ranks, host_sample_interval_s=0, progress_interval_s=args.interval_s)
    with monitor.step(0), monitor.step(1), monitor.step(2):
        pass
    with monitor.step(3):
        print("entering", time.time_ns(), flush=True)
        (time.sleep if args.rank == 0 else lambda _s: threading.Event().wait())(3600)


def _delivered(error: Exception | None) -> None:
    if error is not None:
        raise SystemExit(f"a RankProgress was not delivered: {error}")


def record(conn, args) -> dict:
    from profstream.kafka.clients import make_native_producer
    from profstream.kafka.topics import Topics, ensure_topics
    from profstream.producers.monitor import Monitor
    from profstream.schema.codec import encode

    monitor = Monitor(run_id="bench", rank=3, world_size=8, record_only=True, spool_dir="/tmp/profstream-bench-hang",
                      control=False, host_sample_interval_s=0, device_interval_ms=0)
    monitor.begin_step()
    cpu = []
    value = b""
    for _ in range(args.repeats):
        t0 = time.thread_time_ns()
        step, started, last = monitor.where()
        value = encode("RankProgress", {"run_id": monitor.run_id, "rank": monitor.rank, "world_size": 8,
                                        "host": "node-3", "step": step, "step_started_ns": started,
                                        "last_step": last, "ts_ns": time.time_ns(), "interval_ms": 5000})
        cpu.append((time.thread_time_ns() - t0) / 1e3)
    monitor.close()
    topics = Topics(_common.unique_prefix())
    ensure_topics(conn, topics, partitions=3)
    producer = make_native_producer(conn, compression=None)
    try:
        send = []
        for _ in range(args.repeats):
            t0 = time.thread_time_ns()
            producer.send(topics.raw, value, b"bench/3", _delivered)
            send.append((time.thread_time_ns() - t0) / 1e3)
            producer.poll()
        producer.close(timeout=10)
    finally:
        _common.drop_topics(conn, topics.prefix)
    return {"record_bytes": len(value), "where_and_encode_cpu_us": {
        "median": round(statistics.median(cpu), 2), "p95": round(_common.percentile(cpu, 95), 2), "n": len(cpu)},
        "send_cpu_us": {"median": round(statistics.median(send), 2), "p95": round(_common.percentile(send, 95), 2),
                        "n": len(send)}}


def latency(conn, args) -> dict:
    from profstream.kafka.clients import make_consumer
    from profstream.kafka.topics import Topics, ensure_topics
    from profstream.processors.hangs import HANG_ALERT
    from profstream.processors.runtime import Processor
    from profstream.schema.codec import decode

    totals, beyond = [], []
    for trial in range(args.trials):
        topics = Topics(_common.unique_prefix())
        ensure_topics(conn, topics, partitions=3)
        processor = Processor(conn, topics, group_id=f"g-{topics.prefix}", hang_after_s=args.hang_after_s)
        stop = threading.Event()
        worker = threading.Thread(target=processor.run, args=(stop,), daemon=True)
        worker.start()
        consumer = make_consumer(conn, group_id=None)
        from kafka import TopicPartition

        tps = [TopicPartition(topics.alerts, p) for p in sorted(consumer.partitions_for_topic(topics.alerts))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        run_id = f"hang-{trial}"
        procs = [subprocess.Popen([sys.executable, __file__, "--role", "rank", "--bootstrap", str(conn), "--prefix",
                                   topics.prefix, "--run-id", run_id, "--rank", str(r), "--ranks", str(args.ranks),
                                   "--interval-s", str(args.interval_s)], stdout=subprocess.PIPE, text=True)
                 for r in range(args.ranks)]
        try:
            entered = []
            for p in procs:
                word, ns = p.stdout.readline().split()
                if word != "entering":
                    raise SystemExit("a rank process did not start: run it alone to see why")
                entered.append(int(ns))
            start_ns, first_ns = max(entered), min(entered)
            alert_ns = None
            deadline = time.monotonic() + 120
            while alert_ns is None and time.monotonic() < deadline:
                for msgs in consumer.poll(timeout_ms=100).values():
                    for m in msgs:
                        a = decode("Alert", m.value)
                        if a["name"] == HANG_ALERT and a["state"] == "firing" and a["run_id"] == run_id:
                            alert_ns = time.time_ns()
            if alert_ns is None:
                raise SystemExit(f"trial {trial}: no TrainingHang within 120 s")
            total = (alert_ns - start_ns) / 1e9
            totals.append(total)
            beyond.append((alert_ns - first_ns) / 1e9 - args.hang_after_s)
            note(f"trial {trial}: alert {total:.2f} s after the hang began")
        finally:
            for p in procs:
                p.kill()
            for p in procs:
                p.wait(10)
            consumer.close()
            stop.set()
            worker.join(30)
            _common.drop_topics(conn, topics.prefix)

    def stats(xs):
        return {"median": round(statistics.median(xs), 3), "max": round(max(xs), 3), "n": len(xs)}

    return {"ranks": args.ranks, "hang_after_s": args.hang_after_s, "progress_interval_s": args.interval_s,
            "hang_to_alert_s": stats(totals), "beyond_threshold_s": stats(beyond)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "record", "latency"), default="all")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--hang-after-s", type=float, default=3.0)
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--bootstrap")
    rank_role(parser)
    args = parser.parse_args()
    if args.role == "rank":
        rank_main(args)
        return
    conn = broker_bootstrap(args.bootstrap)
    results = {}
    if args.part in ("all", "record"):
        results["record"] = record(conn, args)
    if args.part in ("all", "latency"):
        results["latency"] = latency(conn, args)
    emit(envelope("hang", args, results))


if __name__ == "__main__":
    main()
