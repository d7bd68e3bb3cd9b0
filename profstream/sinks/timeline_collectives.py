"""The Collectives track of a rank in the timeline files: each collective call split into
the time the rank waited for the others to arrive and the time the data moved.

A call (process group, seq) is the same call on every rank of its group, so the split
needs every member's start: ``Arrivals`` keeps, per run, the latest start of each call
and which rank made it, from every rank's raw batches as the sink reads them. A rank's
step then gets, per call, ``wait for rank <late> (<collective>)`` from its own start to
the last rank's start, and ``<collective>`` from there to its end (the transfer, as
processors/collectives.py splits it). A call some member had not reported when the step
was written shows as one slice ``<collective> (not matched)`` over the whole call.

Starts of different ranks are compared on the run's clock: ``Arrivals`` also holds the
ranks' clock offsets the run stage learned (RunStepMetrics ``clock_offsets``,
processors/clocks.py) and keeps each start less its rank's offset, as known when it came.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from profstream.processors.model import StepEvents
from profstream.schema.batch import EventBatch

TID_COLLECTIVES = 7
TRACK_NAME = "Collectives: wait / transfer"
KEEP_STEPS = 128  # steps of calls kept per run behind the newest one seen (a rank further behind: not matched)


@dataclass
class Arrivals:
    """Per (group, seq) of a run's calls: the latest start, its rank, the ranks seen."""

    calls: dict[int, dict[tuple[str, int], list]] = field(default_factory=dict)  # step -> key -> [start, rank, n]
    newest: int | None = None
    clocks: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (clock offset, error bound) ns

    def learned_offsets(self, offsets: list[dict]) -> None:
        """RunStepMetrics ``clock_offsets``: each rank's clock against the run's."""
        for c in offsets:
            self.clocks[c["rank"]] = (c["offset_ns"], c["error_ns"])

    def clock_offset(self, rank: int) -> int:
        """The rank's clock offset (0 while none is known: its own clock)."""
        clock = self.clocks.get(rank)
        return clock[0] if clock is not None else 0

    def add(self, batch: EventBatch) -> None:
        """The collectives section of one raw batch (re-read batches included: a rank's
        own call counts once)."""
        c = batch.collectives
        if not len(c["step"]):
            return
        names = batch.collective_names
        shift = self.clock_offset(batch.rank)
        for group, step, seq, start in zip(c["group_idx"].tolist(), c["step"].tolist(), c["seq"].tolist(),
                                           c["start_ns"].tolist()):
            start -= shift
            calls = self.calls.setdefault(step, {})
            entry = calls.get((names[group], seq))
            if entry is None:
                calls[(names[group], seq)] = [start, batch.rank, {batch.rank}]
                continue
            entry[2].add(batch.rank)
            if start > entry[0] or (start == entry[0] and batch.rank < entry[1]):
                entry[0], entry[1] = start, batch.rank
        top = int(c["step"].max())
        if self.newest is None or top > self.newest:
            self.newest = top
            for old in [s for s in self.calls if s < top - KEEP_STEPS]:
                del self.calls[old]

    def last(self, step: int, group: str, seq: int, group_size: int) -> tuple[int, int] | None:
        """(latest start, its rank) of a call every member has reported, else None."""
        entry = self.calls.get(step, {}).get((group, seq))
        if entry is None or len(entry[2]) < group_size:
            return None
        return entry[0], entry[1]


def collective_slices(ev: StepEvents, arrivals: Arrivals | None) -> list[tuple[str, str, int, int]]:
    """(name, cat, start_ns, end_ns) of the step's Collectives track: ``collective_wait``
    and ``collective_transfer`` slices of matched calls, ``collective`` ones of the rest."""
    calls = ev.collectives
    if calls is None or not len(calls):
        return []
    names, cols = calls.names, calls.cols
    out = []
    for name, group, size, seq, start, end in zip(*(cols[c].tolist() for c in (
            "name_idx", "group_idx", "group_size", "seq", "start_ns", "end_ns"))):
        collective = names[name]
        timed = end >= start  # gloo's Flight Recorder keeps no end: no transfer slice, an instant
        last = arrivals.last(ev.step, names[group], seq, size) if arrivals is not None else None
        if last is None:
            out.append((f"{collective} (not matched)", "collective", start, end if timed else start))
            continue
        last_start, late = last
        last_start += arrivals.clock_offset(ev.rank)  # on this rank's clock, as its other times
        if last_start > start:
            out.append((f"wait for rank {late} ({collective})", "collective_wait", start, last_start))
        if timed:
            out.append((collective, "collective_transfer", max(start, last_start), max(end, last_start)))
    return out


def slice_columns(slices: list[tuple[str, str, int, int]]) -> tuple[list[tuple[str, str]], np.ndarray,
                                                                      np.ndarray, np.ndarray]:
    """The distinct (name, cat) of ``slices``, each slice's index into them, starts and durations."""
    heads: dict[tuple[str, str], int] = {}
    idx = [heads.setdefault((name, cat), len(heads)) for name, cat, _, _ in slices]
    start = np.array([s[2] for s in slices], np.int64)
    end = np.array([s[3] for s in slices], np.int64)
    return list(heads), np.array(idx, np.int64), start, end - start
