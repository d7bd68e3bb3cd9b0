"""The Monitor as a training loop sees it: never blocks, never raises, bounded, honest about loss."""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import pytest

from profstream import COMMUNICATION, COMPUTE, ConfigError, Monitor
from profstream.schema.batch import END_MARK
from tests.helpers import IdleSender, raw_batches, read_full, topic_size, wait_until

UNREACHABLE = "127.0.0.1:1"


@pytest.fixture(autouse=True, params=["native", "python"])
def recording(request, monkeypatch) -> str:
    """Every test runs on both Monitors: the compiled one and the pure-Python fallback."""
    if request.param == "native":
        from profstream.producers import native

        if native.load()[0] is None:
            pytest.skip(f"the native Monitor is not built here: {native.load()[1]} (tests/test_native.py fails on it)")
    monkeypatch.setenv("PROFSTREAM_NATIVE", str(request.param == "native").lower())
    return request.param


def _train(mon: Monitor, steps: int, ops_per_step: int, first_step: int = 0) -> None:
    for s in range(first_step, first_step + steps):
        with mon.step(s):
            mon.queue("device_queue", 3, 8)
            mon.memory(1000 + s, 2000, 1500)
            for i in range(ops_per_step):
                mon.op(f"k{i % 7}", 1_000_000 * s + 10 * i, 5, COMPUTE if i % 5 else COMMUNICATION, stream=i % 2)


def test_training_goes_on_with_the_broker_down_and_one_warning_is_logged(caplog):
    caplog.set_level(logging.WARNING, logger="profstream")
    mon = Monitor(run_id="offline", bootstrap=UNREACHABLE, buffer_bytes="1MiB", host_sample_interval_s=0,
                  connect_timeout_s=0.5)
    _train(mon, steps=40, ops_per_step=500)
    stats = mon.stats()
    # the buffer is bounded: ops beyond it are dropped and counted, step marks are kept
    assert stats["dropped_ops"] > 0
    assert stats["buffered_ops"] + stats["dropped_ops"] == 40 * 500
    assert stats["buffered_ops"] < 5000
    assert stats["buffered_samples"] == 40 * 3  # marks, memory and queue samples all kept
    wait_until(lambda: [r for r in caplog.records if r.name.startswith("profstream")], 15,
               "the unreachable-broker warning")
    _train(mon, steps=40, ops_per_step=100, first_step=40)  # more events, more retries
    time.sleep(1.0)  # give the sender time to retry: no second warning may follow
    ours = [r for r in caplog.records if r.name.startswith("profstream")]
    assert len(ours) == 1, [r.getMessage() for r in ours]
    assert "not reachable" in ours[0].getMessage() and "profstream stack up" in ours[0].getMessage()
    assert not [r for r in caplog.records if r.name.startswith("kafka") and r.levelno >= logging.WARNING]
    started = time.monotonic()
    assert mon.close(timeout=2.0) is False  # not delivered, and says so
    assert time.monotonic() - started < 5.0


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("profstream") and r.levelno >= logging.WARNING]


def test_a_wrong_broker_address_is_said_at_once_and_close_keeps_to_its_timeout(caplog):
    """A short run with a wrong --bootstrap was silent (the warning came when the first
    10-s connection attempt failed, often after the run), and closing took 17 s."""
    caplog.set_level(logging.WARNING, logger="profstream")
    mon = Monitor(run_id="wrong-address", bootstrap=UNREACHABLE, host_sample_interval_s=0)  # connect_timeout_s 10
    _train(mon, steps=3, ops_per_step=10)
    wait_until(lambda: _warnings(caplog), 3, "a warning well before the first connection attempt gives up")
    assert "127.0.0.1:1 is not reachable" in _warnings(caplog)[0]
    started = time.monotonic()
    assert mon.close(timeout=2.0) is False
    assert time.monotonic() - started < 3.5  # its timeout (and a second for the thread), not timeout + 5


def test_a_run_that_ends_while_the_first_connection_is_pending_still_says_kafka_was_not_reached(caplog):
    """A port that takes TCP connections but speaks no Kafka: nothing fails before the run
    ends, so the close says it."""
    import socket

    caplog.set_level(logging.WARNING, logger="profstream")
    with socket.create_server(("127.0.0.1", 0)) as server:  # accepts, never answers
        address = f"127.0.0.1:{server.getsockname()[1]}"
        mon = Monitor(run_id="mute", bootstrap=address, host_sample_interval_s=0)
        _train(mon, steps=2, ops_per_step=10)
        started = time.monotonic()
        assert mon.close(timeout=1.0) is False
        assert time.monotonic() - started < 2.5
    said = _warnings(caplog)
    assert len(said) == 1 and f"Kafka at {address} was not reached" in said[0] and "--bootstrap" in said[0]


