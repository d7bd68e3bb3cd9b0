"""The archive sink: every message exactly once with its bytes, rotation, kill -9, damaged files."""

from __future__ import annotations

import errno
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections import Counter, namedtuple
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaConsumer, TopicPartition
from typer.testing import CliRunner

from profstream.cli import app
from profstream.kafka.clients import make_consumer, make_producer
from profstream.offline.archive import ArchiveError, finished_files, iter_file, records
from profstream.schema.batch import COMPUTE, EventBatch, encode_batch
from profstream.simulate import SimConfig, run_simulation
from profstream.sinks import archive
from profstream.sinks.archive import UNKNOWN_RUN, ArchiveSink, run_archive
from tests.helpers import wait_until

Msg = namedtuple("Msg", "topic partition offset timestamp key value headers")


def topic_messages(bootstrap: str, topic: str) -> dict[tuple[int, int], Msg]:
    """Every message of ``topic`` by (partition, offset), read to the end offsets."""
    consumer = make_consumer(bootstrap, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        out: dict[tuple[int, int], Msg] = {}
        wait_until(lambda: [out.update({(r.partition, r.offset): Msg(r.topic, r.partition, r.offset, r.timestamp,
                                                                      r.key, r.value, r.headers)
                                        for rs in consumer.poll(timeout_ms=200).values() for r in rs}),
                            all(consumer.position(tp) >= end[tp] for tp in tps)][1],
                   30, f"reading {topic} to its end")
        return out
    finally:
        consumer.close()


def archived(out: Path, topic: str | None = None) -> list[dict]:
    """Every record in the finished files under ``out`` (failing on any damage)."""
    recs = []
    for f in finished_files(out):
        if topic is None or f.topic == topic:
            for rec, loss in iter_file(f):
                assert loss is None, str(loss)
                recs.append(rec)
    return recs


def batch_value(run_id: str, rank: int, step: int, ops: int = 20, t0: int = 1_700_000_000_000_000_000) -> bytes:
    """An EventBatch with one finished step: ``ops`` compute ops, the step mark and its watermark."""
    start = t0 + step * 10_000_000
    b = EventBatch(run_id=run_id, rank=rank, producer_id=f"p{rank}", seq=step, complete_through_step=step,
                   op_names=["matmul"], op_types=["MatMul"])
    b.ops = {"name_idx": np.zeros(ops, np.int32), "type_idx": np.zeros(ops, np.int32),
             "kind": np.full(ops, COMPUTE, np.uint8), "stream": np.zeros(ops, np.int32),
             "step": np.full(ops, step, np.int64), "start_ns": start + 1000 + np.arange(ops) * 100_000,
             "dur_ns": np.full(ops, 50_000, np.int64)}
    b.steps = {"step": np.array([step]), "start_ns": np.array([start]), "end_ns": np.array([start + 9_000_000]),
               "fp_start_ns": np.array([-1]), "bp_end_ns": np.array([-1])}
    return encode_batch(b)


def test_every_message_is_archived_once_with_its_bytes_and_no_key_can_write_outside(kafka_bootstrap, topics,
                                                                                    tmp_path):
    cfg = SimConfig(run_id="round", ranks=2, steps=20, ops_per_step=50, seed=3)
    run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
    hostile = [b"../../escape/0", b"/etc/passwd/1", None, b"..", b"../0", b"a/../../b/2", b"\xff\xfe/3",
               b"run with space/0", b"./.", b"x" * 300 + b"/0"]
    producer = make_producer(kafka_bootstrap)
    for key in hostile:
        producer.send(topics.raw, key=key, value=batch_value("evil", 0, 0))
    producer.send(topics.raw, key=b"round/0", value=b"not avro at all", headers=[("h", b"v")])
    producer.flush()
    producer.close()
    expected = topic_messages(kafka_bootstrap, topics.raw)

    out = tmp_path / "archive"
    stop = threading.Event()
    group = f"a-{topics.prefix}"
    worker = threading.Thread(target=run_archive, args=(kafka_bootstrap, [topics.raw], out, stop),
                              kwargs={"group_id": group, "max_age_s": 0.5}, daemon=True)
    worker.start()
    try:
        wait_until(lambda: len(archived(out)) >= len(expected), 60, "every message in a finished file")
    finally:
        stop.set()
        worker.join(30)

    got = archived(out)
    counts = Counter((r["partition"], r["offset"]) for r in got)
    assert set(counts) == set(expected) and max(counts.values()) == 1
    for r in got:
        m = expected[(r["partition"], r["offset"])]
        assert (r["topic"], r["key"], r["value"], r["timestamp"]) == (m.topic, m.key, m.value, m.timestamp)
        assert [(h["key"], h["value"]) for h in r["headers"]] == list(m.headers)
    # nothing outside the archive directory; every bad key under _unknown
    assert [p.name for p in tmp_path.iterdir()] == ["archive"]
    files = finished_files(out)
    assert all(f.path.resolve().is_relative_to(out.resolve()) for f in files)
    assert {f.run_id for f in files} == {"round", UNKNOWN_RUN}
    unknown = [r for f in files if f.run_id == UNKNOWN_RUN for r, _ in iter_file(f)]
    assert sorted(r["key"] or b"" for r in unknown) == sorted(k or b"" for k in hostile)
    # the index lists every file with its offsets, ranks and steps; the undecodable message counted
    index = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines()]
    assert sorted(e["file"] for e in index) == sorted(f.relative_to(out.resolve()) for f in files)
    assert sum(e["messages"] for e in index) == len(expected)
    run_entries = [e for e in index if e["run_id"] == "round"]
    steps = [e["steps"] for e in run_entries if e["steps"]]  # the file of a late undecodable message has none
    assert min(lo for lo, _ in steps) == 0 and max(hi for _, hi in steps) == 19
    assert sorted({r for e in run_entries for r in e["ranks"]}) == [0, 1]
    assert sum(e["undecodable"] for e in index) == 1
    # offsets were committed: a restarted sink has nothing to read again
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False)
    try:
        ends = consumer.end_offsets([TopicPartition(topics.raw, p) for p in range(4)])
        assert {tp: consumer.committed(tp) for tp in ends} == ends
    finally:
        consumer.close()


