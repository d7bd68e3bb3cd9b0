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
unmatched: the ranks that arrived and those missing, where the group's members are known
(the whole run, or a group named with its ranks: schema/groups.py).
A rank that reported the step without ops (its ops, collectives included, were not
captured there) is not missing: a call the ranks without a capture could account for is
left out, neither matched nor unmatched (not measured). A rank that records every call
whether ops are captured or not (torch's Flight Recorder) is always measured.

A call whose end a rank did not record (its backend keeps none: gloo's Flight Recorder;
end before start) has no transfer there: it adds nothing to transfer, and bandwidths are
over the calls every rank timed. Two records of one call by one rank (op capture and the
Flight Recorder) count once: ``one_per_call`` keeps the timed one.

Times of different ranks are compared on the run's clock: ``offsets`` (rank -> ns, from
processors/clocks.py) is taken off each rank's starts and ends first; a rank without an
offset keeps its own clock.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from profstream.schema.codec import NO_COLLECTIVE_CALLS
from profstream.schema.groups import group_members
from profstream.schema.rank_columns import NO_RANK_COLLECTIVES, rank_collective_columns

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


def one_per_call(calls: Calls) -> Calls:
    """``calls`` with one row per (group, seq): where a call was recorded twice, the row
    with a known end (op capture's) is kept, else the first."""
    cols = calls.cols
    n = len(cols["seq"])
    if n < 2:
        return calls
    group, seq = cols["group_idx"], cols["seq"]
    unknown = cols["end_ns"] < cols["start_ns"]
    order = np.lexsort((np.arange(n), unknown, seq, group))  # per call: timed rows first
    g, q = group[order], seq[order]
    first = np.ones(n, bool)
    first[1:] = (g[1:] != g[:-1]) | (q[1:] != q[:-1])
    if first.all():
        return calls
    keep = np.sort(order[first])
    return Calls(calls.names, {c: a[keep] for c, a in cols.items()})


_NO_FIGURES = {"collectives_matched": 0, "collective_ranks": [], "by_collective": [], "late_rank": None,
               "late_rank_held_ns": 0, "unmatched_collectives": []}


def step_collectives(calls: Mapping[int, Calls], ranks: Sequence[int],
                     offsets: Mapping[int, int] | np.ndarray | None = None) -> dict:
    """The collective figures of one step from ``{rank: its calls}``; ``ranks``: every rank
    of the run (those that did not report the step included). Fields as in
    RunStepMetrics (run_step_metrics.v2.avsc). Arithmetic on arrays over all ranks' calls:
    on rank x call matrices where every rank reported the same calls in (group, seq) order
    (the usual case: ``_aligned``), else on rows sorted by call (``_any_calls``)."""
    reporting = sorted(r for r, c in calls.items() if len(c))
    if not reporting:
        return dict(_NO_FIGURES)
    first = calls[reporting[0]]
    if all(len(calls[r]) == len(first) and calls[r].names == first.names
           and np.array_equal(calls[r].cols["seq"], first.cols["seq"])
           and np.array_equal(calls[r].cols["group_idx"], first.cols["group_idx"]) for r in reporting[1:]):
        figures = _aligned(first.names, first.cols, *_on_run_clock(*(
            np.stack([calls[r].cols[c] for r in reporting]) for c in ("start_ns", "end_ns")), reporting, offsets),
            np.stack([calls[r].cols["bytes"] for r in reporting]), reporting, ranks)
        if figures is not None:
            return _with_rank_rows(figures, False)
    return _with_rank_rows(_any_calls(calls, reporting, ranks, offsets), False)


class JoinedCalls(NamedTuple):
    """A step's StepMetrics ``collectives`` records read once for both of their readers (the
    run's clocks, then the step's figures): the ranks with calls, and ``same_calls`` of them."""

    reporting: list[int]
    same: tuple | None


