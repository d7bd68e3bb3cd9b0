"""The work of a PyTorch training step: tokens and samples found in its batches, and its
model FLOPs counted with torch's own ``FlopCounterMode``, once per input shape.

A step trains on one or more micro-batches. Each starts a *region* that runs until the next
one starts or the step ends: its forward and backward (and, for the last, the optimizer).
The FLOPs of a region are counted once per input shape (the shapes of its batch's tensors):
the region runs under the counter the first time its shape is seen, and the count is
cached; a step whose every region's shape is cached gets their sum as its FLOPs (source
``counted``). At most ``MAX_COUNTED_SHAPES`` shapes are counted; steps of other shapes
have no FLOPs (one line says how to give them). The training thread pays, per step, a few
attribute reads per batch and a dictionary lookup; the counted region pays torch's
dispatch-mode cost once.

The count covers what torch can count: matrix multiplications, attention and convolutions
(FlopCounterMode's registry, elementwise ops count 0, as model FLOPs do by convention). An
op of another library (a custom kernel) without a registered formula, a formula that
fails, or a higher-order op torch skips is left out of the count and named in one warning.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple

from profstream.processors.throughput import CATEGORIES, op_category

log = logging.getLogger("profstream.torch")

MAX_COUNTED_SHAPES = 16
# Namespaces of ops that do no model arithmetic of their own: torch's (its elementwise ops
# count 0, as model FLOPs do by convention), the profiler's annotations, collectives.
_NOT_MODEL_MATH = {"aten", "prims", "prim", "profiler", "c10d", "_c10d_functional", "c10d_functional"}
_TOKEN_KEYS = ("input_ids", "attention_mask", "labels")


def batch_work(batch: Any, torch: Any) -> tuple[int | None, int | None]:
    """(tokens, samples) of a batch: a mapping's ``input_ids`` (else ``attention_mask``,
    ``labels``) gives both, its numel and its first dimension; a tensor of integers with two
    or more dimensions is token ids; any other tensor gives the samples, its first
    dimension; a tuple or list is read by its first element. None where nothing says."""
    return _read(batch, torch, False)[:2]


def shape_key(batch: Any, torch: Any) -> tuple:
    """What the FLOPs of a batch's region depend on: the shapes of its tensors."""
    return _read(batch, torch, True)[2]


def _read(batch: Any, torch: Any, key: bool) -> tuple[int | None, int | None, tuple | None]:
    """(tokens, samples, shape key or None) of a batch, in one pass (the training thread's)."""
    tensor = torch.Tensor
    if type(batch) is dict or isinstance(batch, Mapping):
        shapes = tuple([v.shape for v in batch.values() if isinstance(v, tensor)]) if key else None
        for name in _TOKEN_KEYS:
            ids = batch.get(name)
            if isinstance(ids, tensor) and ids.dim() >= 2:
                return ids.numel(), ids.shape[0], shapes
        first = next((v for v in batch.values() if isinstance(v, tensor) and v.dim() >= 1), None)
        return None, (first.shape[0] if first is not None else None), shapes
    if isinstance(batch, (tuple, list)):
        shapes = tuple([v.shape for v in batch if isinstance(v, tensor)]) if key else None
        first = batch[0] if batch else None
    else:
        first = batch
        shapes = (batch.shape,) if key and isinstance(batch, tensor) else (type(batch),) if key else None
    if isinstance(first, tensor) and first.dim() >= 1:
        if first.dim() >= 2 and not first.is_floating_point() and not first.is_complex():
            return first.numel(), first.shape[0], shapes
        return None, first.shape[0], shapes
    return None, None, shapes


class Count(NamedTuple):
    """The FLOPs of one region, counted once."""

    flops: float
    by_category: tuple[float, float, float]  # matmul, attention, conv (CATEGORIES order)
    dtype: str | None  # the dtype most of them ran in (the matmuls' inputs)
    left_out: tuple[str, ...]  # ops torch could not count: "name (calls)"


def _counter_class(torch: Any) -> type:
    """FlopCounterMode that also keeps, per op, the FLOPs by category and dtype, and the
    ops it left out (no formula outside aten, a formula that failed)."""
    from torch.utils.flop_counter import FlopCounterMode

    class RegionCounter(FlopCounterMode):
        def __init__(self) -> None:
            super().__init__(display=False, skip_unsupported=True)
            self.by_category = [0.0] * len(CATEGORIES)
            self.by_dtype: Counter = Counter()
            self.left_out: Counter = Counter()

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            if func_packet not in self.flop_registry:
                name = str(func_packet)
                if name.split(".", 1)[0] not in _NOT_MODEL_MATH and any(
                        isinstance(a, torch.Tensor) and a.is_floating_point() for a in args):
                    self.left_out[name] += 1  # another library's op on floats (a custom kernel)
                return out
            try:
                flops = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
            except Exception:  # noqa: BLE001 - a formula that fails for these inputs: left out
                self.left_out[str(func_packet)] += 1
                return out
            for par in set(self.mod_tracker.parents):
                self.flop_counts[par][func_packet] += flops
            category = op_category(str(func_packet).replace(".", "::"))
            if category >= 0:
                self.by_category[category] += flops
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.is_floating_point():
                self.by_dtype[first.dtype] += flops
            return out

    return RegionCounter


