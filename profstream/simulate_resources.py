"""The simulator's host and data-loader readings, and the signatures of what starves a rank,
with the advice each must get (processors/advice.py): the ground truth of the advice tests.

A step of a run with ``resources`` on gets one host reading and one data-loader reading (two
workers and the machine) at its middle, and a sample of the loader's host queue
(``dataloader``, capacity 8) at its start. On the stalled steps (``stall``) the ``loader_fault``
sets what the profilers would see:

- ``cpu_bound``: the workers want a CPU all the time, the host queue is empty: more workers;
- ``input_io``: the workers mostly sleep, the machine's iowait is high, the host queue is
  empty: the input's reads;
- ``transfer``: the host queue is full while the step waits for its input: the transfer;
- ``threads``: the kernel takes 45 % of the CPU with 10,000 context switches a second per CPU:
  too many threads.

A stalled step without a fault has an empty host queue and workers neither busy nor idle:
no rule can say why, and it gets no advice. ``comm_tail`` steps run their all-reduce after backward, unhidden, a third of the step
(simulate.py lays it out): the tail is communication.
"""

from __future__ import annotations

from dataclasses import dataclass

LOADER_QUEUE = "dataloader"
LOADER_CAPACITY = 8
WORKERS = 2
CPU_COUNT = 8
FAULTS = ("cpu_bound", "input_io", "transfer", "threads")
ADVICE = {"cpu_bound": "more_workers", "input_io": "input_io", "transfer": "transfer", "threads": "threads"}


@dataclass(frozen=True)
class Readings:
    host: tuple[float, float, float, float, float, int]  # user, system, idle, iowait, process CPU, RSS
    worker_cpu: float
    worker_runnable: float
    worker_batches: int
    ctx_switches_per_s: float
    queue_at_start: int


HEALTHY = Readings((0.35, 0.05, 0.59, 0.01, 1.1, 3 << 30), 0.40, 0.45, 2, 4000.0, 6)
FAULTY = {
    "cpu_bound": Readings((0.55, 0.04, 0.40, 0.01, 1.0, 3 << 30), 0.97, 1.0, 1, 4000.0, 0),
    "input_io": Readings((0.10, 0.04, 0.61, 0.25, 0.9, 3 << 30), 0.05, 0.07, 1, 3000.0, 0),
    "transfer": Readings((0.30, 0.05, 0.64, 0.01, 1.2, 3 << 30), 0.30, 0.35, 2, 4000.0, LOADER_CAPACITY),
    "threads": Readings((0.30, 0.45, 0.24, 0.01, 1.0, 3 << 30), 0.60, 0.65, 1, 80000.0, 0),
}
# a stalled step without a fault: the host queue empty, the workers neither busy nor idle,
# nothing unusual on the machine: the figures do not say why, and no advice is given
UNEXPLAINED = Readings((0.40, 0.05, 0.54, 0.01, 1.0, 3 << 30), 0.60, 0.65, 1, 4000.0, 0)
INTERVAL_S = 1.0


def readings(fault: str | None, stalled: bool) -> Readings:
    if not stalled:
        return HEALTHY
    return FAULTY[fault] if fault is not None else UNEXPLAINED


def resources_truth(r: Readings) -> dict:
    """StepMetrics ``resources`` of a step with one reading of each, by direct arithmetic."""
    user, system, idle, iowait, process, rss = r.host
    batches = WORKERS * r.worker_batches
    return {"readings": 1, "cpu_user": user, "cpu_system": system, "cpu_iowait": iowait, "cpu_idle": idle,
            "process_cpu": process, "rss_bytes": rss, "loader_readings": WORKERS, "workers": WORKERS,
            "worker_cpu_mean": r.worker_cpu, "worker_cpu_max": r.worker_cpu,
            "worker_runnable_mean": r.worker_runnable, "worker_runnable_max": r.worker_runnable,
            "worker_batches": batches, "worker_s_per_batch": WORKERS * INTERVAL_S / batches,
            "worker_cpu_s_per_batch": WORKERS * r.worker_cpu * INTERVAL_S / batches,
            "per_worker": [{"worker": w, "readings": 1, "batches": r.worker_batches,
                            "s_per_batch": INTERVAL_S / r.worker_batches,
                            "cpu_s_per_batch": r.worker_cpu * INTERVAL_S / r.worker_batches} for w in range(WORKERS)],
            "ctx_switches_per_s": r.ctx_switches_per_s, "cpu_count": CPU_COUNT}


def record_readings(monitor, r: Readings, ts_ns: int, step: int) -> None:
    """Feed a step's readings into a Monitor, as its samplers would."""
    monitor.host_sample(*r.host, ts_ns=ts_ns)
    for worker in range(WORKERS):
        monitor.loader_sample((worker, 1000 + worker, INTERVAL_S, r.worker_cpu, r.worker_runnable, r.worker_batches,
                               float("nan"), -1), ts_ns=ts_ns, step=step)
    monitor.loader_sample((-1, -1, INTERVAL_S, float("nan"), float("nan"), -1, r.ctx_switches_per_s, CPU_COUNT),
                          ts_ns=ts_ns, step=step)
