"""The Monitor's disk spool (docs/monitor.md, "Disk spool"): nothing recorded is lost while
Kafka is away or absent, and every (run, rank, step) reaches the processors once.

Ground truth comes from the simulator; the processors' figures are computed from what the
real broker holds (``processors.stream.figures`` over the raw topic, in partition order).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from profstream.processors.stream import STEPS, RawMessage, StreamOptions, figures
from profstream.producers.spool import SEGMENT_MAGIC, Spool, decode_at, rank_dir
from profstream.producers.spool_publish import publish_spool, show_spool
from profstream.schema.codec import decode, record_name
from profstream.simulate import SimConfig, expected, run_simulation
from tests.helpers import topic_records

NOWHERE = "127.0.0.1:1"  # no broker answers there: an outage from the start


@pytest.fixture(autouse=True, params=["native", "python"])
def recording(request, monkeypatch):
    if request.param == "native":
        from profstream.producers import native

        if native.load()[0] is None:
            pytest.skip(f"the native Monitor is not built here: {native.load()[1]} (tests/test_native.py fails on it)")
    monkeypatch.setenv("PROFSTREAM_NATIVE", str(request.param == "native").lower())
    return request.param


def raw_messages(bootstrap: str, topic: str) -> list[RawMessage]:
    """Everything on the raw topic, each partition in order."""
    return [RawMessage(r.timestamp / 1e3, r.partition, r.offset, r.key, r.value) for r in topic_records(bootstrap, topic)]


def step_counts(bootstrap: str, topic: str) -> tuple[Counter, dict]:
    """{(run, rank, step): how many StepMetrics} and the last of each, by the processors' code."""
    counts: Counter = Counter()
    last = {}
    for f in figures(raw_messages(bootstrap, topic), StreamOptions(grace_s=0.5, run_grace_s=1.0)):
        if f.kind == STEPS and record_name(f.value) == "StepMetrics":  # not a rank's RankEnd
            m = decode("StepMetrics", f.value)
            counts[m["run_id"], m["rank"], m["step"]] += 1
            last[m["run_id"], m["rank"], m["step"]] = m
    return counts, last


def assert_every_step_once(bootstrap: str, topics, cfg: SimConfig) -> None:
    counts, metrics = step_counts(bootstrap, topics.raw)
    want = {(cfg.run_id, r, s) for r in range(cfg.ranks) for s in range(cfg.first_step, cfg.first_step + cfg.steps)}
    assert set(counts) == want, f"missing {sorted(want - set(counts))[:5]}, extra {sorted(set(counts) - want)[:5]}"
    assert set(counts.values()) == {1}, [k for k, n in counts.items() if n != 1][:5]
    truth = expected(cfg)
    wrong = [k for k, m in metrics.items() if m["step_time_ns"] != truth[k[1], k[2]]["step_time_ns"]]
    assert not wrong, wrong[:5]


# -- the file format -----------------------------------------------------------------------

def test_a_torn_tail_and_a_corrupted_record_lose_only_themselves_and_are_named(tmp_path, caplog):
    spool = Spool(tmp_path / "r" / "rank-0", 1 << 30, segment_bytes=4096)
    for i in range(30):
        spool.append(b"r/0", bytes([i]) * 700, ops=i, samples=1)
    spool.close()
    segments = sorted(tmp_path.glob("r/rank-0/*.seg"))
    middle, last = segments[1], segments[-1]
    corrupted = decode_at(middle.read_bytes(), len(SEGMENT_MAGIC))[2]  # the ops field: the record's number
    data = bytearray(middle.read_bytes())
    data[len(SEGMENT_MAGIC) + 40] ^= 0xFF  # inside the first record's value
    middle.write_bytes(bytes(data))
    last.write_bytes(last.read_bytes()[:-100])  # a crash in the middle of the last write

    caplog.set_level(logging.WARNING, "profstream.monitor")
    rows = show_spool(tmp_path)
    assert [(r.run_id, r.rank) for r in rows] == [("r", 0)]
    assert rows[0].records == 28 and rows[0].corrupt_regions == 2
    assert rows[0].ops == sum(range(30)) - corrupted - 29  # the corrupted record and the torn last one
    named = [r.getMessage() for r in caplog.records]
    assert any(middle.name in m and "corrupted" in m for m in named), named
    assert any(last.name in m and "torn tail" in m for m in named), named


