"""The exporter's device counter series: ``profstream_device_*{run, rank, host, device}``.

Each device keeps the figures of the latest step that had samples of it (a step shorter
than the sampling interval has none: the series keep their values, as memory_bytes does).
A value no sample reported has no series rather than a 0. At most ``MAX_DEVICES`` devices
per rank get series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

MAX_DEVICES = 16

# metric name without the prefix -> help text
HELP = {
    "device_gpu_utilization_ratio": "share of time a kernel ran on the device (NVML), mean over the latest step "
                                    "with samples of it",
    "device_memory_utilization_ratio": "share of time device memory was read or written, mean over that step",
    "device_memory_used_bytes": "device memory in use (every process on it), highest in that step",
    "device_memory_total_bytes": "device memory",
    "device_power_watts": "power drawn, mean over that step",
    "device_power_peak_watts": "power drawn, highest in that step",
    "device_power_limit_watts": "enforced power limit",
    "device_temperature_celsius": "GPU temperature, highest in that step",
    "device_sm_clock_hertz": "SM clock, mean over that step",
    "device_throttled": "1 when a sample of that step had the clocks held down for power (reason=power: software "
                        "power cap, power brake) or temperature (reason=thermal: thermal or hardware slowdown)",
    "device_pcie_bytes_per_second": "PCIe throughput by direction, mean over that step",
    "device_nvlink_bytes_per_second": "NVLink throughput over all links by direction, mean over that step",
}
# (metric, DeviceFigures field, factor, extra label or None), in HELP's order
SERIES: tuple[tuple[str, str, float, tuple[str, str] | None], ...] = (
    ("device_gpu_utilization_ratio", "gpu_util", 1.0, None),
    ("device_memory_utilization_ratio", "mem_util", 1.0, None),
    ("device_memory_used_bytes", "mem_used_peak", 1.0, None),
    ("device_memory_total_bytes", "mem_total", 1.0, None),
    ("device_power_watts", "power_w", 1.0, None),
    ("device_power_peak_watts", "power_peak_w", 1.0, None),
    ("device_power_limit_watts", "power_limit_w", 1.0, None),
    ("device_temperature_celsius", "temperature_max_c", 1.0, None),
    ("device_sm_clock_hertz", "sm_clock_mhz", 1e6, None),
    ("device_throttled", "throttled_power", 1.0, ("reason", "power")),
    ("device_throttled", "throttled_thermal", 1.0, ("reason", "thermal")),
    ("device_pcie_bytes_per_second", "pcie_rx", 1.0, ("direction", "rx")),
    ("device_pcie_bytes_per_second", "pcie_tx", 1.0, ("direction", "tx")),
    ("device_nvlink_bytes_per_second", "nvlink_rx", 1.0, ("direction", "rx")),
    ("device_nvlink_bytes_per_second", "nvlink_tx", 1.0, ("direction", "tx")),
)


def fold_devices(devices: dict[str, dict], figures: Iterable[dict]) -> int:
    """Keep each device's newest figures; returns how many devices had no room."""
    refused = 0
    for f in figures:
        if f["device"] in devices or len(devices) < MAX_DEVICES:
            devices[f["device"]] = f
        else:
            refused += 1
    return refused


def device_lines(prefix: str, ranks: list[tuple[Any, int, Any]], num: Callable[[float], str]) -> list[str]:
    """The text-format lines of every device series of ``ranks`` [(run, rank, r)], where
    ``r.labels`` holds the rank's escaped labels and ``r.devices`` its devices' figures."""
    out: list[str] = []
    for metric, doc in HELP.items():
        full = prefix + metric
        out.append(f"# HELP {full} {doc}\n# TYPE {full} gauge\n")
        for name, key, factor, extra in SERIES:
            if name != metric:
                continue
            label = f',{extra[0]}="{extra[1]}"' if extra else ""
            for _, _, r in ranks:
                for device, f in r.devices.items():
                    value = f[key]
                    if value is not None:
                        out.append(f'{full}{{{r.labels},device="{_escape(device)}"{label}}} '
                                   f'{num(float(value) * factor)}\n')
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
