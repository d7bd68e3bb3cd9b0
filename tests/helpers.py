"""Reading what profstream wrote, for assertions."""

from __future__ import annotations

import time
from collections.abc import Callable

from profstream.kafka.clients import make_consumer, read_topic
from profstream.schema.batch import EventBatch, decode_batch
from profstream.schema.codec import decode, is_rank_progress, record_name


def read_full(bootstrap: str, topic: str, want, count: int, timeout: float, decode=None,
              what: str = "records") -> list:
    """``read_topic`` for a test that needs all ``count`` values: when fewer came within
    ``timeout`` the test fails here, as a short read, not later as a wrong figure."""
    got = read_topic(bootstrap, topic, want, count, timeout, decode=decode)
    assert len(got) >= count, f"short read: {len(got)} of the {count} {what} asked for came from {topic} " \
                              f"within {timeout:g} s"
    return got


def raw_batch(value: bytes) -> EventBatch | None:
    """The EventBatch of a raw-topic message; None for a RankProgress (where a rank is, sent by
    its Monitor's control thread beside its batches: docs/events.md)."""
    return None if is_rank_progress(value) else decode_batch(value)


def raw_batches(bootstrap: str, topic: str, run_id: str, count: int, timeout: float = 30.0,
                full: bool = True) -> list[EventBatch]:
    """``count`` batches of ``run_id`` from the raw topic, in each partition's order (fewer
    fail the test as a short read; ``full=False``: those that came within ``timeout``)."""
    read = read_full if full else read_topic
    kw = {"what": f"batches of {run_id}"} if full else {}
    return read(bootstrap, topic, lambda b: b is not None and b.run_id == run_id, count, timeout, decode=raw_batch,
                **kw)


def step_records(bootstrap: str, topic: str, run_id: str, count: int, timeout: float = 60.0,
                 name: str = "StepMetrics", full: bool = True) -> list[dict]:
    """``count`` records of ``run_id`` on the steps topic: its StepMetrics (or its RankEnds),
    as ``raw_batches``."""
    read = read_full if full else read_topic
    kw = {"what": f"{name}s of {run_id}"} if full else {}
    return read(bootstrap, topic, lambda r: r is not None and r["run_id"] == run_id, count, timeout,
                decode=lambda v: decode(name, v) if record_name(v) == name else None, **kw)