def test_batches_a_close_purged_go_where_they_belong_in_the_spool(tmp_path):
    """Records handed to Kafka, then batches sent straight to it (purged at close), then
    records spooled after: the purged ones are read back between the two."""
    spool = Spool(tmp_path / "r" / "rank-0", 1 << 30)
    spool.append(b"r/0", b"handed-before", 1, 0)
    record = spool.next_record()
    spool.advance(record)  # handed to Kafka, not acknowledged
    spool.rotate()  # straight to Kafka from here; spooling again later starts a segment
    after = spool.next_segment
    spool.append(b"r/0", b"spooled-after", 3, 0)
    spool.insert([(b"r/0", b"purged-direct", 2, 0)], before=after)
    spool.close()
    again = Spool(tmp_path / "r" / "rank-0", 1 << 30)
    order = []
    while (rec := again.next_record()) is not None:
        again.advance(rec)
        order.append(rec.value)
    again.close()
    assert order == [b"handed-before", b"purged-direct", b"spooled-after"]


def test_a_spool_in_use_by_a_live_monitor_is_not_opened_twice(tmp_path):
    first = Spool(tmp_path / "r" / "rank-0", 1 << 30)
    try:
        with pytest.raises(OSError, match="in use by another process"):
            Spool(tmp_path / "r" / "rank-0", 1 << 30)
    finally:
        first.close()


# -- record only, published later ----------------------------------------------------------

def test_record_only_then_publish_twice_gives_every_step_once(kafka_bootstrap, topics, tmp_path):
    cfg = SimConfig(run_id="spooled", ranks=2, steps=30, ops_per_step=80)
    result = run_simulation(cfg, {"spool_dir": str(tmp_path), "record_only": True, "bootstrap": NOWHERE,
                                  "topic_prefix": topics.prefix})
    assert result.flushed and result.dropped_ops == 0
    assert all(s["spool_records_written"] > 0 for s in result.stats)
    held = show_spool(tmp_path)
    assert [(r.run_id, r.rank) for r in held] == [("spooled", 0), ("spooled", 1)]
    assert sum(r.ops for r in held) == result.ops_recorded

    first = publish_spool(tmp_path, kafka_bootstrap, topics.prefix, keep=True)  # a publish that left it all
    assert [r.records for r in first] == [r.records for r in held]
    done = subprocess.run([sys.executable, "-m", "profstream.cli", "spool", "publish", str(tmp_path),
                           "--bootstrap", kafka_bootstrap, "--topic-prefix", topics.prefix],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "spooled").exists()  # sent and acknowledged: taken off the disk
    assert_every_step_once(kafka_bootstrap, topics, cfg)


