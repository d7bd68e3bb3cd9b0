"""Throughput and MFU per step, rank and run (processors/throughput.py, ranks.py, rolling.py):
every figure equals the simulator's ground truth, computed from the plan by the definitions
of docs/figures.md; a step without work figures has none (absent, never 0)."""

from __future__ import annotations

import numpy as np
import pytest

from profstream.processors.figures import FigureOptions
from profstream.processors.rolling import RollingWindow
from profstream.processors.stream import StreamOptions, figures
from profstream.processors.throughput import CATEGORIES, op_category
from profstream.schema.batch import COMPUTE
from profstream.schema.codec import VERSIONS, decode
from profstream.simulate import SimConfig, expected
from tests.helpers import simulated_messages


def _run(cfg: SimConfig, **options) -> tuple[dict, dict, list[bytes]]:
    """({(rank, step): StepMetrics}, {step: RunStepMetrics}, the StepMetrics messages)."""
    steps, runs, raw = {}, {}, []
    for f in figures(simulated_messages(cfg), StreamOptions(**options)):
        if f.kind == "steps":
            m = decode("StepMetrics", f.value)
            steps[(m["rank"], m["step"])] = m
            raw.append(f.value)
        elif f.kind == "run":
            r = decode("RunStepMetrics", f.value)
            runs[r["step"]] = r
    return steps, runs, raw


WORK = SimConfig(run_id="work", ranks=3, steps=12, ops_per_step=40, batch_size=8, seq_len=512, variable_tokens=True,
                 flops_per_token=6 * 1.3e9, flops_source="counted", peak_tflops=989.5, capture_every_n_steps=3,
                 straggler_rank=2)


def test_every_steps_throughput_and_mfu_equal_the_simulators_truth_exactly():
    steps, _runs, raw = _run(WORK)
    truth = expected(WORK)
    assert len(steps) == WORK.ranks * WORK.steps
    tokens = set()
    for key, m in steps.items():
        want, got = truth[key]["work"], m["work"]
        for name in ("tokens", "samples", "flops", "flops_source", "peak_flops", "tokens_per_s", "samples_per_s",
                     "flops_per_s", "mfu"):
            assert got[name] == want[name], (key, name)
        # MFU is FLOPs / (step time x peak), with the step time the processor measured
        assert got["mfu"] == got["flops"] / (m["step_time_ns"] / 1e9 * 989.5e12)
        tokens.add(got["tokens"])
        cats = {c["category"]: (c["flops"], c["time_ns"], c["flops_per_s"]) for c in got["op_categories"]}
        assert cats == want["op_categories"], key  # captured steps only: none on the others
        assert bool(cats) == (key[1] % 3 == 0)
    assert len(tokens) > 10  # packing: every step its own count, none assumed
    assert all(r[:10] == VERSIONS[("StepMetrics", 8)].header for r in raw)


def test_across_ranks_throughput_is_summed_and_the_lowest_mfu_names_its_rank():
    _steps, runs, _raw = _run(WORK)
    truth = expected(WORK)
    assert sorted(runs) == list(range(WORK.steps))
    for step, r in runs.items():
        per_rank = [truth[(rank, step)]["work"] for rank in range(WORK.ranks)]
        mfus = [(w["mfu"], rank) for rank, w in enumerate(per_rank)]
        want = {"ranks": 3, "tokens_per_s": sum(w["tokens_per_s"] for w in per_rank),
                "samples_per_s": sum(w["samples_per_s"] for w in per_rank),
                "flops_per_s": sum(w["flops_per_s"] for w in per_rank),
                "mean_mfu": sum(m for m, _ in mfus) / 3, "min_mfu": min(mfus)[0], "min_mfu_rank": min(mfus)[1],
                "mfu_ranks": 3}
        assert r["work"] == pytest.approx(want, rel=1e-12), step
        assert r["work"]["min_mfu_rank"] == 2  # the straggler does the same work in more time


def test_rolling_p50_and_p95_of_throughput_and_mfu_over_the_window_equal_numpys():
    cfg = SimConfig(run_id="roll", ranks=1, steps=30, ops_per_step=20, batch_size=4, variable_tokens=True,
                    flops_per_token=1e9, peak_tflops=100.0)
    steps, _runs, _raw = _run(cfg, figures=FigureOptions(rolling_steps=8))
    truth = expected(cfg)
    for (rank, step), m in steps.items():
        window = [truth[(rank, s)]["work"] for s in range(max(0, step - 7), step + 1)]
        for name in ("tokens_per_s", "samples_per_s", "mfu"):
            values = [w[name] for w in window]
            for q in (50, 95):
                assert m["rolling"][f"p{q}_{name}"] == np.percentile(values, q), (step, name, q)


def test_steps_without_work_have_no_work_figures_and_keep_their_older_versions():
    cfg = SimConfig(run_id="plain", ranks=1, steps=5, ops_per_step=20)
    steps, runs, raw = _run(cfg)
    assert all(m["work"] is None for m in steps.values())
    assert all(m["rolling"]["p50_mfu"] is None and m["rolling"]["p95_tokens_per_s"] is None for m in steps.values())
    assert all(r["work"] is None for r in runs.values())
    assert not any(r[:10] == VERSIONS[("StepMetrics", 8)].header for r in raw)  # consumers older than v8 read them


