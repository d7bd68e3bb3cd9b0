"""A broker that stops, dies or stays away while a run streams: nothing lost, nothing
counted twice, every loss counted, and the processor back on its own within seconds."""

from __future__ import annotations

import threading
import time

import pytest

from profstream import Monitor
from profstream.kafka.clients import make_producer
from profstream.schema.batch import END_MARK
from profstream.simulate import SimConfig, run_simulation
from tests.faults.conftest import Broker, ProcessorProcess
from tests.faults.streaming import StreamingRun
from tests.helpers import raw_batches, topic_size, wait_until

# Each fault returns once Kafka answers again; True when the processor was restarted (its
# counters then start from zero: a new process counts what it committed itself).

def _broker_stop(broker: Broker, processor: ProcessorProcess) -> bool:
    broker.stop()
    _outage(15.0)
    broker.start()
    return False


def _broker_kill(broker: Broker, processor: ProcessorProcess) -> bool:
    broker.kill()
    broker.start()
    return False


def _both_killed(broker: Broker, processor: ProcessorProcess) -> bool:
    broker.kill()
    processor.kill()
    broker.start()
    processor.start()
    return True


def _counted(metrics: dict, steps: int, run_steps: int, garbage: int) -> bool:
    """Whether the processor's counters reached what the test sent (they count commits)."""
    return (metrics.get("profstream_steps_closed_total", 0) >= steps
            and metrics.get("profstream_run_steps_total", 0) >= run_steps
            and metrics.get("profstream_decode_errors_total{reason=not_avro}", 0) >= garbage)


def _outage(seconds: float) -> None:
    """The length of an outage is the fault itself, not a wait for a condition."""
    time.sleep(seconds)


FAULTS = {"broker-down-15s": _broker_stop, "broker-kill-9": _broker_kill, "broker-and-processor-kill-9": _both_killed}


@pytest.mark.parametrize("fault", FAULTS.values(), ids=FAULTS.keys())
def test_a_run_through_a_broker_fault_commits_every_step_once_with_clean_values(broker, fault_topics, tmp_path,
                                                                                 fault):
    topics = fault_topics
    cfg = SimConfig(run_id="fault", ranks=2, steps=300, ops_per_step=100, step_time_ms=100, seed=11,
                    rate="realtime")
    total = cfg.ranks * cfg.steps
    processor = ProcessorProcess(broker.bootstrap, topics, tmp_path / "processor.log").start()
    garbage = make_producer(broker.bootstrap)
    for i in range(4):
        garbage.send(topics.raw, key=b"fault/0", value=b"before %d" % i)
    garbage.flush()
    try:
        with StreamingRun(broker.bootstrap, topics, cfg) as run:
            wait_until(lambda: len(run.steps.seen) >= 60, 60, "60 steps committed before the fault")
            restarted = fault(broker, processor)
            up_at, up_wall_ns = time.monotonic(), time.time_ns()
            result = run.end(180)
            for i in range(4):
                garbage.send(topics.raw, key=b"fault/1", value=b"after %d" % i)
            garbage.close()
            run.wait_committed(processor, 120, 60)
            if not restarted:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not _counted(processor.metrics() or {}, total, cfg.steps, 8):
                    time.sleep(0.2)
            metrics = processor.metrics()
            wait_until(lambda: processor.metrics().get("profstream_consumer_lag_messages") == 0, 30, "lag 0")
    finally:
        processor.stop()
    assert result.flushed and result.dropped_ops == 0, result.stats
    run.check_once_and_clean()
    # back to fresh figures: the first step that ended after the broker came back
    # (on a loaded box the run may end while Kafka is away: then fresh is when its last
    # step was committed, every figure current again)
    after_up = [t for t, s in run.steps.seen if s["end_ns"] >= up_wall_ns]
    fresh = min(after_up) if after_up else max(t for t, _ in run.steps.seen)
    print(f"\n{fault.__name__}: fresh figures {fresh - up_at:.1f} s after the broker answered again")
    assert fresh - up_at < 30, "the processor did not come back within 30 s of the broker"
    if restarted:
        return
    # counted once, what was committed
    assert metrics["profstream_steps_closed_total"] == total, (metrics, processor.output()[-3000:])
    assert metrics["profstream_run_steps_total"] == cfg.steps
    assert metrics["profstream_events_total{family=steps}"] == total
    assert metrics["profstream_events_total{family=ops}"] == total * cfg.ops_per_step
    assert metrics["profstream_decode_errors_total{reason=not_avro}"] == 8
    assert metrics["profstream_producer_dropped_total"] == 0 and metrics["profstream_lost_batches_total"] == 0
    assert metrics["profstream_processor_recoveries_total{stage=steps}"] >= 1


def _monitor_cut_off(broker: Broker, topics, run_id: str) -> Monitor:
    """A Monitor that delivered its step 0 (one op), then lost its broker."""
    mon = Monitor(run_id=run_id, bootstrap=broker.bootstrap, topic_prefix=topics.prefix, host_sample_interval_s=0)
    with mon.step(0):
        mon.op("warmup", 1, 1)
    assert mon.flush(timeout=30)
    broker.stop()
    return mon


