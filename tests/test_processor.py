"""The stream processor against the real broker: alerts, stragglers, bad input, crashes."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
from collections import Counter, namedtuple

import numpy as np
import pytest
from kafka import KafkaConsumer

from profstream.kafka.clients import make_producer, read_topic
from profstream.kafka.topics import Topics, ensure_topics
from profstream.processors.health import StageCounts
from profstream.processors.runtime import Processor, RunStage, StepStage
from profstream.schema.codec import decode, record_name
from profstream.simulate import SimConfig, expected, run_simulation
from tests.helpers import read_full, scrape, step_records, wait_until
from tests.test_grafana_client import Feed, step_metrics


class RunningProcessor:
    """A Processor on a thread, stopped on exit."""

    def __init__(self, bootstrap, topics, **kw) -> None:
        kw.setdefault("group_id", f"g-{topics.prefix}")
        kw.setdefault("grace_s", 0.5)
        kw.setdefault("run_grace_s", 5.0)
        self.processor = Processor(bootstrap, topics, **kw)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.processor.run(self.stop)
        except BaseException as e:  # surfaced in __exit__
            self.error = e

    def __enter__(self) -> Processor:
        self.thread.start()
        return self.processor

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)
        if self.error is not None:
            raise AssertionError(f"the processor failed: {self.error!r}") from self.error


def _alerts(bootstrap, topics, run_id, count, timeout=60, full=True):
    return (read_full if full else read_topic)(bootstrap, topics.alerts, lambda a: a["run_id"] == run_id, count,
                                               timeout, decode=lambda v: decode("Alert", v))


def _run_steps(bootstrap, topics, run_id, count, timeout=60, full=True):
    return (read_full if full else read_topic)(bootstrap, topics.run, lambda r: r["run_id"] == run_id, count,
                                               timeout, decode=lambda v: decode("RunStepMetrics", v))


def test_data_stall_fires_at_the_fifth_starved_step_and_resolves_after_five_healthy(kafka_bootstrap, topics):
    stalled = SimConfig(run_id="stalled", ranks=2, steps=50, ops_per_step=40, stall=(20, 34), seed=5)
    clean = SimConfig(run_id="clean", ranks=2, steps=50, ops_per_step=40, seed=5)
    with RunningProcessor(kafka_bootstrap, topics):
        for cfg in (stalled, clean):
            run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
        steps = step_records(kafka_bootstrap, topics.steps, "stalled", 100)
        step_records(kafka_bootstrap, topics.steps, "clean", 100)
        alerts = _alerts(kafka_bootstrap, topics, "stalled", 4)
    assert sorted((s["rank"], s["step"]) for s in steps if s["starved"]) == [
        (r, s) for r in range(2) for s in range(20, 35)]
    got = sorted((a["rank"], a["step"], a["state"]) for a in alerts)
    assert got == [(0, 24, "firing"), (0, 39, "resolved"), (1, 24, "firing"), (1, 39, "resolved")]
    firing = next(a for a in alerts if a["state"] == "firing")
    assert firing["name"] == "DataQueueStall" and "since step 20" in firing["summary"]
    assert _alerts(kafka_bootstrap, topics, "clean", 1, timeout=2, full=False) == []  # nothing fires on a clean run


def test_straggler_is_named_on_every_step_with_the_defined_skew(kafka_bootstrap, topics):
    cfg = SimConfig(run_id="straggle", ranks=4, steps=30, ops_per_step=40, straggler_rank=2,
                    straggler_factor=1.6, seed=9)
    with RunningProcessor(kafka_bootstrap, topics) as processor:
        run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
        runs = _run_steps(kafka_bootstrap, topics, "straggle", cfg.steps, full=False)
        stage = processor.run_stage
        seen = (f"run stage emitted {processor.health.run_steps}, holds "
                f"{ {k: (sorted(r.ranks), r.floor, len(r.pending)) for k, r in stage.runs.items()} }, "
                f"steps closed {processor.health.steps_closed}, assignment "
                f"{processor.loops[1].assignment()}")
    truth = expected(cfg)
    assert len(runs) >= cfg.steps, f"short read: {len(runs)} of {cfg.steps} RunStepMetrics; {seen}"
    assert sorted(r["step"] for r in runs) == list(range(cfg.steps)), seen
    for r in runs:
        times = sorted(truth[(rank, r["step"])]["step_time_ns"] for rank in range(4))
        median = (times[1] + times[2]) / 2
        assert r["ranks_reported"] == 4
        assert r["straggler_rank"] == 2
        assert r["skew"] == pytest.approx((times[-1] - times[0]) / median, rel=1e-12)
        assert r["max_step_time_ns"] == truth[(2, r["step"])]["step_time_ns"]


def test_undecodable_messages_go_to_the_dead_letter_topic_and_valid_steps_still_count(kafka_bootstrap, topics):
    from profstream.schema.batch import EventBatch, encode_batch

    cfg = SimConfig(run_id="mixed", ranks=2, steps=20, ops_per_step=40, seed=2)
    good = encode_batch(EventBatch(run_id="x", rank=0))
    garbage = {
        "not_avro": b'{"op": "matmul"}',
        "truncated": good[: len(good) // 2],
        "unknown_fingerprint": b"\xc3\x01" + b"\x13" * 8 + good[10:],
    }
    producer = make_producer(kafka_bootstrap)
    with RunningProcessor(kafka_bootstrap, topics):
        for value in garbage.values():  # before, between and after the run's batches
            producer.send(topics.raw, value=value, key=b"mixed/0")
        producer.flush()
        run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
        for value in garbage.values():
            producer.send(topics.raw, value=value, key=b"mixed/1")
        producer.close()
        steps = step_records(kafka_bootstrap, topics.steps, "mixed", 40)
        dead = read_topic(kafka_bootstrap, topics.dlq, lambda _: True, 6, 30, decode=None)
    assert sorted((s["rank"], s["step"]) for s in steps) == [(r, s) for r in range(2) for s in range(20)]
    truth = expected(cfg)
    assert all(s["step_time_ns"] == truth[(s["rank"], s["step"])]["step_time_ns"] for s in steps)
    assert len(dead) == 6
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                             isolation_level="read_committed", consumer_timeout_ms=5000)
    consumer.subscribe([topics.dlq])
    reasons = Counter()
    for rec in consumer:
        headers = dict(rec.headers)
        reasons[headers["reason"].decode()] += 1
        topic, part, offset = headers["origin"].decode().rsplit("/", 2)
        assert topic == topics.raw and int(part) >= 0 and int(offset) >= 0
        assert rec.value in garbage.values()  # the original bytes, untouched
        if sum(reasons.values()) == 6:
            break
    consumer.close()
    assert reasons == {"not_avro": 2, "truncated": 2, "unknown_fingerprint": 2}


_Rec = namedtuple("_Rec", "topic partition offset key value")


def _uninterrupted(bootstrap, topics, run_id, n_batches) -> dict:
    """StepMetrics of the run computed by one StepStage that never stops, per (rank, step)."""
    records: list = []
    read_full(bootstrap, topics.raw, lambda r: records.append(r) or True, n_batches, 30, what="raw batches")
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             isolation_level="read_committed", consumer_timeout_ms=3000)
    consumer.subscribe([topics.raw])
    stage = StepStage(topics, 3, StageCounts(keep_step_ends=False))
    out = []
    for rec in consumer:
        out += stage.fold(_Rec(rec.topic, rec.partition, rec.offset, rec.key, rec.value), 0.0)
        out += stage.ready(0.0)
    consumer.close()
    out += stage.ready(1e9)
    steps = [decode("StepMetrics", o.value) for o in out if record_name(o.value) == "StepMetrics"]
    return {(s["rank"], s["step"]): s for s in steps if s["run_id"] == run_id}


def test_kill_9_and_restart_gives_every_step_exactly_once_with_identical_values(kafka_bootstrap, topics, tmp_path):
    # realtime: each step's ops arrive before its end mark, so commits happen with steps open
    cfg = SimConfig(run_id="crash", ranks=2, steps=400, ops_per_step=100, step_time_ms=25, seed=4,
                    rate="realtime")
    total = cfg.ranks * cfg.steps
    cmd = [sys.executable, "-m", "profstream.cli", "process", "--bootstrap", kafka_bootstrap,
           "--topic-prefix", topics.prefix, "--group-id", f"g-{topics.prefix}", "--instance-id", "p0",
           "--metrics-port", "0", "--grace-s", "0.5", "--run-grace-s", "5"]
    log = open(tmp_path / "processor.log", "w")

    def start():
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    proc = start()
    wait_until(lambda: "processing" in (tmp_path / "processor.log").read_text(), 60, "the processor to start")
    sim = {}
    producer = threading.Thread(target=lambda: sim.update(r=run_simulation(
        cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix, "batch_interval_ms": 5})))
    producer.start()
    try:
        # kill -9 once it has committed some steps, mid-run
        wait_until(lambda: len(step_records(kafka_bootstrap, topics.steps, "crash", 100, timeout=0.5, full=False)) >= 100,
                   60, "100 committed steps before the crash")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        before = len(step_records(kafka_bootstrap, topics.steps, "crash", total, timeout=1, full=False))
        assert before < total, "the run was over before the crash: the test did not test a crash"
        proc = start()
        # mid-run, `kill -USR1` logs where each stage stands, and the loop goes on unharmed
        wait_until(lambda: (tmp_path / "processor.log").read_text().count("processing") == 2, 60, "the restart")

        def dumped() -> bool:
            if " assigned [" in (tmp_path / "processor.log").read_text():
                return True
            proc.send_signal(signal.SIGUSR1)  # again: one sent before it was assigned shows nothing
            return False

        wait_until(dumped, 60, "a state dump on USR1", interval=1.0)
        dump = (tmp_path / "processor.log").read_text()
        assert f"g-{topics.prefix}-p0: assigned [" in dump and f"g-{topics.prefix}-run-p0: assigned [" in dump, dump
        producer.join(120)
        steps = step_records(kafka_bootstrap, topics.steps, "crash", total, timeout=90)
        # give a duplicate the chance to show up
        steps = step_records(kafka_bootstrap, topics.steps, "crash", total + 1, timeout=3, full=False)
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
    counts = Counter((s["rank"], s["step"]) for s in steps)
    assert len(counts) == total and max(counts.values()) == 1, (tmp_path / "processor.log").read_text()[-2000:]
    reference = _uninterrupted(kafka_bootstrap, topics, "crash", sum(s["seq"] for s in sim["r"].stats))
    assert len(reference) == total
    for s in steps:
        ref = reference[(s["rank"], s["step"])]
        for field in s:
            if field != "closed_ns":
                assert s[field] == ref[field], (s["rank"], s["step"], field)


def test_ctrl_c_and_sigterm_end_a_processor_promptly_and_the_next_one_redoes_what_was_not_committed(
        kafka_bootstrap, topics, tmp_path):
    # The first processor starts with SIGINT ignored, as a script's background job does
    # (`profstream process &`); `kill -INT` stopped nothing then, and SIGTERM ended the second
    # at once, without its last commit (status -15). Each must stop within seconds, exit 0,
    # and the run still come out once.
    cfg = SimConfig(run_id="stops", ranks=2, steps=600, ops_per_step=40, step_time_ms=25, seed=9, rate="realtime")
    total = cfg.ranks * cfg.steps
    cmd = [sys.executable, "-m", "profstream.cli", "process", "--bootstrap", kafka_bootstrap,
           "--topic-prefix", topics.prefix, "--group-id", f"g-{topics.prefix}", "--instance-id", "p0",
           "--metrics-port", "0", "--grace-s", "0.5", "--run-grace-s", "5"]
    log_path = tmp_path / "processor.log"
    log = open(log_path, "w")

    def start(ignore_sigint: bool = False) -> subprocess.Popen:
        started = log_path.read_text().count("processing")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint
                                else None)
        wait_until(lambda: log_path.read_text().count("processing") > started, 60, "the processor to start")
        return proc

    def committed() -> int:
        return len(step_records(kafka_bootstrap, topics.steps, "stops", total, timeout=0.5, full=False))

    proc = start(ignore_sigint=True)
    producer = threading.Thread(target=run_simulation, args=(cfg, {"bootstrap": kafka_bootstrap,
                                                                  "topic_prefix": topics.prefix}))
    producer.start()
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            before = committed()
            wait_until(lambda b=before: committed() >= b + 100, 60, f"100 more committed steps before {signum!r}")
            proc.send_signal(signum)
            try:
                code = proc.wait(10)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the processor did not end within 10 s of {signum!r}") from None
            assert code == 0, f"{signum!r}: exit status {code}\n{log_path.read_text()[-2000:]}"
            assert f"{signal.Signals(signum).name}: stopping" in log_path.read_text()
            assert committed() < total, "the run was over before the stop: the test did not test a stop"
            proc = start()
        producer.join(120)
        steps = step_records(kafka_bootstrap, topics.steps, "stops", total, timeout=90)
        steps = step_records(kafka_bootstrap, topics.steps, "stops", total + 1, timeout=3, full=False)  # a duplicate?
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
    counts = Counter((s["rank"], s["step"]) for s in steps)
    assert len(counts) == total and max(counts.values()) == 1, log_path.read_text()[-2000:]
    truth = expected(cfg)
    assert all(s["step_time_ns"] == truth[(s["rank"], s["step"])]["step_time_ns"] for s in steps)


def test_a_batch_the_raw_topic_holds_twice_is_counted_once(kafka_bootstrap, topics):
    """librdkafka's idempotent producer can resend a batch the broker already wrote (an epoch
    bump after a leader change): the raw topic then holds it twice, the copy among the
    rank's next batches, while its step is still open. The figures must still be the run's."""
    # realtime with 5 ms batches: each step's ops arrive in several batches before its end mark
    cfg = SimConfig(run_id="twice", ranks=2, steps=20, ops_per_step=40, step_time_ms=20, seed=6, rate="realtime")
    staging = Topics(prefix=f"{topics.prefix}-staging")
    ensure_topics(kafka_bootstrap, staging, raw_partitions=4, partitions=3)
    sim = run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": staging.prefix, "batch_interval_ms": 5})
    n_batches = sum(s["seq"] for s in sim.stats)
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                             isolation_level="read_committed", consumer_timeout_ms=5000)
    consumer.subscribe([staging.raw])
    records = [rec for rec, _ in zip(consumer, range(n_batches))]
    consumer.close()
    assert len(records) == n_batches
    producer = make_producer(kafka_bootstrap)
    copies = 0
    for i, rec in enumerate(sorted(records, key=lambda r: (r.partition, r.offset))):
        for _ in range(1 + (i % 3 == 0)):  # every third batch twice in a row
            producer.send(topics.raw, value=rec.value, key=rec.key, partition=rec.partition)
        copies += i % 3 == 0
    producer.flush()
    producer.close()
    with RunningProcessor(kafka_bootstrap, topics) as processor:
        steps = step_records(kafka_bootstrap, topics.steps, "twice", cfg.ranks * cfg.steps)
        wait_until(lambda: processor.health.steps_closed == cfg.ranks * cfg.steps, 30, "the steps counted")
        health = processor.health
    truth = expected(cfg)
    assert sorted((s["rank"], s["step"]) for s in steps) == sorted(truth)
    for s in steps:
        want = truth[(s["rank"], s["step"])]
        got = (s["op_count"], sum(t["count"] for t in s["op_types"]), sum(t["total_ns"] for t in s["op_types"]))
        assert got == (cfg.ops_per_step, cfg.ops_per_step, sum(d for d, _ in want["op_types"].values())), (s["rank"], s["step"])
    assert health.events["ops"] == sim.ops_recorded and health.lost_batches == 0
    assert 0 < health.duplicate_batches <= copies  # a copy whose steps had all closed is dropped as late


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_metrics_report_what_went_through_and_idle_runs_are_freed(kafka_bootstrap, topics):
    # realtime, 40 x 50 ms: many batches per rank over 2 s, so later headers carry an acknowledged
    # latency also where a loaded machine takes most of a second to acknowledge the first ones
    cfg = SimConfig(run_id="health", ranks=2, steps=40, ops_per_step=40, seed=1, step_time_ms=50, rate="realtime")
    total = cfg.ranks * cfg.steps
    port = _free_port()
    with RunningProcessor(kafka_bootstrap, topics, idle_timeout_s=3.0) as processor:
        processor.health.serve(port, addr="127.0.0.1")
        producer = make_producer(kafka_bootstrap)
        producer.send(topics.raw, value=b"not avro at all", key=b"health/0")
        producer.close()
        # the Monitors never say they ended (a killed job): the run is freed by the idle timeout
        sim = run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix}, ended=False)
        step_records(kafka_bootstrap, topics.steps, "health", total)
        m = wait_until(lambda: (lambda s: s if s["profstream_steps_closed_total"] >= total else None)(scrape(port)),
                       30, "the metrics to show the run")
        assert m["profstream_events_total{family=ops}"] == sim.ops_recorded
        assert m["profstream_events_total{family=steps}"] == total
        assert m["profstream_decode_errors_total{reason=not_avro}"] == 1
        assert m["profstream_lost_batches_total"] == 0 and m["profstream_late_events_total"] == 0
        assert m["profstream_open_runs"] == 1
        assert m["profstream_step_freshness_seconds_count"] == total
        # producer health per rank, from the batch headers: fill within 0..1, latency acknowledged
        for rank in range(cfg.ranks):
            assert 0.0 <= m[f"profstream_producer_buffer_fill_ratio{{rank={rank},run=health}}"] <= 1.0
            assert m[f"profstream_producer_send_latency_seconds{{rank={rank},run=health}}"] > 0
        # the run goes silent: after the idle timeout its state is freed, its series with it
        wait_until(lambda: scrape(port)["profstream_open_runs"] == 0, 30, "the silent run to be closed")
        assert not [k for k in scrape(port) if "run=health" in k]
        assert processor.step_stage.ranks == {}
        # counted when the transaction that closed them commits, a moment after the state went
        wait_until(lambda: processor.health.runs_closed == 2, 30, "both idle ranks to be counted as closed")


def test_two_processors_in_one_group_share_the_ranks_and_still_agree_across_ranks(kafka_bootstrap, topics):
    cfg = SimConfig(run_id="shared", ranks=6, steps=20, ops_per_step=40, straggler_rank=4, seed=8)
    group = f"g-{topics.prefix}"
    with RunningProcessor(kafka_bootstrap, topics, group_id=group, instance_id="a") as a, \
            RunningProcessor(kafka_bootstrap, topics, group_id=group, instance_id="b") as b:
        wait_until(lambda: len(a.loops[0].assignment()) + len(b.loops[0].assignment()) == 4
                   and a.loops[0].assignment() and b.loops[0].assignment(),
                   60, "both processors to own raw partitions")
        run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
        steps = step_records(kafka_bootstrap, topics.steps, "shared", 120)
        runs = _run_steps(kafka_bootstrap, topics, "shared", 20)
        closed_by = (a.health.steps_closed, b.health.steps_closed)
    assert sorted(Counter((s["rank"], s["step"]) for s in steps).values()) == [1] * 120
    assert all(n > 0 for n in closed_by), f"one processor did all the work: {closed_by}"
    assert sorted(r["step"] for r in runs) == list(range(20))
    assert all(r["ranks_reported"] == 6 and r["straggler_rank"] == 4 for r in runs)


def test_a_run_stage_restored_from_its_checkpoint_emits_no_step_twice():
    """A step emitted before the restart whose last report lies past the committed offset
    (the first report of a step still open) is re-read after it: the restored floor drops it."""
    topics, feed = Topics(prefix="restore"), Feed()

    def report(rank: int, step: int):
        return feed(topics.steps, "StepMetrics", step_metrics("r", rank, step, 100 * step))  # world_size 2

    first = RunStage(topics, StageCounts(keep_step_ends=False), grace_s=1.0)
    records = [report(0, 0), report(0, 1), report(1, 0)]  # step 1 opens before step 0 completes
    emitted = []
    for rec in records:
        first.fold(rec, 0.0)
    emitted += first.ready(0.0)
    assert [decode("RunStepMetrics", o.value)["step"] for o in emitted] == [0]
    checkpoint = first.changed_state()
    committed = first.commit_offset(0, records[-1].offset + 1)
    assert committed == records[1].offset  # step 1's first report: step 0's last one lies after it

    restarted = RunStage(topics, StageCounts(keep_step_ends=False), grace_s=1.0)
    for out in checkpoint:
        restarted.restore(out.partition, out.key, out.value, 10.0)
    for rec in records[committed:] + [report(1, 1)]:
        restarted.fold(rec, 10.0)
    emitted += restarted.ready(10.0) + restarted.ready(20.0)  # and once every grace is over
    steps = Counter(decode("RunStepMetrics", o.value)["step"] for o in emitted if o.topic == topics.run)
    assert steps == {0: 1, 1: 1}, f"run steps emitted (step: times): {dict(steps)}"


def test_a_run_step_whose_reports_still_come_waits_and_silent_ranks_are_left_out_after_the_grace():
    """16,384 ranks' StepMetrics of one step reach the run stage over many seconds (the step
    stage closes them one by one): the grace runs from the step's latest report, so the step
    waits while reports come and is emitted whole; ranks that fell silent are left out a
    grace after the last report, the others' figures intact."""
    topics, feed = Topics(prefix="trickle"), Feed()
    world, grace, silent = 64, 1.0, {7, 30, 31, 63}

    def report(rank: int, step: int, step_ms: int):
        return feed(topics.steps, "StepMetrics",
                    {**step_metrics("r", rank, step, 1000 * step, step_ms), "world_size": world})

    stage = RunStage(topics, StageCounts(keep_step_ends=False), grace_s=grace)
    emitted, now = [], 0.0
    for rank in range(world):  # step 0: a report every 0.4 s, 25 s in all
        stage.fold(report(rank, 0, 100 + rank), now)
        emitted += stage.ready(now)
        now += 0.4
    for rank in sorted(set(range(world)) - silent):  # step 1: the silent ranks never report it
        stage.fold(report(rank, 1, 200 + rank), now)
        emitted += stage.ready(now)
        now += 0.4
    assert [decode("RunStepMetrics", o.value)["step"] for o in emitted if o.topic == topics.run] == [0]
    emitted += stage.ready(now - 0.4 + grace * 0.9)
    assert len([o for o in emitted if o.topic == topics.run]) == 1  # still inside the grace of its last report
    emitted += stage.ready(now - 0.4 + grace)
    runs = [decode("RunStepMetrics", o.value) for o in emitted if o.topic == topics.run]
    assert [r["step"] for r in runs] == [0, 1]
    assert runs[0]["ranks_reported"] == world and runs[0]["max_step_time_ns"] == (100 + world - 1) * 1_000_000
    reported = {int(r) for r in runs[1]["step_times_ns"]}
    assert set(range(world)) - reported == silent and runs[1]["ranks_reported"] == world - len(silent)
    assert runs[1]["min_step_time_ns"] == 200 * 1_000_000 and runs[1]["straggler_rank"] == 62


