"""Op events/s that the step stage decodes and folds into StepMetrics, single thread.

The input is what 8 Monitors send for a simulated run (``plan_run``; 2,000 ops per step by
default): each step is recorded phase by phase (start, body, end, as ``run_simulation``
does in realtime) into a real ``Monitor``, and after each phase the Monitor's own
``Sender._build`` drains it into an encoded ``EventBatch``. That gives 3 messages per step
and rank (samples at S; the ops done by B; the other ops, the end mark and the watermark
at E), the batching of a live run with one Sender cycle per phase. Nothing is sent.

The target figure, ``in_memory``: ``StepStage.fold(record, now)`` and
``StepStage.ready(now)`` for each record in turn, timed over all records, no Kafka.
ops/s = op events / wall time; every (rank, step) must come out exactly once, with the
step time, op count and compute time of the simulator's ground truth. The same loop's
op events per CPU second of this process (``ops_per_cpu_s``) is reported beside it: on
a shared machine it is closer to what one dedicated core would do.

A second figure, ``end_to_end``, runs the real ``Processor`` (step stage only, on a thread
of this process) against the broker: the same messages are pre-filled into a fresh
``<prefix>.raw`` (12 partitions, keyed ``run/rank`` as the Monitor does), then the time
runs from ``Processor.run()`` until every StepMetrics has been committed (the
processor's own commit callback has seen them all). Group join and state restore are
inside that time. Its CPU is this process's (``ms_cpu_per_step``: per committed
StepMetrics), split by thread (``cpu_by_thread_s``: the processor's loop thread,
librdkafka's ``rdk:*`` threads, this benchmark's own waiting thread, the rest) for the whole
run, until the first commit (group join, restore, the first transaction) and in the steady part
(``steady``: from a quarter of the StepMetrics committed to the last, per StepMetrics;
``ms_per_step_without_bench_main`` leaves out the benchmark's waiting thread).
``--e2e-profile FILE`` writes a cProfile of the loop thread.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import sys
import threading
import time
from collections import namedtuple
from typing import Any

from _common import (
    add_kafka_config,
    broker_bootstrap,
    drop_topics,
    emit,
    envelope,
    note,
    summary,
    thread_cpu,
    unique_prefix,
)

from profstream.kafka.clients import make_producer
from profstream.kafka.topics import Topics, ensure_topics
from profstream.processors.health import ProcessorHealth, StageCounts
from profstream.processors.runtime import Processor, StepStage
from profstream.producers.monitor import Monitor
from profstream.producers.sender import Sender
from profstream.schema.batch import decode_batch, encode_batch
from profstream.schema.codec import decode
from profstream.simulate import PHASES, SimConfig, phase_time, plan_run, record_phase

TARGET_OPS_PER_S = 2_000_000
ORIGIN_NS = 1_790_000_000_000_000_000  # fixed virtual clock: the same bytes on every run

Record = namedtuple("Record", "topic partition offset key value")


class _NoThread:
    """Stands in for the Monitor's Sender thread: the benchmark drains the buffer itself."""

    def __init__(self, monitor: Monitor) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self, timeout: float) -> bool:
        return True

    def flush(self, timeout: float) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {}


def monitor_messages(cfg: SimConfig, drain: str = "phase", origin_ns: int = ORIGIN_NS,
                     sent_at: list | None = None) -> tuple[list[tuple[bytes, bytes]], dict]:
    """(key, value) of every batch the Monitors of ``cfg`` send, in send order, and the truth.

    ``drain``: "phase" builds batches after each phase of each step (3 per step and rank);
    "full" only when a Monitor holds ``batch_max_ops`` ops, and at the end (8,192-op
    batches spanning several steps, as a Sender that fell behind sends). ``sent_at``, if
    given, gets for each message the virtual time its Monitor would send it (the end of the
    phase it closes; None for what is left at the end)."""
    monitors = [Monitor(run_id=cfg.run_id, rank=r, bootstrap="127.0.0.1:1",
                        sender_factory=_NoThread, buffer_bytes=1 << 31, host_sample_interval_s=0, control=False,
                        native=False, peak_tflops=cfg.peak_tflops)
                for r in range(cfg.ranks)]
    senders = [Sender(m) for m in monitors]
    messages: list[tuple[bytes, bytes]] = []
    truth: dict = {}

    def build(rank: int, at_ns: int | None = None) -> None:
        sender = senders[rank]
        while sender._pending or sender._build():  # a build may queue a side batch too (loader readings)
            value = sender._pending.popleft()[0]  # (value, ops, samples)
            messages.append((monitors[rank].key, value))
            if sent_at is not None:
                sent_at.append(at_ns)

    plans = []
    for plan in plan_run(cfg, origin_ns):
        truth[(plan.rank, plan.step)] = plan.truth
        plans.append(plan)
        if len(plans) < cfg.ranks:
            continue
        for phase in PHASES:
            for p in plans:
                record_phase(monitors[p.rank], p, phase)
                if drain == "phase" or monitors[p.rank].buffered_ops >= monitors[p.rank]._batch_max_ops:
                    build(p.rank, phase_time(p, phase))
        plans = []
    for rank in range(cfg.ranks):
        build(rank)
    for m in monitors:
        m.close()
    return messages, truth


