"""Per-call cost of ``Monitor.op()`` on the training thread.

Figures (ns per recorded op, timed in chunks of calls with perf_counter_ns). The call
arguments are prebuilt (50 op names, random durations, increasing timestamps) and the
same loop drives every figure, so the figures differ only in what ``op`` is:

- ``op_real_broker`` (the target): a tight loop of ``op(name, start_ns, dur_ns)`` while the
  Monitor's sender thread builds and sends batches to a real broker. The buffer is large
  enough that every call takes the accepting path; the sender is flushed between repeats
  and any drop is reported.
- ``op_paced``: the same at a paced offered rate (default 100,000 ops/s, in bursts of
  1,000 calls), as a training loop that also waits for its device.
- ``op_broker_unreachable``: bootstrap 127.0.0.1:1 and a small buffer, filled before
  timing: every timed call takes the drop path.
- ``ops_bulk_real_broker``: ``Monitor.ops()`` with 1,000 prebuilt ops per call, per op.
- ``op_no_sender`` and ``loop_and_empty_call``: context. The same loop with no sender
  thread at all, and with a Python function that does nothing.
- ``step_no_sender``: ns per step boundary, ``begin_step()`` + ``end_step()`` of a step with
  no op (the step mark and what the step lost), with no sender thread.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from _common import (
    add_kafka_config,
    broker_bootstrap,
    cpu_hog,
    drop_topics,
    emit,
    envelope,
    note,
    percentile,
    summary,
    unique_prefix,
    wait_connected,
)

from profstream.producers.monitor import Monitor

TARGET_NS = 400.0  # issue #19 (was 1,000 in #2)
TARGET_POOLED_P99_NS = 1500.0
UNREACHABLE = "127.0.0.1:1"
BULK = 1000


class _NoSender:
    """A sender that never runs: measures op() without a background thread."""

    def __init__(self, monitor: Monitor) -> None:
        pass

    def start(self) -> None:
        pass

    def flush(self, timeout: float) -> bool:
        return True

    def stop(self, timeout: float) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {}


def _noop(name: str, start_ns: int, dur_ns: int) -> None:
    pass


def op_calls(n: int, seed: int = 7) -> list[tuple[str, int, int]]:
    """``n`` prebuilt (name, start_ns, dur_ns) arguments: 50 names, random durations and gaps,
    increasing timestamps, so the sender's batches compress on the wire as real ones do."""
    rng = random.Random(seed)
    t = time.time_ns()
    out = []
    for _ in range(n):
        dur = rng.randrange(1_000, 500_000)
        out.append((f"aten::op_{rng.randrange(50)}", t, dur))
        t += dur + rng.randrange(100, 5_000)
    return out


def time_op_chunks(op: Callable, calls: list[tuple[str, int, int]], chunks: int,
                   rate: float = 0.0) -> list[float]:
    """ns per call of ``op(name, start_ns, dur_ns)``, one value per chunk of ``len(calls)`` calls.

    With ``rate`` > 0, sleeps after each chunk so that calls are offered at ``rate``/s."""
    pc = time.perf_counter_ns
    chunk = len(calls)
    period_ns = chunk / rate * 1e9 if rate > 0 else 0.0
    out = []
    for _ in range(chunks):
        t0 = pc()
        for name, start_ns, dur_ns in calls:
            op(name, start_ns, dur_ns)
        took = pc() - t0
        out.append(took / chunk)
        if period_ns > took:
            time.sleep((period_ns - took) / 1e9)
    return out


def time_step_chunks(monitor: Monitor, steps: int, chunks: int) -> list[float]:
    """ns per begin_step() + end_step() of an empty step, one value per chunk of ``steps``."""
    begin, end = monitor.begin_step, monitor.end_step
    pc = time.perf_counter_ns
    out = []
    for _ in range(chunks):
        t0 = pc()
        for _ in range(steps):
            begin()
            end()
        out.append((pc() - t0) / steps)
    return out


def bulk_columns(n: int) -> dict[str, list]:
    """Prebuilt columns of ``n`` ops: 50 names over 10 types, increasing timestamps."""
    calls = op_calls(n, seed=11)
    names = [c[0] for c in calls]
    return {"names": names, "op_types": [f"type_{int(x.rsplit('_', 1)[1]) % 10}" for x in names],
            "kinds": [i % 3 for i in range(n)], "start_ns": [c[1] for c in calls],
            "dur_ns": [c[2] for c in calls]}


