"""Ascend profiler folders as their profilers write them, one rank each: their trace read by
``chrome`` (and ``ascend``), their rank, device, clock and op types from the profiler's own
info files.

- ``read_ascend_output``: a torch_npu ``*_ascend_pt`` or MindSpore 2.x ``*_ascend_ms``
  folder (or its ``ASCEND_PROFILER_OUTPUT``): ``ASCEND_PROFILER_OUTPUT/trace_view.json``
  (timestamps in epoch µs); the rank from ``profiler_info_<rank>.json`` (``rank_id``); op
  types from ``kernel_details.csv`` (``Name`` -> ``Type``, where it is not ``N/A``); HCCL
  calls from ``communication.json`` (``hccl``). ``step_trace_time.csv``,
  ``op_statistic.csv`` and the trace's Overlap Analysis tracks are the profiler's own
  results and are not read.
- ``read_msprof``: one device of an msprof ``PROF_*`` directory (``device_<N>``): the
  timeline files msprof exported, ``timeline/msprof_<N>_<model>_<iteration>.json`` (one
  per iteration, on the device's monotonic clock in µs) or
  ``mindstudio_profiler_output/msprof_*.json`` (newer CANN, epoch µs); the rank from
  ``info.json.<N>`` (``rank_id``), else N; the clock from ``start_info.<N>``:
  ``collectionTimeBegin`` (epoch µs) taken at ``clockMonotonicRaw`` (ns).
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from profstream.integrations.ingest.ascend import apply_types
from profstream.integrations.ingest.chrome import parse_chrome, parse_chrome_files
from profstream.integrations.ingest.hccl import read_communication
from profstream.integrations.ingest.model import IngestError, Profile

PROFILER_OUTPUT = "ASCEND_PROFILER_OUTPUT"
EXPECTED_OUTPUT = ("a torch_npu or MindSpore profiler folder (*_ascend_pt / *_ascend_ms holding "
                   "ASCEND_PROFILER_OUTPUT/trace_view.json)")
EXPECTED_MSPROF = ("an msprof device folder (PROF_*/device_<N> with exported timeline/msprof_*.json, or "
                   "PROF_*/mindstudio_profiler_output/msprof_*.json): run `msprof --export=on` on raw data")
_DEVICE = re.compile(r"^device_(\d+)$")
_ITERATION_FILE = re.compile(r"^msprof_(\d+)_(\d+)_(\d+)\.json(\.gz)?$")
_TIMELINE_PARTS = ("task_time_*.json", "hccl_*.json", "step_trace_*.json")


def is_ascend_output(folder: Path) -> bool:
    return (folder / PROFILER_OUTPUT).is_dir() or (folder.name == PROFILER_OUTPUT and folder.is_dir())


def read_ascend_output(folder: Path, base_ns: int | None = None, workers: int | None = None) -> Profile:
    """One rank's ``*_ascend_pt`` / ``*_ascend_ms`` folder (see the module docstring)."""
    root = folder.parent if folder.name == PROFILER_OUTPUT else folder
    out = root / PROFILER_OUTPUT
    trace = next((p for p in (out / "trace_view.json", out / "trace_view.json.gz") if p.is_file()), None)
    if trace is None:
        raise IngestError(f"{out}: no trace_view.json: expected {EXPECTED_OUTPUT}")
    profile = parse_chrome(trace, base_ns=base_ns, workers=workers)
    _read_profiler_info(profile, root)
    _read_kernel_types(profile, out / "kernel_details.csv")
    if (out / "communication.json").is_file():
        read_communication(profile, out / "communication.json")
    profile.assign_steps()
    return profile


def _read_profiler_info(profile: Profile, root: Path) -> None:
    found = sorted(root.glob("profiler_info*.json"))
    if not found:
        profile.notes.append(f"{root}: no profiler_info*.json: the rank is taken from the order given")
        return
    try:
        info = json.loads(found[0].read_bytes())
        rank = info.get("rank_id")
    except (OSError, ValueError, AttributeError) as e:
        profile.notes.append(f"{found[0]}: not read ({str(e)[:80]}): the rank is taken from the order given")
        return
    if type(rank) is int and rank >= 0:
        profile.rank = rank
    elif (m := re.search(r"_(\d+)\.json$", found[0].name)) is not None:
        profile.rank = int(m.group(1))


