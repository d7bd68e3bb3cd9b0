"""Step partials: what the run (cross-rank) stage reads of a run step, as columns over ranks.

The step stage closes the steps of many ranks of a run in one ``ready`` call. Instead of
the run stage decoding each rank's whole StepMetrics and folding it in Python, the step
stage also sends, per (run, step) it closed in that call, one ``StepPartial``: the few
StepMetrics fields the cross-rank figures read (rank, step time, world size, op count,
work figures, collective calls) as columns (``PartialBuilder``). The run stage keeps a
run step's partials as they come (``StepReports``) and merges them once, when it emits
the step (``merge``): O(partials) Python, O(ranks) array code. StepMetrics read by the
run stage (an older step stage, the offline replay) join a run step's reports as the
partial they would have made, so that one path computes the figures either way.

A rank that comes twice in a run step (in two partials, or a partial and a StepMetrics)
counts as a dict would: its last step time, its last work figures and its last calls.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

import numpy as np

from profstream.kafka.limits import MAX_MESSAGE_BYTES
from profstream.processors.collectives import CALL_COLUMNS, NO_CALLS, JoinedCalls, check_calls

# A partial is cut in two before it passes this (the rest of the transaction's messages
# take their own room): about 20,000 calls of 44 bytes, or 8,000 ranks without calls.
PARTIAL_ROOM_BYTES = MAX_MESSAGE_BYTES // 2
_ROW_BYTES = 4 + 4 + 8 + 8 + 1 + 4 * 8 + 4 + 4
_CALL_BYTES = sum(d.itemsize for _, d in CALL_COLUMNS)

WORK_PRESENT = 16  # work_fields: the StepMetrics has work figures; bits 1, 2, 4, 8: each figure is not null
WORK_FIGURES = ("tokens_per_s", "samples_per_s", "flops_per_s", "mfu")
_ROW_COLUMNS = (("ranks", np.dtype("<i4")), ("world_size", np.dtype("<i4")), ("step_time_ns", np.dtype("<i8")),
                ("op_count", np.dtype("<i8")), ("work_fields", np.dtype("u1")),
                *((w, np.dtype("<f8")) for w in WORK_FIGURES),
                ("call_count", np.dtype("<i4")), ("call_names", np.dtype("<i4")))


class _Open:
    """One partial being built: per-column Python lists, the calls' packed bytes."""

    __slots__ = ("rows", "calls", "names", "size")

    def __init__(self) -> None:
        self.rows: dict[str, list] = {c: [] for c, _ in _ROW_COLUMNS}
        self.calls: dict[str, list[bytes]] = {c: [] for c, _ in CALL_COLUMNS}
        self.names: dict[tuple[str, ...], int] = {}
        self.size = 0


