"""What learning and applying the ranks' clock offsets (processors/clocks.py) costs the run
stage, per run step and per collective call, single thread, no Kafka.

Input: StepMetrics of R ranks x S steps, each step with C all_reduce calls on the default
group (the same (group, seq) on every rank, ranks' clocks 0 / +-5 ms off, ends within
50 us), encoded as the step stage writes them. Timed: ``RunStage.fold`` over every record,
then ``ready`` (which emits every step: matching, figures, encoding), ``before`` and
``after`` alternating. ``before`` is the same code with the estimator switched off
(``RunClocks.learn_packed`` does nothing, no offsets: the run stage as it was before it); ``after``
learns each step's calls and compares the ranks' times less their offsets. Also timed
alone: ``RunClocks.learn_packed`` over the same calls. Every run step must come out with every
call matched, and ``after`` with every rank's offset within 0.1 ms of its true value.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import namedtuple
from typing import Any

import numpy as np
from _common import emit, envelope, note, summary

from profstream.kafka.topics import Topics
from profstream.processors import clocks as clocks_module
from profstream.processors.clocks import RunClocks
from profstream.processors.collectives import CollectiveCall, calls_of, pack_calls
from profstream.processors.health import StageCounts
from profstream.processors.runtime import RunStage
from profstream.schema.codec import decode, encode_step_metrics

Record = namedtuple("Record", "topic partition offset key value")
MS = 1_000_000


def shift_of(rank: int) -> int:
    return (0, 5 * MS, -5 * MS, 2 * MS)[rank % 4]


def step_records(ranks: int, steps: int, calls: int, seed: int = 0) -> tuple[list[bytes], list[dict]]:
    """StepMetrics messages (steps in order, ranks within), and per step {rank: packed calls}."""
    rng = np.random.default_rng(seed)
    out, packed = [], []
    for step in range(steps):
        t0 = 10**18 + step * 100 * MS
        arrive = t0 + rng.integers(0, 3 * MS, (ranks, calls)) + \
            (np.arange(calls) * 5 * MS)[None, :]
        done = arrive.max(axis=0) + MS
        end = done[None, :] + rng.integers(0, 50_000, (ranks, calls))
        per_step = {}
        for r in range(ranks):
            s = shift_of(r)
            rows = [CollectiveCall("all_reduce", "0", ranks, step * calls + j, 4 << 20, int(arrive[r, j] + s),
                                   int(end[r, j] + s)) for j in range(calls)]
            per_step[r] = pack_calls(calls_of(rows))
            record = {"run_id": "bench-clocks", "rank": r, "world_size": ranks, "host": f"h{r}", "device": "cpu",
                      "step": step, "start_ns": t0 + s, "end_ns": t0 + 100 * MS + s, "step_time_ns": 100 * MS,
                      "data_wait_ns": 0, "fp_bp_ns": 100 * MS, "tail_ns": 0, "compute_ns": 0, "comm_ns": 0,
                      "overlap_ns": 0, "pure_comm_ns": 0, "idle_ns": 0, "utilization": 0.0, "overlap_ratio": 0.0,
                      "op_count": calls, "op_types": [], "memory": None, "queues": [], "starved": False,
                      "rolling": None, "closed_by": "watermark", "late_events": 0, "closed_ns": 0,
                      "collectives": per_step[r]}
            out.append(encode_step_metrics(record))
        packed.append(per_step)
    return out, packed


class _Off:
    """The estimator switched off (the run stage before it)."""

    def __enter__(self) -> None:
        self.saved = RunClocks.learn_packed, RunClocks.offsets, RunClocks.estimates
        RunClocks.learn_packed = lambda self, records, joined=None: None
        RunClocks.offsets = lambda self, ranks=None: {}
        RunClocks.estimates = lambda self, ranks=None: []

    def __exit__(self, *exc: object) -> None:
        RunClocks.learn_packed, RunClocks.offsets, RunClocks.estimates = self.saved


def run_stage(values: list[bytes], ranks: int, steps: int, calls: int, check_offsets: bool) -> float:
    topics = Topics("bench-clocks")
    stage = RunStage(topics, StageCounts(keep_step_ends=False), grace_s=3600.0)
    now = time.monotonic()
    t0 = time.perf_counter()
    for i, value in enumerate(values):
        stage.fold(Record(topics.steps, 0, i, None, value), now)
    out = [o.value for o in stage.ready(now) if o.topic == topics.run]
    elapsed = time.perf_counter() - t0
    runs = [decode("RunStepMetrics", v) for v in out]
    if len(runs) != steps or any(x["collectives_matched"] != calls for x in runs):
        raise SystemExit(f"run steps wrong: {len(runs)} of {steps}")
    if check_offsets:
        last = {c["rank"]: c["offset_ns"] for c in runs[-1]["clock_offsets"]}
        bad = {r: v for r, v in last.items() if abs(v - shift_of(r)) > 0.1 * MS}
        if len(last) != ranks or bad:
            raise SystemExit(f"offsets wrong: {len(last)} ranks, off: {dict(list(bad.items())[:5])}")
    return elapsed


def learn_alone(packed: list[dict]) -> float:
    clocks = RunClocks()
    t0 = time.perf_counter()
    for step in packed:
        clocks.learn_packed(step)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--calls", type=int, default=100, help="collective calls per step (every rank)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    results: dict[str, Any] = {}
    for ranks in args.ranks:
        values, packed = step_records(ranks, args.steps, args.calls)
        note(f"{ranks} ranks: {len(values)} StepMetrics, {args.steps * args.calls} calls")
        before, after, alone = [], [], []
        for r in range(args.repeats):
            with _Off():
                before.append(run_stage(values, ranks, args.steps, args.calls, False))
            after.append(run_stage(values, ranks, args.steps, args.calls, True))
            alone.append(learn_alone(packed))
            note(f"  repeat {r + 1}/{args.repeats}: before {before[-1]:.3f} s, after {after[-1]:.3f} s, "
                 f"learn alone {alone[-1]:.3f} s")
        b, a, x = (statistics.median(v) for v in (before, after, alone))
        results[str(ranks)] = {
            "before_s": summary(before), "after_s": summary(after), "learn_alone_s": summary(alone),
            "before_ms_per_run_step": b / args.steps * 1e3, "after_ms_per_run_step": a / args.steps * 1e3,
            "estimator_ms_per_run_step": (a - b) / args.steps * 1e3,
            "learn_ms_per_run_step": x / args.steps * 1e3,
            "estimator_us_per_call": (a - b) / (args.steps * args.calls) * 1e6,
            "estimator_us_per_rank_call": (a - b) / (args.steps * args.calls * ranks) * 1e6,
            "learn_us_per_rank_call": x / (args.steps * args.calls * ranks) * 1e6,
            "cost": a / b - 1}
    emit(envelope("bench_clocks", args, {
        "metric": "RunStage fold + ready over StepMetrics with collectives, estimator off (before) and on (after)",
        "window_steps": clocks_module.WINDOW_STEPS, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
