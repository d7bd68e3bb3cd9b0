"""torch.profiler events -> profstream op columns.

A captured step's kineto events are reduced to the ops that partition its time: every
device-side activity (kernels, copies, sets) and, per CPU thread, the outermost CPU op
(``aten::linear`` but not the ``aten::addmm`` inside it; the autograd node
``AddmmBackward0`` but not its ``aten::mm``), so that summing ops by type never counts
the same nanosecond twice. User annotations (``ProfilerStep#N``, ``Optimizer.step#...``,
``record_function`` blocks) are not ops and are left out; the ops inside them stay. The
exception: annotations named as collectives (``gloo:all_reduce``) are ops, because gloo
times its transfers with them on its own threads.

Kinds: collectives (nccl, gloo, all_reduce, broadcast, all_gather, reduce_scatter,
all_to_all, c10d) are communication; device copies memcpy; device sets memset; other
device activities compute; CPU ops are host when the run has a device and compute on a
CPU-only run, where the aten ops are the compute; CPU ops that end before the step's
forward start are the batch being loaded and get the kind data.

Two readings give the same ops: ``to_op_columns`` of every event (``events()``; device
runs, whose device activities hang anywhere in the tree), and ``tree_op_columns`` of the
event tree, which reads the annotations and outermost ops alone (CPU-only runs).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from profstream.schema.batch import COMMUNICATION, COMPUTE, DATA, HOST, MEMCPY, MEMSET

_COMM_RE = re.compile(
    r"nccl|gloo|c10d|all_?reduce|broadcast(?!_(?:tensors|to|shapes))|all_?gather|reduce_?scatter|"
    r"all_?to_?all|send_?recv|barrier", re.IGNORECASE)
_AUTOGRAD_PREFIX = "autograd::engine::evaluate_function: "
# Host streams are numbered from here on device runs, so they never meet a device stream id.
HOST_STREAM_BASE = 1_000_000
# A profiler clock more than a day away from the epoch clock is taken for a monotonic one.
_EPOCH_TOLERANCE_NS = 86_400 * 10**9


@lru_cache(maxsize=8192)
def op_kind(name: str, on_device: bool, activity: str, run_has_device: bool) -> int:
    """Kind code of one profiler event (see the module docstring)."""
    if on_device:
        if _COMM_RE.search(name):
            return COMMUNICATION
        low = activity.lower()
        if "memcpy" in low or name.startswith("Memcpy"):
            return MEMCPY
        if "memset" in low or name.startswith("Memset"):
            return MEMSET
        return COMPUTE
    if run_has_device:
        return HOST
    return COMMUNICATION if _COMM_RE.search(name) else COMPUTE


@lru_cache(maxsize=8192)
def op_type(name: str) -> str:
    """A short type for an event name: the autograd node of an engine call, a kernel's
    function name without its template arguments and parameters."""
    if name.startswith(_AUTOGRAD_PREFIX):
        return name[len(_AUTOGRAD_PREFIX):]
    if "(anonymous namespace)::" in name:  # a scope, not the parameter list: at::native::(anonymous namespace)::f
        name = name.replace("(anonymous namespace)::", "")
    if "<" in name or "(" in name:
        cut = min(i for i in (name.find("<"), name.find("(")) if i >= 0)
        short = name[:cut].strip()
        if short.startswith("void "):
            short = short[5:]
        return short or name
    return name


def clock_offset_ns(profiler_ns: int, epoch_ns: int | None = None, monotonic_ns: int | None = None) -> int:
    """What to add to the profiler's timestamps to get nanoseconds since the epoch.

    Recent torch versions report epoch time already (offset 0); a profiler on a
    monotonic clock is moved by the current epoch - monotonic difference."""
    epoch_ns = time.time_ns() if epoch_ns is None else epoch_ns
    if abs(profiler_ns - epoch_ns) < _EPOCH_TOLERANCE_NS:
        return 0
    monotonic_ns = time.monotonic_ns() if monotonic_ns is None else monotonic_ns
    return epoch_ns - monotonic_ns


class RawEvent(NamedTuple):
    """One profiler event, as the unit tests write them."""

    name: str
    start_ns: int
    dur_ns: int
    thread: int  # CPU thread id, or the device stream for device events
    on_device: bool
    activity: str
    annotation: bool
    correlation: int = 0  # a device op and the runtime call that launched it share one (0: none)


class EventTable(NamedTuple):
    """The profiler events of a captured step as columns; names and activities are read
    only for the events that become ops (reading a name costs more than the rest)."""

    start_ns: np.ndarray
    dur_ns: np.ndarray
    thread: np.ndarray
    on_device: np.ndarray
    annotation: np.ndarray
    name: Callable[[int], str]
    activity: Callable[[int], str]
    correlation: np.ndarray | None = None  # CUPTI's launch correlation per event (0: none); device runs

    def __len__(self) -> int:
        return len(self.start_ns)


def table_from_raw(events: Sequence[RawEvent]) -> EventTable:
    return EventTable(
        np.array([e.start_ns for e in events], np.int64), np.array([e.dur_ns for e in events], np.int64),
        np.array([e.thread for e in events], np.int64), np.array([e.on_device for e in events], bool),
        np.array([e.annotation for e in events], bool),
        lambda i: events[i].name, lambda i: events[i].activity, np.array([e.correlation for e in events], np.int64))


_RUNTIME_CALL_RE = re.compile(r"^(cuda|cu|hip|hsa)[A-Z]")  # cudaLaunchKernel, cuLaunchKernelEx, hipMemcpyAsync


def activity_of_name(name: str, on_device: bool) -> str:
    """The Kineto activity of an event from its name, for a torch whose events do not say
    it (before 2.12): device copies and sets, kernels; CUDA/HIP runtime and driver calls."""
    if on_device:
        return "gpu_memcpy" if name.startswith("Memcpy") else "gpu_memset" if name.startswith("Memset") else "kernel"
    return "cuda_runtime" if _RUNTIME_CALL_RE.match(name) else "cpu_op"


def table_from_kineto(events: list[Any], run_has_device: bool) -> EventTable:
    """Columns of torch's ``_KinetoEvent`` objects (``prof.profiler.kineto_results.events()``)."""
    n = len(events)
    if run_has_device:
        from torch.autograd import DeviceType

        cpu = DeviceType.CPU
        on_device = np.array([e.device_type() != cpu for e in events], bool)
        thread = np.array([e.device_resource_id() if d else e.start_thread_id()
                           for e, d in zip(events, on_device.tolist())], np.int64)
        correlation = np.array([e.correlation_id() for e in events], np.int64)
    else:  # only CPU activities were recorded
        on_device = np.zeros(n, bool)
        thread = np.array([e.start_thread_id() for e in events], np.int64)
        correlation = None
    if n and hasattr(events[0], "activity_type"):
        activity = lambda i: str(events[i].activity_type())  # noqa: E731
    else:  # torch before 2.12 has no activity_type(): told by the name
        activity = lambda i: activity_of_name(events[i].name(), bool(on_device[i]))  # noqa: E731
    return EventTable(
        np.array([e.start_ns() for e in events], np.int64), np.array([e.duration_ns() for e in events], np.int64),
        thread, on_device, np.array([e.is_user_annotation() for e in events], bool),
        lambda i: events[i].name(), activity, correlation)


