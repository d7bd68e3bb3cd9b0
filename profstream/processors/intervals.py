"""Interval arithmetic on arrays: unions, their lengths and intersections.

Intervals are half-open [start, end) in integer nanoseconds, given as two parallel
arrays. Empty intervals (end <= start) are left out. Everything is sorting and cumulative
sums over the arrays; no Python loop walks the intervals.
"""

from __future__ import annotations

import numpy as np

_I64 = np.int64


def union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of [start, end) intervals as sorted, disjoint, non-touching intervals."""
    if type(start) is not np.ndarray or start.dtype != _I64:
        start = np.asarray(start, dtype=_I64)
    if type(end) is not np.ndarray or end.dtype != _I64:
        end = np.asarray(end, dtype=_I64)
    nonempty = end > start
    if nonempty.all():
        if (start[1:] > end[:-1]).all():
            return start, end  # already a union: sorted, disjoint, none empty
    else:
        start, end = start[nonempty], end[nonempty]
        if len(start) == 0:
            return start, end
    if not (start[1:] >= start[:-1]).all():  # ops come mostly in start order: then no sort
        order = np.argsort(start, kind="stable")
        start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)  # furthest end of the intervals so far
    # A new merged interval opens where a start lies beyond everything before it.
    opens = np.empty(len(start), dtype=bool)
    opens[0] = True
    opens[1:] = start[1:] > reach[:-1]
    first = np.flatnonzero(opens)
    last = np.empty_like(first)
    last[:-1] = first[1:] - 1
    last[-1] = len(start) - 1
    return start[first], reach[last]


def total(start: np.ndarray, end: np.ndarray) -> int:
    """Length of the union of [start, end) intervals (overlaps counted once)."""
    merged_start, merged_end = union(start, end)
    return int((merged_end - merged_start).sum())


def intersection_length(
    a_start: np.ndarray, a_end: np.ndarray, b_start: np.ndarray, b_end: np.ndarray
) -> int:
    """Length of (union of a) ∩ (union of b).

    Sweeps the boundaries of both unions in time order with +1 at a start and -1 at an
    end; the time during which the running count is 2 is covered by both.
    """
    return union_intersection_length(*union(a_start, a_end), *union(b_start, b_end))


def union_intersection_length(as_: np.ndarray, ae: np.ndarray, bs: np.ndarray, be: np.ndarray) -> int:
    """``intersection_length`` of two unions already made (``union``'s output)."""
    if len(as_) == 0 or len(bs) == 0:
        return 0
    points = np.concatenate([as_, ae, bs, be])
    delta = np.concatenate([
        np.ones(len(as_), _I64), -np.ones(len(ae), _I64),
        np.ones(len(bs), _I64), -np.ones(len(be), _I64),
    ])
    order = np.argsort(points, kind="stable")
    points = points[order]
    cover = np.cumsum(delta[order])  # count in force from points[i] to points[i + 1]
    gaps = np.diff(points)
    return int(gaps[cover[:-1] == 2].sum())
