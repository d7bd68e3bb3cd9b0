"""The unit of a MindSpore step trace (``step_trace_raw_<rank>_detail_time.csv``), from the
profiler's own files.

On Ascend the points are ticks of the device's system counter; GPU and CPU output is in ns.
The counter's frequency, first found wins:

1. msprof's ``info.json.<N>`` under the directory (``PROF_*/device_*/``):
   ``DeviceInfo[0].hwts_frequency`` in MHz;
2. torch_npu / MindSpore 2.x ``profiler_info*.json``: ``start_info.freq`` in MHz;
3. MindSpore 1.x's ``min_cycle_counter_<rank>.txt`` (the first task's counter value) and
   ``output_timeline_data_<rank>.txt`` (the same task's start in ms): their ratio;
4. an Ascend directory (``aicore_intermediate_*``, ``output_timeline_data_*``...) with none
   of these: 100 MHz, the counter of every Ascend 910 / 310 (said in a note).

Otherwise, and for points past 10^17 (ns since the epoch: no counter has ticked that
often since boot), 1 ns per unit.
"""

from __future__ import annotations

import json
from pathlib import Path

_ASCEND_FILES = ("aicore_intermediate_*", "output_timeline_data_*", "ascend_timeline_display_*",
                 "output_format_data_hwts_*", "min_cycle_counter_*", "aicpu_intermediate_*")


def step_trace_unit(folder: Path, rank: int, largest_point: float) -> tuple[float, str]:
    """(ns per step trace unit, how it was found) for ``rank``'s step trace in ``folder``,
    whose largest point is ``largest_point``."""
    if largest_point > 1e17:
        return 1.0, "points in ns since the epoch"
    for find in (_msprof_info, _profiler_info, lambda f: _cycle_ratio(f, rank)):
        found = find(folder)
        if found is not None:
            return found
    if is_ascend_dir(folder):
        return 10.0, "Ascend output without a clock file: its system counter's 100 MHz"
    return 1.0, "GPU/CPU output: ns"


def is_ascend_dir(folder: Path) -> bool:
    """A MindSpore profiler directory written on Ascend (its AI Core / timeline files)."""
    return any(next(folder.glob(pattern), None) for pattern in _ASCEND_FILES)


def _mhz(value) -> float | None:
    try:
        mhz = float(value)
    except (TypeError, ValueError):
        return None
    return mhz if mhz > 0 else None


def _msprof_info(folder: Path) -> tuple[float, str] | None:
    for path in sorted(folder.glob("PROF_*/device_*/info.json.*")) + sorted(folder.glob("info.json.*")):
        if path.suffix == ".done":
            continue
        try:
            devices = json.loads(path.read_bytes()).get("DeviceInfo") or [{}]
            mhz = _mhz(devices[0].get("hwts_frequency"))
        except (OSError, ValueError, AttributeError, IndexError):
            continue
        if mhz is not None:
            return 1000.0 / mhz, f"{path.name}: hwts_frequency {mhz:g} MHz"
    return None


def _profiler_info(folder: Path) -> tuple[float, str] | None:
    for path in sorted(folder.glob("profiler_info*.json")):
        try:
            start = json.loads(path.read_bytes()).get("start_info") or {}
            mhz = _mhz(start.get("freq"))
        except (OSError, ValueError, AttributeError):
            continue
        if mhz is not None:
            return 1000.0 / mhz, f"{path.name}: start_info.freq {mhz:g} MHz"
    return None


def _cycle_ratio(folder: Path, rank: int) -> tuple[float, str] | None:
    counter = folder / f"min_cycle_counter_{rank}.txt"
    timeline = folder / f"output_timeline_data_{rank}.txt"
    try:
        cycles = float(counter.read_text().split()[0])
        with timeline.open() as f:
            next(f)  # the header
            start_ms = min(float(line.split(",")[2]) for line in f if line.strip())
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    if cycles <= 0 or start_ms <= 0:
        return None
    unit = round(start_ms * 1e6 / cycles, 3)
    return unit, f"{counter.name} and {timeline.name}: the first task at {cycles:.0f} ticks and {start_ms:.5f} ms"
