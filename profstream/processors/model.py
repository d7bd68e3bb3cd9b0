"""The in-memory model every figure module reads: the events of one closed step.

The runtime gathers a step's events from any number of batches into one ``StepEvents``
(arrays, not records). Figure modules are pure functions of it and know nothing of Kafka.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from profstream import compiled
from profstream.schema.batch import NO_VALUE, empty_section

_I64 = np.int64


def _empty(dtype=_I64) -> np.ndarray:
    return np.empty(0, dtype)


@dataclass
class StepEvents:
    run_id: str
    rank: int
    step: int
    start_ns: int  # S
    end_ns: int  # E
    fp_start_ns: int = NO_VALUE  # F mark when the producer has one
    bp_end_ns: int = NO_VALUE  # B mark when the producer has one
    host: str = ""
    device: str = ""
    world_size: int | None = None
    # ops: parallel arrays; op_type holds codes into type_names
    op_kind: np.ndarray = field(default_factory=lambda: _empty(np.uint8))
    op_type: np.ndarray = field(default_factory=lambda: _empty(np.int32))
    op_stream: np.ndarray = field(default_factory=lambda: _empty(np.int32))
    op_start_ns: np.ndarray = field(default_factory=_empty)
    op_dur_ns: np.ndarray = field(default_factory=_empty)
    op_launch_ns: np.ndarray = field(default_factory=_empty)  # host launch of a device op, -1 none
    type_names: list[str] = field(default_factory=list)
    # compute and communication of earlier steps that ran on past their end: (start, end)
    # unions starting at or after the previous step's E (window.carry_past_end)
    carried_compute: tuple[np.ndarray, np.ndarray] = field(default_factory=lambda: (_empty(), _empty()))
    carried_comm: tuple[np.ndarray, np.ndarray] = field(default_factory=lambda: (_empty(), _empty()))
    prev_device_end_ns: int = NO_VALUE  # device window end of step - 1, when it had a device window
    # device ops of later steps that ran before this step's device window ended (window.py):
    # kind, start and end of each, whole
    ahead_kind: np.ndarray = field(default_factory=lambda: _empty(np.uint8))
    ahead_start_ns: np.ndarray = field(default_factory=_empty)
    ahead_end_ns: np.ndarray = field(default_factory=_empty)
    # memory samples
    mem_ts_ns: np.ndarray = field(default_factory=_empty)
    mem_allocated: np.ndarray = field(default_factory=_empty)
    mem_reserved: np.ndarray = field(default_factory=_empty)
    mem_peak: np.ndarray = field(default_factory=_empty)
    # queue samples; queue codes into queue_names
    queue: np.ndarray = field(default_factory=lambda: _empty(np.int32))
    queue_ts_ns: np.ndarray = field(default_factory=_empty)
    queue_size: np.ndarray = field(default_factory=_empty)
    queue_capacity: np.ndarray = field(default_factory=_empty)  # -1 unknown
    queue_names: list[str] = field(default_factory=list)
    # collective calls (processors/collectives.Calls: names and columns), matched across
    # ranks by the run stage; None: none
    collectives: Any = None
    # device counter samples: the columns of schema.batch.DEVICE_COLUMNS
    device_samples: dict[str, np.ndarray] = field(default_factory=lambda: empty_section("device_samples"))
    # the step mark's work: its schema.batch.WORK_COLUMNS values in order; None: the mark had none
    work: tuple | None = None
    # host readings (schema.batch.HOST_COLUMNS) and data-loader readings (LOADER_COLUMNS)
    # taken in [S, E]
    host_samples: dict[str, np.ndarray] = field(default_factory=lambda: empty_section("host_samples"))
    loader_samples: dict[str, np.ndarray] = field(default_factory=lambda: empty_section("loader_samples"))
    # events of the step its producer dropped (its buffer was full), as its mark says: a
    # partial step, whose op and sample figures cover only what arrived
    dropped_ops: int = 0
    dropped_samples: int = 0

    @property
    def partial(self) -> bool:
        return bool(self.dropped_ops or self.dropped_samples)

    @property
    def step_time_ns(self) -> int:
        """E - S: the host step time."""
        return self.end_ns - self.start_ns

    @property
    def launched(self) -> np.ndarray:
        """Per op: whether it carries its launch time (a device op of a device run)."""
        launch = self.op_launch_ns
        return launch >= 0 if len(launch) == len(self.op_kind) else np.zeros(len(self.op_kind), bool)

    def any_launched(self) -> bool:
        """Whether an op carries its launch time (``launched.any()``; compiled where built)."""
        launch = self.op_launch_ns
        if len(launch) != len(self.op_kind):
            return False
        if compiled.NATIVE is not None:
            got = compiled.NATIVE.any_launched(launch)
            if got is not None:
                return got
        return bool((launch >= 0).any())

    def clipped_ops(self, kind: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) of ops (of ``kind``) clipped to [S, E]; ops outside are left out."""
        start = self.op_start_ns
        end = start + self.op_dur_ns
        if kind is not None:
            sel = self.op_kind == kind
            start, end = start[sel], end[sel]
        start = np.maximum(start, self.start_ns)
        end = np.minimum(end, self.end_ns)
        keep = end > start
        return start[keep], end[keep]
