"""The run stage's idle commits (issue #35): while a step's reports trickle in, a
transaction with nothing to emit and no committed offset to move waits for the run step
(or ``run_idle_commit_ms``) instead of committing every poll; what it defers a restart
rebuilds by re-reading, so every run step still comes once, whole. Through the real broker."""

from __future__ import annotations

import time

import confluent_kafka
from confluent_kafka import KafkaError, KafkaException

from profstream.kafka.clients import read_topic
from profstream.processors.runtime import Processor
from profstream.schema.codec import decode, encode
from tests.helpers import read_full
from tests.test_run_stage_partials import RANKS, _metrics


def _send(bootstrap: str, topic: str, ranks) -> None:
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap})
    for rank in ranks:
        producer.produce(topic, encode("StepMetrics", _metrics(rank, 0, [])), b"r")
    assert producer.flush(30) == 0


def _run_loop(bootstrap: str, topics, **kw):
    processor = Processor(bootstrap, topics, group_id=f"g-{topics.prefix}", stages="run", run_grace_s=60.0, **kw)
    return processor, processor.loops[0]


def _step_until(loop, condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        loop.step()


def _trickle(bootstrap: str, topics, loop, stage) -> None:
    """Every rank's StepMetrics of step 0, one at a time, each folded before the next is sent."""
    for rank in range(RANKS):
        _send(bootstrap, topics.partials, [rank])
        _step_until(loop, lambda n=rank + 1: "r" in stage.runs and (stage.runs["r"].floor or
                                                                    n == stage.runs["r"].pending[0].count),
                    30, f"rank {rank}'s report to be folded")
        for _ in range(3):  # drained polls: each one committed before
            loop.step()


def _run_steps(bootstrap: str, topics, count: int, timeout: float = 30.0) -> list[dict]:
    return read_full(bootstrap, topics.run, lambda r: r["run_id"] == "r", count, timeout,
                     decode=lambda v: decode("RunStepMetrics", v), what="RunStepMetrics")


def test_a_trickling_step_costs_the_run_stage_two_transactions_not_one_a_report(kafka_bootstrap, topics):
    processor, loop = _run_loop(kafka_bootstrap, topics)
    try:
        _step_until(loop, lambda: loop.assignment(), 30, "the run stage's partitions")
        _trickle(kafka_bootstrap, topics, loop, processor.run_stage)
        _step_until(loop, lambda: processor.health.run_steps == 1, 30, "the run step to commit")
        # the first report's (its partition's first committed offset) and the run step's; one
        # a report (8, and more for the drained polls between them) before
        assert loop.transactions <= 2, loop.transactions
    finally:
        loop.close()
    [run] = _run_steps(kafka_bootstrap, topics, 1)
    assert run["ranks_reported"] == RANKS and sorted(int(r) for r in run["step_times_ns"]) == list(range(RANKS))


def test_the_old_rule_still_holds_where_asked(kafka_bootstrap, topics):
    """run_idle_commit_ms at the commit interval: a commit every drained poll, as before."""
    processor, loop = _run_loop(kafka_bootstrap, topics, run_idle_commit_ms=100.0)
    try:
        _step_until(loop, lambda: loop.assignment(), 30, "the run stage's partitions")
        _trickle(kafka_bootstrap, topics, loop, processor.run_stage)
        _step_until(loop, lambda: processor.health.run_steps == 1, 30, "the run step to commit")
        assert loop.transactions >= RANKS, loop.transactions
    finally:
        loop.close()


def test_a_transaction_aborted_with_deferred_state_loses_no_rank_and_emits_once(kafka_bootstrap, topics):
    """Half the ranks folded, their state never committed (deferred), then the transaction
    thrown away (a broker fault): the rebuilt stage re-reads them and the run step has all."""
    processor, loop = _run_loop(kafka_bootstrap, topics)
    stage = processor.run_stage
    try:
        _step_until(loop, lambda: loop.assignment(), 30, "the run stage's partitions")
        half = RANKS // 2
        _send(kafka_bootstrap, topics.partials, [0])  # its partition's first offset: committed
        _step_until(loop, lambda: loop.transactions == 1, 30, "the first report's commit")
        _send(kafka_bootstrap, topics.partials, range(1, half))
        _step_until(loop, lambda: "r" in stage.runs and stage.runs["r"].pending[0].count == half, 30,
                    "half the ranks to be folded")
        for _ in range(3):
            loop.step()
        assert loop._txn_started is not None, "the ranks' state was committed: nothing deferred to lose"

        def fault():
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "injected: a transaction that timed out"))

        loop._guarded(fault)
        assert loop.aborts == 1 and stage.runs["r"].ranks == {0}  # as committed: ranks 1-3 to be read again
        _send(kafka_bootstrap, topics.partials, range(half, RANKS))
        _step_until(loop, lambda: processor.health.run_steps == 1, 30, "the run step to commit")
        for _ in range(10):  # a duplicate would show itself here
            loop.step()
    finally:
        loop.close()
    runs = read_topic(kafka_bootstrap, topics.run, lambda r: r["run_id"] == "r", 2, 5.0,
                      decode=lambda v: decode("RunStepMetrics", v))
    assert len(runs) == 1, [r["step"] for r in runs]
    assert runs[0]["ranks_reported"] == RANKS


def test_profstream_process_defaults_to_the_processors_idle_commit_interval():
    import inspect

    from profstream.cli.pipeline import process
    from profstream.processors.runtime import RUN_IDLE_COMMIT_MS

    assert inspect.signature(process).parameters["run_idle_commit_ms"].default == RUN_IDLE_COMMIT_MS
