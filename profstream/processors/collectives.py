"""Collectives across ranks: the same call (process group, sequence number) matched over
the ranks of a run, split into arrival wait and transfer, with NCCL-tests bandwidths.

Per matched call and rank: wait = last rank's start - this rank's start (the time it sat
in the call for the others to arrive); transfer = this rank's end - last start (the data
moved once everyone was there, 0 if it ended earlier); algbw = bytes / transfer and
busbw = algbw x NCCL's factor for the collective and group size n (all_reduce 2(n-1)/n;
all_gather, reduce_scatter, all_to_all (n-1)/n; others 1). ``bytes`` is the larger of the
call's input and output message, as NCCL's tests count it.

Per step: per rank the total wait and transfer and its slowest call; the late rank is the
one the others waited for most (summing, over the calls where it arrived last, each other
rank's wait), and ``held_ns`` the longest any one other rank waited for it in the step.
A call not every member of its group reported by the time the step is emitted is
unmatched: the ranks that arrived and, where the group is the whole run, those missing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# NCCL-tests' bus bandwidth factors (doc/PERFORMANCE.md of nccl-tests), n = group size
_RING_TWICE = ("all_reduce", "allreduce")
_RING_ONCE = ("all_gather", "allgather", "_allgather_base", "all_gather_into_tensor", "reduce_scatter",
              "reducescatter", "_reduce_scatter_base", "reduce_scatter_tensor", "all_to_all", "alltoall",
              "alltoall_base", "all_to_all_single")


def bus_factor(collective: str, group_size: int) -> float:
    """busbw / algbw of a collective over ``group_size`` ranks."""
    n = max(group_size, 1)
    name = collective.lower()
    if name in _RING_TWICE:
        return 2.0 * (n - 1) / n
    if name in _RING_ONCE:
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True)
class CollectiveCall:
    """One rank's part in one collective call."""

    collective: str
    group: str
    group_size: int
    seq: int
    bytes: int
    start_ns: int
    end_ns: int


def calls_from_record(records: Sequence[Mapping]) -> list[CollectiveCall]:
    """CollectiveCalls of a StepMetrics record's ``collectives``."""
    return [CollectiveCall(c["collective"], c["group"], c["group_size"], c["seq"], c["bytes"], c["start_ns"],
                           c["end_ns"]) for c in records]


def step_collectives(calls: Mapping[int, Sequence[CollectiveCall]], ranks: Sequence[int]) -> dict:
    """The collective figures of one step from ``{rank: its calls}``; ``ranks``: every rank
    of the run (those that did not report the step included). Fields as in
    RunStepMetrics (run_step_metrics.v2.avsc)."""
    by_key: dict[tuple[str, int], dict[int, CollectiveCall]] = {}
    for rank, rank_calls in calls.items():
        for call in rank_calls:
            by_key.setdefault((call.group, call.seq), {})[rank] = call
    wait = {r: 0 for r in calls}
    transfer = {r: 0 for r in calls}
    slowest: dict[int, tuple[int, str]] = {}
    held = {r: 0 for r in calls}  # others' summed wait, per rank they waited for
    held_max: dict[int, dict[int, int]] = {}  # late rank -> other rank -> its wait for it
    kinds: dict[str, list] = {}  # collective -> [calls, bytes, transfer_ns, bus bytes] (bytes, time: per rank part)
    unmatched = []
    matched = 0
    everyone = sorted(set(ranks) | set(calls))
    for (group, seq), parts in sorted(by_key.items()):
        first = next(iter(parts.values()))
        if len(parts) < first.group_size:
            arrived = sorted(parts)
            missing = [r for r in everyone if r not in parts] if first.group_size == len(everyone) else []
            unmatched.append({"collective": first.collective, "group": group, "seq": seq, "arrived": arrived,
                              "missing": missing, "expected": first.group_size})
            continue
        matched += 1
        starts = np.array([c.start_ns for c in parts.values()], np.int64)
        last_start = int(starts.max())
        late = list(parts)[int(np.argmax(starts))]
        size = max(c.bytes for c in parts.values())
        factor = bus_factor(first.collective, first.group_size)
        entry = kinds.setdefault(first.collective, [0, 0, 0, 0.0])
        entry[0] += 1
        for rank, call in parts.items():
            w = last_start - call.start_ns
            t = max(call.end_ns - last_start, 0)
            wait[rank] += w
            transfer[rank] += t
            if rank != late:
                held[late] += w
                others = held_max.setdefault(late, {})
                others[rank] = others.get(rank, 0) + w
            if call.end_ns - call.start_ns > slowest.get(rank, (-1, ""))[0]:
                slowest[rank] = (call.end_ns - call.start_ns, call.collective)
            entry[1] += size
            entry[2] += t
            entry[3] += size * factor
    late_rank = max(held, key=lambda r: (held[r], -r)) if held and max(held.values()) > 0 else None
    return {
        "collectives_matched": matched,
        "collective_ranks": [{"rank": r, "wait_ns": wait[r], "transfer_ns": transfer[r],
                   "slowest_collective": slowest.get(r, (0, ""))[1], "slowest_ns": slowest.get(r, (0, ""))[0]}
                  for r in sorted(calls)],
        "by_collective": [{"collective": name, "calls": e[0], "bytes": e[1], "transfer_ns": e[2],
                           "algbw_bytes_per_s": e[1] / e[2] * 1e9 if e[2] > 0 else 0.0,
                           "busbw_bytes_per_s": e[3] / e[2] * 1e9 if e[2] > 0 else 0.0}
                          for name, e in sorted(kinds.items())],
        "late_rank": late_rank,
        "late_rank_held_ns": max(held_max.get(late_rank, {}).values(), default=0) if late_rank is not None else 0,
        "unmatched_collectives": unmatched,
    }