def _records(n: int, size: int, run: str = "r", partition: int = 0, first: int = 0, seed: int = 0) -> list[Msg]:
    rnd = random.Random(seed)
    return [Msg("t.raw", partition, first + i, 1_000 + i, f"{run}/0".encode(), rnd.randbytes(size), [])
            for i in range(n)]


def test_files_rotate_by_size_and_by_age_and_offsets_commit_only_when_durable(tmp_path):
    clock = [0.0]
    sink = ArchiveSink(tmp_path, max_bytes=50_000, max_age_s=10.0, clock=lambda: clock[0])
    recs = _records(40, 8_000)  # random bytes: no compression
    sink.handle(recs[:30])
    by_size = finished_files(tmp_path)
    assert len(by_size) >= 4
    assert all(f.path.stat().st_size <= 50_000 for f in by_size)
    assert [f.first_offset for f in by_size] == [0] + [f.last_offset + 1 for f in by_size[:-1]]
    # the open file holds back the commit to its first offset
    assert sink.durable_offsets() == {("t.raw", 0): by_size[-1].last_offset + 1}
    clock[0] = 9.9
    assert sink.rotate_due() == 0
    clock[0] = 10.0  # the open file is now 10 s old: finished with no new message
    assert sink.rotate_due() == 1
    assert sink.durable_offsets() == {("t.raw", 0): 30}
    sink.handle(recs[30:31])  # a new file, opened at 10 s
    clock[0] = 19.9
    assert sink.rotate_due() == 0 and sink.durable_offsets() == {("t.raw", 0): 30}
    clock[0] = 20.0
    assert sink.rotate_due() == 1 and sink.durable_offsets() == {("t.raw", 0): 31}
    sink.handle(recs[31:])
    sink.close()
    assert [r["offset"] for r in archived(tmp_path)] == list(range(40))
    assert [r["value"] for r in archived(tmp_path)] == [r.value for r in recs]


