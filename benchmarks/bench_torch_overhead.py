"""Training overhead of ``profstream.torch.instrument()`` on a CPU training loop.

The loop: a DataLoader over a synthetic TensorDataset (batch 64, in-process loading), an
MLP of Linear/ReLU layers (512 -> 1024 -> 1024 -> 1024 -> 10), MSE loss, SGD, one torch
thread. Four variants:

- ``plain``: the loop as it is;
- ``hooks_only``: ``instrument(..., capture_ops=False)`` feeding ``HooksOnly`` (a disabled
  Monitor whose hooks still run): the cost of the hooks themselves, nothing sent (context);
- ``instrumented``: ``instrument(model, optimizer, loader, capture_ops=False)`` feeding a
  real Monitor and broker (step marks, F/B marks, queue and memory samples);
- ``plain_profiler``: the loop under torch.profiler recording every step as its own
  cycle (the schedule op capture uses) with an on_trace_ready that does nothing: the
  profiler's own cost;
- ``instrumented_capture``: ``instrument()`` with op capture on every step: the profiler,
  plus turning its events into ops and sending them. The compiled event-tree walk is
  built (or found built) before anything is measured, as in any run after the first
  (``--no-compiled-walk``: the Python walk).

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

``--places``: instead, where the conversion of a captured step can run and what the
training thread pays for each place (no broker; see ``conversion_places``).

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from _common import (
    broker_bootstrap,
    chosen,
    cpu_hog,
    drop_topics,
    emit,
    envelope,
    note,
    summary,
    unique_prefix,
)

VARIANTS = ("plain", "hooks_only", "instrumented", "plain_profiler", "instrumented_capture")
TARGETS = {"instrumented": 0.005, "instrumented_capture": 0.02}  # issue #19 (was 1 % and 3 % in #6)
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


def run_steps(model: Any, optimizer: Any, loader: Any, profiler: Any = None,
              clock: Callable[[], Any] = time.perf_counter) -> list[Any]:
    """Train one epoch; per step the difference of ``clock()`` read at its end and at the
    previous step's end (tuples: field by field), the first SKIP left out."""
    import torch

    ends = []
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if profiler is not None:
            profiler.step()
        ends.append(clock())
    if ends and isinstance(ends[0], tuple):
        return [tuple(q - p for p, q in zip(a, b)) for a, b in zip(ends, ends[1:])][SKIP - 1:]
    return [b - a for a, b in zip(ends, ends[1:])][SKIP - 1:]


class HooksOnly:
    """A disabled Monitor that says it is enabled: ``instrument()`` installs its hooks and
    runs them, and every Monitor call they make is a no-op (a disabled Monitor of its own
    makes ``instrument()`` stand aside). What the hooks alone cost."""

    enabled = True

    def __init__(self) -> None:
        from profstream.producers.monitor import Monitor

        self._off = Monitor(enabled=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._off, name)


def run_block(variant: str, loop: tuple[Any, Any, Any], monitors: dict[str, Any], stats: dict,
              compiled_walk: bool = True) -> list[float]:
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
    handle = pst.instrument(model, optimizer, loader, monitor=monitors[variant], capture_ops=capture,
                            compiled_walk=compiled_walk)
    try:
        return run_steps(model, optimizer, loader)
    finally:
        handle.close(timeout=30)
        if handle.capture is not None:
            stats["ops_sent"] = stats.get("ops_sent", 0) + handle.capture.ops_sent
            stats["steps_captured"] = stats.get("steps_captured", 0) + handle.capture.steps_captured
            stats["steps_compiled"] = stats.get("steps_compiled", 0) + handle.capture.steps_compiled
        if handle.error is not None:
            stats.setdefault("errors", []).append(repr(handle.error))


