"""What bulk ``Monitor.ops()`` costs a CPU-bound training step, GIL waits included.

A training-like loop on the main thread: each step does a fixed amount of Python CPU work
(``--work-iters`` iterations of a loop, ~20 ms on a quiet core; the same count for every
scenario and every process, so a longer step is time lost to the Monitor or the box), then
hands the step's ops to ``Monitor.ops()`` in one call of ``--chunk`` ops, as op capture
does (names and op types as lists of str from a pool of 300, the same str objects every
step; kinds, streams, start and duration as fresh numpy arrays), plus a memory sample and
the step marks. The Monitor's sender runs against a real broker meanwhile.

Per step, on the main thread: wall time, CPU time (thread clock), run-queue wait
(schedstat) and the rest, **blocked** (neither running nor runnable: the GIL), and the
wall time of the ``ops()`` call itself. Scenarios: ``none`` (the same loop without a
Monitor: the floor), ``ops@0`` (a Monitor, step marks and memory samples but no ops: its
fixed cost) and ``ops@N`` for each chunk size, a Monitor of its own each, alternating in
rotating order over ``--rounds`` rounds of ``--steps`` steps.

The figures that matter, per scenario, a round's mean over its steps (every GIL wait
counts), the median over rounds, less the same run's ``none`` floor: **step wall time
added** (what the training job loses); per op, the wall time ``ops@N`` adds over
``ops@0``, divided by N; and the ``ops()`` call per op. Whichever Monitor the ``profstream``
on ``sys.path`` has is measured (``recording`` in the output): run it with the Python of
another checkout to compare two versions. Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
from _common import (
    broker_bootstrap,
    drop_topics,
    emit,
    envelope,
    note,
    percentile,
    run_monitored,
    unique_prefix,
)
from bench_gil import _own_clock

from profstream.producers.monitor import Monitor

POOL = [f"aten::op_{i}" for i in range(300)]
TYPES = [f"type_{i}" for i in range(20)]


def _work(iters: int) -> int:
    x = 0
    for i in range(iters):
        x += i
    return x


def calibrate(step_ms: float) -> int:
    """Iterations of ``_work`` for ``step_ms`` of this thread's CPU time (best of 5)."""
    n = 200_000
    best = min(_timed_cpu(n) for _ in range(5))
    return max(1, int(n * step_ms * 1e6 / best))


def _timed_cpu(n: int) -> int:
    t = time.thread_time_ns()
    _work(n)
    return time.thread_time_ns() - t


def _columns(chunk: int, step: int, rng: np.random.Generator) -> tuple:
    picks = rng.integers(0, len(POOL), chunk)
    names = [POOL[i] for i in picks]
    op_types = [TYPES[i % len(TYPES)] for i in picks]
    base = time.time_ns()
    starts = base + np.arange(chunk, dtype=np.int64) * 1000
    durs = np.full(chunk, 500, dtype=np.int64)
    kinds = (picks % 3).astype(np.uint8)
    streams = np.zeros(chunk, dtype=np.int64)
    return names, starts, durs, kinds, op_types, streams


def run_scenario(monitor: Monitor | None, chunk: int, steps: int, iters: int) -> dict[str, Any]:
    """``steps`` steps of the loop; per-step figures of the main thread."""
    tid = threading.get_native_id()
    pc = time.perf_counter_ns
    rng = np.random.default_rng(1)
    rows: list[tuple[int, int, int, int]] = []  # (wall, cpu, run queue, ops() call) ns
    for s in range(steps):
        cols = _columns(chunk, s, rng)  # the caller's work, not timed
        cpu0, rq0 = _own_clock(tid)
        t0 = pc()
        if monitor is not None:
            monitor.begin_step()
        _work(iters)
        call = 0
        if monitor is not None:
            if chunk:
                c0 = pc()
                names, starts, durs, kinds, op_types, streams = cols
                monitor.ops(names, starts, durs, kinds, op_types, streams)
                call = pc() - c0
            monitor.memory(1 << 30, 2 << 30)
            monitor.end_step()
        t1 = pc()
        cpu1, rq1 = _own_clock(tid)
        rows.append((t1 - t0, cpu1 - cpu0, rq1 - rq0, call))
    rows = rows[3:]  # the first steps of a scenario carry the switch-over
    wall = [r[0] / 1e3 for r in rows]
    cpu = [r[1] / 1e3 for r in rows]
    rq = [r[2] / 1e3 for r in rows]
    blocked = [(r[0] - r[1] - r[2]) / 1e3 for r in rows]
    call = [r[3] / 1e3 for r in rows]
    return {
        "steps": len(rows),
        "wall_us": {"median": statistics.median(wall), "mean": statistics.fmean(wall), "p90": percentile(wall, 90)},
        "cpu_us": {"median": statistics.median(cpu), "mean": statistics.fmean(cpu)},
        "run_queue_us": {"median": statistics.median(rq), "mean": statistics.fmean(rq)},
        "blocked_us": {"median": statistics.median(blocked), "mean": statistics.fmean(blocked),
                       "p90": percentile(blocked, 90)},
        "ops_call_us": {"median": statistics.median(call), "mean": statistics.fmean(call)},
    }