class PartialBuilder:
    """StepMetrics records of one transaction of the step stage -> StepPartial records, one
    per (run, step), in the order their first rank closed (cut where one would pass
    PARTIAL_ROOM_BYTES). Kept per input partition of the ranks until then, so that a
    partition taken away before the commit drops its ranks (``drop_partitions``)."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, int, int], _Open] = {}
        self._done: list[tuple[int, dict]] = []

    def __len__(self) -> int:
        return len(self._open) + len(self._done)

    def add(self, record: dict, partition: int) -> None:
        """Take the cross-rank fields of one StepMetrics record of a rank read from ``partition``."""
        ident = (record["run_id"], record["step"], partition)
        part = self._open.get(ident)
        calls = record.get("collectives") or NO_CALLS
        n = calls["count"]
        if part is not None and part.size + _ROW_BYTES + n * _CALL_BYTES > PARTIAL_ROOM_BYTES:
            self._done.append((partition, _record(ident, self._open.pop(ident))))
            part = None
        if part is None:
            part = self._open[ident] = _Open()
        rows = part.rows
        rows["ranks"].append(record["rank"])
        ws = record.get("world_size")
        rows["world_size"].append(-1 if ws is None else ws)
        rows["step_time_ns"].append(record["step_time_ns"])
        rows["op_count"].append(record["op_count"])
        work = record.get("work")
        fields = 0
        for i, w in enumerate(WORK_FIGURES):
            v = None if work is None else work[w]
            if v is not None:
                fields |= 1 << i
            rows[w].append(0.0 if v is None else v)
        rows["work_fields"].append(fields | (WORK_PRESENT if work is not None else 0))
        rows["call_count"].append(n)
        names = tuple(calls["names"])
        if names not in part.names:
            part.names[names] = len(part.names)
            part.size += sum(len(x) + 2 for x in names)
        rows["call_names"].append(part.names[names])
        if n:
            for c, _ in CALL_COLUMNS:
                part.calls[c].append(calls[c])
        part.size += _ROW_BYTES + n * _CALL_BYTES

    def records(self) -> list[dict]:
        """Every partial built since the last call (and forget them): the open ones of a run
        step joined across input partitions (their transaction commits them all), so that a
        step whose ranks close over many transactions sends a run stage one partial a
        transaction, not one per partition (each costs the run stage ~60-90 us to read)."""
        groups: dict[tuple[str, int], list[list[_Open]]] = {}  # a run step's partials, each of parts
        for (run_id, step, _), part in self._open.items():
            cut = groups.setdefault((run_id, step), [])
            if cut and sum(p.size for p in cut[-1]) + part.size <= PARTIAL_ROOM_BYTES:
                cut[-1].append(part)
            else:
                cut.append([part])
        out = [r for _, r in self._done] + [_record((run_id, step, -1), _join(parts))
                                            for (run_id, step), cut in groups.items() for parts in cut]
        self._open.clear()
        self._done = []
        return out

    def drop_partitions(self, partitions: set[int]) -> None:
        """Forget what ranks of ``partitions`` closed (their transaction will not commit)."""
        self._open = {i: p for i, p in self._open.items() if i[2] not in partitions}
        self._done = [(p, r) for p, r in self._done if p not in partitions]


def _join(parts: list[_Open]) -> _Open:
    """The rows of ``parts`` one after another in one partial (each one's name lists numbered
    after those before it), each row copied once."""
    if len(parts) == 1:
        return parts[0]
    out = _Open()
    for part in parts:
        remap = [out.names.setdefault(names, len(out.names)) for names in part.names]
        for c, _ in _ROW_COLUMNS:
            out.rows[c] += part.rows[c] if c != "call_names" else [remap[i] for i in part.rows[c]]
        for c, _ in CALL_COLUMNS:
            out.calls[c] += part.calls[c]
        out.size += part.size
    return out


def _record(ident: tuple[str, int, int], part: _Open) -> dict:
    rows = {c: np.array(part.rows[c], d).tobytes() for c, d in _ROW_COLUMNS}
    calls = {f"call_{c}": b"".join(part.calls[c]) for c, _ in CALL_COLUMNS}
    return {"run_id": ident[0], "step": ident[1], **rows, "name_lists": [list(n) for n in part.names], **calls}


class StepRows(NamedTuple):
    """Ranks' reports of one run step, as columns (a StepPartial's, or one StepMetrics')."""

    rank: np.ndarray  # int64
    world_size: np.ndarray  # int32, -1: unknown
    step_time_ns: np.ndarray  # int64
    op_count: np.ndarray  # int64
    work_fields: np.ndarray  # uint8
    work: np.ndarray  # float64, rows x WORK_FIGURES
    call_count: np.ndarray  # int32: 0 where the row's calls do not count (none, or malformed)
    call_names: np.ndarray  # int32, index in name_lists
    name_lists: list[list[str]]
    calls: dict[str, np.ndarray]  # CALL_COLUMNS, the rows' calls concatenated
    always_on: np.ndarray  # bool: the rank recorded collectives in a step without ops


