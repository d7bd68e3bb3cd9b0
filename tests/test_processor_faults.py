"""Processor faults that need no broker restart (those are in tests/faults/): aborted
transactions, a changelog readable later than the offsets committed with it, messages too
large to forward whole, names a Monitor would refuse."""

from __future__ import annotations

import os
import time
from collections import Counter

import confluent_kafka
import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from kafka import KafkaConsumer

from profstream.kafka.clients import make_transactional_producer, read_topic
from profstream.kafka.deadline import CallTimeout
from profstream.kafka.limits import DEAD_LETTER_ROOM_BYTES, MAX_MESSAGE_BYTES
from profstream.processors.checkpoint import ProcessorUnavailable, _ConsumerFailure, commit_marker
from profstream.processors.runtime import Processor, run_partition
from profstream.schema.batch import EventBatch, encode_batch
from profstream.schema.codec import decode, encode
from profstream.simulate import SimConfig, expected, run_simulation
from tests.helpers import step_records, wait_until
from tests.test_grafana_client import step_metrics
from tests.test_processor import RunningProcessor


def _dead_letters(bootstrap: str, topic: str, count: int, timeout: float = 30.0) -> list:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             isolation_level="read_committed", consumer_timeout_ms=int(timeout * 1000),
                             max_partition_fetch_bytes=4 * MAX_MESSAGE_BYTES)
    consumer.subscribe([topic])
    out = []
    for rec in consumer:
        out.append(rec)
        if len(out) == count:
            break
    consumer.close()
    return out


def _produce(bootstrap: str, topic: str, messages: list[tuple[bytes, bytes]], max_bytes: int = MAX_MESSAGE_BYTES):
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "message.max.bytes": max_bytes})
    for key, value in messages:
        producer.produce(topic, value, key)
    assert producer.flush(30) == 0


def test_aborted_transactions_count_nothing_twice_and_lose_nothing(kafka_bootstrap, topics):
    """Counters count what was committed: a transaction thrown away (here by faults injected
    into the loop, as a broker restart would) takes its counts with it, and the re-read
    input counts once more when it commits."""
    cfg = SimConfig(run_id="aborts", ranks=2, steps=60, ops_per_step=50, seed=7)
    run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix, "batch_interval_ms": 5})
    garbage = [(b"aborts/0", b"not avro %d" % i) for i in range(8)]
    _produce(kafka_bootstrap, topics.raw, garbage)
    total = cfg.ranks * cfg.steps

    processor = Processor(kafka_bootstrap, topics, group_id=f"g-{topics.prefix}", grace_s=0.5, stages="steps")
    loop, counts, health = processor.loops[0], processor.step_stage.counts, processor.health
    faults = [CallTimeout("injected: a call that never returns"),
              KafkaException(KafkaError(KafkaError._TIMED_OUT, "injected: a transaction that timed out"))]
    injected = thrown_away = 0
    deadline = time.monotonic() + 90
    try:
        while health.steps_closed < total and time.monotonic() < deadline:
            loop.step()
            # every few polls with work open, a fault: abort (or replace the producer) and rebuild
            if loop._txn_started is not None and counts.steps_closed and injected < 6:
                thrown_away += counts.steps_closed

                def fault(f=faults[injected % 2]):
                    raise f

                loop._guarded(fault)
                injected += 1
        for _ in range(20):  # let a late duplicate show itself
            loop.step()
    finally:
        loop.close()
    assert injected == 6 and thrown_away > 0, "no transaction with counted steps was aborted"
    assert loop.recoveries == 6 and loop.aborts == 6
    steps = step_records(kafka_bootstrap, topics.steps, "aborts", total + 1, timeout=5, full=False)
    assert Counter((s["rank"], s["step"]) for s in steps) == Counter(expected(cfg).keys())
    assert health.steps_closed == total
    assert health.decode_errors == Counter({"not_avro": 8})
    assert health.events["ops"] == cfg.ranks * cfg.steps * cfg.ops_per_step
    assert health.events["steps"] == total
    assert len(health.freshness_s) == total


def test_recoveries_that_reach_no_broker_add_up_to_an_outage_until_kafka_is_heard_from(kafka_bootstrap, topics):
    """A consumer out of its group is replaced; with no partitions left to rebuild, that
    recovery asks no broker, so it is no sign that Kafka is back. Such recoveries one after
    another must end in ProcessorUnavailable after max_outage_s; a loop that was assigned its
    partitions again in between (Kafka answered) starts counting afresh."""
    processor = Processor(kafka_bootstrap, topics, group_id=f"g-{topics.prefix}", stages="steps", max_outage_s=1.0)
    loop = processor.loops[0]

    def out_of_group():
        raise _ConsumerFailure(KafkaError(KafkaError._STATE, "injected: the consumer has been out of its group"))

    def assigned():
        wait_until(lambda: loop.step() or loop.assignment(), 60, "the loop's partitions assigned")

    def past_the_limit(since):
        wait_until(lambda: time.monotonic() - since > 1.5, 5, "the outage limit to pass")

    try:
        assigned()
        for _ in range(2):  # Kafka heard from between the recoveries: each is a new outage
            at = time.monotonic()
            loop._guarded(out_of_group)
            assigned()
            past_the_limit(at)
        at = time.monotonic()
        loop._guarded(out_of_group)  # nothing heard from Kafka after it
        past_the_limit(at)
        with pytest.raises(ProcessorUnavailable, match="has not recovered"):
            loop._guarded(out_of_group)
    finally:
        loop.close()
    assert loop.recoveries == 3