def test_calls_with_garbage_never_raise_into_the_training_loop():
    mon = Monitor(run_id="garbage", bootstrap=UNREACHABLE, host_sample_interval_s=0)
    mon.begin_step("not a step")
    mon.op(None, "soon", None, kind="warp-drive", stream="x", step=object())
    mon.op("ok", 1, 2)
    mon.ops(["a", "b"], [1, 2], [3, 4], kinds=["compute", "nonsense"])
    mon.memory("lots", None)
    mon.queue(None, "empty")
    mon.mark_fp_start()
    mon.mark_bp_end()
    mon.end_step()
    mon.end_step()  # twice
    mon.complete_through(0)
    mon.close(timeout=0.5)
    mon.op("after close", 1, 2)
    mon.close()


def test_bad_options_fail_at_construction_with_one_line():
    with pytest.raises(ConfigError) as e:
        Monitor(run_id="a/b")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError):
        Monitor(batch_interval_ms=0)


def test_disabled_monitor_records_nothing():
    mon = Monitor(enabled=False)
    assert mon.recording == "python"  # nothing to record: no native buffer either
    _train(mon, steps=3, ops_per_step=10)
    assert mon.stats()["buffered_ops"] == 0 and mon.close()


class _Gate:
    """A producer factory for a broker that is 'down' until opened (the broker is real)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.attempts = 0
        self.make = None  # the Sender's own factory

    def __call__(self, bootstrap: str, **kw):
        self.attempts += 1
        if not self.open.is_set():
            raise ConnectionError("broker down (test gate)")
        return self.make(bootstrap, **kw)

    def sender(self, monitor: Monitor):
        self.make = monitor.sender_type.default_producer
        return monitor.sender_type(monitor, producer_factory=self)


def test_drops_during_an_outage_are_counted_in_batch_headers(kafka_bootstrap, topics, recording):
    gate = _Gate()
    mon = Monitor(sender_factory=gate.sender, run_id="outage",
                  bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, buffer_bytes="1MiB",
                  host_sample_interval_s=0)
    assert mon.recording == recording
    _train(mon, steps=20, ops_per_step=500)
    wait_until(lambda: gate.attempts >= 1, 10, "a connection attempt")
    dropped = mon.dropped_ops
    assert dropped > 0
    gate.open.set()
    assert mon.flush(timeout=60) or mon.flush(timeout=30)
    seq = mon.stats()["seq"]
    mon.close()  # its end mark leaves in one more batch
    batches = raw_batches(kafka_bootstrap, topics.raw, "outage", seq + 1)
    assert [b.seq for b in batches] == list(range(seq + 1))  # no gaps
    assert sum(b.dropped_ops for b in batches) == dropped
    assert sum(b.n("ops") for b in batches) == 20 * 500 - dropped
    marks = np.concatenate([b.steps["step"] for b in batches])
    assert sorted(marks.tolist()) == [END_MARK, *range(20)]  # every step mark survived the outage, then the end


def test_step_window_captures_ops_only_on_the_chosen_steps(kafka_bootstrap, topics):
    mon = Monitor(run_id="window", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, start_step=3,
                  stop_step=8, every_n_steps=2, host_sample_interval_s=0)
    _train(mon, steps=12, ops_per_step=10)
    assert mon.close(timeout=30)
    batches = raw_batches(kafka_bootstrap, topics.raw, "window", mon.stats()["seq"])
    op_steps = set(np.concatenate([b.ops["step"] for b in batches]).tolist())
    assert op_steps == {3, 5, 7}
    assert sum(b.dropped_ops for b in batches) == 0  # outside the window is not a drop
    assert sorted(np.concatenate([b.steps["step"] for b in batches]).tolist()) == [END_MARK, *range(12)]


def test_watermark_never_runs_ahead_of_the_ops_it_covers(kafka_bootstrap, topics):
    """Batches split a big step; no op may arrive for a step a watermark already covered."""
    mon = Monitor(run_id="wm", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, batch_max_ops=100,
                  batch_interval_ms=1, host_sample_interval_s=0)
    _train(mon, steps=15, ops_per_step=730)
    assert mon.close(timeout=30)
    n = mon.stats()["seq"]
    batches = raw_batches(kafka_bootstrap, topics.raw, "wm", n)
    assert len(batches) == n and topic_size(kafka_bootstrap, topics.raw) == n
    covered = -1
    for b in batches:
        if len(b.ops["step"]):
            assert b.ops["step"].min() > covered, f"batch {b.seq} has ops of a step already complete"
        if b.complete_through_step is not None:
            assert b.complete_through_step >= covered
            covered = b.complete_through_step
    assert covered == 14
    assert sum(b.n("ops") for b in batches) == 15 * 730


def test_bulk_ops_are_copied_split_across_batches_and_covered_by_the_watermark(kafka_bootstrap, topics):
    mon = Monitor(run_id="bulk", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, batch_max_ops=1000,
                  host_sample_interval_s=0)
    n = 2500
    kinds = [COMPUTE if i % 4 else COMMUNICATION for i in range(n)]
    for s in range(3):
        names = np.array([f"op{i % 13}" for i in range(n)], dtype=object)
        start = np.arange(n, dtype=np.int64) * 100 + s * 10**6
        dur = np.full(n, 40, dtype=np.int64)
        with mon.step(s):
            mon.ops(names, start, dur, kinds=kinds, op_types="Gemm", streams=1)
        start[:] = -1  # the caller reuses its buffers: what was recorded must not change
        dur[:] = 0
        names[:] = "garbage"
    assert mon.close(timeout=30)
    batches = raw_batches(kafka_bootstrap, topics.raw, "bulk", mon.stats()["seq"])
    assert max(b.n("ops") for b in batches) <= 1000
    covered = -1
    got = {s: [] for s in range(3)}
    for b in batches:
        if b.n("ops"):
            assert b.ops["step"].min() > covered
            for s in set(b.ops["step"].tolist()):
                sel = b.ops["step"] == s
                got[s].extend(b.ops["start_ns"][sel].tolist())
            assert set(b.op_types) == {"Gemm"}
            assert (b.ops["stream"] == 1).all() and (b.ops["dur_ns"] == 40).all()
        if b.complete_through_step is not None:
            covered = b.complete_through_step
    for s in range(3):
        assert sorted(got[s]) == (np.arange(n) * 100 + s * 10**6).tolist()


def _handed_to_kafka(mon: Monitor) -> bool:
    """Everything recorded is built into batches that the Kafka client holds or delivered."""
    st = mon.stats()
    return st["buffered_ops"] == 0 and st["buffered_samples"] == 0 and st["batches_sent"] == st["seq"] > 0


def test_the_first_batch_arrives_first_and_whole_when_the_broker_would_take_a_later_one_first(
        kafka_bootstrap, topics):
    """The broker must never see a second produce request of a new Monitor before its
    first: it would write the second as the producer's first, and the first could then
    never be written, or only after the others (issue 28: the first step's batches were
    lost, and close() said all was delivered). A proxy (tests/kafka_proxy.py) holds the
    first request back and sends any second one first; the Monitor sends no second one
    while the first waits, so every batch arrives once, in order."""
    from tests.kafka_proxy import ReorderingProxy

    with ReorderingProxy(kafka_bootstrap) as proxy:
        mon = Monitor(run_id="first", bootstrap=proxy.bootstrap, topic_prefix=topics.prefix, batch_max_ops=100,
                      host_sample_interval_s=0, control=False)
        with mon.step(0):
            mon.ops(["load"] * 50, np.arange(50, dtype=np.int64) * 10, np.full(50, 5, dtype=np.int64))
        wait_until(proxy.holding.is_set, 30, "the Monitor's first produce request")
        for s in range(1, 5):  # more batches while the first waits
            with mon.step(s):
                mon.ops(["gemm"] * 250, np.arange(250, dtype=np.int64) * 10 + s * 10**6,
                        np.full(250, 5, dtype=np.int64))
        wait_until(lambda: _handed_to_kafka(mon), 30, "every batch handed to the Kafka client")
        # the client had every batch and 2 s to send a second request while the first waited
        assert not proxy.swapped.wait(2.0), "a second produce request went out while the first was unanswered"
        assert proxy.release()
        assert mon.close(timeout=30)
    stats = mon.stats()
    assert stats["dropped_ops"] == 0 and stats["undelivered_ops"] == 0
    batches = raw_batches(kafka_bootstrap, topics.raw, "first", stats["seq"])
    assert [b.seq for b in batches] == list(range(stats["seq"]))  # each once, in the order they were built
    starts = {s: sorted(t for b in batches for t, st in zip(b.ops["start_ns"].tolist(), b.ops["step"].tolist())
                        if st == s) for s in range(5)}
    assert starts[0] == (np.arange(50) * 10).tolist()
    assert all(starts[s] == (np.arange(250) * 10 + s * 10**6).tolist() for s in range(1, 5))


def test_an_outage_the_buffer_cannot_ride_out_drops_ops_and_samples_before_any_step_mark():
    """Issue 37: a 180 s outage of a realtime rank (15 steps/s, 100 ops, a memory and a queue
    sample a step) in a 4 MiB buffer lost 1,816 step marks with its ops, and those steps
    whole. Now ops drop first, then samples, and every step keeps its mark; only once the
    marks' own reserve is full do marks go, counted."""
    mon = Monitor(run_id="outage", bootstrap=UNREACHABLE, buffer_bytes="4MiB", host_sample_interval_s=0,
                  sender_factory=IdleSender)  # nothing leaves: the broker is away
    steps = 180 * 15
    _train(mon, steps, ops_per_step=100)
    stats = mon.stats()
    assert stats["dropped_ops"] > 0 and stats["dropped_samples"] > 0  # memory and queue samples went
    assert stats["dropped_marks"] == 0 and mon.buffer.buffered_samples >= steps  # every step's mark is kept
    partial = stats["partial_steps"]
    assert 0 < partial < steps and partial == stats["dropped_ops"] // 100 + 1  # the steps that lost ops say so
    # the marks' reserve, then full, drops marks last, and counts them
    first_dropped = None
    for s in range(steps, steps + mon.buffer.max_marks):
        _train(mon, 1, ops_per_step=100, first_step=s)
        if first_dropped is None and mon.stats()["dropped_marks"]:
            first_dropped = s
    assert first_dropped == mon.buffer.max_marks
    assert mon.stats()["dropped_marks"] == steps + mon.buffer.max_marks - first_dropped
    mon.close(timeout=0.5)