def join_calls(records: Mapping[int, dict]) -> JoinedCalls:
    """``JoinedCalls`` of ``records`` (``check_calls`` passed)."""
    reporting = sorted(r for r, x in records.items() if x["count"])
    return JoinedCalls(reporting, same_calls(records, reporting) if reporting else None)


def packed_step_collectives(records: Mapping[int, dict], ranks: Sequence[int],
                            unmeasured: Collection[int] = (), offsets: Mapping[int, int] | np.ndarray | None = None,
                            joined: JoinedCalls | None = None, packed: bool = False) -> dict:
    """``step_collectives`` of StepMetrics ``collectives`` records (``check_calls`` passed):
    where every rank's names, groups and sequence numbers are the same bytes, the matrices
    are read straight from the ranks' columns joined; else each record is unpacked.
    ``unmeasured``: ranks that reported the step without ops (``without_unmeasured``);
    ``offsets``: each rank's clock against the run's (ns; or an array of them in the order
    of the ranks with calls, ``_shifts``); ``joined``: ``join_calls`` of
    ``records``, where the caller has it already; ``packed``: the per-rank figures as
    RunStepMetrics v5's ``rank_collectives`` columns, not v4's ``collective_ranks``."""
    figures = _with_rank_rows(_packed_step_collectives(records, ranks, offsets, joined or join_calls(records)),
                              packed)
    if unmeasured and figures["unmatched_collectives"]:
        figures["unmatched_collectives"] = without_unmeasured(figures["unmatched_collectives"], unmeasured)
    return figures


def without_unmeasured(unmatched: list[dict], unmeasured: Collection[int]) -> list[dict]:
    """The unmatched calls that the ranks whose ops were not captured in the step cannot
    account for: those are not measured there, not missing."""
    out = []
    for call in unmatched:
        if call["missing"]:
            if not set(call["missing"]) <= set(unmeasured):
                out.append({**call, "missing": [r for r in call["missing"] if r not in unmeasured]})
        elif call["expected"] - len(call["arrived"]) > len(set(unmeasured) - set(call["arrived"])):
            out.append(call)
    return out


def _packed_step_collectives(records: Mapping[int, dict], ranks: Sequence[int],
                             offsets: Mapping[int, int] | np.ndarray | None, joined: JoinedCalls) -> dict:
    reporting, same = joined
    if not reporting:
        return dict(_NO_FIGURES)
    if same is not None:
        cols, start, end, nbytes = same
        figures = _aligned(records[reporting[0]]["names"], cols, *_on_run_clock(start, end, reporting, offsets),
                           nbytes, reporting, ranks)
        if figures is not None:
            return figures
    return _any_calls({r: unpack_calls(records[r]) for r in reporting}, reporting, ranks, offsets)


def same_calls(records: Mapping[int, dict], reporting: list[int]) -> tuple[dict, np.ndarray, ...] | None:
    """Where the StepMetrics ``collectives`` records of the ``reporting`` ranks hold the same
    calls in the same order (names, groups and sequence numbers the same bytes): the first
    rank's columns and the rank x call matrices of start_ns, end_ns and bytes, read straight
    from the ranks' columns joined. None where they differ."""
    first = records[reporting[0]]
    if not all(x["count"] == first["count"] and x["seq"] == first["seq"] and x["group_idx"] == first["group_idx"]
               and x["names"] == first["names"] for x in (records[r] for r in reporting[1:])):
        return None
    shape = (len(reporting), first["count"])
    start, end, nbytes = (np.frombuffer(b"".join(records[r][c] for r in reporting), "<i8").reshape(shape)
                          for c in ("start_ns", "end_ns", "bytes"))
    return unpack_calls(first).cols, start, end, nbytes


