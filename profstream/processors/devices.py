"""Device counters of one step: per device, the samples taken during [S, E].

Means and extremes leave out the values a device did not report (NaN, -1); a figure
none of the step's samples has is None. ``throttled_power`` / ``throttled_thermal``: a
sample of the step had a power (software power cap, power brake) or a thermal (software
or hardware thermal slowdown, hardware slowdown) clock event reason.
"""

from __future__ import annotations

import numpy as np

from profstream.processors.model import StepEvents

# NVML clock event reasons (nvmlClocksEventReason*), as in the throttle_reasons column.
SW_POWER_CAP, HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x4, 0x8, 0x20, 0x40, 0x80
POWER_REASONS = SW_POWER_CAP | HW_POWER_BRAKE
THERMAL_REASONS = HW_SLOWDOWN | SW_THERMAL | HW_THERMAL


def device_label(producer_device: str, index: int) -> str:
    """``cuda:3`` for ordinal 3 of a producer on ``cuda:0`` (the kind of its device)."""
    kind = producer_device.split(":", 1)[0] if ":" in producer_device else "device"
    return f"{kind}:{index}"


def _mean(values: np.ndarray) -> float | None:
    known = values[~np.isnan(values)]
    return float(known.mean()) if len(known) else None


def _max(values: np.ndarray) -> float | None:
    known = values[~np.isnan(values)]
    return float(known.max()) if len(known) else None


def _last(values: np.ndarray) -> float | None:
    known = values[~np.isnan(values)]
    return float(known[-1]) if len(known) else None


def _peak_bytes(values: np.ndarray) -> int | None:
    known = values[values >= 0]
    return int(known.max()) if len(known) else None


def device_figures(ev: StepEvents) -> list[dict]:
    """One DeviceFigures record per device with samples in the step, by device ordinal."""
    d = ev.device_samples
    ts = d["ts_ns"]
    if not len(ts):  # no device counters (most steps): none of the ~3 us of numpy calls below
        return []
    inside = (ts >= ev.start_ns) & (ts <= ev.end_ns)
    if not inside.any():
        return []
    out = []
    order = np.argsort(ts, kind="stable")  # _last: the latest sample
    for index in np.unique(d["device"][inside]).tolist():
        sel = order[(inside & (d["device"] == index))[order]]
        col = {name: values[sel] for name, values in d.items()}
        reasons = col["throttle_reasons"][col["throttle_reasons"] >= 0]
        either = int(np.bitwise_or.reduce(reasons)) if len(reasons) else None
        out.append({
            "device": device_label(ev.device, index),
            "samples": len(sel),
            "gpu_util": _mean(col["gpu_util"]),
            "mem_util": _mean(col["mem_util"]),
            "mem_used_peak": _peak_bytes(col["mem_used"]),
            "mem_total": _peak_bytes(col["mem_total"]),
            "power_w": _mean(col["power_w"]),
            "power_peak_w": _max(col["power_w"]),
            "power_limit_w": _last(col["power_limit_w"]),
            "temperature_max_c": _max(col["temperature_c"]),
            "sm_clock_mhz": _mean(col["sm_clock_mhz"]),
            "throttle_reasons": either,
            "throttled_power": bool(either and either & POWER_REASONS),
            "throttled_thermal": bool(either and either & THERMAL_REASONS),
            "pcie_rx": _mean(col["pcie_rx"]),
            "pcie_tx": _mean(col["pcie_tx"]),
            "nvlink_rx": _mean(col["nvlink_rx"]),
            "nvlink_tx": _mean(col["nvlink_tx"]),
        })
    return out
