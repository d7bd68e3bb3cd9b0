"""Send a ``Profile`` through the real ``Monitor``, step by step, as a live producer would.

Per step: begin_step at S, F/B marks, the step's ops in one ``ops()`` call, its queue and
memory samples, end_step at E. With the Monitor's automatic watermark every event of a
step is buffered before its end mark, so the processor closes each step at once.
``pace="realtime"`` spaces steps as far apart as they were in the profile; ``"max"`` goes
as fast as the buffer drains (never dropping: it waits while the buffer is half full).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from profstream.integrations.ingest.model import Profile
from profstream.producers.monitor import Monitor

PACES = ("realtime", "max")
_FILL_LIMIT = 0.5
_CHUNK = 32768
_MEMORY_PER_STEP = 256


@dataclass
class SendResult:
    steps: int
    ops: int
    ops_outside_steps: int
    queue_samples: int
    memory_samples: int
    dropped_ops: int
    flushed: bool
    elapsed_s: float


def send_profile(profile: Profile, monitor: Monitor, pace: str = "max",
                 progress: Callable[[int], None] | None = None, flush_timeout: float = 60.0) -> SendResult:
    if pace not in PACES:
        raise ValueError(f"pace {pace!r}: expected realtime or max")
    t0 = time.monotonic()
    inside = np.flatnonzero(profile.op_step >= 0)
    order = inside[np.argsort(profile.op_step[inside], kind="stable")]
    op_steps = profile.op_step[order]
    names = profile.name_table[profile.op_name[order]]
    types = profile.type_table[profile.op_type[order]]
    kinds, streams = profile.op_kind[order], profile.op_stream[order]
    starts, durs = profile.op_start_ns[order], profile.op_dur_ns[order]
    lo = np.searchsorted(op_steps, profile.step, side="left")
    hi = np.searchsorted(op_steps, profile.step, side="right")

    queues: dict[int, list] = {}
    for sample in profile.queue_samples:
        queues.setdefault(sample[2], []).append(sample)
    mem_in = np.flatnonzero(profile.mem_step >= 0)
    mem_order = mem_in[np.argsort(profile.mem_step[mem_in], kind="stable")]
    mem_steps = profile.mem_step[mem_order]
    mem_lo = np.searchsorted(mem_steps, profile.step, side="left")
    mem_hi = np.searchsorted(mem_steps, profile.step, side="right")

    first_start = int(profile.step_start_ns[0]) if profile.steps else 0
    sent_ops = sent_memory = 0
    for i in range(profile.steps):
        step, start, end = int(profile.step[i]), int(profile.step_start_ns[i]), int(profile.step_end_ns[i])
        if pace == "realtime":
            wait = (start - first_start) / 1e9 - (time.monotonic() - t0)
            if wait > 0:
                time.sleep(wait)
        monitor.begin_step(step, ts_ns=start)
        if profile.step_fp_ns[i] >= 0:
            monitor.mark_fp_start(int(profile.step_fp_ns[i]))
        if profile.step_bp_ns[i] >= 0:
            monitor.mark_bp_end(int(profile.step_bp_ns[i]))
        for a in range(lo[i], hi[i], _CHUNK):  # a huge step in pieces the buffer can hold
            b = min(a + _CHUNK, hi[i])
            _wait_for_room(monitor)
            monitor.ops(names[a:b], starts[a:b], durs[a:b], kinds[a:b], types[a:b], streams[a:b], step=step)
            sent_ops += int(b - a)
        for name, ts, _, size, capacity in queues.get(step, ()):
            monitor.queue(name, size, capacity, ts_ns=ts, step=step)
        picks = _memory_picks(profile, mem_order[mem_lo[i]:mem_hi[i]])
        sent_memory += len(picks)
        for j in picks:
            monitor.memory(int(profile.mem_allocated[j]), int(profile.mem_reserved[j]),
                           ts_ns=int(profile.mem_ts_ns[j]), step=step)
        monitor.end_step(end)
        if progress is not None:
            progress(1)
    flushed = monitor.flush(flush_timeout)
    return SendResult(steps=profile.steps, ops=sent_ops, ops_outside_steps=int(profile.ops - len(inside)),
                      queue_samples=sum(len(v) for k, v in queues.items() if k in set(profile.step.tolist())),
                      memory_samples=sent_memory, dropped_ops=monitor.dropped_ops, flushed=flushed,
                      elapsed_s=time.monotonic() - t0)


def _memory_picks(profile: Profile, idx: np.ndarray) -> np.ndarray:
    """At most _MEMORY_PER_STEP of a step's memory samples (a profile with
    profile_memory=True has one per allocation): evenly spaced ones, the highest and the
    last, so that the step's peak and its values at E stay exactly as in the profile."""
    if len(idx) <= _MEMORY_PER_STEP:
        return idx
    spaced = idx[np.linspace(0, len(idx) - 1, _MEMORY_PER_STEP - 2).astype(np.int64)]
    peak = idx[int(np.argmax(profile.mem_allocated[idx]))]
    return np.unique(np.concatenate((spaced, [peak, idx[-1]])))


def _wait_for_room(monitor: Monitor, timeout: float = 120.0) -> None:
    """Backpressure for ``pace=max``: wait while the Monitor's buffer is half full."""
    deadline = time.monotonic() + timeout
    while monitor.buffered_ops and monitor.buffer_fill_ratio > _FILL_LIMIT and time.monotonic() < deadline:
        time.sleep(0.002)