class OpColumns(NamedTuple):
    names: list[str]
    op_types: list[str]
    kinds: np.ndarray
    streams: np.ndarray
    start_ns: np.ndarray
    dur_ns: np.ndarray
    launch_ns: np.ndarray | None = None  # device ops: start of the runtime call that launched them, -1 none

    def __len__(self) -> int:
        return len(self.names)


class HostThreads:
    """Stable small stream numbers for CPU threads, in order of first appearance."""

    def __init__(self) -> None:
        self._ids: dict[int, int] = {}

    def stream(self, thread: int, run_has_device: bool) -> int:
        n = self._ids.setdefault(thread, len(self._ids))
        return HOST_STREAM_BASE + n if run_has_device else n


def outermost_cpu_ops(table: EventTable) -> np.ndarray:
    """Indices of the CPU events (annotations left out, but for collectives such as
    gloo's ``gloo:all_reduce``, which times the transfer on gloo's own threads) that no
    other one contains."""
    annotation = table.annotation.copy()
    for i in np.flatnonzero(annotation & ~table.on_device).tolist():
        if _COMM_RE.search(table.name(i)):
            annotation[i] = False
    cpu = np.flatnonzero(~table.on_device & ~annotation & (table.dur_ns >= 0))
    if not len(cpu):
        return cpu
    thread, start, dur = table.thread[cpu], table.start_ns[cpu], table.dur_ns[cpu]
    order = np.lexsort((-dur, start, thread))  # by thread, then start, longest first
    t, s = thread[order], start[order]
    ends = s + dur[order]
    new_thread = np.ones(len(t), bool)
    new_thread[1:] = t[1:] != t[:-1]
    # An op is outermost when it starts at or after the end of every earlier op of its
    # thread (nested ops end inside their parent; a new thread starts afresh).
    return np.sort(cpu[order[(s >= _prev_max_end(ends, new_thread)) | new_thread]])


