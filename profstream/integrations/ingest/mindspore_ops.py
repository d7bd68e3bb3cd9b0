"""The ops of a MindSpore profiler directory, from its per-kernel or per-type statistics.

These files hold totals and counts, no timing. Read, in this order of preference:

- ``aicore_intermediate_<rank>_detail.csv`` (Ascend; ``full_kernel_name`` / ``full_op_name``,
  ``execution_time`` = the average per call in ms, ``execution_frequency`` = calls): one op
  per call, typed by ``framework_raw_<rank>.csv`` (``kernel_type`` / ``op_type`` of the
  full name), else by the name's last scope part;
- ``aicore_intermediate_<rank>_type.csv`` (Ascend; ``op_type`` or ``kernel_type``,
  ``execution_time`` or ``total_time`` in ms, ``execution_frequency``);
- ``gpu_op_type_info_<rank>.csv`` / ``cpu_op_type_info_<rank>.csv`` (``op_type``,
  ``total_time`` / ``total_compute_time``, ``type_occurrences`` / ``op_occurrences``; in
  the unit its header names, ``(ms)`` or ``(us)``, else µs); msprof's
  ``op_statistic_*.csv`` (``OP Type``, ``Count``, ``Total Time(us)``).

Each entry becomes ``count`` ops of total / count each (a count the file lacks: one per
step), spread evenly over the steps in call order and laid end to end from each step's F:
summed over the steps, every type's total and count are the file's exactly.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from profstream.integrations.ingest.model import (
    I64,
    IngestError,
    Profile,
    kind_from_name,
    type_from_name,
)
from profstream.schema.batch import COMMUNICATION, COMPUTE

# file pattern ({rank}), its name columns, total columns, count columns, ns per unit of the total
_DETAIL = ("aicore_intermediate_{rank}_detail.csv", ("full_kernel_name", "full_op_name"), ("execution_time",),
           ("execution_frequency",), 1_000_000)
_BY_TYPE = (("aicore_intermediate_{rank}_type.csv", ("op_type", "kernel_type"), ("execution_time", "total_time"),
             ("execution_frequency",), 1_000_000),
            ("gpu_op_type_info_{rank}.csv", ("op_type",), ("total_time", "op_total_time", "total_compute_time"),
             ("type_occurrences", "op_occurrences", "execution_frequency"), 1000),
            ("cpu_op_type_info_{rank}.csv", ("op_type",), ("total_time", "op_total_time", "total_compute_time"),
             ("type_occurrences", "op_occurrences", "execution_frequency"), 1000),
            ("op_statistic_{rank}*.csv", ("OP Type",), ("Total Time(us)",), ("Count",), 1000))
_FRAMEWORK = ("framework_raw_{rank}.csv",)
_UNIT_SUFFIX = re.compile(r"\((?:ms|us)\)$")


def glob_one(folder: Path, patterns, rank: int) -> Path | None:
    for pattern in patterns:
        found = sorted(folder.glob(pattern.format(rank=rank)))
        if found:
            return found[0]
    return None


def read_op_statistics(profile: Profile, folder: Path, rank: int, read_csv) -> None:
    """Ops of ``rank`` from the best statistics file of ``folder`` (module docstring)."""
    entries = _detail_entries(profile, folder, rank, read_csv)
    if entries is None:
        entries = _type_entries(profile, folder, rank, read_csv)
    if entries is None:
        profile.notes.append("no operator statistics file: steps without ops")
        return
    names, types, totals, counts, path = entries
    _lay_out(profile, names, types, totals, counts)
    profile.notes.append(f"ops from {path.name}: statistics without timing, spread over the {profile.steps} steps "
                         "and laid end to end from F")


def _columns(rows: list[dict], path: Path, names, totals, counts) -> tuple[str, str, str | None]:
    header = {_UNIT_SUFFIX.sub("", c): c for c in (rows[0] if rows else {})}
    name = next((header[c] for c in names if c in header), None)
    total = next((header[c] for c in totals if c in header), None)
    if name is None or total is None:
        raise IngestError(f"{path}: not an operator statistics CSV: expected a column {' or '.join(names)} and "
                          f"{' or '.join(totals)}")
    return name, total, next((header[c] for c in counts if c in header), None)


def _unit_ns(header, total_col: str, default: int) -> int:
    """ns per unit of the total: its own ``(ms)`` / ``(us)``, else that of the file's other
    time columns (MindSpore 2.x's ``total_compute_time`` beside ``avg_time(ms)``), else the
    file family's."""
    for cols in ([total_col], list(header)):
        for col in cols:
            if col.endswith("(ms)"):
                return 1_000_000
            if col.endswith("(us)"):
                return 1000
    return default


def _read_entries(path: Path, spec, read_csv) -> tuple[list[str], list[float], list[int | None]]:
    _, names_c, totals_c, counts_c, default_unit = spec
    rows = read_csv(path, (), "a MindSpore operator statistics CSV")
    name_c, total_c, count_c = _columns(rows, path, names_c, totals_c, counts_c)
    unit = _unit_ns(rows[0], total_c, default_unit)
    names, totals, counts = [], [], []
    for row in rows:
        try:
            total = float(row[total_c]) * unit
            count = int(float(row[count_c])) if count_c else None
        except (ValueError, TypeError):
            continue  # a summary row
        names.append(row[name_c])
        totals.append(total)
        counts.append(count)
    return names, totals, counts


def _detail_entries(profile: Profile, folder: Path, rank: int, read_csv):
    path = glob_one(folder, (_DETAIL[0],), rank)
    if path is None:
        return None
    names, avg, counts = _read_entries(path, _DETAIL, read_csv)
    if any(c is None for c in counts):  # an older file without the calls: the per-type file instead
        return None
    kernel_types = _framework_types(folder, rank, read_csv, profile)
    types = [kernel_types.get(n) or type_from_name(n) for n in names]
    return names, types, [a * c for a, c in zip(avg, counts)], counts, path


def _framework_types(folder: Path, rank: int, read_csv, profile: Profile) -> dict[str, str]:
    path = glob_one(folder, _FRAMEWORK, rank)
    if path is None:
        return {}
    try:
        rows = read_csv(path, (), "a MindSpore framework_raw CSV")
    except IngestError as e:
        profile.notes.append(f"{e}: op types from the names")
        return {}
    out = {}
    for row in rows:
        name = row.get("full_kernel_name") or row.get("full_op_name")
        kind = row.get("kernel_type") or row.get("op_type")
        if name and kind:
            out.setdefault(name, kind)
    return out


def _type_entries(profile: Profile, folder: Path, rank: int, read_csv):
    for spec in _BY_TYPE:
        path = glob_one(folder, (spec[0],), rank)
        if path is not None:
            names, totals, counts = _read_entries(path, spec, read_csv)
            return names, names, totals, counts, path
    return None


def _lay_out(profile: Profile, names: list[str], types: list[str], totals_ns: list[float],
             counts: list[int | None]) -> None:
    n_steps = profile.steps
    k = len(names)
    calls = np.array([c if c is not None else n_steps for c in counts], I64)
    calls = np.where(calls > 0, calls, 0)
    total = np.rint(np.array(totals_ns, np.float64)).astype(I64) if k else np.empty(0, I64)
    entry = np.repeat(np.arange(k), calls)  # one row per call, entries in file order
    nth = np.arange(len(entry)) - np.repeat(np.cumsum(calls) - calls, calls)  # call index within its entry
    per_call = total // np.maximum(calls, 1)
    dur = per_call[entry] + (nth < (total - per_call * calls)[entry])  # the remainder on the first calls
    step_ix = (nth * n_steps) // np.maximum(calls[entry], 1)  # call j of c in step j * n / c
    order = np.lexsort((entry, step_ix))
    entry, dur, step_ix = entry[order], dur[order], step_ix[order]
    ends = np.cumsum(dur)
    first_of_step = np.searchsorted(step_ix, step_ix, side="left")
    offset = ends - dur - (ends - dur)[first_of_step]  # time since the step's first op
    anchor = np.where(profile.step_fp_ns >= 0, profile.step_fp_ns, profile.step_start_ns)
    kinds = np.array([COMMUNICATION if kind_from_name(t) == COMMUNICATION else COMPUTE for t in types] or [0],
                     np.uint8)
    profile.name_table = np.array(names, dtype=object)
    profile.type_table = np.array(types, dtype=object)
    profile.op_name = profile.op_type = entry.astype(np.int32)
    profile.op_kind = kinds[entry]
    profile.op_stream = np.zeros(len(entry), np.int32)
    profile.op_start_ns = anchor[step_ix] + offset if n_steps else np.empty(0, I64)
    profile.op_dur_ns = dur.astype(I64)