class StepWork:
    """A step's tokens, samples and counted FLOPs, fed by the instrumentation on the
    training thread and handed to the Monitor before the step's end mark."""

    def __init__(self, torch: Any, count_flops: bool) -> None:
        self._torch = torch
        self.count_flops = count_flops
        self.counts: dict[tuple, Count] = {}
        self._counter_type: type | None = None
        self._counting: tuple[Any, tuple] | None = None  # (the counter running, its region's key)
        self._tokens: int | None = None
        self._samples: int | None = None
        self._flops = 0.0
        self._split = [0.0, 0.0, 0.0]
        self._unknown = False  # a region of the step whose FLOPs are not known
        self._regions = 0
        self.counted_regions = 0  # regions run under the counter (for tests and benchmarks)
        self.dtype: str | None = None  # of the first count
        self._said_full = False

    def batch(self, batch: Any) -> None:
        """A micro-batch of the step begins its region (ending the previous one)."""
        tokens, samples, key = _read(batch, self._torch, self.count_flops)
        if tokens is not None:
            self._tokens = tokens if self._tokens is None else self._tokens + tokens
        if samples is not None:
            self._samples = samples if self._samples is None else self._samples + samples
        if key is None:
            return
        if self._counting is not None:
            self.end_region()
        self._regions += 1
        count = self.counts.get(key)
        if count is not None:
            self._add(count)
        elif len(self.counts) < MAX_COUNTED_SHAPES:
            self._start(key)
        else:
            self._unknown = True
            if not self._said_full:
                self._said_full = True
                log.warning("profstream: model FLOPs are counted for %d input shapes at most; steps of other shapes "
                            "have no FLOPs (no MFU): for a run whose shapes keep changing, give flops_per_token "
                            "(PROFSTREAM_FLOPS_PER_TOKEN)", MAX_COUNTED_SHAPES)

    def end_region(self) -> None:
        """The region of the latest batch is over (the next batch is asked for, the step ends)."""
        running, self._counting = self._counting, None
        if running is None:
            return
        counter, key = running
        counter.__exit__(None, None, None)
        by_dtype = counter.by_dtype
        dtype = max(by_dtype, key=by_dtype.get) if by_dtype else None
        count = Count(float(counter.get_total_flops()), tuple(counter.by_category), self._dtype_name(dtype),
                      tuple(f"{name} ({n} calls)" for name, n in counter.left_out.most_common()))
        self.counts[key] = count
        if self.dtype is None:
            self.dtype = count.dtype
        if count.left_out:
            log.warning("profstream: the model FLOP count left out ops torch cannot count (no formula, or one that "
                        "failed): %s; MFU is computed without them", ", ".join(count.left_out))
        self._add(count)

    def take(self) -> tuple[int | None, int | None, float | None, list[float]]:
        """(tokens, samples, FLOPs or None, their split by category) of the step that ends,
        and start afresh."""
        if self._counting is not None:
            self.end_region()
        out = (self._tokens, self._samples, self._flops if self._regions and not self._unknown else None, self._split)
        self._tokens = self._samples = None
        self._flops, self._split, self._unknown, self._regions = 0.0, [0.0, 0.0, 0.0], False, 0
        return out

    def forget(self) -> None:
        """Drop the step's work (a step cancelled): a count running is stopped, not kept."""
        running, self._counting = self._counting, None
        if running is not None:
            running[0].__exit__(None, None, None)
        self.take()

    def _start(self, key: tuple) -> None:
        if self._counter_type is None:
            self._counter_type = _counter_class(self._torch)
        counter = self._counter_type()
        counter.__enter__()
        self._counting = (counter, key)
        self.counted_regions += 1

    def _add(self, count: Count) -> None:
        self._flops += count.flops
        s, c = self._split, count.by_category
        self._split = [s[0] + c[0], s[1] + c[1], s[2] + c[2]]

    def _dtype_name(self, dtype: Any) -> str | None:
        """The peak table's name of the dtype the matmuls ran in; fp32 with TF32 allowed is tf32."""
        from profstream.devices.peaks import dtype_name

        name = dtype_name(dtype) if dtype is not None else None
        if name == "fp32":
            torch = self._torch
            if torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32:
                name = "tf32"
        return name


def send(monitor: Any, tokens: int | None, samples: int | None, flops: float | None, split: list[float]) -> None:
    """Hand a step's work to the Monitor (its step still open)."""
    if tokens is not None or samples is not None:
        monitor.work(tokens, samples)
    if flops is not None:
        monitor.counted_flops(flops, *split)
