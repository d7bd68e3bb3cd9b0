"""Device-side step attribution (issue 18), without Kafka: figures of synthetic Kineto GPU
traces (a device lagging its host by 0.8 of a step, kernels spanning host step boundaries,
overlapping streams, a copy stream) checked against hand-computed values; the exact
accounting of op time at step boundaries; device ops without a launch correlation; a
device clock that is not the host's."""

from __future__ import annotations

import math
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
from profstream.schema.batch import COMMUNICATION, COMPUTE, MEMCPY, EventBatch, encode_batch
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


def test_work_a_step_launches_early_counts_in_the_window_it_ran_in_with_hand_computed_figures(tmp_path):
    """Each step also launches a copy and a kernel that run while the previous step's
    all-reduce and optimizer still run (EARLY in tests/kineto_traces.py). The windows are
    the device's periods, one after the other; each counts what ran inside it, whichever
    step launched it; each op counts once, whole, in the op counts of the step that
    launched it."""
    path = lagging_device_trace(steps=6, lag=0.8, early=True).write(tmp_path / "rank0.json")
    steps = _by_step(analyze([path]))
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    for k in range(2, 7):
        s, before = steps[k], steps[k - 1]
        # [d_k - 20, d_k + 980): from the previous step's last device op to this step's last
        assert s["device_start_ns"] == before["device_end_ns"]
        assert s["step_time_ns"] == s["host_step_time_ns"] == STEP_US * US
        nxt = k < 6  # the next step's early kernel [750, 960) and copy [700, 850) run in this window
        assert s["compute_ns"] == (830 if nxt else 670) * US  # [60,400) [420,700) [750 or 910, 960)
        assert s["comm_ns"] == 480 * US
        assert s["overlap_ns"] == (410 if nxt else 250) * US  # the early kernel beside the all-reduce
        assert s["idle_ns"] == 50 * US  # [-20, 0), [50, 60), [400, 420)
        assert (s["data_wait_ns"], s["fp_bp_ns"], s["tail_ns"]) == (80 * US, 900 * US, 20 * US)
        # op counts: this step's own ops, whole, the early ones too
        kinds = {x["kind"]: (x["total_ns"], x["count"]) for x in s["device_kinds"]}
        assert kinds == {"compute": ((770 + 210) * US, 5), "communication": (480 * US, 1),
                         "memcpy": ((50 + 150) * US, 2)}
    # step 1 starts at its own early copy, 300 us before its first kernel
    assert steps[1]["step_time_ns"] == 1280 * US and steps[1]["compute_ns"] == (210 + 830) * US


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
    # step 3's gemm C (280 us) ran in host step 4: the time rule puts it there, whole, in
    # its op counts; its time still counts where it ran, in step 3's device window, so the
    # time figures of both steps are those of every other step
    assert steps[3]["compute_ns"] == steps[4]["compute_ns"] == PER_STEP["compute"] * US
    assert steps[3]["idle_ns"] == steps[4]["idle_ns"] == steps[2]["idle_ns"]
    assert {k["kind"]: k["total_ns"] for k in steps[3]["device_kinds"]}["compute"] == (
        PER_STEP["kinds"]["compute"] - 280) * US
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


# ---------------------------------------------------------------- device windows tile the device span

UNIT = 100_000  # ns: the property test's unit (0.1 ms), so that CLOCK_SKEW_NS (1 ms) is 10 of them


def _device_profile(bounds: list[tuple[int, int]], ops: list[tuple[int, int, int, int, int]]) -> Profile:
    """Host steps [S, E) and device ops (kind, stream, start, dur, launch), all in UNITs."""
    p = Profile(source="test", path=Path("test"))
    set_steps(p, list(range(len(bounds))), [b[0] * UNIT for b in bounds], [b[1] * UNIT for b in bounds])
    names = ["gemm", "allreduce", "memcpy"]
    p.name_table = p.type_table = np.array(names, dtype=object)
    p.op_kind = np.array([k for k, *_ in ops], np.uint8)
    p.op_name = p.op_type = np.array([{COMPUTE: 0, COMMUNICATION: 1, MEMCPY: 2}[k] for k, *_ in ops], np.int32)
    p.op_stream = np.array([s for _, s, *_ in ops], np.int32)
    p.op_start_ns = np.array([o[2] * UNIT for o in ops], np.int64)
    p.op_dur_ns = np.array([o[3] * UNIT for o in ops], np.int64)
    p.op_launch_ns = np.array([o[4] * UNIT for o in ops], np.int64)
    p.op_on_device = np.ones(len(ops), bool)
    p.assign_steps()
    return p


