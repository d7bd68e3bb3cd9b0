"""What only Ascend traces (msprof timelines, torch_npu's and MindSpore's ``trace_view.json``)
carry, read in the pass of ``trace_events.scan_events`` and kept as columns: each hardware
task's ``Task Type`` and ``connection_id``, the flow events that link a task to the host
call that launched it, and the forward-start and backward-end marks of msprof's
``Iteration N`` events.

Only a trace with complete events that have no category (the device tasks of these
profilers) pays for the extra pass; a Kineto trace has a category on every event.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

I64 = np.int64
_ITERATION = re.compile(r"^Iteration \d+$")
FLOW_PHASES = ("s", "f", "t")


@dataclass
class AscendColumns:
    task_types: list[str]  # the distinct Task Type values
    task_type: np.ndarray  # per complete event: its code into task_types, -1 none (int32)
    connection: np.ndarray  # per complete event: args.connection_id, -1 none (int64)
    marks: list[tuple[int, Any, Any]]  # (complete event index, FP Start, BP End) of Iteration events, µs
    flows: list[tuple[str, str, Any, Any, Any, Any]]  # (ph, cat, id, pid, tid, ts) of flow events


def scan_ascend(events: list, keys: list[tuple], all_code: np.ndarray, complete: np.ndarray) -> AscendColumns | None:
    """The Ascend columns of ``events`` (``keys`` and ``all_code`` as in scan_events;
    ``complete``: the indices of the complete events), or None for a trace without
    uncategorised complete events."""
    bare = [i for i, k in enumerate(keys) if k[0] == "X" and not k[2]]
    if not bare:
        return None
    key_of = all_code[complete]
    n = len(complete)
    types: dict[str, int] = {}
    task_type = np.full(n, -1, np.int32)
    connection = np.full(n, -1, I64)
    for j in np.flatnonzero(np.isin(key_of, bare)).tolist():
        a = events[int(complete[j])].args
        if a is None:
            continue
        if isinstance(a.task_type, str):
            task_type[j] = types.setdefault(a.task_type, len(types))
        if type(a.connection_id) is int:
            connection[j] = a.connection_id
    named = [i for i, k in enumerate(keys) if k[0] == "X" and isinstance(k[1], str) and _ITERATION.match(k[1])]
    marks = []
    for j in np.flatnonzero(np.isin(key_of, named)).tolist():
        a = events[int(complete[j])].args
        if a is not None and a.fp_start is not None and a.bp_end is not None:
            marks.append((j, a.fp_start, a.bp_end))
    flow_keys = [i for i, k in enumerate(keys) if k[0] in FLOW_PHASES]
    flows = [(e.ph, e.cat or "", e.id, e.pid, e.tid, e.ts)
             for e in (events[i] for i in np.flatnonzero(np.isin(all_code, flow_keys)).tolist())]
    return AscendColumns(list(types), task_type, connection, marks, flows)


def merge_ascend(parts: list[AscendColumns | None], offsets: list[int]) -> AscendColumns | None:
    """The Ascend columns of consecutive runs of events as one (``offsets``: where each
    run's complete events start)."""
    if all(p is None for p in parts):
        return None
    table: dict[str, int] = {}
    task_type, connection, marks, flows = [], [], [], []
    for part, lo, hi in zip(parts, offsets, offsets[1:]):
        if part is None:
            task_type.append(np.full(hi - lo, -1, np.int32))
            connection.append(np.full(hi - lo, -1, I64))
            continue
        remap = np.array([table.setdefault(t, len(table)) for t in part.task_types] + [-1], np.int32)
        task_type.append(remap[part.task_type])  # -1 indexes the trailing -1
        connection.append(part.connection)
        marks += [(j + lo, fp, bp) for j, fp, bp in part.marks]
        flows += part.flows
    return AscendColumns(list(table), np.concatenate(task_type), np.concatenate(connection), marks, flows)
