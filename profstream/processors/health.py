"""The processor's own health, as Prometheus metrics.

The hot path only bumps plain integers; a collector turns them into metric families when
Prometheus scrapes. Freshness is measured when a step's StepMetrics commits: wall clock
minus the step's end mark (the producer's clock: on other hosts it includes clock skew).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import Counter, deque
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from profstream.metrics_server import serve_metrics
from profstream.schema.codec import DecodeError

# Step freshness in seconds, here and in the exporter (sinks/prometheus.py): fine below the
# 100 ms and 200 ms targets, coarse up to the PipelineLagging alert's 5 s and beyond.
FRESHNESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, 30.0)
# The raw sections counted in profstream_events_total{family} (host samples are not folded in).
EVENT_FAMILIES = ("ops", "memory", "queues", "steps", "device_samples", "collectives")


class Watched(Protocol):
    """What the health metrics read of the processor they are bound to (runtime.Processor)."""

    step_stage: Any
    loops: list  # checkpoint.TransactionalLoop: stage.name, last_commit_s, last_poll_s, recoveries
    kafka_reachable: bool

    def lag(self) -> int | None: ...


def _producer_health(stage):
    """Per-producer gauges from the latest batch header of each (run, rank) held; a rank's
    series goes away with its state (idle timeout)."""
    fill = GaugeMetricFamily("profstream_producer_buffer_fill_ratio",
                             "share of the producer's buffer in use when it built its latest batch",
                             labels=["run", "rank"])
    latency = GaugeMetricFamily("profstream_producer_send_latency_seconds",
                                "send-to-acknowledge latency of the producer's last acknowledged batch",
                                labels=["run", "rank"])
    for (run_id, rank_no), rank in list(stage.ranks.items()):  # the loop thread may add ranks meanwhile
        labels = [run_id, str(rank_no)]
        fill.add_metric(labels, rank.buffer_fill_ratio)
        if rank.send_latency_s is not None:
            latency.add_metric(labels, rank.send_latency_s)
    return fill, latency


def _loop_health(loops):
    """Per stage: when its loop last committed and last polled Kafka, and its recoveries.
    A loop stuck in a call stops moving both timestamps (ProcessorStalled)."""
    commit = GaugeMetricFamily("profstream_processor_last_commit_timestamp_seconds",
                               "wall clock of the stage's last committed transaction", labels=["stage"])
    poll = GaugeMetricFamily("profstream_processor_last_poll_timestamp_seconds",
                             "wall clock of the stage's last poll of its input", labels=["stage"])
    recoveries = CounterMetricFamily("profstream_processor_recoveries",
                                     "faults the stage recovered from (transaction aborted, clients replaced)",
                                     labels=["stage"])
    for loop in loops:
        stage = [loop.stage.name]
        if loop.last_commit_s is not None:
            commit.add_metric(stage, loop.last_commit_s)
        poll.add_metric(stage, loop.last_poll_s)
        recoveries.add_metric(stage, loop.recoveries)
    return commit, poll, recoveries


class _Counters:
    """The counters of a stage's open transaction, and of the processor's totals."""

    def _zero(self) -> None:
        self.batches = 0
        self.events: Counter = Counter()  # by family (EVENT_FAMILIES)
        self.decode_errors: Counter = Counter()  # by reason
        self.late_events = 0
        self.lost_batches = 0
        self.duplicate_batches = 0
        self.producer_dropped = 0
        self.producer_dropped_samples = 0
        self.steps_closed = 0
        self.partial_steps = 0
        self.run_steps = 0
        self.runs_closed = 0
        self.ranks_ended = 0
        self.progress = 0  # RankProgress records passed on to the steps and partials topics
        self.alerts = 0
        self.uncorrelated_ops = 0


_TOTALS = ("batches", "late_events", "lost_batches", "duplicate_batches", "producer_dropped", "producer_dropped_samples",
           "steps_closed", "partial_steps", "run_steps", "runs_closed", "ranks_ended", "progress", "alerts",
           "uncorrelated_ops")


class StageCounts(_Counters):
    """What a stage counted in its open transaction. The processor adds it to its health
    totals when the transaction commits and throws it away when it aborts (the input is
    then read again), so that every counter counts what was committed, once."""

    def __init__(self, keep_step_ends: bool = True) -> None:
        self._keep_step_ends = keep_step_ends
        self.clear()

    def clear(self) -> None:
        self._zero()
        self.step_ends_ns: list[int] = []  # end marks of the closed steps, for freshness

    def step_closed(self, record: dict) -> None:
        self.steps_closed += 1
        self.partial_steps += bool(record["dropped_ops"] or record["dropped_samples"])
        self.uncorrelated_ops += record["uncorrelated_ops"]
        if self._keep_step_ends:
            self.step_ends_ns.append(record["end_ns"])


class ProcessorHealth(_Counters):
    """Committed totals of a processor's stages, and their Prometheus collector."""

    def __init__(self, keep_freshness: int = 100_000) -> None:
        self.server = None  # the HTTP server of serve()
        self._zero()
        self.transactions = 0
        self.freshness_s: deque[float] = deque(maxlen=keep_freshness)
        self._fresh_buckets = [0] * (len(FRESHNESS_BUCKETS) + 1)
        self._fresh_sum = 0.0
        self._lock = threading.Lock()  # two stages' loops commit from two threads
        self._processor: Watched | None = None

    def bind(self, processor: Watched) -> None:
        self._processor = processor

    def commit(self, counts: StageCounts, transaction: bool = False) -> None:
        """Add what ``counts`` holds (a stage's committed transaction) to the totals; the
        step ends it holds become freshness samples. ``transaction``: count the commit."""
        now = time.time_ns()
        with self._lock:
            for name in _TOTALS:
                setattr(self, name, getattr(self, name) + getattr(counts, name))
            self.events.update(counts.events)
            self.decode_errors.update(counts.decode_errors)
            self.transactions += transaction
            for end_ns in counts.step_ends_ns:
                f = max(0.0, (now - end_ns) / 1e9)
                self.freshness_s.append(f)
                self._fresh_sum += f
                self._fresh_buckets[bisect_left(FRESHNESS_BUCKETS, f)] += 1
        counts.clear()

    # -- Prometheus -------------------------------------------------------------------

    def collect(self):
        p = "profstream_"
        events = CounterMetricFamily(p + "events", "events folded in, by family", labels=["family"])
        for family in EVENT_FAMILIES:
            events.add_metric([family], self.events[family])
        yield events
        errors = CounterMetricFamily(p + "decode_errors", "messages sent to the dead-letter topic (raw messages, "
                                     "and run steps too large to send), by reason", labels=["reason"])
        for reason in (*DecodeError.REASONS, "too_large"):
            errors.add_metric([reason], self.decode_errors[reason])
        yield errors
        for name, doc, value in (
            ("late_events", "events that arrived for an already closed step", self.late_events),
            ("lost_batches", "producer batches missing from the seq sequence", self.lost_batches),
            ("duplicate_batches", "producer batches read again while their steps were open (a copy in the raw "
             "topic), folded in once", self.duplicate_batches),
            ("producer_dropped", "op events producers dropped (buffer full, send failure)", self.producer_dropped),
            ("producer_dropped_samples", "samples producers dropped (buffer full, send failure): memory, queue, "
             "collective and device samples and step marks (a step whose mark was dropped is lost whole)",
             self.producer_dropped_samples),
            ("steps_closed", "StepMetrics produced", self.steps_closed),
            ("partial_steps_closed", "StepMetrics of steps that lost events (their producer dropped some: its mark "
             "says so); left out of the rolling figures", self.partial_steps),
            ("run_steps", "RunStepMetrics produced", self.run_steps),
            ("ranks_ended", "ranks whose producer ended (end mark: a close or a SIGTERM), every step closed: RankEnd "
             "records produced", self.ranks_ended),
            ("rank_progress", "RankProgress records (where a rank is, mid-step too) passed on to the steps and "
             "partials topics", self.progress),
            ("alerts", "alert transitions produced", self.alerts),
            ("uncorrelated_device_ops", "device ops without a launch time in steps whose other device ops "
             "have one: counted in the host step holding their start", self.uncorrelated_ops),
            ("transactions", "transactions committed by the step stage", self.transactions),
            ("raw_batches", "raw batches folded in", self.batches),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)
        proc = self._processor
        if proc is not None:
            lag = proc.lag()
            if lag is not None:  # unknown while the broker does not answer: no sample, never 0
                yield GaugeMetricFamily(p + "consumer_lag_messages", "raw messages not yet consumed, from the "
                                        "broker's end offsets of now (absent while Kafka does not answer)", value=lag)
            yield GaugeMetricFamily(p + "kafka_reachable", "1 when the broker answered the last lag probe",
                                    value=int(proc.kafka_reachable))
            yield from _loop_health(proc.loops)
            stage = proc.step_stage
            if stage is not None:
                yield GaugeMetricFamily(p + "open_runs", "runs with state in this processor", value=stage.open_runs)
                yield GaugeMetricFamily(p + "state_events", "events held for steps not yet closed",
                                        value=stage.open_events)
                yield GaugeMetricFamily(p + "open_ranks", "(run, rank) states held", value=len(stage.ranks))
                yield from _producer_health(stage)
        buckets, acc = [], 0
        for bound, n in zip(FRESHNESS_BUCKETS, self._fresh_buckets):
            acc += n
            buckets.append((repr(bound), acc))
        buckets.append(("+Inf", acc + self._fresh_buckets[-1]))
        yield HistogramMetricFamily(p + "step_freshness_seconds",
                                    "end of a step (producer clock) to its StepMetrics committed",
                                    buckets=buckets, sum_value=self._fresh_sum)

    def serve(self, port: int, addr: str = "0.0.0.0", web=None) -> CollectorRegistry:
        """Serve these metrics on http://addr:port/metrics (a registry of their own); ``web``:
        a ``web_config.WebConfig`` (TLS, basic auth)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        self.server = serve_metrics(addr, port, lambda: generate_latest(registry), "profstream processor", web=web)
        return registry
