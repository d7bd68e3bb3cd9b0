"""``Profile``: what every ingest reader turns a profiler's output into.

Columns, not records: an old profile holds millions of ops, and the sender works on
slices of these arrays step by step. All timestamps are nanoseconds since the epoch.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from profstream.config import ConfigError
from profstream.schema.batch import COMMUNICATION, MEMCPY, MEMSET, NO_VALUE

I64 = np.int64


class IngestError(ConfigError):
    """A file that is not what it was taken for; one line naming the file and what was expected."""


def _empty(dtype=I64) -> np.ndarray:
    return np.empty(0, dtype)


@dataclass
class Profile:
    """One rank's profile: step marks, ops, queue and memory samples (all ns since the epoch)."""

    source: str  # the format read, e.g. "pytorch trace", "msprof timeline", "mindspore profiler dir"
    path: Path
    # steps, sorted by start
    step: np.ndarray = field(default_factory=_empty)
    step_start_ns: np.ndarray = field(default_factory=_empty)
    step_end_ns: np.ndarray = field(default_factory=_empty)
    step_fp_ns: np.ndarray = field(default_factory=_empty)  # NO_VALUE where the file has none
    step_bp_ns: np.ndarray = field(default_factory=_empty)
    # ops: codes into name_table / type_table
    name_table: np.ndarray = field(default_factory=lambda: np.empty(0, object))
    type_table: np.ndarray = field(default_factory=lambda: np.empty(0, object))
    op_name: np.ndarray = field(default_factory=lambda: _empty(np.int32))
    op_type: np.ndarray = field(default_factory=lambda: _empty(np.int32))
    op_kind: np.ndarray = field(default_factory=lambda: _empty(np.uint8))
    op_stream: np.ndarray = field(default_factory=lambda: _empty(np.int32))
    op_start_ns: np.ndarray = field(default_factory=_empty)
    op_dur_ns: np.ndarray = field(default_factory=_empty)
    op_launch_ns: np.ndarray = field(default_factory=_empty)  # host start of the launching call, -1 none
    op_on_device: np.ndarray = field(default_factory=lambda: _empty(bool))  # ran on the device (kernels, copies)
    op_step: np.ndarray = field(default_factory=_empty)  # filled by assign_steps (-1: outside every step)
    # samples
    queue_samples: list[tuple[str, int, int, int, int]] = field(default_factory=list)  # name, ts, step, size, cap
    mem_ts_ns: np.ndarray = field(default_factory=_empty)
    mem_allocated: np.ndarray = field(default_factory=_empty)
    mem_reserved: np.ndarray = field(default_factory=_empty)
    mem_step: np.ndarray = field(default_factory=_empty)
    # this rank's part in each collective call: (collective, group, dtype, seq, start_ns,
    # dur_ns, in_bytes, out_bytes, group_size), as Monitor.collective takes it
    collectives: list[tuple] = field(default_factory=list)
    collective_launch_ns: np.ndarray = field(default_factory=_empty)  # per row: as op_launch_ns
    collective_step: np.ndarray = field(default_factory=_empty)  # filled by assign_steps, as op_step
    # what the reader saw
    rank: int | None = None
    host: str | None = None
    device: str = ""  # the device the profile ran on where the file says (npu, npu:3); else the caller's
    clock: str = ""  # how the file's timestamps became ns since the epoch
    unknown_categories: Counter = field(default_factory=Counter)  # category -> ops recorded as host
    notes: list[str] = field(default_factory=list)

    @property
    def ops(self) -> int:
        return len(self.op_start_ns)

    @property
    def steps(self) -> int:
        return len(self.step)

    @property
    def launched_ops(self) -> int:
        """Ops that carry their launch time."""
        return int(np.count_nonzero(self.op_launch_ns >= 0))

    def assign_steps(self) -> None:
        """Give every op its step: a device op with a launch time the step whose [start,
        end) holds its launch (whenever it ran); any other op the step holding its start,
        or, starting between steps, the first step it runs into. Memory samples: the step
        holding their time."""
        order = np.argsort(self.step_start_ns, kind="stable")
        for name in ("step", "step_start_ns", "step_end_ns", "step_fp_ns", "step_bp_ns"):
            setattr(self, name, getattr(self, name)[order])
        n = self.ops
        if len(self.op_launch_ns) != n:
            self.op_launch_ns = np.full(n, -1, I64)
        if len(self.op_on_device) != n:
            self.op_on_device = np.zeros(n, bool)
        by_time = self._step_of(self.op_start_ns, self.op_start_ns + self.op_dur_ns)
        launched = self.op_launch_ns >= 0
        self.op_step = np.where(launched, self._step_of(self.op_launch_ns), by_time) if launched.any() else by_time
        self.mem_step = self._step_of(self.mem_ts_ns)
        if self.collectives:
            start = np.array([c[4] for c in self.collectives], I64)
            by_time = self._step_of(start, start + np.array([c[5] for c in self.collectives], I64))
            launch = (self.collective_launch_ns if len(self.collective_launch_ns) == len(start)
                      else np.full(len(start), -1, I64))
            self.collective_step = np.where(launch >= 0, self._step_of(launch), by_time)

    def _step_of(self, ts: np.ndarray, until: np.ndarray | None = None) -> np.ndarray:
        """The step whose [start, end) holds ``ts``; with ``until`` (intervals [ts, until)),
        else the first step that begins before ``until``; -1 for none."""
        if not len(self.step):
            return np.full(len(ts), -1, I64)
        idx = np.searchsorted(self.step_start_ns, ts, side="right") - 1
        safe = np.clip(idx, 0, None)
        inside = (idx >= 0) & (ts < self.step_end_ns[safe])
        out = np.where(inside, self.step[safe], -1)
        if until is not None:
            nxt = np.minimum(idx + 1, len(self.step) - 1)
            reaches = ~inside & (idx + 1 < len(self.step)) & (until > self.step_start_ns[nxt])
            out = np.where(reaches, self.step[nxt], out)
        return out

    def check_clocks(self) -> str | None:
        """A note when the device clock disagrees with the host's: device ops starting
        farther than ``clock_bound_ns()`` from every host step, or before the call that
        launched them. Such ops are attributed by their launch time where they have one;
        the others lie outside every step and are not sent. None when the clocks agree."""
        dev = self.op_on_device if len(self.op_on_device) == self.ops else np.zeros(self.ops, bool)
        if not dev.any() or not self.steps:
            return None
        bound = self.clock_bound_ns()
        start = self.op_start_ns[dev]
        far = (start < self.step_start_ns.min() - bound) | (start > self.step_end_ns.max() + bound)
        launch = self.op_launch_ns[dev] if len(self.op_launch_ns) == self.ops else np.full(len(start), -1)
        early = (launch >= 0) & (start < launch - LAUNCH_TOLERANCE_NS)
        if not far.any() and not early.any():
            return None
        rank = "?" if self.rank is None else self.rank
        return (f"{self.path} rank {rank}: the device clock disagrees with the host's: {int(far.sum())} of "
                f"{len(start)} device ops start more than {bound / 1e9:g} s from every host step and "
                f"{int(early.sum())} before the call that launched them; ops are attributed by their launch "
                f"time where they have one, the others are left out of every step")

    def clock_bound_ns(self) -> int:
        """How far from the host steps a device op may start: 3 of the longest host step
        (a device runs at most a few steps behind its host), at least 1 s."""
        longest = int((self.step_end_ns - self.step_start_ns).max()) if self.steps else 0
        return max(3 * longest, 10**9)


