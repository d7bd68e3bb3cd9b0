"""Reading an archive back: its files, the records of one file, every record in replay order.

The archive sink (``sinks/archive.py``) writes ``<out>/<topic>/<run_id>/p<partition>/
<first_offset>-<last_offset>.avro``; ``finished_files`` finds them and ``ArchiveFile``
names what a path says. Order (``merged``, ``records``): each partition's messages in
offset order (a partition's runs merged by offset); partitions interleaved by their
clock, the highest Kafka timestamp seen so far in the partition.

A damaged archive file costs only its damaged blocks: each is reported as a ``Loss``
(file, topic, partition, offsets) and reading goes on.
"""

from __future__ import annotations

import heapq
import io
import itertools
import math
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fastavro import reader, schemaless_reader

_FILE_RE = re.compile(r"(\d+)-(\d+)\.avro")
OPEN_SUFFIX = ".avro.tmp"  # a file the archive sink is still writing


class ArchiveError(Exception):
    """A problem with an archive directory the user can fix; the message says what to do."""



# -- files ------------------------------------------------------------------------------

@dataclass(frozen=True, order=True)
class ArchiveFile:
    """A finished archive file, located by its path: <topic>/<run_id>/p<partition>/<first>-<last>.avro."""

    topic: str
    run_id: str
    partition: int
    first_offset: int
    last_offset: int
    path: Path = field(compare=False)

    @classmethod
    def from_path(cls, path: Path) -> ArchiveFile | None:
        m = _FILE_RE.fullmatch(path.name)
        part = path.parent.name
        if m is None or not part.startswith("p") or not part[1:].isdigit():
            return None
        return cls(path.parent.parent.parent.name, path.parent.parent.name, int(part[1:]),
                   int(m.group(1)), int(m.group(2)), path)

    def relative_to(self, root: Path) -> str:
        return self.path.relative_to(root).as_posix()


def finished_files(root: Path) -> list[ArchiveFile]:
    """Every finished archive file under ``root`` (an archive directory or any part of one)."""
    root = Path(root)
    paths = [root] if root.is_file() else root.rglob("*.avro")
    files = [f for f in (ArchiveFile.from_path(p) for p in paths) if f is not None]
    return sorted(files)



@dataclass(frozen=True)
class Loss:
    """Messages of a damaged archive file that could not be read."""

    file: Path
    topic: str
    partition: int
    run_id: str
    first_offset: int  # first offset lost (inclusive)
    last_offset: int  # last offset lost (inclusive); only this run's messages in between
    reason: str

    def __str__(self) -> str:
        return (f"{self.file}: damaged ({self.reason}); offsets {self.first_offset}..{self.last_offset} of "
                f"{self.topic} partition {self.partition} (run {self.run_id}) lost")


def iter_file(f: ArchiveFile) -> Iterator[tuple[dict | None, Loss | None]]:
    """Records of one archive file in offset order, as ``(record, None)``; for each stretch that
    cannot be read, ``(None, Loss)``. A block that fails to decode loses only itself: reading
    goes on at the next block (found by the file's sync marker)."""
    last = f.first_offset - 1
    try:
        with open(f.path, "rb") as fo:
            for rec in reader(fo):
                if rec["offset"] <= last:
                    raise ValueError(f"offset {rec['offset']} after {last}")
                last = rec["offset"]
                yield rec, None
        if last < f.last_offset:
            yield None, Loss(f.path, f.topic, f.partition, f.run_id, last + 1, f.last_offset,
                             f"ends after offset {last}")
        return
    except Exception as e:  # anything fastavro / the codec raise on damaged bytes
        reason = f"{type(e).__name__}: {e}"
    yield from _salvage(f, last, reason)


