"""``profstream spool publish / show``: send a spool to Kafka later, or see what it holds.

A spool directory (a Monitor's ``spool_dir``) holds ``<run_id>/rank-<rank>/`` folders of
segment files (``spool.py``). Publishing sends each rank's records in their order, with
their own key, to ``<prefix>.raw`` through an idempotent producer, and takes them off
the spool as Kafka acknowledges them (``--keep`` leaves the spool as it was: a later
publish sends it again). A record may reach Kafka twice (a publish stopped half-way and
run again, or ``--keep``); the processors count every batch once by producer id and seq.
A rank folder that a live Monitor holds is skipped with a line: that Monitor sends it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from profstream.producers.spool import Spool, SpoolError, list_segments

# At most this many bytes handed to librdkafka and not yet acknowledged.
INFLIGHT_BYTES = 32 * 1024 * 1024


@dataclass
class RankSpool:
    """What one rank's spool folder holds (``show``) or what publishing it did."""

    run_id: str
    rank: int
    path: Path
    records: int = 0
    bytes: int = 0
    ops: int = 0
    samples: int = 0
    segments: int = 0
    corrupt_regions: int = 0
    corrupt_bytes: int = 0
    skipped: str | None = None  # why it was not read (a live Monitor holds it)
    refused: int = 0  # records Kafka refused for good (counted as lost)
    errors: list[str] = field(default_factory=list)


def rank_folders(root: str | Path, run_id: str | None = None) -> list[tuple[str, int, Path]]:
    """(run id, rank, folder) of every rank spool under ``root``, in name order."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory: give the spool_dir the Monitor wrote to")
    out = []
    for run in sorted(p for p in root.iterdir() if p.is_dir()):
        if run_id is not None and run.name != run_id:
            continue
        for rank in sorted(run.iterdir(), key=lambda p: p.name):
            if rank.is_dir() and rank.name.startswith("rank-") and rank.name[5:].isdigit():
                out.append((run.name, int(rank.name[5:]), rank))
    return sorted(out, key=lambda t: (t[0], t[1]))


def _read_all(spool: Spool, out: RankSpool, each: Callable | None = None) -> None:
    while (record := spool.next_record()) is not None:
        spool.advance(record)
        out.records += 1
        out.bytes += len(record.value)
        out.ops += record.ops
        out.samples += record.samples
        if each is not None:
            each(record)
    out.corrupt_regions, out.corrupt_bytes = spool.corrupt_regions, spool.corrupt_bytes


def show_spool(root: str | Path, run_id: str | None = None) -> list[RankSpool]:
    """What each rank's spool under ``root`` still has to send (every record read and
    checked; a torn or corrupted stretch is counted)."""
    out = []
    for run, rank, path in rank_folders(root, run_id):
        info = RankSpool(run, rank, path, segments=len(list_segments(path)))
        try:
            spool = Spool(path, 1 << 62, write=False)
        except SpoolError as e:
            info.skipped = str(e)
        else:
            try:
                _read_all(spool, info)
            finally:
                spool.close()
        out.append(info)
    return out


def publish_spool(root: str | Path, bootstrap: str, topic_prefix: str = "profstream", run_id: str | None = None,
                  keep: bool = False, timeout_s: float = 120.0) -> list[RankSpool]:
    """Send every rank spool under ``root`` (or ``run_id``'s) to ``<topic_prefix>.raw``.
    Raises ConnectionError when no broker answers, TimeoutError when Kafka has not
    acknowledged a rank's records within ``timeout_s`` (what it acknowledged is off the
    spool; the rest stays)."""
    from profstream.kafka.clients import make_native_producer
    from profstream.kafka.topics import Topics, ensure_topics

    folders = rank_folders(root, run_id)
    if not folders:
        return []
    topics = Topics(topic_prefix)
    producer = make_native_producer(bootstrap, bootstrap_timeout_ms=10000)
    try:
        ensure_topics(bootstrap, topics)
        return [_publish_rank(producer, topics.raw, run, rank, path, keep, timeout_s)
                for run, rank, path in folders]
    finally:
        producer.close(timeout=5.0)


def _publish_rank(producer, topic: str, run: str, rank: int, path: Path, keep: bool, timeout_s: float) -> RankSpool:
    info = RankSpool(run, rank, path, segments=len(list_segments(path)))
    try:
        spool = Spool(path, 1 << 62, write=False)
    except SpoolError as e:
        info.skipped = str(e)
        return info
    state = {"inflight": 0, "settled": 0, "acked": 0}

    def done(error, size: int) -> None:
        state["inflight"] -= size
        state["settled"] += 1
        if error is None:
            state["acked"] += 1
        else:
            info.refused += 1
            if len(info.errors) < 5:
                info.errors.append(str(error))

    deadline = time.monotonic() + timeout_s

    def send(record) -> None:
        while state["inflight"] >= INFLIGHT_BYTES:
            producer.flush(0.1)
            _check(deadline, info)
        while True:
            try:
                producer.send(topic, record.value, record.key, partial(done, size=len(record.value)))
                break
            except BufferError:
                producer.flush(0.1)
                _check(deadline, info)
        state["inflight"] += len(record.value)
        if not keep:
            spool.settle(state["settled"] - spool.records_settled)

    try:
        _read_all(spool, info, send)
        while state["settled"] < info.records:
            producer.flush(0.5)
            _check(deadline, info)
        if not keep:
            spool.settle(state["settled"] - spool.records_settled)
    finally:
        spool.close()
    if not keep and not spool.backlog:
        _remove(path)
    return info


def _check(deadline: float, info: RankSpool) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"Kafka did not acknowledge the records of {info.run_id} rank {info.rank} in time: what it "
                           f"acknowledged is off the spool at {info.path}; publish again to send the rest")


def _remove(path: Path) -> None:
    for p in path.iterdir():
        p.unlink(missing_ok=True)
    path.rmdir()
    try:
        path.parent.rmdir()  # the run's folder, once no rank is left in it
    except OSError:
        pass
