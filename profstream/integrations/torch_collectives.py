"""Collective attributes of a captured torch step: which call of its process group each
collective op is, and its message size.

What torch (2.x, gloo on CPU) records: the c10d op on the calling thread (``c10d::allreduce_``,
the call being queued) and an annotation ``gloo:all_reduce`` on gloo's worker thread that
spans the call as it runs, waiting for the other ranks included; nothing names the call's
sequence number ("Seq", "Process Group Name" appear only where a backend records
``record_param_comms``, which gloo does not). The process group counts its calls itself
(``_get_sequence_number_for_group``): read on the training thread at the end of a
captured step, it numbers the step's collective annotations in start order (gloo runs a
group's calls in the order they were queued): the last is the group's count, the one
before one less, and so on. Every rank numbers its calls alike, so (group, seq) names the
same call on every rank. Only the default group is numbered; a run with more process
groups gets no collective attributes (one log line), as their calls cannot be told apart.

Message sizes come from the annotations' input shapes, recorded only with the
``collective_bytes`` option (torch.profiler ``record_shapes``, a cost on every op).
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, NamedTuple

import numpy as np

log = logging.getLogger("profstream.torch")

# the annotation a backend puts around a collective as it runs: "gloo:all_reduce", "nccl:all_gather"
_RUNNING_CALL = re.compile(r"^(gloo|nccl):([a-z_]+)$")
_GATHERS = ("all_gather", "allgather", "gather")
ITEM_BYTES = {"float": 4, "double": 8, "half": 2, "c10::half": 2, "bfloat16": 2, "c10::bfloat16": 2, "int": 4,
               "long": 8, "short": 2, "char": 1, "byte": 1, "signed char": 1, "unsigned char": 1, "bool": 1,
               "complexfloat": 8, "c10::complex<float>": 8, "complexdouble": 16, "c10::complex<double>": 16,
               "float8_e4m3fn": 1, "float8_e5m2": 1}  # the profiler's and the Flight Recorder's dtype names


class GroupCount(NamedTuple):
    """The default process group and its call count at the end of a step."""

    name: str
    size: int
    seq: int


def default_group_count() -> GroupCount | None:
    """The default process group's count of calls now (training thread), or None where
    torch.distributed is not in use or more than one group exists."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    c10d = dist.distributed_c10d
    groups = getattr(getattr(c10d, "_world", None), "pg_map", None)
    if groups is not None and len(groups) > 1:
        _warn_once("more than one process group: collectives are captured without their sequence numbers, "
                   "so the processors cannot match them across ranks")
        return None
    pg = c10d._get_default_group()
    try:
        seq = pg._get_sequence_number_for_group()
    except (AttributeError, RuntimeError) as e:  # a backend without sequence numbers
        _warn_once(f"the process group has no sequence numbers ({e}): collectives are not matched across ranks")
        return None
    return GroupCount(str(pg.group_name), int(pg.size()), int(seq))


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.info("profstream: %s", message)


class CollectiveRow(NamedTuple):
    """One collective call of this rank, as Monitor.collective takes it (from a captured
    step's annotations here, or from torch's Flight Recorder: torch_flight.py)."""

    collective: str
    group: str
    seq: int
    start_ns: int
    dur_ns: int  # -1: the backend records no end
    group_size: int
    in_bytes: int
    out_bytes: int
    dtype: str


def collective_rows(names: list[str], start_ns: np.ndarray, dur_ns: np.ndarray, count: GroupCount,
                    sizes: list[tuple[int, str]] | None = None) -> list[CollectiveRow]:
    """The collective calls among a step's ops (epoch-clock columns), numbered back from
    the group's ``count`` at the step's end. ``sizes``: (input bytes, dtype) of each call
    in start order (``message_sizes``), or None (sizes unknown, -1)."""
    at = [i for i, n in enumerate(names) if _RUNNING_CALL.match(n)]
    at.sort(key=lambda i: int(start_ns[i]))
    if sizes is not None and len(sizes) != len(at):
        sizes = None  # the two readings disagree: no sizes rather than wrong ones
    rows = []
    first = count.seq - len(at) + 1
    for k, i in enumerate(at):
        collective = _RUNNING_CALL.match(names[i]).group(2)
        in_bytes, dtype = sizes[k] if sizes is not None else (-1, "")
        out_bytes = in_bytes * count.size if in_bytes >= 0 and collective in _GATHERS else in_bytes
        rows.append(CollectiveRow(collective, count.name, first + k, int(start_ns[i]), int(dur_ns[i]), count.size,
                                  in_bytes, out_bytes, dtype))
    return rows


def message_sizes(events: list[Any]) -> list[tuple[int, str]]:
    """(input bytes, dtype) of each running-call annotation among a capture's kineto
    events, in start order; -1 where the shapes were not recorded."""
    calls = sorted((e.start_ns(), e) for e in events if _RUNNING_CALL.match(e.name()))
    out = []
    for _start, e in calls:
        shapes, dtypes = e.shapes(), e.dtypes()
        size, dtype = 0, ""
        for shape, dt in zip(shapes, dtypes):
            item = ITEM_BYTES.get(dt.lower()) if dt else None
            if item is None:
                continue
            size += item * math.prod(shape)
            dtype = dtype or dt
        out.append((size if dtype else -1, dtype))
    return out
