"""RunStepMetrics v5's per-rank columns: packed zigzag varints, written and read as arrays.

v4 listed every rank three times (``step_times_ns``, ``collective_ranks``,
``clock_offsets``): a map entry or a record per rank, built and encoded one by one, most
of the run stage's cost per rank (docs/benchmarks.md §40). v5 carries the same values as
columns (``step_times``, ``rank_collectives``, ``rank_clocks``), each a ``bytes`` field
holding the values as Avro longs one after the other (zigzag varints, as in an Avro
``array<long>`` block), the ranks as the difference from the rank before: numpy writes
and reads them whole, and small values take few bytes (about half v4's size at 16,384
ranks with collectives). ``expanded`` turns a decoded v5 record into v4's shape, which is
what every reader of RunStepMetrics reads (``codec`` upgrades v5 with it); ``packed``
does the reverse for a record built in v4's shape.
"""

from __future__ import annotations

import numpy as np

_SEVEN = np.arange(10, dtype=np.uint64) * np.uint64(7)  # the shift of each byte of a varint
_WIDER = np.uint64(1) << _SEVEN[1:]  # zigzag values from which a varint takes 2, 3, ... 10 bytes
_EMPTY_STEP_TIMES = {"ranks": b"", "step_time_ns": b""}
NO_RANK_COLLECTIVES = {"names": [], "ranks": b"", "wait_ns": b"", "transfer_ns": b"", "slowest_ns": b"",
                       "slowest_collective": b""}
NO_RANK_CLOCKS = {"ranks": b"", "offset_ns": b"", "error_ns": b""}


def pack_longs(values: np.ndarray) -> bytes:
    """``values`` (int64) as Avro longs one after the other."""
    v = np.asarray(values, np.int64)
    if not len(v):
        return b""
    z = ((v << 1) ^ (v >> 63)).view(np.uint64)
    width = np.searchsorted(_WIDER, z, "right") + 1  # bytes of each varint
    k = int(width.max())
    if k == 1:
        return z.astype(np.uint8).tobytes()
    ends = np.cumsum(width)
    starts = ends - width
    out = np.empty(int(ends[-1]), np.uint8)
    for i in range(k):  # the i-th byte of every varint that has one
        at, zi, wi = starts, z, width
        if i:
            has = width > i
            if not has.all():
                at, zi, wi = starts[has], z[has], width[has]
            at = at + i
        byte = (zi >> _SEVEN[i]).astype(np.uint8) & np.uint8(0x7F)
        byte |= (wi > i + 1).view(np.uint8) << np.uint8(7)  # more bytes follow
        out[at] = byte
    return out.tobytes()


