"""StepPartials on a topic of their own (issue #35): through the real broker, the run stage
reads the partials topic (StepPartials, RankEnds, RankProgress) and never a StepMetrics,
and its run steps still equal the simulator's truth."""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest

from profstream.kafka.topics import Topics, delete_topics, ensure_topics
from profstream.schema.codec import decode, record_name
from profstream.simulate import SimConfig, expected, run_simulation
from tests.helpers import read_full, step_records, topic_records, wait_until
from tests.test_processor import RunningProcessor

CFG = SimConfig(run_id="own-topic", ranks=6, steps=12, ops_per_step=40, straggler_rank=3, straggler_factor=1.5,
                seed=21)


@dataclass
class Processed:
    topics: Topics
    read: Counter  # record name -> how many the run stage's consumer handed its fold
    runs: dict[int, dict]  # step -> its RunStepMetrics
    steps: list[dict]  # the StepMetrics on the steps topic
    steps_topic: Counter  # record name -> how many on the steps topic
    run_left: bool  # the run stage let go of the run (every rank's RankEnd came)


@pytest.fixture(scope="module")
def processed(kafka_bootstrap) -> Processed:
    topics = Topics(f"t-partials-{uuid.uuid4().hex[:8]}")
    ensure_topics(kafka_bootstrap, topics, raw_partitions=4, partitions=3)
    read: Counter = Counter()
    running = RunningProcessor(kafka_bootstrap, topics, run_grace_s=5.0)
    stage = running.processor.run_stage
    fold = stage.fold

    def counted(rec, now):  # what the run stage's consumer delivers, before the stage looks at it
        read[record_name(rec.value)] += 1
        return fold(rec, now)

    stage.fold = counted  # the loop binds the stage's fold when it starts
    total = CFG.ranks * CFG.steps
    try:
        with running:
            run_simulation(CFG, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
            steps = step_records(kafka_bootstrap, topics.steps, CFG.run_id, total)
            runs = read_full(kafka_bootstrap, topics.run, lambda r: r["run_id"] == CFG.run_id, CFG.steps, 90,
                             decode=lambda v: decode("RunStepMetrics", v), what="RunStepMetrics")
            wait_until(lambda: read["RankEnd"] >= CFG.ranks and CFG.run_id not in stage.runs, 60,
                       f"the run stage to read every rank's RankEnd and let go of the run (read {dict(read)})")
            run_left = CFG.run_id not in stage.runs
        on_steps = Counter(record_name(r.value) for r in topic_records(kafka_bootstrap, topics.steps, timeout=10))
        yield Processed(topics, read, {r["step"]: r for r in runs}, steps, on_steps, run_left)
    finally:
        delete_topics(kafka_bootstrap, topics, timeout=5.0)


def test_the_run_stage_reads_no_step_metrics_when_partials_come(processed):
    read = processed.read
    assert read["StepMetrics"] == 0, f"the run stage's consumer read {dict(read)}"
    # at most one partial a run step per step-stage transaction: fewer than the ranks' StepMetrics
    assert CFG.steps <= read["StepPartial"] < CFG.ranks * CFG.steps, dict(read)
    assert read["RankEnd"] == CFG.ranks and processed.run_left
    assert set(read) <= {"StepPartial", "RankEnd", "RankProgress"}, dict(read)
    # the steps topic keeps every StepMetrics and RankEnd for the exporter and the archive, and no partial
    assert processed.steps_topic["StepMetrics"] == CFG.ranks * CFG.steps
    assert processed.steps_topic["RankEnd"] == CFG.ranks and processed.steps_topic["StepPartial"] == 0


def test_run_steps_from_the_partials_topic_equal_the_simulators_truth(processed):
    truth = expected(CFG)
    assert sorted(processed.runs) == list(range(CFG.steps))
    assert len(processed.steps) == len({(s["rank"], s["step"]) for s in processed.steps}) == CFG.ranks * CFG.steps
    for step, run in processed.runs.items():
        want = {r: truth[(r, step)]["step_time_ns"] for r in range(CFG.ranks)}
        assert {int(r): t for r, t in run["step_times_ns"].items()} == want, f"step {step}"
        assert run["ranks_reported"] == CFG.ranks
        assert (run["min_step_time_ns"], run["max_step_time_ns"]) == (min(want.values()), max(want.values()))
        assert run["median_step_time_ns"] == float(np.median(list(want.values())))
        assert run["straggler_rank"] == max(want, key=lambda r: (want[r], -r)) == CFG.straggler_rank
