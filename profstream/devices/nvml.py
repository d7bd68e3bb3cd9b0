"""NVIDIA GPUs through NVML (nvidia-ml-py's ``pynvml``): one backend per producer.

A reading of a device makes eight NVML calls: utilization (GPU and memory controller),
memory info, power draw, enforced power limit, GPU temperature, SM clock, clock event
reasons, and one field-values call for the cumulative PCIe and NVLink byte counters
(turned into bytes/s between readings; the first reading has no rate). A device whose
driver lacks the PCIe counters is asked nvmlDeviceGetPcieThroughput instead (a 20 ms
sample inside the driver, on this thread). A call the device does not support is left
out of every later reading and named once in ``unsupported``; a device that is lost
(NVML_ERROR_GPU_IS_LOST, an Xid) raises DeviceLost.

Ordinals are CUDA's (N of cuda:N): through CUDA_VISIBLE_DEVICES (indices or UUIDs) to
NVML's devices; without it, ordinal N is NVML index N (CUDA_DEVICE_ORDER=PCI_BUS_ID
makes the two orders agree on machines that mix GPU models).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from profstream.devices.backend import DeviceLost, DeviceSample, DeviceUnavailable

log = logging.getLogger("profstream.devices")

# nvml.h values (pynvml has them too; named here so that this module reads alone).
SUCCESS, NOT_SUPPORTED, NO_PERMISSION, NOT_FOUND, FUNCTION_NOT_FOUND = 0, 3, 4, 6, 13
GPU_IS_LOST, RESET_REQUIRED = 15, 16
_ABSENT = (NOT_SUPPORTED, NO_PERMISSION, NOT_FOUND, FUNCTION_NOT_FOUND)
_LOST = (GPU_IS_LOST, RESET_REQUIRED)
TEMPERATURE_GPU, CLOCK_SM = 0, 1
PCIE_TX_THROUGHPUT, PCIE_RX_THROUGHPUT = 0, 1
ALL_LINKS = 0xFFFFFFFF
# field id -> (column, bytes per counter unit): cumulative counters read in one call
COUNTER_FIELDS = {
    197: ("pcie_tx", 1),  # NVML_FI_DEV_PCIE_COUNT_TX_BYTES
    198: ("pcie_rx", 1),  # NVML_FI_DEV_PCIE_COUNT_RX_BYTES
    138: ("nvlink_tx", 1024),  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, KiB, all links
    139: ("nvlink_rx", 1024),  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
}
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")  # by NVML_VALUE_TYPE


def nvml_index_of(ordinal: int, environ: Mapping[str, str]) -> int | str:
    """The NVML index (or UUID prefix) of CUDA ordinal ``ordinal``; DeviceUnavailable
    when CUDA_VISIBLE_DEVICES hides it."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ordinal
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if ordinal >= len(entries):
        raise DeviceUnavailable(f"cuda:{ordinal} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    entry = entries[ordinal]
    return int(entry) if entry.isdigit() else entry


def open_nvml(ordinals: list[int], environ: Mapping[str, str] | None = None) -> NvmlBackend:
    """Initialise NVML and find the devices; DeviceUnavailable (one line) where it cannot."""
    try:
        import pynvml
    except ImportError:
        raise DeviceUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        raise DeviceUnavailable("no NVML library (libnvidia-ml.so.1): no NVIDIA driver on this machine") from None
    except pynvml.NVMLError as e:
        raise DeviceUnavailable(f"NVML does not initialise: {e}") from None
    try:
        environ = os.environ if environ is None else environ
        handles = [(o, _handle(pynvml, o, nvml_index_of(o, environ))) for o in ordinals]
    except BaseException:
        pynvml.nvmlShutdown()
        raise
    return NvmlBackend(pynvml, handles)


def _handle(nvml: Any, ordinal: int, index: int | str) -> Any:
    try:
        if isinstance(index, int):
            return nvml.nvmlDeviceGetHandleByIndex(index)
        for i in range(nvml.nvmlDeviceGetCount()):  # a UUID, or the prefix of one
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            if (uuid.decode() if isinstance(uuid, bytes) else uuid).startswith(index):
                return handle
    except nvml.NVMLError as e:
        raise DeviceUnavailable(f"NVML has no device for cuda:{ordinal} (NVML index {index}): {e}") from None
    raise DeviceUnavailable(f"NVML has no device whose UUID starts with {index!r} (cuda:{ordinal})")


class NvmlBackend:
    """Reads the NVML devices ``handles`` [(ordinal, handle)]; see the module docstring."""

    kind = "cuda"

    def __init__(self, nvml: Any, handles: list[tuple[int, Any]]) -> None:
        self.nvml = nvml
        self.handles = handles
        self.unsupported: set[str] = set()
        self.read_errors = 0
        self._off: set[tuple[int, str]] = set()  # (ordinal, call) the device does not support
        self._counters: dict[tuple[int, int], tuple[int, int]] = {}  # (ordinal, field) -> (value, µs)
        self._warned = False

    def read(self) -> list[DeviceSample]:
        return [self._read(ordinal, handle) for ordinal, handle in self.handles]

    def close(self) -> None:
        self.nvml.nvmlShutdown()

    def _read(self, o: int, h: Any) -> DeviceSample:
        nvml, call = self.nvml, self._call
        util = call(o, ("gpu_util", "mem_util"), nvml.nvmlDeviceGetUtilizationRates, h)
        mem = call(o, ("mem_used", "mem_total"), nvml.nvmlDeviceGetMemoryInfo, h)
        power = call(o, ("power_w",), nvml.nvmlDeviceGetPowerUsage, h)
        limit = call(o, ("power_limit_w",), nvml.nvmlDeviceGetEnforcedPowerLimit, h)
        temperature = call(o, ("temperature_c",), nvml.nvmlDeviceGetTemperature, h, TEMPERATURE_GPU)
        clock = call(o, ("sm_clock_mhz",), nvml.nvmlDeviceGetClockInfo, h, CLOCK_SM)
        reasons = call(o, ("throttle_reasons",), self._clock_reasons, h)
        rates = self._rates(o, h)
        return DeviceSample(
            o,
            util.gpu / 100 if util is not None else math.nan,
            util.memory / 100 if util is not None else math.nan,
            int(mem.used) if mem is not None else -1,
            int(mem.total) if mem is not None else -1,
            power / 1000 if power is not None else math.nan,
            limit / 1000 if limit is not None else math.nan,
            float(temperature) if temperature is not None else math.nan,
            float(clock) if clock is not None else math.nan,
            int(reasons) if reasons is not None else -1,
            rates["pcie_rx"], rates["pcie_tx"], rates["nvlink_rx"], rates["nvlink_tx"],
        )

    def _call(self, o: int, columns: tuple[str, ...], fn: Callable, *args: Any, key: str = "") -> Any:
        """``fn(*args)``, or None where it failed (see the class docstring). ``key`` names
        the call (default: its first column); ``columns``: what it fills."""
        key = key or columns[0]
        if (o, key) in self._off:
            return None
        try:
            return fn(*args)
        except self.nvml.NVMLError as e:
            self._failed(o, key, columns, e.value, str(e))
            return None

    def _failed(self, o: int, key: str, columns: tuple[str, ...], code: int, what: str) -> None:
        if code in _LOST:
            raise DeviceLost(f"NVML lost cuda:{o} ({what}): the GPU fell off the bus or needs a reset (an Xid "
                             "error: see dmesg)")
        if code in _ABSENT:
            self._off.add((o, key))
            self.unsupported.update(f"cuda:{o} {c}" for c in columns)
            log.debug("cuda:%d does not support %s (%s)", o, key, what)
            return
        self.read_errors += 1
        if not self._warned:
            self._warned = True
            log.warning("profstream: reading %s of cuda:%d failed (%s); it is left empty where reads fail, "
                        "counted in Monitor.stats()['device_read_errors']", key, o, what)

    def _clock_reasons(self, h: Any) -> int:
        try:
            return self.nvml.nvmlDeviceGetCurrentClocksEventReasons(h)
        except self.nvml.NVMLError as e:
            if e.value != FUNCTION_NOT_FOUND:
                raise
            return self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)  # drivers before 535

    def _rates(self, o: int, h: Any) -> dict[str, float]:
        """bytes/s of each counter since the previous reading (NaN without one). PCIe
        counters a driver lacks are not named unsupported: the throughput call stands in."""
        rates = dict.fromkeys(("pcie_rx", "pcie_tx", "nvlink_rx", "nvlink_tx"), math.nan)
        fields = [(f, ALL_LINKS) for f in COUNTER_FIELDS if (o, f"field {f}") not in self._off]
        values = self._call(o, ("nvlink_rx", "nvlink_tx"), self.nvml.nvmlDeviceGetFieldValues, h, fields,
                            key="counters") if fields else None
        for v in values or ():
            column, unit = COUNTER_FIELDS[v.fieldId]
            if v.nvmlReturn != SUCCESS:
                self._failed(o, f"field {v.fieldId}", () if column.startswith("pcie") else (column,),
                             v.nvmlReturn, f"field {v.fieldId}: NVML error {v.nvmlReturn}")
                continue
            value = getattr(v.value, _VALUE_MEMBERS[v.valueType]) * unit
            rates[column] = self._rate(o, v.fieldId, value, v.timestamp)
        for field, column, which in ((197, "pcie_tx", PCIE_TX_THROUGHPUT), (198, "pcie_rx", PCIE_RX_THROUGHPUT)):
            if (o, f"field {field}") in self._off or (o, "counters") in self._off:
                kb = self._call(o, (column,), self.nvml.nvmlDeviceGetPcieThroughput, h, which)  # KB/s, 20 ms
                if kb is not None:
                    rates[column] = kb * 1024.0
        return rates

    def _rate(self, o: int, field: int, value: int, ts_us: int) -> float:
        prev = self._counters.get((o, field))
        self._counters[(o, field)] = (value, ts_us)
        if prev is None or ts_us <= prev[1] or value < prev[0]:  # first reading, or the counter wrapped
            return math.nan
        return (value - prev[0]) / ((ts_us - prev[1]) / 1e6)
