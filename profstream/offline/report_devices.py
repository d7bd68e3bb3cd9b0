"""The report's device counter section: per rank and device, what NVML read during the
run's steps (StepMetrics.devices), the steps with throttled clocks, and two charts.

Empty for runs whose Monitors read no device counters.
"""

from __future__ import annotations

import html
from typing import Any

import numpy as np

from profstream.offline import charts

# (cell metric, header, how it folds the steps' figures, figure field, scale, format)
COLUMNS: tuple[tuple[str, str, str, str, float, str], ...] = (
    ("gpu_util", "GPU util", "mean", "gpu_util", 1.0, "{:.1%}"),
    ("mem_util", "memory util", "mean", "mem_util", 1.0, "{:.1%}"),
    ("mem_used_peak_gib", "memory used, peak (GiB)", "max", "mem_used_peak", 2.0**-30, "{:.2f}"),
    ("power_w", "power, mean (W)", "mean", "power_w", 1.0, "{:.0f}"),
    ("power_peak_w", "power, peak (W)", "max", "power_peak_w", 1.0, "{:.0f}"),
    ("temperature_max_c", "temperature, max (°C)", "max", "temperature_max_c", 1.0, "{:.0f}"),
)


def _fold(how: str, values: list[Any]) -> float:
    known = [v for v in values if v is not None]
    if not known:
        return float("nan")
    return float(np.mean(known) if how == "mean" else np.max(known))


def _ranges(steps: list[int]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in charts.step_ranges(steps)) or "none"


def by_device(steps: list[dict]) -> dict[tuple[int, str], list[tuple[int, dict]]]:
    """(rank, device) -> [(step, DeviceFigures)] in step order."""
    out: dict[tuple[int, str], list[tuple[int, dict]]] = {}
    for s in steps:
        for f in s.get("devices") or ():
            out.setdefault((s["rank"], f["device"]), []).append((s["step"], f))
    return {k: sorted(v, key=lambda x: x[0]) for k, v in sorted(out.items())}


def device_counter_section(steps: list[dict]) -> str:
    """The section's HTML ("" without device figures)."""
    devices = by_device(steps)
    if not devices:
        return ""
    rows = []
    for (rank, device), figs in devices.items():
        cells = [f'<td>rank {rank}</td><td>{html.escape(device)}</td>',
                 f'<td data-metric="counter_steps" data-value="{len(figs)}">{len(figs)}</td>']
        for metric, _, how, key, scale, fmt in COLUMNS:
            v = _fold(how, [f[key] for _, f in figs]) * scale
            cells.append(f'<td data-metric="{metric}" data-value="{v!r}">{"—" if np.isnan(v) else fmt.format(v)}</td>')
        for reason in ("power", "thermal"):
            hot = [step for step, f in figs if f[f"throttled_{reason}"]]
            cells.append(f'<td data-metric="throttled_{reason}_steps" data-value="{len(hot)}" '
                         f'title="steps {_ranges(hot)}">{len(hot)}</td>')
        rows.append(f'<tr data-rank="{rank}" data-device="{html.escape(device)}">{"".join(cells)}</tr>')
    head = "".join(f"<th>{html.escape(h)}</th>" for h in (
        "rank", "device", "steps with samples", *(c[1] for c in COLUMNS), "power-throttled steps",
        "thermal-throttled steps"))
    throttled = sorted({step for figs in devices.values() for step, f in figs
                        if f["throttled_power"] or f["throttled_thermal"]})
    shaded = charts.step_ranges(throttled)

    def series(key: str, scale: float = 1.0) -> list[charts.Series]:
        return [(f"{device} r{rank}", np.array([s for s, _ in figs]),
                 np.array([np.nan if f[key] is None else f[key] * scale for _, f in figs], float))
                for (rank, device), figs in devices.items()]

    return (f'<table id="device-counters"><tr>{head}</tr>{"".join(rows)}</table>'
            '<p class="sub">Read by the Monitor\'s sampler (NVML) during each step: utilization and power are '
            'means over a step\'s samples, memory and temperature the highest; the step counts are steps with a '
            f'sample of clocks held down for that reason (throttled steps: {_ranges(throttled)}).</p>'
            + charts.line_chart("device-util", "GPU utilization per step and device (NVML), throttled steps shaded",
                                series("gpu_util", 100.0), "% of time a kernel ran", shaded=shaded)
            + charts.line_chart("device-temperature", "Highest GPU temperature per step and device",
                                series("temperature_max_c"), "°C", shaded=shaded, y_min=None))