# per step: host length, gap before it, the device's lag behind the host for its main ops,
# its main ops (kind, stream 0/1, launch offset in the host step, start after the lag, dur)
# and early ops (copies on stream 2, kernels on stream 3) that start soon after their launch
_main_op = st.tuples(st.sampled_from([COMPUTE, COMPUTE, COMMUNICATION, MEMCPY]), st.integers(0, 1),
                     st.integers(0, 100), st.integers(0, 30), st.integers(1, 40))
_early_op = st.tuples(st.sampled_from([(MEMCPY, 2), (COMPUTE, 3)]), st.integers(0, 100), st.integers(0, 5),
                      st.integers(1, 30))
_device_step = st.tuples(st.integers(5, 40), st.integers(0, 8), st.integers(0, 90),
                         st.lists(_main_op, min_size=1, max_size=5), st.lists(_early_op, max_size=3))


def _interleaving(steps, first_kind: int | None = None) -> tuple[list[tuple[int, int]], list[tuple]]:
    """Host steps and device ops of the strategy's steps (``first_kind``: the kind of each
    step's first main op, else as drawn). Every op starts after its launch, inside its
    host step."""
    bounds, ops, t = [], [], 0
    for length, gap, lag, main, early in steps:
        S = t + gap
        bounds.append((S, S + length))
        for i, (kind, stream, at, after, dur) in enumerate(main):
            launch = S + at * (length - 1) // 100
            ops.append((first_kind if i == 0 and first_kind is not None else kind, stream, launch + lag + after,
                        dur, launch))
        for (kind, stream), at, after, dur in early:
            launch = S + at * (length - 1) // 100
            ops.append((kind, stream, launch + after, dur, launch))
        t = S + length
    return bounds, ops


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_device_step, min_size=1, max_size=7))
def test_device_windows_tile_the_device_span_and_summed_figures_equal_the_whole_spans(steps):
    """Steps whose device work interleaves: the device lags its host by a different amount
    in each step, and steps launch copies (stream 2) and kernels (stream 3) that start at
    once, while earlier steps' kernels still run. Every op starts after its launch, inside
    its host step. Summed over the steps, step time is the device's span (first op's start
    to last op's end), and compute, communication, overlap and idle are those of the whole
    span; consecutive windows meet exactly; every op counts once, whole, in its step's
    device kinds."""
    bounds, ops = _interleaving(steps)
    p = _device_profile(bounds, ops)
    out = [decode("StepMetrics", f.value) for f in figures(_messages(list(profile_batches(p, "r", 0))))
           if f.kind == STEPS]
    assert [s["step"] for s in out] == list(range(len(bounds)))
    assert all(s["device_end_ns"] is not None for s in out)

    first = min(o[2] for o in ops)
    world = max(o[2] + o[3] for o in ops)
    _assert_windows_tile(out, ops, ops, first, world, (COMPUTE, COMMUNICATION, MEMCPY))


