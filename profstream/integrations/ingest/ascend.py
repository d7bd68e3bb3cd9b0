"""Ascend traces read as their profilers define them: msprof timelines and the
``trace_view.json`` of torch_npu and MindSpore 2.x (``ASCEND_PROFILER_OUTPUT``).

``chrome`` reads these files like any Chrome trace; ``refine`` then corrects what only
their own fields say:

- **Hardware tasks by their ``Task Type``**, not their track or name. Compute: AI Core,
  AI Vector Core, MIX AIC/AIV, AI CPU, DSA (and unknown types, counted in a note).
  Memory: ``MEMCPY_ASYNC``-like copies (PCIE/SDMA DMA) on a compute stream. Wait/notify:
  ``EVENT_RECORD`` / ``EVENT_WAIT`` / ``NOTIFY_*`` / placeholders are synchronisation, not
  work, and are not ops. HCCL's own tasks on the hardware streams (``Notify Wait``,
  ``Write Value``, ``SDMA``, reduce tasks, and every non-compute task of a stream that
  carries them) are parts of a collective: not ops where the HCCL track has the collective
  itself, else communication ops.
- **Communication** is the HCCL track's collective ops (``Group N Communication``,
  ``Communication Kernel``); its ``Plane N`` tracks hold their parts, read as above.
- **Launch**: torch_npu links a hardware task to the torch op that launched it by flow
  events (``async_npu``; ``HostToDevice`` from the CANN call otherwise), not by
  ``args.correlation``; the flow's start becomes the task's launch time, so that the task
  belongs to the step that launched it and the step is measured on the device's window.
- **Step phases**: msprof's ``Iteration N`` carries ``FP Start`` and ``BP End``: F and B.
- **Types**: a collective's type is its HCCL name (``hcom_allReduce``), a MindSpore op's
  its scope's last part (``Cast``); ``types`` (from ``kernel_details.csv``) override the
  name where the profiler gave one.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from profstream.integrations.ingest.model import I64, Profile
from profstream.integrations.ingest.trace_events import EventColumns, timestamps_ns
from profstream.schema.batch import COMMUNICATION, COMPUTE, MEMCPY

HARDWARE = re.compile(r"ascend hardware|ai ?core|ai ?cpu", re.I)
COMPUTE_TYPES = frozenset({"AI_CORE", "AI_VECTOR_CORE", "AIV", "AIC", "MIX_AIC", "MIX_AIV", "AI_CPU", "AICPU",
                           "DSA", "DSA_SQE", "FFTS_PLUS", "KERNEL_AICORE", "KERNEL_AIVEC", "KERNEL_AICPU",
                           "KERNEL_MIX_AIC", "KERNEL_MIX_AIV"})
MEMCPY_TYPES = frozenset({"MEMCPY_ASYNC", "MEMCPY", "PCIE_DMA_SQE", "SDMA_SQE", "ASYNC_MEMCPY", "MEMCPY_ASYNC_SQE"})
# HCCL's tasks: a stream that runs one of them is a communication stream
HCCL_TYPES = re.compile(r"^(NOTIFY_(WAIT|RECORD)|WRITE_VALUE|SDMA|RDMA|REDUCE_.*|HCCL.*|LOCAL_COPY|RDMA_SEND)$")
SYNC_TYPES = re.compile(r"^(EVENT_|PLACE_HOLDER|NOTIFY_|STREAM_|MODEL_|LABEL_|PROFILER_|CAPTURE_|BARRIER)")
_PART, _WAIT = -4, -5
_HCOM = re.compile(r"^(hcom_[A-Za-z]+)")


def is_ascend(process_names: dict) -> bool:
    """A trace with Ascend hardware tracks (msprof, torch_npu, MindSpore 2.x)."""
    return any(HARDWARE.search(str(name)) for name in process_names.values())


def _task_type(value: str) -> str:
    return value.strip().upper().replace(" ", "_")


def refine(profile: Profile, cols: EventColumns, sel: np.ndarray, tracks: list[tuple], process_names: dict,
           thread_names: dict, starts_ns: np.ndarray, base: int, step_events: dict[int, int]) -> None:
    """Correct the ops and steps ``chrome`` read from an Ascend trace (see the module
    docstring). ``sel``: the complete events that became ops; ``tracks``: (pid, tid) per
    track code; ``starts_ns``: every complete event's start on the trace's clock (``base``
    added gives ns since the epoch); ``step_events``: step number -> its complete event."""
    asc = cols.ascend
    role = [_role(process_names.get(p, ""), thread_names.get((p, t), "")) for p, t in tracks] or ["other"]
    op_role = np.array(role, dtype=object)[profile.op_stream]
    names = [asc.task_types[c] if c >= 0 else "" for c in asc.task_type[sel].tolist()]
    types = [_task_type(t) for t in names]
    hardware = op_role == "hardware"
    hccl_streams = {s for s, t, hw in zip(profile.op_stream.tolist(), types, hardware.tolist())
                    if hw and HCCL_TYPES.match(t)}
    has_collectives = bool((op_role == "hccl_op").any())
    kind = profile.op_kind.astype(np.int16)
    unknown: Counter = Counter()
    for i in np.flatnonzero(hardware).tolist():
        t = types[i]
        if not t:
            continue  # a task without its type (a hand-made trace): its name decided
        if t in COMPUTE_TYPES:
            kind[i] = COMPUTE
        elif int(profile.op_stream[i]) in hccl_streams or HCCL_TYPES.match(t):
            kind[i] = _PART
        elif t in MEMCPY_TYPES:
            kind[i] = MEMCPY
        elif SYNC_TYPES.match(t):
            kind[i] = _WAIT
        else:
            kind[i] = COMPUTE
            unknown[names[i]] += 1
    kind[op_role == "hccl_op"] = COMMUNICATION
    kind[op_role == "hccl_part"] = _PART
    if not has_collectives:  # no collective ops to hold them: the parts are the communication
        kind[kind == _PART] = COMMUNICATION
    keep = kind >= 0
    _notes(profile, kind, unknown)
    on_device = hardware | (op_role == "hccl_op") | (op_role == "hccl_part")
    launch = _flow_launches(asc.flows, tracks, profile.op_stream, starts_ns[sel], base)
    profile.op_kind = kind.astype(np.uint8)
    profile.op_on_device = on_device
    profile.op_launch_ns = np.where(on_device, launch, -1)
    _filter_ops(profile, keep)
    _hccl_types(profile)
    _step_marks(profile, asc.marks, step_events, base)


def _role(process: str, thread: str) -> str:
    if process == "HCCL" or process.upper().startswith("HCCL"):
        return "hccl_part" if thread.startswith("Plane") else "hccl_op"
    if HARDWARE.search(process) and "step trace" not in thread.lower():
        return "hardware"
    return "other"


def _notes(profile: Profile, kind: np.ndarray, unknown: Counter) -> None:
    parts, waits = int(np.count_nonzero(kind == _PART)), int(np.count_nonzero(kind == _WAIT))
    if parts:
        profile.notes.append(f"{parts} HCCL tasks not sent as ops: parts of the collectives on the HCCL track")
    if waits:
        profile.notes.append(f"{waits} wait/notify tasks (EVENT_WAIT, EVENT_RECORD...) not sent as ops: "
                             "synchronisation, not work")
    if unknown:
        listed = ", ".join(f"{t}: {n}" for t, n in unknown.most_common())
        profile.notes.append(f"task types not known, counted as compute: {listed}")


def _flow_launches(flows: list[tuple], tracks: list[tuple], op_stream: np.ndarray, op_start: np.ndarray,
                   base: int) -> np.ndarray:
    """Per op: the start of the host event its flow comes from (torch_npu's ``async_npu``,
    else ``HostToDevice``), + base; -1 without one. A flow ends (``f``) at the start of
    the task it binds to, on the task's track."""
    launch = np.full(len(op_stream), -1, I64)
    if not flows:
        return launch
    ts = timestamps_ns([f[5] for f in flows])
    track_code = {t: i for i, t in enumerate(tracks)}
    at = {(int(s), int(t)): i for i, (s, t) in enumerate(zip(op_stream.tolist(), op_start.tolist()))}
    for cat in ("HostToDevice", "async_npu"):  # the later one wins: the torch op over the CANN call
        starts = {f[2]: int(t) for f, t in zip(flows, ts.tolist()) if f[1] == cat and f[0] == "s"}
        for f, t in zip(flows, ts.tolist()):
            if f[1] != cat or f[0] != "f" or f[2] not in starts:
                continue
            op = at.get((track_code.get((f[3], f[4]), -1), int(t)))
            if op is not None:
                launch[op] = starts[f[2]] + base
    return launch


