"""Freshness of StepMetrics: from a step's end mark being recorded to its StepMetrics committed.

A real ``Processor`` (both stages, as ``profstream process`` runs them) runs on a thread
of this process, which does nothing else while it measures. The training run is
``profstream simulate --rate realtime`` in a subprocess: 8 ranks, one real Monitor each,
50 ms steps (20 steps/s per rank), 200 ops per step by default. In realtime the
simulator records a step's end mark when the wall clock reaches the step's end ``E``
(``end_ns``), so ``end_ns`` is when the mark was recorded, give or take the sleep's
overshoot.

What is measured, per step: the processor's own ``ProcessorHealth.freshness_s``, i.e.
``time.time_ns()`` just after the transaction holding the step's StepMetrics committed,
minus the step's ``end_ns`` (same host, same clock). That is exactly the target's
definition. The first ``--warmup-s`` seconds of each run (Monitors connecting) are left
out of the headline figures and reported apart. As a breakdown, ``closed_ns - end_ns``
(when the processor computed the StepMetrics) is read back from the steps topic.

``--commit-interval-ms`` and ``--monitor-batch-interval-ms`` change the two intervals a
step's figures wait through (defaults: the processor's 100 ms and the Monitor's 50 ms),
to see what each contributes.

Each repeat is one simulated run (a new run id) against the same processor. Prints one
JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from _common import (
    broker_bootstrap,
    drop_topics,
    emit,
    envelope,
    note,
    percentile,
    summary,
    unique_prefix,
)

from profstream.kafka.clients import read_topic
from profstream.kafka.topics import Topics, ensure_topics
from profstream.processors.health import ProcessorHealth
from profstream.processors.runtime import Processor
from profstream.schema.codec import decode, record_name

TARGET_P99_MS = 200.0


def distribution(values_ms: list[float]) -> dict[str, float] | None:
    if not values_ms:
        return None
    return {"n": len(values_ms), "p50": percentile(values_ms, 50), "p95": percentile(values_ms, 95),
            "p99": percentile(values_ms, 99), "max": max(values_ms), "mean": statistics.fmean(values_ms)}


def wait_for(condition, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def simulate(bootstrap: str, prefix: str, run_id: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``profstream simulate`` in realtime in a subprocess; returns its wall time and last line."""
    cmd = [sys.executable, "-m", "profstream.cli", "simulate", "--bootstrap", bootstrap, "--topic-prefix", prefix,
           "--run-id", run_id, "--ranks", str(args.ranks), "--steps", str(args.steps),
           "--ops-per-step", str(args.ops_per_step), "--step-time-ms", str(args.step_time_ms),
           "--rate", "realtime", "--seed", "3"]
    env = dict(os.environ)
    if args.monitor_batch_interval_ms is not None:
        env["PROFSTREAM_BATCH_INTERVAL_MS"] = str(args.monitor_batch_interval_ms)
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout=args.steps * args.step_time_ms / 1000 * 3 + 60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        wall = time.monotonic() - t0
        log.seek(0)
        lines = [ln.strip() for ln in log.read().splitlines() if ln.strip()]
    if rc != 0:
        raise SystemExit(f"profstream simulate failed (exit {rc}): {lines[-3:]}")
    return {"wall_s": wall, "last_line": lines[-1] if lines else ""}


