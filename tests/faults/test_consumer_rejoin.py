"""A processor's consumer that is out of its group, or in it and receiving nothing, without an
error gets back to work.

The fault suite's broker-down-15s case hit this now and then on a loaded box: the consumer's
session timed out while the broker was away, the loop served the revocation of its lost
partitions only after a long rebuild, and librdkafka then never joined the group again
(cgrp state query-coord, "no broker available for coordinator query", for minutes after the
broker was back; processors/group_watch.py). No error is raised and the assignment is just
empty: the processor polls nothing, for good. The same silent state is made here at once
by unsubscribing the loop's consumer behind its back.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import confluent_kafka
import pytest
from confluent_kafka import KafkaError, KafkaException

from profstream.kafka.clients import native_consumer_config
from profstream.processors import checkpoint
from profstream.processors.group_watch import STUCK_AFTER_S
from profstream.processors.runtime import Processor
from profstream.simulate import SimConfig, expected, run_simulation
from tests.helpers import step_records

pytestmark = pytest.mark.faults


def _run(bootstrap: str, topics, run_id: str) -> SimConfig:
    cfg = SimConfig(run_id=run_id, ranks=2, steps=20, ops_per_step=20, seed=3)
    run_simulation(cfg, {"bootstrap": bootstrap, "topic_prefix": topics.prefix, "batch_interval_ms": 5})
    return cfg


def _processed_after(bootstrap: str, topics, fault, timeout_s: float, idle_s: float = 0.0) -> None:
    """A step stage processes a run; after ``idle_s`` with nothing to read (no recovery may
    happen then), ``fault(loop)``; a second run is produced: every step of it must be processed
    once, after exactly one recovery, within ``timeout_s``."""
    before = _run(bootstrap, topics, "before")
    processor = Processor(bootstrap, topics, group_id=f"g-{topics.prefix}", grace_s=0.5, stages="steps")
    loop, health = processor.loops[0], processor.health

    def process(steps: int, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while health.steps_closed < steps and time.monotonic() < deadline:
            loop.step()

    try:
        process(before.ranks * before.steps, 60)
        assert health.steps_closed == before.ranks * before.steps, "the run before the fault was not processed"
        idle_until = time.monotonic() + idle_s
        while time.monotonic() < idle_until:
            loop.step()
        assert loop.recoveries == 0, "a consumer with nothing to read was taken for a stuck one"
        fault(loop)
        after = _run(bootstrap, topics, "after")
        total = (before.ranks * before.steps) + (after.ranks * after.steps)
        process(total, timeout_s)
        assert health.steps_closed == total, (
            f"{total - health.steps_closed} steps of the run after the fault never processed; recoveries "
            f"{loop.recoveries}, state: {loop.describe()}")
        assert loop.recoveries == 1
    finally:
        loop.close()
    steps = step_records(bootstrap, topics.steps, "after", after.ranks * after.steps + 1, timeout=5, full=False)
    assert Counter((s["rank"], s["step"]) for s in steps) == Counter(expected(after).keys())


def test_a_consumer_silently_out_of_its_group_is_replaced_and_what_came_since_is_processed(broker, fault_topics):
    # out of the group, no error: as librdkafka left it
    _processed_after(broker.bootstrap, fault_topics, lambda loop: loop._consumer.unsubscribe(), STUCK_AFTER_S + 60)


def test_a_consumer_in_its_group_that_receives_nothing_while_its_input_grows_is_replaced(broker, fault_topics,
                                                                                         monkeypatch):
    """Joined, assigned, and nothing delivered (made here by pausing its partitions behind the
    loop's back): the input's ends grow unseen, so the loop replaces the consumer (input_watch.py);
    before that, 6 s idle with nothing to read gives no verdict."""
    from profstream.processors import input_watch

    monkeypatch.setattr(input_watch, "PROBE_AFTER_S", 1.0)
    monkeypatch.setattr(input_watch, "PROBE_EVERY_S", 1.0)
    monkeypatch.setattr(input_watch, "STUCK_AFTER_S", 4.0)
    _processed_after(broker.bootstrap, fault_topics, lambda loop: loop._consumer.pause(loop._consumer.assignment()),
                     60, idle_s=6.0)


def test_a_seek_that_never_returns_costs_the_consumer_not_the_loop(broker, fault_topics, monkeypatch):
    """confluent-kafka's seek() waits for librdkafka without a deadline: in the cluster-down
    fault test (2026-11-28) a recovery's seek never returned and the run stage stood still for
    minutes. A rebuild's seek now has the loop's call deadline; past it, the consumer is replaced."""
    release = threading.Event()  # set at the end: the abandoned seek returns
    stuck = threading.Event()

    class SeekMayHang(confluent_kafka.Consumer):
        def seek(self, partition):
            if stuck.is_set():
                release.wait()
            return super().seek(partition)

    made = checkpoint.make_native_consumer
    monkeypatch.setattr(checkpoint, "make_native_consumer",
                        lambda conn, group, **kw: SeekMayHang(native_consumer_config(conn, group, **kw)))
    topics = fault_topics
    before = _run(broker.bootstrap, topics, "before")
    processor = Processor(broker.bootstrap, topics, group_id=f"g-{topics.prefix}", grace_s=0.5, stages="steps")
    loop, health = processor.loops[0], processor.health
    loop.call_timeout = 2.0
    try:
        deadline = time.monotonic() + 60
        while health.steps_closed < before.ranks * before.steps and time.monotonic() < deadline:
            loop.step()
        assert health.steps_closed == before.ranks * before.steps and loop.assignment()
        monkeypatch.setattr(checkpoint, "make_native_consumer", made)  # its replacement seeks as usual
        stuck.set()
        began = time.monotonic()
        loop._recover(KafkaException(KafkaError(KafkaError._TRANSPORT, "a fault")))  # rebuild: seek
        assert time.monotonic() - began < 20, "the recovery waited on the stuck seek"
        after = _run(broker.bootstrap, topics, "after")
        total = (before.ranks * before.steps) + (after.ranks * after.steps)
        deadline = time.monotonic() + 60
        while health.steps_closed < total and time.monotonic() < deadline:
            loop.step()
        assert health.steps_closed == total, f"not processed after the stuck seek; state: {loop.describe()}"
    finally:
        release.set()
        loop.close()
    steps = step_records(broker.bootstrap, topics.steps, "after", after.ranks * after.steps + 1, timeout=5, full=False)
    assert Counter((s["rank"], s["step"]) for s in steps) == Counter(expected(after).keys())
