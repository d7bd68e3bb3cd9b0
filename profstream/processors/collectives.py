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
from typing import NamedTuple

import numpy as np

from profstream.schema.codec import NO_COLLECTIVE_CALLS

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


# StepMetrics v5 ``collectives``: a step's calls on one rank as packed columns (as
# EventBatch sections are), collective and group names indexing ``names``
CALL_COLUMNS = (("name_idx", np.dtype("<i4")), ("group_idx", np.dtype("<i4")), ("group_size", np.dtype("<i4")),
                ("seq", np.dtype("<i8")), ("bytes", np.dtype("<i8")), ("start_ns", np.dtype("<i8")),
                ("end_ns", np.dtype("<i8")))
NO_CALLS = NO_COLLECTIVE_CALLS
assert set(NO_CALLS) == {"names", "count", *(c for c, _ in CALL_COLUMNS)}


class Calls(NamedTuple):
    """One rank's collective calls of a step: ``names`` and CALL_COLUMNS arrays."""

    names: list[str]
    cols: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.cols["seq"])


def pack_calls(calls: Calls) -> dict:
    """The StepMetrics ``collectives`` record of ``calls``."""
    if not len(calls):
        return NO_CALLS
    return {"names": list(calls.names), "count": len(calls),
            **{c: np.asarray(calls.cols[c], d).tobytes() for c, d in CALL_COLUMNS}}


def unpack_calls(record: dict) -> Calls:
    """``pack_calls`` undone; ValueError on columns of the wrong length or names out of range."""
    n = record["count"]
    cols = {c: np.frombuffer(record[c], d) for c, d in CALL_COLUMNS}
    if any(len(a) != n for a in cols.values()):
        raise ValueError("collectives columns differ in length from their count")
    names = record["names"]
    if n and max(cols["name_idx"].max(), cols["group_idx"].max()) >= len(names):
        raise ValueError("collectives name index outside its names")
    return Calls(names, cols)


def readable_calls(record: dict) -> list[dict]:
    """A StepMetrics ``collectives`` record as one dict per call (JSON exports)."""
    calls = unpack_calls(record)
    names = calls.names
    return [{"collective": names[n], "group": names[g], "group_size": size, "seq": seq, "bytes": b,
             "start_ns": start, "end_ns": end}
            for n, g, size, seq, b, start, end in zip(*(calls.cols[c].tolist() for c, _ in CALL_COLUMNS))]


@dataclass(frozen=True)
class CollectiveCall:
    """One rank's part in one collective call (a row of Calls)."""

    collective: str
    group: str
    group_size: int
    seq: int
    bytes: int
    start_ns: int
    end_ns: int


def calls_of(rows: Sequence[CollectiveCall]) -> Calls:
    """Calls from CollectiveCall rows."""
    names: dict[str, int] = {}
    code = [names.setdefault(v, len(names)) for r in rows for v in (r.collective, r.group)]
    cols = {"name_idx": np.array(code[0::2], np.int32), "group_idx": np.array(code[1::2], np.int32),
            **{c: np.array([getattr(r, c) for r in rows], d) for c, d in CALL_COLUMNS[2:]}}
    return Calls(list(names), cols)


