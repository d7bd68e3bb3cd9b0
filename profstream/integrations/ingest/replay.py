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
from typing import NamedTuple

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


class StepSlice(NamedTuple):
    """One step of a profile: its mark, and its ops (rows ``lo:hi`` of ``ProfileSteps``'
    step-ordered columns), queue samples and memory samples."""

    step: int
    start_ns: int
    end_ns: int
    fp_ns: int  # -1: none
    bp_ns: int
    lo: int
    hi: int
    queues: list[tuple[str, int, int, int, int]]
    memory: np.ndarray  # indices into the profile's memory samples
    collectives: list[tuple]  # rows of Profile.collectives


class ProfileSteps:
    """A profile's ops in step order (the order both senders send them in) and its steps
    one by one: what ``send_profile`` records into a Monitor and ``profile_batches``
    turns into raw batches directly."""

    def __init__(self, profile: Profile) -> None:
        self.profile = p = profile
        inside = np.flatnonzero(p.op_step >= 0)
        self.outside = int(p.ops - len(inside))
        order = inside[np.argsort(p.op_step[inside], kind="stable")]
        self.op_step = p.op_step[order]
        self.name_code, self.type_code = p.op_name[order], p.op_type[order]
        self.kinds, self.streams = p.op_kind[order], p.op_stream[order]
        self.starts, self.durs = p.op_start_ns[order], p.op_dur_ns[order]
        self.launches = p.op_launch_ns[order] if len(p.op_launch_ns) == p.ops else None
        self._lo = np.searchsorted(self.op_step, p.step, side="left")
        self._hi = np.searchsorted(self.op_step, p.step, side="right")
        self._queues: dict[int, list] = {}
        for sample in p.queue_samples:
            self._queues.setdefault(sample[2], []).append(sample)
        mem_in = np.flatnonzero(p.mem_step >= 0)
        self._mem_order = mem_in[np.argsort(p.mem_step[mem_in], kind="stable")]
        mem_steps = p.mem_step[self._mem_order]
        self._mem_lo = np.searchsorted(mem_steps, p.step, side="left")
        self._mem_hi = np.searchsorted(mem_steps, p.step, side="right")
        self._collectives: dict[int, list] = {}
        for row, step in zip(p.collectives, p.collective_step.tolist()):
            self._collectives.setdefault(step, []).append(row)

    @property
    def queue_samples(self) -> int:
        """Queue samples of the profile's steps."""
        steps = set(self.profile.step.tolist())
        return sum(len(v) for k, v in self._queues.items() if k in steps)

    def __iter__(self):
        p = self.profile
        for i in range(p.steps):
            yield StepSlice(int(p.step[i]), int(p.step_start_ns[i]), int(p.step_end_ns[i]), int(p.step_fp_ns[i]),
                            int(p.step_bp_ns[i]), int(self._lo[i]), int(self._hi[i]),
                            self._queues.get(int(p.step[i]), []),
                            _memory_picks(p, self._mem_order[self._mem_lo[i]:self._mem_hi[i]]),
                            self._collectives.get(int(p.step[i]), []))


def send_profile(profile: Profile, monitor: Monitor, pace: str = "max",
                 progress: Callable[[int], None] | None = None, flush_timeout: float = 60.0) -> SendResult:
    if pace not in PACES:
        raise ValueError(f"pace {pace!r}: expected realtime or max")
    t0 = time.monotonic()
    steps = ProfileSteps(profile)
    names = profile.name_table[steps.name_code]
    types = profile.type_table[steps.type_code]
    kinds, streams, starts, durs, launches = steps.kinds, steps.streams, steps.starts, steps.durs, steps.launches

    first_start = int(profile.step_start_ns[0]) if profile.steps else 0
    sent_ops = sent_memory = 0
    for st in steps:
        step = st.step
        if pace == "realtime":
            wait = (st.start_ns - first_start) / 1e9 - (time.monotonic() - t0)
            if wait > 0:
                time.sleep(wait)
        monitor.begin_step(step, ts_ns=st.start_ns)
        if st.fp_ns >= 0:
            monitor.mark_fp_start(st.fp_ns)
        if st.bp_ns >= 0:
            monitor.mark_bp_end(st.bp_ns)
        for a in range(st.lo, st.hi, _CHUNK):  # a huge step in pieces the buffer can hold
            b = min(a + _CHUNK, st.hi)
            _wait_for_room(monitor)
            monitor.ops(names[a:b], starts[a:b], durs[a:b], kinds[a:b], types[a:b], streams[a:b], step=step,
                        launch_ns=None if launches is None else launches[a:b])
            sent_ops += b - a
        for name, ts, _, size, capacity in st.queues:
            monitor.queue(name, size, capacity, ts_ns=ts, step=step)
        for collective, group, dtype, seq, start, dur, n_in, n_out, size in st.collectives:
            monitor.collective(collective, group, seq, start, dur, size, n_in, n_out, dtype, step=step)
        sent_memory += len(st.memory)
        for j in st.memory:
            monitor.memory(int(profile.mem_allocated[j]), int(profile.mem_reserved[j]),
                           ts_ns=int(profile.mem_ts_ns[j]), step=step)
        monitor.end_step(st.end_ns)
        if progress is not None:
            progress(1)
    flushed = monitor.flush(flush_timeout)
    return SendResult(steps=profile.steps, ops=sent_ops, ops_outside_steps=steps.outside,
                      queue_samples=steps.queue_samples, memory_samples=sent_memory,
                      dropped_ops=monitor.dropped_ops, flushed=flushed, elapsed_s=time.monotonic() - t0)


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