def one_run(bootstrap: str, topics: Topics, health: ProcessorHealth, run_id: str,
            args: argparse.Namespace) -> dict[str, Any]:
    expected = args.ranks * args.steps
    before = len(health.freshness_s)
    load0 = os.getloadavg()[0]
    sim = simulate(bootstrap, topics.prefix, run_id, args)
    wait_for(lambda: len(health.freshness_s) - before >= expected, 60, f"{expected} StepMetrics of {run_id}")
    fresh_ms = [f * 1000 for f in list(health.freshness_s)[before:before + expected]]
    metrics = read_topic(bootstrap, topics.steps, lambda m: m is not None and m["run_id"] == run_id, expected, 60,
                         decode=lambda v: decode("StepMetrics", v) if record_name(v) == "StepMetrics" else None)
    warm_steps = int(args.warmup_s * 1000 / args.step_time_ms) * args.ranks
    # freshness_s is in commit order, which is step order up to the interleaving of ranks
    steady = fresh_ms[warm_steps:]
    warm_until = min((m["end_ns"] for m in metrics), default=0) + int(args.warmup_s * 1e9)
    close_ms = [(m["closed_ns"] - m["end_ns"]) / 1e6 for m in metrics if m["end_ns"] >= warm_until]
    return {"run_id": run_id, "steps": expected, "steps_read_back": len(metrics),
            "simulate_wall_s": sim["wall_s"], "simulate_output": sim["last_line"],
            "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "freshness_ms": distribution(steady), "freshness_ms_warmup": distribution(fresh_ms[:warm_steps]),
            "freshness_ms_all": distribution(fresh_ms),
            "share_within_target": sum(f <= TARGET_P99_MS for f in steady) / len(steady) if steady else None,
            "end_to_closed_ms": distribution(close_ms)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", help="broker host:port (default: start/reuse `profstream stack up`)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=500, help="steps per rank and run (500 x 50 ms = 25 s)")
    p.add_argument("--ops-per-step", type=int, default=200)
    p.add_argument("--step-time-ms", type=float, default=50.0)
    p.add_argument("--warmup-s", type=float, default=1.0, help="seconds at the start of each run left out")
    p.add_argument("--commit-interval-ms", type=float, default=100.0, help="the processor's (its default: 100)")
    p.add_argument("--monitor-batch-interval-ms", type=float, default=None,
                   help="the simulated Monitors' batch_interval_ms (default: theirs, 50)")
    p.add_argument("--keep-topics", action="store_true", help="do not delete the benchmark's topics")
    args = p.parse_args(argv)

    bootstrap = broker_bootstrap(args.bootstrap)
    prefix = unique_prefix()
    topics = Topics(prefix)
    note(f"broker {bootstrap}, topic prefix {prefix}")
    runs = []
    try:
        ensure_topics(bootstrap, topics, raw_partitions=12)
        health = ProcessorHealth()
        processor = Processor(bootstrap, topics, group_id=f"{prefix}-g", instance_id="0", health=health,
                              commit_interval_ms=args.commit_interval_ms)
        stop = threading.Event()
        errors: list[BaseException] = []

        def work() -> None:
            try:
                processor.run(stop)
            except BaseException as e:  # re-raised below
                errors.append(e)

        thread = threading.Thread(target=work, name="bench-processor", daemon=True)
        thread.start()
        try:
            wait_for(lambda: processor.loops[0].assignment() or errors, 60,
                     "the processor to get its partitions")
            for r in range(args.repeats):
                run = one_run(bootstrap, topics, health, f"bench-fresh-{r}", args)
                runs.append(run)
                f = run["freshness_ms"]
                note(f"repeat {r + 1}/{args.repeats}: {run['steps']} steps, freshness p50 {f['p50']:.1f} ms, "
                     f"p95 {f['p95']:.1f}, p99 {f['p99']:.1f}, max {f['max']:.1f} (load {run['loadavg_1m']})")
        finally:
            stop.set()
            thread.join(30)
        if errors:
            raise errors[0]
        transactions = health.transactions
    finally:
        if not args.keep_topics:
            drop_topics(bootstrap, prefix)

    p99s = [r["freshness_ms"]["p99"] for r in runs]
    median_p99 = statistics.median(p99s)
    results = {
        "bootstrap": bootstrap, "topic_prefix": prefix,
        "metric": "p99 over each run's steps of (StepMetrics committed, processor wall clock) - step end_ns; "
                  "median over runs",
        "unit": "ms",
        "workload": {"ranks": args.ranks, "step_time_ms": args.step_time_ms,
                     "steps_per_s": args.ranks * 1000 / args.step_time_ms, "steps_per_run": args.ranks * args.steps,
                     "ops_per_step": args.ops_per_step,
                     "ops_per_s": args.ranks * args.ops_per_step * 1000 / args.step_time_ms},
        "per_repeat": p99s,
        "median": median_p99,
        "p50_ms": summary([r["freshness_ms"]["p50"] for r in runs]),
        "p95_ms": summary([r["freshness_ms"]["p95"] for r in runs]),
        "p99_ms": summary(p99s),
        "max_ms": summary([r["freshness_ms"]["max"] for r in runs]),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "target": {"max_p99_ms": TARGET_P99_MS},
        "meets_target": median_p99 <= TARGET_P99_MS,
        "transactions": transactions,
        "runs": runs,
    }
    emit(envelope("processor_freshness", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