def _read_kernel_types(profile: Profile, path: Path) -> None:
    """Op types from the profiler's own ``Type`` column (the op_statistic's grouping)."""
    if not path.is_file():
        profile.notes.append(f"{path}: missing: op types are the kernel names")
        return
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        profile.notes.append(f"{path}: not read ({e}): op types are the kernel names")
        return
    types: dict[str, str] = {}
    for row in rows:
        name, kind = (row.get("Name") or "").strip(), (row.get("Type") or "").strip()
        if name and kind and kind != "N/A":
            types.setdefault(name, kind)
        device = (row.get("Device_id") or "").strip()
        if device.isdigit():
            profile.device = f"npu:{device}"
    if not types:
        profile.notes.append(f"{path}: no op types (Type is N/A at profiler level 0): op types are the kernel names")
        return
    apply_types(profile, types)


def device_id(folder: Path) -> int | None:
    m = _DEVICE.match(folder.name)
    return int(m.group(1)) if m else None


def msprof_files(device: Path) -> list[Path]:
    """The exported timeline files of one msprof device folder, in iteration order."""
    timeline = device / "timeline"
    per_iteration = [p for p in timeline.glob("msprof_*.json*") if _ITERATION_FILE.match(p.name)]
    if per_iteration:
        return sorted(per_iteration, key=lambda p: tuple(int(g) for g in _ITERATION_FILE.match(p.name).groups()[:3]))
    parts = sorted(p for pattern in _TIMELINE_PARTS for p in timeline.glob(pattern))
    if parts:
        return parts
    return sorted((device.parent / "mindstudio_profiler_output").glob("msprof*.json"))


def read_msprof(device: Path, files: list[Path] | None = None, base_ns: int | None = None) -> Profile:
    """One msprof device (see the module docstring); ``files``: some of its timeline files only."""
    files = msprof_files(device) if files is None else files
    if not files:
        raise IngestError(f"{device}: no exported timeline: expected {EXPECTED_MSPROF}")
    n = device_id(device)
    notes = []
    monotonic = files[0].parent.name == "timeline"
    if base_ns is None and monotonic:
        base_ns, clock = _monotonic_base(device, n, notes)
    profile = parse_chrome_files(files, device, base_ns)
    if monotonic and base_ns is not None and not notes:
        profile.clock = clock
    profile.notes += notes
    profile.source = "msprof timeline"
    profile.rank = _msprof_rank(device, n, profile)
    profile.device = f"npu:{n}" if n is not None else "npu"
    if len(files) > 1:
        profile.notes.append(f"{len(files)} timeline files of {device.name} read as one rank")
    return profile


def _monotonic_base(device: Path, n: int | None, notes: list[str]) -> tuple[int | None, str]:
    """ns to add to the monotonic clock of a device's timeline: from ``start_info.<N>``."""
    path = device / (f"start_info.{n}" if n is not None else "start_info")
    try:
        info = json.loads(path.read_bytes())
        begin_us, monotonic_ns = int(info["collectionTimeBegin"]), int(info["clockMonotonicRaw"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        notes.append(f"{path}: not read ({str(e)[:60]}): the clock is the file's modification time instead")
        return None, ""
    return begin_us * 1000 - monotonic_ns, f"device monotonic clock + {path.name} (collectionTimeBegin at clockMonotonicRaw)"


def _msprof_rank(device: Path, n: int | None, profile: Profile) -> int | None:
    path = device / (f"info.json.{n}" if n is not None else "info.json")
    try:
        rank = json.loads(path.read_bytes()).get("rank_id")
    except (OSError, ValueError, AttributeError):
        rank = None
    return rank if type(rank) is int and rank >= 0 else n
