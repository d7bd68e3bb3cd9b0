"""A figure that was not measured is absent, never 0: the op figures of steps whose ops were
not captured (op capture every N steps, or off), in StepMetrics, the rolling mean, the
exporter, the cross-rank collectives and the report. No Kafka."""

from __future__ import annotations

import re
import time
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from profstream.kafka.topics import Topics
from profstream.offline import charts
from profstream.processors.collectives import CollectiveCall, calls_of, pack_calls
from profstream.processors.health import StageCounts
from profstream.processors.runtime import RunStage
from profstream.processors.stream import STEPS, figures
from profstream.schema.codec import OP_FIGURES, VERSIONS, decode, encode
from profstream.simulate import SimConfig, expected
from profstream.sinks.prometheus import ExporterState
from tests.helpers import simulated_messages
from tests.test_prometheus_sink import Scrape

CFG = SimConfig(run_id="every-5", ranks=2, steps=23, ops_per_step=40, seed=4, capture_every_n_steps=5)
Rec = namedtuple("Rec", "topic partition offset timestamp value")
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def steps() -> dict[tuple[int, int], tuple[dict, bytes]]:
    """(rank, step) -> (StepMetrics, its message) of CFG through the processors."""
    return {(m["rank"], m["step"]): (m, f.value) for f in figures(simulated_messages(CFG)) if f.kind == STEPS
            for m in [decode("StepMetrics", f.value)]}


def test_steps_between_op_captures_have_no_op_figures_where_they_read_0_before(steps):
    truth = expected(CFG)
    assert len(steps) == CFG.ranks * CFG.steps
    for (rank, step), (m, message) in steps.items():
        want = truth[(rank, step)]
        if step % 5:  # not captured: no op figure, and no op type
            assert {k: m[k] for k in OP_FIGURES} == dict.fromkeys(OP_FIGURES), (rank, step)
            assert m["op_count"] == 0 and m["op_types"] == []
            assert message[:10] == VERSIONS[("StepMetrics", 6)].header  # v6: older readers could only read a 0
        else:
            assert {k: m[k] for k in OP_FIGURES} == pytest.approx({k: want[k] for k in OP_FIGURES}, rel=1e-12)
            assert message[:10] == VERSIONS[("StepMetrics", 3)].header  # measured: read whole by older readers
        assert m["step_time_ns"] == want["step_time_ns"] and m["data_wait_ns"] == want["data_wait_ns"]


def test_the_rolling_mean_utilization_is_over_the_captured_steps_only(steps):
    truth = expected(CFG)
    for (rank, step), (m, _) in steps.items():
        captured = [truth[(rank, s)]["utilization"] for s in range(0, step + 1, 5)]
        assert m["rolling"]["mean_utilization"] == pytest.approx(np.mean(captured), rel=1e-12), (rank, step)
        assert m["rolling"]["mean_utilization"] > 0.5  # the simulated device is busy; 0s would pull it to ~0.2


def test_a_step_without_ops_from_an_older_processor_reads_as_not_measured(steps):
    (m, _), = [v for k, v in steps.items() if k == (0, 1)]
    old = {**m, **{k: 0 for k in ("compute_ns", "comm_ns", "overlap_ns", "pure_comm_ns")},
           "idle_ns": m["step_time_ns"], "utilization": 0.0, "overlap_ratio": 0.0,
           "rolling": {**m["rolling"], "mean_utilization": 0.3}}
    for version in (3, 5):  # what a processor before v6 wrote for it
        back = decode("StepMetrics", encode("StepMetrics", old, version))
        assert {k: back[k] for k in OP_FIGURES} == dict.fromkeys(OP_FIGURES)
    measured = steps[(0, 0)][0]
    assert decode("StepMetrics", encode("StepMetrics", measured, 5)) == measured


def _scrape(records: list[dict]) -> Scrape:
    topics = Topics("nm")
    state = ExporterState(topics)
    now_ms = time.time_ns() // 10**6
    state.handle([Rec(topics.steps, 0, i, now_ms, encode("StepMetrics", m)) for i, m in enumerate(records)])
    return Scrape(state.exposition().decode())