def test_a_rebuild_waits_for_the_changelog_of_the_commit_its_offsets_name(kafka_bootstrap, topics):
    """Kafka shows a transaction's committed offsets before its changelog records can be read
    (the coordinator writes the commit markers after commit_transaction returns; a new
    leader may expose its last records later). Here an earlier run stage's offsets are
    committed and its state (floor 1: run step 0 made) becomes readable only 3 s after the
    processor took the partition. Step 0's last report lies past the committed offset: read
    with an older state, it would make run step 0 a second time."""
    bootstrap, part = kafka_bootstrap, run_partition("r", 3)
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap})
    for rank, step in [(0, 0), (0, 1), (1, 0), (1, 1)]:  # offset 1 (step 1's first report) was committed
        producer.produce(topics.partials, encode("StepMetrics", step_metrics("r", rank, step, 100 * step)), b"r", part)
    assert producer.flush(30) == 0
    producer.close()
    token = time.time_ns()
    group = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{topics.prefix}-run"})
    offsets = make_transactional_producer(bootstrap, f"{topics.prefix}-earlier-offsets")
    offsets.init_transactions(30)
    offsets.begin_transaction()
    offsets.send_offsets_to_transaction([TopicPartition(topics.partials, part, 1, metadata=str(token))],
                                        group.consumer_group_metadata(), 30)
    offsets.commit_transaction(30)
    offsets.close()
    group.close()
    state = make_transactional_producer(bootstrap, f"{topics.prefix}-earlier-state")
    state.init_transactions(30)
    state.begin_transaction()
    state.produce(topics.run_state, encode("RunCheckpoint", {"run_id": "r", "floor": 1, "ranks": [0, 1]}), b"r", part)
    marker = commit_marker(topics.run_state, part, token)
    state.produce(marker.topic, marker.value, marker.key, marker.partition)
    assert state.flush(30) == 0  # written, not committed: a read_committed reader stops before it
    run_steps: list[dict] = []
    with RunningProcessor(bootstrap, topics, stages="run", run_grace_s=0.5) as processor:
        loop = processor.loops[0]
        wait_until(lambda: part in loop.assignment(), 60, "the run stage took its partition")
        time.sleep(3)  # the fault: the state's commit markers arrive late
        state.commit_transaction(30)
        step_1 = read_topic(bootstrap, topics.run, lambda m: run_steps.append(m) or m["step"] == 1, 1, 60,
                            decode=lambda v: decode("RunStepMetrics", v))
        assert step_1, f"short read: no run step 1 within 60 s (read {[m['step'] for m in run_steps]})"
    state.close()
    assert [m["step"] for m in run_steps] == [1], "run step 0 was made again from a state older than the offsets"
    assert sorted(run_steps[0]["step_times_ns"]) == ["0", "1"]


def test_a_message_too_large_to_forward_whole_goes_to_the_dead_letter_topic_truncated(kafka_bootstrap, topics):
    # within what the raw topic takes (profstream.kafka.limits), beyond what fits a dead letter
    big = os.urandom(MAX_MESSAGE_BYTES + 10_000)
    cfg = SimConfig(run_id="after-big", ranks=1, steps=30, ops_per_step=40, seed=3)
    with RunningProcessor(kafka_bootstrap, topics) as processor:
        _produce(kafka_bootstrap, topics.raw, [(b"foreign/0", big)], max_bytes=2 * MAX_MESSAGE_BYTES)
        run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
        steps = step_records(kafka_bootstrap, topics.steps, "after-big", cfg.steps)
        [dead] = _dead_letters(kafka_bootstrap, topics.dlq, 1)
        aborts = processor.loops[0].aborts
    assert sorted(s["step"] for s in steps) == list(range(cfg.steps))
    assert aborts == 0, "the large message made the processor abort"
    headers = {k: v.decode() for k, v in dead.headers}
    assert headers["reason"] == "not_avro"
    assert headers["truncated_from"] == str(len(big))
    assert headers["origin"].startswith(f"{topics.raw}/")
    assert dead.value == big[:MAX_MESSAGE_BYTES - DEAD_LETTER_ROOM_BYTES]
    assert dead.key == b"foreign/0"


def test_names_a_monitor_would_refuse_go_to_the_dead_letter_topic(kafka_bootstrap, topics):
    bad = {"x" * 300: "run_id", "nul\x00run": "run_id", "../../etc": "run_id"}
    messages = [(b"bad/0", encode_batch(EventBatch(run_id=name, rank=0))) for name in bad]
    messages.append((b"bad/0", encode_batch(EventBatch(run_id="fine", rank=0, host="a/b"))))
    cfg = SimConfig(run_id="named", ranks=1, steps=10, ops_per_step=20, seed=1)
    with RunningProcessor(kafka_bootstrap, topics) as processor:
        _produce(kafka_bootstrap, topics.raw, messages)
        run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
        steps = step_records(kafka_bootstrap, topics.steps, "named", cfg.steps)
        dead = _dead_letters(kafka_bootstrap, topics.dlq, len(messages))
        health = processor.health
        deadline = time.monotonic() + 10
        while health.decode_errors["invalid_name"] < len(messages) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(steps) == cfg.steps
    assert [dict(d.headers)["reason"] for d in dead] == [b"invalid_name"] * len(messages)
    details = [dict(d.headers)["detail"].decode() for d in dead]
    assert any("host 'a/b'" in d for d in details) and any("run_id '../../etc'" in d for d in details)
    assert health.decode_errors["invalid_name"] == len(messages)