def _filter_ops(profile: Profile, keep: np.ndarray) -> None:
    if keep.all():
        return
    for name in ("op_name", "op_type", "op_kind", "op_stream", "op_start_ns", "op_dur_ns", "op_launch_ns",
                 "op_on_device"):
        setattr(profile, name, getattr(profile, name)[keep])


def _hccl_types(profile: Profile) -> None:
    table = profile.type_table.copy()
    for code in np.unique(profile.op_name[profile.op_kind == COMMUNICATION]).tolist():
        m = _HCOM.match(str(profile.name_table[code]))
        if m:
            table[code] = m.group(1)
    profile.type_table = table


def apply_types(profile: Profile, types: dict[str, str]) -> int:
    """Give each op named in ``types`` (name -> the profiler's op type) that type; the
    number of op names typed so."""
    table = profile.type_table.copy()
    done = 0
    for code, name in enumerate(profile.name_table.tolist()):
        t = types.get(name)
        if t:
            table[code] = t
            done += 1
    profile.type_table = table
    return done


def _step_marks(profile: Profile, marks: list[tuple], step_events: dict[int, int], base: int) -> None:
    """F and B of msprof's Iteration events (their FP Start and BP End)."""
    if not marks or not profile.steps:
        return
    by_event = {j: (fp, bp) for j, fp, bp in marks}
    fp_ns = profile.step_fp_ns.copy()
    bp_ns = profile.step_bp_ns.copy()
    for i, step in enumerate(profile.step.tolist()):
        mark = by_event.get(step_events.get(step, -1))
        if mark is None:
            continue
        try:
            fp, bp = timestamps_ns(list(mark)).tolist()
        except (TypeError, ValueError):
            continue
        if profile.step_start_ns[i] <= fp + base <= bp + base <= profile.step_end_ns[i]:
            fp_ns[i], bp_ns[i] = fp + base, bp + base
    profile.step_fp_ns, profile.step_bp_ns = fp_ns, bp_ns
