"""Prometheus exporter: StepMetrics, RunStepMetrics and alerts in; the metrics of
docs/metrics.md out, per run, rank and host.

``ExporterState.handle`` (the consume thread) folds records into plain numbers per run and
rank under one lock; ``exposition`` (each scrape) writes them in the text format. Label
cardinality is bounded: per run at most ``top_k`` op types (and kernel types) get series of their own (the
first ones seen, most expensive first, kept for the run's life so that no counter ever
goes down; the rest are summed as "other"), a rank exports at most ``MAX_QUEUES`` queues,
and a rank or run whose newest record is older than ``ttl_s`` is dropped with its series.
A run with more than ``top_ranks`` ranks keeps per-rank series for its slowest ranks only,
and every run gets quantiles over its ranks (sinks/rank_summary.py).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from profstream.kafka.connection import Connection
from profstream.kafka.topics import Topics
from profstream.metrics_server import serve_metrics
from profstream.processors.hangs import hang_state
from profstream.processors.health import FRESHNESS_BUCKETS
from profstream.processors.stalls import stall_state
from profstream.schema.codec import (
    HEADER_LEN,
    STEP_PARTIAL_HEADERS,
    DecodeError,
    decode,
    decode_any,
)
from profstream.sinks.collective_metrics import RunCollectives, collective_lines, run_collectives
from profstream.sinks.device_metrics import MAX_DEVICES, device_lines, fold_devices
from profstream.sinks.host_metrics import fold_resources, host_lines
from profstream.sinks.rank_summary import (
    DEFAULT_TOP_RANKS,
    PHASES,
    SLOW_WINDOW_STEPS,
    slowest_ranks,
    summary_lines,
)
from profstream.sinks.work_metrics import RankWork, fold_run_work, fold_work, work_lines

log = logging.getLogger("profstream.sink.prometheus")

DEFAULT_PORT = 9464
DEFAULT_GROUP = "profstream-prometheus"
DEFAULT_TTL_S = 900.0
DEFAULT_TOP_K = 10
MAX_QUEUES = 16
# A rank outside a large run's slowest --top-ranks keeps its step time and end series (and
# profstream_rank_ended) once its newest record is this much older than its run's: RankSilent
# reads them
SILENT_KEEP_S = 10.0
OTHER = "other"
# Step times from 1 ms to 10 min: 1, 1.5, 2, 3, 5, 7.5 per decade up to 30 s (neighbours at
# most 1.67x apart), then minutes.
STEP_BUCKETS = (0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
                60.0, 120.0, 300.0, 600.0)
_TOPIC_KINDS = ("steps", "run", "alerts")
_P = "profstream_"
_RANK = ["run", "rank", "host"]


class ExporterError(RuntimeError):
    """A problem the user can fix (port in use, topics missing); the message says what to do."""


def _les(bounds: Sequence[float]) -> list[str]:
    return [floatToGoString(b) for b in bounds] + ["+Inf"]


_STEP_LES = _les(STEP_BUCKETS)


def _esc(value: str) -> str:
    """A label value escaped for the text format."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    text = repr(value)
    return text if text[-1].isdigit() else floatToGoString(value)  # inf, nan