def test_the_exporter_keeps_the_latest_measured_utilization_and_has_none_before_one(steps):
    rank0 = [steps[(0, s)][0] for s in range(CFG.steps)]
    never = [{**steps[(1, s)][0], "run_id": "no-capture"} for s in range(1, 5)]  # steps 1-4: no op captured
    s = _scrape(rank0 + never)
    lab = {"run": CFG.run_id, "rank": "0"}
    assert s("profstream_last_step", **lab) == CFG.steps - 1  # step 22: not captured
    last = steps[(0, 20)][0]  # the latest captured step
    assert s("profstream_device_utilization_ratio", **lab) == pytest.approx(last["utilization"], rel=1e-12)
    assert s("profstream_idle_ratio", **lab) == pytest.approx(last["idle_ns"] / last["step_time_ns"], rel=1e-12)
    assert s("profstream_comm_overlap_ratio", **lab) == pytest.approx(last["overlap_ratio"], rel=1e-12)
    # a run whose ops were never captured: no utilization at all, not 0, and in no quantile over ranks
    for name in ("profstream_device_utilization_ratio", "profstream_idle_ratio", "profstream_comm_overlap_ratio",
                 "profstream_ranks_device_utilization_ratio"):
        assert s.all(name, run="no-capture") == [], name
    assert s("profstream_last_step", run="no-capture", rank="1") == 4


def _step(rank: int, step: int, calls: list | None) -> dict:
    m = decode("StepMetrics", (DATA / "stepmetrics-v3.bin").read_bytes())
    m = {**m, "run_id": "coll", "rank": rank, "world_size": 2, "step": step}
    if calls is None:  # not captured on this rank
        return {**m, "op_count": 0, "op_types": [], **dict.fromkeys(OP_FIGURES)}
    return {**m, "collectives": pack_calls(calls_of(calls))}


def test_a_collective_one_rank_did_not_capture_is_not_a_missing_rank():
    """Rank 0 captured steps 3 and 4 (a capture request for rank 0 alone); rank 1 did not:
    its calls are not measured, not missing (CollectiveHang would fire)."""
    topics = Topics("coll")
    stage = RunStage(topics, StageCounts(keep_step_ends=False), grace_s=10.0)
    call = [CollectiveCall("all_reduce", "0", 2, seq, 4000, 10 * seq, 10 * seq + 5) for seq in (7,)]
    records = [_step(0, 3, call), _step(1, 3, None),  # not captured on rank 1
               _step(0, 4, call), _step(1, 4, [])]  # captured on rank 1, which did not make the call
    out = []
    for i, m in enumerate(records):
        stage.fold(Rec(topics.steps, 0, i, 0, encode("StepMetrics", m)), 1.0)
        out += stage.ready(1.0)
    runs = {r["step"]: r for r in (decode("RunStepMetrics", o.value) for o in out if o.topic == topics.run)}
    assert runs[3]["unmatched_collectives"] == []
    (hang,) = runs[4]["unmatched_collectives"]
    assert hang["missing"] == [1] and hang["arrived"] == [0]


def test_a_chart_leaves_out_what_was_not_measured_instead_of_drawing_0():
    xs = np.arange(10)
    ys = np.array([50.0 if x % 5 == 0 else np.nan for x in xs])  # steps 0 and 5 measured
    svg = charts.line_chart("u", "utilization", [("rank 0", xs, ys)], "%")
    assert svg.count("<circle") == 2 and "<polyline" not in svg  # two lone points, no line through 0
    on_zero = f'cy="{charts.HEIGHT - charts.BOTTOM:.1f}"'  # y of the value 0 (the chart starts at 0)
    assert on_zero not in svg and re.findall(r'cy="([\d.]+)"', svg) == [re.findall(r'cy="([\d.]+)"', svg)[0]] * 2
    joined = charts.line_chart("u", "utilization", [("rank 0", xs, np.full(10, 50.0))], "%")
    assert joined.count("<polyline") == 1 and "<circle" not in joined