def _salvage(f: ArchiveFile, last: int, reason: str) -> Iterator[tuple[dict | None, Loss | None]]:
    data = f.path.read_bytes()
    blocks = _blocks(data)
    if blocks is None:
        yield None, Loss(f.path, f.topic, f.partition, f.run_id, last + 1, f.last_offset, reason)
        return
    header, sync, segments = blocks
    gap_from = None  # first offset of a stretch lost since ``last``
    for segment in segments:
        try:
            recs = list(reader(io.BytesIO(header + segment + sync)))
        except Exception as e:  # a damaged block: its messages are lost
            gap_from = last + 1 if gap_from is None else gap_from
            reason = f"{type(e).__name__}: {e}"
            continue
        recs = [r for r in recs if r["offset"] > last]
        if not recs:
            continue
        if gap_from is not None:
            yield None, Loss(f.path, f.topic, f.partition, f.run_id, gap_from, recs[0]["offset"] - 1, reason)
            gap_from = None
        for r in recs:
            if r["offset"] > last:  # offsets only grow; anything else is damage
                last = r["offset"]
                yield r, None
    if last < f.last_offset:
        yield None, Loss(f.path, f.topic, f.partition, f.run_id, last + 1, f.last_offset, reason)


def _blocks(data: bytes) -> tuple[bytes, bytes, list[bytes]] | None:
    """(header, sync marker, the bytes of each block) of an Object Container File, or None
    when its header is unreadable."""
    if data[:4] != b"Obj\x01":
        return None
    body = io.BytesIO(data)
    body.seek(4)
    try:
        schemaless_reader(body, {"type": "map", "values": "bytes"}, None)
    except Exception:  # a damaged header: nothing can be located in this file
        return None
    end = body.tell() + 16
    if end > len(data):
        return None
    sync = data[end - 16:end]
    segments, pos = [], end
    while pos < len(data):
        nxt = data.find(sync, pos)
        if nxt < 0:
            segments.append(data[pos:])
            break
        segments.append(data[pos:nxt])
        pos = nxt + 16
    return data[:end], sync, segments


# -- progress --------------------------------------------------------------------------------

@dataclass
class Tally:
    """What a long job has done so far, for a progress display."""

    what: str
    files_total: int
    bytes_total: int  # archive file bytes to read
    files_done: int = 0
    bytes_done: int = 0
    messages: int = 0
    events: int = 0  # op events
    steps: int = 0  # StepMetrics out
    started: float = field(default_factory=time.monotonic)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


class Reporter:
    """Calls ``progress(tally)`` at most every 0.2 s (checked every 32 ticks)."""

    def __init__(self, tally: Tally, progress: Callable[[Tally], None] | None) -> None:
        self.tally, self.progress = tally, progress
        self._n = 0
        self._at = 0.0

    def tick(self, force: bool = False) -> None:
        if self.progress is None:
            return
        self._n += 1
        if force or self._n % 32 == 0:
            now = time.monotonic()
            if force or now - self._at >= 0.2:
                self._at = now
                self.progress(self.tally)


# -- choosing files and reading them in order --------------------------------------------------------------

def open_files(archive: Path, run: str) -> list[Path]:
    """The files of ``run`` the archive sink is still writing (``*.avro.tmp``)."""
    return sorted(Path(archive).glob(f"*/{run}/p*/*{OPEN_SUFFIX}"))


def missing_run(archive: Path, run: str, runs: list[str], where: str = "") -> ArchiveError:
    """The one-line error for ``run`` without a finished file in ``archive`` (``runs``: those
    there): when the sink is still writing its files, it says so and what to do."""
    pending = open_files(archive, run)
    if pending:
        return ArchiveError(
            f"run {run} has no finished archive file yet: the archive sink is still writing {len(pending)} of its "
            f"files ({pending[0]}). It finishes a run's files once every rank's Monitor has closed, after its "
            "--max-age-s (300 s by default) or when it stops: run this again then")
    return ArchiveError(f"run {run} is not in {where or archive}; runs there: "
                        f"{', '.join(runs[:20]) or 'none'}{' ...' if len(runs) > 20 else ''}")