def test_a_rank_running_ten_times_ahead_does_not_end_the_others_run_steps():
    """A flooding rank (ten steps in the time of the others' one) reports each step long
    before the rest: the step waits while the ranks behind it keep reporting, and every run
    step comes out with all the ranks' step times."""
    topics, feed = Topics(prefix="flood"), Feed()
    world, grace, flooder, steps = 8, 3.0, 5, 6

    def report(rank: int, step: int):
        return feed(topics.steps, "StepMetrics",
                    {**step_metrics("r", rank, step, 1000 * step, 100 + rank), "world_size": world})

    arrivals = sorted([(0.1 * s, flooder, s) for s in range(steps * 10)]
                      + [(s + 1.0, r, s) for s in range(steps) for r in range(world) if r != flooder])
    stage = RunStage(topics, StageCounts(keep_step_ends=False), grace_s=grace)
    emitted = []
    for now, rank, step in arrivals:
        stage.fold(report(rank, step), now)
        emitted += stage.ready(now)
    emitted += stage.ready(arrivals[-1][0] + grace)
    runs = {(m := decode("RunStepMetrics", o.value))["step"]: m for o in emitted if o.topic == topics.run}
    assert [runs[s]["ranks_reported"] for s in range(steps)] == [world] * steps
    assert all(runs[s]["ranks_reported"] == 1 for s in range(steps, steps * 10))  # the flooder's own steps


