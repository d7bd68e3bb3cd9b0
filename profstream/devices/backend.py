"""What a device counter backend is, what one reading holds, and which backend reads a
producer's devices."""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

NAN = math.nan


class DeviceSample(NamedTuple):
    """One reading of one device's counters; NaN (or -1 for the integers) where the device
    does not report a value. The columns of ``EventBatch.device_samples`` after ts_ns and
    step, in their order (docs/events.md)."""

    device: int  # ordinal as the framework numbers it: N of cuda:N
    gpu_util: float = NAN  # ratio 0..1
    mem_util: float = NAN  # ratio 0..1, memory controller
    mem_used: int = -1  # bytes
    mem_total: int = -1  # bytes
    power_w: float = NAN
    power_limit_w: float = NAN
    temperature_c: float = NAN
    sm_clock_mhz: float = NAN
    throttle_reasons: int = -1  # NVML clock event reasons bit mask
    pcie_rx: float = NAN  # bytes/s
    pcie_tx: float = NAN
    nvlink_rx: float = NAN  # bytes/s, all links
    nvlink_tx: float = NAN


class DeviceLost(RuntimeError):
    """The device stopped answering (fell off the bus: an Xid error); its sampler stops."""


class DeviceUnavailable(RuntimeError):
    """No counters can be read here (no library, no such device); the message says why."""


class DeviceBackend(Protocol):
    """Reads the counters of a fixed set of devices. ``read`` raises DeviceLost when a
    device is gone and nothing else: a value that cannot be read is left empty, and a
    field the device does not have is named once in ``unsupported`` ("cuda:0 nvlink_rx")
    and not asked for again; other failed reads count in ``read_errors``."""

    kind: str  # the device kind it reads: "cuda"
    unsupported: set[str]
    read_errors: int

    def read(self) -> list[DeviceSample]: ...

    def close(self) -> None: ...


# Device kinds with a backend, and the kinds known to have none yet (said so in one line).
NVIDIA_KINDS = ("cuda", "gpu")
NO_BACKEND_YET = {"npu": "no Ascend counter backend yet (docs/monitor.md#ascend maps npu-smi / DCMI fields to ours)"}


def device_ordinals(device: str, counter_devices: str | None) -> tuple[str, list[int]]:
    """(device kind, ordinals to read) for a producer on ``device`` ("cuda:3": cuda, [3];
    "cuda": cuda, [0]); ``counter_devices`` ("0,1") names the ordinals instead."""
    kind, _, index = device.partition(":")
    if counter_devices:
        return kind, [int(i) for i in counter_devices.split(",")]
    return kind, [int(index)] if index.isdigit() else [0]

