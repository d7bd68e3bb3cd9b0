"""The processor service: raw events in; StepMetrics, RunStepMetrics and alerts out.

Two stages, each a consumer group run exactly-once by ``checkpoint.TransactionalLoop``:

- ``StepStage`` (raw -> steps, partials, alerts, dlq): decodes batches (undecodable ones go to the
  dead-letter topic with their reason and origin), keeps one ``RankAssembler`` and
  ``RankFigures`` per (run, rank), and turns closed steps into StepMetrics. StepMetrics
  are keyed ``<run>/<rank>`` but partitioned by run.
- ``RunStage`` (partials -> run) sees every rank of a run and computes the cross-rank
  figures per step, wherever the ranks were processed. It reads the partials topic, where
  the step stage writes its StepPartials (``partials.py``: per run step, the ranks one
  transaction closed, as columns) and copies of its RankEnds and RankProgress, in the
  run's partition: never the ranks' StepMetrics (docs/exactly-once.md).

This module knows Kafka records and nothing of how figures are computed.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from profstream.kafka.connection import Connection
from profstream.kafka.limits import DEAD_LETTER_ROOM_BYTES, MAX_MESSAGE_BYTES
from profstream.kafka.topics import Topics
from profstream.processors.assembler import RankAssembler
from profstream.processors.checkpoint import MAX_OUTAGE_S, Output, TransactionalLoop
from profstream.processors.clocks import RunClocks
from profstream.processors.close_schedule import CloseSchedule
from profstream.processors.collectives import packed_step_collectives
from profstream.processors.figures import FigureOptions, RankFigures
from profstream.processors.hangs import HANG_AFTER_S, HangWatch
from profstream.processors.health import EVENT_FAMILIES, ProcessorHealth, StageCounts
from profstream.processors.lag import LagProbe
from profstream.processors.partials import (
    LastReports,
    PartialBuilder,
    RankSet,
    StepReports,
    StepRows,
    checked_calls,
    merge,
    rows_of_partial,
)
from profstream.processors.ranks import rank_figures_of, run_work_of
from profstream.processors.stalls import stall_alert
from profstream.schema.batch import END_MARK, SECTIONS, decode_batch
from profstream.schema.codec import (
    DecodeError,
    decode,
    decode_any,
    encode,
    encode_rank_end,
    encode_run_checkpoint,
    encode_run_step_metrics,
    encode_step_metrics,
    is_rank_progress,
    peek,
)
from profstream.schema.rank_columns import step_time_columns

# How many finished ranks a stage remembers to drop late copies of their batches (a few
# hundred bytes each): a day of jobs of 1,024 ranks restarting every hour.
RETIRED_RANKS = 65536
# (family, its section's first column): a batch's events of each family, counted per batch
_FAMILY_ROWS = tuple((section, SECTIONS[section][0][0]) for section in EVENT_FAMILIES)

log = logging.getLogger("profstream.processor")


def dead_letter(topic: str, rec, error: DecodeError) -> Output:
    """The dead-letter copy of an input message, with its reason, detail and origin."""
    return dead_letter_of(topic, rec.key, rec.value if isinstance(rec.value, bytes) else b"", error.reason,
                          str(error), f"{rec.topic}/{rec.partition}/{rec.offset}")


def dead_letter_of(topic: str, key: bytes | None, value: bytes, reason: str, detail: str, origin: str) -> Output:
    """A dead letter with its ``reason``, ``detail`` and ``origin`` headers. A message too
    large to forward whole (a foreign producer's, on a topic that takes more than
    profstream's clients send, or a record of ours over the limit) is forwarded truncated,
    with its original size."""
    headers = [("reason", reason.encode()), ("detail", detail[:500].encode()), ("origin", origin.encode())]
    if key is not None and len(key) > DEAD_LETTER_ROOM_BYTES // 2:  # the key and headers fit in the room
        headers.append(("key_truncated_from", str(len(key)).encode()))
        key = key[:DEAD_LETTER_ROOM_BYTES // 2]
    room = MAX_MESSAGE_BYTES - DEAD_LETTER_ROOM_BYTES
    if len(value) > room:
        headers.append(("truncated_from", str(len(value)).encode()))
        value = value[:room]
    return Output(topic, key, value, None, headers)


def run_partition(run_id: str, partitions: int) -> int:
    """Partition of the steps (or partials) topic of ``partitions`` partitions that carries
    every rank of ``run_id``."""
    return zlib.crc32(run_id.encode()) % partitions


@dataclass
class _Rank:
    assembler: RankAssembler
    figures: RankFigures
    buffer_fill_ratio: float = 0.0  # producer health from the latest batch header
    send_latency_s: float | None = None
    order: int = 0  # when its (run, rank) entered the stage: ready() closes ranks in this order


class StepStage:
    """raw -> StepMetrics / Alert / dead letters, with a RankCheckpoint per (run, rank).

    ``ready(now)`` runs after every poll and visits only the ranks that may have something
    to close (``close_schedule.CloseSchedule``), in the order they entered the stage.
    """

    name = "steps"

    def __init__(self, topics: Topics, steps_partitions: int, counts: StageCounts,
                 grace_s: float = 2.0, idle_timeout_s: float = 60.0,
                 figure_options: FigureOptions | None = None, partials: bool = True,
                 partials_partitions: int | None = None) -> None:
        self.topics = topics
        self.input_topic = topics.raw
        self.state_topic = topics.state
        self.steps_partitions = steps_partitions
        # the partials topic's partition count (None: the steps topic's)
        self.partials_partitions = partials_partitions or steps_partitions
        self.counts = counts
        self.grace_s = grace_s
        self.idle_timeout_s = idle_timeout_s
        self.figure_options = figure_options or FigureOptions()
        self.ranks: dict[tuple[str, int], _Rank] = {}
        # ranks that ended or went idle: their input partition and each producer's next seq,
        # so that a copy of one of their batches read later (a spool published twice, a
        # resend) is no new step. Not checkpointed: a rebuild of a partition (an aborted
        # transaction, a restart, a rebalance) forgets its ranks here, as their input is
        # read again from the last commit anyway (docs/exactly-once.md).
        self._retired: OrderedDict[tuple[str, int], tuple[int, dict[str, int]]] = OrderedDict()
        self._changed: set[tuple[str, int]] = set()
        self._orders = itertools.count()
        self.schedule = CloseSchedule(grace_s, idle_timeout_s)
        # the closed steps' cross-rank fields, per run step, sent at commit (``transaction_outputs``);
        # None: no run stage reads this stage's output (the offline replay's RunFigures reads
        # StepMetrics), and nothing goes to the partials topic
        self._partials = PartialBuilder() if partials else None

    # -- checkpoint -------------------------------------------------------------------

    def restore(self, partition: int, key: bytes, value: bytes | None, now: float) -> None:
        run_id, _, rank = key.decode().rpartition("/")
        ident = (run_id, int(rank))
        if value is None:
            self._forget(ident)
            return
        cp = decode("RankCheckpoint", value)
        self._add_rank(ident, _Rank(RankAssembler.restore(cp, self.grace_s, partition, now),
                                    RankFigures.restore(self.figure_options, cp)))

    def transaction_outputs(self) -> list[Output]:
        """The StepPartials of the steps closed in this transaction (``_partial_outputs``)."""
        return self._partial_outputs()

    def changed_state(self) -> list[Output]:
        out = []
        for ident in self._changed:
            rank = self.ranks.get(ident)
            if rank is not None:
                cp = {**rank.assembler.snapshot(), **rank.figures.snapshot()}
                out.append(Output(self.state_topic, f"{ident[0]}/{ident[1]}".encode(),
                                  encode("RankCheckpoint", cp), rank.assembler.partition))
        self._changed.clear()
        return out

    def commit_offset(self, partition: int, position: int) -> int:
        offsets = [r.assembler.min_open_offset for r in self.ranks.values() if r.assembler.partition == partition]
        return min([o for o in offsets if o is not None] + [position])

    def drop_partitions(self, partitions: Iterable[int]) -> None:
        parts = set(partitions)
        for ident in [i for i, r in self.ranks.items() if r.assembler.partition in parts]:
            self._forget(ident)
        for ident in [i for i, (part, _) in self._retired.items() if part in parts]:
            del self._retired[ident]
        if self._partials is not None:
            self._partials.drop_partitions(parts)

    def _add_rank(self, ident: tuple[str, int], rank: _Rank) -> _Rank:
        """Put a new or restored rank in (a restored one in its old place) and schedule it."""
        old = self.ranks.get(ident)
        rank.order = old.order if old is not None else next(self._orders)
        self.ranks[ident] = rank
        self.schedule.add(ident, rank.assembler)  # a restored rank has no open step: only its idle time to watch
        return rank

    def _retire(self, ident: tuple[str, int], asm: RankAssembler) -> None:
        """Remember where a finished rank's producers were (the last RETIRED_RANKS ranks)."""
        self._retired[ident] = (asm.partition, {**self._retired.get(ident, (0, {}))[1], **asm.next_seq})
        self._retired.move_to_end(ident)
        while len(self._retired) > RETIRED_RANKS:
            self._retired.popitem(last=False)

    def _forget(self, ident: tuple[str, int]) -> None:
        self.ranks.pop(ident, None)
        self._changed.discard(ident)
        self.schedule.forget(ident)

    # -- records ----------------------------------------------------------------------

    def fold(self, rec, now: float) -> list[Output]:
        if is_rank_progress(rec.value):
            return self._pass_progress(rec)
        try:
            batch = decode_batch(rec.value)
        except DecodeError as e:
            self.counts.decode_errors[e.reason] += 1
            return [dead_letter(self.topics.dlq, rec, e)]
        ident = (batch.run_id, batch.rank)
        if self._retired and batch.seq < self._retired.get(ident, (0, {}))[1].get(batch.producer_id, -1):
            self.counts.duplicate_batches += 1  # of a rank that ended: its steps are closed and sent
            return []
        rank = self.ranks.get(ident)
        if rank is None:
            rank = self._add_rank(ident, _Rank(RankAssembler(batch.run_id, batch.rank, self.grace_s, rec.partition),
                                               RankFigures(self.figure_options)))
        asm = rank.assembler
        before = (asm.late_events, asm.lost_batches, asm.dropped_ops, asm.duplicate_batches, asm.dropped_samples)
        watermark = asm.watermark
        fresh = asm.add(batch, now, rec.offset)
        # only marks and the watermark let a step close
        self.schedule.folded(ident, asm, bool(len(batch.steps["step"])) or asm.watermark != watermark)
        self.counts.duplicate_batches += asm.duplicate_batches - before[3]
        if fresh:
            self._changed.add(ident)
            h = self.counts
            h.batches += 1
            events = h.events
            for section, first in _FAMILY_ROWS:
                n = len(getattr(batch, section)[first])
                if n:
                    events[section] += n
            marks = batch.steps["step"]
            if len(marks) and END_MARK in marks.tolist():  # an end mark is no step (a list: numpy's `in` ~4 us)
                events["steps"] -= 1
            h.late_events += asm.late_events - before[0]
            h.lost_batches += asm.lost_batches - before[1]
            h.producer_dropped += asm.dropped_ops - before[2]
            h.producer_dropped_samples += asm.dropped_samples - before[4]
            rank.buffer_fill_ratio = batch.buffer_fill_ratio
            if batch.send_latency_ns >= 0:
                rank.send_latency_s = batch.send_latency_ns / 1e9
        return []

    def _pass_progress(self, rec) -> list[Output]:
        """A RankProgress goes on, as it is, to the steps topic (the exporter's: the run lives
        on) and the partials topic (the run stage's: hangs), each in its run's partition; one
        that does not decode goes to the dead letters."""
        try:
            m = decode("RankProgress", rec.value)
        except DecodeError as e:
            self.counts.decode_errors[e.reason] += 1
            return [dead_letter(self.topics.dlq, rec, e)]
        self.counts.progress += 1
        return self._to_both(m["run_id"], f"{m['run_id']}/{m['rank']}".encode(), bytes(rec.value))

    def _to_both(self, run_id: str, key: bytes, value: bytes) -> list[Output]:
        """``value`` on the steps topic and, where a run stage reads this stage's output, a
        copy on the partials topic, each in the run's partition."""
        out = [Output(self.topics.steps, key, value, run_partition(run_id, self.steps_partitions))]
        if self._partials is not None:
            out.append(Output(self.topics.partials, key, value, run_partition(run_id, self.partials_partitions)))
        return out

    def ready(self, now: float) -> list[Output]:
        out: list[Output] = []
        ends: list[Output] = []
        for ident in self._due(now):
            rank = self.ranks[ident]
            asm = rank.assembler
            closed = asm.close_ready(now)
            idle = not closed and now - asm.last_seen >= self.idle_timeout_s
            if idle or asm.finished:  # silent for the idle timeout, or ended with every step closed
                closed += [(ev, "idle") for ev in asm.close_all()]
                self._retire(ident, asm)
                self._forget(ident)
                self.counts.runs_closed += 1
            else:
                if closed:
                    self._changed.add(ident)
                self.schedule.visited(ident, asm)
            for ev, reason in closed:
                out.extend(self._step_outputs(rank, ev, reason))
            if idle or asm.finished:
                if asm.ended_ns is not None:  # after its last StepMetrics, on the same partition
                    ends += self._rank_end(asm)
                out.append(Output(self.state_topic, f"{ident[0]}/{ident[1]}".encode(), None, asm.partition))
        if ends:  # on the partials topic after the partials of their ranks' last steps: the run
            out += self._partial_outputs() + ends  # stage may end the run on them
        return out

    def _partial_outputs(self) -> list[Output]:
        """The StepPartials of the steps closed since the last call, in their runs' partitions
        of the partials topic: one per run step a transaction (not per ``ready``, which may
        close one rank at a time)."""
        if self._partials is None or not len(self._partials):
            return []
        topic, partitions = self.topics.partials, self.partials_partitions
        return [Output(topic, p["run_id"].encode(), encode("StepPartial", p), run_partition(p["run_id"], partitions))
                for p in self._partials.records()]

    def _rank_end(self, asm: RankAssembler) -> list[Output]:
        """The RankEnd of a rank that ended, on the steps topic and the partials topic."""
        record = {"run_id": asm.run_id, "rank": asm.rank, "world_size": asm.world_size, "host": asm.host,
                  "last_step": asm.last_step, "ended_ns": asm.ended_ns, "end_signal": asm.end_signal}
        self.counts.ranks_ended += 1
        return self._to_both(asm.run_id, f"{asm.run_id}/{asm.rank}".encode(), encode_rank_end(record))

    def _due(self, now: float) -> list[tuple[str, int]]:
        """The ranks ready(now) must visit, in the order they entered the stage."""
        ranks = self.ranks
        due = self.schedule.due(now, lambda ident: ranks[ident].assembler.last_seen)
        return sorted(due, key=lambda ident: ranks[ident].order)

    def _step_outputs(self, rank: _Rank, ev, reason: str) -> list[Output]:
        record, transition = rank.figures.step_metrics(ev, reason, rank.assembler.late_events)
        key = f"{ev.run_id}/{ev.rank}".encode()
        part = run_partition(ev.run_id, self.steps_partitions)
        out = [Output(self.topics.steps, key, encode_step_metrics(record), part)]
        if self._partials is not None:
            self._partials.add(record, rank.assembler.partition)
        self.counts.step_closed(record)
        if transition is not None:
            self.counts.alerts += 1
            alert = stall_alert(record, transition, self.figure_options.stall_steps, rank.figures.stall.since_step,
                                rank.figures.starved_steps)
            out.append(Output(self.topics.alerts, ev.run_id.encode(), encode("Alert", alert), None))
        return out

    def describe(self) -> str:
        return f"{len(self.ranks)} ranks open, {self.open_events} events"

    @property
    def open_runs(self) -> int:
        return len({run for run, _ in self.ranks})

    @property
    def open_events(self) -> int:
        return sum(r.assembler.open_events for r in self.ranks.values())


@dataclass
class _RunState:
    partition: int
    ranks: set[int] = field(default_factory=set)
    rank_set: RankSet = field(default_factory=RankSet)  # ``ranks``, for arrays of them
    world_size: int | None = None  # from the producers, when they know it
    floor: int | None = None  # every step below has been emitted
    pending: dict[int, StepReports] = field(default_factory=dict)  # step -> its reports
    # ranks that sent collectives in a step without ops: they record every call, captured or not
    always_on: set[int] = field(default_factory=set)
    partials: bool = False  # StepPartials come for the run: its StepMetrics are not read
    ended: dict[int, int | None] = field(default_factory=dict)  # rank -> its last step, from its RankEnd
    first_offset: dict[int, int] = field(default_factory=dict)  # step -> input offset
    first_seen: dict[int, float] = field(default_factory=dict)
    # step -> when its latest report came: the grace runs from there, so that a step whose
    # reports are still coming (16,384 ranks' StepMetrics take the step stage seconds) waits
    latest: dict[int, float] = field(default_factory=dict)
    # per rank, the highest step it reported and when: a rank behind a step that reported within
    # the grace is still coming to it (a rank running ahead must not end the others' steps)
    reports: LastReports = field(default_factory=LastReports)
    held_until: dict[int, float] = field(default_factory=dict)  # step -> when to look for coming ranks again
    last_seen: float = 0.0
    hangs: HangWatch | None = None  # where its ranks are (RankProgress): in memory only (hangs.py)
    clocks: RunClocks = field(default_factory=RunClocks)  # its ranks' clock offsets (clocks.py), checkpointed


class RunStage:
    """partials -> RunStepMetrics: a step of a run is emitted once all its ranks reported it
    (the producers' world_size, else every rank seen in the run so far), or ``grace_s``
    after its latest report once no rank behind it reported within ``grace_s`` (the missing
    ones fell silent); steps are emitted in order. Each step's calls teach the run's
    rank clock offsets (``clocks.py``) before its collective figures compare the ranks'
    times with them. From the ranks' RankProgress it tells a hang (``hangs.py``):
    TrainingHang alerts after ``hang_after_s`` in one step."""

    name = "run"

    def __init__(self, topics: Topics, counts: StageCounts, grace_s: float = 10.0,
                 idle_timeout_s: float = 60.0, hang_after_s: float = HANG_AFTER_S) -> None:
        if hang_after_s <= 0:
            raise ValueError("hang_after_s must be > 0")
        self.topics = topics
        self.input_topic = topics.partials
        self.state_topic = topics.run_state
        self.counts = counts
        self.grace_s = grace_s
        self.idle_timeout_s = idle_timeout_s
        self.hang_after_s = hang_after_s
        self.runs: dict[str, _RunState] = {}
        self._changed: set[str] = set()
        self._too_large_said: set[str] = set()  # runs whose run steps were said too large (bounded)

    def restore(self, partition: int, key: bytes, value: bytes | None, now: float) -> None:
        run_id = key.decode()
        if value is None:
            self.runs.pop(run_id, None)
            return
        cp = decode("RunCheckpoint", value)
        run = self.runs[run_id] = _RunState(partition, set(cp["ranks"]), floor=cp["floor"], last_seen=now,
                                            clocks=RunClocks.restore(cp["clocks"]))
        run.rank_set.add(np.array(cp["ranks"], np.int64))

    def transaction_outputs(self) -> list[Output]:
        return []

    def changed_state(self) -> list[Output]:
        out = []
        for run_id in self._changed:
            run = self.runs.get(run_id)
            if run is not None:
                cp = {"run_id": run_id, "floor": run.floor, "ranks": sorted(run.ranks),
                      "clocks": run.clocks.snapshot() if run.clocks.reference is not None else None}
                out.append(Output(self.state_topic, run_id.encode(), encode_run_checkpoint(cp), run.partition))
        self._changed.clear()
        return out

    def commit_offset(self, partition: int, position: int) -> int:
        offsets = [o for r in self.runs.values() if r.partition == partition for o in r.first_offset.values()]
        return min(offsets + [position])

    def drop_partitions(self, partitions: Iterable[int]) -> None:
        parts = set(partitions)
        for run_id in [k for k, r in self.runs.items() if r.partition in parts]:
            del self.runs[run_id]
            self._changed.discard(run_id)

    def fold(self, rec, now: float) -> list[Output]:
        seen = peek(rec.value)
        if seen is not None and seen[0] == "StepMetrics":
            run = self.runs.get(seen[1])
            if run is not None and run.partials:
                return []  # the run's StepPartials bring what the run stage reads of it: not decoded
        try:
            name, m = decode_any(rec.value)
            if name == "RankEnd":
                self._rank_ended(m)
                return []
            if name == "RankProgress":
                self._rank_progress(m, rec.partition, now)
                return []
            if name == "StepPartial":
                rows = rows_of_partial(m)
            elif name == "StepMetrics":
                run = self.runs.get(m["run_id"])
                if run is not None and run.partials:
                    return []  # as above, for a value peek could not read (not bytes)
                rows = None
            else:
                raise DecodeError("wrong_type",
                                  f"expected StepPartial, StepMetrics, RankEnd or RankProgress, got {name}")
        except DecodeError as e:
            self.counts.decode_errors[e.reason] += 1
            return []
        except ValueError:  # a StepPartial whose columns do not fit together: no step stage of ours wrote it
            self.counts.decode_errors["malformed"] += 1
            return []
        run = self.runs.get(m["run_id"])
        if run is None:
            run = self.runs[m["run_id"]] = _RunState(rec.partition)
        run.last_seen = now
        if rows is None:
            self._fold_step_metrics(run, m, rec, now)
        else:
            run.partials = True
            self._fold_partial(run, m, rows, rec, now)
        return []

    def _fold_partial(self, run: _RunState, m: dict, rows: StepRows, rec, now: float) -> None:
        known = rows.world_size[rows.world_size >= 0]
        if len(known):
            run.world_size = int(known[-1])
        new = run.rank_set.add(rows.rank)
        if len(new):
            run.ranks.update(new.tolist())
            self._changed.add(m["run_id"])
        pending = self._pending(run, m["step"], rec, now)
        if pending is not None:
            pending.add(rows)
            run.reports.report(rows.rank, m["step"], now)
            if rows.always_on.any():  # collectives recorded without a capture
                run.always_on.update(rows.rank[rows.always_on].tolist())

    def _fold_step_metrics(self, run: _RunState, m: dict, rec, now: float) -> None:
        """One rank's StepMetrics, where the run has no StepPartials (archived StepMetrics
        republished to the partials topic; the offline replay's ``RunFigures``): its fields join
        the step's reports as a partial would."""
        if m["world_size"] is not None:
            run.world_size = m["world_size"]
        if m["rank"] not in run.ranks:
            run.ranks.add(m["rank"])
            run.rank_set.add(np.array([m["rank"]], np.int64))
            self._changed.add(m["run_id"])
        pending = self._pending(run, m["step"], rec, now)
        if pending is None:
            return
        m, calls_ok = checked_calls(m)
        if not calls_ok:  # a StepMetrics of another writer: its step counts, its calls do not
            self.counts.decode_errors["malformed"] += 1
        if not m["op_count"] and (m["collectives"]["count"] or not calls_ok):  # collectives without a capture
            run.always_on.add(m["rank"])
        pending.add_step_metrics(m)
        run.reports.report(np.array([m["rank"]], np.int64), m["step"], now)

    def _pending(self, run: _RunState, step: int, rec, now: float) -> StepReports | None:
        """The reports of ``step`` so far (new ones from ``rec``); None: already emitted (a
        re-read after restart, or a rank far behind)."""
        if run.floor is not None and step < run.floor:
            return None
        pending = run.pending.get(step)
        if pending is None:
            pending = run.pending[step] = StepReports()
            run.first_offset[step] = rec.offset
            run.first_seen[step] = now
        run.latest[step] = now
        return pending

    def _rank_ended(self, end: dict) -> None:
        run = self.runs.get(end["run_id"])
        if run is not None:
            run.ended[end["rank"]] = end["last_step"]
            if run.hangs is not None:
                run.hangs.forget(end["rank"])

    def _rank_progress(self, m: dict, partition: int, now: float) -> None:
        run = self.runs.get(m["run_id"])
        if run is None:
            run = self.runs[m["run_id"]] = _RunState(partition)
        if m["rank"] in run.ended:  # a record sent before its end, read after it
            return
        run.last_seen = now  # the run is alive while its ranks say where they are
        if run.world_size is None and m["world_size"] is not None:
            run.world_size = m["world_size"]
        if run.hangs is None:
            run.hangs = HangWatch(self.hang_after_s)
        run.hangs.report(m, now)

    def ready(self, now: float) -> list[Output]:
        out: list[Output] = []
        for run_id, run in list(self.runs.items()):
            expected = run.world_size or len(run.ranks)
            for step in sorted(run.pending):
                pending = run.pending[step]
                if pending.count < expected - _gone(run.ended, pending, step) and \
                        (now - run.latest[step] < self.grace_s or self._coming(run, step, pending, now)):
                    break
                everyone = range(run.world_size) if run.world_size else run.rank_set.sorted().tolist()
                out.append(self._emit(run_id, step, pending.rows, everyone, run.always_on, run.clocks))
                del run.pending[step], run.first_offset[step], run.first_seen[step], run.latest[step]
                run.held_until.pop(step, None)
                run.floor = step + 1
                self._changed.add(run_id)
            if run.hangs is not None:
                for alert in run.hangs.check(run_id, now):
                    self.counts.alerts += 1
                    out.append(Output(self.topics.alerts, run_id.encode(), encode("Alert", alert), None))
            ended = len(run.ended) >= expected and run.ranks <= run.ended.keys()  # every rank said it ended
            live = run.hangs is not None and run.hangs.live(now)  # its ranks still report where they are
            if not run.pending and not live and (ended or now - run.last_seen >= self.idle_timeout_s):
                del self.runs[run_id]
                self._changed.discard(run_id)
                out.append(Output(self.state_topic, run_id.encode(), None, run.partition))
        return out

    def _coming(self, run: _RunState, step: int, pending: StepReports, now: float) -> bool:
        """Whether a rank that has not reported ``step`` is behind it and reported within the
        grace (still coming); looked up again only when the first of them could go silent."""
        if now < run.held_until.get(step, 0.0):
            return True
        heard = run.reports.heard_behind(step, pending, now, self.grace_s)
        if len(heard):
            run.held_until[step] = float(heard.min()) + self.grace_s
        return bool(len(heard))

    def describe(self) -> str:
        """Per run: the steps it waits for, the lowest one's missing ranks (a state dump)."""
        parts = []
        for run_id, run in self.runs.items():
            low = min(run.pending, default=None)
            if low is None:
                parts.append(f"{run_id} floor {run.floor}, nothing pending")
                continue
            everyone = set(range(run.world_size)) if run.world_size else run.ranks
            missing = sorted(everyone - set(run.pending[low].reported.tolist()))
            parts.append(f"{run_id} floor {run.floor}, {len(run.pending)} steps pending from {low} (missing ranks "
                         f"{missing[:16]}, first seen {time.monotonic() - run.first_seen[low]:.0f} s ago)")
        return "; ".join(parts) or "no runs"

    def _emit(self, run_id: str, step: int, reports: list[StepRows], everyone: Iterable[int], always_on: set[int],
              clocks: RunClocks) -> Output:
        merged = merge(reports)  # every rank's last report, by rank
        calls = merged.calls
        joined = calls.joined()  # read once for the clocks and the figures
        if calls:  # the step's calls teach the offsets first, and are then compared on the run's clock
            clocks.learn_packed(calls, joined)
        # RunStepMetrics v5: the per-rank figures written as columns straight from the arrays
        record = {"run_id": run_id, "step": step, **rank_figures_of(merged.ranks, merged.step_time_ns),
                  "step_times": step_time_columns(merged.ranks, merged.step_time_ns),
                  **packed_step_collectives(calls, list(everyone), merged.unmeasured - always_on,
                                            clocks.offset_column(calls.ranks), joined, packed=True),
                  "work": run_work_of(merged.work_ranks, merged.work, merged.work_present),
                  "rank_clocks": clocks.estimate_columns(calls.ranks)}
        self.counts.run_steps += 1
        value = encode_run_step_metrics(record)
        if len(value) > MAX_MESSAGE_BYTES - DEAD_LETTER_ROOM_BYTES:
            return self._too_large(run_id, step, value)
        return Output(self.topics.run, run_id.encode(), value, None)

    def _too_large(self, run_id: str, step: int, value: bytes) -> Output:
        """A RunStepMetrics over the size a message may have (every rank is listed, with its
        calls and clock: tens of thousands of ranks with collectives) goes to the dead-letter
        topic, truncated, with reason ``too_large``, rather than failing its transaction again
        and again; said once per run."""
        self.counts.decode_errors["too_large"] += 1
        detail = (f"RunStepMetrics of run {run_id} step {step} is {len(value)} bytes, over the "
                  f"{MAX_MESSAGE_BYTES - DEAD_LETTER_ROOM_BYTES}-byte limit of a run step")
        if run_id not in self._too_large_said:
            if len(self._too_large_said) >= 1024:
                self._too_large_said.clear()
            self._too_large_said.add(run_id)
            log.error("profstream run stage: %s; its run steps go to %s (reason too_large) and are not exported: "
                      "capture collectives on fewer ranks, or see docs/deploy.md (a run step's size)",
                      detail, self.topics.dlq)
        return dead_letter_of(self.topics.dlq, run_id.encode(), value, "too_large", detail,
                              f"{self.topics.run}/{run_id}/{step}")


def _gone(ended: dict[int, int | None], pending: StepReports, step: int) -> int:
    """How many ranks that did not report ``step`` ended before it (or without a step)."""
    if not ended:
        return 0
    before = [r for r, last in ended.items() if last is None or last < step]
    return int((~np.isin(np.array(before, np.int64), pending.reported)).sum()) if before else 0


_PROCESSOR_ACLS = "`profstream acl show --role processor` lists a processor's ACLs"
# The topics a processor reads and writes (base names): on a broker with ACLs it sees no other.
PROCESSOR_TOPICS = ("raw", "steps", "partials", "run", "alerts", "dlq", "state", "run-state")


# The run stage commits a transaction with no run step, alert or moved offset in it at most
# this often: while a step's partials trickle in (~20 s at 16,384 ranks) its commits would
# only rewrite the run's RunCheckpoint, which a restart rebuilds by re-reading anyway
# (docs/exactly-once.md). Its outputs still commit as soon as they are ready.
RUN_IDLE_COMMIT_MS = 5000.0


class Processor:
    """A processor process: the step stage and (by default) the run stage, each in its own
    consumer group and thread, exactly once. ``instance_id`` must be unique per process and
    stable across its restarts."""

    def __init__(self, conn: Connection | str, topics: Topics, group_id: str = "profstream-processor",
                 instance_id: str = "0", grace_s: float = 2.0, idle_timeout_s: float = 60.0,
                 run_grace_s: float = 10.0, figure_options: FigureOptions | None = None,
                 commit_interval_ms: float = 100.0, stages: str = "all", compression: str = "lz4",
                 health: ProcessorHealth | None = None, max_outage_s: float = MAX_OUTAGE_S,
                 hang_after_s: float = HANG_AFTER_S, run_idle_commit_ms: float = RUN_IDLE_COMMIT_MS) -> None:
        if stages not in ("all", "steps", "run"):
            raise ValueError("stages must be all, steps or run")
        self.health = health or ProcessorHealth()
        self.loops: list[TransactionalLoop] = []
        self.step_stage: StepStage | None = None
        self.run_stage: RunStage | None = None
        # Each stage counts into its own StageCounts, added to the health totals when its
        # loop commits and thrown away when it aborts.
        if stages in ("all", "steps"):
            counts = StageCounts()
            self.step_stage = StepStage(topics, _partition_count(conn, topics.steps), counts,
                                        grace_s, idle_timeout_s, figure_options,
                                        partials_partitions=_partition_count(conn, topics.partials))
            self.loops.append(TransactionalLoop(
                conn, self.step_stage, group_id, instance_id, commit_interval_ms, compression=compression,
                on_commit=lambda _n, c=counts: self.health.commit(c, transaction=True), on_abort=counts.clear,
                max_outage_s=max_outage_s))
        if stages in ("all", "run"):
            counts = StageCounts(keep_step_ends=False)
            self.run_stage = RunStage(topics, counts, run_grace_s, idle_timeout_s, hang_after_s)
            self.loops.append(TransactionalLoop(
                conn, self.run_stage, f"{group_id}-run", instance_id, commit_interval_ms,
                compression=compression, on_commit=lambda _n, c=counts: self.health.commit(c),
                on_abort=counts.clear, max_outage_s=max_outage_s, idle_commit_interval_ms=run_idle_commit_ms))
        self._lag = LagProbe(conn, group_id, topics.raw) if self.step_stage is not None else None
        self.health.bind(self)
        self._stop = threading.Event()

    def run(self, stop: threading.Event | None = None) -> None:
        """Run every stage until ``stop`` (or ``self.stop()``) is set; re-raises a stage's error."""
        if stop is not None:
            self._stop = stop
        stop = self._stop
        errors: list[BaseException] = []

        def work(loop: TransactionalLoop) -> None:
            try:
                loop.run(stop)
            except BaseException as e:
                errors.append(e)
                stop.set()

        threads = [threading.Thread(target=work, args=(loop,), name=f"profstream-{type(loop.stage).__name__}",
                                    daemon=True) for loop in self.loops[1:]]
        for t in threads:
            t.start()
        work(self.loops[0])
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def stop(self) -> None:
        self._stop.set()

    def describe(self) -> str:
        """Every stage's loop, one line each (``kill -USR1`` logs it with the threads' stacks)."""
        return "\n".join(loop.describe() for loop in self.loops)

    def lag(self) -> int | None:
        """Raw messages the step stage has not consumed yet, from the broker's end offsets
        (asked at most once a second); 0 without a step stage; None (unknown) while the
        broker does not answer."""
        if self._lag is None:
            return 0
        loop = self.loops[0]
        return self._lag.measure(loop.assignment(), loop.positions())

    @property
    def kafka_reachable(self) -> bool:
        """Whether the broker answered the last lag probe."""
        return self._lag is None or self._lag.reachable


def _partition_count(conn: Connection | str, topic: str) -> int:
    from profstream.kafka.clients import make_consumer

    consumer = make_consumer(conn, group_id=None)
    try:
        parts = consumer.partitions_for_topic(topic)
    finally:
        consumer.close()
    if not parts:
        from profstream.kafka.diagnose import topic_denied

        raise RuntimeError(topic_denied(Connection.of(conn), topic, "WRITE", hint=_PROCESSOR_ACLS)
                           or f"topic {topic} does not exist: create it with ensure_topics / `profstream process`")
    return len(parts)