def _on_run_clock(start: np.ndarray, end: np.ndarray, reporting: list[int],
                  offsets: Mapping[int, int] | np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Rank x call ``start`` and ``end`` less each rank's clock offset."""
    if offsets is None or not len(offsets):
        return start, end
    shift = _shifts(offsets, reporting)[:, None]
    return start - shift, end - shift


def _shifts(offsets: Mapping[int, int] | np.ndarray, reporting: list[int]) -> np.ndarray:
    """Each reporting rank's clock offset (0: none): ``offsets`` maps rank -> ns, or is an
    array of them already in ``reporting``'s order (the run stage's: no dict of every rank)."""
    if isinstance(offsets, np.ndarray):
        if len(offsets) != len(reporting):
            raise ValueError("an offsets array must have one entry per reporting rank")
        return offsets.astype(np.int64, copy=False)
    return np.array([offsets.get(r, 0) for r in reporting], np.int64)


def check_calls(record: dict) -> None:
    """ValueError unless a StepMetrics ``collectives`` record's columns have its count of
    values and its name indexes are inside its names."""
    n = record["count"]
    if any(len(record[c]) != n * d.itemsize for c, d in CALL_COLUMNS):
        raise ValueError("collectives columns differ in length from their count")
    if n and np.frombuffer(record["name_idx"] + record["group_idx"], "<u4").max() >= len(record["names"]):
        raise ValueError("collectives name index outside its names")


def _aligned(names: list[str], cols: dict[str, np.ndarray], start: np.ndarray, end: np.ndarray,
             nbytes: np.ndarray, reporting: list[int], ranks: Sequence[int]) -> dict | None:
    """step_collectives where every reporting rank made the same calls ``cols`` (the first
    rank's: names, groups, sequence numbers) in the same order: ``start``, ``end`` and
    ``nbytes`` are rank x call matrices. None unless the calls are in increasing (group,
    seq) order (``_any_calls`` then, which breaks ties in that order)."""
    group, seq = cols["group_idx"], cols["seq"]
    k = len(seq)
    if k > 1 and not ((group[1:] > group[:-1]) | ((group[1:] == group[:-1]) & (seq[1:] > seq[:-1]))).all():
        return None
    nr = len(reporting)
    start = start.astype(np.int64, copy=False)
    end = end.astype(np.int64, copy=False)
    coll = cols["name_idx"]
    group_size = cols["group_size"]
    matched = group_size <= nr
    last_start = start.max(axis=0)
    late = start.argmax(axis=0)  # the lowest rank on ties
    wait = last_start - start
    transfer = np.maximum(end - last_start, 0)
    known = end >= start  # the rank recorded the call's end
    timed = known.all(axis=0)  # every rank knows the call's end
    all_matched = bool(matched.all())
    if not all_matched:
        wait *= matched
        transfer *= matched
    dur = end - start
    longest = dur.argmax(axis=1)  # the first longest call in (group, seq) order
    rows = np.arange(nr)
    # held: the ranks' waits, per the late rank of the call (the late rank's own wait is 0)
    held = np.bincount(late, wait.sum(axis=0), nr)

    def held_ns(i: int) -> int:  # the longest any one rank waited in total for reporting rank i
        return int(wait[:, late == i].sum(axis=1).max())

    size = nbytes.max(axis=0).astype(np.int64, copy=False)
    unmatched = [] if all_matched else [
        (int(coll[j]), int(group[j]), int(seq[j]), list(reporting), int(group_size[j]))
        for j in np.flatnonzero(~matched).tolist()]  # every reporting rank arrived
    return _figures(names, reporting, wait.sum(axis=1), transfer.sum(axis=1), known.any(axis=1),
                    (dur[rows, longest], coll[longest]), (held, held_ns),
                    _by_collective(names, coll, group_size, matched, size, np.full(k, nr), transfer.sum(axis=0), timed),
                    k if all_matched else int(matched.sum()), unmatched, ranks)


def _any_calls(calls: Mapping[int, Calls], reporting: list[int], ranks: Sequence[int],
               offsets: Mapping[int, int] | np.ndarray | None = None) -> dict:
    """step_collectives on the rows of every rank's calls, sorted by (group, seq, rank)."""
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
    if offsets is not None and len(offsets):
        shift = _shifts(offsets, reporting)[np.searchsorted(reporting, rank)]
        col["start_ns"] -= shift
        col["end_ns"] -= shift
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
    # held: each other rank's wait, per the late rank of the call it waited in
    late_i = np.searchsorted(ranks_at, late)[seg]
    other = row_ok & (rank_i != late_i)
    held = np.bincount(late_i[other], wait[other], nr)

    def held_ns(i: int) -> int:  # the longest any one rank waited in total for reporting rank i
        mine = other & (late_i == i)
        return int(np.bincount(rank_i[mine], wait[mine], nr).max())

    # slowest call per rank (longest end - start; among matched and unmatched alike)
    dur = end - start
    by_dur = np.lexsort((-dur, rank_i))  # the first longest in (group, seq) order
    first_of_rank = by_dur[np.append(True, rank_i[by_dur][1:] != rank_i[by_dur][:-1])]
    size = np.maximum.reduceat(col["bytes"], first)
    known = end >= start  # the rank recorded the call's end
    timed = np.minimum.reduceat(known.astype(np.int8), first).astype(bool)
    unmatched = [(int(coll[a]), int(group[a]), int(seq[a]), sorted(rank[a:a + n].tolist()), int(col["group_size"][a]))
                 for a, n in zip(first[~matched].tolist(), count[~matched].tolist())]
    return _figures(list(names), reporting, np.bincount(rank_i, wait, nr), np.bincount(rank_i, transfer, nr),
                    np.bincount(rank_i, known, nr) > 0, (dur[first_of_rank], coll[first_of_rank]), (held, held_ns),
                    _by_collective(list(names), coll[first], col["group_size"][first], matched, size, count,
                                   np.bincount(seg, transfer, len(first)), timed),
                    int(matched.sum()), unmatched, ranks)


def _by_collective(name_of: list[str], coll: np.ndarray, group_size: np.ndarray, matched: np.ndarray,
                   size: np.ndarray, count: np.ndarray, transfer: np.ndarray, timed: np.ndarray) -> list[dict]:
    """Per collective name, over the matched calls (one entry of each argument per call):
    calls; bytes, transfer and bus bytes summed over the ranks' parts; bandwidths over the
    ``timed`` calls only (every rank knows their end)."""
    moved = size * count
    kinds = []
    for c in sorted(set(coll[matched].tolist()), key=lambda c: name_of[c]):
        sel = matched & (coll == c)
        nbytes = int(moved[sel].sum())
        t = int(transfer[sel].sum())
        sel_t = sel & timed
        timed_bytes = moved[sel_t]
        sizes = group_size[sel_t]
        if not len(sizes):  # no call of it timed on every rank: no transfer measured
            kinds.append({"collective": name_of[c], "calls": int(sel.sum()), "bytes": nbytes, "transfer_ns": None,
                          "algbw_bytes_per_s": None, "busbw_bytes_per_s": None})
            continue
        if (sizes == sizes[0]).all():  # one group size: one factor
            bus = float(timed_bytes.sum()) * bus_factor(name_of[c], int(sizes[0]))
        else:
            n, n_of = np.unique(sizes, return_inverse=True)
            bus = float((timed_bytes * np.array([bus_factor(name_of[c], x) for x in n.tolist()])[n_of]).sum())
        kinds.append({"collective": name_of[c], "calls": int(sel.sum()), "bytes": nbytes, "transfer_ns": t,
                      "algbw_bytes_per_s": float(timed_bytes.sum()) / t * 1e9 if t > 0 else 0.0,
                      "busbw_bytes_per_s": bus / t * 1e9 if t > 0 else 0.0})
    return kinds


def _figures(name_of: list[str], reporting: list[int], wait_by: np.ndarray, transfer_by: np.ndarray,
             timed_by: np.ndarray, slowest: tuple[np.ndarray, np.ndarray], held: tuple[np.ndarray, Callable],
             kinds: list[dict], matched: int, unmatched: list[tuple], ranks: Sequence[int]) -> dict:
    """The RunStepMetrics fields from per-rank arrays (in ``reporting`` order); unmatched:
    (collective, group, seq, arrived ranks, expected) per call; ``ranks``: every rank of
    the run; ``timed_by``: whether the rank knows the end of any of its calls (its transfer
    and slowest call are None, not measured, where it knows none); ``held``: per rank the
    other ranks' waits for it summed, and a function of a rank's index that says the most
    one other rank waited for it (no rank x rank matrix: 2 GB at 16,384 ranks)."""
    everyone = sorted(set(ranks) | set(reporting)) if unmatched else []  # whose call is missing: unmatched only
    late_rank = None
    late_i = None
    held_by, held_ns = held
    if held_by.max() > 0:
        late_i = int(np.argmax(held_by))  # lowest rank on ties
        late_rank = reporting[late_i]
    return {
        "collectives_matched": matched,
        "collective_ranks": RankCollectives(name_of, np.asarray(reporting, np.int64), wait_by, transfer_by,
                                            slowest[0], slowest[1], timed_by),
        "by_collective": kinds,
        "late_rank": late_rank,
        "late_rank_held_ns": held_ns(late_i) if late_i is not None else 0,
        "unmatched_collectives": [
            {"collective": name_of[c], "group": name_of[g], "seq": q, "arrived": arrived,
             "missing": _missing(name_of[g], arrived, expected, everyone), "expected": expected}
            for c, g, q, arrived, expected in unmatched],
    }


class RankCollectives(NamedTuple):
    """RunStepMetrics ``collective_ranks`` as arrays, one entry per reporting rank (by rank):
    its wait, transfer, slowest call's time and name (an index in ``names``); ``timed``:
    whether it knows the end of any of its calls (the last three are None, not measured,
    where it knows none)."""

    names: list[str]
    ranks: np.ndarray
    wait_ns: np.ndarray
    transfer_ns: np.ndarray
    slowest_ns: np.ndarray
    slowest: np.ndarray
    timed: np.ndarray

    def listed(self) -> list[dict]:
        """v4's ``collective_ranks``: a record per rank."""
        name_of = self.names
        return [{"rank": r, "wait_ns": int(w), "transfer_ns": int(t), "slowest_collective": name_of[c],
                 "slowest_ns": int(d)} if timed else
                {"rank": r, "wait_ns": int(w), "transfer_ns": None, "slowest_collective": None, "slowest_ns": None}
                for r, w, t, d, c, timed in zip(self.ranks.tolist(), self.wait_ns.tolist(), self.transfer_ns.tolist(),
                                                self.slowest_ns.tolist(), self.slowest.tolist(), self.timed.tolist())]

    def columns(self) -> dict:
        """RunStepMetrics v5's ``rank_collectives`` (schema/rank_columns.py)."""
        return rank_collective_columns(self.names, self.ranks, self.wait_ns, self.transfer_ns, self.slowest_ns,
                                       self.slowest, self.timed)


def _with_rank_rows(figures: dict, packed: bool) -> dict:
    """``figures`` with their ``collective_ranks`` as v4's list of records, or (``packed``)
    as v5's ``rank_collectives`` columns in their place."""
    per_rank = figures.pop("collective_ranks")
    if packed:
        figures["rank_collectives"] = per_rank.columns() if per_rank else dict(NO_RANK_COLLECTIVES)
    else:
        figures["collective_ranks"] = per_rank.listed() if per_rank else []
    return figures


def _missing(group: str, arrived: list[int], expected: int, everyone: list[int]) -> list[int]:
    """The members of ``group`` that did not report its call: known for a group named with
    its ranks and for one of every rank of the run; else none named."""
    members = group_members(group)
    if members is None:
        members = everyone if expected == len(everyone) else []
    return [r for r in members if r not in arrived]
