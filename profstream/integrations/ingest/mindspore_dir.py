"""A MindSpore profiler output directory (``<output_path>/profiler`` or the folder above).

- ``step_trace_raw_<rank>_detail_time.csv``: one row per step with start_point, end_point,
  fp_point, bp_point (and iteration_interval = fp - start, fp_and_bp = bp - fp,
  tail = end - bp); the last row (step_num ``-``, or ``0`` with zero points in older
  versions) holds averages and is skipped. Step
  marks with F and B come from it.
  Points are in the profiler's clock units (``step_clock``).
- operator statistics (``mindspore_ops``): per kernel or per type totals and counts, no
  timing, spread over the steps and laid end to end from F.
- ``device_queue_profiling_<rank>.txt`` / ``dataset_iterator_profiling_<rank>.txt``: lines
  ``type extra batch value timestamp``; type 1 is a queue size (extra: capacity) taken
  when the device got batch ``batch``, recorded at the start of that step.
- ``communication_<rank>.json`` (or ``communication.json`` where the directory holds one
  rank): HCCL communication ops as collective calls (``hccl``).
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np

from profstream.integrations.ingest.hccl import find_communication_file, read_communication
from profstream.integrations.ingest.mindspore_ops import glob_one, read_op_statistics
from profstream.integrations.ingest.model import (
    I64,
    IngestError,
    Profile,
    relative_base_ns,
    set_steps,
)
from profstream.integrations.ingest.step_clock import is_ascend_dir, step_trace_unit

EXPECTED = ("a MindSpore profiler output directory holding step_trace_raw_<rank>_detail_time.csv "
            "(columns step_num,start_point,end_point,fp_point,bp_point,...)")
STEP_COLUMNS = ("step_num", "start_point", "end_point", "fp_point", "bp_point")
_STEP_FILE = re.compile(r"^step_trace_raw_(\d+)_detail_time\.csv$")

_QUEUE_FILES = (("device_queue_profiling_{rank}.txt", "device_queue"),
                ("dataset_iterator_profiling_{rank}.txt", "dataset_iterator"))


def find_profiler_dir(path: Path) -> tuple[Path, list[Path]]:
    """The directory holding the step trace files (``path`` or ``path/profiler``) and those files."""
    for folder in (path, path / "profiler"):
        files = sorted(p for p in folder.glob("step_trace_raw_*_detail_time.csv") if _STEP_FILE.match(p.name))
        if files:
            return folder, files
    raise IngestError(f"{path}: no step_trace_raw_<rank>_detail_time.csv here or in {path / 'profiler'}: "
                      f"expected {EXPECTED}")


def rank_of(step_trace_file: Path) -> int:
    """The rank a ``step_trace_raw_<rank>_detail_time.csv`` belongs to."""
    return int(_STEP_FILE.match(step_trace_file.name).group(1))


def parse_mindspore_dir(path: Path, rank: int | None = None, unit_ns: float | None = None,
                        base_ns: int | None = None) -> Profile:
    """Read the step trace, operator statistics and data-queue files of one rank.

    ``unit_ns``: nanoseconds per unit of the step trace; None: from the profiler's own files
    (``step_clock``: 10 for Ascend's 100 MHz system counter, 1 for GPU/CPU output in ns)."""
    folder, files = find_profiler_dir(path)
    ranks = {int(_STEP_FILE.match(p.name).group(1)): p for p in files}
    if rank is None:
        if len(ranks) > 1:
            raise IngestError(f"{folder}: step traces of ranks {sorted(ranks)}: choose one with --rank")
        rank = next(iter(ranks))
    if rank not in ranks:
        raise IngestError(f"{folder}: no step_trace_raw_{rank}_detail_time.csv (ranks here: {sorted(ranks)})")
    profile = Profile(source="mindspore profiler dir", path=folder, rank=rank,
                      device="npu" if is_ascend_dir(folder) else "")
    _read_step_trace(profile, ranks[rank], folder, unit_ns, base_ns)
    read_op_statistics(profile, folder, rank, read_csv)
    _read_queues(profile, folder, rank)
    communication = find_communication_file(folder, rank, len(ranks))
    if communication is not None:
        read_communication(profile, communication)
    profile.assign_steps()
    return profile


def read_csv(path: Path, required: tuple[str, ...], what: str) -> list[dict[str, str]]:
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in reader.fieldnames or ()]
            missing = [c for c in required if c not in header]
            if missing:
                raise IngestError(f"{path}: not {what}: no column {', '.join(missing)} "
                                  f"(expected columns {','.join(required)})")
            return [{k.strip(): (v or "").strip() for k, v in row.items() if k} for row in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise IngestError(f"{path}: unreadable ({e}): expected {what}") from None


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def _read_step_trace(profile: Profile, path: Path, folder: Path, unit_ns: float | None, base_ns: int | None) -> None:
    rows = read_csv(path, STEP_COLUMNS, "a MindSpore step trace CSV")
    steps, points = [], []
    for row in rows:
        if not row["step_num"].isdigit() or int(row["step_num"]) < 1:  # the averages row ("-", or 0 in older files)
            continue
        try:
            point = [_number(row[c]) for c in STEP_COLUMNS[1:]]
        except ValueError:
            raise IngestError(f"{path}: step {row['step_num']}: a point is not a number: expected "
                              "numbers in start_point,end_point,fp_point,bp_point") from None
        if not any(point):
            continue
        points.append(point)
        steps.append(int(row["step_num"]))
    if not steps:
        raise IngestError(f"{path}: no step rows: expected {EXPECTED}")
    if unit_ns is None:
        unit_ns, how = step_trace_unit(folder, profile.rank, max(max(p) for p in points))
        profile.notes.append(f"step trace unit: {unit_ns:g} ns ({how})")
    if float(unit_ns).is_integer():  # exact: ns since the epoch do not fit a float64
        ns = np.array([[int(v * int(unit_ns)) if isinstance(v, int) else round(v * unit_ns) for v in p]
                       for p in points], I64)
    else:
        ns = np.array([[round(v * unit_ns) for v in p] for p in points], I64)
    if base_ns is not None:
        base, profile.clock = base_ns, f"step trace points x {unit_ns} ns + --base-ns {base_ns}"
    elif int(ns.max()) > 10**18:
        base, profile.clock = 0, f"absolute (step trace points x {unit_ns} ns since the epoch)"
    else:
        base = relative_base_ns(path, int(ns[:, 1].max()))
        profile.clock = "relative step trace: its last step ends at the file's modification time"
    ns += base
    set_steps(profile, steps, ns[:, 0], ns[:, 1], ns[:, 2], ns[:, 3])


def _read_queues(profile: Profile, folder: Path, rank: int) -> None:
    start_of = dict(zip(profile.step.tolist(), profile.step_start_ns.tolist()))
    for pattern, queue in _QUEUE_FILES:
        path = glob_one(folder, (pattern,), rank)
        if path is None:
            continue
        outside = 0
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise IngestError(f"{path}: unreadable ({e}): expected lines 'type extra batch value timestamp'") \
                from None
        for number, line in enumerate(lines, 1):
            fields = line.split()
            if not fields:
                continue
            try:
                kind, extra, batch, value = (int(x) for x in fields[:4])
            except ValueError:
                raise IngestError(f"{path}:{number}: expected 'type extra batch value timestamp' "
                                  f"(integers), got {line[:60]!r}") from None
            if kind != 1:  # 0: timings
                continue
            ts = start_of.get(batch)
            if ts is None:
                outside += 1
                continue
            profile.queue_samples.append((queue, ts, batch, value, extra))
        if outside:
            profile.notes.append(f"{path.name}: {outside} queue samples of batches without a step")
