"""StepStage.ready() visits only the ranks that may close something: each rank's steps still
close on the same call, for the same reason, as when every rank was visited. No Kafka."""

from __future__ import annotations

import random
from collections import namedtuple

from profstream.kafka.topics import Topics
from profstream.processors.health import StageCounts
from profstream.processors.runtime import StepStage
from profstream.schema.batch import encode_batch
from profstream.schema.codec import decode
from tests.test_assembler import batch

GRACE_S, IDLE_S = 2.0, 60.0
Rec = namedtuple("Rec", "topic partition offset key value")


class Streams:
    """Raw records of several ranks of run "r", with per-rank seqs and one offset counter."""

    def __init__(self, topics: Topics) -> None:
        self.topics = topics
        self.seq: dict[int, int] = {}
        self.offset = 0

    def __call__(self, rank: int, ops_steps=(), marks=(), watermark=None) -> Rec:
        b = batch(self.seq.get(rank, 0), ops_steps=ops_steps, marks=marks, watermark=watermark,
                  producer=f"p{rank}")
        b.rank = rank
        self.seq[rank] = self.seq.get(rank, 0) + 1
        self.offset += 1
        return Rec(self.topics.raw, rank % 2, self.offset - 1, b.key, encode_batch(b))


def _stage(topics: Topics, cls=StepStage) -> StepStage:
    return cls(topics, 1, StageCounts(keep_step_ends=False), grace_s=GRACE_S, idle_timeout_s=IDLE_S)


class VisitEveryRank(StepStage):
    """The stage as it was before: ready() visits every rank on every call."""

    def _due(self, now: float) -> list[tuple[str, int]]:
        self.schedule.dirty.clear()
        return sorted(self.ranks, key=lambda ident: self.ranks[ident].order)


def _closed(stage: StepStage, outputs) -> list[tuple[int, int, str]]:
    """(rank, step, closed_by) of each StepMetrics among outputs."""
    steps = [decode("StepMetrics", o.value) for o in outputs if o.topic == stage.topics.steps]
    return [(s["rank"], s["step"], s["closed_by"]) for s in steps]


def _same(stage: StepStage, outputs) -> list:
    """Outputs to compare between two stages: StepMetrics decoded, less the wall clock of
    their closing (``closed_ns``)."""
    same = []
    for o in outputs:
        if o.topic == stage.topics.steps:
            same.append((o.topic, o.key, o.partition, {**decode("StepMetrics", o.value), "closed_ns": 0}))
        else:
            same.append(o)
    return same


def _freed(stage: StepStage, outputs) -> list[bytes]:
    return [o.key for o in outputs if o.topic == stage.state_topic and o.value is None]


def test_a_rank_without_watermark_closes_after_grace_while_other_ranks_keep_streaming():
    topics = Topics(prefix="grace")
    stage, feed = _stage(topics), Streams(topics)
    stage.fold(feed(7, ops_steps=[0, 0], marks=[0]), 10.0)  # rank 7 never sends a watermark
    assert _closed(stage, stage.ready(10.0)) == []
    now, seen = 10.0, []
    for step in range(30):  # ranks 0-3 stream a step every 0.1 s, closed at their watermark
        now = 10.05 + 0.1 * step
        for rank in range(4):
            stage.fold(feed(rank, ops_steps=[step], marks=[step], watermark=step), now)
        seen += [(now, c) for c in _closed(stage, stage.ready(now))]
    grace = [(t, c) for t, c in seen if c[0] == 7]
    assert grace == [(12.05, (7, 0, "grace"))], f"rank 7's closes (time, (rank, step, reason)): {grace}"
    assert sorted(c for _, c in seen if c[0] != 7) == sorted((r, s, "watermark") for r in range(4) for s in range(30))


def test_an_idle_rank_is_freed_on_time_with_its_marked_step_while_others_stream():
    topics = Topics(prefix="idle")
    stage, feed = _stage(topics), Streams(topics)
    stage.fold(feed(5, ops_steps=[0], marks=[0], watermark=None), 0.0)
    stage.fold(feed(5, ops_steps=[1], marks=[1], watermark=0), 0.5)  # step 1 marked, its watermark never comes
    assert _closed(stage, stage.ready(0.5)) == [(5, 0, "watermark")]
    freed_at, closed = [], []
    for i in range(1, 130):
        now = 0.5 * i + 0.25
        stage.fold(feed(0, ops_steps=[i], marks=[i], watermark=i), now)
        out = stage.ready(now)
        closed += [c for c in _closed(stage, out) if c[0] == 5]
        freed_at += [now for _ in _freed(stage, out)]
    assert freed_at == [60.75], f"rank 5 last seen at 0.5, idle timeout {IDLE_S} s: freed at {freed_at}"
    assert closed == [(5, 1, "idle")]
    assert ("r", 5) not in stage.ranks and ("r", 0) in stage.ranks