def to_op_columns(table: EventTable | Sequence[RawEvent], run_has_device: bool, offset_ns: int = 0,
                  threads: HostThreads | None = None, data_until_ns: int | None = None) -> OpColumns:
    """The ops of a captured step: device events and outermost CPU ops, on the epoch clock.

    CPU ops that end by ``data_until_ns`` (epoch clock: the step's forward start) load
    the batch and get the kind data."""
    if not isinstance(table, EventTable):
        table = table_from_raw(table)
    device = np.flatnonzero(table.on_device & ~table.annotation & (table.dur_ns >= 0))
    keep = np.sort(np.concatenate([device, outermost_cpu_ops(table)]))
    names = [table.name(i) for i in keep.tolist()]
    on_device = table.on_device[keep]
    activities = [table.activity(i) if d else "cpu_op" for i, d in zip(keep.tolist(), on_device.tolist())]
    threads = threads or HostThreads()
    start = table.start_ns[keep] + offset_ns
    dur = table.dur_ns[keep]
    kinds = np.array([op_kind(nm, d, a, run_has_device) for nm, d, a in zip(names, on_device.tolist(), activities)],
                     np.uint8)
    if data_until_ns is not None:
        kinds[~on_device & (start + dur <= data_until_ns)] = DATA
    streams = np.array([t if d else threads.stream(t, run_has_device)
                        for t, d in zip(table.thread[keep].tolist(), on_device.tolist())], np.int32)
    launch = None
    if table.correlation is not None and on_device.any():
        launch = np.full(len(keep), -1, np.int64)
        found = launch_times(table, keep[on_device])
        launch[on_device] = np.where(found >= 0, found + offset_ns, -1)
    return OpColumns(names, [op_type(nm) for nm in names], kinds, streams, start, dur, launch)


_LAUNCH_ACTIVITIES = ("runtime", "driver")  # cuda_runtime, cuda_driver, privateuse1_runtime...


def launch_times(table: EventTable, device: np.ndarray) -> np.ndarray:
    """For the device events at ``device`` (indices), the start (profiler clock) of the
    runtime call that launched each: the CPU event of the same correlation whose activity
    is a runtime or driver call (torch ops number their correlations apart); -1 for none.
    Only CPU events that share a correlation with a device event are read."""
    corr = table.correlation
    wanted = corr[device]
    out = np.full(len(device), -1, np.int64)
    candidates = np.flatnonzero(~table.on_device & (corr > 0) & np.isin(corr, wanted[wanted > 0]))
    launches = {}
    for i in candidates.tolist():
        c = int(corr[i])
        if c not in launches and any(a in table.activity(i).lower() for a in _LAUNCH_ACTIVITIES):
            launches[c] = int(table.start_ns[i])
    for j, c in enumerate(wanted.tolist()):
        out[j] = launches.get(c, -1)
    return out



