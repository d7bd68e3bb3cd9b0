"""The throughput counter tracks of a step in the timeline files: at the start of the step's
window, its tokens/s and samples/s (``throughput``), its achieved TFLOP/s, per op category
too where its ops were captured (``achieved TFLOP/s``), and its MFU in percent (``MFU``).
A step without work figures adds no point: the track keeps the last measured value."""

from __future__ import annotations

from profstream.processors.model import StepEvents
from profstream.processors.throughput import work_figures
from profstream.processors.window import Window


def work_counter_events(ev: StepEvents, pid: int, window: Window, step_time_ns: int) -> list[tuple[dict, int]]:
    """(counter event without ts, ts_ns) of the step's work figures, none without them."""
    work = work_figures(ev, step_time_ns, window)
    if work is None:
        return []
    out: list[tuple[dict, int]] = []
    ts = window.start_ns
    rates = {name: work[key] for name, key in (("tokens/s", "tokens_per_s"), ("samples/s", "samples_per_s"))
             if work[key] is not None}
    if rates:
        out.append(({"ph": "C", "name": "throughput", "pid": pid, "args": rates}, ts))
    if work["flops_per_s"] is not None:
        achieved = {"model": work["flops_per_s"] / 1e12}
        achieved.update((c["category"], c["flops_per_s"] / 1e12) for c in work["op_categories"]
                        if c["flops_per_s"] is not None)
        out.append(({"ph": "C", "name": "achieved TFLOP/s", "pid": pid, "args": achieved}, ts))
    if work["mfu"] is not None:
        out.append(({"ph": "C", "name": "MFU", "pid": pid, "args": {"MFU %": work["mfu"] * 100}}, ts))
    return out