def test_an_unknown_peak_leaves_mfu_absent_and_throughput_there(caplog):
    cfg = SimConfig(run_id="nopeak", ranks=1, steps=3, ops_per_step=20, batch_size=2, flops_per_token=1e9)
    steps, runs, _raw = _run(cfg)
    for m in steps.values():
        w = m["work"]
        assert w["mfu"] is None and w["peak_flops"] is None
        assert w["tokens_per_s"] > 0 and w["flops_per_s"] == w["flops"] / (m["step_time_ns"] / 1e9)
    assert all(r["work"]["mean_mfu"] is None and r["work"]["mfu_ranks"] == 0 for r in runs.values())
    assert all(r["work"]["tokens_per_s"] > 0 for r in runs.values())


def test_tokens_alone_give_throughput_and_no_flops_figures():
    cfg = SimConfig(run_id="tokens", ranks=1, steps=3, ops_per_step=20, batch_size=2, peak_tflops=10.0)
    steps, _runs, _raw = _run(cfg)
    for m in steps.values():
        w = m["work"]
        assert w["tokens"] == 1024 and w["flops"] is None and w["flops_source"] is None
        assert w["flops_per_s"] is None and w["mfu"] is None and w["op_categories"] == []


def _messages_of(record) -> list:
    """The raw messages of what ``record(monitor)`` records on a Python Monitor (no broker)."""
    from profstream.processors.stream import RawMessage
    from profstream.producers.monitor import Monitor
    from profstream.producers.sender import Sender
    from tests.helpers import IdleSender

    mon = Monitor(run_id="ops-flops", rank=0, bootstrap="127.0.0.1:1", host_sample_interval_s=0, control=False,
                  native=False, device_interval_ms=0, sender_factory=IdleSender, peak_tflops=100.0,
                  auto_watermark=False)
    sender = Sender(mon)
    record(mon)
    out = []
    while sender._pending or sender._build():
        out.append(RawMessage(0.0, 0, len(out), mon.key, sender._pending.popleft()[0]))
    return out


def test_the_flops_of_a_steps_captured_ops_sent_after_its_mark_are_its_flops_where_it_has_none():
    """A producer that reads the profiler's FLOPs after the step ended (torch.profiler
    with_flops) sends them in a work row: the step's FLOPs, source ops, with their split by
    op category; FLOPs given or counted on the mark win over them."""
    second = 1_000_000_000

    def record(mon):
        for step, counted in ((0, None), (1, 5e12)):
            s = step * second
            mon.begin_step(step, ts_ns=s)
            mon.work(tokens=4096)
            if counted:
                mon.counted_flops(counted)
            mon.end_step(ts_ns=s + second)
            # ops recorded after the step ended: two linears of 100 ms, one conv of 50 ms, an add
            mon.ops(["l1", "l2", "c", "a"], [s, s + 2 * 10**8, s + 4 * 10**8, s + 5 * 10**8],
                    [10**8, 10**8, 5 * 10**7, 10**7], kinds=COMPUTE,
                    op_types=["aten::linear", "aten::linear", "aten::conv2d", "aten::add"], step=step)
            mon.ops_flops(step, 3e12, matmul=2e12, conv=1e12)
            mon.complete_through(step)

    steps = {}
    for f in figures(_messages_of(record)):
        if f.kind == "steps":
            m = decode("StepMetrics", f.value)
            steps[m["step"]] = m["work"]
    w = steps[0]
    assert w["tokens"] == 4096 and w["flops"] == 3e12 and w["flops_source"] == "ops"
    assert w["mfu"] == 3e12 / (1.0 * 100e12)
    cats = {c["category"]: c for c in w["op_categories"]}
    assert cats["matmul"]["time_ns"] == 2 * 10**8 and cats["matmul"]["flops_per_s"] == 2e12 / 0.2
    assert cats["conv"]["flops_per_s"] == 1e12 / 0.05 and "attention" not in cats
    assert steps[1]["flops"] == 5e12 and steps[1]["flops_source"] == "counted" and steps[1]["op_categories"] == []


def test_a_rolling_window_of_work_figures_survives_the_checkpoint_and_a_window_resize():
    window = RollingWindow(5)
    rng = np.random.default_rng(2)
    mfus = []
    for i in range(12):
        mfu = None if i % 4 == 3 else float(rng.random())
        mfus.append(mfu)
        window.add(100 + i, 5, None, None if mfu is None else {"tokens_per_s": 2 * mfu, "samples_per_s": None,
                                                               "mfu": mfu})
    state = window.to_state()
    again = RollingWindow.from_state(5, state)
    assert again.figures() == window.figures()
    last = [m for m in mfus[-5:] if m is not None]
    assert again.figures()["p95_mfu"] == np.percentile(last, 95)
    smaller = RollingWindow.from_state(3, state)  # the window shrank: the last 3 steps kept
    assert smaller.figures()["p50_mfu"] == np.percentile([m for m in mfus[-3:] if m is not None], 50)
    assert again.figures()["p50_samples_per_s"] is None  # no step had it: absent, not 0
    for _ in range(5):  # five steps without work push the last ones out: the figures are absent again
        again.add(1, 0, None)
    assert again.figures()["p50_mfu"] is None and again.to_state()["mfu"] == b""


def test_op_categories_of_torch_ops_and_cuda_kernels():
    cases = {"aten::addmm": "matmul", "MmBackward0": "matmul", "aten::baddbmm": "matmul",
             "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n": "matmul", "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT": "matmul",
             "aten::scaled_dot_product_attention": "attention", "flash_fwd_kernel": "attention",
             "fmha_cutlassF_f32_aligned_64x64_rf_sm80": "attention", "aten::conv2d": "conv",
             "ConvolutionBackward0": "conv", "sm80_xmma_fprop_implicit_gemm_f16f16": "conv",
             "aten::add": None, "aten::embedding": None, "AdamW": None}
    for name, want in cases.items():
        got = op_category(name)
        assert (CATEGORIES[got] if got >= 0 else None) == want, name