def topic_records(bootstrap: str, topic: str, timeout: float = 60.0) -> list:
    """Every committed record of ``topic`` (kafka-python's ConsumerRecords), each partition
    in order; fails the test when they are not all read within ``timeout``."""
    from kafka import TopicPartition

    consumer = make_consumer(bootstrap, group_id=None, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        out: list = []
        deadline = time.monotonic() + timeout
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"{topic} not read to its end within {timeout:g} s"
            for records in consumer.poll(timeout_ms=500).values():
                out.extend(records)
        return out
    finally:
        consumer.close()


def topic_size(bootstrap: str, topic: str) -> int:
    """Messages on a topic (sum of end offsets)."""
    from kafka import TopicPartition

    consumer = make_consumer(bootstrap, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        return sum(consumer.end_offsets(tps).values())
    finally:
        consumer.close()


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll ``condition`` until truthy; fail with ``what`` and the last value after ``timeout``."""
    deadline = time.monotonic() + timeout
    value = condition()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {value!r})")
        time.sleep(interval)
        value = condition()
    return value


def chromium() -> str:
    """Path of headless Chromium; fails the test when it is missing (.ci/run installs Debian's
    ``chromium``), skips it only when PROFSTREAM_SKIP_CHROMIUM=1 is set."""
    import os
    import shutil

    import pytest

    path = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if path is None:
        if os.environ.get("PROFSTREAM_SKIP_CHROMIUM") == "1":
            pytest.skip("chromium not installed and PROFSTREAM_SKIP_CHROMIUM=1")
        pytest.fail("chromium is not installed: apt-get install chromium (.ci/run does), or set "
                    "PROFSTREAM_SKIP_CHROMIUM=1 to skip this test", pytrace=False)
    return path


def render_in_chromium(page) -> tuple[str, list[str]]:
    """The DOM after headless Chromium loaded the HTML file ``page``, and the console messages it logged."""
    import subprocess

    done = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, [line for line in done.stderr.splitlines() if ":CONSOLE" in line]


def health_of_a_processor(step_stage=None):
    """A ProcessorHealth bound to a stand-in of a running processor (one steps loop that
    has committed), for tests of what the health endpoint exposes."""
    from types import SimpleNamespace

    from profstream.processors.health import ProcessorHealth

    health = ProcessorHealth()
    loop = SimpleNamespace(stage=SimpleNamespace(name="steps"), last_commit_s=1.0, last_poll_s=2.0, recoveries=0)
    health.bind(SimpleNamespace(lag=lambda: 0, kafka_reachable=True, loops=[loop], step_stage=step_stage))
    return health


def connected_exporter(topics, **options):
    """An ExporterState whose consumer (a stand-in) reaches Kafka: it writes its lag."""
    from types import SimpleNamespace

    from profstream.sinks.prometheus import ExporterState

    state = ExporterState(topics, **options)
    state.source = SimpleNamespace(lag=0, lag_known=True)
    return state


def scrape(port: int) -> dict[str, float]:
    """The /metrics of a profstream endpoint on this host, as {name{labels}: value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class IdleSender:
    """A Monitor's sender that never runs (``Monitor(sender_factory=IdleSender)``): the test
    builds the batches itself."""

    def __init__(self, monitor) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self, timeout: float) -> bool:
        return True

    def flush(self, timeout: float) -> bool:
        return True

    def stats(self) -> dict:
        return {"undelivered_ops": 0, "undelivered_samples": 0}


def simulated_messages(cfg, close: bool = True, partitions: int = 4, send_every: int = 1, end_signal: int = 0,
                       **monitor_options):
    """The raw messages the Monitors of a simulated run (``SimConfig``) send, built with no
    broker and no thread, step by step (each rank's batches after each of its steps; after
    every ``send_every``-th, as a sender that falls behind), as
    ``processors.stream.RawMessage`` (the clock: the step's end). ``close``: then each
    Monitor closes normally, and what its close sends (the end mark) follows; ``end_signal``:
    as one told to end by that signal (SIGTERM) does."""
    from profstream.processors.stream import RawMessage
    from profstream.producers.monitor import Monitor
    from profstream.producers.sender import Sender
    from profstream.simulate import plan_run, record_step

    opts = {"bootstrap": "127.0.0.1:1", "host_sample_interval_s": 0, "control": False, "native": False,
            "device_interval_ms": 0, **monitor_options}
    if cfg.capture_every_n_steps is not None:
        opts["every_n_steps"] = cfg.capture_every_n_steps
    if cfg.peak_tflops is not None:
        opts["peak_tflops"] = cfg.peak_tflops
    monitors = {r: Monitor(run_id=cfg.run_id, rank=r, world_size=cfg.ranks, sender_factory=IdleSender, **opts)
                for r in range(cfg.ranks)}
    senders = {r: Sender(m) for r, m in monitors.items()}
    offsets = [0] * partitions
    out = []
    clock = 0.0

    def build(rank: int) -> None:
        p = rank % partitions
        sender = senders[rank]
        while sender._pending or sender._build():  # a build may queue a batch of device samples too
            value = sender._pending.popleft()[0]
            out.append(RawMessage(clock, p, offsets[p], monitors[rank].key, value))
            offsets[p] += 1

    for plan in plan_run(cfg):
        record_step(monitors[plan.rank], plan)
        clock = max(clock, plan.end_ns / 1e9)
        if (plan.step + 1) % send_every == 0:
            build(plan.rank)
    for rank, m in monitors.items():
        build(rank)
        if end_signal:
            m.ending_on(end_signal)
        if close:
            m.close()
            build(rank)
        else:
            m.close(ended=False)
    return out
