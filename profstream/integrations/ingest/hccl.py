"""HCCL communication ops of one rank from the communication analysis that the MindSpore
and torch_npu profilers write (``communication.json``), as ``Profile.collectives`` rows.

Layout read (written from the documented layout, not checked against a real Ascend
machine's files)::

    {"step1": {"collective": {"hcom_allReduce__184_1_1@<group>": {
                   "Communication Time Info": {"Start Timestamp(us)": ..., "Elapse Time(ms)": ...,
                                               "Transit Time(ms)": ..., "Wait Time(ms)": ...},
                   "Communication Bandwidth Info": {"HCCS": {"Transit Size(MB)": ...}, "RDMA": {...}}},
                "Total Op Info": {...}},
               "p2p": {...}}}

Per op: the collective from the name (``hcom_allReduce_...`` -> all_reduce), the group
after ``@``, seq = the op's place among this rank's ops of that group by start time, start
and elapse time, bytes = the transit sizes of every link type summed (MB = 2**20 bytes).
Group sizes are not in the file: 0 here (see ``fill_group_sizes``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from profstream.integrations.ingest.model import I64, Profile
from profstream.schema.batch import NO_VALUE

EXPECTED = ('a communication analysis JSON: {"stepN": {"collective"|"p2p": {"<hccl op>@<group>": '
            '{"Communication Time Info": {"Start Timestamp(us)", "Elapse Time(ms)", ...}, '
            '"Communication Bandwidth Info": {...}}}}}')
# rank-specific first; the plain names only where the directory holds one rank
FILES = ("communication_{rank}.json",)
SINGLE_RANK_FILES = ("communication.json", "ASCEND_PROFILER_OUTPUT/communication.json")
_KINDS = ("collective", "p2p")
_COLLECTIVES = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
                "broadcast": "broadcast", "alltoall": "all_to_all", "alltoallv": "all_to_all",
                "alltoallvc": "all_to_all", "send": "send", "receive": "recv", "recv": "recv",
                "reduce": "reduce", "scatter": "scatter", "barrier": "barrier"}
_OP_NAME = re.compile(r"^(?:hcom_)?([A-Za-z]+)")
MB = 1 << 20


def collective_name(op: str) -> str:
    """profstream's collective name of an HCCL op name (``hcom_allReduce__184_1_1`` ->
    ``all_reduce``); the op's leading word, lower case, where it names none known."""
    m = _OP_NAME.match(op)
    word = m.group(1).lower() if m else op.lower()
    return _COLLECTIVES.get(word, word)


def find_communication_file(folder: Path, rank: int, ranks_here: int) -> Path | None:
    """This rank's communication analysis file in a profiler directory, or None."""
    for pattern in FILES + (SINGLE_RANK_FILES if ranks_here == 1 else ()):
        path = folder / pattern.format(rank=rank)
        if path.is_file():
            return path
    return None


def read_communication(profile: Profile, path: Path) -> None:
    """Add the ops of ``path`` to ``profile.collectives``. A file that is not the layout
    above becomes one note naming it (the rest of the profile stands); ops lacking a
    start or elapse time are skipped and counted in a note."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        profile.notes.append(f"{path}: not read ({str(e).splitlines()[0][:80]}): expected {EXPECTED}")
        return
    if not isinstance(doc, dict):
        profile.notes.append(f"{path}: not read (top level is not an object): expected {EXPECTED}")
        return
    ops, skipped = [], 0
    for step in doc.values():
        if not isinstance(step, dict):
            skipped += 1
            continue
        for kind in _KINDS:
            entries = step.get(kind) or {}
            if not isinstance(entries, dict):
                skipped += 1
                continue
            for name, op in entries.items():
                if name == "Total Op Info":
                    continue
                row = _op_row(name, op)
                if row is None:
                    skipped += 1
                else:
                    ops.append(row)
    seqs: dict[str, int] = {}
    for collective, group, start, dur, nbytes in sorted(ops, key=lambda r: (r[2], r[1])):
        seq = seqs.get(group, 0)
        seqs[group] = seq + 1
        profile.collectives.append((collective, group, "", seq, start, dur, nbytes, NO_VALUE, 0))
    profile.collective_launch_ns = np.full(len(profile.collectives), -1, I64)
    profile.notes.append(f"{len(ops)} HCCL ops from {path.name} ({len(seqs)} groups)"
                         + (f"; {skipped} entries skipped (not an op with a numeric start and elapse time)" if skipped else ""))


def _op_row(name: str, op: object) -> tuple | None:
    """(collective, group, start_ns, dur_ns, bytes) of one op entry; None when malformed."""
    if not isinstance(op, dict) or not isinstance(op.get("Communication Time Info"), dict):
        return None
    times = op["Communication Time Info"]
    start_us, elapse_ms = times.get("Start Timestamp(us)"), times.get("Elapse Time(ms)")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (start_us, elapse_ms)):
        return None
    if start_us <= 0 or elapse_ms < 0:
        return None
    op_name, _, group = name.rpartition("@")
    if not op_name:  # no group in the name
        op_name, group = name, "default"
    nbytes = 0
    for link in (op.get("Communication Bandwidth Info") or {}).values():
        size = link.get("Transit Size(MB)") if isinstance(link, dict) else None
        if isinstance(size, (int, float)) and size > 0:
            nbytes += round(size * MB)
    whole = int(start_us)  # ns since the epoch exceed a float64's exact integers
    return (collective_name(op_name), group, whole * 1000 + round((start_us - whole) * 1000),
            round(elapse_ms * 1_000_000),
            nbytes if nbytes else NO_VALUE)


def fill_group_sizes(profiles: list[Profile]) -> None:
    """Where calls carry no group size (HCCL's file has none): the number of the given
    profiles that hold calls of that group."""
    members: dict[str, int] = {}
    for p in profiles:
        for group in {c[1] for c in p.collectives}:
            members[group] = members.get(group, 0) + 1
    for p in profiles:
        p.collectives = [(*c[:8], members[c[1]]) if c[8] <= 0 else c for c in p.collectives]
