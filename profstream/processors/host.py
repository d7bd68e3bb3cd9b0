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

import numpy as np

from profstream.processors.model import StepEvents
from profstream.schema.batch import MACHINE


def _mean(values: np.ndarray) -> float | None:
    known = values[values == values]
    return float(known.mean()) if len(known) else None


def _max(values: np.ndarray) -> float | None:
    known = values[values == values]
    return float(known.max()) if len(known) else None


def host_figures(ev: StepEvents) -> dict | None:
    """StepMetrics ``resources`` of a closed step (None: no reading in it)."""
    h, lo = ev.host_samples, ev.loader_samples
    if not len(h["ts_ns"]) and not len(lo["ts_ns"]):
        return None
    workers = lo["worker"] != MACHINE
    machine = ~workers
    batches = lo["batches"][workers]
    known = batches >= 0
    total = int(batches[known].sum()) if known.any() else None
    seconds = lo["interval_s"][workers][known]
    cpu_s = (lo["cpu"][workers] * lo["interval_s"][workers])[known]
    produced = total is not None and total > 0
    cpu_known = cpu_s[cpu_s == cpu_s]
    rss = h["rss_bytes"][h["rss_bytes"] > 0]
    return {
        "readings": int(len(h["ts_ns"])),
        "cpu_user": _mean(h["cpu_user"]), "cpu_system": _mean(h["cpu_system"]),
        "cpu_iowait": _mean(h["cpu_iowait"]), "cpu_idle": _mean(h["cpu_idle"]),
        "process_cpu": _mean(h["process_cpu"]), "rss_bytes": int(rss.max()) if len(rss) else None,
        "loader_readings": int(workers.sum()),
        "workers": int(len(np.unique(lo["worker"][workers]))),
        "worker_cpu_mean": _mean(lo["cpu"][workers]), "worker_cpu_max": _max(lo["cpu"][workers]),
        "worker_runnable_mean": _mean(lo["runnable"][workers]), "worker_runnable_max": _max(lo["runnable"][workers]),
        "worker_batches": total,
        # a worker makes its batches one at a time: its seconds (and CPU seconds) per batch
        "worker_s_per_batch": float(seconds.sum()) / total if produced else None,
        "worker_cpu_s_per_batch": float(cpu_known.sum()) / total if produced and len(cpu_known) else None,
        "ctx_switches_per_s": _mean(lo["ctx_switches_per_s"][machine]),
        "cpu_count": int(lo["cpu_count"][machine].max()) if machine.any() and lo["cpu_count"][machine].max() > 0
        else None,
    }
