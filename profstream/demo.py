"""The walking skeleton end to end: broker, simulated run, processor, per-rank summary."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from profstream.kafka.clients import read_topic
from profstream.kafka.topics import Topics, ensure_topics
from profstream.processors.health import ProcessorHealth
from profstream.processors.runtime import Processor
from profstream.schema.codec import decode, record_name
from profstream.simulate import SimConfig, SimResult, expected, run_simulation


@dataclass
class DemoResult:
    sim: SimResult
    steps: list[dict]  # StepMetrics records of the run
    alerts: list[dict]  # Alert records of the run
    truth: dict  # (rank, step) -> simulator ground truth
    wall_s: float

    def per_rank(self) -> list[dict]:
        """One summary row per rank."""
        rows = []
        for rank in sorted({s["rank"] for s in self.steps}):
            recs = sorted((s for s in self.steps if s["rank"] == rank), key=lambda s: s["step"])
            st = np.array([r["step_time_ns"] for r in recs]) / 1e6
            rows.append({
                "rank": rank,
                "steps": len(recs),
                "step_ms_mean": float(st.mean()),
                "step_ms_p50": float(np.percentile(st, 50)),
                "step_ms_p95": float(np.percentile(st, 95)),
                "data_wait_ms": float(np.mean([r["data_wait_ns"] for r in recs]) / 1e6),
                "fp_bp_ms": float(np.mean([r["fp_bp_ns"] for r in recs]) / 1e6),
                "tail_ms": float(np.mean([r["tail_ns"] for r in recs]) / 1e6),
                # over the steps whose ops were captured (NaN: none was)
                "utilization": float(np.mean([r["utilization"] for r in recs if r["utilization"] is not None]
                                             or [np.nan])),
                "overlap_ratio": float(np.mean([r["overlap_ratio"] for r in recs if r["overlap_ratio"] is not None]
                                               or [np.nan])),
                "queue_mean": float(np.mean([q["mean"] for r in recs for q in r["queues"]] or [np.nan])),
                "queue_empty_ratio": float(np.mean([q["empty_ratio"] for r in recs for q in r["queues"]] or [np.nan])),
                "starved_steps": sum(r["starved"] for r in recs),
                "matches_truth": all(
                    r["step_time_ns"] == self.truth[(rank, r["step"])]["step_time_ns"] for r in recs),
            })
        return rows


def _step_metrics(value: bytes) -> dict | None:
    """A StepMetrics of the steps topic; None for its other records (a rank's RankEnd)."""
    return decode("StepMetrics", value) if record_name(value) == "StepMetrics" else None


def demo_bootstrap(bootstrap: str | None, starting: Callable[[], None] | None = None) -> str:
    """``bootstrap`` when given, else the local broker of `profstream stack up`, started when
    none runs (``starting()`` is called first: a first start fetches the Kafka jars)."""
    from profstream.stack import stack_status, stack_up

    if bootstrap is not None:
        return bootstrap
    if stack_status() is None and starting is not None:
        starting()
    return stack_up().bootstrap


def run_demo(bootstrap: str, cfg: SimConfig, topics: Topics | None = None,
             group_id: str = "profstream-demo", timeout: float = 120.0,
             progress=None, health: ProcessorHealth | None = None) -> DemoResult:
    """Simulate ``cfg`` into Kafka, process it, and read its StepMetrics back."""
    topics = topics or Topics()
    ensure_topics(bootstrap, topics)
    t0 = time.monotonic()
    # its own group and instance id: a demo must never fence a real `profstream process`
    processor = Processor(bootstrap, topics, group_id=group_id, instance_id="demo", health=health)
    stop = threading.Event()
    worker = threading.Thread(target=processor.run, kwargs={"stop": stop}, name="profstream-processor",
                              daemon=True)
    worker.start()
    try:
        sim = run_simulation(cfg, {"bootstrap": bootstrap, "topic_prefix": topics.prefix}, progress=progress)
        want = cfg.ranks * cfg.steps
        steps = read_topic(bootstrap, topics.steps, lambda r: r is not None and r["run_id"] == cfg.run_id, want,
                           timeout=timeout, decode=_step_metrics)
        alerts = read_topic(bootstrap, topics.alerts, lambda a: a["run_id"] == cfg.run_id,
                            processor.health.alerts, timeout=10, decode=lambda v: decode("Alert", v))
    finally:
        stop.set()
        worker.join(timeout=30)
    alerts.sort(key=lambda a: (a["step"], a["rank"] if a["rank"] is not None else -1))
    return DemoResult(sim, steps, alerts, expected(cfg), time.monotonic() - t0)
