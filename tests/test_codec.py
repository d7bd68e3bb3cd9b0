"""The event contract: round trips, fingerprints, shipped versions, and hostile input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastavro.schema import fingerprint, to_parsing_canonical_form
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from profstream import compiled as _compiled
from profstream.schema import (
    COLUMN_FILL,
    CURRENT,
    SECTIONS,
    DecodeError,
    EventBatch,
    codec,
    crc64_avro,
    decode,
    decode_any,
    decode_batch,
    encode,
    encode_batch,
    sparse,
)
from profstream.schema.batch import DEVICE_COLUMNS, LOSS_COLUMNS, STEP_MARK_V1_COLUMNS, WORK_COLUMNS
from profstream.schema.codec import VERSIONS, encode_run_step_metrics, encode_step_metrics

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "eventbatch-v1.bin"
GOLDEN_V2 = Path(__file__).parent / "data" / "eventbatch-v2.bin"  # random_batch(1234, 20), world_size 8
GOLDEN_V3 = Path(__file__).parent / "data" / "eventbatch-v3.bin"  # the same, written by v3
GOLDEN_V4 = DATA / "eventbatch-v4.bin"  # the same with launch times, written by v4
GOLDEN_V6 = DATA / "eventbatch-v6.bin"  # random_batch(1234, 20, losses=False, work=False), world_size 8, by v6


def random_batch(seed: int, n_ops: int = 500, launches: bool = True, devices: bool = True,
                 collectives: bool = True, losses: bool = True, work: bool = True, loader: bool = False) -> EventBatch:
    """A batch of random columns; ``launches``: with ops.launch_ns (v4), ``devices``: with
    device samples (v5), ``collectives``: with collective rows (v6), ``losses``: with step
    marks that lost events and an end signal (v7), ``work``: with the step marks' work (v8),
    ``loader``: with loader samples (v8), each drawn apart so that the other columns are those
    the older golden messages were written from."""
    rng = np.random.default_rng(seed)
    names = [f"op{i}" for i in range(17)]
    types = ["MatMul", "AllReduce", "Copy", "Softmax"]
    queue_names = ["device_queue", "host_queue"]
    b = EventBatch(run_id="run-1", rank=3, host="node7", device="cuda:3", producer_id="p" * 32,
                   seq=41, sent_ns=1_700_000_000_000_000_000, dropped_ops=12, dropped_samples=1,
                   complete_through_step=9, buffer_fill_ratio=0.25, send_latency_ns=1234567,
                   op_names=names, op_types=types, queue_names=queue_names)
    b.ops = {
        "name_idx": rng.integers(0, len(names), n_ops), "type_idx": rng.integers(0, len(types), n_ops),
        "kind": rng.integers(0, 6, n_ops), "stream": rng.integers(0, 8, n_ops),
        "step": rng.integers(0, 10, n_ops), "start_ns": rng.integers(0, 2**62, n_ops),
        "dur_ns": rng.integers(0, 10**9, n_ops),
    }
    if launches:
        b.ops["launch_ns"] = np.random.default_rng([seed, 4]).integers(-1, 2**62, n_ops)
    b.memory = {c: rng.integers(-1, 2**40, 5) for c, _ in SECTIONS["memory"]}
    b.queues = {"name_idx": rng.integers(0, 2, 7), **{c: rng.integers(-1, 2**40, 7)
                                                        for c, _ in SECTIONS["queues"][1:]}}
    b.steps = {c: rng.integers(-1, 2**62, 3) for c, _ in SECTIONS["steps"][:STEP_MARK_V1_COLUMNS]}
    if losses:
        lrng = np.random.default_rng([seed, 7])
        b.steps.update({c: lrng.integers(0, 2**20, 3) for c, _ in LOSS_COLUMNS})
    b.host_samples = {c: (rng.random(4) if d.kind == "f" else rng.integers(0, 2**40, 4))
                      for c, d in SECTIONS["host_samples"]}
    if devices:
        drng = np.random.default_rng([seed, 5])
        b.device_samples = {c: (drng.random(6) if d.kind == "f" else drng.integers(-1, 2**40, 6))
                            for c, d in SECTIONS["device_samples"]}
        b.device_samples["gpu_util"][2] = np.nan  # a value the device does not report
    if work:
        wrng = np.random.default_rng([seed, 9])
        b.steps.update({c: wrng.random(3) * 1e15 if d.kind == "f" else wrng.integers(0, 3 if d.kind == "u" else 2**40, 3)
                        for c, d in WORK_COLUMNS})
        b.steps["flops"][1] = np.nan  # a step without FLOPs
    if loader:  # v8: drawn apart as well
        lrng = np.random.default_rng([seed, 8])
        b.loader_samples = {c: (lrng.random(4) if d.kind == "f" else lrng.integers(-1, 2**30, 4))
                            for c, d in SECTIONS["loader_samples"]}
    if collectives:
        crng = np.random.default_rng([seed, 6])
        b.collective_names = ["all_reduce", "0", "Float", "all_gather"]
        b.collectives = {c: crng.integers(0, len(b.collective_names), 5) if c.endswith("_idx")
                         else crng.integers(-1, 2**40, 5) for c, _ in SECTIONS["collectives"]}
    return b


WORK = {(c, "steps") for c, _ in WORK_COLUMNS}


def assert_same_batch(a: EventBatch, b: EventBatch) -> None:
    for f in ("run_id", "rank", "host", "device", "producer_id", "seq", "sent_ns", "dropped_ops",
              "dropped_samples", "complete_through_step", "buffer_fill_ratio", "send_latency_ns",
              "op_names", "op_types", "queue_names", "collective_names"):
        assert getattr(a, f) == getattr(b, f), f
    for section, cols in SECTIONS.items():
        for col, dtype in cols:
            cols_a = getattr(a, section)
            want = cols_a[col] if col in cols_a else np.full(len(cols_a[cols[0][0]]), COLUMN_FILL[section, col])
            got, want = getattr(b, section)[col], np.asarray(want).astype(dtype)
            assert got.dtype == dtype, (section, col)
            np.testing.assert_array_equal(got, want, err_msg=f"{section}.{col}")  # NaN equals NaN here


@pytest.mark.parametrize("seed", range(5))
def test_every_section_of_a_batch_survives_the_round_trip(seed):
    batch = random_batch(seed)
    assert_same_batch(batch, decode_batch(encode_batch(batch)))


def test_empty_batch_and_absent_watermark_round_trip():
    batch = EventBatch(run_id="r", rank=0)
    back = decode_batch(encode_batch(batch))
    assert back.complete_through_step is None
    assert back.event_count == 0


def test_a_section_whose_columns_differ_in_length_is_refused_even_when_its_first_is_empty():
    batch = EventBatch(run_id="r", rank=0)
    batch.memory = {**batch.memory, "allocated": np.array([1], np.int64)}  # ts_ns, the first column, is empty
    with pytest.raises(ValueError, match="memory.allocated has 1 values, expected 0"):
        encode_batch(batch)


def test_empty_columns_of_any_kind_encode_alike():
    as_lists = EventBatch(run_id="r", rank=0, ops={col: [] for col, _ in SECTIONS["ops"]})
    fresh = EventBatch(run_id="r", rank=0, ops={col: np.zeros(0, dtype) for col, dtype in SECTIONS["ops"]})
    assert encode_batch(as_lists) == encode_batch(fresh) == encode_batch(EventBatch(run_id="r", rank=0))


def test_message_is_avro_single_object_encoding():
    data = encode_batch(random_batch(0, 10, loader=True))
    assert data[:2] == b"\xc3\x01"
    sv = CURRENT["EventBatch"]
    assert int.from_bytes(data[2:10], "little") == sv.fingerprint


@pytest.mark.parametrize("name", sorted(CURRENT))
def test_fingerprints_agree_with_fastavro(name):
    sv = CURRENT[name]
    canonical = to_parsing_canonical_form(sv.parsed)
    # fastavro prints the fingerprint as the 8 little-endian bytes of the spec's number
    assert sv.fingerprint.to_bytes(8, "little").hex() == fingerprint(canonical, "CRC-64-AVRO")
    assert crc64_avro(canonical.encode()) == sv.fingerprint


DEVICE_FIGURES = {"device": "cuda:0", "samples": 2, "gpu_util": 0.9, "mem_util": None, "mem_used_peak": 10,
                  "mem_total": 80, "power_w": 300.5, "power_peak_w": 310.0, "power_limit_w": 700.0,
                  "temperature_max_c": 61.0, "sm_clock_mhz": 1980.0, "throttle_reasons": 4,
                  "throttled_power": True, "throttled_thermal": False, "pcie_rx": 1e9, "pcie_tx": 2e9,
                  "nvlink_rx": None, "nvlink_tx": None}


WORK_FIGURES = {"tokens": 4096, "samples": 8, "flops": 1.2e14, "flops_source": "counted", "peak_flops": 9.89e14,
                "tokens_per_s": 4.096e5, "samples_per_s": 800.0, "flops_per_s": 1.2e16, "mfu": 0.41,
                "op_categories": [{"category": "matmul", "flops": 1.1e14, "time_ns": 8, "flops_per_s": 1.3e22}]}


RESOURCES = {"readings": 1, "cpu_user": 0.4, "cpu_system": 0.05, "cpu_iowait": 0.0, "cpu_idle": 0.55,
             "process_cpu": 1.2, "rss_bytes": 3 << 30, "loader_readings": 2, "workers": 2, "worker_cpu_mean": 0.97,
             "worker_cpu_max": 0.99, "worker_runnable_mean": 0.99, "worker_runnable_max": 1.0, "worker_batches": 4,
             "worker_s_per_batch": 0.5, "worker_cpu_s_per_batch": 0.48, "ctx_switches_per_s": 3000.0, "cpu_count": 8}


def test_processed_records_round_trip():
    step = {
        "run_id": "r", "rank": 1, "world_size": 8, "host": "h", "device": "cpu", "step": 7, "start_ns": 1, "end_ns": 11,
        "step_time_ns": 10, "data_wait_ns": 1, "fp_bp_ns": 8, "tail_ns": 1, "compute_ns": 8, "comm_ns": 2,
        "overlap_ns": 1, "pure_comm_ns": 1, "idle_ns": 1, "utilization": 0.8, "overlap_ratio": 0.5,
        "op_count": 3, "op_types": [{"op_type": "MatMul", "total_ns": 8, "count": 2}],
        "memory": {"peak": 5, "allocated": 4, "reserved": 6},
        "queues": [{"queue": "q", "min": 0, "mean": 1.5, "last": 3, "at_start": 0, "empty_ratio": 0.5}],
        "starved": True, "rolling": None, "closed_by": "watermark", "late_events": 0, "closed_ns": 99,
        "host_step_time_ns": 12, "device_start_ns": 3, "device_end_ns": 13,
        "kernel_types": [{"op_type": "gemm", "total_ns": 7, "count": 1}],
        "device_kinds": [{"kind": "compute", "total_ns": 7, "count": 1}], "uncorrelated_ops": 2,
        "devices": [DEVICE_FIGURES],
        "collectives": {"names": ["all_reduce", "0"], "count": 1, "name_idx": b"\0" * 4, "group_idx": b"\1\0\0\0",
                        "group_size": b"\2\0\0\0", "seq": b"\4" + b"\0" * 7, "bytes": b"\xa0\x0f" + b"\0" * 6,
                        "start_ns": b"\2" + b"\0" * 7, "end_ns": b"\5" + b"\0" * 7},
        "dropped_ops": 3, "dropped_samples": 1,
    }
    assert decode("StepMetrics", encode("StepMetrics", step)) == {**step, "work": None, "resources": None, "advice": []}
    with_work = {**step, "work": WORK_FIGURES,
                 "rolling": {"window": 2, "mean_step_time_ns": 10.0, "p50_step_time_ns": 10.0,
                             "p95_step_time_ns": 10.0, "data_wait_share": 0.1, "mean_utilization": 0.8,
                             "p50_tokens_per_s": 4e5, "p95_tokens_per_s": 4.1e5, "p50_samples_per_s": None,
                             "p95_samples_per_s": None, "p50_mfu": 0.41, "p95_mfu": 0.43}}
    data = encode_step_metrics(with_work)
    assert data[:10] == VERSIONS[("StepMetrics", 8)].header
    assert decode("StepMetrics", data) == {**with_work, "resources": None, "advice": []}
    with_advice = {**with_work, "resources": RESOURCES, "advice": [
        {"rule": "more_workers", "text": "raise num_workers", "source": "MindSpore", "figures": {"workers_busy": 0.97}}]}
    data = encode_step_metrics(with_advice)
    assert data[:10] == VERSIONS[("StepMetrics", 8)].header  # no worker of its own: readers of v8 read it
    assert decode("StepMetrics", data) == {**with_advice, "resources": {**RESOURCES, "per_worker": []}}
    # each worker's figures (v9), one of them without a batch counted: its per-batch figures absent
    per_worker = [{"worker": 0, "readings": 1, "batches": 3, "s_per_batch": 1 / 3, "cpu_s_per_batch": 0.32},
                  {"worker": 1, "readings": 1, "batches": 1, "s_per_batch": 1.0, "cpu_s_per_batch": None},
                  {"worker": 2, "readings": 1, "batches": None, "s_per_batch": None, "cpu_s_per_batch": None}]
    each = {**with_advice, "resources": {**RESOURCES, "per_worker": per_worker}}
    data = encode_step_metrics(each)
    assert data[:10] == VERSIONS[("StepMetrics", 9)].header
    assert decode("StepMetrics", data) == each
    run = {"run_id": "r", "step": 7, "ranks_reported": 2, "min_step_time_ns": 10, "median_step_time_ns": 12.0,
           "max_step_time_ns": 14, "skew": 1 / 3, "straggler_rank": 1, "step_times_ns": {"0": 10, "1": 14},
           "collectives_matched": 1, "late_rank": 1, "late_rank_held_ns": 3,
           "collective_ranks": [{"rank": 0, "wait_ns": 3, "transfer_ns": 1, "slowest_collective": "all_reduce",
                                 "slowest_ns": 4}],
           "by_collective": [{"collective": "all_reduce", "calls": 1, "bytes": 8000, "transfer_ns": 2,
                              "algbw_bytes_per_s": 4e12, "busbw_bytes_per_s": 4e12}],
           "unmatched_collectives": [{"collective": "broadcast", "group": "0", "seq": 5, "arrived": [0],
                                      "missing": [1], "expected": 2}]}
    assert decode("RunStepMetrics", encode("RunStepMetrics", run)) == {**run, "work": None, "clock_offsets": []}
    run_work = {**run, "work": {"ranks": 2, "tokens_per_s": 8e5, "samples_per_s": None, "flops_per_s": 3e14,
                                "mean_mfu": 0.4, "min_mfu": 0.38, "min_mfu_rank": 1, "mfu_ranks": 2}}
    data = encode_run_step_metrics(run_work)
    assert data[:10] == VERSIONS[("RunStepMetrics", 5)].header  # every run step: the per-rank lists as columns
    assert decode("RunStepMetrics", data) == {**run_work, "clock_offsets": []}
    for version in (3, 4):  # what older processors wrote still reads the same
        assert decode("RunStepMetrics", encode("RunStepMetrics", run_work, version)) == decode("RunStepMetrics", data)
    alert = {"name": "DataQueueStall", "state": "firing", "run_id": "r", "rank": 0, "step": 24, "ts_ns": 5,
             "summary": "starved", "evidence": {"data_wait_ns": 3.0}}
    assert decode("Alert", encode("Alert", alert)) == alert


def test_shipped_step_metrics_v2_and_rank_checkpoint_v1_still_decode():
    """StepMetrics v3 and RankCheckpoint v2 added fields: older records read as host
    windows (host step time = step time, no device window, no kernels) and as a rank with
    nothing carried into its next step."""
    m = decode("StepMetrics", (DATA / "stepmetrics-v2.bin").read_bytes())
    assert (m["step"], m["step_time_ns"], m["world_size"]) == (7, 10, 8)
    assert m["host_step_time_ns"] == 10 and m["device_start_ns"] is None and m["device_end_ns"] is None
    assert (m["kernel_types"], m["device_kinds"], m["uncorrelated_ops"]) == ([], [], 0)
    assert m["devices"] == []
    assert decode("StepMetrics", encode("StepMetrics", m)) == m  # re-encoded as the current version
    cp = decode("RankCheckpoint", (DATA / "rankcheckpoint-v1.bin").read_bytes())
    assert (cp["floor"], cp["watermark"], cp["producers"]) == (12, 11, {"p": 5})
    assert cp["device_end_step"] is None and set(cp["carry"].values()) == {b""}
    from profstream.processors.assembler import RankAssembler
    asm = RankAssembler.restore(cp, 2.0, 0, 0.0)
    assert asm.floor == 12 and asm.device_end is None and all(len(a) == 0 for c in asm.carry for a in c)


def test_shipped_v1_message_still_decodes():
    """A message written before world_size existed (schema v1) must decode forever."""
    raw = GOLDEN.read_bytes()
    assert raw[2:10] != CURRENT["EventBatch"].header[2:10]  # it really is an older version
    batch = decode_batch(raw)
    assert_same_batch(random_batch(1234, 20, launches=False, devices=False, collectives=False, losses=False, work=False), batch)
    assert batch.world_size is None
    assert (batch.ops["launch_ns"] == -1).all()


def test_shipped_v2_message_still_decodes():
    """v2 carried op_names as an Avro array of strings; v3 as one blob. Both decode the same."""
    raw = GOLDEN_V2.read_bytes()
    assert raw[2:10] not in (CURRENT["EventBatch"].header[2:10], GOLDEN.read_bytes()[2:10])
    batch = decode_batch(raw)
    assert_same_batch(random_batch(1234, 20, launches=False, devices=False, collectives=False, losses=False, work=False), batch)
    assert batch.world_size == 8
    assert_same_batch(batch, decode_batch(encode_batch(batch)))  # re-encoded as the current version, unchanged


def test_shipped_v3_message_still_decodes_with_no_launch_times():
    """v4 added ops.launch_ns: a v3 message reads as ops without a launch (-1), and a
    batch built without the column (code written for v3) encodes the same way."""
    raw = GOLDEN_V3.read_bytes()
    assert len({raw[2:10], GOLDEN_V2.read_bytes()[2:10], CURRENT["EventBatch"].header[2:10]}) == 3
    batch = decode_batch(raw)
    assert_same_batch(random_batch(1234, 20, launches=False, devices=False, collectives=False, losses=False, work=False), batch)
    assert batch.ops["launch_ns"].tolist() == [-1] * 20
    assert_same_batch(batch, decode_batch(encode_batch(random_batch(1234, 20, launches=False, devices=False, collectives=False, losses=False, work=False))))


def test_shipped_v4_message_still_decodes_with_no_device_samples():
    raw = GOLDEN_V4.read_bytes()
    assert len({raw[2:10], GOLDEN_V3.read_bytes()[2:10], CURRENT["EventBatch"].header[2:10]}) == 3
    batch = decode_batch(raw)
    assert_same_batch(random_batch(1234, 20, devices=False, collectives=False, losses=False, work=False), batch)
    assert batch.n("device_samples") == 0 and batch.world_size == 8 and (batch.ops["launch_ns"] > 0).any()


def test_a_batch_without_device_samples_is_written_as_v4_so_older_processors_read_it():
    batch = random_batch(1234, 20, devices=False, collectives=False, losses=False, work=False)
    batch.world_size = 8
    assert encode_batch(batch) == GOLDEN_V4.read_bytes()  # byte for byte what v4 wrote
    with_devices = random_batch(1234, 20, collectives=False, losses=False, work=False)
    data = encode_batch(with_devices)
    assert data[:10] == VERSIONS[("EventBatch", 5)].header  # v5 readers read it whole
    back = decode_batch(data)
    assert_same_batch(with_devices, back)


def test_shipped_v6_message_still_decodes_with_no_work_and_is_written_again_as_v6():
    raw = GOLDEN_V6.read_bytes()
    assert raw[:10] == VERSIONS[("EventBatch", 6)].header
    batch = decode_batch(raw)
    assert_same_batch(random_batch(1234, 20, losses=False, work=False), batch)  # every v6 column as it was written
    assert batch.steps["tokens"].tolist() == [-1] * 3 and batch.steps["flops_source"].tolist() == [0] * 3
    assert np.isnan(batch.steps["flops"]).all() and np.isnan(batch.steps["peak_flops"]).all()
    assert np.isnan(decode_batch(GOLDEN_V4.read_bytes()).steps["matmul_flops"]).all()
    # its marks carry no work: written as v6 again, which a v6 processor reads whole
    assert encode_batch(batch) == raw


def test_batches_are_v8_with_work_losses_or_loader_readings_and_v4_to_v6_without():
    """v8: a batch whose marks carry work, lost events or a signal, or that has loader
    samples (side batches of their own). Without those, the oldest version that holds the
    batch: v4 (ops and samples alone: the compiled Monitor's plain plan), v5 with device
    samples, v6 with collectives."""
    plain = {"losses": False, "work": False}
    cases = [(random_batch(3, 20, devices=False, collectives=False, losses=False), 8),
             (random_batch(3, 20, devices=False, collectives=False, **plain), 4),
             (EventBatch(run_id="r", rank=0), 4),
             (random_batch(3, 20), 8), (random_batch(3, 20, collectives=False), 8),
             (random_batch(3, 20, work=False), 8),
             (random_batch(3, 20, **plain), 6), (random_batch(3, 20, collectives=False, **plain), 5),
             (random_batch(3, 20, loader=True, **plain), 8),
             (EventBatch(run_id="r", rank=0, loader_samples=random_batch(3, 1, loader=True).loader_samples), 8)]
    for batch, version in cases:
        data = encode_batch(batch)
        assert data[:10] == VERSIONS[("EventBatch", version)].header, version
        assert_same_batch(batch, decode_batch(data))
    back = decode_batch(encode_batch(random_batch(3, 20)))
    assert np.isnan(back.device_samples["gpu_util"][2]) and back.n("device_samples") == 6
    assert np.isnan(back.steps["flops"][1]) and back.steps["tokens"].min() >= 0


def test_only_batches_whose_marks_lost_events_or_name_a_signal_carry_the_loss_columns():
    """The loss columns (dropped_ops, dropped_samples, end_signal: v7, now in v8) go on the
    wire only when a mark holds something there; a batch whose marks lost nothing keeps its
    older version, which processors before v7 read whole; an older message reads with them
    at 0."""
    for collectives, older in ((False, 5), (True, 6)):
        clean = random_batch(4, 20, collectives=collectives, losses=False, work=False)
        assert encode_batch(clean)[:10] == VERSIONS[("EventBatch", older)].header
        lossy = random_batch(4, 20, collectives=collectives, work=False)
        data = encode_batch(lossy)
        assert data[:10] == VERSIONS[("EventBatch", 8)].header
        assert_same_batch(lossy, decode_batch(data))
    old = decode_batch(GOLDEN_V4.read_bytes())
    for col in ("dropped_ops", "dropped_samples", "end_signal"):
        assert (old.steps[col] == 0).all() and len(old.steps[col]) == old.n("steps")


def test_step_metrics_v3_still_decode_and_steps_without_device_figures_are_written_as_v3():
    stored = (DATA / "stepmetrics-v3.bin").read_bytes()
    m = decode("StepMetrics", stored)
    assert m["devices"] == [] and m["kernel_types"] == [{"op_type": "gemm", "total_ns": 7, "count": 1}]
    assert encode_step_metrics(m) == stored  # byte for byte what v3 wrote
    assert encode_step_metrics(m)[:10] == VERSIONS[("StepMetrics", 3)].header
    with_devices = {**m, "devices": [DEVICE_FIGURES]}
    data = encode_step_metrics(with_devices)
    assert data[:10] == VERSIONS[("StepMetrics", 4)].header  # v4 readers read it whole
    assert decode("StepMetrics", data) == with_devices


def test_step_metrics_v6_still_decode_with_no_work_and_steps_without_work_are_written_as_before():
    stored = (DATA / "stepmetrics-v6.bin").read_bytes()
    m = decode("StepMetrics", stored)
    assert m["work"] is None and m["utilization"] is None and m["op_count"] == 0
    assert m["rolling"]["p50_mfu"] is None and m["rolling"]["p95_tokens_per_s"] is None
    assert m["rolling"]["p95_step_time_ns"] == 11.0
    assert encode_step_metrics(m) == stored  # byte for byte what v6 wrote: v6 readers read it whole
    v3 = decode("StepMetrics", (DATA / "stepmetrics-v3.bin").read_bytes())
    assert v3["work"] is None and encode_step_metrics(v3)[:10] == VERSIONS[("StepMetrics", 3)].header


def test_a_rank_checkpoint_v2_restores_a_rolling_window_without_work_figures():
    from profstream.processors.rolling import RollingWindow

    window = RollingWindow(4)
    window.add(10, 1, 0.5)
    state = window.to_state()
    v2 = {"run_id": "r", "rank": 0, "floor": 3, "watermark": 2, "host": "h", "device": "cpu", "producers": {"p": 1},
          "counters": {}, "starved_steps": 0, "stall": {"firing": False, "streak": 0, "streak_start": None,
                                                        "since_step": None},
          "rolling": {k: state[k] for k in ("added", "step_time", "data_wait", "utilization")},
          "carry": {"compute_start": b"", "compute_end": b"", "comm_start": b"", "comm_end": b""},
          "device_end_step": None, "device_end_ns": None}
    cp = decode("RankCheckpoint", encode("RankCheckpoint", v2, version=2))
    assert cp["rolling"]["mfu"] == b"" and cp["rolling"]["tokens_per_s"] == b""
    restored = RollingWindow.from_state(4, cp["rolling"])
    figures = restored.figures()
    assert figures["p50_step_time_ns"] == 10.0 and figures["p50_mfu"] is None and figures["p95_tokens_per_s"] is None


def test_launch_times_round_trip():
    batch = random_batch(8, 30)
    back = decode_batch(encode_batch(batch))
    np.testing.assert_array_equal(back.ops["launch_ns"], batch.ops["launch_ns"])
    assert back.ops["launch_ns"].min() >= -1 and (back.ops["launch_ns"] > 0).any()


def test_op_names_with_any_characters_survive_and_a_nul_cannot_shift_the_dictionary():
    batch = random_batch(5, 50)
    batch.op_names = ["", "Default/net/Conv2D-op1", "ünïcødé ✓", "bad\0name", *[f"n{i}" for i in range(13)]]
    back = decode_batch(encode_batch(batch))
    assert len(back.op_names) == 17
    assert list(back.op_names)[:3] == batch.op_names[:3]
    assert back.op_names[3] == "bad\ufffdname" and back.op_names[16] == "n12"


def test_op_names_blob_without_its_terminator_is_malformed():
    from profstream.schema.codec import encode
    batch = random_batch(6, 10, loader=True)
    record = {f: getattr(batch, f) for f in ("run_id", "rank", "world_size", "host", "device", "producer_id", "seq",
                                             "sent_ns", "dropped_ops", "dropped_samples", "complete_through_step",
                                             "buffer_fill_ratio", "send_latency_ns", "op_types", "queue_names")}
    good = decode_any(encode_batch(batch))[1]
    record.update({s: good[s] for s in SECTIONS}, op_names=b"op0\0op1")
    with pytest.raises(DecodeError) as e:
        decode_batch(encode("EventBatch", record))
    assert e.value.reason == "malformed"


def test_world_size_round_trips_in_the_current_version():
    batch = random_batch(3, 10)
    batch.world_size = 64
    assert decode_batch(encode_batch(batch)).world_size == 64


def test_decode_error_names_the_reason():
    good = encode_batch(random_batch(0, 10))
    with pytest.raises(DecodeError) as e:
        decode_batch(b'{"json": true}')
    assert e.value.reason == "not_avro"
    with pytest.raises(DecodeError) as e:
        decode_batch(good[:6])
    assert e.value.reason == "truncated"
    with pytest.raises(DecodeError) as e:
        decode_batch(good[: len(good) // 2])
    assert e.value.reason == "truncated"
    with pytest.raises(DecodeError) as e:
        decode_batch(b"\xc3\x01" + b"\x00" * 8 + good[10:])
    assert e.value.reason == "unknown_fingerprint"
    with pytest.raises(DecodeError) as e:
        decode_batch(good + b"\x00")
    assert e.value.reason == "malformed"
    with pytest.raises(DecodeError) as e:
        decode_batch(encode("Alert", {"name": "a", "state": "firing", "run_id": "r", "rank": None, "step": 1,
                                      "ts_ns": 1, "summary": "", "evidence": {}}))
    assert e.value.reason == "wrong_type"


def test_dictionary_index_out_of_range_is_malformed():
    batch = random_batch(0, 10)
    batch.ops["name_idx"] = np.full(10, 99)
    with pytest.raises(DecodeError) as e:
        decode_batch(encode_batch(batch))
    assert e.value.reason == "malformed"


_GOOD = [encode_batch(random_batch(s, 50)) for s in range(3)]
_HEADER = _GOOD[0][:10]
_fuzz = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _only_decode_error(data: bytes) -> None:
    try:
        decode_any(data)
    except DecodeError as e:
        assert e.reason in DecodeError.REASONS
        assert "\n" not in str(e)


@_fuzz
@given(st.binary(max_size=2000))
def test_fuzz_random_bytes_raise_only_decode_error(data):
    _only_decode_error(data)


@_fuzz
@given(st.binary(max_size=2000))
def test_fuzz_garbage_behind_a_valid_header_raises_only_decode_error(body):
    _only_decode_error(_HEADER + body)


@_fuzz
@given(st.sampled_from(_GOOD), st.data())
def test_fuzz_truncated_messages_raise_only_decode_error(good, data):
    cut = data.draw(st.integers(0, len(good) - 1))
    with pytest.raises(DecodeError):
        decode_batch(good[:cut])


@_fuzz
@given(st.sampled_from(_GOOD), st.data())
def test_fuzz_corrupted_messages_decode_or_raise_decode_error(good, data):
    raw = bytearray(good)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        decode_batch(bytes(raw))
    except DecodeError as e:
        assert e.reason in DecodeError.REASONS


def _readings(data: bytes) -> tuple:
    """(the compiled reader's record, the Python sparse reader's, each None where it refuses;
    fastavro's record or its DecodeError)."""
    sv = codec.SCHEMAS[int.from_bytes(data[2:10], "little")]

    def read(reader) -> dict | None:
        try:
            record, end = reader(data, 10)
            return record if end == len(data) else None
        except Exception:  # noqa: BLE001 - refused: decode_any reads it with fastavro
            return None

    compiled = read(_COMPILED.setdefault(sv.fingerprint, sparse.compiled_reader(sv.parsed)))
    python = read(_PYTHON.setdefault(sv.fingerprint, sparse.sparse_reader(sv.parsed, compiled=False)))
    try:
        return compiled, python, codec._fastavro_read(data, sv)
    except DecodeError as e:
        return compiled, python, e


_COMPILED: dict = {}
_PYTHON: dict = {}
_SIDE_BATCH = encode_batch(EventBatch(run_id="run-1", rank=3, host="node7", device="cuda:3", producer_id="p.loader",
                                      seq=0, sent_ns=1, loader_samples=random_batch(5, loader=True).loader_samples))
_EVENT_BATCHES = [GOLDEN.read_bytes(), GOLDEN_V2.read_bytes(), GOLDEN_V3.read_bytes(), GOLDEN_V4.read_bytes(),
                  GOLDEN_V6.read_bytes(), encode_batch(EventBatch(run_id="r", rank=0)), _SIDE_BATCH,
                  *(encode_batch(random_batch(s, n, loader=True)) for s, n in ((1, 0), (2, 1), (3, 500)))]


@pytest.mark.skipif(_compiled.pure(), reason="PROFSTREAM_PURE_PROCESSORS=1: the compiled reader is off")
def test_event_batches_are_read_by_the_compiled_reader_where_it_is_built():
    """The processors read EventBatch bodies with the compiled reader (csrc/reader.cpp), built
    with the compiled Monitor; PROFSTREAM_PURE_PROCESSORS=1 or an install without the extension
    reads them in Python."""
    sv = codec.CURRENT["EventBatch"]
    assert sparse.compiled_reader(sv.parsed) is not None, "the compiled Monitor's extension is not built"
    assert type(sv.sparse).__name__ == "builtin_function_or_method"
    assert type(sparse.sparse_reader(sv.parsed, compiled=False)).__name__ == "function"


@pytest.mark.parametrize("i", range(len(_EVENT_BATCHES)))
def test_the_sparse_readers_read_every_event_batch_version_as_fastavro_does(i):
    """EventBatches are read by the compiled reader (or schema/sparse.py's) first: every
    shipped version and every section, full or empty, reads into the very record fastavro
    reads, in both."""
    data = _EVENT_BATCHES[i]
    compiled, python, fastavro = _readings(data)
    assert python is not None and python == fastavro
    assert (compiled is not None and compiled == fastavro) or _compiled.pure()
    assert codec.SCHEMAS[int.from_bytes(data[2:10], "little")].version in {1, 2, 3, 4, 6, 8}


@_fuzz
@given(st.sampled_from(_EVENT_BATCHES), st.data())
def test_fuzz_what_the_sparse_readers_take_fastavro_reads_the_same(good, data):
    """A corrupted body either sparse reader takes is one fastavro reads into the same record
    (any other goes to fastavro, whose DecodeError says why)."""
    raw = bytearray(good)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(10, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(10, len(raw)))
    compiled, python, fastavro = _readings(bytes(raw[:cut]))
    for record in (compiled, python):
        if record is not None:
            assert record == fastavro


def test_a_capture_status_v1_still_decodes_without_a_requester():
    """CaptureStatus v2 (issue 30) adds the authenticated requester and the request's reason:
    a status written before reads with both empty, and v2 round-trips them."""
    import io

    from fastavro import schemaless_writer

    from profstream.control.records import new_request, new_status

    status = new_status({**new_request("r1", reason="why"), "requester": "alice"}, "finished", 3, first_step=1,
                        last_step=2, ops=5)
    assert decode("CaptureStatus", encode("CaptureStatus", status)) == status
    assert (status["requester"], status["request_reason"]) == ("alice", "why")
    v1 = VERSIONS[("CaptureStatus", 1)]
    body = io.BytesIO()
    schemaless_writer(body, v1.parsed, {k: v for k, v in status.items() if k not in ("requester", "request_reason")})
    old = decode("CaptureStatus", v1.header + body.getvalue())
    assert old == {**status, "requester": "", "request_reason": ""}


def _fastavro_bytes(name: str, record: dict, version: int | None) -> bytes:
    """What fastavro writes for ``record`` (the path encode took before the generated writers)."""
    import io

    from fastavro import schemaless_writer

    sv = codec.CURRENT[name] if version is None else VERSIONS[(name, version)]
    missing = codec._WRITE_DEFAULTS.get(name)
    if missing and any(f not in record for f in missing):
        record = {**missing, **record}
    record = dict(record)
    for field, branch in sv.named_unions:
        if type(record.get(field)) is dict:
            record[field] = (branch, record[field])
    out = io.BytesIO()
    out.write(sv.header)
    schemaless_writer(out, sv.parsed, record)
    return out.getvalue()


@pytest.mark.parametrize("options", [
    {},
    {"batch_size": 8, "seq_len": 128, "flops_per_token": 6e9, "peak_tflops": 400.0, "device_counters": True,
     "stall": (3, 6), "resources": True, "loader_fault": "cpu_bound", "straggler_rank": 1},
    {"capture_every_n_steps": 3, "comm_tail": (2, 5), "slowdown": (4, 5)},
])
def test_generated_writers_write_fastavros_bytes(monkeypatch, options):
    """Every record the processors write (StepMetrics of each version, RankCheckpoint, RankEnd,
    Alert, RunStepMetrics, RunCheckpoint, StepPartial) is written byte for byte as fastavro
    writes it."""
    from profstream.kafka.topics import Topics
    from profstream.processors.checkpoint import Record
    from profstream.processors.health import StageCounts
    from profstream.processors.runtime import StepStage
    from profstream.processors.stream import StepFigures, figures
    from profstream.simulate import SimConfig
    from tests.helpers import simulated_messages

    written = []
    real = codec.encode

    def spy(name, record, version=None):
        data = real(name, record, version)
        written.append((name, record, version, data))
        return data

    monkeypatch.setattr(codec, "encode", spy)  # encode_step_metrics, encode_rank_end, ... call it here
    monkeypatch.setattr("profstream.processors.runtime.encode", spy)  # Alerts, checkpoints
    cfg = SimConfig(run_id="w", ranks=3, steps=10, ops_per_step=40, step_time_ms=50.0, seed=3, **options)
    messages = simulated_messages(cfg)
    assert list(figures(messages))
    steps = StepFigures()
    for m in messages[: len(messages) // 2]:
        steps.feed(m)
    for stage, _ in steps._stages.values():  # the rank checkpoints of steps half way
        stage.changed_state()
    live = StepStage(Topics("w"), 3, StageCounts())  # the live stage's StepPartials too
    for m in messages:
        live.fold(Record("w.raw", 0, 0, m.key, m.value), 0.0)
    assert live.ready(0.0)  # its ranks end: their partials go out with their ends
    live.transaction_outputs()
    assert {"StepMetrics", "RankCheckpoint", "RankEnd", "RunStepMetrics", "StepPartial"} <= {
        name for name, *_ in written}
    for name, record, version, data in written:
        assert data == _fastavro_bytes(name, record, version), (name, version)
        sv = codec.CURRENT[name] if version is None else VERSIONS[(name, version)]
        assert sv.header + codec._WRITERS[sv.fingerprint]({**codec._WRITE_DEFAULTS.get(name, {}), **record}) == data
    # a record the generated writer does not take is written by fastavro, as before
    odd = next(dict(record) for name, record, version, _ in written if name == "StepMetrics")
    odd["op_count"] = np.int64(odd["op_count"])
    assert real("StepMetrics", odd) == _fastavro_bytes("StepMetrics", odd, None)


def test_run_checkpoints_carry_clock_offsets_only_once_there_are_some():
    """A run without offsets is checkpointed as RunCheckpoint v1 (an older processor
    restores it whole); with offsets as v2; a v1 checkpoint reads with none."""
    from profstream.schema.codec import encode_run_checkpoint

    plain = {"run_id": "r", "floor": 3, "ranks": [0, 1]}
    data = encode_run_checkpoint({**plain, "clocks": None})
    assert data[:10] == VERSIONS[("RunCheckpoint", 1)].header
    assert decode("RunCheckpoint", data) == {**plain, "clocks": None}
    clocks = {"reference": 0, "at_ns": 10**18, "ranks": [{"rank": 1, "offset_ns": -5_000_000, "lo_ns": -5_400_000,
                                                          "hi_ns": -4_600_000}]}
    data = encode_run_checkpoint({**plain, "clocks": clocks})
    assert data[:10] == VERSIONS[("RunCheckpoint", 2)].header
    assert decode("RunCheckpoint", data) == {**plain, "clocks": clocks}



@pytest.mark.parametrize("ranks, collectives", [(16_384, True), (65_536, False)])
def test_a_run_step_of_many_ranks_fits_one_kafka_message(ranks, collectives):
    """A RunStepMetrics lists every rank's step time (and, with collectives, every rank's wait
    and clock offset): at 16,384 ranks with collectives (waits under a second, offsets under
    a millisecond) and at 65,536 without, it fits the message size every profstream client
    and topic uses (docs/deploy.md, "16,384 ranks and more"), in under two thirds of v4's
    bytes, and reads back whole."""
    from profstream.kafka.limits import MAX_MESSAGE_BYTES
    from profstream.processors.ranks import rank_figures

    times = {r: 3_600_000_000_000 + r for r in range(ranks)}  # an hour a step: 7-byte varints
    record = {"run_id": "r" * 64, "step": 2**40, **rank_figures(times),
              "step_times_ns": {str(r): t for r, t in times.items()}, "collectives_matched": 0,
              "collective_ranks": [], "by_collective": [], "late_rank": None, "late_rank_held_ns": 0,
              "unmatched_collectives": [], "work": None, "clock_offsets": []}
    if collectives:
        record.update(collectives_matched=10**4, late_rank=ranks - 1, late_rank_held_ns=999_999_999,
                      collective_ranks=[{"rank": r, "wait_ns": 999_999_999, "transfer_ns": 999_999_999,
                                         "slowest_collective": "all_reduce", "slowest_ns": 999_999_999}
                                        for r in range(ranks)],
                      clock_offsets=[{"rank": r, "offset_ns": -999_999, "error_ns": 99_999} for r in range(ranks)])
    data = encode_run_step_metrics(record)
    size = len(data)
    assert size <= MAX_MESSAGE_BYTES, f"{size} bytes at {ranks} ranks, over {MAX_MESSAGE_BYTES}"
    # v5's columns: ranks in order a byte each, values as varints; v4 took a record per rank
    assert size < 0.65 * len(encode("RunStepMetrics", record, 4))
    assert decode("RunStepMetrics", data) == record


@pytest.mark.parametrize("section, col", [("host_samples", "cpu_user"), ("host_samples", "ts_ns"),
                                          ("loader_samples", "worker"), ("loader_samples", "cpu_count")])
def test_a_reading_column_of_the_wrong_length_is_malformed_and_named(section, col):
    """The readings are kept as the wire's bytes until a column is read (WireColumns): their
    lengths are still checked when the batch is decoded, and the column is named."""
    record = decode("EventBatch", encode_batch(random_batch(2, 10, loader=True)))
    record[section][col] = record[section][col][:-1]
    with pytest.raises(DecodeError) as e:
        decode_batch(encode("EventBatch", record))
    assert e.value.reason == "malformed" and f"{section}.{col} holds" in str(e.value)


def test_decoded_readings_are_read_only_columns_of_what_was_sent():
    batch = random_batch(4, 10, loader=True, losses=False, work=False)  # v8 marks holding their fill alone
    got = decode_batch(encode_batch(batch))
    for section in ("host_samples", "loader_samples"):
        cols = getattr(got, section)
        assert list(cols) == [c for c, _ in SECTIONS[section]] and len(cols) == len(SECTIONS[section])
        assert "ts_ns" in cols and "nope" not in cols
        for c, dtype in SECTIONS[section]:
            assert cols[c].dtype == dtype and not cols[c].flags.writeable
            np.testing.assert_array_equal(cols[c], np.asarray(getattr(batch, section)[c]).astype(dtype))
        assert {c: v.tolist() for c, v in cols.items()} == {c: v.tolist() for c, v in getattr(batch, section).items()}
    for (section, col), fill in COLUMN_FILL.items():
        if section == "steps":
            assert not got.steps[col].flags.writeable
            np.testing.assert_array_equal(got.steps[col], np.full(3, fill, dict(SECTIONS["steps"])[col]))


@pytest.mark.skipif(_compiled.pure(), reason="PROFSTREAM_PURE_PROCESSORS=1: the compiled reader is off")
def test_the_compiled_reader_gives_each_section_without_rows_a_dict_of_its_own_as_fastavro_reads_it():
    """A v8 batch's sections without rows (its device samples and collectives) are read as a
    copy of one empty dict per section (csrc/reader.cpp): each read is a dict of its own, with
    fastavro's keys in fastavro's order, and a section of no rows whose columns hold bytes all
    the same is read column by column, as fastavro reads it."""
    data = _SIDE_BATCH
    reader = sparse.compiled_reader(codec.SCHEMAS[int.from_bytes(data[2:10], "little")].parsed)
    first, again = reader(data, 10)[0], reader(data, 10)[0]
    fastavro = _readings(data)[2]
    for section in ("device_samples", "collectives", "host_samples"):
        assert first[section] == fastavro[section] and list(first[section]) == list(fastavro[section])
        assert first[section]["count"] == 0 and first[section] is not again[section]
        first[section]["count"] = 7  # a consumer may change what it was given
        assert again[section]["count"] == 0 and reader(data, 10)[0][section]["count"] == 0
    record = {**decode("EventBatch", data), "device_samples": {"count": 0, **{c: b"" for c, _ in DEVICE_COLUMNS}}}
    record["device_samples"]["gpu_util"] = b"\x01" * 8  # no rows, one column not empty (decode_batch refuses it)
    odd = encode("EventBatch", record)
    compiled, _, fastavro = _readings(odd)
    assert compiled == fastavro and compiled["device_samples"]["gpu_util"] == b"\x01" * 8
