"""Device-side step attribution (issue 18), without Kafka: figures of synthetic Kineto GPU
traces (a device lagging its host by 0.8 of a step, kernels spanning host step boundaries,
overlapping streams, a copy stream) checked against hand-computed values; the exact
accounting of op time at step boundaries; device ops without a launch correlation; a
device clock that is not the host's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from profstream.integrations.ingest.batches import profile_batches
from profstream.integrations.ingest.model import Profile, set_steps
from profstream.offline.analyze import analyze
from profstream.processors.assembler import RankAssembler
from profstream.processors.figures import FigureOptions, RankFigures
from profstream.processors.stream import STEPS, RawMessage, figures
from profstream.schema.batch import COMMUNICATION, COMPUTE, EventBatch, encode_batch
from profstream.schema.codec import decode
from tests.kineto_traces import PER_STEP, STEP_US, lagging_device_trace

US = 1000  # ns


def _by_step(result) -> dict[int, dict]:
    return {s["step"]: s for s in result.steps}


# ---------------------------------------------------------------- a device lagging its host


def test_a_lagging_device_is_measured_on_its_own_window_with_hand_computed_figures(tmp_path):
    path = lagging_device_trace(steps=6, lag=0.8).write(tmp_path / "rank0.json")
    steps = _by_step(analyze([path]))
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    for k, s in steps.items():
        # every kernel counted whole in the step that launched it, though it ran in the next host step
        assert s["compute_ns"] == PER_STEP["compute"] * US
        assert s["comm_ns"] == PER_STEP["comm"] * US
        assert s["overlap_ns"] == PER_STEP["overlap"] * US
        assert s["pure_comm_ns"] == (PER_STEP["comm"] - PER_STEP["overlap"]) * US
        assert s["overlap_ratio"] == pytest.approx(250 / 480)
        assert s["host_step_time_ns"] == STEP_US * US
        # the device window: from the previous step's last device op (20 us before this
        # step's first) to this step's last device op; step 1 from its first device op
        before = 0 if k == 1 else 20
        assert s["step_time_ns"] == (PER_STEP["device_span"] + before) * US
        assert s["device_end_ns"] - s["device_start_ns"] == s["step_time_ns"]
        assert s["data_wait_ns"] == (PER_STEP["first_compute"] + before) * US
        assert s["fp_bp_ns"] == (PER_STEP["last_compute_end"] - PER_STEP["first_compute"]) * US
        assert s["tail_ns"] == (PER_STEP["device_span"] - PER_STEP["last_compute_end"]) * US
        # idle: no device op at all (the memcpy counts as busy), 20 us between steps
        assert s["idle_ns"] == s["step_time_ns"] - PER_STEP["busy"] * US
        assert s["utilization"] == pytest.approx(PER_STEP["compute"] * US / s["step_time_ns"])
        assert {k["kind"]: k["total_ns"] for k in s["device_kinds"]} == {
            kind: v * US for kind, v in PER_STEP["kinds"].items()}
        assert s["uncorrelated_ops"] == 0
    # the device runs 0.8 of a step behind: its window starts in the next host step
    s2 = steps[2]
    assert s2["device_start_ns"] > s2["end_ns"] - 300 * US and s2["device_end_ns"] > s2["end_ns"] + 700 * US


def test_host_ops_and_device_kernels_are_listed_apart(tmp_path):
    path = lagging_device_trace(steps=3).write(tmp_path / "rank0.json")
    s = _by_step(analyze([path]))[2]
    kernels = {k["op_type"] for k in s["kernel_types"]}
    host = {k["op_type"] for k in s["op_types"]}
    assert kernels == {"Memcpy HtoD", "gemm_a_kernel", "gemm_b_kernel", "gemm_c_kernel", "adam_kernel",
                       "ncclKernel_AllReduce_RING_LL_Sum_float"}  # template arguments and parameters cut
    assert {"cudaLaunchKernel", "cudaMemcpyAsync", "aten::linear"} <= host
    assert not kernels & host
    assert sum(k["total_ns"] for k in s["kernel_types"]) == sum(k["total_ns"] for k in s["device_kinds"])


def test_without_a_lag_the_device_window_is_the_device_work_of_the_step(tmp_path):
    path = lagging_device_trace(steps=4, lag=0.0).write(tmp_path / "rank0.json")
    steps = _by_step(analyze([path]))
    for s in steps.values():
        assert s["device_end_ns"] == s["start_ns"] + 980 * US  # inside the 1000 us host step
        assert s["compute_ns"] == PER_STEP["compute"] * US


# ---------------------------------------------------------------- device ops without a correlation


def test_device_ops_without_a_correlation_fall_back_to_the_time_rule_and_are_counted(tmp_path):
    path = lagging_device_trace(steps=5, uncorrelated=(3,)).write(tmp_path / "rank0.json")
    result = analyze([path])
    steps = _by_step(result)
    # step 3's gemm C (280 us) ran in host step 4: the time rule puts it there, whole
    assert steps[3]["compute_ns"] == (PER_STEP["compute"] - 280) * US
    assert steps[4]["uncorrelated_ops"] == 1
    assert sum(s["uncorrelated_ops"] for s in steps.values()) == 1
    c4 = {k["op_type"]: k["count"] for k in steps[4]["kernel_types"]}
    assert c4["gemm_c_kernel"] == 2
    # nothing lost: the device's summed op time over the run is unchanged
    kinds = sum(k["total_ns"] for s in steps.values() for k in s["device_kinds"])
    assert kinds == 5 * sum(PER_STEP["kinds"].values()) * US
    # and the processors' health counter counts it
    from profstream.processors.health import ProcessorHealth, StageCounts
    counts = StageCounts(keep_step_ends=False)
    for s in result.steps:
        counts.step_closed(s)
    health = ProcessorHealth()
    health.commit(counts)
    families = {f.name: f for f in health.collect()}
    assert families["profstream_uncorrelated_device_ops"].samples[0].value == 1


# ---------------------------------------------------------------- clock domains


def test_a_device_clock_that_is_not_the_hosts_is_reported_once_with_file_and_rank(tmp_path):
    path = lagging_device_trace(steps=4, rank=3, device_offset_us=3600e6).write(tmp_path / "r3.json")
    result = analyze([path])
    notes = result.ranks[0].profile.notes
    clock = [n for n in notes if "device clock" in n]
    assert len(clock) == 1 and str(path) in clock[0] and "rank 3" in clock[0]
    # the launch correlation still attributes every kernel to the step that launched it
    steps = _by_step(result)
    assert sorted(steps) == [1, 2, 3, 4]
    assert all(s["compute_ns"] == PER_STEP["compute"] * US for s in steps.values())
    healthy = analyze([lagging_device_trace(steps=4, rank=3).write(tmp_path / "ok.json")])
    assert not [n for n in healthy.ranks[0].profile.notes if "device clock" in n]


# ---------------------------------------------------------------- exact accounting at boundaries

N = 160  # nanoseconds of the property test's world


def _profile(bounds: list[tuple[int, int]], ops: list[tuple[int, int, int]]) -> Profile:
    p = Profile(source="test", path=Path("test"))
    set_steps(p, list(range(len(bounds))), [b[0] for b in bounds], [b[1] for b in bounds])
    p.name_table = p.type_table = np.array(["mm", "allreduce"], dtype=object)
    kinds = np.array([k for k, _, _ in ops], np.uint8)
    p.op_kind = kinds
    p.op_name = p.op_type = (kinds == COMMUNICATION).astype(np.int32)
    p.op_stream = np.zeros(len(ops), np.int32)
    p.op_start_ns = np.array([s for _, s, _ in ops], np.int64)
    p.op_dur_ns = np.array([d for _, _, d in ops], np.int64)
    p.assign_steps()
    return p


def _messages(batches: list[EventBatch]) -> list[RawMessage]:
    return [RawMessage(float(i), 0, i, b"r/0", encode_batch(b)) for i, b in enumerate(batches)]


steps_strategy = st.lists(st.tuples(st.integers(0, 12), st.integers(1, 40)), min_size=1, max_size=6)
ops_strategy = st.lists(st.tuples(st.sampled_from([COMPUTE, COMMUNICATION]), st.integers(0, N - 1),
                                  st.integers(0, 70)), max_size=25)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps_strategy, ops_strategy)
def test_summed_over_steps_compute_comm_overlap_and_idle_equal_the_totals_over_the_covered_time(gaps, ops):
    """Over the steps with ops of their own (the others were not measured: no figure, not 0),
    whatever ran in them, carried from earlier steps too, counts once."""
    bounds, t = [], 0
    for gap, length in gaps:
        bounds.append((t + gap, t + gap + length))
        t += gap + length
    p = _profile(bounds, ops)
    out = [decode("StepMetrics", f.value) for f in figures(_messages(list(profile_batches(p, "r", 0))))
           if f.kind == STEPS]
    assert [s["step"] for s in out] == list(range(len(bounds)))
    for s in out:  # a step without an op event of its own has no op figure
        assert (s["op_count"] == 0) == (s["utilization"] is None) == (s["idle_ns"] is None)
    out = [s for s in out if s["op_count"]]

    world = max(t, N + 70)  # six steps of up to 52 ns reach past the ops' N + 70
    covered = np.zeros(world, bool)
    for s in out:
        covered[bounds[s["step"]][0]:bounds[s["step"]][1]] = True
    masks = {COMPUTE: np.zeros(world, bool), COMMUNICATION: np.zeros(world, bool)}
    for kind, start, dur in ops:
        masks[kind][start:start + dur] = True
    compute, comm = masks[COMPUTE] & covered, masks[COMMUNICATION] & covered
    assert sum(s["compute_ns"] for s in out) == compute.sum()
    assert sum(s["comm_ns"] for s in out) == comm.sum()
    assert sum(s["overlap_ns"] for s in out) == (compute & comm).sum()
    assert sum(s["idle_ns"] for s in out) == (covered & ~(compute | comm)).sum()
    assert sum(s["step_time_ns"] for s in out) == covered.sum()


def test_an_op_running_past_its_step_counts_in_the_next_ones_across_a_restart():
    """The part of an op past E is carried; the carry survives the checkpoint."""
    p = _profile([(0, 100), (100, 200), (200, 300)],  # [50, 250), and an op of their own in steps 1 and 2
                 [(COMPUTE, 50, 200), (COMMUNICATION, 120, 10), (COMMUNICATION, 220, 10)])
    batches = list(profile_batches(p, "r", 0))
    asm, figs = RankAssembler("r", 0), RankFigures(FigureOptions())
    out = []
    restarted = False
    for i, b in enumerate(batches):
        asm.add(b, 0.0, i)
        for ev, reason in asm.close_ready(0.0):
            out.append(figs.step_metrics(ev, reason, 0)[0])
        if len(out) == 1 and not restarted:  # restart after the first step closed: restore from the checkpoint
            restarted = True
            from profstream.schema.codec import encode
            cp = decode("RankCheckpoint", encode("RankCheckpoint", {**asm.snapshot(), **figs.snapshot()}))
            asm, figs = RankAssembler.restore(cp, 2.0, 0, 0.0), RankFigures.restore(FigureOptions(), cp)
    assert [s["compute_ns"] for s in out] == [50, 100, 50]
    assert [s["idle_ns"] for s in out] == [50, 0, 50]
    # op types count the op once, whole, in the step where it starts
    assert [sum(c["count"] for c in s["op_types"] if c["op_type"] == "mm") for s in out] == [1, 0, 0]
