"""CPU that profstream adds to each training step, thread by thread (issue #19).

bench_torch_overhead's loop (a CPU MLP, ~20 ms steps, one torch thread) runs ``--steps``
steps under ``instrument()`` with op capture off and a real Monitor on a real broker, with
the Monitor's defaults (host samples once a second, the control reader on). Per step:

- ``hooks_us``: wall time inside profstream's code on the training thread (the loader
  wrapper's calls and the forward/optimizer hooks, each timed around its call; torch's
  dispatch to them is not in it: ``hook_cost_us`` of bench_torch_overhead has it), and
  ``hooks_by_entry_us`` the same per entry point (``before_batch`` ends the step: the
  memory sample and the step's mark; ``after_batch`` begins the next one);
- for each of the process's other threads (the Monitor's sender, the control reader,
  librdkafka's threads), the CPU it used (``/proc/self/task/TID/schedstat``) and how often it
  woke (voluntary context switches): on a box with no idle core every microsecond of it,
  and each wake-up's switch, is taken from the loop or from the process beside it;
- the training thread's own wait for a core (run queue) and involuntary switches;
- ``broker_us``: the CPU the broker used per step (only when this benchmark watches it: the
  local stack's broker, or ``--broker-pid``). A broker on the same box, as here, competes
  with the loop too; a deployed one runs elsewhere.

``--monitor-off``: the same loop under ``instrument()`` with a disabled Monitor (which
installs no hooks: the loop as without profstream): the baseline for the run-queue wait and
the broker's CPU, which the box's other work makes non-zero.

``total_us`` = hooks + the other threads' CPU: what the Monitor can take from a step when
no core is idle, as a share of the median step (``total_share``). That bound is what
bench_torch_overhead's wall-time medians cannot resolve to 0.5 % on a shared 2-core box
(their single repeats spread by ±5 %). ``--cpu-hog``: a second CPU-bound process beside
it. Linux only (``/proc``). Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
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
    schedstat,
    thread_cpu,
    thread_switches,
    unique_prefix,
    wait_connected,
)
from bench_processor_scaleout import cpu_seconds
from bench_torch_overhead import make_loop

HOOKS = ("before_batch", "after_batch", "_forward_pre_hook", "_optimizer_pre_hook", "_optimizer_post_hook")


def timed_hooks(spent: dict[str, int]) -> list[tuple[Any, str, Any]]:
    """Wrap profstream's training-thread entry points so that their wall time adds to
    ``spent[name]`` (ns); returns what to restore."""
    from profstream.integrations import torch as pst_torch
    from profstream.integrations import torch_sources

    def timed(fn: Any, name: str) -> Any:
        spent[name] = 0

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter_ns() - t0
        return wrapper

    restore = []
    cls = pst_torch.TorchInstrumentation
    for name in HOOKS:
        restore.append((cls, name, getattr(cls, name)))
        setattr(cls, name, timed(getattr(cls, name), name))
    restore.append((torch_sources, "waiting_batches", torch_sources.waiting_batches))
    torch_sources.waiting_batches = timed(torch_sources.waiting_batches, "waiting_batches")
    return restore


def group_of(tid: int, comm: str, names: dict[int, str]) -> str:
    """The thread's role: the Monitor's sender, the control reader, librdkafka, or other."""
    name = names.get(tid, "")
    if name.startswith("profstream-sender"):
        return "sender"
    if name.startswith("profstream-control"):
        return "control_reader"
    if comm.startswith("rdk:"):
        return "librdkafka"
    return f"other:{name or comm}"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import profstream.torch as pst
    from profstream.producers.monitor import Monitor
    from profstream.stack import stack_up

    torch.set_num_threads(1)
    if args.bootstrap:  # a given broker is not ours to watch, unless --broker-pid names it
        bootstrap = broker_bootstrap(args.bootstrap)
        args.broker_pid = -1 if args.broker_pid is None else args.broker_pid
    else:
        stack = stack_up()
        bootstrap = stack.bootstrap
        args.broker_pid = stack.pid if args.broker_pid is None else args.broker_pid
    prefix = unique_prefix()
    options = {} if args.batch_interval_ms is None else {"batch_interval_ms": args.batch_interval_ms}
    monitor = Monitor(run_id="bench-step-cpu", bootstrap=bootstrap, topic_prefix=prefix,
                      enabled=not args.monitor_off, **options)
    model, optimizer, loader = make_loop(args.block, 64, 1024)
    spent: dict[str, int] = {}
    restore = timed_hooks(spent)
    main = threading.get_native_id()
    try:
        wait_connected(monitor, bootstrap)
        handle = pst.instrument(model, optimizer, loader, monitor=monitor, capture_ops=False)
        steps: list[float] = []

        def epoch(record: bool) -> None:
            last = time.perf_counter()
            for x, y in loader:
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                now = time.perf_counter()
                if record:
                    steps.append(now - last)
                last = now

        for _ in range(3):  # warm-up: allocator, caches, the first batches sent
            epoch(False)
        spent.update(dict.fromkeys(spent, 0))
        before = {tid: (comm, cpu, thread_switches(tid)) for tid, (comm, cpu) in thread_cpu().items()}
        main_wait0 = schedstat(main)[1]
        broker0 = cpu_seconds(args.broker_pid)
        while len(steps) < args.steps:
            epoch(True)
        after = {tid: (comm, cpu, thread_switches(tid)) for tid, (comm, cpu) in thread_cpu().items()}
        main_wait = schedstat(main)[1] - main_wait0
        broker_cpu = cpu_seconds(args.broker_pid) - broker0
        names = {t.native_id: t.name for t in threading.enumerate()}  # while they run
        handle.close(timeout=30)
        stats = monitor.stats()
    finally:
        for owner, name, value in restore:
            setattr(owner, name, value)
        monitor.close(timeout=30)
        drop_topics(bootstrap, prefix)
    n = len(steps)
    groups: dict[str, dict[str, float]] = {}
    for tid, (comm, cpu, (vol, _inv)) in after.items():
        if tid == main:
            continue
        comm0, cpu0, (vol0, _) = before.get(tid, (comm, 0, (0, 0)))
        g = groups.setdefault(group_of(tid, comm, names), {"cpu_us": 0.0, "wakeups": 0.0})
        g["cpu_us"] += (cpu - cpu0) / n / 1e3
        g["wakeups"] += (vol - vol0) / n
    threads_us = sum(g["cpu_us"] for g in groups.values())
    hooks_us = sum(spent.values()) / n / 1e3
    step_ms = statistics.median(steps) * 1e3
    vol, inv = (a - b for a, b in zip(after[main][2], before[main][2]))
    return {
        "steps": n,
        "median_step_ms": step_ms,
        "hooks_us": hooks_us,
        "hooks_by_entry_us": {k: round(v / n / 1e3, 2) for k, v in spent.items()},
        "threads": {k: {"cpu_us": round(v["cpu_us"], 2), "wakeups": round(v["wakeups"], 3)}
                    for k, v in sorted(groups.items())},
        "threads_us": threads_us,
        "total_us": hooks_us + threads_us,
        "total_share": (hooks_us + threads_us) / (step_ms * 1e3),
        "training_thread": {"run_queue_us": main_wait / n / 1e3, "voluntary_switches": vol / n,
                            "involuntary_switches": inv / n},
        "broker_us": None if math.isnan(broker_cpu) else broker_cpu / n * 1e6,
        "monitor": "off" if args.monitor_off else "on",
        "recording": stats.get("recording"),
        "batches_sent_per_step": stats.get("batches_sent", 0) / max(n, 1),
        "dropped": stats.get("dropped_ops", 0) + stats.get("dropped_samples", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default=os.environ.get("PROFSTREAM_TEST_BOOTSTRAP"),
                        help="Kafka broker (default: $PROFSTREAM_TEST_BOOTSTRAP, else the local stack)")
    parser.add_argument("--steps", type=int, default=1000, help="steps measured (after 3 epochs of warm-up)")
    parser.add_argument("--block", type=int, default=25, help="steps per epoch of the loader")
    parser.add_argument("--batch-interval-ms", type=float, default=None,
                        help="the Monitor's batch_interval_ms (default: its default, 50)")
    parser.add_argument("--cpu-hog", action="store_true", help="a second CPU-bound process runs beside the loop")
    parser.add_argument("--monitor-off", action="store_true",
                        help="the baseline: a disabled Monitor (instrument() installs no hooks, nothing is sent)")
    parser.add_argument("--broker-pid", type=int, default=None,
                        help="the broker's pid, for its CPU per step (default: the local stack's when no "
                             "--bootstrap is given, else not watched)")
    args = parser.parse_args()
    with cpu_hog(args.cpu_hog):
        result = measure(args)
    note(f"{result['total_us']:.0f} us a step ({100 * result['total_share']:.2f} % of {result['median_step_ms']:.1f} ms): "
         f"hooks {result['hooks_us']:.0f} us, threads {result['threads']}")
    emit(envelope("step_cpu", args, result))


if __name__ == "__main__":
    main()
