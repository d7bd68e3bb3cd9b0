"""Operator cost per op type: summed duration and count, top K by time plus "other";
and the device's time by kind (compute, communication, memcpy, memset).

On a host window (``window.py``) an op belongs to the step when its start lies in
[S, E). On a device window the step's device ops (its kernels, copies and sets, whole)
are listed apart from its host ops (runtime calls, CPU ops, annotations), so that the
kernel breakdown a GPU user reads first is not mixed with the host's.
"""

from __future__ import annotations

import numpy as np

from profstream import compiled
from profstream.processors.model import StepEvents
from profstream.processors.window import DEVICE_KINDS, Window, device_ops, step_window
from profstream.schema.batch import KIND_NAMES

OTHER = "other"


_NAME_ARRAYS: dict[int, tuple[list[str], int, np.ndarray]] = {}  # id(type_names) -> (it, its length, array)


def _names_array(names: list[str]) -> np.ndarray:
    """``np.array(names, dtype=str)`` of a rank's op types (its assembler's growing
    ``type_names``), kept until the list grows (built once per step, it cost ~10 us)."""
    held = _NAME_ARRAYS.get(id(names))
    if held is not None and held[0] is names and held[1] == len(names):
        return held[2]
    if len(_NAME_ARRAYS) >= 4096:
        _NAME_ARRAYS.clear()
    array = np.array(names, dtype=str)
    _NAME_ARRAYS[id(names)] = (names, len(names), array)
    return array


def _costs(ev: StepEvents, sel: np.ndarray, top_k: int) -> list[dict[str, int | str]]:
    if top_k < 0:
        raise ValueError("top_k must be >= 0")
    codes = ev.op_type[sel]
    n_types = len(ev.type_names)
    totals = np.bincount(codes, weights=ev.op_dur_ns[sel], minlength=n_types)
    counts = np.bincount(codes, minlength=n_types)
    present = np.flatnonzero(counts)
    names = _names_array(ev.type_names)[present]
    # bincount weights are float64: exact for sums below 2**53 ns (104 days).
    totals = totals[present].astype(np.int64)
    counts = counts[present]
    order = np.lexsort((names, -totals))
    top, rest = order[:top_k], order[top_k:]
    costs: list[dict[str, int | str]] = [
        {"op_type": str(names[i]), "total_ns": int(totals[i]), "count": int(counts[i])}
        for i in top
    ]
    if len(rest):
        costs.append({"op_type": OTHER, "total_ns": int(totals[rest].sum()),
                      "count": int(counts[rest].sum())})
    return costs


def _in_host_step(ev: StepEvents) -> np.ndarray:
    return (ev.op_start_ns >= ev.start_ns) & (ev.op_start_ns < ev.end_ns)


def op_type_costs(ev: StepEvents, top_k: int = 10, window: Window | None = None) -> list[dict[str, int | str]]:
    """``[{op_type, total_ns, count}]`` of the step, most expensive first.

    An op belongs to the step when its start lies in [S, E); it counts with its own full
    ``dur_ns`` (not clipped), so the figures are the profiler's op durations. On a device
    window only host ops are listed here (the device's in ``kernel_type_costs``). The
    ``top_k`` types with the largest total (ties: by name) are listed; the rest, if any,
    are summed into one entry named "other".
    """
    device = (window or step_window(ev)).device
    if not device and compiled.NATIVE is not None:
        sums = compiled.NATIVE.sums_by_code(ev.op_type, ev.op_start_ns, ev.op_dur_ns, ev.start_ns, ev.end_ns)
        if sums is not None:
            return _compiled_costs(ev, sums, top_k)
    sel = _in_host_step(ev)
    if device:
        sel &= ~device_ops(ev)
    return _costs(ev, sel, top_k)


def _compiled_costs(ev: StepEvents, sums: list[tuple[int, int, int]], top_k: int) -> list[dict[str, int | str]]:
    """``_costs`` of the kernel's (type code, total, count) sums, in code order: the same
    list (sorted by total, then name; the sort is stable as ``np.lexsort``)."""
    if top_k < 0:
        raise ValueError("top_k must be >= 0")
    names = ev.type_names
    # by total, then name, then code (the sums' order: what the stable sort kept), with no key function
    rows = [(name, -negated, count) for negated, name, _, count in
            sorted([(-total, names[code], code, count) for code, total, count in sums])]
    costs: list[dict[str, int | str]] = [{"op_type": name, "total_ns": total, "count": count}
                                         for name, total, count in rows[:top_k]]
    rest = rows[top_k:]
    if rest:
        costs.append({"op_type": OTHER, "total_ns": sum(r[1] for r in rest), "count": sum(r[2] for r in rest)})
    return costs


def kernel_type_costs(ev: StepEvents, top_k: int = 10, window: Window | None = None) -> list[dict[str, int | str]]:
    """The same for the device ops of a device window (every one the step launched,
    whole); empty on a host window."""
    if not (window or step_window(ev)).device:
        return []
    return _costs(ev, device_ops(ev), top_k)


def device_kind_costs(ev: StepEvents, window: Window | None = None) -> list[dict[str, int | str]]:
    """``[{kind, total_ns, count}]``: summed durations of the step's device ops per kind
    (compute, communication, memcpy, memset; kinds without ops left out). On a device
    window, its device ops; on a host window, the ops of those kinds that start in [S, E)."""
    device = (window or step_window(ev)).device
    if not device and compiled.NATIVE is not None:
        sums = compiled.NATIVE.sums_by_code(ev.op_kind, ev.op_start_ns, ev.op_dur_ns, ev.start_ns, ev.end_ns)
        if sums is not None:
            by_kind = {kind: (total, count) for kind, total, count in sums}
            return [{"kind": KIND_NAMES[k], "total_ns": by_kind[k][0], "count": by_kind[k][1]}
                    for k in DEVICE_KINDS if k in by_kind]
    sel = device_ops(ev) if device else _in_host_step(ev)
    kinds = ev.op_kind[sel]
    counts = np.bincount(kinds, minlength=len(KIND_NAMES))
    # float64 weights: exact for sums below 2**53 ns (104 days), as op_type_costs
    totals = np.bincount(kinds, weights=ev.op_dur_ns[sel], minlength=len(KIND_NAMES))
    return [{"kind": KIND_NAMES[k], "total_ns": int(totals[k]), "count": int(counts[k])}
            for k in DEVICE_KINDS if counts[k]]