def test_monitor_flush_waits_for_the_broker_to_come_back_and_delivers_everything(broker, fault_topics):
    topics = fault_topics
    mon = _monitor_cut_off(broker, topics, "flush-outage")
    for s in range(1, 21):
        with mon.step(s):
            for i in range(50):
                mon.op(f"k{i % 5}", s * 1_000_000 + i, 10)
    restart = broker.start_in(3.0)
    started = time.monotonic()
    try:
        assert mon.flush(timeout=90), mon.stats()
        took = time.monotonic() - started
    finally:
        restart.join(120)
    stats = mon.stats()
    mon.close()  # its end mark goes in one more batch
    assert took < 60, f"flush took {took:.1f} s"
    assert stats["dropped_ops"] == 0 and stats["dropped_samples"] == 0
    batches = raw_batches(broker.bootstrap, topics.raw, "flush-outage", stats["seq"] + 1)
    assert [b.seq for b in batches] == list(range(stats["seq"] + 1))
    assert sum(b.n("ops") for b in batches) == 1 + 20 * 50
    assert sorted(int(s) for b in batches for s in b.steps["step"]) == [END_MARK, *range(21)]


def test_monitor_closed_during_an_outage_counts_exactly_what_it_could_not_deliver(broker, fault_topics):
    topics = fault_topics
    mon = _monitor_cut_off(broker, topics, "close-outage")
    recorded_ops = 1
    for s in range(1, 31):
        with mon.step(s):
            mon.memory(1000 * s)
            for i in range(40):
                mon.op(f"k{i % 5}", s * 1_000_000 + i, 10)
                recorded_ops += 1
    started = time.monotonic()
    assert mon.close(timeout=3.0) is False  # not delivered, and says so
    assert time.monotonic() - started < 15
    stats = mon.stats()
    broker.start()
    # Some batches were dropped by design: read what the topic holds (its end offsets), all of it.
    on_topic = wait_until(lambda: topic_size(broker.bootstrap, topics.raw), 30, "the raw topic to be readable")
    assert on_topic < stats["seq"]  # the close said not everything went
    delivered = raw_batches(broker.bootstrap, topics.raw, "close-outage", on_topic, timeout=30)
    delivered_ops = sum(b.n("ops") for b in delivered)
    delivered_samples = sum(b.n("steps") + b.n("memory") for b in delivered)
    assert stats["dropped_ops"] > 0
    assert delivered_ops + stats["dropped_ops"] == recorded_ops
    assert delivered_samples + stats["dropped_samples"] == 31 + 30 + 1  # step marks, memory samples, the end mark


def test_a_processor_that_cannot_get_kafka_back_exits_with_one_line(broker, fault_topics, tmp_path):
    topics = fault_topics
    processor = ProcessorProcess(broker.bootstrap, topics, tmp_path / "processor.log", "--max-outage-s", "5").start()
    cfg = SimConfig(run_id="gone", ranks=1, steps=400, ops_per_step=20, step_time_ms=50, seed=5, rate="realtime")
    run = threading.Thread(target=run_simulation, args=(cfg, {"bootstrap": broker.bootstrap,
                                                              "topic_prefix": topics.prefix}), daemon=True)
    run.start()
    try:
        wait_until(lambda: (processor.metrics() or {}).get("profstream_steps_closed_total", 0) >= 20, 60,
                   "steps committed")
        broker.stop()
        wait_until(lambda: processor.proc.poll() is not None, 120, f"the processor to give up ({processor.log})")
    finally:
        processor.stop()
        broker.start()
        run.join(60)
    _gave_up(processor)


def test_an_idle_processor_that_cannot_get_kafka_back_exits_too(broker, fault_topics, tmp_path):
    """Nothing in flight when the broker goes: the loops learn of it only from their consumers
    (out of the group for 20 s), whose replacement with no partitions to rebuild needs no
    broker. Such recoveries, one after another, must still end in an exit."""
    topics = fault_topics
    processor = ProcessorProcess(broker.bootstrap, topics, tmp_path / "processor.log", "--max-outage-s", "5").start()
    garbage = make_producer(broker.bootstrap)
    garbage.send(topics.raw, key=b"idle/0", value=b"not avro")
    garbage.flush()
    garbage.close()
    try:
        wait_until(lambda: (processor.metrics() or {}).get("profstream_decode_errors_total{reason=not_avro}", 0) >= 1,
                   60, "the one message committed to the dead-letter topic")
        broker.stop()
        wait_until(lambda: processor.proc.poll() is not None, 120, f"the processor to give up ({processor.log})")
    finally:
        processor.stop()
        broker.start()
    _gave_up(processor)


def _gave_up(processor: ProcessorProcess) -> None:
    assert processor.proc.returncode == 2
    last = processor.output().strip().splitlines()[-1]
    assert "has not recovered" in last and "supervisor restarts it" in last, last