def test_per_call_and_bulk_ops_share_one_buffer_bound():
    mon = Monitor(run_id="bound", bootstrap=UNREACHABLE, buffer_bytes="1MiB", host_sample_interval_s=0)
    limit = mon.buffer.max_ops
    with mon.step(0):
        mon.ops(["a"] * limit, list(range(limit)), [1] * limit)  # the buffer is full of bulk ops
        for i in range(1000):
            mon.op("b", i, 1)
    stats = mon.stats()
    assert stats["buffered_ops"] == limit
    assert stats["dropped_ops"] == 1000
    mon.close(timeout=0.5)


def test_a_batch_over_the_message_limit_is_split_and_nothing_is_lost(kafka_bootstrap, topics):
    """Long, distinct op names make a batch of 8192 ops encode to megabytes: the Sender
    splits it under Kafka's message limit instead of losing it (or, as it once did,
    retrying it forever while the buffer filled up)."""
    from profstream.kafka.limits import MAX_MESSAGE_BYTES
    from profstream.schema.batch import decode_batch

    mon = Monitor(run_id="long-names", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix,
                  host_sample_interval_s=0)
    n = 6000
    names = [f"kernel_{i:05d}_" + "t" * 400 for i in range(n)]  # ~2.5 MB of names
    with mon.step(0):
        mon.ops(names, np.arange(n, dtype=np.int64) * 10, np.full(n, 5, dtype=np.int64))
    assert mon.flush(timeout=60)
    stats = mon.stats()
    mon.close()
    assert stats["dropped_ops"] == 0 and stats["dropped_samples"] == 0
    values = read_full(kafka_bootstrap, topics.raw, lambda v: True, stats["seq"] + 1, 30,  # + the end mark's
                       what="batches of long-names")
    assert len(values) == stats["seq"] + 1 >= 4
    assert max(len(v) for v in values) <= MAX_MESSAGE_BYTES
    batches = [decode_batch(v) for v in values]
    got = [b.op_names[i] for b in batches for i in b.ops["name_idx"]]
    assert sorted(got) == names  # every op once
    assert batches[-2].complete_through_step == 0  # the watermark came with the last part
    assert batches[-1].steps["step"].tolist() == [END_MARK]  # then the Monitor's close