def test_a_publish_stopped_half_way_sends_the_rest_and_nothing_twice_downstream(kafka_bootstrap, topics, tmp_path):
    cfg = SimConfig(run_id="half", ranks=1, steps=40, ops_per_step=60)
    run_simulation(cfg, {"spool_dir": str(tmp_path), "record_only": True, "topic_prefix": topics.prefix,
                         "batch_max_ops": 500})
    folder = rank_dir(tmp_path, "half", 0)
    # what a publish killed half-way leaves: the first half on Kafka, the position not saved
    spool = Spool(folder, 1 << 30)
    records = []
    while (rec := spool.next_record()) is not None:
        spool.advance(rec)
        records.append(rec)
    spool.close()
    assert len(records) >= 4
    from profstream.kafka.clients import make_native_producer

    producer = make_native_producer(kafka_bootstrap)
    for rec in records[:len(records) // 2]:
        producer.send(topics.raw, rec.value, rec.key, lambda e: None)
    assert producer.flush(30)
    producer.close(5)
    publish_spool(tmp_path, kafka_bootstrap, topics.prefix)
    assert_every_step_once(kafka_bootstrap, topics, cfg)


def test_publish_without_a_broker_says_so_in_one_line(tmp_path):
    run_simulation(SimConfig(run_id="nobroker", ranks=1, steps=3), {"spool_dir": str(tmp_path),
                                                                    "record_only": True})
    done = subprocess.run([sys.executable, "-m", "profstream.cli", "spool", "publish", str(tmp_path),
                           "--bootstrap", NOWHERE], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "error" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert rank_dir(tmp_path, "nobroker", 0).exists()  # nothing taken off


def test_record_only_needs_a_spool_dir():
    from profstream import Monitor
    from profstream.config import ConfigError

    with pytest.raises(ConfigError, match="record_only needs spool_dir"):
        Monitor(run_id="r", record_only=True)


# -- an outage, and the next Monitor of the run ---------------------------------------------

def test_what_a_monitor_spooled_in_an_outage_is_sent_first_by_the_next_one(kafka_bootstrap, topics, tmp_path):
    """The first process never reaches Kafka (its 4 MiB of memory hold ~14,000 ops: it records
    24,000); the restarted one sends its predecessor's batches, then its own, in order."""
    before = SimConfig(run_id="restarted", ranks=1, steps=60, ops_per_step=400, step_time_ms=25, rate="realtime")
    after = SimConfig(run_id="restarted", ranks=1, steps=20, ops_per_step=400, first_step=60)
    opts = {"spool_dir": str(tmp_path), "topic_prefix": topics.prefix, "buffer_bytes": "4MiB",
            "connect_timeout_s": 0.5}
    cut_off = run_simulation(before, {**opts, "bootstrap": NOWHERE})
    assert cut_off.dropped_ops == 0, cut_off.stats
    assert cut_off.stats[0]["spool_records_written"] > 0
    back = run_simulation(after, {**opts, "bootstrap": kafka_bootstrap})
    assert back.flushed and back.dropped_ops == 0
    assert not rank_dir(tmp_path, "restarted", 0).exists()  # everything acknowledged
    counts, _ = step_counts(kafka_bootstrap, topics.raw)
    assert sorted(s for (_run, _rank, s) in counts) == list(range(80))
    assert set(counts.values()) == {1}


# -- faults of the disk ----------------------------------------------------------------------

def test_an_unwritable_spool_dir_is_one_line_and_the_monitor_runs_without_it(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    caplog.set_level(logging.WARNING, "profstream.monitor")
    result = run_simulation(SimConfig(run_id="nodisk", ranks=1, steps=5), {
        "spool_dir": str(blocker / "spool"), "bootstrap": NOWHERE, "connect_timeout_s": 0.2})
    assert result.steps_recorded == 5
    said = [r.getMessage() for r in caplog.records if "spool" in r.getMessage()]
    assert len(said) == 1 and "not writable" in said[0] and "without a spool" in said[0], said


FULL_DISK = r'''
import json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))
from profstream.simulate import SimConfig, run_simulation
r = run_simulation(SimConfig(run_id="full", ranks=1, steps=60, ops_per_step=400),
                   {"spool_dir": sys.argv[1], "bootstrap": "127.0.0.1:1", "connect_timeout_s": 0.2,
                    "buffer_bytes": "2MiB"})
print(json.dumps({"steps": r.steps_recorded, "dropped_ops": r.dropped_ops, "stats": r.stats[0]}))
'''


def test_a_full_disk_drops_and_counts_and_training_goes_on(tmp_path):
    """The disk refuses the spool's writes (a file size limit: EFBIG, as ENOSPC would): the
    spool stops with one warning, the Monitor goes on in memory, and what it cannot keep is
    dropped and counted; the loop itself records every step."""
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["steps"] == 60
    assert got["dropped_ops"] > 0 and got["stats"]["spool_error"], got["stats"]
    warned = [line for line in done.stderr.splitlines() if "spool" in line and "stopped" in line]
    assert len(warned) == 1, done.stderr[-2000:]
