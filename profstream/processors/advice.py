"""What to do about a starved step or a long tail: a small rule set, each rule reading a few
figures of the step (and the rank's latest host figures) and naming them, and the profilers'
rule it comes from (MindSpore's data preparation and CPU utilization analysis, Ascend and
GPU, and its step trace: ``seeds/`` of the design).

A starved step (stalls.py) gets at most two lines, in this order: too many threads, the
transfer to the device, more workers (not with too many threads: it would contradict it),
the input's reads; a step whose tail is mostly
communication gets the all-reduce line. A starved step no rule explains gets none: the
figures do not say why. Host figures older than ``HOST_MAX_AGE_NS`` (a reading every second
by default: a short step often has none of its own) are not used.
"""

from __future__ import annotations

import numpy as np

from profstream.processors.model import StepEvents

MAX_LINES = 2
HOST_MAX_AGE_NS = 10 * 10**9  # the rank's latest host figures are used for this long
BUSY_WORKERS = 0.8  # the workers wanted a CPU at least this share of the time: compute-bound
WAITING_WORKERS = 0.5  # below this they mostly wait (reads, the network, sleeps)
HIGH_IOWAIT = 0.10  # of the machine's CPU time
FULL_QUEUE = 0.75  # a host queue at least this full at S (and 2 batches): batches were ready
HIGH_SYSTEM_CPU = 0.30
HIGH_SWITCHES_PER_CORE = 5000.0  # context switches per second and logical CPU
LONG_TAIL = 0.30  # of the step time
COMM_TAIL = 0.50  # pure communication, of the tail

# rule -> the profiler's rule it follows (in our words)
SOURCES = {
    "threads": "MindSpore CPU utilization: high system CPU with many context switches means too many threads; "
               "reduce them",
    "transfer": "MindSpore data preparation: the host queue full while the device queue stays low means sending "
                "data to the device is the bottleneck",
    "more_workers": "MindSpore data preparation: the host queue empty means data processing is too slow; low user "
                    "CPU means more threads can help",
    "input_io": "MindSpore data preparation: the host queue empty means the data pipeline is the bottleneck; its "
                "workers waiting rather than computing point at the reads",
    "tail_allreduce": "MindSpore step trace: a long tail points at all-reduce and the parallel strategy",
}


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _host_queue(ev: StepEvents) -> tuple[str, int, int] | None:
    """(name, size at S, capacity) of the step's host-side queue (the loader's prefetch queue:
    a queue whose name does not say device), None without one."""
    for code, name in enumerate(ev.queue_names):
        if "device" in name:
            continue
        sel = ev.queue == code
        if not sel.any():
            continue
        ts, size, cap = ev.queue_ts_ns[sel], ev.queue_size[sel], ev.queue_capacity[sel]
        before = ts <= ev.start_ns
        at = int(np.flatnonzero(before)[-1]) if before.any() else 0
        capacity = int(cap.max()) if len(cap) else -1
        return name, int(size[at]), capacity
    return None


def step_advice(record: dict, ev: StepEvents, host: dict | None) -> list[dict]:
    """The advice lines of a step (``record``: its StepMetrics figures so far; ``host``: its
    host figures or the rank's latest recent ones)."""
    out: list[dict] = []
    step_ms = record["step_time_ns"] / 1e6
    if record["starved"]:
        out += _starved(record, ev, host, step_ms)
    tail = record["tail_ns"]
    pure = record["pure_comm_ns"]
    if pure is not None and tail >= LONG_TAIL * record["step_time_ns"] > 0 and pure >= COMM_TAIL * tail > 0:
        out.append(_line("tail_allreduce",
                         f"the step's tail ({tail / 1e6:.1f} ms, {_pct(tail / record['step_time_ns'])} of it) is mostly "
                         f"communication not hidden by compute ({pure / 1e6:.1f} ms): overlap gradient all-reduce with "
                         "backward (DDP bucket sizes), then look at the network and at the slowest rank",
                         tail_ms=tail / 1e6, pure_comm_ms=pure / 1e6, step_ms=step_ms))
    return out[:MAX_LINES]


def _starved(record: dict, ev: StepEvents, host: dict | None, step_ms: float) -> list[dict]:
    out = []
    wait_ms = record["data_wait_ns"] / 1e6
    h = host or {}
    system, switches, cores = h.get("cpu_system"), h.get("ctx_switches_per_s"), h.get("cpu_count")
    # a thrashing machine: workers wait for a CPU (runnable, not running), so their being
    # busy does not ask for more of them, which would make it worse: no more_workers line
    thrashing = system is not None and switches is not None and bool(cores) and system >= HIGH_SYSTEM_CPU \
        and switches / cores >= HIGH_SWITCHES_PER_CORE
    if thrashing:
        out.append(_line("threads",
                         f"too many threads: the machine spends {_pct(system)} of its CPU in the kernel with "
                         f"{switches / cores:,.0f} context switches a second per CPU: lower num_workers, and the "
                         "threads each process starts (torch.set_num_threads, OMP_NUM_THREADS in the workers)",
                         cpu_system=system, ctx_switches_per_s_per_cpu=switches / cores, data_wait_ms=wait_ms))
    queue = _host_queue(ev)
    if queue is not None and queue[2] > 0 and queue[1] >= max(2, FULL_QUEUE * queue[2]):
        name, size, capacity = queue
        out.append(_line("transfer",
                         f"batches were ready ({size} of {capacity} in the {name} queue at the step's start) and "
                         f"the step still waited {wait_ms:.1f} ms for its input: moving the batch to the device is "
                         "the limit: pin_memory=True, .to(device, non_blocking=True), or prefetch onto the device",
                         queue_at_start=size, queue_capacity=capacity, data_wait_ms=wait_ms))
    elif queue is None or queue[1] == 0:
        busy = h.get("worker_runnable_mean")
        if busy is None:
            busy = h.get("worker_cpu_mean")
        workers = h.get("workers") or 0
        per_batch = h.get("worker_s_per_batch")
        figures = {"data_wait_ms": wait_ms, "workers": workers}
        if queue is not None:
            figures["queue_at_start"] = 0
        if per_batch is not None:
            figures["worker_s_per_batch"] = per_batch
        each = f"; each makes a batch in {per_batch:.2f} s" if per_batch is not None else ""
        if workers and busy is not None and busy >= BUSY_WORKERS and not thrashing:
            out.append(_line("more_workers",
                             f"raise num_workers: the loader's {workers} worker{'s' if workers > 1 else ''} "
                             f"want{'' if workers > 1 else 's'} a CPU {_pct(busy)} of the time and its queue was "
                             f"empty at the step's start{each}: batches are made slower than the loop takes them "
                             "(or make the transform cheaper)", workers_busy=busy, **figures))
        elif workers and busy is not None and busy < WAITING_WORKERS:
            iowait = h.get("cpu_iowait")
            disk = (f"; the machine's iowait is {_pct(iowait)}: the disk is the limit" if iowait is not None
                    and iowait >= HIGH_IOWAIT else "")
            out.append(_line("input_io",
                             f"the loader's workers mostly wait (they want a CPU {_pct(busy)} of the time) while "
                             f"its queue was empty{each}: reading the data (disk, network) is the limit{disk}; more "
                             "workers or a larger prefetch_factor overlap the waits, faster storage removes them",
                             workers_busy=busy, **({"cpu_iowait": iowait} if iowait is not None else {}), **figures))
    return out


def _line(rule: str, text: str, **figures: float) -> dict:
    return {"rule": rule, "text": text, "source": SOURCES[rule],
            "figures": {k: float(v) for k, v in figures.items()}}