def _ops_on_topic(bootstrap: str, topic: str, run_id: str, seq: int) -> list[int]:
    return sorted(np.concatenate([b.ops["start_ns"] for b in raw_batches(bootstrap, topic, run_id, seq)]).tolist())


def test_a_step_leaves_when_it_ends_not_while_it_runs(kafka_bootstrap, topics, monkeypatch):
    """What a step records is sent once the step ends (at the end of the batch interval),
    not once per interval while the step runs: a step end is what makes a batch worth its
    cost. With the idle interval far away, only the step end can have sent it."""
    from profstream.producers.sender import Sender

    monkeypatch.setattr(Sender, "idle_send_s", 120.0)
    mon = Monitor(run_id="ends", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, batch_interval_ms=20,
                  host_sample_interval_s=0)
    assert mon.flush(30)
    time.sleep(0.1)  # a flush may leave one more (empty) cycle behind it
    mon.begin_step(0)
    mon.ops([f"k{i}" for i in range(50)], list(range(50)), [5] * 50)
    time.sleep(0.5)  # 25 batch intervals of a running step: nothing worth sending yet
    assert mon.stats()["batches_sent"] == 0
    mon.end_step()
    wait_until(lambda: mon.stats()["batches_acked"] >= 1, 20, "the batch of the ended step")
    assert mon.stats()["batches_sent"] == 1
    assert _ops_on_topic(kafka_bootstrap, topics.raw, "ends", 1) == list(range(50))
    mon.close()


