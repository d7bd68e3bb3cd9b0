"""A broker away longer than the Monitor's buffer lasts (issue 37): ops and samples are
dropped, and counted; no step is lost with them, a step that lost events says what it lost,
and the processor says every family of drops, and that it cannot know its lag meanwhile."""

from __future__ import annotations

import time

from profstream.simulate import SimConfig
from tests.faults.conftest import ProcessorProcess
from tests.faults.streaming import StreamingRun
from tests.helpers import wait_until


def test_an_outage_the_buffer_cannot_hold_loses_no_step_and_marks_the_partial_ones(broker, fault_topics, tmp_path):
    topics = fault_topics
    # 2 ranks x 10 steps/s x 100 ops for 70 s; a 2 MiB buffer holds ~52 steps' ops and 1,572
    # marks, and the broker is away for 15 s and its restart (the run goes on until it is
    # back, so that what the buffer kept is delivered): ~150 steps of each rank, most of their
    # ops dropped
    cfg = SimConfig(run_id="overflow", ranks=2, steps=700, ops_per_step=100, step_time_ms=100, seed=13,
                    rate="realtime")
    processor = ProcessorProcess(broker.bootstrap, topics, tmp_path / "processor.log").start()
    try:
        with StreamingRun(broker.bootstrap, topics, cfg, buffer_bytes="2MiB") as run:
            wait_until(lambda: len(run.steps.seen) >= 40, 60, "40 steps committed before the outage")
            broker.stop()
            away_until = time.monotonic() + 15.0
            # the processor cannot know its lag: it says so, and does not say 0
            away = wait_until(lambda: (m := processor.metrics() or {}).get("profstream_kafka_reachable") == 0 and m,
                              15, "the processor to see Kafka away")
            assert "profstream_consumer_lag_messages" not in away, away
            time.sleep(max(0.0, away_until - time.monotonic()))  # the outage's length is the fault itself
            broker.start()
            result = run.end(180)
            run.wait_committed(processor, 120, 60)
            wait_until(lambda: (processor.metrics() or {}).get("profstream_steps_closed_total", 0)
                       >= cfg.ranks * cfg.steps, 30, "every step counted")
            metrics = processor.metrics()
    finally:
        processor.stop()
    dropped_ops, dropped_samples = result.dropped_ops, result.dropped("dropped_samples")
    assert result.flushed and dropped_ops > 10_000 and result.dropped("dropped_marks") == 0, result.stats
    committed = run.check_once_and_clean()  # every step once: none lost with the ops
    partial = {k: m for k, m in committed.items() if m["dropped_ops"] or m["dropped_samples"]}
    assert len(partial) == result.dropped("partial_steps") > 100
    for m in committed.values():  # what arrived and what the mark says was lost make up the step
        assert m["op_count"] + m["dropped_ops"] == cfg.ops_per_step, m
    assert sum(m["dropped_ops"] for m in committed.values()) == dropped_ops
    # every family of drops, on the processor's /metrics
    assert metrics["profstream_producer_dropped_total"] == dropped_ops
    assert metrics["profstream_producer_dropped_samples_total"] == dropped_samples
    assert metrics["profstream_partial_steps_closed_total"] == len(partial)
    assert metrics.get("profstream_consumer_lag_messages") is not None  # known again