def rows_of_partial(record: dict) -> StepRows:
    """A decoded StepPartial as StepRows; ValueError where its columns do not fit together
    (the whole partial is then refused: it came from no profstream step stage)."""
    cols = {}
    for c, d in _ROW_COLUMNS:
        if len(record[c]) % d.itemsize:
            raise ValueError(f"StepPartial column {c} is not a whole number of values")
        cols[c] = np.frombuffer(record[c], d)
    n = len(cols["ranks"])
    if any(len(a) != n for a in cols.values()):
        raise ValueError("StepPartial columns differ in length")
    count = cols["call_count"].astype(np.int64)
    total = int(count.sum()) if n else 0
    if (count < 0).any():
        raise ValueError("StepPartial call_count below 0")
    calls = {}
    for c, d in CALL_COLUMNS:
        b = record[f"call_{c}"]
        if len(b) != total * d.itemsize:
            raise ValueError("StepPartial call columns differ in length from its call counts")
        calls[c] = np.frombuffer(b, d)
    lists = record["name_lists"]
    names_of = cols["call_names"]
    if n and (names_of.min() < 0 or names_of.max() >= len(lists)):
        raise ValueError("StepPartial call_names outside its name_lists")
    if total:
        room = np.repeat(np.array([len(x) for x in lists], np.int64)[names_of], count)
        if (np.maximum(calls["name_idx"], calls["group_idx"]) >= room).any() or \
                (np.minimum(calls["name_idx"], calls["group_idx"]) < 0).any():
            raise ValueError("StepPartial call name index outside its names")
    return StepRows(cols["ranks"].astype(np.int64), cols["world_size"], cols["step_time_ns"], cols["op_count"],
                    cols["work_fields"], np.stack([cols[w] for w in WORK_FIGURES], axis=1), cols["call_count"],
                    names_of, lists, calls, (cols["op_count"] == 0) & (cols["call_count"] > 0))


def checked_calls(m: dict) -> tuple[dict, bool]:
    """A StepMetrics record, and whether its calls are well formed; one whose are not (a
    StepMetrics of another writer: its step counts, its calls do not) without them."""
    if m["collectives"]["count"]:
        try:
            check_calls(m["collectives"])
        except ValueError:
            return {**m, "collectives": NO_CALLS}, False
    return m, True


_RANKS_IN_BITMAP = 1 << 22  # ranks below: told apart by a bitmap; others (none in practice) by a set


class RankSet:
    """A set of ranks that takes arrays: ``add`` costs the ranks added, not those held."""

    def __init__(self) -> None:
        self.count = 0
        self._seen = np.zeros(0, bool)
        self._other: set[int] = set()

    def __contains__(self, rank: int) -> bool:
        return bool(0 <= rank < len(self._seen) and self._seen[rank]) or rank in self._other

    def add(self, r: np.ndarray) -> np.ndarray:
        """Put ``r`` in; the ranks of it that were not in yet (sorted)."""
        if not len(r):
            return r
        fresh_other = np.zeros(0, np.int64)
        inside = (r >= 0) & (r < _RANKS_IN_BITMAP)
        if not inside.all():
            fresh = set(r[~inside].tolist()) - self._other
            self._other |= fresh
            fresh_other = np.array(sorted(fresh), np.int64)
            r = r[inside]
        if len(r) > 1 and not (r[1:] > r[:-1]).all():
            r = np.unique(r)
        if len(r):
            top = int(r[-1]) + 1
            if top > len(self._seen):
                grown = np.zeros(max(top, 2 * len(self._seen)), bool)
                grown[:len(self._seen)] = self._seen
                self._seen = grown
            r = r[~self._seen[r]]
            self._seen[r] = True
        new = np.union1d(r, fresh_other) if len(fresh_other) else r
        self.count += len(new)
        return new

    def holds(self, r: np.ndarray) -> np.ndarray:
        """Per rank of ``r``: whether it is in."""
        inside = (r >= 0) & (r < len(self._seen))
        held = np.zeros(len(r), bool)
        held[inside] = self._seen[r[inside]]
        if self._other:
            held |= np.isin(r, np.fromiter(self._other, np.int64))
        return held

    def sorted(self) -> np.ndarray:
        """Every rank, sorted."""
        ranks = np.flatnonzero(self._seen)
        return np.union1d(ranks, np.array(sorted(self._other), np.int64)) if self._other else ranks