def set_steps(profile: Profile, steps, starts, ends, fps=None, bps=None) -> None:
    n = len(steps)
    profile.step = np.asarray(steps, I64)
    profile.step_start_ns = np.asarray(starts, I64)
    profile.step_end_ns = np.asarray(ends, I64)
    profile.step_fp_ns = np.full(n, NO_VALUE, I64) if fps is None else np.asarray(fps, I64)
    profile.step_bp_ns = np.full(n, NO_VALUE, I64) if bps is None else np.asarray(bps, I64)


# -- op kinds and types from names -----------------------------------------------------

_COMM = re.compile(r"nccl|hccl|hcom|gloo|c10d::|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|"
                   r"broadcast|collective|send_?recv|\blccl", re.I)
_MEMCPY = re.compile(r"memcpy|memcopy|\bh2d\b|\bd2h\b|\bd2d\b|host_?to_?device|device_?to_?host", re.I)
_MEMSET = re.compile(r"memset", re.I)
_OP_SUFFIX = re.compile(r"-op\d+(?:_\d+)*$")
# A device op may start this long before the call that launched it (clock granularity):
# earlier, the device's clock is not the host's.
LAUNCH_TOLERANCE_NS = 1_000_000


def kind_from_name(name: str) -> int:
    """COMMUNICATION / MEMCPY / MEMSET when the name says so, else -1."""
    if _COMM.search(name):
        return COMMUNICATION
    if _MEMSET.search(name):
        return MEMSET
    if _MEMCPY.search(name):
        return MEMCPY
    return -1


def type_from_name(name: str) -> str:
    """Op type of a full op name: the last scope component without MindSpore's ``-opN``
    suffix (``Default/network/Conv2D-op11`` -> ``Conv2D``); other names as they are."""
    if "/" in name and not name.endswith("/"):
        name = name.rsplit("/", 1)[1]
    return _OP_SUFFIX.sub("", name)


def kernel_type(name: str) -> str:
    """Op type of a device op: its name without template arguments and parameters
    (``void at::native::vectorized_elementwise_kernel<4, ...>(...)`` ->
    ``at::native::vectorized_elementwise_kernel``), as the PyTorch producer types them."""
    from profstream.integrations.torch_ops import op_type

    return op_type(name)


def relative_base_ns(path: Path, last_end_ns: int) -> int:
    """Base for a trace whose clock is relative: the file was written when its trace
    ended, so its last event ends at the file's modification time."""
    return os.stat(path).st_mtime_ns - int(last_end_ns)
