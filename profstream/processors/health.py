"""The processor's own health, as Prometheus metrics.

The hot path only bumps plain integers; a collector turns them into metric families when
Prometheus scrapes. Freshness is measured when a step's StepMetrics commits: wall clock
minus the step's end mark (the producer's clock: on other hosts it includes clock skew).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from profstream.schema.codec import DecodeError

# Step freshness in seconds, here and in the exporter (sinks/prometheus.py): fine below the
# 100 ms and 200 ms targets, coarse up to the PipelineLagging alert's 5 s and beyond.
FRESHNESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, 30.0)


class Watched(Protocol):
    """What the health metrics read of the processor they are bound to (runtime.Processor)."""

    step_stage: Any

    def lag(self) -> int: ...


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


class ProcessorHealth:
    def __init__(self, keep_freshness: int = 100_000) -> None:
        self.batches = 0
        self.events: Counter = Counter()  # by family: ops, memory, queues, steps
        self.decode_errors: Counter = Counter()  # by reason
        self.late_events = 0
        self.lost_batches = 0
        self.producer_dropped = 0
        self.steps_closed = 0
        self.run_steps = 0
        self.runs_closed = 0
        self.alerts = 0
        self.transactions = 0
        self._uncommitted_end_ns: list[int] = []
        self.freshness_s: deque[float] = deque(maxlen=keep_freshness)
        self._fresh_buckets = [0] * (len(FRESHNESS_BUCKETS) + 1)
        self._fresh_sum = 0.0
        self._processor: Watched | None = None

    def bind(self, processor: Watched) -> None:
        self._processor = processor

    def step_closed(self, record: dict) -> None:
        self.steps_closed += 1
        self._uncommitted_end_ns.append(record["end_ns"])

    def committed(self, _outputs: int) -> None:
        """Called by the step stage's loop after each committed transaction."""
        self.transactions += 1
        if not self._uncommitted_end_ns:
            return
        now = time.time_ns()
        for end_ns in self._uncommitted_end_ns:
            f = max(0.0, (now - end_ns) / 1e9)
            self.freshness_s.append(f)
            self._fresh_sum += f
            i = next((i for i, b in enumerate(FRESHNESS_BUCKETS) if f <= b), len(FRESHNESS_BUCKETS))
            self._fresh_buckets[i] += 1
        self._uncommitted_end_ns.clear()

    # -- Prometheus -------------------------------------------------------------------

    def collect(self):
        p = "profstream_"
        events = CounterMetricFamily(p + "events", "events folded in, by family", labels=["family"])
        for family in ("ops", "memory", "queues", "steps"):
            events.add_metric([family], self.events[family])
        yield events
        errors = CounterMetricFamily(p + "decode_errors", "raw messages sent to the dead-letter topic, by reason",
                                     labels=["reason"])
        for reason in DecodeError.REASONS:
            errors.add_metric([reason], self.decode_errors[reason])
        yield errors
        for name, doc, value in (
            ("late_events", "events that arrived for an already closed step", self.late_events),
            ("lost_batches", "producer batches missing from the seq sequence", self.lost_batches),
            ("producer_dropped", "op events producers dropped (buffer full, send failure)", self.producer_dropped),
            ("steps_closed", "StepMetrics produced", self.steps_closed),
            ("run_steps", "RunStepMetrics produced", self.run_steps),
            ("alerts", "alert transitions produced", self.alerts),
            ("transactions", "transactions committed by the step stage", self.transactions),
            ("raw_batches", "raw batches folded in", self.batches),
        ):
            yield CounterMetricFamily(p + name, doc, value=value)
        proc = self._processor
        if proc is not None:
            yield GaugeMetricFamily(p + "consumer_lag_messages", "raw messages not yet consumed",
                                    value=proc.lag())
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

    def serve(self, port: int, addr: str = "0.0.0.0") -> CollectorRegistry:
        """Serve these metrics on http://addr:port/metrics (a registry of their own)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        start_http_server(port, addr=addr, registry=registry)
        return registry