def step_collectives(calls: Mapping[int, Calls], ranks: Sequence[int]) -> dict:
    """The collective figures of one step from ``{rank: its calls}``; ``ranks``: every rank
    of the run (those that did not report the step included). Fields as in
    RunStepMetrics (run_step_metrics.v2.avsc). Arithmetic on arrays over all ranks' calls."""
    reporting = sorted(r for r, c in calls.items() if len(c))
    empty = {"collectives_matched": 0, "collective_ranks": [], "by_collective": [], "late_rank": None,
             "late_rank_held_ns": 0, "unmatched_collectives": []}
    if not reporting:
        return empty
    # one dictionary for the names of every rank
    names: dict[str, int] = {}
    parts = []
    for r in reporting:
        c = calls[r]
        remap = np.array([names.setdefault(n, len(names)) for n in c.names], np.int64)
        parts.append((r, remap[c.cols["name_idx"]], remap[c.cols["group_idx"]], c.cols))
    rank = np.concatenate([np.full(len(p[1]), p[0], np.int64) for p in parts])
    coll = np.concatenate([p[1] for p in parts])
    group = np.concatenate([p[2] for p in parts])
    col = {c: np.concatenate([p[3][c] for p in parts]).astype(np.int64) for c, _ in CALL_COLUMNS[2:]}
    order = np.lexsort((rank, col["seq"], group))
    rank, coll, group = rank[order], coll[order], group[order]
    col = {c: a[order] for c, a in col.items()}
    seq, start, end = col["seq"], col["start_ns"], col["end_ns"]
    new = np.ones(len(seq), bool)
    new[1:] = (group[1:] != group[:-1]) | (seq[1:] != seq[:-1])
    first = np.flatnonzero(new)  # one segment per call (group, seq)
    count = np.diff(np.append(first, len(seq)))
    seg = np.cumsum(new) - 1  # row -> its call
    matched = count >= col["group_size"][first]
    last_start = np.maximum.reduceat(start, first)
    # the late rank of a call: the latest start (lowest rank on ties, rows are in rank order)
    at_last = np.flatnonzero(start == last_start[seg])
    late_row = at_last[np.unique(seg[at_last], return_index=True)[1]]
    late = rank[late_row]
    row_ok = matched[seg]
    wait = np.where(row_ok, last_start[seg] - start, 0)
    transfer = np.where(row_ok, np.maximum(end - last_start[seg], 0), 0)
    ranks_at = np.array(reporting, np.int64)
    rank_i = np.searchsorted(ranks_at, rank)
    nr = len(reporting)
    wait_by = np.bincount(rank_i, wait, nr)
    transfer_by = np.bincount(rank_i, transfer, nr)
    # held: each other rank's wait, per the late rank of the call it waited in
    late_i = np.searchsorted(ranks_at, late)[seg]
    other = row_ok & (rank_i != late_i)
    held_pairs = np.bincount(late_i[other] * nr + rank_i[other], wait[other], nr * nr).reshape(nr, nr)
    held = held_pairs.sum(axis=1)
    # slowest call per rank (longest end - start; among matched and unmatched alike)
    dur = end - start
    by_dur = np.lexsort((dur, rank_i))
    last_of_rank = by_dur[np.append(rank_i[by_dur][1:] != rank_i[by_dur][:-1], True)]
    slowest = {int(rank_i[i]): (int(dur[i]), int(coll[i])) for i in last_of_rank.tolist()}
    name_of = list(names)
    # per collective name, over matched calls: calls; bytes, transfer and bus bytes over the ranks' parts
    size = np.maximum.reduceat(col["bytes"], first) if len(first) else first
    pair = coll[first] << 32 | col["group_size"][first]  # (collective, group size) of each call
    pairs, pair_of = np.unique(pair, return_inverse=True)
    factor = np.array([bus_factor(name_of[p >> 32], p & 0xFFFFFFFF) for p in pairs.tolist()])[pair_of]
    kinds = []
    seg_coll = coll[first]
    seg_transfer = np.bincount(seg, transfer, len(first))
    for c in sorted(set(seg_coll[matched].tolist()), key=lambda c: name_of[c]):
        sel = matched & (seg_coll == c)
        nbytes = int((size[sel] * count[sel]).sum())
        t = int(seg_transfer[sel].sum())
        bus = float((size[sel] * count[sel] * factor[sel]).sum())
        kinds.append({"collective": name_of[c], "calls": int(sel.sum()), "bytes": nbytes, "transfer_ns": t,
                      "algbw_bytes_per_s": nbytes / t * 1e9 if t > 0 else 0.0,
                      "busbw_bytes_per_s": bus / t * 1e9 if t > 0 else 0.0})
    everyone = sorted(set(ranks) | set(reporting))
    unmatched = []
    for k in np.flatnonzero(~matched).tolist():
        a, n = int(first[k]), int(count[k])
        arrived = sorted(rank[a:a + n].tolist())
        expected = int(col["group_size"][a])
        unmatched.append({"collective": name_of[int(coll[a])], "group": name_of[int(group[a])], "seq": int(seq[a]),
                          "arrived": arrived,
                          "missing": [r for r in everyone if r not in arrived] if expected == len(everyone) else [],
                          "expected": expected})
    late_rank = None
    if nr and held.max() > 0:
        late_rank = reporting[int(np.argmax(held))]  # lowest rank on ties
    return {
        "collectives_matched": int(matched.sum()),
        "collective_ranks": [{"rank": r, "wait_ns": int(wait_by[i]), "transfer_ns": int(transfer_by[i]),
                              "slowest_collective": name_of[slowest[i][1]] if i in slowest else "",
                              "slowest_ns": slowest[i][0] if i in slowest else 0}
                             for i, r in enumerate(reporting)],
        "by_collective": kinds,
        "late_rank": late_rank,
        "late_rank_held_ns": int(held_pairs[reporting.index(late_rank)].max()) if late_rank is not None else 0,
        "unmatched_collectives": unmatched,
    }
