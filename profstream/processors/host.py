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

from profstream.processors.model import StepEvents
from profstream.schema.batch import MACHINE

# A step has a few readings (one a second): the figures are computed on Python lists, about
# 10 us a step where numpy's per-call overhead on so few values took 37 (benchmarks.md, issue #34).


def _mean(values: list[float]) -> float | None:
    known = [v for v in values if v == v]  # NaN: not measured
    return sum(known) / len(known) if known else None


def _max(values: list[float]) -> float | None:
    known = [v for v in values if v == v]
    return max(known) if known else None


def host_figures(ev: StepEvents) -> dict | None:
    """StepMetrics ``resources`` of a closed step (None: no reading in it)."""
    h, lo = ev.host_samples, ev.loader_samples
    if not len(h["ts_ns"]) and not len(lo["ts_ns"]):
        return None
    ids = lo["worker"].tolist()
    cpu, runnable, interval = lo["cpu"].tolist(), lo["runnable"].tolist(), lo["interval_s"].tolist()
    batches = lo["batches"].tolist()
    workers = [i for i, w in enumerate(ids) if w != MACHINE]
    machine = [i for i, w in enumerate(ids) if w == MACHINE]
    known = [i for i in workers if batches[i] >= 0]
    total = sum(batches[i] for i in known) if known else None
    produced = total is not None and total > 0
    cpu_s = [cpu[i] * interval[i] for i in known]
    cpu_known = [x for x in cpu_s if x == x]
    rss = [x for x in h["rss_bytes"].tolist() if x > 0]
    cpu_count = lo["cpu_count"].tolist()
    count = max(cpu_count[i] for i in machine) if machine else -1
    worker_cpu, worker_runnable = [cpu[i] for i in workers], [runnable[i] for i in workers]
    ctx = lo["ctx_switches_per_s"].tolist()
    return {
        "readings": len(h["ts_ns"]),
        "cpu_user": _mean(h["cpu_user"].tolist()), "cpu_system": _mean(h["cpu_system"].tolist()),
        "cpu_iowait": _mean(h["cpu_iowait"].tolist()), "cpu_idle": _mean(h["cpu_idle"].tolist()),
        "process_cpu": _mean(h["process_cpu"].tolist()), "rss_bytes": max(rss) if rss else None,
        "loader_readings": len(workers),
        "workers": len({ids[i] for i in workers}),
        "worker_cpu_mean": _mean(worker_cpu), "worker_cpu_max": _max(worker_cpu),
        "worker_runnable_mean": _mean(worker_runnable), "worker_runnable_max": _max(worker_runnable),
        "worker_batches": total,
        # a worker makes its batches one at a time: its seconds (and CPU seconds) per batch
        "worker_s_per_batch": sum(interval[i] for i in known) / total if produced else None,
        "worker_cpu_s_per_batch": sum(cpu_known) / total if produced and cpu_known else None,
        "ctx_switches_per_s": _mean([ctx[i] for i in machine]),
        "cpu_count": int(count) if count > 0 else None,
    }