def test_a_restored_rank_closes_its_reread_grace_step_and_goes_idle():
    topics = Topics(prefix="restore")
    first, feed = _stage(topics), Streams(topics)
    records = [feed(3, ops_steps=[0], marks=[0]), feed(3, ops_steps=[1, 1]), feed(3, marks=[1])]
    for rec in records:
        first.fold(rec, 0.0)
    assert _closed(first, first.ready(2.0)) == [(3, 0, "grace"), (3, 1, "grace")]
    first.fold(feed(3, ops_steps=[2]), 2.5)
    records.append(feed(3, marks=[2]))
    first.fold(records[-1], 3.0)  # step 2 waits out its grace when the processor stops
    checkpoint = first.changed_state()
    committed = first.commit_offset(1, records[-1].offset + 1)

    restarted, other = _stage(topics), Streams(topics)
    for out in checkpoint:
        restarted.restore(out.partition, out.key, out.value, 100.0)
    for rec in [r for r in records if r.offset >= committed]:  # re-read from the committed offset
        restarted.fold(rec, 100.0)
    emitted = []
    for now in (100.0, 101.0, 101.9, 102.0, 103.0):
        restarted.fold(other(0, ops_steps=[0], marks=[0], watermark=0), now)  # another rank keeps streaming
        emitted += [(now, c) for c in _closed(restarted, restarted.ready(now)) if c[0] == 3]
    assert emitted == [(102.0, (3, 2, "grace"))]
    out = restarted.ready(160.0)
    assert _freed(restarted, out) == [b"r/3"], "the restored rank, last seen at 100 s, is idle at 160 s"


def test_ready_closes_what_visiting_every_rank_closes_call_by_call():
    """A seeded mix: ranks with and without watermarks, marks out of order, ranks that stop
    and come back, a clock that goes back a little, partitions revoked and restored."""
    topics = Topics(prefix="same")
    rng = random.Random(14)
    lean, every = _stage(topics), _stage(topics, VisitEveryRank)
    feed = Streams(topics)
    next_step = {rank: 0 for rank in range(12)}
    changelog: dict[tuple[int, bytes], bytes | None] = {}  # the state topic, compacted
    now, calls = 0.0, 0
    for _ in range(1500):
        now += rng.choice((0.0, 0.01, 0.3, 1.0, -0.05))
        rank = rng.randrange(12)
        if rank in (10, 11) and now > 40.0 and now < 130.0:
            continue  # ranks 10 and 11 pause past the idle timeout, then come back
        step = next_step[rank]
        with_watermark = rank % 3 != 0
        ops = [step, step + 1] if rng.random() < 0.3 else [step]
        marks = [step] if rng.random() < 0.7 else []
        if marks and rng.random() < 0.1:
            marks = [step + 1, step]  # two marks in one batch, the later one first
        if marks:
            next_step[rank] = max(marks) + 1
        rec = feed(rank, ops_steps=ops, marks=marks, watermark=max(step - 1, 0) if with_watermark else None)
        assert lean.fold(rec, now) == every.fold(rec, now)
        if rng.random() < 0.6:
            calls += 1
            out = lean.ready(now)
            assert _same(lean, out) == _same(every, every.ready(now)), f"ready({now}), call {calls}"
            state = lean.changed_state()
            assert state == every.changed_state()
            changelog.update(((o.partition, o.key), o.value) for o in out + state if o.topic == lean.state_topic)
        if rng.random() < 0.01:  # revoke partition 1 and restore it from the changelog
            for stage in (lean, every):
                stage.drop_partitions([1])
                for (partition, key), value in changelog.items():
                    if partition == 1:
                        stage.restore(partition, key, value, now)
    for later in (now + 1.0, now + GRACE_S, now + IDLE_S, now + IDLE_S + GRACE_S + 1.0, now + 2 * IDLE_S):
        assert _same(lean, lean.ready(later)) == _same(every, every.ready(later))
    assert lean.ranks == {} and every.ranks == {}
    assert calls > 500


def test_a_rank_whose_last_batch_came_on_an_earlier_clock_is_idle_from_that_clock():
    """Offline replay feeds each message at its own clock, which can step back: the idle
    timeout counts from the rank's last batch, as the assembler saw it."""
    topics = Topics(prefix="back")
    stage, feed = _stage(topics), Streams(topics)
    stage.fold(feed(2, ops_steps=[0], marks=[0], watermark=0), 10.0)
    assert _closed(stage, stage.ready(10.0)) == [(2, 0, "watermark")]
    stage.fold(feed(2, ops_steps=[1]), 50.0)  # no mark: nothing to close, only its last-seen moves
    assert _freed(stage, stage.ready(70.0)) == []
    stage.fold(feed(2, ops_steps=[1]), 49.5)
    assert _freed(stage, stage.ready(109.4)) == []
    assert _freed(stage, stage.ready(109.5)) == [b"r/2"]