def time_ops_chunks(monitor: Monitor, calls: int, chunks: int) -> list[float]:
    """ns per op of ``monitor.ops()`` with BULK ops per call, one value per chunk of calls."""
    cols = bulk_columns(BULK)
    names, types, kinds, starts, durs = (cols[k] for k in ("names", "op_types", "kinds", "start_ns", "dur_ns"))
    ops = monitor.ops
    pc = time.perf_counter_ns
    out = []
    for _ in range(chunks):
        t0 = pc()
        for _ in range(calls):
            ops(names, starts, durs, kinds=kinds, op_types=types)
        out.append((pc() - t0) / (calls * BULK))
    return out


def figure(per_repeat: list[list[float]], **extra: Any) -> dict[str, Any]:
    """Per-repeat median and p99 over chunks, their summary, and the pooled p99."""
    medians = [statistics.median(r) for r in per_repeat]
    p99s = [percentile(r, 99) for r in per_repeat]
    pooled = [x for r in per_repeat for x in r]
    return {"per_repeat_median_ns": medians, "per_repeat_p99_ns": p99s,
            "median_ns": summary(medians), "p99_ns": summary(p99s),
            "pooled_p99_ns": percentile(pooled, 99), "chunks_per_repeat": len(per_repeat[0]),
            **extra}


def measured_with_sender(monitor: Monitor, run: Callable[[], list[float]], repeats: int,
                         flush_timeout: float, label: str) -> tuple[list[list[float]], list[int], list[bool]]:
    """Run ``run`` ``repeats`` times, flushing after each; returns chunk values, drops, flush ok."""
    per_repeat, drops, flushed = [], [], []
    for r in range(repeats):
        before = monitor.dropped_ops
        per_repeat.append(run())
        drops.append(monitor.dropped_ops - before)
        flushed.append(monitor.flush(flush_timeout))
        note(f"{label} repeat {r + 1}/{repeats}: median {statistics.median(per_repeat[-1]):.0f} ns/op, "
             f"dropped {drops[-1]}, flushed {flushed[-1]}")
    return per_repeat, drops, flushed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", help="broker host:port (default: start/reuse `profstream stack up`)")
    add_kafka_config(p)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk", type=int, default=10_000, help="op() calls per timed chunk")
    p.add_argument("--chunks", type=int, default=50, help="chunks per repeat (real broker)")
    p.add_argument("--buffer-mib", type=int, default=512,
                   help="Monitor buffer for the real-broker figures: large enough that no call drops")
    p.add_argument("--paced-rate", type=float, default=100_000, help="offered ops/s of op_paced")
    p.add_argument("--paced-chunk", type=int, default=1_000, help="calls per burst of op_paced")
    p.add_argument("--paced-chunks", type=int, default=100, help="bursts per repeat of op_paced")
    p.add_argument("--bulk-calls", type=int, default=10, help="ops() calls (of 1,000 ops) per timed chunk")
    p.add_argument("--bulk-chunks", type=int, default=50, help="chunks per repeat of ops_bulk")
    p.add_argument("--unreachable-buffer-mib", type=int, default=16)
    p.add_argument("--flush-timeout", type=float, default=120.0)
    p.add_argument("--keep-topics", action="store_true", help="do not delete the benchmark's topics")
    p.add_argument("--cpu-hog", action="store_true", help="a second CPU-bound process runs beside the benchmark")
    args = p.parse_args(argv)
    with cpu_hog(args.cpu_hog):
        return measure(args)