def unpack_longs(data: bytes) -> np.ndarray:
    """The Avro longs of ``data`` one after the other, as int64; ValueError where it is not
    whole varints of at most 10 bytes."""
    b = np.frombuffer(data, np.uint8)
    if not len(b):
        return np.zeros(0, np.int64)
    last = b < 0x80
    if not last[-1]:
        raise ValueError("packed longs end inside a varint")
    ends = np.flatnonzero(last)
    starts = np.empty(len(ends), np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    width = ends - starts + 1
    if width.max() > 10:
        raise ValueError("a packed long longer than 10 bytes")
    if width.max() == 1:
        z = b.astype(np.uint64)
    else:
        at = np.arange(len(b)) - np.repeat(starts, width)
        z = np.bitwise_or.reduceat((b & 0x7F).astype(np.uint64) << _SEVEN[at], starts)
    return (z >> np.uint64(1)).view(np.int64) ^ -(z & np.uint64(1)).view(np.int64)


def pack_ranks(ranks: np.ndarray) -> bytes:
    """Ranks as packed longs of each one's difference from the one before (1 byte a rank in order)."""
    r = np.asarray(ranks, np.int64)
    return pack_longs(np.diff(r, prepend=np.int64(0))) if len(r) else b""


def unpack_ranks(data: bytes) -> np.ndarray:
    """The ranks ``pack_ranks`` wrote."""
    return np.cumsum(unpack_longs(data))


def step_time_columns(ranks: np.ndarray, step_time_ns: np.ndarray) -> dict:
    """v5 ``step_times`` of the ranks (by rank) and their step times."""
    return {"ranks": pack_ranks(ranks), "step_time_ns": pack_longs(step_time_ns)}


def rank_collective_columns(names: list[str], ranks: np.ndarray, wait_ns: np.ndarray, transfer_ns: np.ndarray,
                            slowest_ns: np.ndarray, slowest: np.ndarray, timed: np.ndarray) -> dict:
    """v5 ``rank_collectives``: per rank, its wait, transfer, slowest call's time and name
    (an index in ``names``); where ``timed`` is False (no call of the rank has an end) the
    last three are not measured (written 0, 0, -1)."""
    timed = np.asarray(timed, bool)
    return {"names": list(names), "ranks": pack_ranks(ranks), "wait_ns": pack_longs(wait_ns),
            "transfer_ns": pack_longs(np.where(timed, transfer_ns, 0)),
            "slowest_ns": pack_longs(np.where(timed, slowest_ns, 0)),
            "slowest_collective": pack_longs(np.where(timed, slowest, -1))}


def rank_clock_columns(ranks: np.ndarray, offset_ns: np.ndarray, error_ns: np.ndarray) -> dict:
    """v5 ``rank_clocks``: per rank, its clock offset and error bound."""
    return {"ranks": pack_ranks(ranks), "offset_ns": pack_longs(offset_ns), "error_ns": pack_longs(error_ns)}


def _columns(record: dict, names: tuple[str, ...]) -> list[list[int]]:
    """The columns ``names`` of a v5 column record (ranks first), as lists of one length."""
    cols = [unpack_ranks(record[names[0]]).tolist()] + [unpack_longs(record[n]).tolist() for n in names[1:]]
    if any(len(c) != len(cols[0]) for c in cols[1:]):
        raise ValueError(f"RunStepMetrics columns {', '.join(names)} differ in length")
    return cols


def expanded(record: dict) -> dict:
    """A decoded RunStepMetrics v5 in v4's shape (the shape its readers read)."""
    out = {k: v for k, v in record.items() if k not in ("step_times", "rank_collectives", "rank_clocks")}
    ranks, times = _columns(record["step_times"], ("ranks", "step_time_ns"))
    out["step_times_ns"] = dict(zip(map(str, ranks), times))
    rc = record["rank_collectives"]
    names = rc["names"]
    rows = []
    for r, w, t, d, c in zip(*_columns(rc, ("ranks", "wait_ns", "transfer_ns", "slowest_ns", "slowest_collective"))):
        if c < 0:
            rows.append({"rank": r, "wait_ns": w, "transfer_ns": None, "slowest_collective": None,
                         "slowest_ns": None})
        else:
            rows.append({"rank": r, "wait_ns": w, "transfer_ns": t, "slowest_collective": names[c],
                         "slowest_ns": d})
    out["collective_ranks"] = rows
    out["clock_offsets"] = [{"rank": r, "offset_ns": o, "error_ns": e}
                            for r, o, e in zip(*_columns(record["rank_clocks"], ("ranks", "offset_ns", "error_ns")))]
    return out


def packed(record: dict) -> dict:
    """A RunStepMetrics in v4's shape (``step_times_ns``, ``collective_ranks``,
    ``clock_offsets``) as v5's record; ValueError where a rank's transfer, slowest call and
    its time are not all measured or all null (v5 says them together)."""
    out = {k: v for k, v in record.items() if k not in ("step_times_ns", "collective_ranks", "clock_offsets")}
    times = record.get("step_times_ns") or {}
    out["step_times"] = step_time_columns(np.array([int(r) for r in times], np.int64),
                                          np.fromiter(times.values(), np.int64, len(times))) if times \
        else dict(_EMPTY_STEP_TIMES)
    rows = record.get("collective_ranks") or []
    if rows:
        nulls = [(x["transfer_ns"] is None, x["slowest_collective"] is None, x["slowest_ns"] is None) for x in rows]
        if any(len(set(n)) != 1 for n in nulls):
            raise ValueError("a rank's transfer_ns, slowest_collective and slowest_ns are null together or not at all")
        names: dict[str, int] = {}
        slowest = [-1 if x["slowest_collective"] is None else names.setdefault(x["slowest_collective"], len(names))
                   for x in rows]
        timed = np.array([not n[0] for n in nulls], bool)
        out["rank_collectives"] = rank_collective_columns(
            list(names), np.array([x["rank"] for x in rows], np.int64), np.array([x["wait_ns"] for x in rows], np.int64),
            np.array([x["transfer_ns"] or 0 for x in rows], np.int64),
            np.array([x["slowest_ns"] or 0 for x in rows], np.int64), np.array(slowest, np.int64), timed)
    else:
        out["rank_collectives"] = dict(NO_RANK_COLLECTIVES)
    clocks = record.get("clock_offsets") or []
    out["rank_clocks"] = rank_clock_columns(*(np.array([c[f] for c in clocks], np.int64)
                                              for f in ("rank", "offset_ns", "error_ns"))) if clocks \
        else dict(NO_RANK_CLOCKS)
    return out


def is_packed(record: dict) -> bool:
    """Whether a RunStepMetrics record is v5's (columns) rather than v4's shape."""
    return "step_times" in record