def names_as_types(messages: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The same batches with each op named by its type: a 13-name dictionary per batch
    instead of one distinct name per op (the simulator names every op of a step apart)."""
    out = []
    for key, value in messages:
        b = decode_batch(value)
        b.op_names = list(b.op_types)
        b.ops = {**b.ops, "name_idx": b.ops["type_idx"]}
        out.append((key, encode_batch(b)))
    return out


def as_records(topic: str, messages: list[tuple[bytes, bytes]], partitions: int = 12) -> list[Record]:
    """Consumer records: rank r on partition r % partitions, offsets counted per partition."""
    next_offset = [0] * partitions
    out = []
    for key, value in messages:
        part = int(key.rpartition(b"/")[2]) % partitions
        out.append(Record(topic, part, next_offset[part], key, value))
        next_offset[part] += 1
    return out


def fold_all(records: list[Record], topics: Topics) -> dict[str, Any]:
    """fold + ready over every record, as one processor thread would; returns times and outputs."""
    stage = StepStage(topics, 3, StageCounts(keep_step_ends=False))
    fold, ready, pc = stage.fold, stage.ready, time.perf_counter
    steps_topic = topics.steps
    outputs = []
    fold_s = ready_s = 0.0
    now = time.monotonic()
    cpu0 = time.process_time()
    t0 = pc()
    for rec in records:
        t1 = pc()
        out = fold(rec, now)
        t2 = pc()
        out += ready(now)
        ready_s += pc() - t2
        fold_s += t2 - t1
        if out:
            outputs.extend(out)
    elapsed = pc() - t0
    cpu_s = time.process_time() - cpu0
    steps = [o.value for o in outputs if o.topic == steps_topic]
    return {"elapsed_s": elapsed, "cpu_s": cpu_s, "fold_s": fold_s, "ready_s": ready_s, "step_values": steps,
            "other_outputs": len(outputs) - len(steps)}


def verify(step_values: list[bytes], truth: dict) -> dict[str, Any]:
    """Every (rank, step) exactly once, with the simulator's step time, op count and compute time."""
    seen: dict = {}
    wrong = 0
    for value in step_values:
        m = decode("StepMetrics", value)
        key = (m["rank"], m["step"])
        seen[key] = seen.get(key, 0) + 1
        t = truth.get(key)
        if t is None or (m["step_time_ns"], m["op_count"], m["compute_ns"]) != (
                t["step_time_ns"], sum(c for _, c in t["op_types"].values()), t["compute_ns"]):
            wrong += 1
    return {"expected_steps": len(truth), "steps_out": len(step_values),
            "each_once": set(seen) == set(truth) and all(n == 1 for n in seen.values()),
            "values_match_truth": wrong == 0, "mismatches": wrong}


def in_memory(records: list[Record], truth: dict, total_ops: int, repeats: int, label: str) -> dict[str, Any]:
    topics = Topics("bench-mem")
    rates, cpu_rates, steps_rates, fold_share, decode_rates = [], [], [], [], []
    check = None
    for r in range(repeats):
        t0 = time.perf_counter()
        for rec in records:
            decode_batch(rec.value)
        decode_rates.append(total_ops / (time.perf_counter() - t0))
        res = fold_all(records, topics)
        if check is None:
            check = verify(res["step_values"], truth)
            if not (check["each_once"] and check["values_match_truth"]):
                raise SystemExit(f"{label}: StepMetrics wrong: {check}")
        rates.append(total_ops / res["elapsed_s"])
        cpu_rates.append(total_ops / res["cpu_s"])
        steps_rates.append(len(res["step_values"]) / res["elapsed_s"])
        fold_share.append(res["fold_s"] / (res["fold_s"] + res["ready_s"]))
        note(f"{label} repeat {r + 1}/{repeats}: {rates[-1] / 1e6:.3f} M ops/s ({cpu_rates[-1] / 1e6:.3f} M per "
             f"CPU second), {steps_rates[-1]:.0f} steps/s "
             f"(fold {res['fold_s']:.3f} s, ready {res['ready_s']:.3f} s; decode alone "
             f"{decode_rates[-1] / 1e6:.2f} M ops/s)")
    return {"ops_per_s": rates, "summary": summary(rates),
            "ops_per_cpu_s": cpu_rates, "cpu_summary": summary(cpu_rates),
            "steps_closed_per_s": steps_rates, "median_steps_closed_per_s": statistics.median(steps_rates),
            "fold_share_of_time": statistics.median(fold_share),
            "decode_batch_alone_ops_per_s": statistics.median(decode_rates),
            "messages": len(records), "mean_message_bytes": sum(len(r.value) for r in records) / len(records),
            "check": check}


def prefill(bootstrap: str, topics: Topics, messages: list[tuple[bytes, bytes]],
            partition_of=None) -> int:
    """Send the messages to ``topics.raw`` (lz4, acks=all, as the Monitor sends); returns bytes sent."""
    producer = make_producer(bootstrap, compression="lz4")
    sent = 0
    try:
        for key, value in messages:
            producer.send(topics.raw, key=key, value=value,
                          partition=partition_of(key) if partition_of else None)
            sent += len(value)
        producer.flush(timeout=120)
    finally:
        producer.close(timeout=10)
    return sent


class _WatchedHealth(ProcessorHealth):
    """The processor's health, with events for its first commit, a quarter and all of
    ``expected`` StepMetrics committed."""

    def __init__(self, expected: int) -> None:
        super().__init__()
        self.expected = expected
        self.first, self.quarter, self.done = threading.Event(), threading.Event(), threading.Event()

    def commit(self, counts: StageCounts, transaction: bool = False) -> None:
        super().commit(counts, transaction)
        self.first.set()
        n = len(self.freshness_s)
        if n >= self.expected // 4:
            self.quarter.set()
        if n >= self.expected:
            self.done.set()


def _cpu_by_role(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]],
                 loop_tid: int | None) -> dict[str, float]:
    """CPU seconds between two ``thread_cpu()`` readings, by role: the processor's loop
    thread, librdkafka's threads (``rdk:*``), the benchmark's own waiting thread and the rest
    (the loop's deadline caller, the input watch)."""
    out = {"loop": 0.0, "librdkafka": 0.0, "bench_main": 0.0, "other": 0.0}
    main_tid = threading.main_thread().native_id
    for tid, (name, ns) in after.items():
        spent = (ns - before.get(tid, (name, 0))[1]) / 1e9
        role = ("loop" if tid == loop_tid else "librdkafka" if name.startswith("rdk:")
                else "bench_main" if tid == main_tid else "other")
        out[role] += spent
    return out