def hook_cost_us(loops: int = 5000) -> float:
    """Wall time the hooks add to one step of an empty loop (a 1-sample DataLoader batch,
    an identity module, an optimizer over one scalar), feeding ``HooksOnly``: the
    instrumentation's own per-step cost, best of 3."""
    import torch

    import profstream.torch as pst

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
    with pst.instrument(model, optimizer, loader, monitor=HooksOnly(), capture_ops=False):
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


PLACES = ("none", "training_thread", "training_thread_compiled", "worker", "worker_pure_python", "worker_gil_free",
          "worker_switch_100us")


class _Worker:
    """A thread that runs ``work`` on each trace handed to it, timing its CPU; the trace
    is then freed on this thread, as a converting worker would."""

    def __init__(self, work: Callable[[Any], Any]) -> None:
        self.work, self.cpu_s, self.items = work, 0.0, 0
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while (item := self.queue.get()) is not None:
            c0 = time.thread_time()
            self.work(item)
            self.cpu_s += time.thread_time() - c0
            self.items += 1
            del item


def _training_clock() -> tuple[float, float, float]:
    """Wall time, the calling thread's CPU time and its wait on the run queue, in seconds."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        run_delay_ns = int(f.read().split()[1])
    return time.perf_counter(), time.thread_time(), run_delay_ns / 1e9


def conversion_places(loop: tuple[Any, Any, Any], rounds: int) -> dict[str, Any]:
    """Where the conversion of a captured step can run, and what the training thread pays.

    The loop runs under torch.profiler (every step its own cycle); each step's trace is
    left alone (``none``), converted in the profiler's callback on the training thread
    (``training_thread``: the Python walk; ``training_thread_compiled``: the compiled
    walk, what a CPU-only run does once it is built), converted on a worker thread
    (``worker``), or the worker spends as much CPU in pure Python (``worker_pure_python``:
    holds the GIL) or hashing (``worker_gil_free``: the GIL released); and the worker
    under ``sys.setswitchinterval(1e-4)`` (``worker_switch_100us``; 5 ms is the default).
    The conversion elsewhere is ``tree_op_columns``. Per training step, means: wall, the
    training thread's CPU, its wait for a core (run queue, /proc/self/task/TID/schedstat) and the
    rest, blocked: neither running nor runnable, waiting for the GIL."""
    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    from profstream.integrations import torch_native
    from profstream.integrations.torch_ops import (
        HostThreads,
        NodeNames,
        native_op_columns,
        tree_op_columns,
    )

    torch_native.start()
    if not torch_native.wait(900) or torch_native.walker() is None:
        raise SystemExit(f"the compiled walk is unavailable: {torch_native.status()[1]}")

    names = NodeNames()  # kept from step to step, as OpCapture keeps it

    def convert(results: Any) -> None:
        tree_op_columns(results.experimental_event_tree(), 0, HostThreads(), None, names)

    burn_s = [0.0]  # CPU of one conversion on the worker, measured in the warm-up

    def pure_python(_results: Any) -> None:
        end = time.thread_time() + burn_s[0]
        while time.thread_time() < end:
            pass

    buffer = bytes(1 << 16)

    def gil_free(_results: Any) -> None:
        end = time.thread_time() + burn_s[0]
        while time.thread_time() < end:
            hashlib.sha256(buffer).digest()  # releases the GIL (inputs over 2 KiB)

    workers = {"worker": _Worker(convert), "worker_switch_100us": _Worker(convert),
               "worker_pure_python": _Worker(pure_python), "worker_gil_free": _Worker(gil_free)}
    def compiled(results: Any) -> None:
        native_op_columns(torch_native.walker(), results, 0, HostThreads(), None, names)

    training_cpu = {"training_thread": [0.0, 0], "training_thread_compiled": [0.0, 0]}

    def in_place(place: str, work: Callable[[Any], Any], results: Any) -> None:
        c0 = time.thread_time()
        work(results)
        training_cpu[place][0] += time.thread_time() - c0
        training_cpu[place][1] += 1

    def block(place: str) -> list[tuple[float, float, float]]:
        if place == "none":
            on_trace_ready: Callable[[Any], Any] = lambda _prof: None  # noqa: E731
        elif place == "training_thread":
            on_trace_ready = lambda prof: in_place(place, convert, prof.profiler.kineto_results)  # noqa: E731
        elif place == "training_thread_compiled":
            on_trace_ready = lambda prof: in_place(place, compiled, prof.profiler.kineto_results)  # noqa: E731
        else:
            worker = workers[place]
            on_trace_ready = lambda prof: worker.queue.put(prof.profiler.kineto_results)  # noqa: E731
        interval = sys.getswitchinterval()
        if place == "worker_switch_100us":
            sys.setswitchinterval(1e-4)
        prof = profile(activities=[ProfilerActivity.CPU], schedule=lambda _step: ProfilerAction.RECORD_AND_SAVE,
                       on_trace_ready=on_trace_ready)
        prof.start()
        try:
            return run_steps(*loop, prof, clock=_training_clock)
        finally:
            prof.stop()
            sys.setswitchinterval(interval)

    for place in PLACES:  # warm-up; the worker's conversion CPU sets the burn of the two controls
        block(place)
        if place == "worker":
            burn_s[0] = workers["worker"].cpu_s / max(workers["worker"].items, 1)
    for w in workers.values():
        w.cpu_s, w.items = 0.0, 0
    for totals in training_cpu.values():
        totals[:] = [0.0, 0]
    steps: dict[str, list[tuple[float, float, float]]] = {p: [] for p in PLACES}
    for i in range(rounds):
        k = i % len(PLACES)
        for place in PLACES[k:] + PLACES[:k]:
            steps[place] += block(place)
    out: dict[str, Any] = {}
    for place in PLACES:
        wall, cpu, run_queue = (statistics.fmean(col) * 1e3 for col in zip(*steps[place]))
        worker = workers.get(place)
        out[place] = {"steps": len(steps[place]), "mean_wall_ms": wall, "training_cpu_ms": cpu,
                      "run_queue_ms": run_queue, "blocked_ms": wall - cpu - run_queue,
                      "median_wall_ms": statistics.median(s[0] for s in steps[place]) * 1e3,
                      "conversion_cpu_ms": (worker.cpu_s / max(worker.items, 1) * 1e3 if worker is not None
                                            else training_cpu[place][0] / max(training_cpu[place][1], 1) * 1e3
                                            if place in training_cpu else 0.0)}
    for place in PLACES:
        out[place]["wall_over_none_ms"] = out[place]["mean_wall_ms"] - out["none"]["mean_wall_ms"]
    for w in workers.values():
        w.queue.put(None)
    return out


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
    parser.add_argument("--no-compiled-walk", dest="compiled_walk", action="store_false",
                        help="op capture reads traces with the Python walk only")
    parser.add_argument("--places", action="store_true",
                        help="measure where the conversion can run instead (no broker); --repeats x 4 rounds")
    parser.add_argument("--cpu-hog", action="store_true", help="a second CPU-bound process runs beside the loop")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of " + ",".join(VARIANTS) + " (default: all): fewer variants "
                             "give each more steps in the same time; a figure needs its baseline too")
    args = parser.parse_args()
    picked = chosen(parser, args.variants, VARIANTS, "variant")
    args.variants = tuple(v for v in VARIANTS if v in picked)
    with cpu_hog(args.cpu_hog):
        measure(args)


def measure(args: argparse.Namespace) -> None:

    import torch

    from profstream.integrations import torch_native
    from profstream.producers.monitor import Monitor

    torch.set_num_threads(args.threads)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # read when kineto starts: no lines per cycle, any variant
    if args.places:
        emit(envelope("torch_conversion_places", args,
                      {"places": conversion_places(make_loop(args.block, args.batch, args.hidden), args.repeats * 4)}))
        return
    if args.compiled_walk:  # built (or found built) before measuring, as in a run after the first
        torch_native.start()
        torch_native.wait(900)
    bootstrap = broker_bootstrap(args.bootstrap)
    prefix = unique_prefix()
    options = {"bootstrap": bootstrap, "topic_prefix": prefix, "host_sample_interval_s": 0,
               "batch_interval_ms": args.batch_interval_ms}
    monitors = {"disabled": HooksOnly()}  # only the Monitors measured: each has threads of its own
    if "instrumented" in args.variants:
        monitors["instrumented"] = Monitor(run_id="bench-instrumented", **options)
    if "instrumented_capture" in args.variants:
        monitors["instrumented_capture"] = Monitor(run_id="bench-capture", auto_watermark=False, **options)
    loop = make_loop(args.block, args.batch, args.hidden)
    rounds = math.ceil(args.steps / (args.block - SKIP))
    variants = args.variants
    per_repeat: dict[str, list[float]] = {v: [] for v in variants}
    cpu_per_repeat: dict[str, list[float]] = {v: [] for v in variants}
    stats: dict[str, Any] = {}
    try:
        for variant in variants:  # warm-up: allocator, kineto's first start, the broker connection
            run_block(variant, loop, monitors, {}, args.compiled_walk)
        for r in range(args.repeats):
            times: dict[str, list[float]] = {v: [] for v in variants}
            cpu = dict.fromkeys(variants, 0.0)
            for i in range(rounds):
                k = i % len(variants)
                for variant in variants[k:] + variants[:k]:
                    c0 = time.process_time()
                    times[variant] += run_block(variant, loop, monitors, stats, args.compiled_walk)
                    cpu[variant] += time.process_time() - c0
            for v in variants:
                per_repeat[v].append(statistics.median(times[v]))
                cpu_per_repeat[v].append(cpu[v] / (rounds * args.block))
            note(f"repeat {r}: " + ", ".join(f"{v} {per_repeat[v][-1] * 1e3:.2f} ms ({len(times[v])} steps)"
                                             for v in variants))
        stats["dropped_ops"] = sum(m.stats()["dropped_ops"] for m in monitors.values())
        stats["compiled_walk"] = "/".join(filter(None, torch_native.status()))
        stats["recording"] = getattr(monitors.get("instrumented", monitors["disabled"]), "recording", "python")
        context = {"hook_cost_us_per_step": hook_cost_us(),
                   "monitor_alone_cpu_ms_per_20ms_step": monitor_cpu_ms_per_step(options)}
    finally:
        for m in monitors.values():
            m.close(timeout=30)
        drop_topics(bootstrap, prefix)

    def overhead(variant: str, base: str, source: dict = per_repeat) -> list[float]:
        return [a / b - 1 for a, b in zip(source[variant], source[base])]

    pairs = {"instrumented": "plain", "hooks_only": "plain", "instrumented_capture": "plain_profiler",
             "profiler_alone": ("plain_profiler", "plain")}
    figures, cpu_figures = {}, {}
    for name, base in pairs.items():
        variant, base = base if isinstance(base, tuple) else (name, base)
        if variant in variants and base in variants:
            figures[name] = summary(overhead(variant, base))
            if name != "profiler_alone":
                cpu_figures[name] = summary(overhead(variant, base, cpu_per_repeat))
    emit(envelope("torch_overhead", args, {
        "median_step_ms": {v: summary([t * 1e3 for t in per_repeat[v]]) for v in variants},
        "cpu_ms_per_step": {v: summary([t * 1e3 for t in cpu_per_repeat[v]]) for v in variants},
        "steps_per_variant_and_repeat": rounds * (args.block - SKIP),
        "overhead": figures,
        "cpu_overhead": cpu_figures,
        "target": TARGETS,
        "meets_target": {k: figures[k]["median"] <= t for k, t in TARGETS.items() if k in figures},
        "capture": stats,
        "context": context,
    }))


if __name__ == "__main__":
    main()