class _Families:
    """Ready-made metric families, in the shape generate_latest reads."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self) -> list:
        return self.families


@dataclass(eq=False)
class _Rank:
    labels: str  # 'run="..",rank="..",host=".."', escaped once
    host: str
    seen_s: float  # time of the newest record (Kafka timestamp)
    last_step: int = -1
    end_s: float = 0.0
    step_s: float = 0.0
    phases: tuple[float, float, float] = (0.0, 0.0, 0.0)  # data_wait, fp_bp, tail
    # of the latest step whose ops were captured (None before one was: not measured, no series)
    utilization: float | None = None
    overlap_ratio: float | None = None
    idle_ratio: float | None = None
    memory: tuple[tuple[str, int], ...] = ()  # (kind, bytes) of the latest step with samples
    queues: dict[str, tuple[int, float]] = field(default_factory=dict)  # name -> (last size, empty ratio)
    buckets: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    sum_s: float = 0.0
    starved: int = 0
    op_ns: dict[str, int] = field(default_factory=dict)  # admitted op type or "other" -> ns
    host_step_s: float = 0.0  # E - S of the latest step (step_s is the device's on a device window)
    kind_ns: dict[str, int] = field(default_factory=dict)  # device kind -> summed op ns
    kernel_ns: dict[str, int] = field(default_factory=dict)  # admitted kernel type or "other" -> ns
    devices: dict[str, dict] = field(default_factory=dict)  # device -> DeviceFigures of its latest step
    recent: deque = field(default_factory=lambda: deque(maxlen=SLOW_WINDOW_STEPS))  # newest steps' step_s
    ended: bool = False  # its producer ended normally after its latest step (RankEnd)
    end_signal: int = 0  # the signal that ended it (RankEnd v2), 0: it closed
    # what its producer lost, as its StepMetrics say: events of partial steps (their marks
    # say how many), those steps, and steps missing from its sequence (lost whole)
    dropped: tuple[int, int] = (0, 0)  # ops, samples
    partial_steps: int = 0
    lost_steps: int = 0
    work: RankWork | None = None  # throughput and MFU (None before a step with work figures)
    resources: dict | None = None  # host and data-loader figures of the latest step with readings
    advice: tuple[str, ...] = ()  # rules of the latest step's advice


@dataclass(eq=False)
class _Run:
    seen_s: float
    ranks: dict[int, _Rank] = field(default_factory=dict)
    op_types: set[str] = field(default_factory=set)  # op types with series of their own
    kernels: set[str] = field(default_factory=set)  # kernel types with series of their own
    stalls: dict[int, int] = field(default_factory=dict)  # rank -> 1 while DataQueueStall fires
    hang_step: int | None = None  # the step a firing TrainingHang named; None: none fires
    step: int = -1  # newest RunStepMetrics
    skew: float = 0.0
    straggler: int = 0
    ranks_reported: int = 0
    collectives: RunCollectives | None = None  # of the newest RunStepMetrics with collectives
    work: dict[str, float] | None = None  # of the newest RunStepMetrics with work figures
    work_step: int = -1


class ExporterState:
    """Current figures of every live run, as a Prometheus collector; a ``SinkLoop`` sink."""

    def __init__(self, topics: Topics, ttl_s: float = DEFAULT_TTL_S, top_k: int = DEFAULT_TOP_K,
                 top_ranks: int | None = DEFAULT_TOP_RANKS) -> None:
        if ttl_s <= 0 or top_k < 1 or (top_ranks is not None and top_ranks < 1):
            raise ValueError("ttl_s must be > 0, top_k >= 1 and top_ranks >= 1 or None")
        self.ttl_s = ttl_s
        self.top_k = top_k
        self.top_ranks = top_ranks  # None: every rank keeps its series
        self._kinds = {topics.steps: "steps", topics.run: "run", topics.alerts: "alerts"}
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._stall_seeds: dict[str, dict[int, int]] = {}  # firing stalls read at start, by run
        self._hang_seeds: dict[str, int | None] = {}  # the step of a firing TrainingHang read at start, by run
        self._next_expiry = 0.0
        # sink health: plain values
        self.records: Counter = Counter()  # by topic kind
        self.decode_errors: Counter = Counter()  # by (topic kind, reason)
        self.stale_records = 0
        self.expired: Counter = Counter()  # "run", "rank"
        self.queues_over_limit = 0
        self.devices_over_limit = 0
        self.source: Any = None  # the SinkLoop: its lag is kept on its own thread
        self._fresh = [0] * (len(FRESHNESS_BUCKETS) + 1)
        self._fresh_sum = 0.0

    # -- records (consume thread) -------------------------------------------------------

    def handle(self, records: Sequence[Any]) -> None:
        now = time.time()
        with self._lock:
            for rec in records:
                kind = self._kinds.get(rec.topic, "steps")
                if kind == "steps" and rec.value is not None and bytes(rec.value[:HEADER_LEN]) in STEP_PARTIAL_HEADERS:
                    continue  # the run stage's input (its figures come as RunStepMetrics): not this sink's
                self.records[kind] += 1
                ts = rec.timestamp / 1000 if rec.timestamp is not None and rec.timestamp >= 0 else now
                if now - ts > self.ttl_s:
                    self.stale_records += 1  # replayed history: its series would expire at once
                    continue
                try:
                    if kind == "steps":
                        name, value = decode_any(rec.value)
                        if name == "StepMetrics":
                            self._fold_step(value, ts, now)
                        elif name == "RankEnd":
                            self._fold_rank_end(value, ts)
                        elif name == "RankProgress":  # the run lives on (hangs come as Alerts)
                            self._run(value["run_id"], ts)
                        else:
                            raise DecodeError("wrong_type", f"expected StepMetrics or RankEnd, got {name}")
                    elif kind == "run":
                        self._fold_run_step(decode("RunStepMetrics", rec.value), ts)
                    else:
                        self._fold_alert(decode("Alert", rec.value), ts)
                except DecodeError as e:
                    self.decode_errors[(kind, e.reason)] += 1
            if now >= self._next_expiry:
                self._expire(now)

    def seed_stalls(self, alerts: Sequence[dict]) -> None:
        """Replay DataQueueStall and TrainingHang transitions read at start, so that a
        restarted exporter keeps reporting a stall or hang that is still firing."""
        with self._lock:
            for a in alerts:
                stall = stall_state(a)
                if stall is not None:
                    run_id, rank, firing = stall
                    self._stall_seeds.setdefault(run_id, {})[rank] = int(firing)
                hang = hang_state(a)
                if hang is not None:
                    self._hang_seeds[hang[0]] = a["step"] if hang[1] else None

    def _run(self, run_id: str, ts: float) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            run = self._runs[run_id] = _Run(ts, stalls=self._stall_seeds.pop(run_id, {}),
                                            hang_step=self._hang_seeds.pop(run_id, None))
        elif ts > run.seen_s:
            run.seen_s = ts
        return run

    def _fold_step(self, m: dict, ts: float, now: float) -> None:
        run = self._run(m["run_id"], ts)
        r = run.ranks.get(m["rank"])
        if r is None or r.host != m["host"]:
            labels = f'run="{_esc(m["run_id"])}",rank="{m["rank"]}",host="{_esc(m["host"])}"'
            r = run.ranks[m["rank"]] = _Rank(labels, m["host"], ts)
        elif ts > r.seen_s:
            r.seen_s = ts
        step_ns = m["step_time_ns"]
        step_s = step_ns / 1e9
        r.buckets[bisect.bisect_left(STEP_BUCKETS, step_s)] += 1
        r.sum_s += step_s
        r.starved += m["starved"]
        lost_ops, lost_samples = m["dropped_ops"], m["dropped_samples"]
        r.partial_steps += bool(lost_ops or lost_samples)
        r.dropped = (r.dropped[0] + lost_ops, r.dropped[1] + lost_samples)
        if r.last_step >= 0 and m["step"] > r.last_step + 1:  # steps between: their marks never came
            r.lost_steps += m["step"] - r.last_step - 1
        self._add_types(m["op_types"], run.op_types, r.op_ns)
        self._add_types(m["kernel_types"], run.kernels, r.kernel_ns)
        for cost in m["device_kinds"]:
            r.kind_ns[cost["kind"]] = r.kind_ns.get(cost["kind"], 0) + cost["total_ns"]
        end_s = m["end_ns"] / 1e9
        fresh = max(0.0, now - end_s)
        self._fresh[bisect.bisect_left(FRESHNESS_BUCKETS, fresh)] += 1
        self._fresh_sum += fresh
        r.ended = False  # a step after an end: the rank runs again (a new Monitor)
        r.work = fold_work(r.work, m["work"], m["step"] >= r.last_step)
        if m["step"] < r.last_step:
            return  # an older step: counted above, the gauges keep the newest
        if m["step"] > r.last_step:
            r.recent.append(step_s)
        r.last_step = m["step"]
        r.end_s = end_s
        r.step_s = step_s
        r.host_step_s = m["host_step_time_ns"] / 1e9
        r.phases = (m["data_wait_ns"] / 1e9, m["fp_bp_ns"] / 1e9, m["tail_ns"] / 1e9)
        r.resources = fold_resources(r.resources, m["resources"])
        r.advice = tuple(a["rule"] for a in m["advice"])
        # a step without captured ops keeps the last measured values; so does one that lost ops
        if m["utilization"] is not None and not lost_ops:
            r.utilization = m["utilization"]
            r.overlap_ratio = m["overlap_ratio"]
            r.idle_ratio = m["idle_ns"] / step_ns if step_ns else 0.0
        # a step without samples keeps the last known values; so does one that lost samples
        mem = None if lost_samples else m["memory"]
        if mem is not None:
            r.memory = tuple((k, mem[k]) for k in ("allocated", "reserved", "peak") if mem[k] >= 0)
        for q in () if lost_samples else m["queues"]:
            if q["queue"] in r.queues or len(r.queues) < MAX_QUEUES:
                r.queues[q["queue"]] = (q["last"], q["empty_ratio"])
            else:
                self.queues_over_limit += 1
        self.devices_over_limit += fold_devices(r.devices, m.get("devices", ()))

    def _add_types(self, costs: list[dict], admitted: set[str], into: dict[str, int]) -> None:
        """Fold top-K type costs into a rank's counters: the first ``top_k`` types of a run
        get series of their own for its life, the rest are summed as "other"."""
        for cost in costs:
            name = cost["op_type"]
            if name not in admitted and name != OTHER and len(admitted) < self.top_k:
                admitted.add(name)
            key = name if name in admitted else OTHER
            into[key] = into.get(key, 0) + cost["total_ns"]

    def _fold_run_step(self, m: dict, ts: float) -> None:
        run = self._run(m["run_id"], ts)
        if m["step"] >= run.step:
            run.step = m["step"]
            run.skew = m["skew"]
            run.straggler = m["straggler_rank"]
            run.ranks_reported = m["ranks_reported"]
            run.collectives = run_collectives(m) or run.collectives
        if m["work"] is not None and m["step"] >= run.work_step:
            run.work_step = m["step"]
            run.work = fold_run_work(run.work, m["work"])

    def _fold_rank_end(self, end: dict, ts: float) -> None:
        run = self._runs.get(end["run_id"])
        r = run.ranks.get(end["rank"]) if run is not None else None
        if r is not None:  # after the rank's last StepMetrics (same partition, in order)
            r.ended = True
            r.end_signal = end["end_signal"]
            r.seen_s = max(r.seen_s, ts)
            run.seen_s = max(run.seen_s, ts)

    def _fold_alert(self, a: dict, ts: float) -> None:
        stall = stall_state(a)
        if stall is not None:
            run_id, rank, firing = stall
            self._run(run_id, ts).stalls[rank] = int(firing)
        hang = hang_state(a)
        if hang is not None:
            self._run(hang[0], ts).hang_step = a["step"] if hang[1] else None

    def _expire(self, now: float) -> None:
        """Drop ranks and runs whose newest record is older than the TTL (lock held)."""
        self._next_expiry = now + min(1.0, self.ttl_s / 4)
        horizon = now - self.ttl_s
        for run_id, run in list(self._runs.items()):
            if run.seen_s < horizon:
                del self._runs[run_id]
                self.expired["run"] += 1
                self.expired["rank"] += len(run.ranks)
                continue
            for rank, r in list(run.ranks.items()):
                if r.seen_s < horizon:
                    del run.ranks[rank]
                    run.stalls.pop(rank, None)
                    self.expired["rank"] += 1

    # -- Prometheus (scrape thread) -----------------------------------------------------

    def exposition(self) -> bytes:
        """Every series, in the Prometheus text format 0.0.4."""
        with self._lock:
            self._expire(time.time())
            figures = self._write_figures()
            health = self._health()
        return figures + generate_latest(_Families(health))

    def _write_figures(self) -> bytes:
        """The per-run and per-rank series, written directly: prometheus_client's
        generate_latest costs ~20 us per sample, 80 ms for 64 ranks; this ~1 us."""
        kept = {run_id: slowest_ranks(run.ranks, self.top_ranks) for run_id, run in self._runs.items()}
        ranks = [(run, rank, r) for run_id, run in self._runs.items() for rank, r in kept[run_id].items()]
        # a stall that fires keeps its series (DataQueueStall) on a rank outside the slowest
        stalled = [(run, rank, run.ranks[rank]) for run_id, run in self._runs.items()
                   for rank, firing in run.stalls.items()
                   if firing and rank in run.ranks and rank not in kept[run_id]]
        # so does a rank that stopped while its run goes on, for RankSilent (and whether it ended)
        silent = [(run, rank, r) for run_id, run in self._runs.items() for rank, r in run.ranks.items()
                  if rank not in kept[run_id] and run.seen_s - r.seen_s > SILENT_KEEP_S]
        runs = [(run_id, run) for run_id, run in self._runs.items() if run.step >= 0]
        out: list[str] = []

        def family(name: str, kind: str, doc: str, lines) -> None:
            out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")
            out.extend(lines)

        def per_rank(name: str, doc: str, value: Callable[[_Run, int, _Rank], float | None], kind: str = "gauge",
                     extra: Sequence = ()) -> None:  # a value None (not measured) has no sample
            family(name, kind, doc, (f"{name}{{{r.labels}}} {_num(v)}\n" for run, rank, r in itertools.chain(ranks, extra)
                                     if (v := value(run, rank, r)) is not None))

        def per_run(name: str, doc: str, value: Callable[[_Run], float]) -> None:
            family(name, "gauge", doc, (f'{name}{{run="{_esc(run_id)}"}} {_num(value(run))}\n' for run_id, run in runs))

        def split(name: str, kind: str, doc: str, label: str, items: Callable[[_Rank], Iterable]) -> None:
            family(name, kind, doc, (f'{name}{{{r.labels},{label}="{_esc(key)}"}} {_num(v)}\n'
                                     for _, _, r in ranks for key, v in items(r)))

        p = _P
        per_rank(p + "step_duration_seconds", "duration of the rank's latest step (end - start; on a device "
                 "window, the device's)", lambda run, rank, r: r.step_s, extra=silent)
        per_rank(p + "host_step_duration_seconds", "host duration of the rank's latest step (end - start mark)",
                 lambda run, rank, r: r.host_step_s)
        hist = p + "step_duration_seconds_hist"
        family(hist, "histogram", "step durations of the rank", (
            line for _, _, r in ranks for line in itertools.chain(
                (f'{hist}_bucket{{{r.labels},le="{le}"}} {n}\n'
                 for le, n in zip(_STEP_LES, itertools.accumulate(r.buckets))),
                (f"{hist}_sum{{{r.labels}}} {_num(r.sum_s)}\n", f"{hist}_count{{{r.labels}}} {sum(r.buckets)}\n"))))
        split(p + "step_phase_seconds", "gauge", "phases of the latest step: data_wait (waiting for data), "
              "fp_bp (forward and backward), tail", "phase", lambda r: zip(PHASES, r.phases))
        per_rank(p + "last_step", "number of the rank's latest step", lambda run, rank, r: r.last_step)
        per_rank(p + "last_step_timestamp_seconds", "end of the rank's latest step, Unix time (producer clock)",
                 lambda run, rank, r: r.end_s, extra=silent)
        per_rank(p + "device_utilization_ratio", "compute time / step time of the latest step with captured ops "
                 "(no sample before one)", lambda run, rank, r: r.utilization)
        per_rank(p + "comm_overlap_ratio", "communication overlapped by compute / communication time of the "
                 "latest step with captured ops (0 without communication)", lambda run, rank, r: r.overlap_ratio)
        per_rank(p + "idle_ratio", "time with neither compute nor communication / step time of the latest step "
                 "with captured ops", lambda run, rank, r: r.idle_ratio)
        split(p + "memory_bytes", "gauge", "device memory at the end of the latest step with samples (peak: "
              "highest in that step)", "kind", lambda r: r.memory)
        split(p + "queue_size", "gauge", "size of the data queue at the end of the latest step", "queue",
              lambda r: ((q, v[0]) for q, v in r.queues.items()))
        split(p + "queue_empty_ratio", "gauge", "share of the latest step's queue samples at 0", "queue",
              lambda r: ((q, v[1]) for q, v in r.queues.items()))
        per_rank(p + "data_stall", "1 while the processor's DataQueueStall alert fires for the rank",
                 lambda run, rank, r: run.stalls.get(rank, 0), extra=stalled)
        per_rank(p + "starved_steps_total", "steps starved of input data", lambda run, rank, r: r.starved,
                 "counter")
        split(p + "step_dropped_events_total", "counter", "events of the rank's partial steps its producer dropped "
              "(their marks say how many), by family: ops, samples", "family",
              lambda r: (("ops", r.dropped[0]), ("samples", r.dropped[1])))
        per_rank(p + "partial_steps_total", "steps of the rank that lost events (their producer dropped some): "
                 "their figures cover what arrived, and the utilization, memory and queue gauges keep the last "
                 "whole step's", lambda run, rank, r: r.partial_steps, "counter")
        per_rank(p + "lost_steps_total", "steps of the rank missing from its sequence: their marks were dropped "
                 "or lost with a batch, so they were lost whole", lambda run, rank, r: r.lost_steps, "counter")
        split(p + "op_type_seconds_total", "counter", "summed op durations by op type (top K per run, the rest "
              "as other; host ops only where steps have device windows)", "op_type",
              lambda r: ((t, ns / 1e9) for t, ns in r.op_ns.items()))
        split(p + "kernel_seconds_total", "counter", "summed device op durations by kernel type, on steps with "
              "device windows (top K per run, the rest as other)", "kernel",
              lambda r: ((t, ns / 1e9) for t, ns in r.kernel_ns.items()))
        split(p + "device_kind_seconds_total", "counter", "summed device op durations by kind: compute, "
              "communication, memcpy, memset", "kind", lambda r: ((k, ns / 1e9) for k, ns in r.kind_ns.items()))
        per_rank(p + "rank_ended", "1 when the rank's producer ended (its Monitor closed, normally or on a signal it "
                 "was sent) after its latest step, else 0: RankSilent fires only for ranks at 0",
                 lambda run, rank, r: int(r.ended), extra=silent)
        per_rank(p + "rank_end_signal", "the signal that ended the rank's producer (15: SIGTERM), for a rank that "
                 "ended on one", lambda run, rank, r: r.end_signal if r.ended and r.end_signal else None)
        family(p + "run_ended", "gauge", "1 when every rank of the run the exporter holds ended (its Monitor "
               "closed after its last step, normally or on a signal it was sent), else 0: RunSilent fires only for "
               "runs at 0",
               (f'{p}run_ended{{run="{_esc(run_id)}"}} {int(all(r.ended for r in run.ranks.values()))}\n'
                for run_id, run in self._runs.items() if run.ranks))
        per_run(p + "rank_skew_ratio", "(max - min) / median step time across the ranks of the run's latest "
                "complete step", lambda run: run.skew)
        per_run(p + "straggler_rank", "rank with the largest step time in the run's latest complete step",
                lambda run: run.straggler)
        per_run(p + "run_ranks_reported", "ranks in the run's latest complete step", lambda run: run.ranks_reported)
        # every live run, a step emitted or not (a run may hang in its first step)
        family(p + "training_hang", "gauge", "1 while the processor's TrainingHang alert fires for the run: a rank "
               "in one step past --hang-after-s (the alert's summary names the ranks)",
               (f'{p}training_hang{{run="{_esc(run_id)}"}} {int(run.hang_step is not None)}\n'
                for run_id, run in self._runs.items()))
        family(p + "hang_step", "gauge", "the step the firing TrainingHang named (no sample while none fires)",
               (f'{p}hang_step{{run="{_esc(run_id)}"}} {run.hang_step}\n'
                for run_id, run in self._runs.items() if run.hang_step is not None))
        out.extend(device_lines(p, ranks, _num))
        out.extend(host_lines(p, ranks + stalled, _num))  # a stalled rank's advice, whatever its rank
        out.extend(work_lines(p, ranks, [(_esc(run_id), run) for run_id, run in self._runs.items()], _num))
        out.extend(collective_lines(p, [(run_id, run.collectives) for run_id, run in runs], _esc, _num,
                                    self.top_ranks))
        out.extend(summary_lines(p, ((_esc(run_id), run.ranks, len(kept[run_id]))
                                     for run_id, run in self._runs.items()), _num, STEP_BUCKETS, _STEP_LES))
        return "".join(out).encode()

    def _health(self) -> list:
        p = _P + "sink_"
        records = CounterMetricFamily(p + "records", "records consumed, by topic", labels=["topic"])
        errors = CounterMetricFamily(p + "decode_errors", "records skipped as undecodable, by topic and "
                                     "reason", labels=["topic", "reason"])
        for kind in _TOPIC_KINDS:
            records.add_metric([kind], self.records[kind])
            for reason in DecodeError.REASONS:
                errors.add_metric([kind, reason], self.decode_errors[(kind, reason)])
        expired = CounterMetricFamily(p + "expired", "ranks and runs dropped after the TTL", labels=["what"])
        for what in ("run", "rank"):
            expired.add_metric([what], self.expired[what])
        buckets = list(zip(_les(FRESHNESS_BUCKETS), itertools.accumulate(self._fresh)))
        return [
            records, errors, expired,
            CounterMetricFamily(p + "stale_records", "records older than the TTL when consumed, skipped",
                                value=self.stale_records),
            CounterMetricFamily(p + "queues_over_limit", f"queue figures not exported: rank already had "
                                f"{MAX_QUEUES} queues", value=self.queues_over_limit),
            CounterMetricFamily(p + "devices_over_limit", f"device figures not exported: rank already had "
                                f"{MAX_DEVICES} devices", value=self.devices_over_limit),
            *([GaugeMetricFamily(p + "consumer_lag_messages", "records on the input topics not yet consumed "
                                 "(absent while Kafka does not answer)", value=self.source.lag)]
              if self.source is not None and self.source.lag_known else []),
            GaugeMetricFamily(p + "runs", "runs with series", value=len(self._runs)),
            GaugeMetricFamily(p + "ranks", "ranks held (per-rank series: each run's slowest --top-ranks)",
                              value=sum(len(r.ranks) for r in self._runs.values())),
            HistogramMetricFamily(p + "step_freshness_seconds", "end of a step (producer clock) to its "
                                  "figures served here", buckets=buckets, sum_value=self._fresh_sum),
        ]


def read_alerts(conn: Connection | str, topic: str, timeout: float = 10.0) -> list[dict]:
    """Every Alert on ``topic`` up to its current end (undecodable ones left out)."""
    from kafka import TopicPartition

    from profstream.kafka.clients import make_consumer, position_by

    consumer = make_consumer(conn, group_id=None)
    alerts: list[dict] = []
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not tps:
            return alerts
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        deadline = time.monotonic() + timeout

        def behind(tp: TopicPartition) -> bool:  # a position not known in time (Kafka away): behind
            position = position_by(consumer, tp, deadline)
            return position is None or position < end[tp]

        while any(behind(tp) for tp in tps):
            if time.monotonic() > deadline:
                log.warning("read only part of %s within %.0f s: stalls firing before the start may "
                            "show as 0 until their next transition", topic, timeout)
                break
            for batch in consumer.poll(timeout_ms=200).values():
                for rec in batch:
                    try:
                        alerts.append(decode("Alert", rec.value))
                    except DecodeError:
                        pass  # counted when the sink loop reads it
    finally:
        consumer.close()
    return alerts


class PrometheusExporter:
    """``ExporterState`` fed by a ``SinkLoop`` and served over HTTP: ``serve()``, then
    ``run()`` (blocking) until ``stop()``."""

    def __init__(self, conn: Connection | str, topics: Topics, port: int = DEFAULT_PORT, addr: str = "0.0.0.0",
                 group_id: str = DEFAULT_GROUP, ttl_s: float = DEFAULT_TTL_S,
                 top_k: int = DEFAULT_TOP_K, top_ranks: int | None = DEFAULT_TOP_RANKS,
                 wait_topics_s: float = 0.0, web=None) -> None:
        self.conn = conn
        self.web = web  # web_config.WebConfig: TLS and basic auth of /metrics
        self.wait_topics_s = wait_topics_s
        self.topics = topics
        self.port = port
        self.addr = addr
        self.group_id = group_id
        self.state = ExporterState(topics, ttl_s, top_k, top_ranks)
        self._stop = threading.Event()
        self._server = None
        self._loop = None

    def serve(self) -> str:
        """Bind the HTTP port and join the consumer group; returns the /metrics URL."""
        from profstream.sinks.runner import SinkLoop

        try:
            self._server = serve_metrics(self.addr, self.port, self.state.exposition, "profstream exporter",
                                         web=self.web)
        except OSError as e:
            raise ExporterError(f"cannot serve metrics on {self.addr}:{self.port} ({e.strerror or e}): "
                                "choose another --port") from None
        try:
            self.state.seed_stalls(read_alerts(self.conn, self.topics.alerts))
            self._loop = SinkLoop(self.conn, [self.topics.steps, self.topics.run, self.topics.alerts],
                                  self.group_id, self.state, wait_topics_s=self.wait_topics_s)
            self.state.source = self._loop
        except RuntimeError as e:  # a missing topic: SinkLoop says which
            self.close()
            raise ExporterError(str(e)) from None
        except BaseException:
            self.close()
            raise
        port = self._server.server_port
        host = "localhost" if self.addr in ("", "0.0.0.0", "::") else self.addr
        return f"{self.web.scheme if self.web is not None else 'http'}://{host}:{port}/metrics"

    def run(self) -> None:
        """Consume until ``stop()``; commits what was handled and closes the consumer."""
        if self._loop is None:
            raise RuntimeError("call serve() first")
        self._loop.run(self._stop)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Stop serving HTTP."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def start_exporter(conn: Connection | str, topics: Topics, port: int = DEFAULT_PORT, addr: str = "0.0.0.0",
                   group_id: str = DEFAULT_GROUP, ttl_s: float = DEFAULT_TTL_S, top_k: int = DEFAULT_TOP_K,
                   top_ranks: int | None = DEFAULT_TOP_RANKS) -> tuple[str, Callable[[], None]]:
    """Start an exporter on a background thread: (its /metrics URL, a function that stops it).

    Raises ``ExporterError`` (one line) when the port is taken or a topic is missing."""
    exporter = PrometheusExporter(conn, topics, port, addr, group_id, ttl_s, top_k, top_ranks)
    url = exporter.serve()
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            exporter.run()
        except BaseException as e:  # re-raised by stop()
            log.exception("the Prometheus exporter stopped consuming")
            errors.append(e)

    thread = threading.Thread(target=consume, name="profstream-prometheus", daemon=True)
    thread.start()

    def stop() -> None:
        exporter.stop()
        thread.join(30)
        exporter.close()
        if errors:
            raise errors[0]

    return url, stop
