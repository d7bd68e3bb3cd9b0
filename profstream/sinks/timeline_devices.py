"""The device counter tracks of a step in the timeline files: one counter event per device
reading, ``<device> <counter>`` (``cuda:0 power``), with the values the device reported.

A value the device did not report (NaN, -1) is left out of its event; an event with no
value left is not written.
"""

from __future__ import annotations

import math

from profstream.processors.devices import POWER_REASONS, THERMAL_REASONS, device_label
from profstream.processors.model import StepEvents

# track -> ((arg name, column, factor), ...)
TRACKS: dict[str, tuple[tuple[str, str, float], ...]] = {
    "utilization": (("gpu %", "gpu_util", 100.0), ("memory %", "mem_util", 100.0)),
    "power": (("watts", "power_w", 1.0),),
    "temperature": (("celsius", "temperature_c", 1.0),),
    "SM clock": (("MHz", "sm_clock_mhz", 1.0),),
    "memory used": (("bytes", "mem_used", 1.0),),
    "PCIe": (("rx bytes/s", "pcie_rx", 1.0), ("tx bytes/s", "pcie_tx", 1.0)),
    "NVLink": (("rx bytes/s", "nvlink_rx", 1.0), ("tx bytes/s", "nvlink_tx", 1.0)),
}


def _known(value: float | int) -> bool:
    return not (isinstance(value, float) and math.isnan(value)) and value != -1


def device_counter_events(ev: StepEvents, pid: int) -> list[tuple[dict, int]]:
    """(counter event without ts, ts_ns) for every device reading of ``ev``."""
    d = ev.device_samples
    if not len(d["ts_ns"]):
        return []
    cols = {name: values.tolist() for name, values in d.items()}
    out: list[tuple[dict, int]] = []
    for i, ts in enumerate(cols["ts_ns"]):
        device = device_label(ev.device, cols["device"][i])
        for track, spec in TRACKS.items():
            args = {arg: (v * factor if factor != 1.0 else v) for arg, col, factor in spec
                    if _known(v := cols[col][i])}
            if args:
                out.append(({"ph": "C", "name": f"{device} {track}", "pid": pid, "args": args}, ts))
        reasons = cols["throttle_reasons"][i]
        if reasons >= 0:
            out.append(({"ph": "C", "name": f"{device} throttled", "pid": pid,
                         "args": {"power": int(bool(reasons & POWER_REASONS)),
                                  "thermal": int(bool(reasons & THERMAL_REASONS))}}, ts))
    return out
