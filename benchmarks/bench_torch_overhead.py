"""Training overhead of ``profstream.torch.instrument()`` on a CPU training loop.

The loop: a DataLoader over a synthetic TensorDataset (batch 64, in-process loading), an
MLP of Linear/ReLU layers (512 -> 1024 -> 1024 -> 1024 -> 10), MSE loss, SGD, one torch
thread. Four variants:

- ``plain``: the loop as it is;
- ``hooks_only``: ``instrument(..., capture_ops=False)`` feeding a disabled Monitor: the
  cost of the hooks themselves, nothing sent (context);
- ``instrumented``: ``instrument(model, optimizer, loader, capture_ops=False)`` feeding a
  real Monitor and broker (step marks, F/B marks, queue and memory samples);
- ``plain_profiler``: the loop under torch.profiler recording every step as its own
  cycle (the schedule op capture uses) with an on_trace_ready that does nothing: the
  profiler's own cost;
- ``instrumented_capture``: ``instrument()`` with op capture on every step: the profiler,
  plus turning its events into ops and sending them.

The variants run interleaved in blocks of ``--block`` steps (one epoch of the loader),
in a rotating order, so that a busy moment of a shared machine hits them alike; the
first two steps of a block (hooks attached, profiler started) are left out. A step's
time is the wall time from one ``optimizer.step()`` return to the next, the loader's
next batch included. Each repeat pools at least ``--steps`` steps per variant and gives
its median step time; overheads are per repeat (instrumented / plain - 1,
instrumented_capture / plain_profiler - 1) and the figure is their median over repeats.
Targets: <= 1 % and <= 3 %. The process CPU time per step (all threads: the Monitor's
sender and the Kafka client included) is reported beside the wall time: on a machine with
no idle core every CPU cycle of a background thread lengthens the step.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any

from _common import broker_bootstrap, drop_topics, emit, envelope, note, summary, unique_prefix

VARIANTS = ("plain", "hooks_only", "instrumented", "plain_profiler", "instrumented_capture")
TARGETS = {"instrumented": 0.01, "instrumented_capture": 0.03}
SKIP = 2  # first steps of a block left out


def make_loop(steps: int, batch: int, hidden: int) -> tuple[Any, Any, Any]:
    import torch

    torch.manual_seed(0)
    x, y = torch.randn(steps * batch, 512), torch.randn(steps * batch, 10)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)
    layers: list[Any] = [torch.nn.Linear(512, hidden), torch.nn.ReLU()]
    for _ in range(2):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 10))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), loader


def run_steps(model: Any, optimizer: Any, loader: Any, profiler: Any = None) -> list[float]:
    """Train one epoch; the wall time of each step in seconds, the first SKIP left out."""
    import torch

    ends = []
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if profiler is not None:
            profiler.step()
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends, ends[1:])][SKIP - 1:]


def run_block(variant: str, loop: tuple[Any, Any, Any], monitors: dict[str, Any], stats: dict) -> list[float]:
    import profstream.torch as pst

    model, optimizer, loader = loop
    if variant == "plain":
        return run_steps(model, optimizer, loader)
    if variant == "plain_profiler":
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], schedule=lambda _step: ProfilerAction.RECORD_AND_SAVE,
                       on_trace_ready=lambda _prof: None)
        prof.start()
        try:
            return run_steps(model, optimizer, loader, prof)
        finally:
            prof.stop()
    capture = variant == "instrumented_capture"
    if variant == "hooks_only":
        variant = "disabled"
    handle = pst.instrument(model, optimizer, loader, monitor=monitors[variant], capture_ops=capture)
    try:
        return run_steps(model, optimizer, loader)
    finally:
        handle.close(timeout=30)
        if handle.capture is not None:
            stats["ops_sent"] = stats.get("ops_sent", 0) + handle.capture.ops_sent
            stats["steps_captured"] = stats.get("steps_captured", 0) + handle.capture.steps_captured
        if handle.error is not None:
            stats.setdefault("errors", []).append(repr(handle.error))


def hook_cost_us(loops: int = 5000) -> float:
    """Wall time the hooks add to one step of an empty loop (a 1-sample DataLoader batch,
    an identity module, an optimizer over one scalar), with a disabled Monitor: the
    instrumentation's own per-step cost, best of 3."""
    import torch

    import profstream.torch as pst
    from profstream.producers.monitor import Monitor

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(loops + 1, 1)), batch_size=1)
    model = torch.nn.Identity()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    def loop() -> float:
        it = iter(loader)
        t0 = time.perf_counter()
        for _ in range(loops):
            next(it)
            model(0)
            optimizer.step()
        return (time.perf_counter() - t0) / loops

    loop()
    base = min(loop() for _ in range(3))
    with pst.instrument(model, optimizer, loader, monitor=Monitor(enabled=False), capture_ops=False):
        hooked = min(loop() for _ in range(3))
    return (hooked - base) * 1e6


