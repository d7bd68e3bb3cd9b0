"""Figure modules against the simulator's ground truth, and their edge cases.

Pure: no Kafka. Every simulated step's figures must equal ``plan.truth`` exactly.
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from profstream.processors.intervals import intersection_length, total, union
from profstream.processors.memory import memory_figures
from profstream.processors.model import StepEvents
from profstream.processors.optypes import op_type_costs
from profstream.processors.queues import queue_figures
from profstream.processors.ranks import rank_figures
from profstream.processors.rolling import RollingWindow
from profstream.processors.stalls import StallDetector, is_starved
from profstream.processors.steptrace import step_trace
from profstream.processors.utilization import utilization
from profstream.schema.batch import COMMUNICATION, COMPUTE, NO_VALUE
from profstream.simulate import QUEUE_NAME, SimConfig, StepPlan, plan_run

ORIGIN_NS = 1_700_000_000_000_000_000

CONFIGS = [
    SimConfig(seed=seed, ranks=2, steps=3, comm_share=share)
    for seed in (0, 1, 2) for share in (0.0, 0.2)
] + [
    SimConfig(seed=1, ranks=2, steps=6, stall=(2, 4)),
    SimConfig(seed=2, ranks=2, steps=3, straggler_rank=1, straggler_factor=1.7),
]


def _ids(cfg: SimConfig) -> str:
    return f"seed{cfg.seed}-comm{cfg.comm_share}-stall{cfg.stall}-straggler{cfg.straggler_rank}"


def events_of(plan: StepPlan, marks: bool = True) -> StepEvents:
    """The StepEvents the runtime would assemble from one planned step."""
    type_names = sorted(set(plan.op_types))
    code = {name: i for i, name in enumerate(type_names)}
    mem = np.array(plan.memory, dtype=np.int64).reshape(-1, 4)
    queue = np.array(plan.queue, dtype=np.int64).reshape(-1, 2)
    return StepEvents(
        run_id="sim", rank=plan.rank, step=plan.step,
        start_ns=plan.start_ns, end_ns=plan.end_ns,
        fp_start_ns=plan.fp_start_ns if marks else NO_VALUE,
        bp_end_ns=plan.bp_end_ns if marks else NO_VALUE,
        op_kind=np.array(plan.kinds, dtype=np.uint8),
        op_type=np.array([code[t] for t in plan.op_types], dtype=np.int32),
        op_stream=np.array(plan.streams, dtype=np.int32),
        op_start_ns=np.array(plan.op_start_ns, dtype=np.int64),
        op_dur_ns=np.array(plan.op_dur_ns, dtype=np.int64),
        type_names=type_names,
        mem_ts_ns=mem[:, 0], mem_allocated=mem[:, 1], mem_reserved=mem[:, 2], mem_peak=mem[:, 3],
        queue=np.zeros(len(queue), dtype=np.int32), queue_ts_ns=queue[:, 0],
        queue_size=queue[:, 1], queue_names=[QUEUE_NAME],
    )


def ops_events(S: int, E: int, ops: list[tuple[int, int, int, str]], **kw) -> StepEvents:
    """A hand-made step with ops given as (kind, start, end, op_type)."""
    type_names = sorted({o[3] for o in ops})
    return StepEvents(
        run_id="r", rank=0, step=0, start_ns=S, end_ns=E,
        op_kind=np.array([o[0] for o in ops], dtype=np.uint8),
        op_type=np.array([type_names.index(o[3]) for o in ops], dtype=np.int32),
        op_stream=np.zeros(len(ops), dtype=np.int32),
        op_start_ns=np.array([o[1] for o in ops], dtype=np.int64),
        op_dur_ns=np.array([o[2] - o[1] for o in ops], dtype=np.int64),
        type_names=type_names, **kw,
    )


# ---------------------------------------------------------------- simulator ground truth


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_figures_equal_simulator_truth(cfg: SimConfig) -> None:
    for plan in plan_run(cfg, ORIGIN_NS):
        truth = plan.truth
        ev = events_of(plan)

        trace = step_trace(ev)
        for key in ("step_time_ns", "data_wait_ns", "fp_bp_ns", "tail_ns"):
            assert trace[key] == truth[key], (plan.rank, plan.step, key)

        util = utilization(ev)
        for key in ("compute_ns", "comm_ns", "overlap_ns", "pure_comm_ns", "idle_ns"):
            assert util[key] == truth[key], (plan.rank, plan.step, key)
        assert util["utilization"] == pytest.approx(truth["utilization"], rel=1e-12)
        assert util["overlap_ratio"] == pytest.approx(truth["overlap_ratio"], rel=1e-12)
        if cfg.comm_share > 0:
            assert util["overlap_ns"] > 0 and util["pure_comm_ns"] > 0
        else:
            assert util["comm_ns"] == 0 and util["overlap_ratio"] == 0.0

        mem = memory_figures(ev)
        assert mem == truth["memory"]

        (queue,) = queue_figures(ev)
        assert queue["queue"] == QUEUE_NAME
        for key in ("min", "last", "at_start"):
            assert queue[key] == truth["queue"][key]
        assert queue["mean"] == pytest.approx(truth["queue"]["mean"], rel=1e-12)
        assert queue["empty_ratio"] == pytest.approx(truth["queue"]["empty_ratio"], rel=1e-12)

        starved = is_starved(trace, queue_figures(ev), device_queue=QUEUE_NAME)
        assert starved == cfg.is_stalled(plan.step)


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=_ids)
def test_op_type_costs_equal_simulator_truth(cfg: SimConfig) -> None:
    for plan in plan_run(cfg, ORIGIN_NS):
        truth = plan.truth["op_types"]
        ev = events_of(plan)
        # every type listed: exactly the truth
        costs = op_type_costs(ev, top_k=len(truth))
        assert {c["op_type"]: (c["total_ns"], c["count"]) for c in costs} == truth
        assert [c["total_ns"] for c in costs] == sorted((t for t, _ in truth.values()), reverse=True)
        # top 3 and the rest summed as "other"
        ranked = sorted(truth.items(), key=lambda kv: (-kv[1][0], kv[0]))
        top3 = op_type_costs(ev, top_k=3)
        assert [(c["op_type"], c["total_ns"], c["count"]) for c in top3[:3]] == [
            (name, tot, cnt) for name, (tot, cnt) in ranked[:3]
        ]
        assert top3[3] == {
            "op_type": "other",
            "total_ns": sum(tot for _, (tot, _) in ranked[3:]),
            "count": sum(cnt for _, (_, cnt) in ranked[3:]),
        }
        assert len(top3) == 4
        assert sum(c["total_ns"] for c in top3) == sum(plan.op_dur_ns)


def test_default_top_k_is_ten_plus_other() -> None:
    plan = next(iter(plan_run(SimConfig(comm_share=0.2), ORIGIN_NS)))
    assert len(plan.truth["op_types"]) > 10
    costs = op_type_costs(events_of(plan))
    assert len(costs) == 11 and costs[-1]["op_type"] == "other"
    assert sum(c["count"] for c in costs) == len(plan.names)


def test_step_trace_without_marks_uses_first_and_last_compute_op() -> None:
    plan = next(iter(plan_run(SimConfig(seed=3), ORIGIN_NS)))
    ev = events_of(plan, marks=False)
    compute = [(s, s + d) for s, d, k in zip(plan.op_start_ns, plan.op_dur_ns, plan.kinds, strict=True)
               if k == COMPUTE]
    first_start = min(s for s, _ in compute)
    last_end = max(e for _, e in compute)  # the optimizer's last op, after B
    trace = step_trace(ev)
    assert trace["data_wait_ns"] == first_start - plan.start_ns == plan.truth["data_wait_ns"]
    assert trace["fp_bp_ns"] == last_end - first_start
    assert trace["tail_ns"] == plan.end_ns - last_end
    assert trace["tail_ns"] < plan.truth["tail_ns"]  # B falls back past the marked one


def test_step_trace_without_marks_or_compute_spans_the_step() -> None:
    ev = ops_events(100, 200, [(COMMUNICATION, 120, 150, "AllReduce")])
    assert step_trace(ev) == {"step_time_ns": 100, "data_wait_ns": 0, "fp_bp_ns": 100,
                              "tail_ns": 0}


# ---------------------------------------------------------------- clipping and edge cases


def test_ops_partly_outside_the_step_are_clipped() -> None:
    ev = ops_events(100, 200, [
        (COMPUTE, 50, 120, "MatMul"),  # starts before S: [100, 120)
        (COMPUTE, 150, 250, "MatMul"),  # ends after E: [150, 200)
        (COMPUTE, 10, 90, "Add"),  # wholly before S: left out
        (COMMUNICATION, 110, 160, "AllReduce"),
        (COMMUNICATION, 190, 300, "AllReduce"),  # [190, 200)
        (COMMUNICATION, 200, 260, "AllReduce"),  # starts at E: left out
    ])
    assert utilization(ev) == {
        "compute_ns": 70, "comm_ns": 60, "overlap_ns": 30, "pure_comm_ns": 30,
        "idle_ns": 0, "utilization": 0.7, "overlap_ratio": 0.5,
    }
    trace = step_trace(ev)
    assert (trace["data_wait_ns"], trace["tail_ns"]) == (0, 0)
    # op types: ops starting in [S, E), each with its full duration
    assert op_type_costs(ev) == [
        {"op_type": "AllReduce", "total_ns": 50 + 110, "count": 2},
        {"op_type": "MatMul", "total_ns": 100, "count": 1},
    ]


def test_utilization_counts_overlapping_ops_of_a_kind_once() -> None:
    ev = ops_events(0, 100, [
        (COMPUTE, 10, 40, "A"), (COMPUTE, 20, 50, "B"),  # two streams: union [10, 50)
        (COMMUNICATION, 45, 70, "C"), (COMMUNICATION, 60, 80, "C"),  # union [45, 80)
    ])
    u = utilization(ev)
    assert (u["compute_ns"], u["comm_ns"], u["overlap_ns"], u["idle_ns"]) == (40, 35, 5, 30)
    assert u["pure_comm_ns"] == 30 and u["utilization"] == pytest.approx(0.4)


def test_empty_and_zero_length_steps() -> None:
    ev = ops_events(100, 100, [(COMPUTE, 90, 110, "A")])
    u = utilization(ev)
    assert u["utilization"] == 0.0 and u["overlap_ratio"] == 0.0 and u["idle_ns"] == 0
    assert op_type_costs(ev) == []
    assert memory_figures(ev) is None
    assert queue_figures(ev) == []
    assert not is_starved(step_trace(ev), [])


def test_memory_falls_back_to_allocated_and_reports_the_last_sample() -> None:
    ev = ops_events(100, 200, [], mem_ts_ns=np.array([50, 120, 150, 200, 210]),
                    mem_allocated=np.array([9_000, 300, 700, 400, 8_000]),
                    mem_reserved=np.array([1, 2, 3, NO_VALUE, 5]),
                    mem_peak=np.array([NO_VALUE] * 5))
    # samples outside [S, E] (ts 50 and 210) do not count
    assert memory_figures(ev) == {"peak": 700, "allocated": 400, "reserved": -1}
    ev.mem_peak = np.array([99_999, NO_VALUE, 800, 750, 99_999])
    assert memory_figures(ev)["peak"] == 800


def test_queue_figures_per_queue_sorted_by_name() -> None:
    ev = ops_events(100, 200, [], queue_names=["loader", "device_queue"],
                    queue=np.array([0, 1, 1, 0, 1, 0], dtype=np.int32),
                    queue_ts_ns=np.array([90, 95, 100, 150, 180, 300]),
                    queue_size=np.array([5, 3, 0, 2, 4, 7]))
    device, loader = queue_figures(ev)
    # device_queue: at S its sample reads 0 (the one at 95 is older)
    assert device == {"queue": "device_queue", "min": 0, "mean": 2.0, "last": 4,
                      "at_start": 0, "empty_ratio": 0.5}
    # loader: only the sample at 150 lies in the step; at S the last one was at 90
    assert loader == {"queue": "loader", "min": 2, "mean": 2.0, "last": 2,
                      "at_start": 5, "empty_ratio": 0.0}
    trace = {"step_time_ns": 100, "data_wait_ns": 5}
    assert is_starved(trace, [device, loader])
    assert is_starved(trace, [device, loader], device_queue="device_queue")
    assert not is_starved(trace, [device, loader], device_queue="loader")


def test_starved_by_data_wait_share_alone() -> None:
    healthy_queue = [{"queue": "q", "at_start": 3}]
    assert is_starved({"step_time_ns": 100, "data_wait_ns": 30}, healthy_queue)
    assert not is_starved({"step_time_ns": 100, "data_wait_ns": 29}, healthy_queue)
    assert is_starved({"step_time_ns": 100, "data_wait_ns": 20}, healthy_queue, stall_ratio=0.2)
    # no size at S: the queue says nothing
    assert not is_starved({"step_time_ns": 100, "data_wait_ns": 1}, [{"queue": "q", "at_start": None}])


# ---------------------------------------------------------------- interval properties

interval_lists = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 15)), max_size=12)


def _arrays(intervals: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    start = np.array([s for s, _ in intervals], dtype=np.int64)
    return start, start + np.array([n for _, n in intervals], dtype=np.int64)


def _mask(intervals: list[tuple[int, int]]) -> np.ndarray:
    covered = np.zeros(80, dtype=bool)
    for s, n in intervals:
        covered[s:s + n] = True
    return covered


@settings(max_examples=300, deadline=None)
@given(interval_lists)
def test_union_matches_a_per_nanosecond_count(intervals: list[tuple[int, int]]) -> None:
    start, end = _arrays(intervals)
    us, ue = union(start, end)
    assert total(start, end) == int(_mask(intervals).sum())
    # sorted, disjoint, non-empty, and covering exactly the same nanoseconds
    assert np.all(ue > us)
    assert np.all(us[1:] > ue[:-1])
    assert np.array_equal(_mask([(int(s), int(e - s)) for s, e in zip(us, ue, strict=True)]), _mask(intervals))


@settings(max_examples=300, deadline=None)
@given(interval_lists, interval_lists)
def test_intersection_matches_a_per_nanosecond_count(a: list, b: list) -> None:
    a_start, a_end = _arrays(a)
    b_start, b_end = _arrays(b)
    both = intersection_length(a_start, a_end, b_start, b_end)
    assert both == int((_mask(a) & _mask(b)).sum())
    assert both == intersection_length(b_start, b_end, a_start, a_end)
    assert both <= min(total(a_start, a_end), total(b_start, b_end))


def test_intervals_of_empty_arrays() -> None:
    empty = np.empty(0, dtype=np.int64)
    us, ue = union(empty, empty)
    assert len(us) == len(ue) == 0
    assert total(empty, empty) == 0
    assert intersection_length(empty, empty, np.array([0]), np.array([10])) == 0


# ---------------------------------------------------------------- stall alert


def test_stall_fires_on_fifth_starved_step_and_resolves_after_five_healthy() -> None:
    detector = StallDetector(k=5)
    events = {}
    for step in range(60):
        change = detector.update(step, starved=20 <= step <= 34)
        if change:
            events[step] = change
        if step == 30:
            assert detector.state == "firing" and detector.since_step == 20
    assert events == {24: "firing", 39: "resolved"}
    assert detector.state == "ok"


def test_a_stall_alert_carries_the_time_its_step_ended_not_when_it_was_computed() -> None:
    """Live, replayed or in a report made years later, DataQueueStall says when it fired in
    the run: the end of the step at which it changed (the report showed its own time)."""
    from profstream.processors.figures import FigureOptions, RankFigures
    from profstream.processors.stalls import stall_alert

    cfg = SimConfig(ranks=1, steps=30, ops_per_step=20, stall=(5, 12))
    figures, alerts, ends = RankFigures(FigureOptions()), [], {}
    for plan in plan_run(cfg, ORIGIN_NS):  # a run of 2023
        ends[plan.step] = plan.end_ns
        record, transition = figures.step_metrics(events_of(plan), "watermark", 0)
        if transition is not None:
            alerts.append(stall_alert(record, transition, 5, figures.stall.since_step, figures.starved_steps))
    assert [(a["step"], a["state"]) for a in alerts] == [(9, "firing"), (17, "resolved")]
    assert [a["ts_ns"] for a in alerts] == [ends[9], ends[17]]


def test_stall_never_fires_on_a_clean_run_or_short_stalls() -> None:
    detector = StallDetector()
    starved = [s % 6 < 4 for s in range(100)]  # 4 starved steps, then 2 healthy, repeatedly
    assert all(detector.update(step, flag) is None for step, flag in enumerate(starved))
    assert detector.state == "ok"
    clean = StallDetector()
    assert all(clean.update(step, False) is None for step in range(100))


def test_stall_detector_on_a_simulated_run() -> None:
    cfg = SimConfig(ranks=1, steps=45, ops_per_step=20, stall=(20, 34))
    detector = StallDetector()
    events = {}
    for plan in plan_run(cfg, ORIGIN_NS):
        ev = events_of(plan)
        change = detector.update(plan.step, is_starved(step_trace(ev), queue_figures(ev)))
        if change:
            events[plan.step] = change
    assert events == {24: "firing", 39: "resolved"}


# ---------------------------------------------------------------- rolling window


def test_rolling_window_keeps_only_the_last_n_steps() -> None:
    rng = np.random.default_rng(7)
    step_times = [int(x) for x in rng.integers(80_000_000, 120_000_000, 250)]
    waits = [int(x) for x in rng.integers(0, 10_000_000, 250)]
    utils = [float(x) for x in rng.uniform(0.5, 0.9, 250)]
    window = RollingWindow(n=100)
    for t, w, u in zip(step_times, waits, utils, strict=True):
        window.add(t, w, u)
    last_t, last_w, last_u = step_times[-100:], waits[-100:], utils[-100:]
    quantiles = statistics.quantiles(last_t, n=100, method="inclusive")
    fig = window.figures()
    assert fig["window"] == 100
    assert fig["mean_step_time_ns"] == pytest.approx(statistics.fmean(last_t), rel=1e-12)
    assert fig["p50_step_time_ns"] == pytest.approx(quantiles[49], rel=1e-12)
    assert fig["p95_step_time_ns"] == pytest.approx(quantiles[94], rel=1e-12)
    assert fig["data_wait_share"] == pytest.approx(sum(last_w) / sum(last_t), rel=1e-12)
    assert fig["mean_utilization"] == pytest.approx(statistics.fmean(last_u), rel=1e-12)


def test_rolling_window_before_it_is_full() -> None:
    window = RollingWindow(n=100)
    assert window.figures()["window"] == 0
    for t in (100, 200, 300):
        window.add(t, 10, 0.5)
    fig = window.figures()
    assert fig["window"] == 3
    assert fig["p50_step_time_ns"] == 200.0 and fig["p95_step_time_ns"] == pytest.approx(290.0)
    assert fig["data_wait_share"] == pytest.approx(30 / 600)


@pytest.mark.parametrize("seed", range(20))
def test_rolling_percentiles_are_numpys_linear_percentiles_bit_for_bit(seed) -> None:
    """Replayed and live figures must be equal, so the percentile must not drift in the last bit."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 130))
    window = RollingWindow(n=100)
    values = rng.integers(0, 2**62 if seed % 2 else 10**9, n)
    for v in values:
        window.add(int(v), 0, 0.5)
    held = values[-100:]
    fig = window.figures()
    assert fig["p50_step_time_ns"] == float(np.percentile(held, 50))
    assert fig["p95_step_time_ns"] == float(np.percentile(held, 95))


