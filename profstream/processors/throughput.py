"""Throughput and model FLOPs utilization of one step: tokens/s, samples/s, achieved
FLOP/s and MFU, and in a step whose ops were captured the achieved FLOP/s per op
category (matmul, attention, conv).

The work comes with the step mark (EventBatch v8): tokens, samples and model FLOPs the
producer found or was given, where the FLOPs came from (given, counted, or the profiler's
FLOPs of the step's captured ops, sent in a work row after the mark), the device's dense
peak and the FLOPs by op category. A figure whose inputs are absent is absent (None),
never 0; a step with no work at all has none.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

from profstream.processors.model import StepEvents
from profstream.processors.window import Window, device_ops
from profstream.schema.batch import COMPUTE, FLOPS_SOURCES

CATEGORIES = ("matmul", "attention", "conv")
# An op type's category, by its name: torch ops and autograd nodes (aten::addmm,
# AddmmBackward0, aten::scaled_dot_product_attention), CUDA kernels (cutlass / cuBLAS
# gemms, flash and fused attention, cuDNN convolutions), the simulator's types. Tried in
# this order: an attention kernel built on cutlass is attention, a convolution's implicit
# gemm a convolution.
_CATEGORY_RES = (
    ("attention", re.compile(r"attention|attn|sdpa|flash|fmha|scaleddotproduct", re.IGNORECASE)),
    ("conv", re.compile(r"conv|implicit_gemm|fprop|dgrad|wgrad|winograd", re.IGNORECASE)),
    ("matmul", re.compile(r"gemm|gemv|matmul|cublas|cutlass|xmma|nvjet|linear|(?:^|::|_)(?:b?add)?b?mm(?:\b|_)|"
                          r"^(?:b?add)?b?mmbackward", re.IGNORECASE)),
)


@lru_cache(maxsize=16384)
def op_category(op_type: str) -> int:
    """Index of ``op_type``'s category in CATEGORIES, -1 for none."""
    for name, pattern in _CATEGORY_RES:
        if pattern.search(op_type):
            return CATEGORIES.index(name)
    return -1


def work_figures(ev: StepEvents, step_time_ns: int, window: Window) -> dict | None:
    """StepMetrics ``work`` of a closed step (None: its producer sent none)."""
    if ev.work is None:
        return None
    tokens, samples, flops, source, peak, *split = ev.work
    source_name = FLOPS_SOURCES[source] if 0 < source < len(FLOPS_SOURCES) and flops == flops else None
    flops = flops if source_name is not None else None
    seconds = step_time_ns / 1e9
    per_s = seconds > 0
    peak = peak if peak == peak and peak > 0 else None
    return {
        "tokens": tokens if tokens >= 0 else None,
        "samples": samples if samples >= 0 else None,
        "flops": flops,
        "flops_source": source_name,
        "peak_flops": peak,
        "tokens_per_s": tokens / seconds if tokens >= 0 and per_s else None,
        "samples_per_s": samples / seconds if samples >= 0 and per_s else None,
        "flops_per_s": flops / seconds if flops is not None and per_s else None,
        "mfu": flops / (seconds * peak) if flops is not None and peak is not None and per_s else None,
        "op_categories": _op_categories(ev, window, split) if len(ev.op_kind) and flops is not None else [],
    }


_TYPE_CATEGORIES: dict[int, tuple[list[str], int, np.ndarray]] = {}  # id(type_names) -> (it, its length, codes)


def _type_categories(names: list[str]) -> np.ndarray:
    """Category index of each op type of a rank (its assembler's growing ``type_names``),
    kept until the list grows."""
    held = _TYPE_CATEGORIES.get(id(names))
    if held is not None and held[0] is names and held[1] == len(names):
        return held[2]
    if len(_TYPE_CATEGORIES) >= 4096:
        _TYPE_CATEGORIES.clear()
    codes = np.fromiter((op_category(n) for n in names), np.int64, len(names))
    _TYPE_CATEGORIES[id(names)] = (names, len(names), codes)
    return codes


def _op_categories(ev: StepEvents, window: Window, split: list[float]) -> list[dict]:
    """Achieved FLOP/s per op category of a captured step: the category's FLOPs (the
    producer's split) over the summed time of its compute ops, the step's device ops on a
    device window, else those starting in [S, E)."""
    if all(f != f for f in split):
        return []
    if window.device:
        sel = device_ops(ev) & (ev.op_kind == COMPUTE)
    else:
        sel = (ev.op_kind == COMPUTE) & (ev.op_start_ns >= ev.start_ns) & (ev.op_start_ns < ev.end_ns)
    cats = _type_categories(ev.type_names)[ev.op_type[sel]] + 1
    time_ns = np.bincount(cats, weights=ev.op_dur_ns[sel], minlength=len(CATEGORIES) + 1)[1:]
    out = []
    for i, name in enumerate(CATEGORIES):
        f = split[i]
        t = int(time_ns[i])
        if f != f or (f == 0 and t == 0):  # unknown, or none of it in the step
            continue
        out.append({"category": name, "flops": float(f), "time_ns": t,
                    "flops_per_s": f / (t / 1e9) if t > 0 else None})
    return out