class StepReports:
    """A run step's reports so far, as read (merged when the step is emitted), and how many
    ranks reported it: a partial costs its own ranks, not the step's. StepMetrics read one
    by one wait as Python rows and join as one StepRows before anything read after them."""

    def __init__(self) -> None:
        self._rows: list[StepRows] = []
        self._ranks = RankSet()
        self._loose: PartialBuilder | None = None  # StepMetrics not joined yet
        self._loose_ranks: set[int] = set()  # their ranks, where not counted yet

    @property
    def count(self) -> int:
        """How many ranks reported the step."""
        return self._ranks.count + len(self._loose_ranks)

    @property
    def rows(self) -> list[StepRows]:
        """Every report, in the order read."""
        self._join()
        return self._rows

    @property
    def reported(self) -> np.ndarray:
        """The ranks that reported the step, sorted."""
        self._join()
        return self._ranks.sorted()

    def holds(self, r: np.ndarray) -> np.ndarray:
        """Per rank of ``r``: whether it reported the step."""
        self._join()
        return self._ranks.holds(r)

    def add(self, rows: StepRows) -> None:
        """One StepPartial's rows."""
        self._join()
        self._rows.append(rows)
        self._ranks.add(rows.rank)

    def add_step_metrics(self, m: dict) -> None:
        """One rank's StepMetrics (``checked_calls`` passed)."""
        if self._loose is None:
            self._loose = PartialBuilder()
        self._loose.add(m, 0)
        if m["rank"] not in self._ranks:
            self._loose_ranks.add(m["rank"])

    def _join(self) -> None:
        if self._loose is None:
            return
        loose, self._loose = self._loose, None
        self._loose_ranks.clear()
        for record in loose.records():
            rows = rows_of_partial(record)
            self._rows.append(rows)
            self._ranks.add(rows.rank)


class LastReports:
    """Per rank of a run, the highest step it reported and when it last reported (arrays
    indexed by rank: a report costs its own ranks)."""

    _NONE = np.iinfo(np.int64).min

    def __init__(self) -> None:
        self._step = np.zeros(0, np.int64)
        self._time = np.zeros(0, np.float64)  # NaN: never
        self._other: dict[int, tuple[int, float]] = {}  # ranks outside the arrays' range

    def report(self, ranks: np.ndarray, step: int, now: float) -> None:
        """``ranks`` reported ``step`` at ``now``."""
        inside = (ranks >= 0) & (ranks < _RANKS_IN_BITMAP)
        if not inside.all():
            for r in ranks[~inside].tolist():
                self._other[r] = (max(step, self._other.get(r, (step, 0.0))[0]), now)
            ranks = ranks[inside]
        if not len(ranks):
            return
        top = int(ranks.max()) + 1
        if top > len(self._step):
            n = max(top, 2 * len(self._step))
            self._step = np.concatenate([self._step, np.full(n - len(self._step), self._NONE, np.int64)])
            self._time = np.concatenate([self._time, np.full(n - len(self._time), np.nan)])
        self._step[ranks] = np.maximum(self._step[ranks], step)
        self._time[ranks] = now

    def heard_behind(self, step: int, pending: StepReports, now: float, grace_s: float) -> np.ndarray:
        """When each rank that has not reported ``step`` (``pending``) and whose highest step
        is below it last reported, where that is within ``grace_s`` of ``now``."""
        with np.errstate(invalid="ignore"):
            behind = np.flatnonzero((self._step < step) & (now - self._time < grace_s))
        heard = self._time[behind[~pending.holds(behind)]]
        other = [t for r, (last, t) in self._other.items()
                 if last < step and now - t < grace_s and not pending.holds(np.array([r], np.int64))[0]]
        return np.concatenate([heard, np.array(other, np.float64)]) if other else heard


class MergedStep(NamedTuple):
    """A run step's reports merged, by rank (the last report of a rank counts)."""

    ranks: np.ndarray  # every rank that reported the step, sorted
    step_time_ns: np.ndarray
    work_ranks: np.ndarray  # the ranks whose step had work figures, sorted
    work: np.ndarray  # their figures, rows x WORK_FIGURES
    work_present: np.ndarray  # which of them are not null, rows x WORK_FIGURES
    unmeasured: set[int]  # ranks that reported the step without ops
    calls: StepCalls