# ---------------------------------------------------------------- ranks


def test_rank_figures_skew_and_straggler() -> None:
    fig = rank_figures({0: 100, 1: 150, 2: 110, 3: 120})
    assert fig == {"ranks_reported": 4, "min_step_time_ns": 100, "median_step_time_ns": 115.0,
                   "max_step_time_ns": 150, "skew": pytest.approx(50 / 115, rel=1e-12),
                   "straggler_rank": 1}
    tie = rank_figures({3: 200, 1: 200, 2: 50})
    assert tie["straggler_rank"] == 1 and tie["median_step_time_ns"] == 200.0
    assert rank_figures({0: 0})["skew"] == 0.0
    with pytest.raises(ValueError):
        rank_figures({})


def test_rank_figures_find_the_simulated_straggler() -> None:
    cfg = SimConfig(ranks=4, steps=3, ops_per_step=20, straggler_rank=2)
    by_step: dict[int, dict[int, int]] = {}
    for plan in plan_run(cfg, ORIGIN_NS):
        by_step.setdefault(plan.step, {})[plan.rank] = plan.truth["step_time_ns"]
    for times in by_step.values():
        fig = rank_figures(times)
        assert fig["straggler_rank"] == 2 and fig["ranks_reported"] == 4
        median = statistics.median(times.values())
        assert fig["skew"] == pytest.approx((max(times.values()) - min(times.values())) / median,
                                            rel=1e-12)
        assert fig["skew"] > 0.3  # straggler_factor 1.5 stands out of the 3 % jitter
