"""Capture requests through the real broker: `profstream capture` against running Monitors.

Each test runs ranks as real Monitors driven by a loop on a thread of its own (the
"training thread"), ops recorded on every step and kept only where a request asks
(``scheduled_capture=False``), and reads back what reached the raw and control topics.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
from confluent_kafka.admin import AdminClient
from typer.testing import CliRunner

from profstream.cli import app
from profstream.control.client import recent_requests, runs_seen, send_request
from profstream.control.policy import CapturePolicy
from profstream.control.records import (
    control_key,
    decode_control,
    new_request,
    parse_ranks,
    refusal_code,
)
from profstream.control.service import AutoCaptureService
from profstream.kafka.clients import make_producer, read_topic
from profstream.kafka.connection import Connection
from profstream.producers.monitor import Monitor
from profstream.schema.codec import DecodeError
from profstream.sinks.runner import SinkLoop
from profstream.sinks.timeline import TimelineSink
from tests.helpers import raw_batches, read_full, wait_until
from tests.test_processor import RunningProcessor

OPS_PER_STEP = 10


class TrainingLoop:
    """Ranks of one run as Monitors, stepped together by one thread until stopped."""

    def __init__(self, bootstrap, topics, run_id, ranks, step_s=0.02, **options):
        # a bootstrap address, or a Connection (the secured broker's: tests/test_secure_pipeline.py)
        kafka = {"connection": bootstrap} if isinstance(bootstrap, Connection) else {"bootstrap": bootstrap}
        self.monitors = [Monitor(**kafka, topic_prefix=topics.prefix, run_id=run_id, rank=r,
                                 world_size=ranks, scheduled_capture=False, host_sample_interval_s=0, **options)
                         for r in range(ranks)]
        self.step_s = step_s
        self.steps = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            while not self._stop.is_set():
                for m in self.monitors:
                    m.begin_step()
                    now = time.time_ns()
                    m.ops([f"op{i}" for i in range(OPS_PER_STEP)], [now + i for i in range(OPS_PER_STEP)], 1000,
                          0, "MatMul")
                time.sleep(self.step_s)
                for m in self.monitors:
                    m.end_step()
                self.steps += 1
        except BaseException as e:  # surfaced by the test
            self.error = e

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)
        for m in self.monitors:
            m.close(timeout=10)


def control_records(bootstrap, topics, want, count, timeout=30.0, full=True):
    """Decodable (name, record) pairs of the control topic satisfying ``want``."""
    def decoded(value):
        try:
            return decode_control(value)
        except DecodeError:
            return ("undecodable", {})

    if full:
        return read_full(bootstrap, topics.control, want, count, timeout, decode=decoded, what="control records")
    return read_topic(bootstrap, topics.control, want, count, timeout, decode=decoded)


def statuses_of(bootstrap, topics, request_id, count, timeout=30.0):
    return [r for _n, r in control_records(bootstrap, topics, lambda x: x[0] == "CaptureStatus"
                                           and x[1]["request_id"] == request_id, count, timeout)]


def steps_with_ops(batches) -> dict[int, dict[int, int]]:
    """rank -> {step: ops} of the raw batches read back."""
    out: dict[int, dict[int, int]] = {}
    for b in batches:
        if not b.n("ops"):
            continue
        steps, counts = np.unique(b.ops["step"], return_counts=True)
        per = out.setdefault(b.rank, {})
        for s, n in zip(steps.tolist(), counts.tolist()):
            per[s] = per.get(s, 0) + n
    return out


class RunningSink:
    """A SinkLoop on a thread, stopped on exit."""

    def __init__(self, bootstrap, topics_, group, sink):
        self.loop = SinkLoop(bootstrap, topics_, group, sink, poll_ms=50)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop.run, args=(self.stop,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)


def test_a_capture_mid_run_gives_ops_for_exactly_the_requested_steps_and_ranks(kafka_bootstrap, topics, tmp_path):
    timeline_dir = tmp_path / "timeline"
    sink = TimelineSink(timeline_dir, window_steps=1000, control_topic=topics.control)
    with RunningSink(kafka_bootstrap, [topics.raw, topics.control], f"tl-{topics.prefix}", sink), \
            TrainingLoop(kafka_bootstrap, topics, "cap", ranks=3) as loop:
        wait_until(lambda: loop.steps >= 5, 30, "the loop's first steps")
        result = CliRunner().invoke(app, [
            "capture", "--run", "cap", "--ranks", "0,2", "--steps", "5", "--wait", "--timeout-s", "60",
            "--timeline-dir", str(timeline_dir), "--bootstrap", kafka_bootstrap, "--topic-prefix", topics.prefix])
        assert loop.error is None
        listed = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_consumer_groups().result(30)
        groups = [g.group_id for g in listed.valid]
    assert result.exit_code == 0, result.output
    listed = recent_requests(kafka_bootstrap, topics, 600, "cap")
    (item,) = listed
    finished = item.progress.finished()
    assert sorted(finished) == [0, 2] and item.progress.ranks.keys() == {0, 2}  # rank 1 was not asked: no status
    sent = steps_with_ops(raw_batches(kafka_bootstrap, topics.raw, "cap", 10**6, timeout=5, full=False))
    for rank, status in finished.items():
        first, last = status["first_step"], status["last_step"]
        assert last - first == 4
        assert sent[rank] == {s: OPS_PER_STEP for s in range(first, last + 1)}, rank  # exactly those steps
        assert status["ops"] == 5 * OPS_PER_STEP
        assert status["window_start_ns"] < status["window_end_ns"] <= status["ts_ns"]
        # the timeline sink wrote the captured steps as a file of their own, and --wait named it
        path = timeline_dir / "cap" / f"rank-{rank}" / f"steps-{first}-{last}.json.gz"
        assert path.is_file() and f"rank {rank}: {path}" in result.output.replace("\n", "")
    assert 1 not in sent  # no op of an unasked rank
    assert "finished" in result.output and "waiting" not in result.output
    assert len(re.findall(r"capture [0-9a-f]{12}: run cap", result.output)) == 1  # not a terminal: the table once
    # while they read, the readers had no consumer group on the broker
    assert not [g for g in groups if g.startswith("profstream-control-")], groups


def test_refusals_and_garbage_leave_the_training_loop_untouched(kafka_bootstrap, topics):
    policy = CapturePolicy(unknown_run_after_s=1.0)
    service = AutoCaptureService(kafka_bootstrap, topics, policy)
    stop, ready = threading.Event(), threading.Event()
    guard = threading.Thread(target=service.run, args=(stop, ready.set), daemon=True)
    guard.start()
    try:
        assert ready.wait(30)
        with TrainingLoop(kafka_bootstrap, topics, "busy-run", ranks=2, capture_max_steps=10) as loop:
            wait_until(lambda: loop.steps >= 3, 30, "the loop's first steps")
            too_long = new_request("busy-run", steps=11)
            stale = new_request("busy-run", steps=2, expires_s=1, now_ns=time.time_ns() - 10**10)
            far = new_request("busy-run", ranks=parse_ranks("0"), start_step=10**9, steps=2)
            second = new_request("busy-run", ranks=parse_ranks("0"), steps=2)
            ghost = new_request("nobody-runs-this", steps=2)
            for request in (too_long, stale, far, second, ghost):
                send_request(kafka_bootstrap, topics, request)
            producer = make_producer(kafka_bootstrap)  # the garbage where the ranks read requests
            producer.send(topics.requests("ANONYMOUS"), b"definitely not avro", control_key("busy-run")).get(10)
            producer.close()

            def refusals(request, count):
                return {(s["rank"], refusal_code(s["reason"]))
                        for s in statuses_of(kafka_bootstrap, topics, request["request_id"], count)
                        if s["state"] == "refused"}

            assert refusals(too_long, 2) == {(0, "over_limit"), (1, "over_limit")}
            assert refusals(stale, 2) == {(0, "expired"), (1, "expired")}
            assert refusals(second, 1) == {(0, "busy")}
            assert refusals(ghost, 1) == {(None, "unknown_run")}
            dead = read_full(kafka_bootstrap, topics.dlq, lambda v: True, 1, 30, what="dead letters")
            assert dead == [b"definitely not avro"]
            wait_until(lambda: all(m.stats()["control_undecodable"] == 1 for m in loop.monitors), 30,
                       "each rank's reader to skip the garbage")
            steps_before = loop.steps
            wait_until(lambda: loop.steps >= steps_before + 3, 30, "the loop going on")
            assert loop.error is None
        # `far` never started: the Monitor's close refuses it
        assert refusals(far, 2) == {(0, "ended")}
        stats = [m.stats() for m in loop.monitors]
        assert [s["captures_started"] for s in stats] == [0, 0]
        assert [s["captures_refused"] for s in stats] == [4, 2]
        sent = steps_with_ops(raw_batches(kafka_bootstrap, topics.raw, "busy-run", 10**6, timeout=5, full=False))
        assert sent == {}  # nothing was captured
    finally:
        stop.set()
        guard.join(30)
    (headers,) = [r.headers for r in _dlq_records(kafka_bootstrap, topics)]
    headers = dict(headers)
    assert headers["reason"] == b"not_avro" and headers["origin"].startswith(f"{topics.requests('ANONYMOUS')}/".encode())


def _dlq_records(bootstrap, topics):
    from kafka import TopicPartition

    from profstream.kafka.clients import make_consumer

    consumer = make_consumer(bootstrap, group_id=None)
    try:
        tps = [TopicPartition(topics.dlq, p) for p in consumer.partitions_for_topic(topics.dlq)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out = []
        for records in consumer.poll(timeout_ms=5000).values():
            out.extend(records)
        return out
    finally:
        consumer.close()


def test_without_a_broker_the_monitor_runs_and_reports_no_captures():
    m = Monitor(bootstrap="127.0.0.1:1", run_id="offline", connect_timeout_s=0.5, host_sample_interval_s=0)
    for _ in range(5):
        with m.step():
            m.op("x", time.time_ns(), 1)
    stats = m.stats()
    assert stats["control_connected"] is False and stats["capture_requests"] == 0
    m.close(timeout=1)


@pytest.mark.parametrize("argv, said", [
    (["capture"], "give --run RUN"),
    (["capture", "--run", "a/b"], "invalid run id 'a/b'"),
    (["capture", "--run", "r", "--ranks", "3-1"], "the range 3-1 ends before it starts"),
    (["capture", "--run", "r", "--activities", "tpu"], "--activities 'tpu'"),
])
def test_bad_capture_arguments_get_one_line_errors(argv, said):
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and said in result.output


def test_capture_against_a_prefix_without_its_control_topic_says_so_in_one_line(kafka_bootstrap):
    said = "topic nowhere-else.control does not exist"
    for argv in (["--run", "r"], ["--list"]):
        result = CliRunner().invoke(app, ["capture", *argv, "--bootstrap", kafka_bootstrap,
                                          "--topic-prefix", "nowhere-else"])
        assert result.exit_code == 2 and said in result.output, result.output


def test_a_capture_for_a_run_nobody_has_seen_says_so_at_once_not_after_the_timeout(kafka_bootstrap, topics):
    """--wait's default timeout is 600 s: a run id with a typo waited for all of it, then
    quoted another timeout. It now says within seconds that no rank of the run was seen."""
    from profstream.simulate import SimConfig, run_simulation

    run_simulation(SimConfig(run_id="real-run", ranks=1, steps=5, ops_per_step=20),
                   {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
    with RunningProcessor(kafka_bootstrap, topics):  # it shows real-run on the run topic
        wait_until(lambda: runs_seen(kafka_bootstrap, topics, 600).get("real-run"), 60, "the run topic to show it")
    started = time.monotonic()
    result = CliRunner().invoke(app, ["capture", "--run", "rael-run", "--wait", "--bootstrap", kafka_bootstrap,
                                      "--topic-prefix", topics.prefix])
    waited = time.monotonic() - started
    assert result.exit_code == 2 and waited < 60, (waited, result.output)
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: no rank of run rael-run has been seen") and "runs of the last 2 min: real-run" in last
    assert "warning: the processors have shown no step of run rael-run" in result.output
    assert "600" not in result.output  # no timeout quoted that did not pass


def test_the_report_sets_a_captured_window_s_op_types_beside_the_baseline(kafka_bootstrap, topics, tmp_path):
    import re

    from profstream.offline.archive import finished_files, iter_file
    from profstream.simulate import SimConfig, expected, run_simulation
    from profstream.sinks.archive import run_archive
    from tests.helpers import topic_size

    # ten op types (the processors' top 10: none is folded into "other"); ops every 10th step
    # on a schedule, the baseline, and steps 40-44 on request, slower as they are in the stall
    # steps of 100 ms: the request must reach the rank before step 40 begins (4 s after the run's
    # first batch), also when a loaded machine takes seconds to read that batch and send it
    cfg = SimConfig(run_id="reported", ranks=1, steps=60, ops_per_step=10, step_time_ms=100, stall=(35, 59),
                    rate="realtime", seed=5)
    out = tmp_path / "archive"
    stop = threading.Event()
    sink = threading.Thread(target=run_archive, args=(kafka_bootstrap, [topics.raw, topics.control,
                                                                        topics.requests_prefix], out, stop),
                            kwargs={"group_id": f"a-{topics.prefix}", "max_age_s": 0.5}, daemon=True)
    sink.start()
    request = new_request("reported", start_step=40, steps=5, reason="a test")

    def ask():
        wait_until(lambda: raw_batches(kafka_bootstrap, topics.raw, "reported", 1, timeout=1, full=False), 60, "the run")
        send_request(kafka_bootstrap, topics, request)

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix, "every_n_steps": 10})
        asker.join(60)
        total = sum(topic_size(kafka_bootstrap, t) for t in (topics.raw, topics.control, topics.requests("ANONYMOUS")))
        wait_until(lambda: sum(1 for f in finished_files(out) for r, _ in iter_file(f) if r) == total, 60,
                   "the archive to hold every raw, control and request message")
    finally:
        stop.set()
        sink.join(30)
    page = tmp_path / "report.html"
    result = CliRunner().invoke(app, ["report", str(out), "--run", "reported", "-o", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert re.search(r'<table class="capture" data-rank="0" data-first="40" data-last="44">', text)
    (asked,) = re.findall(r'<p class="sub">asked by [^<]*</p>', text)
    assert "a test" in asked and "asked by ANONYMOUS" in asked, asked  # the broker's name for who sent it
    (window,) = re.findall(r"<p>Rank 0, steps 40–44 [^<]*", text)
    assert "4 earlier steps with ops" in window, window  # steps 0, 10, 20, 30
    truth = expected(cfg)

    def mean_ms(op_type, steps):
        return sum(truth[(0, s)]["op_types"].get(op_type, (0, 0))[0] for s in steps) / len(steps) / 1e6

    rows = re.findall(r'<tr data-op-type="([^"]+)"><td>[^<]*</td><td>([^<]+)</td><td>([^<]+)</td>', text)
    assert len(rows) == 10
    for op_type, before, during in rows:
        assert float(before) == pytest.approx(mean_ms(op_type, (0, 10, 20, 30)), abs=5e-4), op_type
        assert float(during) == pytest.approx(mean_ms(op_type, range(40, 45)), abs=5e-4), op_type


def test_a_request_written_while_the_reader_positions_itself_on_a_new_topic_is_read():
    """A new requester creates its topic and writes its request at once: the reader that
    finds the topic in between, with nothing written since its start, must still read it.
    (It took the topic's end after asking the times, and so started past such a request:
    a secured pipeline test saw no status in 60 s on a loaded box.)"""
    import types

    import confluent_kafka

    from profstream.kafka.topics import Topics
    from profstream.producers.control import ControlReader

    topics = Topics("race")
    topic = topics.requests_prefix + "alice"
    written = []  # offsets of the requests on the topic's one partition

    class Consumer:  # the broker's answers, the request written right after the times were asked
        def list_topics(self, timeout):
            meta = types.SimpleNamespace(error=None, partitions={0: None})
            return types.SimpleNamespace(topics={topic: meta})

        def get_watermark_offsets(self, tp, timeout):
            return 0, len(written)

        def offsets_for_times(self, tps, timeout):
            out = [confluent_kafka.TopicPartition(tp.topic, tp.partition, -1) for tp in tps]  # none since
            written.append(0)  # the requester's write lands now
            return out

        def incremental_assign(self, tps):
            self.assigned = tps

    owner = types.SimpleNamespace(options={"connect_timeout_s": 1.0}, connection=Connection("127.0.0.1:1"),
                                  run_id="r", rank=0, producer_id="p", topics=topics)
    reader = ControlReader(owner, plan=None, since_ms=0)
    consumer = Consumer()
    reader._scan(consumer, 1.0)
    assert [(tp.topic, tp.offset) for tp in consumer.assigned] == [(topic, 0)]  # from the request on