def select_files(files: list[ArchiveFile], kind: str, topic: str | None, run: str | None, archive: Path,
                 required: bool = True) -> list[ArchiveFile]:
    """The files of the archived ``<prefix>.<kind>`` topic (``topic``: its full name, needed
    when the archive holds several prefixes) and of ``run`` (None: every run)."""
    topics = sorted({f.topic for f in files if (f.topic == topic if topic else f.topic.endswith("." + kind))})
    if not topics:
        if not required:
            return []
        if run is not None and open_files(archive, run):
            raise missing_run(archive, run, [])
        raise ArchiveError(f"no archive of {'topic ' + topic if topic else 'a ' + kind + ' topic'} under "
                           f"{archive}: point at the directory given to `profstream sink archive`")
    if len(topics) > 1:
        raise ArchiveError(f"{archive} holds several {kind} topics ({', '.join(topics)}): choose one with --topic")
    chosen = [f for f in files if f.topic == topics[0]]
    if run is not None:
        runs = sorted({f.run_id for f in chosen})
        chosen = [f for f in chosen if f.run_id == run]
        if not chosen and required:
            raise missing_run(archive, run, runs, f"the archive of {topics[0]} under {archive}")
    return chosen


def _file_records(f: ArchiveFile, on_loss: Callable[[Loss], None], tally: Tally) -> Iterator[dict]:
    for rec, loss in iter_file(f):
        if loss is not None:
            on_loss(loss)
        else:
            yield rec
    tally.files_done += 1
    tally.bytes_done += f.path.stat().st_size


def _partition_records(files: list[ArchiveFile], on_loss, tally: Tally) -> Iterator[dict]:
    """One partition's messages in offset order: each run's files in turn, runs merged."""
    by_run: dict[str, list[ArchiveFile]] = defaultdict(list)
    for f in sorted(files):
        by_run[f.run_id].append(f)
    streams = [itertools.chain.from_iterable(_file_records(f, on_loss, tally) for f in fs)
               for fs in by_run.values()]
    last = -1
    for rec in heapq.merge(*streams, key=lambda r: r["offset"]):
        if rec["offset"] > last:  # files that overlap (two sinks on one topic) hold a message twice
            last = rec["offset"]
            yield rec


def _clocked(partition: int, records: Iterator[dict]) -> Iterator[tuple[float, int, dict]]:
    now = -math.inf
    for rec in records:
        now = max(now, rec["timestamp"] / 1000.0)
        yield now, partition, rec


def merged(files: list[ArchiveFile], on_loss: Callable[[Loss], None], tally: Tally) -> Iterator[tuple[float, int, dict]]:
    """(clock, partition, record) of every archived message of ``files`` in replay order."""
    parts: dict[int, list[ArchiveFile]] = defaultdict(list)
    for f in files:
        parts[f.partition].append(f)
    streams = [_clocked(p, _partition_records(fs, on_loss, tally)) for p, fs in sorted(parts.items())]
    return heapq.merge(*streams, key=lambda t: (t[0], t[1]))


def records(files: list[ArchiveFile], on_loss: Callable[[Loss], None], tally: Tally | None = None,
            progress: Callable[[Tally], None] | None = None) -> Iterator[dict]:
    """Every archived record of ``files`` in replay order (see the module docstring)."""
    tally = tally or Tally("read", len(files), sum(f.path.stat().st_size for f in files))
    reporter = Reporter(tally, progress)
    for _now, _p, rec in merged(files, on_loss, tally):
        tally.messages += 1
        reporter.tick()
        yield rec
    reporter.tick(force=True)


def archive_files(archive: Path | str, kind: str = "raw", topic: str | None = None,
                  run: str | None = None) -> list[ArchiveFile]:
    """The finished files of the archived ``kind`` topic (and ``run``) under ``archive``."""
    archive = Path(archive)
    if not archive.exists():
        raise ArchiveError(f"{archive} does not exist: give the directory written by `profstream sink archive`")
    return select_files(finished_files(archive), kind, topic, run, archive)