class NodeNames:
    """What the tree readings learn of an event name, kept from step to step: whether its
    nodes are read through (annotations), and its kind and op type. Reading whether a
    node is an annotation (``extra_fields.scope``) costs three times what the rest of the
    node does, so the Python walk reads it once per name: a name is taken to be an
    annotation or an op throughout the run. Bounded: names that change every step
    (``ProfilerStep#N``) are forgotten with the rest when it is full."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._info: dict[str, tuple[bool, int, str] | None] = {}
        self._last: tuple[list[str], np.ndarray, list[str]] = ([], np.zeros(0, np.uint8), [])

    def get(self, name: str, node: Any) -> tuple[bool, int, str] | None:
        """(read through, kind, op type) of a tree node's name; None when the node is not
        a torch op (memory, Python calls...: the tree reading gives up)."""
        try:
            return self._info[name]
        except KeyError:
            pass
        try:
            from torch._C._profiler import RecordScope, _ExtraFields_TorchOp
        except ImportError:  # a torch that names them otherwise: the caller reads events()
            return None
        fields = node.extra_fields
        if type(fields) is not _ExtraFields_TorchOp:
            return self._remember(name, None)
        return self._remember(name, self._op_info(name, fields.scope == RecordScope.USER_SCOPE))

    def op(self, name: str) -> tuple[bool, int, str]:
        """The entry of a name the compiled walk found to be an op."""
        info = self._info.get(name)
        return info if info is not None else self._remember(name, self._op_info(name, False))

    @property
    def last_names(self) -> list[str]:
        """The op names of the step before (the compiled walk hands this very list back
        when a step has the same ops)."""
        return self._last[0]

    def kinds_and_types(self, op_names: list[str]) -> tuple[np.ndarray, list[str]]:
        """Kinds and op types of the ops the compiled walk found; a step with the ops of
        the step before (the usual case) reuses its columns."""
        names, kinds, types = self._last
        if op_names is not names and op_names != names:
            infos = [self.op(n) for n in op_names]
            kinds, types = np.array([i[1] for i in infos], np.uint8), [i[2] for i in infos]
            self._last = (op_names, kinds, types)
        return kinds.copy(), types

    @staticmethod
    def through(name: str) -> bool:
        """An annotation of this name is read through: it is no op (a collective's is)."""
        return not _COMM_RE.search(name)

    def _op_info(self, name: str, annotation: bool) -> tuple[bool, int, str]:
        return annotation and self.through(name), op_kind(name, False, "cpu_op", False), op_type(name)

    def _remember(self, name: str, info: Any) -> Any:
        if len(self._info) >= self.LIMIT:
            self._info.clear()
        self._info[name] = info
        return info


def tree_op_columns(roots: Sequence[Any], offset_ns: int = 0, threads: HostThreads | None = None,
                    data_until_ns: int | None = None, names: NodeNames | None = None) -> OpColumns | None:
    """``to_op_columns`` of a CPU-only capture, read from the profiler's event tree
    (``kineto_results.experimental_event_tree()``) rather than from every event.

    The tree hangs each op under the op or annotation that was open on its thread when it
    began, so the outermost ops are those reached through annotations alone: only they
    and the annotations are read, never the ops nested in them (172 of 484 events a step
    of the overhead benchmark; reading a tree node also costs less than reading a
    ``_KinetoEvent``). ``names`` carries what is known of each name from the steps
    before (pass the same one every step). Same ops, in the same order, as
    ``to_op_columns`` of ``events()``, but where torch's tree nests what the time rule
    does not: an op that starts at the very nanosecond its predecessor ends, and an
    autograd op with nothing open on its own thread, which torch hangs under the op open
    on its forward thread (backward run from another thread). None when a node is not a
    torch op (the caller converts ``events()`` instead). ``native_op_columns`` is the
    same walk, compiled."""
    names = names or NodeNames()
    op_names: list[str] = []
    infos: list[tuple[bool, int, str]] = []
    start: list[int] = []
    dur: list[int] = []
    thread: list[int] = []
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        name = node.name
        info = names.get(name, node)
        if info is None:
            return None
        d = node.duration_time_ns
        # An annotation is read through, as is an op that never ended (events() leaves it
        # out): the ops under them may be ops.
        if d < 0 or info[0]:
            stack.extend(reversed(node.children))
            continue
        op_names.append(name)
        infos.append(info)
        start.append(node.start_time_ns)
        dur.append(d)
        thread.append(node.start_tid)
    starts = np.array(start, np.int64) + offset_ns
    durs = np.array(dur, np.int64)
    tids = np.array(thread, np.int64)
    return _outermost_columns(
        op_names, np.array([i[1] for i in infos], np.uint8), [i[2] for i in infos], starts, durs, tids, threads,
        in_order=not (len(starts) > 1 and (np.diff(starts) < 0).any()),
        one_thread=not len(tids) or bool((tids == tids[0]).all()),
        data=None if data_until_ns is None else starts + durs <= data_until_ns)


def native_op_columns(walk: Callable[..., Any], results: Any, offset_ns: int = 0, threads: HostThreads | None = None,
                      data_until_ns: int | None = None, names: NodeNames | None = None) -> OpColumns | None:
    """``tree_op_columns`` of a capture (``kineto_results``) by the compiled walk
    (``torch_native.walker()``), which also does the per-op arithmetic: see torch_tree.cpp."""
    names = names or NodeNames()
    walked = walk(results, names.through, offset_ns, data_until_ns, names.last_names)
    if walked is None:
        return None
    op_names, start, dur, thread, in_order, one_thread, data = walked
    kinds, types = names.kinds_and_types(op_names)
    return _outermost_columns(op_names, kinds, types, np.frombuffer(start, np.int64), np.frombuffer(dur, np.int64),
                              np.frombuffer(thread, np.int64), threads, in_order, one_thread,
                              None if data is None else np.frombuffer(data, np.bool_))


def _outermost_columns(op_names: list[str], kinds: np.ndarray, types: list[str], starts: np.ndarray,
                       durs: np.ndarray, tids: np.ndarray, threads: HostThreads | None, in_order: bool,
                       one_thread: bool, data: np.ndarray | None) -> OpColumns:
    """OpColumns of the outermost ops of a tree walk (``starts`` on the epoch clock), in
    start order as events() is; ``in_order``: ``starts`` is already, ``one_thread``: one
    tid throughout; ``data``: the ops that end before the step's forward, or None.
    ``kinds`` is changed in place; the other arrays may be read-only."""
    threads = threads or HostThreads()
    if not in_order:
        order = np.argsort(starts, kind="stable")
        starts, durs, kinds, tids = starts[order], durs[order], kinds[order], tids[order]
        data = None if data is None else data[order]
        at = order.tolist()
        op_names, types = [op_names[i] for i in at], [types[i] for i in at]
    if not len(tids):
        streams = np.zeros(0, np.int32)
    elif one_thread:  # the usual CPU run: one lookup
        streams = np.full(len(tids), threads.stream(int(tids[0]), False), np.int32)
    else:
        streams = np.array([threads.stream(t, False) for t in tids.tolist()], np.int32)
    if data is not None:
        kinds[data] = DATA
    return OpColumns(op_names, types, kinds, streams, starts, durs)


def _prev_max_end(end: np.ndarray, new_thread: np.ndarray) -> np.ndarray:
    """For each row, the largest end among the earlier rows of the same thread segment."""
    prev = np.full(len(end), np.iinfo(np.int64).min, np.int64)
    starts = np.flatnonzero(new_thread)
    bounds = np.append(starts, len(end))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi - lo > 1:
            prev[lo + 1:hi] = np.maximum.accumulate(end[lo:hi - 1])
    return prev