def test_a_crash_between_rename_and_commit_does_not_archive_a_message_twice(tmp_path):
    recs = [r._replace(key=b"r/0" if r.offset % 2 else b"other/0") for r in _records(30, 500)]  # 2 runs, 1 partition
    first = ArchiveSink(tmp_path, max_bytes=4_000)
    first.handle(recs[:20])
    first.close()  # files finished and renamed; the "process" dies before committing anything
    orphan = tmp_path / "t.raw" / "r" / "p0" / "99.avro.tmp"
    orphan.write_bytes(b"half a file")
    again = ArchiveSink(tmp_path, max_bytes=4_000)
    assert again.stats.orphans_removed == 1 and not orphan.exists()
    again.handle(recs)  # the broker re-delivers from the last committed offset: 0
    again.close()
    assert again.stats.skipped == 20
    assert sorted(r["offset"] for r in archived(tmp_path)) == list(range(30))
    assert again.durable_offsets() == {("t.raw", 0): 30}


def test_kill_9_mid_file_and_restart_archives_every_message_exactly_once(kafka_bootstrap, topics, tmp_path):
    cfg = SimConfig(run_id="killed", ranks=2, steps=150, ops_per_step=60, step_time_ms=20, seed=6,
                    rate="realtime")
    out = tmp_path / "archive"
    cmd = [sys.executable, "-m", "profstream.cli", "sink", "archive", str(out), "--bootstrap", kafka_bootstrap,
           "--topic-prefix", topics.prefix, "--topics", "raw", "--group-id", f"a-{topics.prefix}",
           "--max-bytes", "32KiB", "--max-age-s", "1", "--no-progress"]
    log_path = tmp_path / "archive.log"
    log = open(log_path, "w")

    def start():
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    proc = start()
    producer = threading.Thread(target=run_simulation, args=(cfg, {"bootstrap": kafka_bootstrap,
                                                                  "topic_prefix": topics.prefix}))
    try:
        wait_until(lambda: "archiving" in log_path.read_text(), 60, "the archive sink to start")
        producer.start()
        wait_until(lambda: len(finished_files(out)) >= 2 and list(out.rglob("*.avro.tmp")), 60,
                   "finished files and one being written")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert list(out.rglob("*.avro.tmp")), "no file was open at the kill: the test did not test a crash"
        assert producer.is_alive(), "the run was over before the crash"
        proc = start()
        producer.join(120)
        expected = topic_messages(kafka_bootstrap, topics.raw)
        wait_until(lambda: len(archived(out)) >= len(expected), 60, "every message archived after the restart")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, log_path.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    got = archived(out)
    counts = Counter((r["partition"], r["offset"]) for r in got)
    assert set(counts) == set(expected), log_path.read_text()[-2000:]
    assert max(counts.values()) == 1, [k for k, n in counts.items() if n > 1][:10]
    assert all(r["value"] == expected[(r["partition"], r["offset"])].value for r in got)
    assert not list(out.rglob("*.avro.tmp"))


class FillingDisk:
    """Files (``open`` of the archive module) on a disk that holds ``room`` more bytes: a
    write past it fails as a full disk does (ENOSPC)."""

    def __init__(self, room: int) -> None:
        self.room = room

    def open(self, path, mode="r", *args, **kwargs):
        if "w" not in mode:
            return open(path, mode, *args, **kwargs)
        disk = self

        class File(io.FileIO):
            def write(self, data) -> int:
                if len(data) > disk.room:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                disk.room -= len(data)
                return super().write(data)

        return io.BufferedWriter(File(path, "wb"))