def test_a_long_step_still_sends_at_the_idle_interval(kafka_bootstrap, topics, monkeypatch):
    from profstream.producers.sender import Sender

    monkeypatch.setattr(Sender, "idle_send_s", 0.3)
    mon = Monitor(run_id="long-step", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, batch_interval_ms=20,
                  host_sample_interval_s=0)
    assert mon.flush(30)
    mon.begin_step(0)
    mon.ops([f"k{i}" for i in range(50)], list(range(50)), [5] * 50)
    wait_until(lambda: mon.stats()["batches_acked"] >= 1, 20, "the running step's ops, sent without a step end")
    assert _ops_on_topic(kafka_bootstrap, topics.raw, "long-step", 1) == list(range(50))
    mon.close()


def test_ops_recorded_after_their_step_leave_when_the_watermark_moves(kafka_bootstrap, topics, monkeypatch):
    """A profiler's ops arrive after their step ended (auto_watermark=False): moving the
    watermark over them sends them, without waiting for the next step's end."""
    from profstream.producers.sender import Sender

    monkeypatch.setattr(Sender, "idle_send_s", 120.0)
    mon = Monitor(run_id="late-ops", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, batch_interval_ms=20,
                  host_sample_interval_s=0, auto_watermark=False)
    assert mon.flush(30)
    with mon.step(0):
        pass
    wait_until(lambda: mon.stats()["batches_acked"] >= 1, 20, "step 0's mark")
    mon.begin_step(1)
    mon.ops([f"k{i}" for i in range(50)], list(range(50)), [5] * 50, step=0)
    mon.complete_through(0)
    wait_until(lambda: mon.stats()["batches_acked"] >= 2, 20, "step 0's ops, sent when the watermark moved")
    batches = raw_batches(kafka_bootstrap, topics.raw, "late-ops", 2)
    assert batches[-1].complete_through_step == 0 and batches[-1].n("ops") == 50
    mon.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="counts the sender thread's context switches in /proc")
def test_step_ends_do_not_wake_the_sender_once_per_step(kafka_bootstrap, topics):
    """On a box with no idle core every wake-up of a profstream thread is taken from the
    training loop: 200 short steps wake the sender about once per batch interval (each a
    message), not once per step as a step end used to."""
    mon = Monitor(run_id="wakes", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, batch_interval_ms=50,
                  host_sample_interval_s=0)
    assert mon.flush(30)

    def switches() -> int:
        with open(f"/proc/self/task/{mon._sender.native_id}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))

    before, started = switches(), time.monotonic()
    for s in range(200):
        with mon.step(s):
            mon.memory(s)
            time.sleep(0.002)
    woke, elapsed = switches() - before, time.monotonic() - started
    intervals = elapsed / 0.05
    assert woke <= 3 * intervals + 20, f"the sender woke {woke} times in {intervals:.0f} batch intervals of 200 steps"
    assert mon.close(timeout=30)
    assert mon.stats()["dropped_samples"] == 0


@pytest.mark.parametrize("native", [True, False])
def test_work_rows_count_with_the_marks_and_never_make_the_dropped_marks_negative(native):
    """A captured step's FLOPs go as a work row of the steps section after its mark
    (``ops_flops``): a row of the marks' reserve, so the marks dropped are counted over
    both and a Monitor that dropped none says 0 (it said -N with the compiled Monitor: the
    rows recorded outnumbered the marks offered)."""
    mon = Monitor(run_id="work-rows", bootstrap=UNREACHABLE, host_sample_interval_s=0, native=native,
                  sender_factory=IdleSender)
    for s in range(20):
        with mon.step(s):
            mon.op("gemm", 1_000 * s, 5)
        mon.ops_flops(s, 1e12)
    stats = mon.stats()
    assert stats["dropped_marks"] == 0 and stats["dropped_samples"] == 0
    mon.close(timeout=0.1)
