"""Device counter figures of a step (processors/devices.py): the simulator's ground truth,
and what a real device's samples bring (values it does not report, samples outside the
step, several devices, throttling)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from profstream.devices import DeviceSample
from profstream.processors.devices import device_figures, device_label
from profstream.processors.model import StepEvents
from profstream.schema.batch import SECTIONS
from profstream.simulate import SimConfig, StepPlan, plan_run

ORIGIN_NS = 1_700_000_000_000_000_000


def device_columns(rows: list[tuple[int, int, DeviceSample]]) -> dict[str, np.ndarray]:
    """(ts_ns, step, sample) rows as the columns the assembler hands over."""
    spec = SECTIONS["device_samples"]
    return {col: np.array([(ts, step, *s)[i] for ts, step, s in rows], dtype) for i, (col, dtype) in enumerate(spec)}


def step_with(rows: list[tuple[int, int, DeviceSample]], S: int = 1000, E: int = 2000,
              device: str = "cuda:0") -> StepEvents:
    return StepEvents(run_id="r", rank=0, step=0, start_ns=S, end_ns=E, device=device,
                      device_samples=device_columns(rows))


def events_of(plan: StepPlan) -> StepEvents:
    return step_with([(ts, plan.step, s) for ts, s in plan.devices], plan.start_ns, plan.end_ns,
                     f"cuda:{plan.rank}")


@pytest.mark.parametrize("cfg", [SimConfig(seed=4, ranks=2, steps=6, device_counters=True, throttle=(2, 3)),
                                 SimConfig(seed=5, ranks=1, steps=3, device_counters=True)])
def test_device_figures_equal_simulator_truth(cfg: SimConfig) -> None:
    for plan in plan_run(cfg, ORIGIN_NS):
        (figures,) = device_figures(events_of(plan))
        truth = plan.truth["device"]
        assert figures["device"] == f"cuda:{plan.rank}"
        for key, want in truth.items():
            assert figures[key] == pytest.approx(want, rel=1e-12), (plan.rank, plan.step, key)
        throttled = cfg.throttle is not None and cfg.throttle[0] <= plan.step <= cfg.throttle[1]
        assert figures["throttled_thermal"] is throttled and figures["throttled_power"] is False


def test_a_simulation_without_device_counters_has_no_device_figures() -> None:
    plan = next(iter(plan_run(SimConfig(), ORIGIN_NS)))
    assert plan.devices == [] and "device" not in plan.truth
    assert device_figures(StepEvents(run_id="r", rank=0, step=0, start_ns=0, end_ns=10)) == []


def test_only_samples_taken_during_the_step_count_and_unreported_values_are_left_out() -> None:
    nan = math.nan
    rows = [
        (999, 0, DeviceSample(0, gpu_util=0.0, power_w=900.0, temperature_c=99.0)),  # before S
        (1000, 0, DeviceSample(0, gpu_util=0.5, power_w=200.0, mem_used=5, temperature_c=50.0)),
        (1500, 0, DeviceSample(0, gpu_util=nan, power_w=300.0, mem_used=-1, temperature_c=nan)),
        (2000, 0, DeviceSample(0, gpu_util=0.7, power_w=nan, mem_used=7, temperature_c=60.0)),
        (2001, 1, DeviceSample(0, gpu_util=1.0, power_w=900.0, temperature_c=99.0)),  # after E
    ]
    (f,) = device_figures(step_with(rows))
    assert f["samples"] == 3
    assert f["gpu_util"] == pytest.approx(0.6)  # the NaN sample is left out, not counted as 0
    assert (f["power_w"], f["power_peak_w"]) == (pytest.approx(250.0), 300.0)
    assert (f["mem_used_peak"], f["temperature_max_c"]) == (7, 60.0)
    # values no sample reported are None, never 0
    assert f["mem_util"] is None and f["pcie_rx"] is None and f["throttle_reasons"] is None
    assert f["throttled_power"] is False and f["throttled_thermal"] is False


def test_each_device_gets_its_own_figures_and_throttle_reasons_are_ored() -> None:
    rows = [(1100, 0, DeviceSample(0, gpu_util=0.9, throttle_reasons=0x4)),
            (1200, 0, DeviceSample(1, gpu_util=0.1, throttle_reasons=0x1)),  # GPU idle: not throttling
            (1300, 0, DeviceSample(0, gpu_util=0.8, throttle_reasons=0x40)),
            (1400, 0, DeviceSample(1, gpu_util=0.2, throttle_reasons=0))]
    by_device = {f["device"]: f for f in device_figures(step_with(rows, device="cuda:4"))}
    assert sorted(by_device) == ["cuda:0", "cuda:1"]
    assert by_device["cuda:0"]["throttle_reasons"] == 0x44
    assert by_device["cuda:0"]["throttled_power"] and by_device["cuda:0"]["throttled_thermal"]
    assert not (by_device["cuda:1"]["throttled_power"] or by_device["cuda:1"]["throttled_thermal"])
    assert by_device["cuda:1"]["gpu_util"] == pytest.approx(0.15)


def test_the_power_limit_is_the_latest_sample_s_even_when_samples_arrived_out_of_order() -> None:
    rows = [(1800, 0, DeviceSample(0, power_limit_w=500.0)), (1200, 0, DeviceSample(0, power_limit_w=700.0))]
    (f,) = device_figures(step_with(rows))
    assert f["power_limit_w"] == 500.0


def test_device_labels_take_the_kind_of_the_producer_s_device() -> None:
    assert device_label("cuda:3", 1) == "cuda:1"
    assert device_label("npu:0", 2) == "npu:2"
    assert device_label("cpu", 0) == "device:0"