def test_a_full_disk_stops_the_sink_with_one_line_and_a_restart_archives_every_message_once(tmp_path, monkeypatch):
    recs = sorted(_records(40, 8_000, run="a") + _records(40, 8_000, run="b", seed=1), key=lambda r: r.offset)
    recs = [r._replace(offset=i) for i, r in enumerate(recs)]  # two runs' files open at once, one partition
    monkeypatch.setattr(archive, "open", FillingDisk(300_000).open, raising=False)
    sink = ArchiveSink(tmp_path, max_bytes=50_000)
    committed = 0
    with pytest.raises(ArchiveError) as failed:
        for i in range(0, len(recs), 5):  # as the sink loop does: a poll handled, then its commit
            sink.handle(recs[i:i + 5])
            committed = sink.durable_offsets()[("t.raw", 0)]
    message = str(failed.value)
    # one line that says what happened and what to do; not an OSError traceback chained twice
    assert "No space left on device" in message and "start the sink again" in message and "\n" not in message
    assert failed.value.__suppress_context__
    assert 0 < committed < len(recs) and sink.durable_offsets()[("t.raw", 0)] <= committed + 5
    sink.abandon()  # what run_archive does on the way out: no second error, no temporary file left
    assert not list(tmp_path.rglob("*.tmp"))
    monkeypatch.undo()  # space freed; the broker re-delivers from the committed offset
    again = ArchiveSink(tmp_path, max_bytes=50_000)
    again.handle(recs[committed:])
    again.close()
    assert sorted(r["offset"] for r in archived(tmp_path)) == list(range(len(recs)))


def test_a_damaged_file_is_reported_by_name_and_offsets_and_the_rest_is_read(tmp_path):
    out = tmp_path / "archive"
    sink = ArchiveSink(out, max_bytes=10_000_000)
    recs = _records(60, 100_000, partition=0) + _records(60, 100_000, partition=1, seed=1)
    sink.handle(recs)  # partition 0 and 1: one file each, ~6 blocks of 1 MiB
    sink.close()
    files = {f.partition: f for f in finished_files(out)}
    assert sorted(files) == [0, 1] and all(f.first_offset == 0 and f.last_offset == 59 for f in files.values())
    truncated, flipped = files[0].path, files[1].path
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) * 6 // 10])
    data = bytearray(flipped.read_bytes())
    sync = bytes(data[-16:])
    second_block = data.find(sync, data.find(sync) + 16) + 16  # after the header's and the first block's sync
    data[second_block + 2: second_block + 12] = b"\xff" * 10  # its size and the codec's frame header
    flipped.write_bytes(bytes(data))

    losses = []
    got = list(records(finished_files(out), losses.append))
    read = {p: sorted(r["offset"] for r in got if r["partition"] == p) for p in (0, 1)}
    # truncated: a prefix survives, the rest is reported lost, by file name and offsets
    n0 = len(read[0])
    assert 0 < n0 < 60 and read[0] == list(range(n0))
    by_file = {loss.file: loss for loss in losses}
    assert (by_file[truncated].first_offset, by_file[truncated].last_offset) == (n0, 59)
    # flipped bytes in the second block: only that block is lost, later blocks are still read
    lost1 = sorted(set(range(60)) - set(read[1]))
    assert lost1 and lost1 == list(range(lost1[0], lost1[-1] + 1)) and lost1[-1] < 59
    assert (by_file[flipped].first_offset, by_file[flipped].last_offset) == (lost1[0], lost1[-1])
    assert len(losses) == 2
    assert all(r["value"] == recs[r["offset"] + 60 * r["partition"]].value for r in got)


def test_replay_reports_a_truncated_file_and_goes_on(tmp_path):
    out = tmp_path / "archive"
    sink = ArchiveSink(out, max_bytes=20_000)
    offsets = [0, 0]
    for step in range(30):
        for rank in (0, 1):
            sink.handle([Msg("t.raw", rank, offsets[rank], 1_000 * step, f"cut/{rank}".encode(),
                             batch_value("cut", rank, step, ops=200), [])])
            offsets[rank] += 1
    sink.close()
    victim = [f for f in finished_files(out) if f.partition == 1][1]
    victim.path.write_bytes(victim.path.read_bytes()[:-200])
    lost = set(range(30)) - {r["offset"] for r in records(finished_files(out), lambda _: None) if r["partition"] == 1}
    assert lost
    result = CliRunner().invoke(app, ["replay", str(out), "--offline", "--output", str(tmp_path / "o"),
                                      "--workers", "1"])
    assert result.exit_code == 1, result.output
    assert victim.path.name in result.output and f"..{victim.last_offset}" in result.output
    steps = [json.loads(line) for line in (tmp_path / "o" / "steps.jsonl").read_text().splitlines()]
    assert sorted(s["step"] for s in steps if s["rank"] == 0) == list(range(30))  # rank 0 untouched
    assert sorted(s["step"] for s in steps if s["rank"] == 1) == sorted(set(range(30)) - lost)  # step = offset


