"""Chrome Trace Event Format JSON (plain or gzip): PyTorch ``export_chrome_trace`` and
Kineto traces, MindSpore timeline files, CANN msprof timelines.

Complete events (``ph: X``) become ops; their kind comes from the track (process and
thread names: ``Ascend Hardware``, ``HCCL``, ``AI CPU``...), then the category (``kernel``,
``gpu_memcpy``, ``cpu_op``...), then the name (nccl/hccl/all_reduce -> communication,
Memcpy -> memcpy). An op whose category none of these knows is recorded as host and
counted per category in ``Profile.unknown_categories``. Step events (``ProfilerStep#N``,
``Iteration N``, ``Step N``) become step marks; ``[memory]`` instant events become memory
samples. Tracks that hold figures derived from the ops (msprof's ``Overlap Analysis``,
MindSpore's merged/pure/free tracks) are left out: the processors compute those.

A device event (category ``kernel``, ``gpu_memcpy``...) whose ``args.correlation`` matches
a host event's (the ``cudaLaunchKernel`` that launched it) gets that event's start as
its launch time, and its type is its name without template arguments and parameters.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from profstream.integrations.ingest.ascend import is_ascend, refine
from profstream.integrations.ingest.chunks import columns_in_chunks
from profstream.integrations.ingest.model import (
    I64,
    IngestError,
    Profile,
    kernel_type,
    kind_from_name,
    relative_base_ns,
    set_steps,
    type_from_name,
)
from profstream.integrations.ingest.trace_events import (
    DEVICE_CATEGORIES,
    EventColumns,
    decode_trace,
    gc_paused,
    is_plain,
    read_bytes,
    scan_events,
)
from profstream.schema.batch import COMPUTE, HOST, MEMCPY, MEMSET, dictionary_codes

_STEP = re.compile(r"^(?:ProfilerStep#|Iteration[ _]?|[Ss]tep[ _#]?)(\d+)$")
_SKIP = -2  # a derived or bookkeeping event, not an op
_UNKNOWN = -1

# category -> kind; None: decided by whether the trace has device events
_CATEGORIES: dict[str, int | None] = {
    "kernel": COMPUTE, "gpu_op": COMPUTE, "ai_core": COMPUTE, "ai_cpu": COMPUTE, "aicore": COMPUTE,
    "gpu_memcpy": MEMCPY, "gpu_memset": MEMSET,
    "cpu_op": None, "operator": None,
    "user_annotation": HOST, "gpu_user_annotation": HOST, "python_function": HOST, "cuda_runtime": HOST,
    "cuda_driver": HOST, "runtime": HOST, "driver": HOST, "overhead": HOST, "cpu_instant_event": HOST,
    "cuda_sync": HOST, "python": HOST, "acl": HOST, "ascendcl": HOST, "cann": HOST, "ge": HOST,
    "mstx": HOST,
    "trace": _SKIP, "fwdbwd": _SKIP, "ac2g": _SKIP, "async": _SKIP, "flow": _SKIP,
}

# track (process or thread name) -> kind, first match wins
_TRACKS: tuple[tuple[re.Pattern, int], ...] = (
    (re.compile(r"overlap analysis|merged|pure communication|free time|^steps?$|step trace|iteration|scope layer",
                re.I), _SKIP),
    (re.compile(r"hccl|nccl|communication|hcom|lccl", re.I), -3),  # by name: comm unless memcpy/memset
    (re.compile(r"cann|ascendcl|acl|runtime|\bge\b|python|host|framework|pta|cpu usage|memory", re.I), HOST),
    (re.compile(r"ascend hardware|ai ?core|ai ?cpu|aiv|ascend op|gpu op|cpu op|kernel|stream \d+|"
                r"npu|device", re.I), COMPUTE),
)
_COMM_TRACK = -3


def parse_chrome(path: Path, base_ns: int | None = None, workers: int | None = None) -> Profile:
    """Read a Chrome trace JSON file into a ``Profile``. A large file is parsed in
    ``workers`` processes (default: ``chunks.default_workers()``; 1: this process only),
    with the same result."""
    with gc_paused():
        raw = None if is_plain(path) else read_bytes(path)  # plain: each worker reads its chunk
        parsed = columns_in_chunks(path, raw, workers)
        if parsed is None:  # small, one worker, or not cut cleanly: in this process
            raw = read_bytes(path) if raw is None else raw
            events, meta = decode_trace(path, raw)
            del raw
            parsed = scan_events(path, events), meta
            del events  # freed now rather than after the numpy work below
        return _profile(path, *parsed, base_ns)


def parse_chrome_files(paths: list[Path], path: Path, base_ns: int | None = None) -> Profile:
    """The trace files of one rank (msprof's one file per iteration) read as one trace,
    named ``path``. A file that cannot be read is one note naming it; the rest are read.
    IngestError when none can be."""
    events: list = []
    meta: dict = {}
    problems = []
    with gc_paused():
        for file in paths:
            try:
                more, header = decode_trace(file, read_bytes(file))
            except IngestError as e:
                problems.append(f"{e} (the rank's other files are read)")
                continue
            events += more
            meta = meta or header
        if not events and problems:
            raise IngestError(problems[0])
        profile = _profile(path, scan_events(path, events), meta, base_ns)
    profile.notes[:0] = problems
    return profile


def _profile(path: Path, cols: EventColumns, meta: dict, base_ns: int | None) -> Profile:
    keys, key_code, dur_us = cols.keys, cols.key_code, cols.dur_us
    key_name, name_ix = dictionary_codes([k[1] for k in keys])
    key_cat, cat_ix = dictionary_codes([k[2] or "" for k in keys])
    key_track, track_ix = dictionary_codes([(k[3], k[4]) for k in keys])  # (pid, tid)

    process_names, thread_names = {}, {}
    for what, pid, tid, name in cols.metadata:  # in file order: the last one of a track wins
        if what == "process_name":
            process_names[pid] = name
        else:
            thread_names[(pid, tid)] = name

    # kind per category, per track and per name (each decided once per distinct value)
    device_cat = np.array([c.lower() in DEVICE_CATEGORIES for c in cat_ix] or [False], bool)
    ascend = cols.ascend is not None and is_ascend(process_names)
    has_device = bool(device_cat.any()) or ascend  # Ascend's hardware tasks have no category
    cat_kind = np.array([_category_kind(c, has_device) for c in cat_ix] or [0], np.int8)
    track_kind = np.array([_track_kind(process_names.get(p, ""), thread_names.get((p, t), ""))
                           for p, t in track_ix] or [0], np.int8)
    name_list = list(name_ix)
    name_kind = np.array([kind_from_name(nm) for nm in name_list] or [0], np.int8)
    step_of_name = [_STEP.match(nm) for nm in name_list]

    # then per key (name, category and track together), so that each event costs one lookup:
    # a derived track is left out; else the category decides, else the track, else the name
    by_track = track_kind[key_track].astype(np.int16)
    kind = cat_kind[key_cat].astype(np.int16)
    kind = np.where(by_track == _SKIP, _SKIP, np.where(kind == _UNKNOWN, by_track, kind))
    by_name = name_kind[key_name]
    comm_track = kind == _COMM_TRACK
    kind = np.where(comm_track, np.where(by_name >= 0, by_name, 1), kind)  # 1: COMMUNICATION
    named = (by_name >= 0) & ((kind == COMPUTE) | (kind == _UNKNOWN))
    kind = np.where(named, by_name, kind)

    # steps: step-named events that are not the GPU-side copies of the annotation
    gpu_annotation = cat_ix.get("gpu_user_annotation", -1)
    is_step_name = np.array([m is not None for m in step_of_name] or [False], bool)[key_name]
    is_step = is_step_name & (key_cat != gpu_annotation)
    kept_key = (kind != _SKIP) & ~is_step_name
    unknown_key = kept_key & (kind == _UNKNOWN)
    kind = np.where(kind == _UNKNOWN, HOST, kind).astype(np.uint8)

    starts_ns = cols.ts_ns
    durs_ns = np.rint(dur_us * 1000).astype(I64)
    base, clock = _clock(path, meta, starts_ns, durs_ns, base_ns)

    profile = Profile(source=_flavour(meta, cat_ix, process_names), path=path, clock=clock)
    sel = np.flatnonzero(kept_key[key_code] & (dur_us >= 0))
    op_key = key_code[sel]
    if unknown_key.any():
        per_key = np.bincount(op_key, minlength=len(keys)) * unknown_key
        counts = np.bincount(key_cat, weights=per_key, minlength=len(cat_ix)).astype(I64)
        cat_list = list(cat_ix)
        for code in np.flatnonzero(counts):
            profile.unknown_categories[cat_list[code] or "(none)"] += int(counts[code])

    profile.name_table = np.array(name_list, dtype=object)
    device_key = device_cat[key_cat]
    device_name = np.zeros(len(name_list), bool)
    device_name[key_name[device_key]] = True
    profile.type_table = np.array([kernel_type(nm) if d else type_from_name(nm)
                                   for nm, d in zip(name_list, device_name.tolist())], dtype=object)
    profile.op_name = key_name[op_key]
    profile.op_type = profile.op_name  # type_table is indexed by name code
    profile.op_kind = kind[op_key]
    profile.op_stream = key_track[op_key]
    profile.op_start_ns = starts_ns[sel] + base
    profile.op_dur_ns = durs_ns[sel]
    launch_ns = _launch_times(cols.correlation, device_key[key_code], starts_ns + base)
    profile.op_launch_ns = launch_ns[sel]
    profile.op_on_device = device_key[op_key]

    steps_at = np.flatnonzero(is_step[key_code])
    numbers = [int(step_of_name[key_name[key_code[i]]].group(1)) for i in steps_at]
    seen: dict[int, int] = {}
    for i, s in zip(steps_at, numbers):  # a step number twice (several threads): the first one
        seen.setdefault(s, i)
    idx = np.array(list(seen.values()), I64)
    if len(idx):
        set_steps(profile, list(seen), starts_ns[idx] + base, starts_ns[idx] + durs_ns[idx] + base)
    elif len(sel):
        first, last = int(profile.op_start_ns.min()), int((profile.op_start_ns + profile.op_dur_ns).max())
        set_steps(profile, [0], [first], [last + 1])
        profile.notes.append("no step events (ProfilerStep#N, Iteration N, Step N): the whole trace is step 0")

    if cols.begin_end:
        profile.notes.append(f"{cols.begin_end} begin/end (B/E) events not read: complete (X) events become ops")
    if len(cols.mem_ts_ns):
        mts = cols.mem_ts_ns + base
        order = np.argsort(mts, kind="stable")
        profile.mem_ts_ns = mts[order]
        profile.mem_allocated = cols.mem_allocated[order]
        profile.mem_reserved = cols.mem_reserved[order]
    profile.host = meta.get("host_name") if isinstance(meta.get("host_name"), str) else None
    dist = meta.get("distributedInfo")
    if isinstance(dist, dict) and isinstance(dist.get("rank"), int):
        profile.rank = dist["rank"]
    profile.collectives, profile.collective_launch_ns = _collective_calls(
        cols.collectives, device_key[key_code], starts_ns + base, durs_ns, launch_ns)
    if ascend:
        profile.device = "npu"
        refine(profile, cols, sel, list(track_ix), process_names, thread_names, starts_ns, base, seen)
    profile.assign_steps()
    return profile


# bytes per element of the dtypes torch.distributed records
_DTYPE_BYTES = {"Float": 4, "Int": 4, "UInt32": 4, "Half": 2, "BFloat16": 2, "Short": 2, "UInt16": 2, "Double": 8,
                "Long": 8, "UInt64": 8, "ComplexFloat": 8, "ComplexDouble": 16, "Byte": 1, "Char": 1, "Bool": 1,
                "Float8_e4m3fn": 1, "Float8_e5m2": 1}


def _collective_calls(found: list[tuple], on_device: np.ndarray, starts_ns: np.ndarray, durs_ns: np.ndarray,
                      launch_ns: np.ndarray) -> tuple[list[tuple], np.ndarray]:
    """Profile.collectives and their launch times from the events with collective args
    (EventColumns.collectives): where the device ops (NCCL kernels) carry them, those,
    which time the transfer on the device; else the host's ``record_param_comms``. One
    row per (group, seq)."""
    if any(on_device[f[0]] for f in found):
        found = [f for f in found if on_device[f[0]]]
    rows: dict[tuple[str, int], tuple] = {}
    launched: dict[tuple[str, int], int] = {}
    for j, collective, group, seq, size, n_in, n_out, dtype in found:
        if (group, seq) in rows:
            continue
        per = _DTYPE_BYTES.get(dtype, -1)
        rows[(group, seq)] = (collective, group, dtype, seq, int(starts_ns[j]), int(durs_ns[j]),
                              n_in * per if n_in >= 0 and per > 0 else -1, n_out * per if n_out >= 0 and per > 0
                              else -1, size)
        launched[(group, seq)] = int(launch_ns[j])
    return list(rows.values()), np.array(list(launched.values()), I64)


def _launch_times(correlation: np.ndarray, on_device: np.ndarray, starts_ns: np.ndarray) -> np.ndarray:
    """Per complete event: for a device event, the start of the first host event with its
    correlation (the runtime call that launched it); -1 otherwise. Correlations are > 0
    (0 and -1: none, as Holistic Trace Analysis reads them)."""
    launch = np.full(len(correlation), -1, I64)
    linked = correlation > 0
    host = np.flatnonzero(linked & ~on_device)
    device = np.flatnonzero(linked & on_device)
    if not len(host) or not len(device):
        return launch
    order = host[np.argsort(correlation[host], kind="stable")]  # file order among equal ids
    ids, first = np.unique(correlation[order], return_index=True)
    at = np.minimum(np.searchsorted(ids, correlation[device]), len(ids) - 1)
    found = ids[at] == correlation[device]
    launch[device[found]] = starts_ns[order[first[at[found]]]]
    return launch


def _category_kind(cat: str, has_device: bool) -> int:
    c = cat.lower()
    if c in _CATEGORIES:
        k = _CATEGORIES[c]
        return (HOST if has_device else COMPUTE) if k is None else k
    if not c:
        return _UNKNOWN
    by_name = kind_from_name(c)
    return by_name if by_name >= 0 else _UNKNOWN


def _track_kind(process: str, thread: str) -> int:
    if process and _TRACKS[0][0].search(process):  # a derived process: every thread of it (Overlap Analysis)
        return _SKIP
    for label in (thread, process):
        if not label:
            continue
        for pattern, k in _TRACKS:
            if pattern.search(label):
                return k
    return _UNKNOWN


def _clock(path: Path, meta: dict, starts_ns: np.ndarray, durs_ns: np.ndarray,
           base_ns: int | None) -> tuple[int, str]:
    if base_ns is not None:
        return base_ns, f"trace time + --base-ns {base_ns}"
    if isinstance(meta.get("baseTimeNanoseconds"), int):
        return meta["baseTimeNanoseconds"], "trace time + the trace's baseTimeNanoseconds"
    if len(starts_ns) and int(starts_ns.max()) > 10**18:  # ts in epoch microseconds (after 2001)
        return 0, "absolute (epoch microseconds in the trace)"
    last = int((starts_ns + durs_ns).max()) if len(starts_ns) else 0
    return relative_base_ns(path, last), "relative trace: its last event ends at the file's modification time"


def _flavour(meta: dict, cats: dict, processes: dict) -> str:
    labels = " ".join(processes.values()).lower()
    ascend = "ascend hardware" in labels or "cann" in labels or "overlap analysis" in labels
    if ascend and "cpu_op" in cats:
        return "torch_npu trace"
    if meta.get("baseTimeNanoseconds") is not None or "cpu_op" in cats or "kernel" in cats:
        return "pytorch trace"
    if ascend:
        return "msprof timeline"
    if "ascend op" in labels or "gpu op" in labels or "cpu op" in labels or "step trace" in labels:
        return "mindspore timeline"
    return "chrome trace"
