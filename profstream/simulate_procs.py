"""A simulated run of many ranks driven from several producer processes (``simulate --procs``).

One process cannot record and encode the steps of a thousand ranks in real time, so the
ranks are shared out: process i of P runs ranks ``[i*R/P, (i+1)*R/P)``, each with its own
Monitors, through :func:`profstream.simulate.run_simulation`. Every process first opens
its Monitors and says it is ready; then all are given one virtual clock origin, so that
``--rate realtime`` records step s of every rank at the same wall time whichever process
runs it. A rank's plans depend only on (seed, rank, step), so the events are those of the
same run in one process. The results are summed.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from typing import Any

from profstream.producers.shutdown import SIGNAL_FLUSH_S
from profstream.simulate import (
    TERMINATED_CLOSE_S,
    SimConfig,
    SimResult,
    Terminated,
    run_simulation,
    sigterm_ends_the_run,
)

START_MARGIN_S = 0.5  # between "all ready" and the origin, for every process to see the go
READY_TIMEOUT_S = 300.0  # spawning and opening a share of a thousand Monitors on a loaded box


def shares(ranks: int, procs: int) -> list[range]:
    """The ranks of each of ``procs`` processes: contiguous, sizes differing by one at most."""
    if not 1 <= procs <= ranks:
        raise ValueError(f"procs must be between 1 and the number of ranks ({ranks}), got {procs}")
    return [range(i * ranks // procs, (i + 1) * ranks // procs) for i in range(procs)]


def _share(cfg: SimConfig, ranks: range, opts: dict, index: int, counter, go, origin, results,
           shared_producer: bool = False) -> None:
    """One producer process: its share of the ranks, reporting ready, steps done, and the result."""
    def start() -> int:
        results.put(("ready", index, None))
        go.wait()
        return origin.value

    def progress(_plan) -> None:
        with counter.get_lock():
            counter.value += 1

    try:
        results.put(("done", index, run_simulation(cfg, opts, progress, ranks=ranks, start=start,
                                                        shared_producer=shared_producer)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        results.put(("error", index, f"{type(e).__name__}: {e}"))


def run_in_processes(cfg: SimConfig, procs: int, monitor_options: dict | None = None,
                     progress: Callable[[int], Any] | None = None, shared_producer: bool = False) -> SimResult:
    """Simulate ``cfg`` from ``procs`` processes; ``progress(n)`` is told of steps done;
    ``shared_producer``: the Monitors of each process share one producer and thread
    (``run_simulation``'s).

    Raises ``ValueError`` for a ``procs`` outside 1..ranks and ``RuntimeError`` when a
    process fails (the others are stopped)."""
    parts = shares(cfg.ranks, procs)
    ctx = mp.get_context("spawn")  # no librdkafka state inherited through fork
    results = ctx.Queue()
    go = ctx.Event()
    origin = ctx.Value("q", 0, lock=False)
    counters = [ctx.Value("q", 0) for _ in parts]
    workers = [ctx.Process(target=_share, args=(cfg, part, dict(monitor_options or {}), i, counters[i], go,
                                                origin, results, shared_producer), name=f"simulate-{i}", daemon=True)
               for i, part in enumerate(parts)]
    with sigterm_ends_the_run():  # passed on to the processes, which end the run as one does
        for w in workers:
            w.start()
        done: dict[int, SimResult] = {}
        reported = 0
        ended_by = 0
        wall0 = time.monotonic()
        try:
            ready = 0
            while len(done) < len(workers):
                try:
                    kind, index, value = results.get(timeout=0.2)
                except queue.Empty:
                    kind = None
                if kind == "error":
                    raise RuntimeError(f"simulate process {index} (ranks {parts[index].start}-"
                                       f"{parts[index].stop - 1}) failed: {value}")
                if kind == "ready":
                    ready += 1
                    if ready == len(workers):
                        origin.value = (cfg.start_ns if cfg.start_ns is not None
                                        else time.time_ns() + int(START_MARGIN_S * 1e9))
                        wall0 = time.monotonic()
                        go.set()
                elif kind == "done":
                    done[index] = value
                elif not go.is_set() and time.monotonic() - wall0 > READY_TIMEOUT_S:
                    raise RuntimeError(f"only {ready} of {len(workers)} simulate processes were ready after "
                                       f"{READY_TIMEOUT_S:.0f} s")
                dead = [i for i, w in enumerate(workers) if i not in done and w.exitcode not in (None, 0)]
                if dead and kind is None:
                    raise RuntimeError(f"simulate process {dead[0]} ended with exit code {workers[dead[0]].exitcode}")
                if progress is not None:
                    total = sum(c.value for c in counters)
                    if total > reported:
                        progress(total - reported)
                        reported = total
        except KeyboardInterrupt:  # Ctrl-C reached the whole process group: each process flushes and closes
            for w in workers:
                w.join(40)
            raise
        except Terminated as t:  # passed on: each process closes its Monitors and says what it did
            ended_by = t.signum
            _collect_ended(workers, results, done)
        finally:
            for w in workers:
                if w.is_alive():
                    w.terminate()
                w.join(10)
        ordered = [done[i] for i in sorted(done)]
        stats = [s for r in ordered for s in r.stats]
        return SimResult(sum(r.steps_recorded for r in ordered), sum(r.ops_recorded for r in ordered),
                         time.monotonic() - wall0, len(ordered) == len(workers) and all(r.flushed for r in ordered),
                         sum(r.dropped_ops for r in ordered), stats, ended_by)


def _collect_ended(workers: list, results: Any, done: dict[int, SimResult]) -> None:
    """SIGTERM to every process still running, and their results as they come, within the
    time a run told to end gives its Monitors (the processes not heard from are left out)."""
    for w in workers:
        if w.is_alive():
            w.terminate()  # SIGTERM: run_simulation ends the run there as here
    deadline = time.monotonic() + SIGNAL_FLUSH_S + TERMINATED_CLOSE_S + 5.0
    while len(done) < len(workers) and time.monotonic() < deadline:
        try:
            kind, index, value = results.get(timeout=0.2)
        except queue.Empty:
            if not any(w.is_alive() for w in workers):
                return
            continue
        if kind == "done":
            done[index] = value