def measure(args: argparse.Namespace) -> int:
    bootstrap = broker_bootstrap(args.bootstrap, args.kafka_config)
    prefix = unique_prefix()
    note(f"broker {bootstrap}, topic prefix {prefix}")
    results: dict[str, Any] = {"bootstrap": str(bootstrap), "security": bootstrap.protocol, "topic_prefix": prefix}
    figures: dict[str, Any] = {}

    # Context: the bare loop, and op() with no sender thread.
    calls = op_calls(args.chunk)
    paced_calls = calls[:args.paced_chunk]
    figures["loop_and_empty_call"] = figure(
        [time_op_chunks(_noop, calls, args.chunks) for _ in range(args.repeats)])
    per_repeat, dropped = [], 0
    for _ in range(args.repeats):  # a Monitor per repeat: nothing drains it, and no call may drop
        bare = Monitor(run_id="bench-op", sender_factory=_NoSender, buffer_bytes=args.buffer_mib << 20)
        per_repeat.append(time_op_chunks(bare.op, calls, args.chunks))
        dropped += bare.dropped_ops
        bare.close()
    figures["op_no_sender"] = figure(per_repeat, dropped_ops=dropped)
    per_repeat = []
    for _ in range(args.repeats):  # 1,000-step chunks: the marks' reserve of the buffer holds them all
        bare = Monitor(run_id="bench-op", sender_factory=_NoSender, buffer_bytes=args.buffer_mib << 20)
        per_repeat.append(time_step_chunks(bare, 1000, args.chunks))
        bare.close()
    figures["step_no_sender"] = figure(per_repeat, steps_per_chunk=1000)

    # The target: op() with the sender thread talking to a real broker.
    monitor = Monitor(run_id="bench-op", connection=bootstrap, topic_prefix=prefix,
                      buffer_bytes=args.buffer_mib << 20)
    try:
        wait_connected(monitor, bootstrap)
        per_repeat, drops, flushed = measured_with_sender(
            monitor, lambda: time_op_chunks(monitor.op, calls, args.chunks),
            args.repeats, args.flush_timeout, "op_real_broker")
        figures["op_real_broker"] = figure(per_repeat, calls_per_repeat=args.chunk * args.chunks,
                                           dropped_ops=drops, flushed=flushed,
                                           accepting_path_only=not any(drops))
        per_repeat, drops, flushed = measured_with_sender(
            monitor, lambda: time_op_chunks(monitor.op, paced_calls, args.paced_chunks, args.paced_rate),
            args.repeats, args.flush_timeout, "op_paced")
        figures["op_paced"] = figure(per_repeat, offered_ops_per_s=args.paced_rate,
                                     dropped_ops=drops, flushed=flushed)
        per_repeat, drops, flushed = measured_with_sender(
            monitor, lambda: time_ops_chunks(monitor, args.bulk_calls, args.bulk_chunks),
            args.repeats, args.flush_timeout, "ops_bulk")
        figures["ops_bulk_real_broker"] = figure(per_repeat, ops_per_call=BULK, dropped_ops=drops,
                                                 flushed=flushed, accepting_path_only=not any(drops))
        figures["sender_stats_after_real_broker"] = monitor.stats()
        recording = getattr(monitor, "recording", "python")
    finally:
        monitor.close(timeout=30.0)
        if not args.keep_topics:
            drop_topics(bootstrap, prefix)

    # Drop path: broker unreachable, buffer already full.
    down = Monitor(run_id="bench-op", bootstrap=UNREACHABLE, topic_prefix=prefix,
                   buffer_bytes=args.unreachable_buffer_mib << 20)
    try:
        cols = bulk_columns(BULK)
        while down.buffer_fill_ratio < 1.0:
            down.ops(cols["names"], cols["start_ns"], cols["dur_ns"])
        before = down.dropped_ops
        per_repeat = [time_op_chunks(down.op, calls, args.chunks) for _ in range(args.repeats)]
        n_calls = args.repeats * args.chunks * args.chunk
        figures["op_broker_unreachable"] = figure(
            per_repeat, bootstrap=UNREACHABLE, calls=n_calls, dropped_ops=down.dropped_ops - before,
            all_calls_dropped=down.dropped_ops - before == n_calls)
    finally:
        down.close(timeout=0.5)

    target = figures["op_real_broker"]["median_ns"]["median"]
    pooled_p99 = figures["op_real_broker"]["pooled_p99_ns"]
    results.update({
        "metric": "op_real_broker: median over repeats of the median ns per op() call across chunks",
        "unit": "ns/call",
        "per_repeat": figures["op_real_broker"]["per_repeat_median_ns"],
        "median": target,
        "target": {"max_ns_per_call": TARGET_NS, "max_pooled_p99_ns": TARGET_POOLED_P99_NS},
        "meets_target": (target <= TARGET_NS and pooled_p99 <= TARGET_POOLED_P99_NS
                         and figures["op_real_broker"]["accepting_path_only"]),
        "recording": recording,
        "figures": figures,
    })
    emit(envelope("monitor_op", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