def _assert_windows_tile(out: list[dict], ops: list[tuple], bounding: list[tuple], first: int, last: int,
                         busy_kinds: tuple[int, ...]) -> None:
    """The StepMetrics ``out`` of ``ops`` (in UNITs): windows that meet exactly from ``first``
    to ``last``, step time, compute, communication and overlap summed equal to those of the
    ``bounding`` ops over that span, idle the span's time none of ``busy_kinds`` runs, the
    phases tiling each window, and every op once, whole, in its step's device kinds."""
    world = max(o[2] + o[3] for o in ops)
    masks = {k: np.zeros(world, bool) for k in (COMPUTE, COMMUNICATION, MEMCPY)}
    for kind, _stream, start, dur, _launch in bounding:
        masks[kind][start:start + dur] = True
    compute, comm = masks[COMPUTE], masks[COMMUNICATION]
    busy = np.logical_or.reduce([masks[k] for k in busy_kinds])
    span = np.zeros(world, bool)
    span[first:last] = True

    def summed(field: str) -> float:
        return sum(s[field] for s in out) / UNIT

    assert out[0]["device_start_ns"] == first * UNIT and out[-1]["device_end_ns"] == last * UNIT
    for before, after in zip(out, out[1:]):
        assert after["device_start_ns"] == before["device_end_ns"]  # neither overlap nor gap
    assert summed("step_time_ns") == span.sum()
    assert summed("compute_ns") == compute.sum()
    assert summed("comm_ns") == comm.sum()
    assert summed("overlap_ns") == (compute & comm).sum()
    assert summed("idle_ns") == (span & ~busy).sum()
    for s in out:  # the phases tile each window
        assert s["data_wait_ns"] >= 0 and s["fp_bp_ns"] >= 0 and s["tail_ns"] >= 0
        assert s["data_wait_ns"] + s["fp_bp_ns"] + s["tail_ns"] == s["step_time_ns"]
    assert sum(k["total_ns"] for s in out for k in s["device_kinds"]) == sum(o[3] for o in ops) * UNIT
    assert sum(k["count"] for s in out for k in s["device_kinds"]) == len(ops)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_device_step, min_size=1, max_size=7), st.sampled_from([COMPUTE, COMMUNICATION]))
def test_on_ascend_the_windows_tile_the_span_of_compute_and_communication(steps, first_kind):
    """The same interleaving steps on an Ascend device (issue 38's msprof definitions with
    issue 28's tiling): each step has a compute or communication task, so its own bounds
    come from those; copies bound no window and are free time. Summed over the steps, step
    time is the span from the first compute or communication task to the last (the second
    step's window and every later one start at the previous window's end: the previous
    step's last such task), and compute, communication, overlap and idle (the time neither
    runs) are those of that span; copies still count whole in device kinds."""
    bounds, ops = _interleaving(steps, first_kind)
    p = _device_profile(bounds, ops)
    out = [decode("StepMetrics", f.value)
           for f in figures(_messages(list(profile_batches(p, "r", 0, device="npu:0")))) if f.kind == STEPS]
    assert [s["step"] for s in out] == list(range(len(bounds)))
    assert all(s["device"] == "npu:0" and s["device_end_ns"] is not None for s in out)

    tasks = [o for o in ops if o[0] in (COMPUTE, COMMUNICATION)]
    first = min(o[2] for o in tasks)
    last = max(o[2] + o[3] for o in tasks)
    _assert_windows_tile(out, ops, tasks, first, last, (COMPUTE, COMMUNICATION))


def test_a_step_waiting_for_a_later_one_gets_the_same_figures_across_a_restart(tmp_path):
    """A device step stays open until a later step has ended on the host after its window
    (a next step's early copies and kernels may still run in it); a processor restarted
    meanwhile reads its events again from the checkpointed offset and closes it with the
    figures of a run without the restart."""
    from profstream.integrations.ingest import load_profile
    from profstream.schema.codec import encode

    path = lagging_device_trace(steps=6, lag=0.8, early=True).write(tmp_path / "rank0.json")
    batches = list(profile_batches(load_profile(path), "r", 0))
    straight = [decode("StepMetrics", f.value) for f in figures(_messages(batches)) if f.kind == STEPS]

    asm, figs = RankAssembler("r", 0), RankFigures(FigureOptions())
    out, held, i = [], 0, 0
    while i < len(batches):
        asm.add(batches[i], 0.0, i)
        i += 1
        held += asm.held_step is not None
        closed = asm.close_ready(0.0)
        held += asm.held_step is not None
        out += [figs.step_metrics(ev, reason, 0)[0] for ev, reason in closed]
        if closed and asm.open:  # restart: state from the checkpoint, open steps read again
            cp = decode("RankCheckpoint", encode("RankCheckpoint", {**asm.snapshot(), **figs.snapshot()}))
            i = asm.min_open_offset
            asm, figs = RankAssembler.restore(cp, 2.0, 0, 0.0), RankFigures.restore(FigureOptions(), cp)
    out += [figs.step_metrics(ev, "idle", 0)[0] for ev in asm.close_all()]
    assert held  # steps did wait for later ones
    assert [s["step"] for s in out] == [s["step"] for s in straight] == [1, 2, 3, 4, 5, 6]
    same = ("step_time_ns", "device_start_ns", "device_end_ns", "compute_ns", "comm_ns", "overlap_ns", "idle_ns",
            "data_wait_ns", "fp_bp_ns", "tail_ns", "device_kinds")
    assert [{f: s[f] for f in same} for s in out] == [{f: s[f] for f in same} for s in straight]


