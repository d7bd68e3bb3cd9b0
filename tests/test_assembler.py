"""Step closing rules and per-rank bookkeeping, without Kafka."""

from __future__ import annotations

import numpy as np

from profstream.processors.assembler import RankAssembler
from profstream.schema.batch import COMPUTE, EventBatch

S0 = 1_000_000_000


def batch(seq: int, ops_steps=(), marks=(), watermark=None, producer="p1", dropped_ops=0) -> EventBatch:
    """A batch with one 10 ns compute op per entry of ops_steps and a mark per entry of marks."""
    b = EventBatch(run_id="r", rank=0, producer_id=producer, seq=seq, complete_through_step=watermark,
                   dropped_ops=dropped_ops, op_names=["mm"], op_types=["MatMul"])
    n = len(ops_steps)
    steps = np.array(ops_steps, dtype=np.int64)
    b.ops = {"name_idx": np.zeros(n, np.int32), "type_idx": np.zeros(n, np.int32),
             "kind": np.full(n, COMPUTE, np.uint8), "stream": np.zeros(n, np.int32), "step": steps,
             "start_ns": S0 + steps * 1000 + 100, "dur_ns": np.full(n, 10, np.int64)}
    m = np.array(marks, dtype=np.int64)
    b.steps = {"step": m, "start_ns": S0 + m * 1000, "end_ns": S0 + m * 1000 + 900,
               "fp_start_ns": np.full(len(m), -1, np.int64), "bp_end_ns": np.full(len(m), -1, np.int64)}
    return b


def test_a_step_closes_at_the_watermark_not_before():
    asm = RankAssembler("r", 0)
    asm.add(batch(0, ops_steps=[0, 0, 1], marks=[0], watermark=None), now=0.0)
    assert asm.close_ready(0.0) == []  # mark, but no watermark yet and grace not over
    asm.add(batch(1, ops_steps=[1], marks=[1], watermark=0), now=0.1)
    closed = asm.close_ready(0.1)
    assert [(ev.step, reason, len(ev.op_kind)) for ev, reason in closed] == [(0, "watermark", 2)]
    asm.add(batch(2, watermark=1), now=0.2)
    assert [(ev.step, len(ev.op_kind)) for ev, _ in asm.close_ready(0.2)] == [(1, 2)]


def test_without_a_watermark_a_step_closes_after_the_grace_period():
    asm = RankAssembler("r", 0, grace_s=2.0)
    asm.add(batch(0, ops_steps=[0], marks=[0]), now=10.0)
    assert asm.close_ready(11.9) == []
    assert [(ev.step, reason) for ev, reason in asm.close_ready(12.0)] == [(0, "grace")]


def test_events_for_a_closed_step_are_counted_late_and_not_folded_in():
    asm = RankAssembler("r", 0)
    asm.add(batch(0, ops_steps=[0], marks=[0], watermark=0), now=0.0)
    (ev, _), = asm.close_ready(0.0)
    asm.add(batch(1, ops_steps=[0, 0, 0], marks=[0]), now=0.1)
    assert asm.late_events == 4
    assert asm.open == {}
    assert len(ev.op_kind) == 1


def test_seq_gaps_count_lost_batches_and_drops_are_summed():
    asm = RankAssembler("r", 0)
    for seq in (0, 1, 4, 5):
        asm.add(batch(seq, dropped_ops=3), now=0.0)
    asm.add(batch(0, producer="p2"), now=0.0)  # a restarted producer starts its own sequence
    assert asm.lost_batches == 2
    assert asm.dropped_ops == 12


def test_a_step_whose_mark_never_came_is_discarded_and_counted_when_a_later_one_closes():
    asm = RankAssembler("r", 0)
    asm.add(batch(0, ops_steps=[3, 3, 4], marks=[4], watermark=4), now=0.0)
    closed = asm.close_ready(0.0)
    assert [ev.step for ev, _ in closed] == [4]
    assert asm.orphan_events == 2 and asm.open == {}


def test_a_re_read_batch_refeeds_open_steps_without_counting_anything_twice():
    """What a restarted processor does with batches between the committed offset and the
    position its checkpoint was taken at."""
    first = RankAssembler("r", 0)
    b0 = batch(0, ops_steps=[0, 1], marks=[0], watermark=0, dropped_ops=5)
    b1 = batch(1, ops_steps=[1], dropped_ops=1)
    first.add(b0, now=0.0, offset=10)
    first.close_ready(0.0)
    first.add(b1, now=0.0, offset=11)
    assert first.min_open_offset == 10  # step 1 was first fed by the batch at offset 10
    restored = RankAssembler.restore(first.snapshot(), grace_s=2.0, partition=0, now=1.0)
    for b, offset in ((b0, 10), (b1, 11)):  # re-read from the committed offset
        assert restored.add(b, now=1.0, offset=offset) is False
    assert (restored.dropped_ops, restored.late_events, restored.events) == (6, 0, first.events)
    restored.add(batch(2, marks=[1], watermark=1), now=1.1, offset=12)
    (ev, _), = restored.close_ready(1.1)
    assert ev.step == 1 and len(ev.op_kind) == 2  # both ops of step 1, once each


def test_a_batch_in_the_raw_topic_twice_feeds_its_steps_once_however_the_reads_are_grouped():
    """An idempotent producer's resend under a bumped epoch puts a batch in the log twice,
    possibly after later batches. A processor catching up reads both copies before the step
    can close; one reading live may close the step between them. Both must count it once."""
    b0 = batch(0, ops_steps=[0, 1], marks=[0])
    b1 = batch(1, ops_steps=[1, 1], marks=[1], watermark=0)
    b2 = batch(2, ops_steps=[2], marks=[2], watermark=1)
    log = [b0, b1, b0, b1, b2]  # b0 and b1 again, after b1
    catching_up, live = RankAssembler("r", 0), RankAssembler("r", 0)
    closed_catching_up, closed_live = [], []
    for offset, b in enumerate(log):
        catching_up.add(b, now=0.0, offset=offset)
        live.add(b, now=0.0, offset=offset)
        closed_live += live.close_ready(0.0)
    closed_catching_up += catching_up.close_ready(0.0)
    for closed, asm in ((closed_catching_up, catching_up), (closed_live, live)):
        assert [(ev.step, len(ev.op_kind)) for ev, _ in closed] == [(0, 1), (1, 3)]
        assert asm.lost_batches == 0 and asm.late_events == 0
    assert catching_up.duplicate_batches == 2  # both copies found their steps open
    assert catching_up.events == live.events == 8  # 5 ops and 3 marks, the copies not counted


def test_after_a_restart_a_re_read_batch_still_feeds_its_open_step_and_its_copy_does_not():
    first = RankAssembler("r", 0)
    b0 = batch(0, ops_steps=[0, 1], marks=[0], watermark=0)
    first.add(b0, now=0.0, offset=10)
    first.close_ready(0.0)
    restored = RankAssembler.restore(first.snapshot(), grace_s=2.0, partition=0, now=1.0)
    restored.add(b0, now=1.0, offset=10)  # the re-read: step 1's op is not in the checkpoint
    restored.add(b0, now=1.0, offset=11)  # a copy of it further on
    restored.add(batch(1, marks=[1], watermark=1), now=1.1, offset=12)
    (ev, _), = restored.close_ready(1.1)
    assert ev.step == 1 and len(ev.op_kind) == 1 and restored.duplicate_batches == 1