def merge(parts: list[StepRows]) -> MergedStep:
    """The reports of one run step, in the order they were read, merged."""
    if len(parts) == 1:
        p = parts[0]
        rank, step_time, op_count, work_fields, work = p.rank, p.step_time_ns, p.op_count, p.work_fields, p.work
        count, names_of, lists, calls = p.call_count, p.call_names, p.name_lists, p.calls
    else:
        rank = np.concatenate([p.rank for p in parts])
        step_time = np.concatenate([p.step_time_ns for p in parts])
        op_count = np.concatenate([p.op_count for p in parts])
        work_fields = np.concatenate([p.work_fields for p in parts])
        work = np.concatenate([p.work for p in parts])
        count = np.concatenate([p.call_count for p in parts])
        shift = np.cumsum([0] + [len(p.name_lists) for p in parts[:-1]])
        names_of = np.concatenate([p.call_names + s for p, s in zip(parts, shift.tolist())])
        lists = [x for p in parts for x in p.name_lists]
        calls = {c: np.concatenate([p.calls[c] for p in parts]) for c, _ in CALL_COLUMNS}
    ranks, last = _last_of_rank(rank, np.ones(len(rank), bool))
    has_work = (work_fields & WORK_PRESENT) > 0
    work_ranks, work_rows = _last_of_rank(rank, has_work)
    present = ((work_fields[work_rows, None] >> np.arange(len(WORK_FIGURES), dtype=np.uint8)) & 1) > 0
    call_ranks, call_rows = _last_of_rank(rank, count > 0)
    first_call = np.cumsum(count, dtype=np.int64) - count
    return MergedStep(ranks, step_time[last], work_ranks, work[work_rows], present,
                      set(rank[op_count == 0].tolist()),
                      StepCalls(call_ranks, first_call[call_rows], count[call_rows], names_of[call_rows], lists, calls))


def _last_of_rank(rank: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ranks of the ``keep`` rows, sorted, and the row of each one's last report."""
    rows = np.flatnonzero(keep)
    if not len(rows):
        return np.zeros(0, np.int64), rows
    r = rank[rows]
    if len(r) == 1 or (r[1:] > r[:-1]).all():  # each rank once, in order: one partial
        return r, rows
    if r.min() >= 0 and r.max() < _RANKS_IN_BITMAP:  # partials of several partitions: a scatter, no sort
        last = np.full(int(r.max()) + 1, -1, np.int64)
        np.maximum.at(last, r, rows)  # the last report of a rank that came twice
        ranks = np.flatnonzero(last >= 0)
        return ranks, last[ranks]
    backwards = rows[::-1]
    ranks, first = np.unique(rank[backwards], return_index=True)
    return ranks, backwards[first]


class StepCalls(Mapping):
    """The ranks' StepMetrics ``collectives`` records of a run step, read lazily from the
    merged columns: ``{rank: record}`` for the ranks with calls, as ``collectives.py`` and
    ``clocks.py`` take them; ``joined()`` their ``JoinedCalls`` in array code."""

    def __init__(self, ranks: np.ndarray, first: np.ndarray, count: np.ndarray, names_of: np.ndarray,
                 lists: list[list[str]], calls: dict[str, np.ndarray]) -> None:
        self.ranks = ranks
        self._first = first
        self._count = count
        self._names_of = names_of
        self._lists = lists
        self._calls = calls
        self._order = ranks.tolist()

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def __contains__(self, rank: object) -> bool:
        i = int(np.searchsorted(self.ranks, rank)) if isinstance(rank, (int, np.integer)) else len(self._order)
        return i < len(self._order) and self._order[i] == rank

    def __getitem__(self, rank: int) -> dict:
        if rank not in self:
            raise KeyError(rank)
        i = int(np.searchsorted(self.ranks, rank))
        a = int(self._first[i])
        n = int(self._count[i])
        return {"names": self._lists[int(self._names_of[i])], "count": n,
                **{c: self._calls[c][a:a + n].tobytes() for c, _ in CALL_COLUMNS}}

    def joined(self) -> JoinedCalls:
        """``collectives.join_calls`` of these records: where every rank made the same calls
        (the same names, groups and sequence numbers), the rank x call matrices."""
        reporting = self._order
        if not reporting:
            return JoinedCalls([], None)
        k = int(self._count[0])
        if not (self._count == k).all():
            return JoinedCalls(reporting, None)
        ids = np.unique(self._names_of).tolist()
        if any(self._lists[i] != self._lists[ids[0]] for i in ids[1:]):
            return JoinedCalls(reporting, None)
        at = self._first[:, None] + np.arange(k)  # rank x call rows of the columns
        seq = self._calls["seq"][at]
        group = self._calls["group_idx"][at]
        if not ((seq == seq[0]).all() and (group == group[0]).all()):
            return JoinedCalls(reporting, None)
        cols = {c: self._calls[c][at[0]] for c, _ in CALL_COLUMNS}
        return JoinedCalls(reporting, (cols, self._calls["start_ns"][at], self._calls["end_ns"][at],
                                       self._calls["bytes"][at]))
