"""Rank clocks against the run's clock, learned from the collectives themselves.

Every timestamp is taken on its rank's host clock; hosts' clocks differ by 0.1-10 ms, as
much as the waits the cross-rank figures measure. A blocking collective in which every
rank's result depends on every rank's input (all_reduce, all_gather, reduce_scatter,
all_to_all, barrier: ``MUTUAL``) ends on all its members within the transfer's tail, and
no member can end it before the last one started it. So, per matched call of such a
collective and per member r, against an anchor member a whose offset is known:

- sample: end_r - end_a + offset_a (the ends nearly coincide in true time);
- causality: start_r - end_a <= offset_r - offset_a <= end_r - start_a.

The run's clock is the clock of its reference rank (the lowest rank of the first step with
such calls; offset 0). The anchor of a call is the reference where it is a member, else
the lowest member with an offset, so that ranks never in a call with the reference (a
pipeline stage's tensor-parallel group) are reached through others. Per rank and step the
median of its samples goes into a window of the last ``WINDOW_STEPS`` steps; the offset is
the median of the window, clipped into the window's causality interval [lo, hi] (its
tightest bounds), and its error bound the distance to the farther end of the interval: the
true offset lies inside it whenever the calls are real barriers and the clock did not
drift across the window. A rank without such a call has no offset (absent, never 0). A call some member did not
time (its end unknown: gloo's always-on records, end before start) teaches nothing: with
op capture off on gloo, ranks have no offsets and keep their own clocks.

A time t of rank r is t - offset_r on the run's clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from profstream.processors.collectives import Calls, JoinedCalls, join_calls, unpack_calls
from profstream.schema.rank_columns import rank_clock_columns

WINDOW_STEPS = 32  # steps of samples per rank: long enough to be robust, short enough to follow drift
MAX_DRIFT = 100e-6  # the fastest a host clock runs apart from another (a free-running crystal's 100 ppm)
MUTUAL = frozenset({"all_reduce", "allreduce", "all_gather", "allgather", "_allgather_base",
                    "all_gather_into_tensor", "reduce_scatter", "reducescatter", "_reduce_scatter_base",
                    "reduce_scatter_tensor", "all_to_all", "alltoall", "alltoall_base", "all_to_all_single",
                    "barrier", "all_gather_object", "all_gather_coalesced", "allreduce_coalesced"})
_CHAIN_PASSES = 4  # anchor hops from the reference within one step


class RunClocks:
    """The clock offsets of one run's ranks: ``learn`` a step's calls, then read
    ``offsets()`` (ns, rank -> offset) and ``estimates()`` (with error bounds)."""

    def __init__(self, window: int = WINDOW_STEPS) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self.reference: int | None = None
        self._row: dict[int, int] = {}  # rank -> row of the rings
        self._lookup = np.full(0, -1, np.int64)  # the same, indexed by rank
        self._ranks: list[int] = []
        self._sample = np.full((0, window), np.nan)  # per step: median of the rank's samples
        self._lo = np.full((0, window), np.nan)
        self._hi = np.full((0, window), np.nan)
        self._time = np.full(window, np.nan)  # per column: when its step's calls ended (ns, any clock)
        self._pos = 0  # the next column written
        self._offset = np.full(0, np.nan)  # the current estimate per row (NaN: none)
        self._error = np.full(0, np.nan)
        self._bounds = np.full((0, 2), np.nan)  # the window's [lo, hi] per row

    # -- learning ---------------------------------------------------------------------

    def learn(self, calls: Mapping[int, Calls]) -> None:
        """Fold in one step's calls ``{rank: its calls}`` (matched ones of MUTUAL collectives
        count) and update every offset."""
        rows = _aligned_rows(calls)
        self._learn_rows(rows if rows is not None else _mutual_rows(calls))

    def learn_packed(self, records: Mapping[int, dict], joined: JoinedCalls | None = None) -> None:
        """``learn`` from StepMetrics ``collectives`` records (``check_calls`` passed);
        ``joined``: their ``join_calls``, where the caller has it already."""
        reporting, same = joined or join_calls(records)
        if len(reporting) < 2:
            same = None
        if same is None:
            self.learn({r: unpack_calls(records[r]) for r in reporting})
            return
        cols, start, end, _ = same
        names = records[reporting[0]]["names"]
        if self.reference is None or self.reference in reporting:
            self._learn_matrix(names, cols, start, end, reporting)
        else:
            self._learn_rows(_matrix_rows(names, cols, start, end, reporting))

    def _learn_matrix(self, names: list[str], cols: dict[str, np.ndarray], start: np.ndarray, end: np.ndarray,
                      ranks: list[int]) -> None:
        """``_learn_rows`` where every rank, the reference among them, made every call: the
        reference anchors them all, on rank x call matrices."""
        whole = _whole_calls(names, cols, len(ranks)) & (end >= start).all(axis=0)
        if not whole.any():
            return
        if self.reference is None:
            self.reference = ranks[0]
        i = ranks.index(self.reference)
        S = start[:, whole].astype(np.float64)
        E = end[:, whole].astype(np.float64)
        sample = np.median(E - E[i], axis=1)
        lo = (S - E[i]).max(axis=1)
        hi = (E - S[i]).min(axis=1)
        sample[i] = lo[i] = hi[i] = 0.0
        self._write(ranks, sample, lo, hi, float(E.max()))

    def _learn_rows(self, rows: tuple[np.ndarray, ...] | None) -> None:
        if rows is None:
            return
        rank, seg, start, end = rows
        if self.reference is None:
            self.reference = int(rank.min())
        known = self._offset_of(rank)
        lo_known, hi_known = self._bounds_of(rank)
        step_sample: dict[int, float] = {}
        step_lo: dict[int, float] = {}
        step_hi: dict[int, float] = {}
        for _ in range(_CHAIN_PASSES):
            anchor = _anchors(rank, seg, known, self.reference)
            use = (anchor >= 0) & (anchor != np.arange(len(rank)))
            use &= ~np.isin(rank, list(step_sample))  # a rank's samples of this step come from one pass
            if not use.any():
                break
            a = anchor[use]
            r = rank[use]
            sample = end[use] - end[a] + known[a]
            lo = start[use] - end[a] + lo_known[a]
            hi = end[use] - start[a] + hi_known[a]
            for x, med, low, high in _per_rank(r, sample, lo, hi):
                step_sample[x], step_lo[x], step_hi[x] = med, low, high
            new = np.isin(rank, list(step_sample)) & np.isnan(known)  # anchors for the next pass
            if not new.any():
                break
            for i in np.flatnonzero(new).tolist():
                x = int(rank[i])
                known[i], lo_known[i], hi_known[i] = step_sample[x], step_lo[x], step_hi[x]
        ref = self.reference
        if ref in set(rank.tolist()):
            step_sample[ref], step_lo[ref], step_hi[ref] = 0.0, 0.0, 0.0
        if step_sample:
            ranks = list(step_sample)
            self._write(ranks, np.array(list(step_sample.values())), np.array([step_lo[x] for x in ranks]),
                        np.array([step_hi[x] for x in ranks]), float(end.max()))

    def _write(self, ranks: list[int], sample: np.ndarray, lo: np.ndarray, hi: np.ndarray, at_ns: float) -> None:
        """One step's column of the window: per rank of ``ranks`` its sample and bounds."""
        r = np.asarray(ranks, np.int64)
        known = np.zeros(len(r), bool)
        inside = (r >= 0) & (r < len(self._lookup))
        known[inside] = self._lookup[r[inside]] >= 0
        new = r[~known].tolist()  # the ranks without a row yet (an array test: 16,384 ranks a step)
        if new:
            self._grow(new)
        col = self._pos % self.window
        self._pos += 1
        self._time[col] = at_ns
        rows = self._lookup[r]
        if len(rows) == len(self._ranks) and (rows == np.arange(len(rows))).all():
            # every row in order (each rank of the run in the step's calls): whole columns, no gathers
            self._sample[:, col], self._lo[:, col], self._hi[:, col] = sample, lo, hi
            self._estimate(slice(None))
            return
        for ring in (self._sample, self._lo, self._hi):
            ring[:, col] = np.nan
        self._sample[rows, col] = sample
        self._lo[rows, col] = lo
        self._hi[rows, col] = hi
        self._estimate(rows)

    def _estimate(self, rows: np.ndarray | slice) -> None:
        """Offsets of ``rows`` (or every row: ``slice(None)``) from their windows: median
        clipped into [max lo, min hi], each step's bounds widened by the drift they may have
        seen since (MAX_DRIFT)."""
        med = _nanmedian_rows(self._sample[rows])
        now = np.nanmax(self._time)
        widen = MAX_DRIFT * np.nan_to_num(now - self._time, nan=0.0)
        lo = np.nanmax(self._lo[rows] - widen, axis=1)
        hi = np.nanmin(self._hi[rows] + widen, axis=1)
        for i in np.flatnonzero(lo > hi).tolist():  # the window's bounds disagree (the clock moved
            row = i if isinstance(rows, slice) else int(rows[i])  # within it): the newest step's
            lo[i], hi[i] = self._newest_bounds(row)
        offset = np.clip(med, lo, hi)
        self._offset[rows] = offset
        self._error[rows] = np.maximum(hi - offset, offset - lo)
        self._bounds[rows] = np.stack([lo, hi], axis=1)

    def _newest_bounds(self, row: int) -> tuple[float, float]:
        for back in range(1, self.window + 1):
            col = (self._pos - back) % self.window
            if not np.isnan(self._lo[row, col]):
                return float(self._lo[row, col]), float(self._hi[row, col])
        return -np.inf, np.inf

    def _grow(self, ranks: list[int]) -> None:
        """Rows for ``ranks`` (new ones), at once."""
        n = len(ranks)
        top = max(ranks)
        if top >= len(self._lookup):
            self._lookup = np.append(self._lookup, np.full(top + 1 - len(self._lookup), -1, np.int64))
        for x in ranks:
            self._row[x] = self._lookup[x] = len(self._ranks)
            self._ranks.append(x)
        blank = np.full((n, self.window), np.nan)
        self._sample = np.vstack([self._sample, blank])
        self._lo = np.vstack([self._lo, blank])
        self._hi = np.vstack([self._hi, blank])
        self._offset = np.append(self._offset, np.full(n, np.nan))
        self._error = np.append(self._error, np.full(n, np.nan))
        self._bounds = np.vstack([self._bounds, np.full((n, 2), np.nan)])

    def _offset_of(self, rank: np.ndarray) -> np.ndarray:
        """The current offset of each row's rank (the reference 0; NaN: none)."""
        return self._per_row(rank, self._offset, 0.0)

    def _bounds_of(self, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._per_row(rank, self._bounds[:, 0], 0.0), self._per_row(rank, self._bounds[:, 1], 0.0)

    def _per_row(self, rank: np.ndarray, values: np.ndarray, at_reference: float) -> np.ndarray:
        idx = self._lookup[np.minimum(rank, len(self._lookup) - 1)] if len(self._lookup) else np.full(len(rank), -1)
        idx = np.where(rank < len(self._lookup), idx, -1)
        out = np.where(idx >= 0, values[np.maximum(idx, 0)] if len(values) else np.nan, np.nan)
        out[rank == self.reference] = at_reference
        return out.astype(np.float64)

    # -- reading ----------------------------------------------------------------------

    def offsets(self, ranks: Iterable[int] | None = None) -> dict[int, int]:
        """rank -> its clock's offset from the run's clock (ns), for the ranks with one."""
        r, rows = self._with_offset(ranks)
        return dict(zip(r.tolist(), np.rint(self._offset[rows]).astype(np.int64).tolist()))

    def offset_column(self, ranks: np.ndarray) -> np.ndarray:
        """``offsets`` of ``ranks`` (each once) as an array in their order, 0 where a rank has
        none (it keeps its own clock): what the collective figures take off its times."""
        r = np.asarray(ranks, np.int64)
        rows = np.full(len(r), -1, np.int64)
        inside = (r >= 0) & (r < len(self._lookup))
        rows[inside] = self._lookup[r[inside]]
        at = np.flatnonzero(rows >= 0)
        value = self._offset[rows[at]]
        known = ~np.isnan(value)
        out = np.zeros(len(r), np.int64)
        out[at[known]] = np.rint(value[known]).astype(np.int64)
        return out

    def estimates(self, ranks: Iterable[int] | None = None) -> list[dict]:
        """RunStepMetrics v4's ``clock_offsets``: rank, offset_ns, error_ns, for the ranks
        with an offset (of ``ranks``, else all), by rank."""
        return [{"rank": x, "offset_ns": o, "error_ns": e} for x, o, e in
                zip(*(a.tolist() for a in self.estimate_arrays(ranks)))]

    def estimate_columns(self, ranks: Iterable[int] | None = None) -> dict:
        """``estimates`` as RunStepMetrics v5's ``rank_clocks`` columns (schema/rank_columns.py)."""
        return rank_clock_columns(*self.estimate_arrays(ranks))

    def estimate_arrays(self, ranks: Iterable[int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``estimates`` as arrays: the ranks, their offsets and error bounds (int64)."""
        r, rows = self._with_offset(ranks)
        order = np.argsort(r, kind="stable")
        r, rows = r[order], rows[order]
        error = np.ceil(self._error[rows])
        if not np.isfinite(error).all():
            raise OverflowError("a clock offset without bounds has no error to write")
        return r, np.rint(self._offset[rows]).astype(np.int64), error.astype(np.int64)

    def _with_offset(self, ranks: Iterable[int] | None) -> tuple[np.ndarray, np.ndarray]:
        """The ranks of ``ranks`` (else all) that have an offset, each once, and their rows."""
        if ranks is None:
            r = np.array(self._ranks, np.int64)
            rows = np.arange(len(r))
        else:
            r = ranks if isinstance(ranks, np.ndarray) else np.fromiter(ranks, np.int64)
            r = r.astype(np.int64, copy=False)
            if len(r) > 1 and not (r[1:] > r[:-1]).all():  # sorted, each once already: the run stage's
                r = np.unique(r)
            r = r[(r >= 0) & (r < len(self._lookup))]
            rows = self._lookup[r]
            r, rows = r[rows >= 0], rows[rows >= 0]
        keep = ~np.isnan(self._offset[rows])
        return r[keep], rows[keep]

    # -- checkpoint -------------------------------------------------------------------

    def snapshot(self) -> dict:
        """RunCheckpoint ``clocks``: the reference and each rank's estimate and interval."""
        return {"reference": self.reference, "at_ns": int(np.nanmax(self._time)) if self._pos else 0,
                "ranks": [{"rank": r, "offset_ns": int(round(self._offset[i])),
                           "lo_ns": int(np.floor(self._bounds[i, 0])), "hi_ns": int(np.ceil(self._bounds[i, 1]))}
                          for r, i in self._row.items() if not np.isnan(self._offset[i])]}

    @classmethod
    def restore(cls, state: dict | None, window: int = WINDOW_STEPS) -> RunClocks:
        """A RunClocks whose window holds one step: the checkpointed estimates (the next
        steps' samples replace them; docs/figures.md, Clocks)."""
        clocks = cls(window)
        if state is None or state["reference"] is None:
            return clocks
        clocks.reference = state["reference"]
        if state["ranks"]:
            clocks._write([x["rank"] for x in state["ranks"]],
                          *(np.array([float(x[k]) for x in state["ranks"]]) for k in ("offset_ns", "lo_ns", "hi_ns")),
                          float(state["at_ns"]))
        return clocks


def _mutual_rows(calls: Mapping[int, Calls]) -> tuple[np.ndarray, ...] | None:
    """(rank, call segment, start, end) of every member of every call of a MUTUAL
    collective that all its group's members reported, sorted by call then rank."""
    names: dict[str, int] = {}
    parts = []
    for r in sorted(calls):
        c = calls[r]
        if not len(c):
            continue
        mutual = np.array([n.lower() in MUTUAL for n in c.names], bool)
        keep = mutual[c.cols["name_idx"]] & (c.cols["end_ns"] >= c.cols["start_ns"])  # timed: no end, no sample
        if not keep.any():
            continue
        remap = np.array([names.setdefault(n, len(names)) for n in c.names], np.int64)
        cols = {k: c.cols[k][keep] for k in ("group_idx", "seq", "group_size", "start_ns", "end_ns")}
        parts.append((r, remap[cols["group_idx"]], cols))
    if not parts:
        return None
    rank = np.concatenate([np.full(len(g), r, np.int64) for r, g, _ in parts])
    group = np.concatenate([g for _, g, _ in parts])
    col = {k: np.concatenate([p[2][k] for p in parts]).astype(np.int64) for k in parts[0][2]}
    order = np.lexsort((rank, col["seq"], group))
    rank, group = rank[order], group[order]
    seq, size = col["seq"][order], col["group_size"][order]
    start, end = col["start_ns"][order], col["end_ns"][order]
    new = np.ones(len(seq), bool)
    new[1:] = (group[1:] != group[:-1]) | (seq[1:] != seq[:-1])
    first = np.flatnonzero(new)
    count = np.diff(np.append(first, len(seq)))
    seg = np.cumsum(new) - 1
    whole = (count == size[first])[seg] & (count > 1)[seg]  # every member reported it
    if not whole.any():
        return None
    seg = np.unique(seg[whole], return_inverse=True)[1]
    return rank[whole], seg, start[whole].astype(np.float64), end[whole].astype(np.float64)


def _aligned_rows(calls: Mapping[int, Calls]) -> tuple[np.ndarray, ...] | None:
    """_mutual_rows where every rank made the same calls in the same order (the usual case),
    from rank x call matrices; None where they did not."""
    ranks = sorted(r for r, c in calls.items() if len(c))
    if len(ranks) < 2:
        return None
    first = calls[ranks[0]]
    group, seq = first.cols["group_idx"], first.cols["seq"]
    if not all(calls[r].names == first.names and np.array_equal(calls[r].cols["seq"], seq)
               and np.array_equal(calls[r].cols["group_idx"], group) for r in ranks[1:]):
        return None
    return _matrix_rows(first.names, first.cols, np.stack([calls[r].cols["start_ns"] for r in ranks]),
                        np.stack([calls[r].cols["end_ns"] for r in ranks]), ranks)


def _matrix_rows(names: list[str], cols: dict[str, np.ndarray], start: np.ndarray, end: np.ndarray,
                 ranks: list[int]) -> tuple[np.ndarray, ...] | None:
    """_mutual_rows of rank x call ``start`` and ``end`` matrices of the calls ``cols``
    (every rank's)."""
    whole = _whole_calls(names, cols, len(ranks)) & (end >= start).all(axis=0)
    k = int(whole.sum())
    if not k:
        return None
    # rows by call, then rank (as _mutual_rows sorts them)
    rank = np.tile(np.array(ranks, np.int64), k)
    seg = np.repeat(np.arange(k), len(ranks))
    return rank, seg, start[:, whole].T.ravel().astype(np.float64), end[:, whole].T.ravel().astype(np.float64)


def _whole_calls(names: list[str], cols: dict[str, np.ndarray], ranks: int) -> np.ndarray:
    """Which calls ``cols``, made by each of ``ranks`` ranks, teach: MUTUAL collectives
    whose every member is here, each (group, seq) once."""
    mutual = np.array([n.lower() in MUTUAL for n in names], bool)[cols["name_idx"]]
    key = cols["group_idx"].astype(np.int64) * (1 << 40) + cols["seq"]
    uniq, count = np.unique(key, return_counts=True)
    return mutual & (cols["group_size"] == ranks) & (count[np.searchsorted(uniq, key)] == 1)


def _anchors(rank: np.ndarray, seg: np.ndarray, known: np.ndarray, reference: int) -> np.ndarray:
    """Per row, the row of its call's anchor: the reference, else the lowest member with
    an offset (-1: none)."""
    priority = np.where(rank == reference, -1.0, np.where(np.isnan(known), np.inf, rank.astype(np.float64)))
    order = np.lexsort((priority, seg))
    first = order[np.append(True, seg[order][1:] != seg[order][:-1])]  # per call, its best row
    best = np.where(np.isfinite(priority[first]), first, -1)
    return best[seg]


def _per_rank(rank: np.ndarray, sample: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """(rank, median sample, max lo, min hi) per rank of the rows."""
    by_rank = np.argsort(rank, kind="stable")
    ranks, count = np.unique(rank, return_counts=True)
    if (count == count[0]).all():  # as many samples each (every rank in every call): a matrix
        shape = (len(ranks), int(count[0]))
        return zip(ranks.tolist(), np.median(sample[by_rank].reshape(shape), axis=1).tolist(),
                   lo[by_rank].reshape(shape).max(axis=1).tolist(), hi[by_rank].reshape(shape).min(axis=1).tolist())
    order = np.lexsort((sample, rank))
    rank, s = rank[order], sample[order]
    first = np.flatnonzero(np.append(True, rank[1:] != rank[:-1]))
    count = np.diff(np.append(first, len(rank)))
    med = (s[first + (count - 1) // 2] + s[first + count // 2]) / 2
    low = np.maximum.reduceat(lo[order], first)
    high = np.minimum.reduceat(hi[order], first)
    return zip(rank[first].tolist(), med.tolist(), low.tolist(), high.tolist())


def _nanmedian_rows(a: np.ndarray) -> np.ndarray:
    """np.nanmedian(a, axis=1) of rows with at least one value, without its masked arrays."""
    s = np.sort(a, axis=1)  # NaN last
    n = (~np.isnan(a)).sum(axis=1)
    rows = np.arange(len(a))
    return (s[rows, (n - 1) // 2] + s[rows, n // 2]) / 2
