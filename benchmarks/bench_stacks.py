"""Every rank's stacks on demand (issue #32): time from request to merged stacks, and what
the dump costs the rank's control thread.

- ``latency``: ``--ranks`` rank processes (this script, ``--role rank``: a real Monitor,
  a few steps, then the main thread waits in an Event, one rank sleeps in another
  function) and this process asking ``ask_stacks`` ``--requests`` times, one after the
  other: per request the wall time from just before the request is sent to every rank's
  answer read and the groups merged (``profstream stacks`` minus its start-up). The first
  request of a requester creates its request topic, which the ranks' readers find at their
  next scan (every 5 s): reported apart, as ``first_request_s``.
- ``dump``: ``thread_stacks()`` in this process with ``--threads`` extra threads each
  ``--depth`` frames deep: the CPU time of one dump on the calling thread (the reader's, on
  a rank), and the encoded size of the answer.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

from _common import broker_bootstrap, drop_topics, emit, envelope, note, percentile, unique_prefix


def rank_main(args) -> None:
    from profstream.producers.monitor import Monitor

    monitor = Monitor(bootstrap=args.bootstrap, topic_prefix=args.prefix, run_id=args.run_id, rank=args.rank,
                      world_size=args.ranks, host_sample_interval_s=0)
    for _ in range(3):
        monitor.begin_step()
        monitor.end_step()
    monitor.begin_step()
    print("ready", flush=True)
    if args.rank == 0:
        time.sleep(3600)  # the odd one out
    else:
        threading.Event().wait()


def latency(conn, args) -> dict:
    from profstream.control.stacks import ask_stacks
    from profstream.kafka.topics import Topics, ensure_topics

    topics = Topics(unique_prefix())
    ensure_topics(conn, topics, partitions=3)
    procs = [subprocess.Popen([sys.executable, __file__, "--role", "rank", "--bootstrap", str(conn), "--prefix",
                               topics.prefix, "--run-id", "bench-run", "--rank", str(r), "--ranks", str(args.ranks)],
                              stdout=subprocess.PIPE, text=True) for r in range(args.ranks)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise SystemExit("a rank process did not start: run it alone to see why")
        started = time.monotonic()
        first = ask_stacks(conn, topics, "bench-run", timeout_s=30)
        first_s = time.monotonic() - started
        note(f"first request: {first_s:.2f} s, {len(first.answered)} ranks, {len(first.groups)} groups")
        times = []
        for i in range(args.requests):
            started = time.monotonic()
            answer = ask_stacks(conn, topics, "bench-run", timeout_s=30)
            times.append(time.monotonic() - started)
            if len(answer.answered) != args.ranks or [g.ranks for g in answer.groups][0] != [0]:
                raise SystemExit(f"request {i}: {len(answer.answered)} ranks answered, groups "
                                 f"{[g.ranks for g in answer.groups]}")
        return {"ranks": args.ranks, "first_request_s": round(first_s, 3),
                "request_to_merged_s": {"median": round(statistics.median(times), 3),
                                        "p95": round(percentile(times, 95), 3), "max": round(max(times), 3),
                                        "n": len(times)}}
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(10)
        drop_topics(conn, topics.prefix)


def dump(args) -> dict:
    from profstream.control.records import FINISHED, encode_status, new_stacks_request, new_status
    from profstream.producers.stacks import thread_stacks

    stop = threading.Event()

    def deep(n: int) -> None:
        if n:
            return deep(n - 1)
        stop.wait()

    workers = [threading.Thread(target=deep, args=(args.depth,), daemon=True) for _ in range(args.threads)]
    for w in workers:
        w.start()
    time.sleep(0.2)  # let them reach their depth (a benchmark, not a test)
    try:
        cpu = []
        for _ in range(args.repeats):
            t0 = time.thread_time_ns()
            threads, omitted = thread_stacks()
            cpu.append((time.thread_time_ns() - t0) / 1e6)
        size = len(encode_status(new_status(new_stacks_request("r"), FINISHED, 0, threads=threads,
                                            threads_omitted=omitted)))
    finally:
        stop.set()
    return {"threads": len(threads), "depth": args.depth, "dump_cpu_ms": {
        "median": round(statistics.median(cpu), 3), "max": round(max(cpu), 3)}, "answer_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "latency", "dump"), default="all")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--depth", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--bootstrap")
    parser.add_argument("--role", default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "rank":
        rank_main(args)
        return
    results = {}
    if args.part in ("all", "dump"):
        results["dump"] = dump(args)
    if args.part in ("all", "latency"):
        results["latency"] = latency(broker_bootstrap(args.bootstrap), args)
    emit(envelope("stacks", args, results))


if __name__ == "__main__":
    main()