def monitor_cpu_ms_per_step(options: dict[str, Any], steps: int = 100, step_s: float = 0.02) -> float:
    """Process CPU time per step of a bare Monitor (a step mark and a memory sample per
    step, steps of ``step_s`` asleep) sending to the broker: what sending costs."""
    from profstream.producers.monitor import Monitor

    monitor = Monitor(run_id="bench-monitor-alone", **options)
    try:
        monitor.flush(30)
        c0 = time.process_time()
        for _ in range(steps):
            with monitor.step():
                monitor.memory(1)
                time.sleep(step_s)
        return (time.process_time() - c0) / steps * 1e3
    finally:
        monitor.close(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default=os.environ.get("PROFSTREAM_TEST_BOOTSTRAP"),
                        help="Kafka broker (default: $PROFSTREAM_TEST_BOOTSTRAP, else the local stack)")
    parser.add_argument("--steps", type=int, default=200, help="steps per variant and repeat (>= 200 for the target)")
    parser.add_argument("--block", type=int, default=25, help="steps per interleaved block")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared box)")
    parser.add_argument("--batch-interval-ms", type=float, default=None,
                        help="Monitor batch_interval_ms (default: the Monitor's default)")
    args = parser.parse_args()

    import torch

    from profstream.producers.monitor import Monitor

    torch.set_num_threads(args.threads)
    bootstrap = broker_bootstrap(args.bootstrap)
    prefix = unique_prefix()
    options = {"bootstrap": bootstrap, "topic_prefix": prefix, "host_sample_interval_s": 0,
               "batch_interval_ms": args.batch_interval_ms}
    monitors = {"instrumented": Monitor(run_id="bench-instrumented", **options),
                "instrumented_capture": Monitor(run_id="bench-capture", auto_watermark=False, **options),
                "disabled": Monitor(enabled=False)}
    loop = make_loop(args.block, args.batch, args.hidden)
    rounds = math.ceil(args.steps / (args.block - SKIP))
    per_repeat: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu_per_repeat: dict[str, list[float]] = {v: [] for v in VARIANTS}
    stats: dict[str, Any] = {}
    try:
        for variant in VARIANTS:  # warm-up: allocator, kineto's first start, the broker connection
            run_block(variant, loop, monitors, {})
        for r in range(args.repeats):
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            cpu = dict.fromkeys(VARIANTS, 0.0)
            for i in range(rounds):
                k = i % len(VARIANTS)
                for variant in VARIANTS[k:] + VARIANTS[:k]:
                    c0 = time.process_time()
                    times[variant] += run_block(variant, loop, monitors, stats)
                    cpu[variant] += time.process_time() - c0
            for v in VARIANTS:
                per_repeat[v].append(statistics.median(times[v]))
                cpu_per_repeat[v].append(cpu[v] / (rounds * args.block))
            note(f"repeat {r}: " + ", ".join(f"{v} {per_repeat[v][-1] * 1e3:.2f} ms ({len(times[v])} steps)"
                                             for v in VARIANTS))
        stats["dropped_ops"] = sum(m.stats()["dropped_ops"] for m in monitors.values())
        context = {"hook_cost_us_per_step": hook_cost_us(),
                   "monitor_alone_cpu_ms_per_20ms_step": monitor_cpu_ms_per_step(options)}
    finally:
        for m in monitors.values():
            m.close(timeout=30)
        drop_topics(bootstrap, prefix)

    def overhead(variant: str, base: str, source: dict = per_repeat) -> list[float]:
        return [a / b - 1 for a, b in zip(source[variant], source[base])]

    figures = {
        "instrumented": summary(overhead("instrumented", "plain")),
        "hooks_only": summary(overhead("hooks_only", "plain")),
        "instrumented_capture": summary(overhead("instrumented_capture", "plain_profiler")),
        "profiler_alone": summary(overhead("plain_profiler", "plain")),
    }
    cpu_figures = {
        "instrumented": summary(overhead("instrumented", "plain", cpu_per_repeat)),
        "hooks_only": summary(overhead("hooks_only", "plain", cpu_per_repeat)),
        "instrumented_capture": summary(overhead("instrumented_capture", "plain_profiler", cpu_per_repeat)),
    }
    emit(envelope("torch_overhead", args, {
        "median_step_ms": {v: summary([t * 1e3 for t in per_repeat[v]]) for v in VARIANTS},
        "cpu_ms_per_step": {v: summary([t * 1e3 for t in cpu_per_repeat[v]]) for v in VARIANTS},
        "steps_per_variant_and_repeat": rounds * (args.block - SKIP),
        "overhead": figures,
        "cpu_overhead": cpu_figures,
        "target": TARGETS,
        "meets_target": {k: figures[k]["median"] <= t for k, t in TARGETS.items()},
        "capture": stats,
        "context": context,
    }))


if __name__ == "__main__":
    main()
