"""A MindSpore profiler output directory (``<output_path>/profiler`` or the folder above).

- ``step_trace_raw_<rank>_detail_time.csv``: one row per step with start_point, end_point,
  fp_point, bp_point (and iteration_interval = fp - start, fp_and_bp = bp - fp,
  tail = end - bp); the last row (step_num ``-``) holds averages and is skipped. Step
  marks with F and B come from it.
- operator statistics (``aicore_intermediate_<rank>_type.csv``, ``gpu_op_type_info_<rank>.csv``,
  ``cpu_op_type_info_<rank>.csv``, msprof ``op_statistic_*.csv``): totals per op type, no
  timing; each step gets one op per type lasting total / steps, laid end to end from F.
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
from profstream.integrations.ingest.model import (
    I64,
    IngestError,
    Profile,
    kind_from_name,
    relative_base_ns,
    set_steps,
)
from profstream.schema.batch import COMMUNICATION, COMPUTE

EXPECTED = ("a MindSpore profiler output directory holding step_trace_raw_<rank>_detail_time.csv "
            "(columns step_num,start_point,end_point,fp_point,bp_point,...)")
STEP_COLUMNS = ("step_num", "start_point", "end_point", "fp_point", "bp_point")
_STEP_FILE = re.compile(r"^step_trace_raw_(\d+)_detail_time\.csv$")

# statistics file patterns ({rank}) and their columns: type, count, total and the total's unit in ns
_STAT_FILES = ("aicore_intermediate_{rank}_type.csv", "gpu_op_type_info_{rank}.csv",
               "cpu_op_type_info_{rank}.csv", "op_statistic_{rank}*.csv")
_TYPE_COLS = ("op_type", "OP Type")
_COUNT_COLS = ("execution_frequency", "type_occurrences", "op_occurrences", "Count")
_TOTAL_COLS = (("execution_time", 1_000_000), ("total_time", 1000), ("op_total_time", 1000),
               ("total_compute_time", 1000), ("Total Time(us)", 1000))
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


def parse_mindspore_dir(path: Path, rank: int | None = None, unit_ns: float = 1.0,
                        base_ns: int | None = None) -> Profile:
    """Read the step trace, operator statistics and data-queue files of one rank.

    ``unit_ns``: nanoseconds per unit of the step trace (1 for GPU/CPU output in ns; 10 for
    an Ascend system counter at 100 MHz)."""
    folder, files = find_profiler_dir(path)
    ranks = {int(_STEP_FILE.match(p.name).group(1)): p for p in files}
    if rank is None:
        if len(ranks) > 1:
            raise IngestError(f"{folder}: step traces of ranks {sorted(ranks)}: choose one with --rank")
        rank = next(iter(ranks))
    if rank not in ranks:
        raise IngestError(f"{folder}: no step_trace_raw_{rank}_detail_time.csv (ranks here: {sorted(ranks)})")
    profile = Profile(source="mindspore profiler dir", path=folder, rank=rank)
    _read_step_trace(profile, ranks[rank], unit_ns, base_ns)
    _read_op_statistics(profile, folder, rank)
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


def _read_step_trace(profile: Profile, path: Path, unit_ns: float, base_ns: int | None) -> None:
    rows = read_csv(path, STEP_COLUMNS, "a MindSpore step trace CSV")
    steps, points = [], []
    for row in rows:
        if not row["step_num"].isdigit():  # the averages row
            continue
        try:
            points.append([_number(row[c]) for c in STEP_COLUMNS[1:]])
        except ValueError:
            raise IngestError(f"{path}: step {row['step_num']}: a point is not a number: expected "
                              "numbers in start_point,end_point,fp_point,bp_point") from None
        steps.append(int(row["step_num"]))
    if not steps:
        raise IngestError(f"{path}: no step rows: expected {EXPECTED}")
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


def _glob_one(folder: Path, patterns, rank: int):
    for pattern in patterns:
        found = sorted(folder.glob(pattern.format(rank=rank)))
        if found:
            return found[0]
    return None


def _read_op_statistics(profile: Profile, folder: Path, rank: int) -> None:
    path = _glob_one(folder, _STAT_FILES, rank)
    if path is None:
        profile.notes.append("no operator statistics file: steps without ops")
        return
    rows = read_csv(path, (), "a MindSpore operator statistics CSV")
    header = set(rows[0]) if rows else set()
    type_col = next((c for c in _TYPE_COLS if c in header), None)
    total = next(((c, unit) for c, unit in _TOTAL_COLS if c in header), None)
    if type_col is None or total is None:
        raise IngestError(f"{path}: not an operator statistics CSV: expected a column op_type and one of "
                          f"{', '.join(c for c, _ in _TOTAL_COLS)}")
    types, totals = [], []
    for row in rows:
        try:
            totals.append(float(row[total[0]]) * total[1])
        except ValueError:
            continue  # a summary row
        types.append(row[type_col])
    n_steps = profile.steps
    per_step = np.rint(np.array(totals, np.float64) / max(n_steps, 1)).astype(I64)
    kinds = np.array([COMMUNICATION if kind_from_name(t) == COMMUNICATION else COMPUTE for t in types], np.uint8)
    # one op per type per step, end to end from F (S when the step has no F)
    anchor = np.where(profile.step_fp_ns >= 0, profile.step_fp_ns, profile.step_start_ns)
    offsets = np.concatenate(([0], np.cumsum(per_step)[:-1])) if len(per_step) else per_step
    k = len(types)
    profile.name_table = profile.type_table = np.array(types, dtype=object)
    profile.op_name = profile.op_type = np.tile(np.arange(k, dtype=np.int32), n_steps)
    profile.op_kind = np.tile(kinds, n_steps)
    profile.op_stream = np.zeros(k * n_steps, np.int32)
    profile.op_start_ns = (anchor[:, None] + offsets[None, :]).ravel()
    profile.op_dur_ns = np.tile(per_step, n_steps)
    profile.notes.append(f"ops from {path.name}: per-type totals / {n_steps} steps, laid end to end from F")


def _read_queues(profile: Profile, folder: Path, rank: int) -> None:
    start_of = dict(zip(profile.step.tolist(), profile.step_start_ns.tolist()))
    for pattern, queue in _QUEUE_FILES:
        path = _glob_one(folder, (pattern,), rank)
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
