"""The run (cross-rank) stage's CPU per run step at many ranks, in memory (no Kafka).

Input: StepMetrics of R ranks x S steps of one run, as the step stage writes them: every
rank has work figures (throughput, MFU) and ``--calls`` all_reduce calls a step on the
default group (the same (group, seq) on every rank; clocks 0 / +-5 / +2 ms off, ends
within 50 us), world size R. Timed (CPU time of this thread), per run step: the run
stage's ``fold`` of what it reads of the step, then ``ready``, which emits it (figures,
collectives, clock offsets, RunStepMetrics encoding).

``--input stepmetrics``: the stage reads every rank's StepMetrics (the run stage before
issue #35 item 2, and what it still does with StepMetrics alone). ``--input partials``:
it reads the StepPartials the step stage writes instead (processors/partials.py), the
step's ranks split over ``--partitions`` input partitions, closed in one transaction of
the step stage each (one partial each). Also timed for ``partials``: what the step
stage spends on them (``PartialBuilder.add`` per rank-step, the partials' encoding per
run step). Every run step must come out once with every rank and every call matched;
``digest`` is a hash of every RunStepMetrics message (the bytes: equal within one
schema version); ``figures_digest`` a hash of every decoded RunStepMetrics (equal where
the figures are, whichever version wrote them); ``run_step_metrics_bytes``: the size of
one; ``run_step_metrics_encode_ms``: encoding one RunStepMetrics alone (in the run step's
time).

Run it with PYTHONPATH pointing at the checkout to measure (``--input stepmetrics``
works on checkouts from before partials). Prints one JSON object on stdout; progress on
stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections import namedtuple

import numpy as np
from _common import emit, envelope, note, summary

from profstream.kafka.topics import Topics
from profstream.processors.health import StageCounts
from profstream.processors.runtime import RunStage
from profstream.schema.codec import (
    NO_COLLECTIVE_CALLS,
    decode,
    encode,
    encode_run_step_metrics,
    encode_step_metrics,
)

Record = namedtuple("Record", "topic partition offset key value")
MS = 1_000_000
RUN = "bench-run-stage"


def shift_of(rank: int) -> int:
    return (0, 5 * MS, -5 * MS, 2 * MS)[rank % 4]


def step_metrics(ranks: int, step: int, calls: int, rng: np.random.Generator) -> list[dict]:
    """The StepMetrics records of one step of every rank (rank order)."""
    t0 = 10**18 + step * 100 * MS
    arrive = t0 + rng.integers(0, 3 * MS, (ranks, calls)) + (np.arange(calls) * 5 * MS)[None, :]
    end = arrive.max(axis=0)[None, :] + MS + rng.integers(0, 50_000, (ranks, calls))
    step_time = 100 * MS + rng.integers(0, 5 * MS, ranks)
    out = []
    fixed = {"names": ["all_reduce", "0"], "count": calls, "name_idx": np.zeros(calls, "<i4").tobytes(),
             "group_idx": np.ones(calls, "<i4").tobytes(), "group_size": np.full(calls, ranks, "<i4").tobytes(),
             "seq": np.arange(step * calls, (step + 1) * calls, dtype="<i8").tobytes(),
             "bytes": np.full(calls, 4 << 20, "<i8").tobytes()}  # as pack_calls packs these calls
    for r in range(ranks):
        s = shift_of(r)
        packed = {**fixed, "start_ns": (arrive[r] + s).astype("<i8").tobytes(),
                  "end_ns": (end[r] + s).astype("<i8").tobytes()} if calls else None
        tokens = 4096 + r % 7
        out.append({
            "run_id": RUN, "rank": r, "world_size": ranks, "host": f"h{r // 8}", "device": f"cuda:{r % 8}",
            "step": step, "start_ns": t0 + s, "end_ns": t0 + int(step_time[r]) + s, "step_time_ns": int(step_time[r]),
            "data_wait_ns": 0, "fp_bp_ns": int(step_time[r]), "tail_ns": 0, "compute_ns": 0, "comm_ns": 0,
            "overlap_ns": 0, "pure_comm_ns": 0, "idle_ns": 0, "utilization": 0.0, "overlap_ratio": 0.0,
            "op_count": 50, "op_types": [], "memory": None, "queues": [], "starved": False, "rolling": None,
            "closed_by": "watermark", "late_events": 0, "closed_ns": 0,
            "collectives": packed or NO_COLLECTIVE_CALLS,
            "work": {"tokens": tokens, "samples": 4, "flops": 1.2e15, "flops_source": "counted", "peak_flops": 9.9e14,
                     "tokens_per_s": tokens / (int(step_time[r]) / 1e9), "samples_per_s": 4 / (int(step_time[r]) / 1e9),
                     "flops_per_s": 1.2e15 / (int(step_time[r]) / 1e9),
                     "mfu": 1.2e15 / (int(step_time[r]) / 1e9) / 9.9e14, "op_categories": []},
        })
    return out


def inputs(ranks: int, steps: int, calls: int, mode: str, partitions: int) -> tuple[list[list[bytes]], dict]:
    """Per step, the messages the run stage reads; and what building them cost the step stage."""
    rng = np.random.default_rng(ranks)
    out, add_s, encode_s, sizes = [], 0.0, 0.0, []
    for step in range(steps):
        records = step_metrics(ranks, step, calls, rng)
        encoded = [encode_step_metrics(m) for m in records]
        if mode == "stepmetrics":
            out.append(encoded)
            continue
        from profstream.processors.partials import PartialBuilder

        decoded = [decode("StepMetrics", v) for v in encoded]  # as the step stage holds them: the same fields
        builder = PartialBuilder()
        c0 = time.thread_time()
        taken = []
        for part in range(partitions):  # one transaction a partition: a partial each
            for m in decoded[part::partitions]:
                builder.add(m, part)
            taken += builder.records()
        c1 = time.thread_time()
        values = [encode("StepPartial", p) for p in taken]
        c2 = time.thread_time()
        add_s += c1 - c0
        encode_s += c2 - c1
        sizes += [len(v) for v in values]
        out.append(values)
    cost = {} if mode == "stepmetrics" else {
        "step_stage_add_us_per_rank_step": add_s / (ranks * steps) * 1e6,
        "step_stage_encode_ms_per_run_step": encode_s / steps * 1e3,
        "partials_per_run_step": len(sizes) / steps, "partial_bytes_max": max(sizes)}
    return out, cost


def run_stage(per_step: list[list[bytes]], ranks: int, calls: int) -> tuple[list[float], str, str, int, float]:
    """CPU seconds per run step (fold + ready), the digests of the RunStepMetrics (bytes,
    figures), the size of the last, and the CPU seconds of encoding it alone (its share of
    a run step)."""
    topics = Topics("bench")
    stage = RunStage(topics, StageCounts(keep_step_ends=False), grace_s=3600.0)
    digest, figures = hashlib.sha256(), hashlib.sha256()
    times, offset = [], 0
    for step, values in enumerate(per_step):
        c0 = time.thread_time()
        for v in values:
            stage.fold(Record(topics.steps, 0, offset, RUN.encode(), v), 0.0)
            offset += 1
        out = [o.value for o in stage.ready(0.0) if o.topic == topics.run]
        times.append(time.thread_time() - c0)
        if len(out) != 1:
            raise SystemExit(f"step {step}: {len(out)} RunStepMetrics, expected 1")
        m = decode("RunStepMetrics", out[0])
        if m["ranks_reported"] != ranks or m["collectives_matched"] != calls:
            raise SystemExit(f"step {step}: {m['ranks_reported']} ranks, {m['collectives_matched']} calls matched")
        digest.update(out[0])
        figures.update(json.dumps(m, sort_keys=True).encode())
    try:  # RunStepMetrics v5: the run stage hands the encoder columns, packed here untimed
        from profstream.schema.rank_columns import packed
        m = packed(m)
    except ImportError:  # a checkout from before v5: the record as decoded is what it encodes
        pass
    c0 = time.thread_time()
    encode_run_step_metrics(m)
    return times, digest.hexdigest()[:16], figures.hexdigest()[:16], len(out[0]), time.thread_time() - c0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--steps", type=int, default=6, help="run steps per repeat (the first one also learns the clocks)")
    p.add_argument("--calls", type=int, default=20, help="all_reduce calls per rank-step")
    p.add_argument("--input", choices=("stepmetrics", "partials"), default="partials")
    p.add_argument("--partitions", type=int, default=16, help="input partitions the ranks come from (partials)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    results = {}
    for ranks in args.ranks:
        note(f"{ranks} ranks: building {args.steps} steps of {args.input}")
        per_step, cost = inputs(ranks, args.steps, args.calls, args.input, args.partitions)
        runs, digests, encoding = [], set(), []
        for i in range(args.repeats):
            times, digest, figures, size, encode_s = run_stage(per_step, ranks, args.calls)
            runs.append(statistics.median(times[1:] or times) * 1e3)  # the first step also sets the clocks' rows up
            encoding.append(encode_s * 1e3)
            digests.add((digest, figures))
            note(f"  repeat {i}: {runs[-1]:.2f} ms per run step (digest {digest}, figures {figures})")
        if len(digests) != 1:
            raise SystemExit(f"repeats differ: {digests}")
        digest, figures = digests.pop()
        results[str(ranks)] = {"ms_per_run_step": summary(runs), "us_per_rank": statistics.median(runs) / ranks * 1e3,
                               "run_step_metrics_encode_ms": statistics.median(encoding), "digest": digest,
                               "figures_digest": figures, "run_step_metrics_bytes": size, **cost}
    emit(envelope("bench_run_stage", args, {
        "metric": "run stage CPU per run step (fold + ready), one thread, no Kafka", "results": results}))


if __name__ == "__main__":
    main()
