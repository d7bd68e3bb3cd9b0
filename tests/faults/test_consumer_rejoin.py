"""A processor's consumer that is out of its group without an error gets back into it.

The fault suite's broker-down-15s case hit this now and then on a loaded box: the consumer's
session timed out while the broker was away, the loop served the revocation of its lost
partitions only after a long rebuild, and librdkafka then never joined the group again
(cgrp state query-coord, "no broker available for coordinator query", for minutes after the
broker was back; processors/group_watch.py). No error is raised and the assignment is just
empty: the processor polls nothing, for good. The same silent state is made here at once
by unsubscribing the loop's consumer behind its back.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from profstream.processors.group_watch import STUCK_AFTER_S
from profstream.processors.runtime import Processor
from profstream.simulate import SimConfig, expected, run_simulation
from tests.helpers import step_records

pytestmark = pytest.mark.faults


def _run(bootstrap: str, topics, run_id: str) -> SimConfig:
    cfg = SimConfig(run_id=run_id, ranks=2, steps=20, ops_per_step=20, seed=3)
    run_simulation(cfg, {"bootstrap": bootstrap, "topic_prefix": topics.prefix, "batch_interval_ms": 5})
    return cfg


def test_a_consumer_silently_out_of_its_group_is_replaced_and_what_came_since_is_processed(broker, fault_topics):
    topics = fault_topics
    before = _run(broker.bootstrap, topics, "before")
    processor = Processor(broker.bootstrap, topics, group_id=f"g-{topics.prefix}", grace_s=0.5, stages="steps")
    loop, health = processor.loops[0], processor.health
    try:
        deadline = time.monotonic() + 60
        while health.steps_closed < before.ranks * before.steps and time.monotonic() < deadline:
            loop.step()
        assert health.steps_closed == before.ranks * before.steps, "the run before the fault was not processed"
        loop._consumer.unsubscribe()  # out of the group, no error: as librdkafka left it
        after = _run(broker.bootstrap, topics, "after")
        total = (before.ranks * before.steps) + (after.ranks * after.steps)
        deadline = time.monotonic() + STUCK_AFTER_S + 60
        while health.steps_closed < total and time.monotonic() < deadline:
            loop.step()
        assert health.steps_closed == total, (
            f"{total - health.steps_closed} steps of the run after the fault never processed; consumer assignment "
            f"{loop.assignment()}, recoveries {loop.recoveries}")
        assert loop.recoveries == 1
    finally:
        loop.close()
    steps = step_records(broker.bootstrap, topics.steps, "after", after.ranks * after.steps + 1, timeout=5, full=False)
    assert Counter((s["rank"], s["step"]) for s in steps) == Counter(expected(after).keys())