def _sink_records(cfg: SimConfig, close: bool) -> list[Msg]:
    """The raw messages of a simulated run as the archive sink gets them (topic "p.raw")."""
    from tests.helpers import simulated_messages

    return [Msg("p.raw", m.partition, m.offset, int(m.clock * 1000), m.key, m.value, [])
            for m in simulated_messages(cfg, close=close)]


def test_a_run_that_ended_is_reportable_at_once_and_one_still_written_is_named(tmp_path):
    """The run's files are finished as soon as every rank's end mark is archived (not after
    --max-age-s), so its report can be made; a run whose files are still being written
    gets a one-line error that says so and what to do, not "not in the archive"."""
    ended = SimConfig(run_id="done", ranks=2, steps=8, ops_per_step=20, seed=1)
    going = SimConfig(run_id="going", ranks=2, steps=8, ops_per_step=20, seed=2)
    sink = ArchiveSink(tmp_path / "a", max_age_s=300.0)
    try:
        sink.handle(_sink_records(going, close=False))  # its Monitors have not closed
        sink.handle(_sink_records(ended, close=True))
        assert {f.run_id for f in finished_files(tmp_path / "a")} == {"done"}
        assert sink.open_files == len({m.partition for m in _sink_records(going, close=False)})
        report = CliRunner().invoke(app, ["report", str(tmp_path / "a"), "--run", "done", "-o",
                                          str(tmp_path / "done.html")])
        assert report.exit_code == 0, report.output
        assert "Every rank ended normally" in (tmp_path / "done.html").read_text()
        for argv in (["report", str(tmp_path / "a"), "--run", "going", "-o", str(tmp_path / "g.html")],
                     ["export", "parquet", str(tmp_path / "a"), "--run", "going", "--output", str(tmp_path / "x")]):
            result = CliRunner().invoke(app, argv)
            assert result.exit_code != 0 and len(result.output.strip().splitlines()) == 1, result.output
            assert "still writing" in result.output and "--max-age-s" in result.output, result.output
    finally:
        sink.close()
    assert {f.run_id for f in finished_files(tmp_path / "a")} == {"done", "going"}  # the stop finished the rest


def test_a_sink_started_before_its_topics_waits_for_them_with_a_deadline(kafka_bootstrap, tmp_path):
    """Started beside the processor that creates the topics (as a supervisor starts them), the
    archive and timeline sinks wait for the topics, saying so, instead of exiting."""
    import time
    import uuid

    from profstream.kafka.topics import Topics, delete_topics, ensure_topics

    topics = Topics(f"t-late-{uuid.uuid4().hex[:8]}")
    log = tmp_path / "sink.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "profstream.cli", "sink", "archive", str(tmp_path / "a"),
                                 "--bootstrap", kafka_bootstrap, "--topic-prefix", topics.prefix, "--topics", "raw"],
                                stderr=stderr, stdout=subprocess.DEVNULL)
    try:
        wait_until(lambda: "waiting up to 60 s" in log.read_text(), 60, "the sink to say it waits for its topic")
        ensure_topics(kafka_bootstrap, topics, raw_partitions=2, partitions=1)  # the processor starts
        wait_until(lambda: "archiving" in log.read_text() or proc.poll() is not None, 60, "the sink to start")
        assert proc.poll() is None, log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        delete_topics(kafka_bootstrap, topics, timeout=5.0)
    # and with nothing coming, it gives up at its deadline with one line that says what to do
    started = time.monotonic()
    result = CliRunner().invoke(app, ["sink", "timeline", "--out", str(tmp_path / "t"), "--bootstrap", kafka_bootstrap,
                                      "--topic-prefix", "t-never-there", "--wait-topics-s", "1"])
    assert result.exit_code == 2 and time.monotonic() - started < 30, result.output
    last = result.output.strip().splitlines()[-1]
    assert "t-never-there.raw does not exist after waiting 1 s" in last and "profstream process" in last