def test_ranks_that_fall_silent_are_left_out_of_the_run_steps_after_the_grace(kafka_bootstrap, topics):
    """Through the real broker and processor: 3 of 12 simulated ranks die after step 3 (no end
    mark); every later run step still comes out, after the grace, with exactly those ranks
    missing and the others' step times, min / median / max and straggler as planned."""
    cfg = SimConfig(run_id="silent", ranks=12, steps=8, ops_per_step=20, seed=11)
    silent, last = [2, 7, 11], 3
    opts = {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix}
    with RunningProcessor(kafka_bootstrap, topics, run_grace_s=6.0):
        dying = threading.Thread(target=run_simulation, args=(dataclasses.replace(cfg, steps=last + 1), opts),
                                 kwargs={"ranks": silent, "ended": False})  # the same plans, to step 3
        dying.start()
        run_simulation(cfg, opts, ranks=[r for r in range(12) if r not in silent])
        dying.join(60)
        runs = {r["step"]: r for r in _run_steps(kafka_bootstrap, topics, "silent", cfg.steps, timeout=90)}
    truth = expected(cfg)
    assert sorted(runs) == list(range(cfg.steps))
    for step, run in runs.items():
        want = {r: truth[(r, step)]["step_time_ns"] for r in range(12) if step <= last or r not in silent}
        assert {int(r): t for r, t in run["step_times_ns"].items()} == want, f"step {step}"
        assert run["ranks_reported"] == len(want) == (12 if step <= last else 9)
        assert (run["min_step_time_ns"], run["max_step_time_ns"]) == (min(want.values()), max(want.values()))
        assert run["median_step_time_ns"] == float(np.median(list(want.values())))
        assert run["straggler_rank"] == max(want, key=lambda r: (want[r], -r))
