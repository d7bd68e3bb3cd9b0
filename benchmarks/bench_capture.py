"""Capture requests (#13): how fast a request starts a capture, what the control reader
costs an idle training process, and the training overhead of ``instrument()`` with
capture off now that every Monitor reads the control topic.

Four parts (``--part``, default all):

- ``latency``: a training process of its own (this script, ``--role train``: one Monitor,
  rank 0, ``scheduled_capture=False``, steps of ``--step-ms`` asleep or spinning the GIL
  with ``--work busy``, 10 ops a step) and this process sending capture requests of one
  step through an open kafka-python producer, one after the other, each after a random
  wait of up to one step, so that requests reach the rank at every phase of a step. Per
  request: sent (taken just before ``send``) -> ``armed`` (the reader thread accepted it:
  Kafka plus the reader's poll) -> ``started`` (the training thread took it up at its next
  step boundary), from the statuses' ``ts_ns`` (one host, one clock). Target: sent ->
  started p99 <= 1 s plus one step.
- ``idle_cpu``: an idle training process (this script, ``--role idle``: a Monitor made,
  no step, host sampling off) measured for ``--idle-s`` seconds after ``--warmup-s``, with
  ``control`` on and off in alternating processes: the process CPU time (every thread, the
  librdkafka ones included) per wall second; the difference is the reader's cost. With
  control on, also the reader's Python thread alone (its thread CPU clock). Target:
  <= 0.2 % of a core.
- ``overhead``: ``bench_torch_overhead``'s CPU training loop, three variants interleaved
  in rotating blocks: ``plain``; ``instrumented`` (``instrument()``, op capture off, a
  Monitor with control on, the default); ``instrumented_no_control`` (the same, control
  off). Per repeat the median step and the process CPU time per step (every thread);
  the figure is the median over repeats of the per-repeat overhead. Compare
  ``instrumented`` with docs/benchmarks.md section 12.
- ``step_cost``: what the training thread pays per step for capture requests when none is
  asked: a loop of ``begin_step()`` / ``end_step()`` pairs on a Monitor with the plan the
  reader feeds and on one without (no Sender, no reader thread: the training thread
  alone), alternating, ``--pairs`` pairs a repeat; the best repeat of each (the least
  disturbed by other work on the machine), in ns per step.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
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

RUN_ID = "bench-capture"
OPS_PER_STEP = 10


# -- the training process (--role train / idle) ------------------------------------------

def _monitor(args: argparse.Namespace, control: bool) -> Any:
    from profstream.producers.monitor import Monitor

    return Monitor(run_id=RUN_ID, rank=0, world_size=1, bootstrap=args.bootstrap, topic_prefix=args.prefix,
                   scheduled_capture=False, host_sample_interval_s=0, control=control)


def _wait_connected(monitor: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not monitor.stats().get("control_connected"):
        if time.monotonic() >= deadline:
            raise SystemExit(f"the control reader did not connect within {timeout:g} s: {monitor.stats()}")
        time.sleep(0.05)


def role_train(args: argparse.Namespace) -> None:
    """Step until stdin closes; print one JSON line of Monitor.stats() at the end."""
    monitor = _monitor(args, control=True)
    _wait_connected(monitor)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("ready", flush=True)
    step_s = args.step_ms / 1000
    names = [f"op{i}" for i in range(OPS_PER_STEP)]
    while not stop.is_set():
        monitor.begin_step()
        now = time.time_ns()
        monitor.ops(names, [now + i for i in range(OPS_PER_STEP)], 1000, 0, "MatMul")
        if args.work == "busy":  # holds the GIL but for the interpreter's switch interval
            end = time.perf_counter() + step_s
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(step_s)
        monitor.end_step()
    monitor.close(timeout=10)
    print(json.dumps(monitor.stats()), flush=True)


def role_idle(args: argparse.Namespace) -> None:
    """A Monitor and nothing else for --idle-s; prints one JSON line of CPU figures."""
    monitor = _monitor(args, control=args.control == "on")
    reader = monitor._control
    if reader is not None:
        _wait_connected(monitor)
    time.sleep(args.warmup_s)
    clock = time.pthread_getcpuclockid(reader.ident) if reader is not None else None
    w0, c0 = time.perf_counter(), time.process_time()
    r0 = time.clock_gettime(clock) if clock is not None else 0.0
    time.sleep(args.idle_s)
    r1 = time.clock_gettime(clock) if clock is not None else 0.0
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    result = {"control": args.control, "wall_s": wall, "process_cpu_share": cpu / wall,
              "reader_thread_cpu_share": (r1 - r0) / wall if clock is not None else None,
              "threads": len(os.listdir("/proc/self/task"))}
    monitor.close(timeout=10)
    print(json.dumps(result), flush=True)


def _child(args: argparse.Namespace, role: str, *extra: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--role", role, "--bootstrap", args.bootstrap,
            "--prefix", args.prefix, *extra]


# -- latency --------------------------------------------------------------------------------

def latency(args: argparse.Namespace) -> dict[str, Any]:
    from profstream.control.client import follow
    from profstream.control.records import control_key, encode_request, new_request
    from profstream.kafka.clients import make_producer
    from profstream.kafka.topics import Topics

    topics = Topics(args.prefix)
    runs = []
    for r in range(args.runs):
        child = subprocess.Popen(_child(args, "train", "--step-ms", str(args.step_ms), "--work", args.work),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        producer = make_producer(args.bootstrap)
        sent_started, sent_armed, armed_started, refused = [], [], [], []
        try:
            if child.stdout.readline().strip() != "ready":
                raise SystemExit("the training process did not start; see its error above")
            producer.partitions_for(topics.control)  # metadata fetched before the first timing
            for _ in range(args.requests):
                time.sleep(random.uniform(0, args.step_ms / 1000))
                request = new_request(RUN_ID, steps=1, activities=("cpu",), reason="bench", requested_by="bench",
                                      expires_s=30)
                sent = time.time_ns()
                producer.send(topics.control, encode_request(request), control_key(RUN_ID)).get(timeout=10)
                progress = follow(args.bootstrap, topics, request, timeout=30)
                status = progress.ranks.get(0)
                if status is None or status["state"] != "finished":
                    refused.append(status["reason"] if status else "no answer within 30 s")
                    continue
                ts = progress.times[0]
                sent_started.append((ts["started"] - sent) / 1e6)
                sent_armed.append((ts["armed"] - sent) / 1e6)
                armed_started.append((ts["started"] - ts["armed"]) / 1e6)
        finally:
            producer.close(timeout=5)
            out, _ = child.communicate("", timeout=60)
        stats = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        run = {"sent_to_started_ms": sent_started, "sent_to_armed_ms": sent_armed,
               "armed_to_started_ms": armed_started, "failed": refused,
               "p50_ms": statistics.median(sent_started) if sent_started else None,
               "p99_ms": percentile(sent_started, 99) if sent_started else None,
               "rank_stats": {k: stats.get(k) for k in ("capture_requests", "captures_started", "captures_finished",
                                                        "captures_refused", "control_outages")}}
        note(f"latency run {r}: sent->started p50 {run['p50_ms']:.1f} ms, p99 {run['p99_ms']:.1f} ms "
             f"({len(sent_started)} requests, {len(refused)} failed)")
        runs.append(run)
    pooled = [x for run in runs for x in run["sent_to_started_ms"]]
    target_ms = 1000 + args.step_ms
    p99 = percentile(pooled, 99) if pooled else math.inf
    return {"step_ms": args.step_ms, "work": args.work, "runs": runs,
            "pooled": {"requests": len(pooled), "p50_ms": statistics.median(pooled) if pooled else None,
                       "p99_ms": p99, "max_ms": max(pooled) if pooled else None,
                       "sent_to_armed_p50_ms": statistics.median([x for r in runs for x in r["sent_to_armed_ms"]])
                       if pooled else None,
                       "armed_to_started_p50_ms": statistics.median([x for r in runs
                                                                     for x in r["armed_to_started_ms"]])
                       if pooled else None},
            "p99_per_run_ms": summary([r["p99_ms"] for r in runs if r["p99_ms"] is not None]) if pooled else None,
            "target_ms": target_ms, "meets_target": p99 <= target_ms}


# -- idle CPU ---------------------------------------------------------------------------------

def idle_cpu(args: argparse.Namespace) -> dict[str, Any]:
    shares: dict[str, list[float]] = {"on": [], "off": []}
    reader: list[float] = []
    for r in range(args.runs):
        for control in (("on", "off") if r % 2 == 0 else ("off", "on")):
            done = subprocess.run(_child(args, "idle", "--control", control, "--idle-s", str(args.idle_s),
                                         "--warmup-s", str(args.warmup_s)),
                                  stdout=subprocess.PIPE, text=True, check=True, timeout=args.idle_s + 120)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            shares[control].append(result["process_cpu_share"] * 100)
            if result["reader_thread_cpu_share"] is not None:
                reader.append(result["reader_thread_cpu_share"] * 100)
        note(f"idle run {r}: process CPU control on {shares['on'][-1]:.3f} %, off {shares['off'][-1]:.3f} % "
             f"of a core; reader thread {reader[-1]:.4f} %")
    diffs = [a - b for a, b in zip(shares["on"], shares["off"])]
    return {"idle_s": args.idle_s, "process_cpu_pct_of_core": {k: summary(v) for k, v in shares.items()},
            "process_cpu_pct_per_run": shares, "control_cost_pct_of_core": summary(diffs),
            "control_cost_pct_per_run": diffs, "reader_thread_pct_of_core": summary(reader),
            "target_pct": 0.2, "meets_target": statistics.median(diffs) <= 0.2}


# -- training overhead with capture off --------------------------------------------------------

OVERHEAD_VARIANTS = ("plain", "instrumented", "instrumented_no_control")


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from bench_torch_overhead import SKIP, make_loop, run_block

    from profstream.producers.monitor import Monitor

    torch.set_num_threads(1)
    options = {"bootstrap": args.bootstrap, "topic_prefix": args.prefix, "host_sample_interval_s": 0}
    monitors = {"instrumented": {"instrumented": Monitor(run_id="bench-control-on", **options)},
                "instrumented_no_control": {"instrumented": Monitor(run_id="bench-control-off", control=False,
                                                                    **options)}}
    loop = make_loop(args.block, 64, 1024)
    rounds = math.ceil(args.steps / (args.block - SKIP))
    per_repeat: dict[str, list[float]] = {v: [] for v in OVERHEAD_VARIANTS}
    cpu_per_repeat: dict[str, list[float]] = {v: [] for v in OVERHEAD_VARIANTS}
    stats: dict[str, Any] = {}

    def block(variant: str) -> list[float]:
        if variant == "plain":
            return run_block("plain", loop, {}, stats)
        return run_block("instrumented", loop, monitors[variant], stats)

    try:
        for variant in OVERHEAD_VARIANTS:  # warm-up
            block(variant)
        for r in range(args.repeats):
            times: dict[str, list[float]] = {v: [] for v in OVERHEAD_VARIANTS}
            cpu = dict.fromkeys(OVERHEAD_VARIANTS, 0.0)
            for i in range(rounds):
                k = i % len(OVERHEAD_VARIANTS)
                for variant in OVERHEAD_VARIANTS[k:] + OVERHEAD_VARIANTS[:k]:
                    c0 = time.process_time()  # every thread: the reader's and librdkafka's included
                    times[variant] += block(variant)
                    cpu[variant] += time.process_time() - c0
            for v in OVERHEAD_VARIANTS:
                per_repeat[v].append(statistics.median(times[v]))
                cpu_per_repeat[v].append(cpu[v] / (rounds * args.block))
            note(f"overhead repeat {r}: " + ", ".join(f"{v} {per_repeat[v][-1] * 1e3:.2f} ms" for v in OVERHEAD_VARIANTS))
    finally:
        for by_name in monitors.values():
            by_name["instrumented"].close(timeout=30)

    def over(variant: str, base: str, source: dict = per_repeat) -> list[float]:
        return [(a / b - 1) * 100 for a, b in zip(source[variant], source[base])]

    def figures(source: dict) -> dict[str, Any]:
        return {"instrumented": summary(over("instrumented", "plain", source)),
                "instrumented_no_control": summary(over("instrumented_no_control", "plain", source)),
                "control_on_over_off": summary(over("instrumented", "instrumented_no_control", source))}

    return {"median_step_ms": {v: summary([t * 1e3 for t in per_repeat[v]]) for v in OVERHEAD_VARIANTS},
            "cpu_ms_per_step": {v: summary([t * 1e3 for t in cpu_per_repeat[v]]) for v in OVERHEAD_VARIANTS},
            "steps_per_variant_and_repeat": rounds * (args.block - SKIP),
            "overhead_pct": figures(per_repeat), "cpu_overhead_pct": figures(cpu_per_repeat),
            "errors": stats.get("errors", [])}


# -- the training thread's cost per step ----------------------------------------------------

class _NoSender:
    """Stands in for the Sender in ``step_cost``: the loop measures the training thread alone."""

    def __init__(self, monitor: Any) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self, timeout: float) -> bool:
        return True


def step_cost(args: argparse.Namespace) -> dict[str, Any]:
    from profstream.producers.capture_plan import CapturePlan
    from profstream.producers.monitor import Monitor

    options = {"bootstrap": args.bootstrap, "topic_prefix": args.prefix, "host_sample_interval_s": 0,
               "auto_watermark": False, "control": False, "sender_factory": _NoSender}
    monitors = {"on": Monitor(run_id="bench-steps-on", **options), "off": Monitor(run_id="bench-steps-off", **options)}
    on = monitors["on"]  # what start_control gives the Monitor, without the reader's thread (idle_cpu measures it)
    on.capture_plan = on._plan_gate = CapturePlan(on.rank, on.options["capture_max_steps"])
    per_pair: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for r in range(args.repeats * 2):
            for control in (("on", "off") if r % 2 == 0 else ("off", "on")):
                m = monitors[control]
                m.buffer.marks.clear()  # no Sender drains them
                begin, end = m.begin_step, m.end_step
                t0 = time.perf_counter()
                for _ in range(args.pairs):
                    begin()
                    end()
                per_pair[control].append((time.perf_counter() - t0) / args.pairs * 1e9)
    finally:
        for m in monitors.values():
            m.close(timeout=30)
    best = {k: min(v) for k, v in per_pair.items()}
    note(f"step cost: control on {best['on']:.0f} ns, off {best['off']:.0f} ns per begin/end pair")
    return {"pairs": args.pairs, "ns_per_step": {k: summary(v) for k, v in per_pair.items()}, "best_ns_per_step": best,
            "control_ns_per_step": best["on"] - best["off"]}


# -- main -------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", default=os.environ.get("PROFSTREAM_TEST_BOOTSTRAP"),
                        help="Kafka broker (default: $PROFSTREAM_TEST_BOOTSTRAP, else the local stack)")
    parser.add_argument("--part", choices=("all", "latency", "idle_cpu", "overhead", "step_cost"), default="all")
    parser.add_argument("--runs", type=int, default=3, help="latency: training processes; idle_cpu: on/off pairs")
    parser.add_argument("--requests", type=int, default=40, help="latency: requests per training process")
    parser.add_argument("--step-ms", type=float, default=100.0, help="latency: the training loop's step")
    parser.add_argument("--work", choices=("sleep", "busy"), default="sleep",
                        help="latency: a step asleep, or spinning in Python (holding the GIL)")
    parser.add_argument("--idle-s", type=float, default=20.0, help="idle_cpu: seconds measured per process")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="idle_cpu: seconds before measuring")
    parser.add_argument("--steps", type=int, default=200, help="overhead: steps per variant and repeat")
    parser.add_argument("--block", type=int, default=25, help="overhead: steps per interleaved block")
    parser.add_argument("--repeats", type=int, default=3, help="overhead, step_cost: repeats")
    parser.add_argument("--pairs", type=int, default=100_000, help="step_cost: begin/end pairs per repeat")
    parser.add_argument("--role", choices=("train", "idle"), help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--control", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "train":
        return role_train(args)
    if args.role == "idle":
        return role_idle(args)

    from profstream.kafka.topics import Topics, ensure_topics

    args.bootstrap = broker_bootstrap(args.bootstrap)
    args.prefix = unique_prefix()
    ensure_topics(args.bootstrap, Topics(args.prefix))
    results: dict[str, Any] = {}
    try:
        for part, fn in (("latency", latency), ("idle_cpu", idle_cpu), ("overhead", overhead),
                         ("step_cost", step_cost)):
            if args.part in ("all", part):
                results[part] = fn(args)
    finally:
        drop_topics(args.bootstrap, args.prefix)
    emit(envelope("capture", args, results))


if __name__ == "__main__":
    main()
