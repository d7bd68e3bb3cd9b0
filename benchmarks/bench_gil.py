"""What the Monitor's threads cost a training thread that always wants the GIL, per 50 ms cycle.

The main thread plays a CPU-bound training loop written in Python: it never blocks and
never gives the GIL back of its own accord, so every microsecond another thread of the
process holds the GIL (and every hand-over of it) is a microsecond it waits. It runs
steps of ``--step-ms`` (a step mark and a memory sample each, as ``instrument()`` records)
and records ops at ``--rate`` ops/s, either one ``Monitor.op()`` call per op in bursts of
100 (``per_call``) or one ``Monitor.ops()`` call of a step's ops at each step end
(``bulk``, as op capture does); between calls it spins in Python.

Per window of ``--window-ms`` (default 50 ms, the Monitor's batch interval), from
``/proc/self/task/TID/schedstat`` of the main thread: wall time, its CPU time, its wait
for a core (run queue), and the rest, **blocked**: neither running nor runnable, i.e.
waiting for the GIL. Per scenario, the CPU time of every thread of the process by name
(the Monitor's sender, librdkafka's threads). Scenarios (``--scenarios``): ``none`` (the
same loop with no Monitor: the floor), ``steps`` (step marks and memory samples only:
op capture off), ``per_call`` and ``bulk`` at ``--rate``. They alternate in rotating order
over ``--rounds`` rounds of ``--seconds`` each.

``--cpu-hog`` runs a second, CPU-bound process beside it for the whole run (the box's
second core taken). Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

from _common import (
    broker_bootstrap,
    cpu_hog,
    drop_topics,
    emit,
    envelope,
    note,
    percentile,
    run_monitored,
    schedstat,
    thread_cpu,
    unique_prefix,
)

from profstream.producers.monitor import Monitor

TARGET_BLOCKED_US = 50.0
SCENARIOS = ("none", "steps", "per_call", "bulk")
BURST = 100


def _own_clock(tid: int) -> tuple[int, int]:
    """(CPU ns, run-queue wait ns) of the calling thread: CPU from the thread clock (exact),
    the run-queue wait from schedstat (settled while the thread runs)."""
    return time.thread_time_ns(), schedstat(tid)[1]


def _group(tid: int, name: str, sender_tid: int | None) -> str:
    if tid == sender_tid:
        return "profstream_sender"
    if name.startswith("rdk:"):
        return "librdkafka"
    return f"other:{name}"


def run_scenario(scenario: str, monitor: Monitor | None, seconds: float, rate: float, step_ms: float,
                 window_ms: float) -> dict[str, Any]:
    """One scenario for ``seconds``: per-window figures of the main thread, per-thread CPU."""
    sender = getattr(monitor, "_sender", None)
    sender_tid = getattr(sender, "native_id", None)
    tid = threading.get_native_id()
    pc = time.perf_counter_ns
    names = [f"aten::op_{i}" for i in range(50)]
    step_ns = int(step_ms * 1e6)
    window_ns = int(window_ms * 1e6)
    ops_per_step = int(rate * step_ms / 1e3)
    bulk_names = [names[i % 50] for i in range(ops_per_step)]
    bulk_starts = list(range(0, ops_per_step * 1000, 1000))
    bulk_durs = [500] * ops_per_step
    burst_ns = int(BURST / rate * 1e9) if rate else 0
    windows: list[tuple[int, int, int]] = []  # (wall, cpu, run queue) ns
    threads_before = thread_cpu()
    end = pc() + int(seconds * 1e9)
    w_wall = pc()
    w_cpu, w_rq = _own_clock(tid)
    next_window = w_wall + window_ns
    ts = time.time_ns()
    op_count = 0
    while True:
        step_start = pc()
        if step_start >= end:
            break
        if monitor is not None:
            monitor.begin_step()
        step_end = step_start + step_ns
        next_burst = step_start
        while True:
            now = pc()
            if now >= step_end:
                break
            if scenario == "per_call" and now >= next_burst:
                op = monitor.op
                for i in range(BURST):
                    op(names[i % 50], ts + i, 500)
                op_count += BURST
                next_burst += burst_ns
            if now >= next_window:  # close a window (reading /proc costs CPU, not blocked time)
                cpu, rq = _own_clock(tid)
                t = pc()
                windows.append((t - w_wall, cpu - w_cpu, rq - w_rq))
                w_wall, w_cpu, w_rq = t, cpu, rq
                next_window = t + window_ns
        if monitor is not None:
            if scenario == "bulk":
                monitor.ops(bulk_names, bulk_starts, bulk_durs)
                op_count += ops_per_step
            monitor.memory(1 << 30, 2 << 30)
            monitor.end_step()
    threads_after = thread_cpu()
    cpu_by_group: dict[str, float] = {}
    for t, (name, cpu) in threads_after.items():
        if t == tid:
            continue
        before = threads_before.get(t, (name, 0))[1]
        group = _group(t, name, sender_tid)
        cpu_by_group[group] = cpu_by_group.get(group, 0.0) + (cpu - before)
    windows = windows[2:]  # the first windows of a scenario carry the switch-over
    blocked = [(w - c - r) / 1e3 for w, c, r in windows]
    run_queue = [r / 1e3 for _w, _c, r in windows]
    n = len(windows)
    return {
        "windows": n,
        "ops": op_count,
        "blocked_us": {"mean": statistics.fmean(blocked), "median": statistics.median(blocked),
                       "p90": percentile(blocked, 90), "p99": percentile(blocked, 99), "max": max(blocked)},
        "run_queue_us": {"mean": statistics.fmean(run_queue), "median": statistics.median(run_queue)},
        "other_threads_cpu_us_per_window": {k: v / 1e3 / max(n, 1) for k, v in sorted(cpu_by_group.items())},
    }


def _measured(scenario: str, bootstrap: str, prefix: str, args: argparse.Namespace) -> dict[str, Any]:
    """One scenario with a Monitor of its own (none for ``none``), connected before timing."""
    if scenario == "none":
        return run_scenario(scenario, None, args.seconds, args.rate, args.step_ms, args.window_ms)
    monitor = Monitor(run_id="bench-gil", bootstrap=bootstrap, topic_prefix=prefix, buffer_bytes=256 << 20)
    return run_monitored(monitor, bootstrap, lambda: run_scenario(scenario, monitor, args.seconds, args.rate,
                                                                  args.step_ms, args.window_ms))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", help="broker host:port (default: start/reuse `profstream stack up`)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0, help="per scenario and round")
    p.add_argument("--rate", type=float, default=100_000, help="op events/s of per_call and bulk")
    p.add_argument("--step-ms", type=float, default=18.0)
    p.add_argument("--window-ms", type=float, default=50.0)
    p.add_argument("--cpu-hog", action="store_true", help="a second CPU-bound process runs beside the loop")
    args = p.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")

    bootstrap = broker_bootstrap(args.bootstrap)
    prefix = unique_prefix()
    note(f"broker {bootstrap}, topic prefix {prefix}")
    results: dict[str, Any] = {"bootstrap": bootstrap, "topic_prefix": prefix}
    per_round: dict[str, list[dict[str, Any]]] = {s: [] for s in scenarios}
    load = [os.getloadavg()[0]]
    sent = dropped = 0
    try:
        with cpu_hog(args.cpu_hog):
            for r in range(args.rounds):
                k = r % len(scenarios)
                for s in scenarios[k:] + scenarios[:k]:
                    got = _measured(s, bootstrap, prefix, args)
                    per_round[s].append(got)
                    sent += got.get("batches_sent", 0)
                    dropped += got.get("dropped_ops", 0)
                    note(f"round {r + 1}/{args.rounds} {s}: blocked mean {got['blocked_us']['mean']:.0f} us, "
                         f"p99 {got['blocked_us']['p99']:.0f} us per window; other threads "
                         f"{got['other_threads_cpu_us_per_window']}")
                load.append(os.getloadavg()[0])
    finally:
        drop_topics(bootstrap, prefix)

    figures = {}
    for s, rounds in per_round.items():
        figures[s] = {
            "blocked_us_mean": statistics.median(x["blocked_us"]["mean"] for x in rounds),
            "blocked_us_median": statistics.median(x["blocked_us"]["median"] for x in rounds),
            "blocked_us_p99": statistics.median(x["blocked_us"]["p99"] for x in rounds),
            "run_queue_us_mean": statistics.median(x["run_queue_us"]["mean"] for x in rounds),
            "per_round": rounds,
        }
    floor = figures.get("none", {}).get("blocked_us_mean", 0.0)
    worst = max((f["blocked_us_mean"] - floor for s, f in figures.items() if s != "none"), default=0.0)
    results.update({
        "metric": "blocked time of the main thread per window, mean over windows, median over rounds, "
                  "less the no-Monitor floor: the worst scenario",
        "unit": "us per window",
        "median": worst,
        "target": {"max_blocked_us_per_window": TARGET_BLOCKED_US},
        "meets_target": worst <= TARGET_BLOCKED_US,
        "loadavg_1min": load,
        "cpu_hog": args.cpu_hog,
        "batches_sent": sent,
        "dropped_ops": dropped,
        "figures": figures,
    })
    emit(envelope("gil", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