def _measured(scenario: str, bootstrap: str, prefix: str, args: argparse.Namespace) -> dict[str, Any]:
    if scenario == "none":
        return run_scenario(None, 0, args.steps, args.work_iters)
    chunk = int(scenario.split("@")[1])
    monitor = Monitor(run_id="bench-step-ops", bootstrap=bootstrap, topic_prefix=prefix, buffer_bytes=256 << 20)
    got = run_monitored(monitor, bootstrap, lambda: run_scenario(monitor, chunk, args.steps, args.work_iters))
    got.update(chunk=chunk)
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", help="broker host:port (default: start/reuse `profstream stack up`)")
    p.add_argument("--chunks", default="200,2000", help="ops per ops() call, one scenario each")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=60, help="per scenario and round")
    p.add_argument("--step-ms", type=float, default=20.0, help="CPU work per step, to calibrate --work-iters")
    p.add_argument("--work-iters", type=int, default=0,
                   help="loop iterations per step (0: calibrate to --step-ms here); give the same "
                        "number to every process compared")
    args = p.parse_args(argv)
    if args.work_iters <= 0:
        args.work_iters = calibrate(args.step_ms)
        note(f"calibrated: {args.work_iters} iterations for {args.step_ms} ms of CPU")
    scenarios = ["none", "ops@0"] + [f"ops@{int(c)}" for c in args.chunks.split(",") if c.strip()]

    bootstrap = broker_bootstrap(args.bootstrap)
    prefix = unique_prefix()
    note(f"broker {bootstrap}, topic prefix {prefix}")
    per_round: dict[str, list[dict[str, Any]]] = {s: [] for s in scenarios}
    load = [os.getloadavg()[0]]
    try:
        for r in range(args.rounds):
            k = r % len(scenarios)
            for s in scenarios[k:] + scenarios[:k]:
                got = _measured(s, bootstrap, prefix, args)
                per_round[s].append(got)
                note(f"round {r + 1}/{args.rounds} {s}: step wall {got['wall_us']['median']:.0f} us, "
                     f"blocked {got['blocked_us']['median']:.0f} us, ops() {got['ops_call_us']['median']:.0f} us")
            load.append(os.getloadavg()[0])
    finally:
        drop_topics(bootstrap, prefix)

    figures: dict[str, Any] = {}
    for s, rounds in per_round.items():  # each figure: the median over rounds of a round's mean / median
        figures[s] = {f"{k}_{stat}": statistics.median(x[k][stat] for x in rounds)
                      for k in ("wall_us", "cpu_us", "run_queue_us", "blocked_us", "ops_call_us")
                      for stat in ("mean", "median")}
        figures[s]["per_round"] = rounds
    floor, fixed = figures["none"], figures["ops@0"]
    added = {}
    for s in scenarios[1:]:
        f, chunk = figures[s], int(s.split("@")[1])
        added[s] = {  # by the steps' mean (every GIL wait counts), and by their median
            f"step_{k}_added_us_{stat}": f[f"{k}_us_{stat}"] - floor[f"{k}_us_{stat}"]
            for k in ("wall", "cpu", "blocked") for stat in ("mean", "median")}
        if chunk:
            added[s].update({
                "wall_over_ops0_ns_per_op_mean": (f["wall_us_mean"] - fixed["wall_us_mean"]) * 1e3 / chunk,
                "cpu_over_ops0_ns_per_op_mean": (f["cpu_us_mean"] - fixed["cpu_us_mean"]) * 1e3 / chunk,
                "ops_call_ns_per_op_median": f["ops_call_us_median"] * 1e3 / chunk,
                "ops_call_ns_per_op_mean": f["ops_call_us_mean"] * 1e3 / chunk,
            })
    first = per_round[scenarios[-1]][0]
    emit(envelope("step_ops", args, {
        "bootstrap": bootstrap,
        "metric": "step wall time added by Monitor.ops() per step (GIL waits included): mean over a "
                  "round's steps, median over rounds, less the no-Monitor loop's",
        "unit": "us per step",
        "recording": first.get("recording"),
        "loadavg_1min": load,
        "dropped_ops": sum(x.get("dropped_ops", 0) for rounds in per_round.values() for x in rounds),
        "added": added,
        "figures": figures,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