def test_without_a_watermark_a_waiting_device_step_closes_when_a_later_step_s_grace_ends(tmp_path):
    """A producer that sends no watermark: steps close a grace period after their mark; a
    device step whose window a later step may still reach closes as soon as the grace of
    the first step that ended on the host after its window (+ CLOCK_SKEW_NS) has passed."""
    from dataclasses import replace

    from profstream.integrations.ingest import load_profile
    from profstream.processors.stream import StreamOptions

    # host steps end at 11, 12, 13, 14 ms; device windows at 11.78, 12.78, 13.78, 14.78 ms
    path = lagging_device_trace(steps=4, lag=0.8, early=True).write(tmp_path / "rank0.json")
    batches = [replace(b, complete_through_step=None) for b in profile_batches(load_profile(path), "r", 0)]
    # a batch a second: step k's mark comes at 2k - 1 s; then another run's batches keep
    # the clock going (the rank is not idle before 60 s)
    messages = [RawMessage(float(i), 0, i, b"r/0", encode_batch(b)) for i, b in enumerate(batches)]
    messages += [RawMessage(float(t), 0, t, b"x/0", encode_batch(EventBatch(run_id="x", rank=0, producer_id="x",
                                                                             seq=t))) for t in range(8, 13)]
    out = {s["step"]: (f.clock, s["closed_by"]) for f in figures(messages, StreamOptions(grace_s=2.0))
           if f.kind == STEPS and (s := decode("StepMetrics", f.value))["run_id"] == "r"}
    # step 1 waits for step 3 (ends at 13 ms >= 11.78 + 1), marked at 5 s: closes at 7 s;
    # step 2 for step 4, marked at 7 s; steps 3 and 4 for a step that never comes
    assert out == {1: (7.0, "grace"), 2: (9.0, "grace"), 3: (math.inf, "idle"), 4: (math.inf, "idle")}


def test_a_rank_that_ends_closes_its_waiting_device_steps_at_its_end_mark(tmp_path):
    """The last device steps of a rank wait for a later step that never comes; the
    producer's end mark (issue 29) says none will: they close when it arrives, with the
    figures they would have had at the idle timeout, and the rank's RankEnd follows them
    at once, not 60 s later."""
    from profstream.integrations.ingest import load_profile
    from profstream.processors.stream import ENDS
    from profstream.schema.batch import END_MARK, NO_VALUE

    path = lagging_device_trace(steps=4, lag=0.8, early=True).write(tmp_path / "rank0.json")
    batches = list(profile_batches(load_profile(path), "r", 0))
    last = batches[-1]
    end_ns = int(last.steps["end_ns"][-1]) + 1000
    mark = EventBatch(run_id="r", rank=0, producer_id=last.producer_id, seq=last.seq + 1,
                      complete_through_step=last.complete_through_step,
                      steps={"step": np.array([END_MARK]), "start_ns": np.array([end_ns]),
                             "end_ns": np.array([end_ns]), "fp_start_ns": np.array([NO_VALUE]),
                             "bp_end_ns": np.array([NO_VALUE])})
    without = [(f.kind, f.clock, decode("StepMetrics", f.value)) for f in figures(_messages(batches))
               if f.kind == STEPS]
    got = [(f.kind, f.clock, decode("RankEnd" if f.kind == ENDS else "StepMetrics", f.value))
           for f in figures(_messages(batches + [mark])) if f.kind in (STEPS, ENDS)]
    at = float(len(batches))  # the end mark's clock
    assert [(k, c) for k, c, _ in without][-2:] == [(STEPS, math.inf)] * 2  # without it: at the idle timeout
    assert [(k, c, m.get("step")) for k, c, m in got][-3:] == [(STEPS, at, 3), (STEPS, at, 4), (ENDS, at, None)]
    assert got[-1][2]["last_step"] == 4
    same = ("step_time_ns", "device_start_ns", "device_end_ns", "compute_ns", "comm_ns", "overlap_ns", "idle_ns")
    assert [{f: m[f] for f in same} for _, _, m in got[:-1]] == [{f: m[f] for f in same} for _, _, m in without]
