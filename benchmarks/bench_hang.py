"""A hang told while no step ends (issue #32, items 2 and 3): what a RankProgress costs the
rank's control thread and the processor, and the time from a hang's start to its
TrainingHang alert and to every rank's stacks, merged, that autocapture asked for.

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
  run) to the alert, minus ``--hang-after-s``: what the pipeline adds. An
  ``AutoCaptureService`` (default policy) in this process asks for the stacks on the alert;
  from the hang's start to every rank's answer read from the control topic here and merged
  (``latest_answer``, as ``profstream stacks --latest`` does): ``hang_to_stacks_s``.
- ``processor``: in memory, no broker: ``--progress-ranks`` ranks' RankProgress records
  (each in step 3) through the step stage (``StepStage.fold``: decoded and passed on) and
  the run stage (``RunStage.fold``: the HangWatch update), ``--rounds`` rounds, then the run
  stage's ``ready`` (the hang check, at most every 0.5 s) once a round; CPU time per record.

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


def processor_cost(args) -> dict:
    from collections import namedtuple

    from profstream.kafka.topics import Topics
    from profstream.processors.health import StageCounts
    from profstream.processors.runtime import RunStage, StepStage
    from profstream.schema.codec import encode

    Record = namedtuple("Record", "topic partition offset key value")
    topics = Topics("bench")
    step_stage = StepStage(topics, 3, StageCounts(keep_step_ends=False))
    run_stage = RunStage(topics, StageCounts(keep_step_ends=False), hang_after_s=60.0)
    n = args.progress_ranks
    started = time.time_ns()
    step_us, run_us, ready_us = [], [], []
    for round_ in range(args.rounds):
        now_ns = time.time_ns()
        raws = [Record(topics.raw, 0, round_ * n + r, f"bench/{r}".encode(), encode("RankProgress", {
            "run_id": "bench", "rank": r, "world_size": n, "host": f"node-{r // 8}", "step": 3,
            "step_started_ns": started, "last_step": 2, "ts_ns": now_ns, "interval_ms": 5000}))
            for r in range(n)]
        t0 = time.process_time_ns()
        passed = [o for rec in raws for o in step_stage.fold(rec, time.monotonic())]
        t1 = time.process_time_ns()
        for i, o in enumerate(passed):
            run_stage.fold(Record(o.topic, 0, round_ * n + i, o.key, o.value), time.monotonic())
        t2 = time.process_time_ns()
        run_stage.ready(time.monotonic() + round_)  # a second later each round: the check is due
        t3 = time.process_time_ns()
        if len(passed) != n:
            raise SystemExit(f"the step stage passed {len(passed)} of {n} records on")
        step_us.append((t1 - t0) / 1e3 / n)
        run_us.append((t2 - t1) / 1e3 / n)
        ready_us.append((t3 - t2) / 1e3)

    def stats(xs):
        return {"median": round(statistics.median(xs), 2), "p95": round(_common.percentile(xs, 95), 2),
                "n": len(xs)}

    return {"ranks": n, "rounds": args.rounds, "step_stage_pass_cpu_us_per_record": stats(step_us),
            "run_stage_fold_cpu_us_per_record": stats(run_us), "run_stage_ready_cpu_us_per_round": stats(ready_us)}


def latency(conn, args) -> dict:
    from kafka import TopicPartition

    from profstream.control.policy import CapturePolicy
    from profstream.control.records import STATUS, decode_control
    from profstream.control.service import AutoCaptureService
    from profstream.control.stacks import latest_answer
    from profstream.kafka.clients import make_consumer
    from profstream.kafka.topics import Topics, ensure_topics
    from profstream.processors.hangs import HANG_ALERT
    from profstream.processors.runtime import Processor
    from profstream.schema.codec import decode

    totals, beyond, stacks_s = [], [], []
    for trial in range(args.trials):
        topics = Topics(_common.unique_prefix())
        ensure_topics(conn, topics, partitions=3)
        processor = Processor(conn, topics, group_id=f"g-{topics.prefix}", hang_after_s=args.hang_after_s)
        stop = threading.Event()
        worker = threading.Thread(target=processor.run, args=(stop,), daemon=True)
        worker.start()
        service = AutoCaptureService(conn, topics, CapturePolicy())
        service_ready = threading.Event()
        asker = threading.Thread(target=service.run, args=(stop, service_ready.set), daemon=True)
        asker.start()
        if not service_ready.wait(60):
            raise SystemExit("the autocapture service did not start")
        consumer = make_consumer(conn, group_id=None)
        tps = [TopicPartition(t, p) for t in (topics.alerts, topics.control)
               for p in sorted(consumer.partitions_for_topic(t))]
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
            alert_ns = merged_ns = None
            statuses = []
            deadline = time.monotonic() + args.hang_after_s + 120
            while merged_ns is None and time.monotonic() < deadline:
                for msgs in consumer.poll(timeout_ms=100).values():
                    for m in msgs:
                        if m.topic == topics.alerts:
                            a = decode("Alert", m.value)
                            if a["name"] == HANG_ALERT and a["state"] == "firing" and a["run_id"] == run_id:
                                alert_ns = time.time_ns()
                            continue
                        name, record = decode_control(m.value)
                        if name == STATUS and record["run_id"] == run_id:
                            statuses.append(record)
                answer = latest_answer(statuses) if statuses else None
                if answer is not None and len(answer.answered) == args.ranks:
                    merged_ns = time.time_ns()
                    if [g.ranks for g in answer.groups][0] != [0]:
                        raise SystemExit(f"trial {trial}: groups {[g.ranks for g in answer.groups]}")
            if alert_ns is None or merged_ns is None:
                raise SystemExit(f"trial {trial}: no TrainingHang or no stacks within {args.hang_after_s + 120:g} s")
            total = (alert_ns - start_ns) / 1e9
            totals.append(total)
            beyond.append((alert_ns - first_ns) / 1e9 - args.hang_after_s)
            stacks_s.append((merged_ns - start_ns) / 1e9)
            note(f"trial {trial}: alert {total:.2f} s, stacks {stacks_s[-1]:.2f} s after the hang began")
        finally:
            for p in procs:
                p.kill()
            for p in procs:
                p.wait(10)
            consumer.close()
            stop.set()
            worker.join(30)
            asker.join(30)
            _common.drop_topics(conn, topics.prefix)

    def stats(xs):
        return {"median": round(statistics.median(xs), 3), "max": round(max(xs), 3), "n": len(xs)}

    return {"ranks": args.ranks, "hang_after_s": args.hang_after_s, "progress_interval_s": args.interval_s,
            "hang_to_alert_s": stats(totals), "beyond_threshold_s": stats(beyond), "hang_to_stacks_s": stats(stacks_s),
            "alert_to_stacks_s": stats([b - a for a, b in zip(totals, stacks_s)])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "record", "processor", "latency"), default="all")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--hang-after-s", type=float, default=3.0)
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--progress-ranks", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--bootstrap")
    rank_role(parser)
    args = parser.parse_args()
    if args.role == "rank":
        rank_main(args)
        return
    results = {}
    if args.part in ("all", "processor"):
        results["processor"] = processor_cost(args)
    if args.part == "processor":
        emit(envelope("hang", args, results))
        return
    conn = broker_bootstrap(args.bootstrap)
    if args.part in ("all", "record"):
        results["record"] = record(conn, args)
    if args.part in ("all", "latency"):
        results["latency"] = latency(conn, args)
    emit(envelope("hang", args, results))


if __name__ == "__main__":
    main()
