"""Host figures of one step: the machine's CPU, the training process's CPU and memory, and
the data loader's workers, from the readings taken in the step's host window [S, E].

Host readings (EventBatch ``host_samples``: CPU shares of the whole machine, the process's
CPU of one core, its RSS) and data-loader readings (v8 ``loader_samples``: per worker its CPU
and the share of the time it wanted a CPU, the batches it handed to the loop; per machine
its context switches) come every ``host_sample_interval_s`` (1 s by default): a step shorter
than that may have none, and then has no host figures (null), as device counters do. A
value no reading had is null, never 0.
"""

from __future__ import annotations

from operator import itemgetter

from profstream import compiled
from profstream.processors.model import StepEvents
from profstream.schema.batch import HOST_COLUMNS, LOADER_COLUMNS, MACHINE
from profstream.schema.wire_columns import WireColumns, row_count

# A step has a few readings (one a second): the figures are computed in one pass, by the
# compiled kernel where it is built (``host_figures`` of csrc/kernels.cpp, the same floats
# summed in the same order), else over Python lists, about 9 us a step timed alone, where
# numpy's per-call overhead on so few values took 37 (benchmarks.md, issue #34).

_LOADER = ("worker", "cpu", "runnable", "interval_s", "batches", "ctx_switches_per_s", "cpu_count")
# the kernel's columns (the loader's in _LOADER's order), taken from a decoded batch's
# WireColumns as the wire's bytes
_HOST_KERNEL = ("cpu_user", "cpu_system", "cpu_iowait", "cpu_idle", "process_cpu", "rss_bytes")
_HOST_WIRE = itemgetter(*(next(i for i, (c, _) in enumerate(HOST_COLUMNS) if c == col) for col in _HOST_KERNEL))
_LOADER_WIRE = itemgetter(*(next(i for i, (c, _) in enumerate(LOADER_COLUMNS) if c == col) for col in _LOADER))
_NO_WIRE = {_HOST_WIRE: (b"",) * len(_HOST_KERNEL), _LOADER_WIRE: (b"",) * len(_LOADER)}


def _wire(cols, rows: int, columns: itemgetter) -> tuple[bytes, ...] | None:
    """The wire's bytes of the kernel's ``columns`` (empty ones for a section without rows),
    or None where they are arrays (selected from a batch, joined from several, built in memory)."""
    if type(cols) is WireColumns:
        return columns(cols.raw)
    return None if rows else _NO_WIRE[columns]


def _mean(values: list[float]) -> float | None:
    known = [v for v in values if v == v]  # NaN: not measured
    return sum(known) / len(known) if known else None


def _max(values: list[float]) -> float | None:
    known = [v for v in values if v == v]
    return max(known) if known else None


def _worker(worker: int, readings: int, batches: int, busy_s: float, cpu_s: float) -> dict:
    """One worker's figures (StepMetrics v9 ``WorkerFigures``): per batch only where it counted
    some (``batches`` -1: none of its readings counted)."""
    made = batches > 0
    return {"worker": worker, "readings": readings, "batches": batches if batches >= 0 else None,
            "s_per_batch": busy_s / batches if made else None,
            "cpu_s_per_batch": cpu_s / batches if made and cpu_s == cpu_s else None}


def host_figures(ev: StepEvents) -> dict | None:
    """StepMetrics ``resources`` of a closed step (None: no reading in it)."""
    h, lo = ev.host_samples, ev.loader_samples
    readings = row_count(h)
    loader_rows = row_count(lo)
    if not readings and not loader_rows:
        return None
    if compiled.NATIVE is not None:
        wire_h, wire_lo = _wire(h, readings, _HOST_WIRE), _wire(lo, loader_rows, _LOADER_WIRE)
        if wire_h is not None and wire_lo is not None:  # as decoded: the kernel reads the wire's bytes
            got = compiled.NATIVE.host_figures(*wire_h, *wire_lo, True)
        else:
            got = compiled.NATIVE.host_figures(*(h[c] for c in _HOST_KERNEL), *(lo[c] for c in _LOADER))
        if got is not None:  # None: a column of another type
            return got
    each: dict[int, list] = {}  # worker -> [readings, batches or -1, seconds, CPU seconds or NaN]
    worker_cpu: list[float] = []
    worker_runnable: list[float] = []
    switches: list[float] = []
    counts: list[int] = []
    total = 0  # batches of the workers that counted theirs (batches >= 0)
    counted = 0
    busy_s = 0  # their readings' intervals, summed
    cpu_s: list[float] = []  # their CPU seconds where known
    for worker, cpu, runnable, interval, batches, ctx, count in zip(*(lo[c].tolist() for c in _LOADER)):
        if worker == MACHINE:
            switches.append(ctx)
            counts.append(count)
            continue
        own = each.get(worker)
        if own is None:
            own = each[worker] = [0, -1, 0.0, 0.0]
        own[0] += 1
        worker_cpu.append(cpu)
        worker_runnable.append(runnable)
        if batches >= 0:
            counted += 1
            total += batches
            busy_s += interval
            own[1] = max(own[1], 0) + batches
            own[2] += interval
            cpu = cpu * interval
            own[3] += cpu  # NaN once a reading's CPU time is unknown
            if cpu == cpu:
                cpu_s.append(cpu)
    produced = counted and total > 0
    rss = [x for x in h["rss_bytes"].tolist() if x > 0]
    count = max(counts) if counts else -1
    return {
        "readings": readings,
        "cpu_user": _mean(h["cpu_user"].tolist()), "cpu_system": _mean(h["cpu_system"].tolist()),
        "cpu_iowait": _mean(h["cpu_iowait"].tolist()), "cpu_idle": _mean(h["cpu_idle"].tolist()),
        "process_cpu": _mean(h["process_cpu"].tolist()), "rss_bytes": max(rss) if rss else None,
        "loader_readings": len(worker_cpu),
        "workers": len(each),
        "worker_cpu_mean": _mean(worker_cpu), "worker_cpu_max": _max(worker_cpu),
        "worker_runnable_mean": _mean(worker_runnable), "worker_runnable_max": _max(worker_runnable),
        "worker_batches": total if counted else None,
        # a worker makes its batches one at a time: its seconds (and CPU seconds) per batch
        "worker_s_per_batch": busy_s / total if produced else None,
        "worker_cpu_s_per_batch": sum(cpu_s) / total if produced and cpu_s else None,
        "per_worker": [_worker(w, *each[w]) for w in sorted(each)],
        "ctx_switches_per_s": _mean(switches),
        "cpu_count": int(count) if count > 0 else None,
    }