def end_to_end(bootstrap: str, messages: list[tuple[bytes, bytes]], expected_steps: int, total_ops: int,
               timeout: float, keep: bool, profile_to: str | None = None) -> dict[str, Any]:
    prefix = unique_prefix()
    topics = Topics(prefix)
    try:
        ensure_topics(bootstrap, topics, raw_partitions=12)
        t0 = time.perf_counter()
        prefill(bootstrap, topics, messages)
        fill_s = time.perf_counter() - t0
        health = _WatchedHealth(expected_steps)
        processor = Processor(bootstrap, topics, group_id=f"{prefix}-g", instance_id="0", stages="steps",
                              health=health)
        stop = threading.Event()
        errors: list[BaseException] = []
        loop_tid: list[int] = []

        def work() -> None:
            loop_tid.append(threading.get_native_id())
            profiler = cProfile.Profile() if profile_to else None
            try:
                if profiler is not None:
                    profiler.enable()
                processor.run(stop)
            except BaseException as e:  # re-raised below
                errors.append(e)
            finally:
                health.done.set()
                if profiler is not None:
                    profiler.disable()
                    profiler.dump_stats(profile_to)

        thread = threading.Thread(target=work, name="bench-processor", daemon=True)
        threads0 = thread_cpu()
        t_start, cpu_start = time.perf_counter(), time.process_time()
        thread.start()
        # this thread's CPU counts in the process's: it sleeps on the commits' events, not in a poll loop
        first = quarter = None  # (thread CPU, process CPU, steps committed) at those points
        deadline = t_start + timeout
        t_first = time.perf_counter() if health.first.wait(timeout) else None
        if t_first is not None:
            first = (thread_cpu(), time.process_time(), len(health.freshness_s))
            if health.quarter.wait(max(deadline - time.perf_counter(), 0)):
                quarter = (thread_cpu(), time.process_time(), len(health.freshness_s))
            health.done.wait(max(deadline - time.perf_counter(), 0))
        t_end, cpu_end = time.perf_counter(), time.process_time()
        threads_end = thread_cpu()
        committed = len(health.freshness_s)
        stop.set()
        thread.join(30)
        if errors:
            raise errors[0]
        if committed < expected_steps:
            raise SystemExit(f"end to end: only {committed} of {expected_steps} StepMetrics committed "
                             f"within {timeout} s")
        elapsed = t_end - t_start
        tid = loop_tid[0] if loop_tid else None
        cpu_s = cpu_end - cpu_start
        split = {"whole_run": _cpu_by_role(threads0, threads_end, tid)}
        if first is not None:  # group join, restore, the first transaction
            split["until_first_commit"] = _cpu_by_role(threads0, first[0], tid)
        steady = None
        if quarter is not None and committed > quarter[2]:
            split["steady"] = _cpu_by_role(quarter[0], threads_end, tid)
            # process CPU per StepMetrics committed from a quarter of them to the last: the
            # per-step cost without the group join, the restore and the first fetches
            n = committed - quarter[2]
            steady = {"steps": n, "cpu_s": cpu_end - quarter[1], "ms_per_step": (cpu_end - quarter[1]) / n * 1e3,
                      "ms_per_step_without_bench_main": sum(
                          v for k, v in split["steady"].items() if k != "bench_main") / n * 1e3,
                      "ms_per_step_by_role": {k: v / n * 1e3 for k, v in split["steady"].items()}}
        return {"topic_prefix": prefix, "prefill_s": fill_s, "elapsed_s": elapsed,
                "ops_per_s": total_ops / elapsed,
                "first_batch_folded_after_s": (t_first - t_start) if t_first else None,
                "ops_per_s_from_first_batch": total_ops / (t_end - t_first) if t_first else None,
                "steps_committed": committed, "transactions": health.transactions,
                # this process's CPU (the processor's threads, librdkafka's with its TLS): per CPU second
                "cpu_s": cpu_s, "ops_per_cpu_s": total_ops / max(cpu_s, 1e-9),
                "ms_cpu_per_step": cpu_s / committed * 1e3, "cpu_by_thread_s": split, "steady": steady,
                "steps_closed_per_s": committed / elapsed}
    finally:
        if not keep:
            drop_topics(bootstrap, prefix)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", help="broker host:port (default: start/reuse `profstream stack up`)")
    add_kafka_config(p)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=50, help="steps per rank")
    p.add_argument("--ops-per-step", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5, help="repeats of the in-memory figures")
    p.add_argument("--e2e-repeats", type=int, default=3, help="repeats of the end-to-end figure (0: skip)")
    p.add_argument("--e2e-timeout", type=float, default=120.0)
    p.add_argument("--no-diagnostics", action="store_true",
                   help="skip the names-as-types and 8,192-op-batch variants")
    p.add_argument("--keep-topics", action="store_true", help="do not delete the benchmark's topics")
    p.add_argument("--e2e-profile", metavar="FILE",
                   help="cProfile the processor's loop thread in the end-to-end runs (pstats; the last run's)")
    args = p.parse_args(argv)

    cfg = SimConfig(run_id="bench-throughput", ranks=args.ranks, steps=args.steps,
                    ops_per_step=args.ops_per_step, step_time_ms=50.0)
    t0 = time.perf_counter()
    messages, truth = monitor_messages(cfg)
    total_ops = args.ranks * args.steps * args.ops_per_step
    note(f"built {len(messages)} messages ({total_ops} ops, {len(truth)} steps) in {time.perf_counter() - t0:.1f} s")
    records = as_records("bench-mem.raw", messages)

    figures: dict[str, Any] = {"in_memory": in_memory(records, truth, total_ops, args.repeats, "in_memory")}
    if not args.no_diagnostics:
        figures["diag_names_as_types"] = in_memory(
            as_records("bench-mem.raw", names_as_types(messages)), truth, total_ops, args.repeats,
            "names_as_types")
        full, _ = monitor_messages(cfg, drain="full")
        figures["diag_full_batches"] = in_memory(as_records("bench-mem.raw", full), truth, total_ops,
                                                 args.repeats, "full_batches")

    bootstrap = None
    if args.e2e_repeats:
        bootstrap = broker_bootstrap(args.bootstrap, args.kafka_config)
        reps = []
        for r in range(args.e2e_repeats):
            rep = end_to_end(bootstrap, messages, len(truth), total_ops, args.e2e_timeout, args.keep_topics,
                             args.e2e_profile)
            reps.append(rep)
            note(f"end_to_end repeat {r + 1}/{args.e2e_repeats}: {rep['ops_per_s'] / 1e6:.3f} M ops/s "
                 f"({rep['elapsed_s']:.2f} s from run(), first commit after "
                 f"{rep['first_batch_folded_after_s'] or float('nan'):.2f} s, {rep['transactions']} transactions; "
                 f"{rep['ms_cpu_per_step']:.3f} ms CPU a StepMetrics, steady "
                 f"{rep['steady']['ms_per_step'] if rep['steady'] else float('nan'):.3f})")
        rates = [r["ops_per_s"] for r in reps]
        per_cpu = [r["ops_per_cpu_s"] for r in reps]
        steady = [r["steady"]["ms_per_step"] for r in reps if r["steady"]]
        figures["end_to_end"] = {
            "ms_cpu_per_step": [r["ms_cpu_per_step"] for r in reps],
            "median_ms_cpu_per_step": statistics.median([r["ms_cpu_per_step"] for r in reps]),
            "steady_ms_cpu_per_step": steady,
            "median_steady_ms_cpu_per_step": statistics.median(steady) if steady else None,
            "ops_per_cpu_s": per_cpu, "ops_per_cpu_s_summary": summary(per_cpu),
            "label": "real Processor (step stage, one thread) on the broker, pre-filled topic: "
                     "op events / (Processor.run() start -> all StepMetrics committed)",
            "ops_per_s": rates, "summary": summary(rates),
            "median_ops_per_s_from_first_batch": statistics.median(
                [r["ops_per_s_from_first_batch"] for r in reps if r["ops_per_s_from_first_batch"]] or [0.0]),
            "repeats": reps}

    mem = figures["in_memory"]
    median = mem["summary"]["median"]
    results = {
        "bootstrap": str(bootstrap) if bootstrap is not None else None,
        "security": bootstrap.protocol if bootstrap is not None else None,
        "metric": "in_memory: op events/s through StepStage.fold + StepStage.ready, one thread, no Kafka",
        "unit": "ops/s",
        "workload": {"ranks": args.ranks, "steps_per_rank": args.steps, "ops_per_step": args.ops_per_step,
                     "op_events": total_ops, "steps": len(truth), "messages": len(messages),
                     "batching": "Monitor + Sender._build after each phase: 3 messages per step and rank"},
        "per_repeat": mem["ops_per_s"],
        "median": median,
        "median_ops_per_cpu_s": mem["cpu_summary"]["median"],
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "target": {"min_ops_per_s": TARGET_OPS_PER_S},
        "meets_target": bool(median >= TARGET_OPS_PER_S and mem["check"]["each_once"]),
        "figures": figures,
    }
    emit(envelope("processor_throughput", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
