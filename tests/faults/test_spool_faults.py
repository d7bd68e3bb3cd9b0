"""A Monitor with a disk spool through a broker that stops: nothing recorded is lost, and
every step reaches the processors once (docs/monitor.md, "Disk spool")."""

from __future__ import annotations

import time

from profstream import Monitor
from profstream.producers.spool import rank_dir
from profstream.producers.spool_publish import publish_spool
from tests.faults.conftest import Broker
from tests.test_spool import step_counts

OPS_PER_STEP = 400


def _cut_off_monitor(broker: Broker, topics, run_id: str, spool_dir) -> Monitor:
    """A Monitor that reached the broker, with a small memory buffer, and the broker then stopped."""
    mon = Monitor(run_id=run_id, bootstrap=broker.bootstrap, topic_prefix=topics.prefix, host_sample_interval_s=0,
                  spool_dir=str(spool_dir), buffer_bytes="4MiB", connect_timeout_s=1.0)
    with mon.step(0):
        mon.op("warmup", time.time_ns(), 1)
    assert mon.flush(timeout=30)
    broker.stop()
    return mon


def _record(mon: Monitor, steps: range) -> int:
    """Steps of OPS_PER_STEP ops at about 20 steps/s: more ops than 4 MiB of memory holds."""
    for s in steps:
        with mon.step(s):
            t = time.time_ns()
            for i in range(OPS_PER_STEP):
                mon.op(f"k{i % 7}", t + i * 1000, 500)
        time.sleep(0.05)
    return len(steps) * OPS_PER_STEP


def test_an_outage_longer_than_the_memory_buffer_loses_nothing(broker, fault_topics, tmp_path):
    mon = _cut_off_monitor(broker, fault_topics, "spool-outage", tmp_path)
    _record(mon, range(1, 61))  # 24,000 ops; the 4 MiB buffer holds about 14,000
    spooled = mon.stats()
    assert spooled["spooling"] and spooled["spool_records_written"] > 0
    broker.start()
    _record(mon, range(61, 71))  # new steps queue behind the spool's records
    assert mon.flush(timeout=60)
    wait_sent = time.monotonic() + 60
    while mon.stats()["spooling"] and time.monotonic() < wait_sent:  # drained, then straight to Kafka again
        time.sleep(0.1)
    stats = mon.stats()
    mon.close(timeout=30)
    assert stats["dropped_ops"] == 0 and stats["dropped_samples"] == 0, stats
    assert not stats["spooling"], stats
    counts, _ = step_counts(broker.bootstrap, fault_topics.raw)
    assert sorted(s for (_run, _rank, s) in counts) == list(range(71))
    assert set(counts.values()) == {1}


def test_a_monitor_closed_in_an_outage_leaves_everything_on_disk_for_a_publish(broker, fault_topics, tmp_path):
    """What librdkafka held when Kafka went away is written in front of the spool at close."""
    mon = _cut_off_monitor(broker, fault_topics, "spool-close", tmp_path)
    _record(mon, range(1, 31))
    assert mon.close(timeout=3.0)  # everything is on disk: nothing is lost, and it says so
    stats = mon.stats()
    assert stats["dropped_ops"] == 0 and stats["dropped_samples"] == 0, stats
    assert rank_dir(tmp_path, "spool-close", 0).exists()
    broker.start()
    published = publish_spool(tmp_path, broker.bootstrap, fault_topics.prefix)
    assert published and all(not r.corrupt_regions and not r.refused for r in published)
    counts, _ = step_counts(broker.bootstrap, fault_topics.raw)
    assert sorted(s for (_run, _rank, s) in counts) == list(range(31))
    assert set(counts.values()) == {1}
