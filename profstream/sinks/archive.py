"""The archive sink: every message of the raw (and steps) topic, in Avro Object Container Files.

Layout (one file holds one run's messages of one partition, in offset order)::

    <out>/<topic>/<run_id>/p<partition>/<first_offset>-<last_offset>.avro
    <out>/index.jsonl      one line per finished file: offsets, runs, ranks, steps
    <out>/.lock            one archive sink per directory

A message's run is the part of its key before the last "/"; a key that is missing or is
not a valid name (``config.check_name``) goes under ``_unknown``, so no key can reach
outside ``<out>``. Each record is ``ARCHIVE_SCHEMA``: the message as it was on the wire.

A run's files are finished (renamed, indexed) by size, by age, when the sink stops, and as
soon as the run ends: every rank of it the sink has seen on a topic sent its end mark (raw
topic) or its RankEnd (steps topic), so that a report can be made of it seconds later.

Crash safety: a file is written as ``<first_offset>.avro.tmp``, fsynced, renamed and its
directory fsynced; only then does ``durable_offsets`` let the consumer commit past its
messages. A crash before the rename leaves a ``.tmp`` file (removed at start-up; its
messages were never committed, so they come again). A crash between the rename and the
commit re-delivers messages already in a finished file: at start-up the sink reads the
highest archived offset of every (topic, run, partition) from the file names and skips
those messages.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from fastavro import parse_schema, schemaless_reader
from fastavro.schema import to_parsing_canonical_form
from fastavro.write import Writer

from profstream.config import ConfigError, check_name
from profstream.kafka.connection import Connection
from profstream.offline.archive import (
    OPEN_SUFFIX,
    ArchiveError,
    ArchiveFile,
    finished_files,
    iter_file,
)
from profstream.schema.batch import END_MARK
from profstream.schema.codec import HEADER_LEN, MAGIC, SCHEMAS, DecodeError, decode_any
from profstream.sinks.runner import SinkLoop

log = logging.getLogger("profstream.archive")

ARCHIVE_SCHEMA = {
    "type": "record", "name": "ArchivedMessage", "namespace": "profstream.archive",
    "doc": "One Kafka message as it was on the wire.",
    "fields": [
        {"name": "topic", "type": "string"},
        {"name": "partition", "type": "int"},
        {"name": "offset", "type": "long"},
        {"name": "timestamp", "type": "long", "doc": "Kafka record timestamp, ms since the epoch"},
        {"name": "key", "type": ["null", "bytes"]},
        {"name": "value", "type": ["null", "bytes"]},
        {"name": "headers", "default": [], "type": {"type": "array", "items": {
            "type": "record", "name": "Header",
            "fields": [{"name": "key", "type": "string"}, {"name": "value", "type": ["null", "bytes"]}]}}},
    ],
}
_PARSED = parse_schema(ARCHIVE_SCHEMA)

UNKNOWN_RUN = "_unknown"  # starts with "_": never a valid run id, so never a real run's directory
INDEX_FILE = "index.jsonl"
LOCK_FILE = ".lock"
TMP_SUFFIX = OPEN_SUFFIX
CODECS = ("zstandard", "deflate", "null")
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_AGE_S = 300.0
BLOCK_BYTES = 1024 * 1024  # uncompressed bytes per Avro block

_TOPIC_RE = re.compile(r"[A-Za-z0-9._-]+")


# -- layout ------------------------------------------------------------------------------

def run_of_key(key: bytes | None) -> str:
    """The run directory of a message: its key before the last "/" (the whole key when it has none,
    as on the control topic), if that is a valid name."""
    if not key:
        return UNKNOWN_RUN
    try:
        run = (key.rpartition(b"/")[0] if b"/" in key else key).decode()  # the control topic's key is the run
        return check_name(run, "run id")
    except (UnicodeDecodeError, ConfigError):
        return UNKNOWN_RUN


def _topic_dir(topic: str) -> str:
    if not _TOPIC_RE.fullmatch(topic) or topic in (".", ".."):
        raise ValueError(f"topic name {topic!r} cannot be a directory name")
    return topic


# -- what a message holds, for the index ---------------------------------------------------

def _batch_projection(sv) -> dict:
    """A reader schema of EventBatch holding only run_id, rank and each section's step column:
    fastavro skips the rest (op names, the other columns) without building objects."""
    schema = json.loads(to_parsing_canonical_form(sv.parsed))
    keep = []
    for f in schema["fields"]:
        if f["name"] in ("run_id", "rank"):
            keep.append(f)
        elif isinstance(f["type"], dict) and any(c["name"] == "step" for c in f["type"].get("fields", ())):
            f["type"]["fields"] = [c for c in f["type"]["fields"] if c["name"] in ("count", "step")]
            keep.append(f)
    schema["fields"] = keep
    return parse_schema(schema)


_BATCH_READERS = {sv.header: (sv.parsed, _batch_projection(sv)) for sv in SCHEMAS.values() if sv.name == "EventBatch"}
_I64 = np.dtype("<i8")


class MessageSteps(NamedTuple):
    """What the index (and the run-end check) reads of one message."""

    run_id: str
    rank: int | None
    lo: int | None  # lowest and highest step of its step-bearing events (None: none)
    hi: int | None
    ended: bool  # the rank ended: a batch with its end mark, or a RankEnd


def message_steps(value: bytes | None) -> MessageSteps | None:
    """Run, rank, lowest and highest step of a profstream message, and whether it ends its
    rank; None when it cannot be decoded. Steps are None for a batch without step-bearing
    events (an end mark is no step)."""
    if not value:
        return None
    readers = _BATCH_READERS.get(value[:HEADER_LEN])
    if readers is not None:
        try:
            body = io.BytesIO(value)
            body.seek(HEADER_LEN)
            rec = schemaless_reader(body, readers[0], readers[1])
            lo = hi = None
            ended = False
            for name, section in rec.items():
                if isinstance(section, dict) and section["count"]:
                    steps = np.frombuffer(section["step"], _I64)
                    if name == "steps" and END_MARK in steps:
                        ended = True
                        steps = steps[steps != END_MARK]
                        if not len(steps):
                            continue
                    a, b = int(steps.min()), int(steps.max())
                    lo = a if lo is None else min(lo, a)
                    hi = b if hi is None else max(hi, b)
            return MessageSteps(rec["run_id"], rec["rank"], lo, hi, ended)
        except Exception:  # garbage after a valid header: fastavro raises many types; counted
            return None
    if value[:2] != MAGIC:
        return None
    try:
        name, record = decode_any(value)
    except DecodeError:
        return None
    if name == "RankProgress":  # where a rank is now: no events of a step
        return MessageSteps(record["run_id"], record["rank"], None, None, False)
    step = record.get("last_step") if name == "RankEnd" else record.get("step")
    return MessageSteps(record.get("run_id", ""), record.get("rank"), step, step, name == "RankEnd")


class FileSummary:
    """What the index says about one file, accumulated message by message."""

    __slots__ = ("messages", "value_bytes", "first_ts", "last_ts", "runs", "ranks", "lo", "hi", "undecodable")

    def __init__(self) -> None:
        self.messages = self.value_bytes = self.undecodable = 0
        self.first_ts = self.last_ts = None
        self.runs: set[str] = set()
        self.ranks: set[int] = set()
        self.lo = self.hi = None

    def add(self, timestamp: int, value: bytes | None) -> MessageSteps | None:
        """Count one message in; what it holds (None: undecodable)."""
        self.messages += 1
        self.value_bytes += len(value) if value else 0
        if self.first_ts is None:
            self.first_ts = timestamp
        self.last_ts = timestamp
        found = message_steps(value)
        if found is None:
            self.undecodable += 1
            return None
        run, rank, lo, hi, _ended = found
        self.runs.add(run)
        if rank is not None:
            self.ranks.add(rank)
        if lo is not None:
            self.lo = lo if self.lo is None else min(self.lo, lo)
            self.hi = hi if self.hi is None else max(self.hi, hi)
        return found

    def entry(self, f: ArchiveFile, root: Path, codec: str) -> dict:
        return {"file": f.relative_to(root), "topic": f.topic, "run_id": f.run_id, "partition": f.partition,
                "first_offset": f.first_offset, "last_offset": f.last_offset, "messages": self.messages,
                "bytes": f.path.stat().st_size, "value_bytes": self.value_bytes,
                "first_timestamp_ms": self.first_ts, "last_timestamp_ms": self.last_ts,
                "runs": sorted(self.runs), "ranks": sorted(self.ranks),
                "steps": None if self.lo is None else [self.lo, self.hi],
                "undecodable": self.undecodable, "codec": codec}


# -- files on disk -----------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(root: Path, path: Path) -> None:
    """mkdir -p whose new entries are durable (each new directory's parent is fsynced)."""
    if not path.resolve().is_relative_to(root):
        raise ValueError(f"{path} is outside the archive {root}")
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        _fsync_dir(d.parent)


class ArchiveIndex:
    """``index.jsonl``: one JSON line per finished file, appended with one write and fsynced."""

    def __init__(self, root: Path) -> None:
        self.path = root / INDEX_FILE

    def entries(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s: skipping a damaged line", self.path)
        return out

    def repair(self) -> None:
        """Cut a line left half-written by a crash, so that the next append starts clean."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
                os.fsync(f.fileno())

    def append(self, entry: dict) -> None:
        line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)


class _OpenFile:
    """The file being written for one (topic, run, partition)."""

    def __init__(self, directory: Path, topic: str, run_id: str, partition: int, first_offset: int,
                 codec: str, level: int | None, opened_at: float) -> None:
        self.topic, self.run_id, self.partition = topic, run_id, partition
        self.first_offset = self.last_offset = first_offset
        self.opened_at = opened_at
        self.tmp = directory / f"{first_offset}{TMP_SUFFIX}"
        self.fo = open(self.tmp, "wb")
        try:
            self.writer = Writer(self.fo, _PARSED, codec=codec, sync_interval=BLOCK_BYTES, compression_level=level,
                                 metadata={"profstream.topic": topic, "profstream.run_id": run_id,
                                           "profstream.partition": str(partition)})
        except OSError:  # the disk refused the header: no file is left behind
            self.abandon()
            raise
        self.summary = FileSummary()

    @property
    def size(self) -> int:
        """Bytes on disk plus the pending (uncompressed) block: an upper bound of the final size."""
        return self.fo.tell() + self.writer.io.tell()

    def append(self, rec: Any) -> MessageSteps | None:
        headers = [{"key": k, "value": v} for k, v in rec.headers] if rec.headers else []
        self.writer.write({"topic": rec.topic, "partition": rec.partition, "offset": rec.offset,
                           "timestamp": rec.timestamp, "key": rec.key, "value": rec.value, "headers": headers})
        self.last_offset = rec.offset
        return self.summary.add(rec.timestamp, rec.value)

    def finish(self) -> Path:
        self.writer.flush()
        self.fo.flush()
        os.fsync(self.fo.fileno())
        self.fo.close()
        final = self.tmp.with_name(f"{self.first_offset}-{self.last_offset}.avro")
        os.rename(self.tmp, final)
        _fsync_dir(final.parent)
        return final

    def abandon(self) -> None:
        """Drop the file: closed and removed, whatever the disk says."""
        try:
            self.fo.close()
        except OSError:  # a full disk refuses what its buffer held: closed all the same
            pass
        self.tmp.unlink(missing_ok=True)


# -- the sink ----------------------------------------------------------------------------

@dataclass
class ArchiveStats:
    messages: int = 0  # archived (written to a file)
    value_bytes: int = 0
    files: int = 0  # finished
    skipped: int = 0  # already in a finished file (re-delivered after a crash)
    orphans_removed: int = 0  # *.tmp files of a crashed sink, at start-up
    reindexed: int = 0  # finished files missing from the index, at start-up
    runs_ended: int = 0  # times a run's files were finished because all its ranks ended


class ArchiveSink:
    """Writes every handled message into its (topic, run, partition) file; rotates files by
    size and age; reports as durable only what is in finished files."""

    def __init__(self, out_dir: Path | str, codec: str = "zstandard", max_bytes: int = DEFAULT_MAX_BYTES,
                 max_age_s: float = DEFAULT_MAX_AGE_S, compression_level: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if codec not in CODECS:
            raise ValueError(f"codec {codec!r}: expected one of {', '.join(CODECS)}")
        if max_bytes < 1 or max_age_s <= 0:
            raise ValueError("max_bytes and max_age_s must be > 0")
        self.root = Path(out_dir).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.codec, self.level = codec, compression_level
        self.max_bytes, self.max_age_s = max_bytes, max_age_s
        self.clock = clock
        self.stats = ArchiveStats()
        self._lock_fd = _lock(self.root)
        self.index = ArchiveIndex(self.root)
        self._open: dict[tuple[str, str, int], _OpenFile] = {}
        self._next: dict[tuple[str, int], int] = {}  # (topic, partition) -> next offset handled
        self._unwritten: dict[tuple[str, int], int] = {}  # (topic, partition) -> first offset of a file the disk refused
        self.archived: dict[tuple[str, str, int], int] = {}  # (topic, run, partition) -> last archived offset
        # (topic, run) -> (ranks seen, ranks that ended) while the run has files open on the topic
        self._ranks: dict[tuple[str, str], tuple[set[int], set[int]]] = {}
        self._recover()

    def _recover(self) -> None:
        for tmp in self.root.glob(f"*/*/p*/*{TMP_SUFFIX}"):
            log.info("removing %s, left by a crash (its messages were never committed)", tmp)
            tmp.unlink()
            self.stats.orphans_removed += 1
        files = finished_files(self.root)
        for f in files:
            k = (f.topic, f.run_id, f.partition)
            self.archived[k] = max(self.archived.get(k, -1), f.last_offset)
        self.index.repair()
        indexed = {e.get("file") for e in self.index.entries()}
        for f in files:
            if f.relative_to(self.root) not in indexed:  # renamed, then crashed before the index line
                summary = FileSummary()
                for rec, _ in iter_file(f):
                    if rec is not None:
                        summary.add(rec["timestamp"], rec["value"])
                self.index.append(summary.entry(f, self.root, self.codec))
                self.stats.reindexed += 1

    # -- the SinkLoop interface --

    def handle(self, records: Sequence[Any]) -> None:
        with self._writing():
            for rec in records:
                self._append(rec)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """File writes whose failure (a full disk, a lost mount, permissions) is the user's
        to fix: one ArchiveError that says what to do. Nothing is lost: what is not in a
        finished file was never committed, and a restarted sink reads it again."""
        try:
            yield
        except OSError as e:
            raise ArchiveError(f"cannot write the archive in {self.root} ({e.strerror or e}): free space there or "
                               "choose another directory, then start the sink again; nothing is lost, it goes on "
                               "from its last finished file") from None

    def _append(self, rec: Any) -> None:
        run = run_of_key(rec.key)
        k = (rec.topic, run, rec.partition)
        if rec.offset <= self.archived.get(k, -1):
            self.stats.skipped += 1
            self._next[(rec.topic, rec.partition)] = rec.offset + 1
            return
        f = self._open.get(k)
        if f is not None and f.size + len(rec.value or b"") + len(rec.key or b"") > self.max_bytes:
            self._finish(k)
            f = None
        if f is None:
            directory = self.root / _topic_dir(rec.topic) / run / f"p{int(rec.partition)}"
            _make_dirs(self.root, directory)
            f = self._open[k] = _OpenFile(directory, rec.topic, run, rec.partition, rec.offset,
                                          self.codec, self.level, self.clock())
        found = f.append(rec)
        self._next[(rec.topic, rec.partition)] = rec.offset + 1  # once it is in a file: never commit past a failed write
        self.stats.messages += 1
        self.stats.value_bytes += len(rec.value) if rec.value else 0
        if found is not None and found.rank is not None:
            seen, ended = self._ranks.setdefault((rec.topic, run), (set(), set()))
            seen.add(found.rank)
            if found.ended:
                ended.add(found.rank)
                if seen <= ended:
                    self._run_ended(run)

    def _run_ended(self, run: str) -> None:
        """Every rank of ``run`` seen on a topic ended: finish the run's open files, of every
        topic (its last StepMetrics and RankEnds that come later start a file of their own,
        finished when they are all there)."""
        for k in [k for k in self._open if k[1] == run]:
            self._finish(k)
        self.stats.runs_ended += 1

    def durable_offsets(self) -> dict[tuple[str, int], int]:
        """Per (topic, partition), the first offset not yet in a finished file."""
        out = dict(self._next)
        for (topic, _run, part), f in self._open.items():
            out[(topic, part)] = min(out[(topic, part)], f.first_offset)
        for part, first in self._unwritten.items():
            out[part] = min(out[part], first)
        return out

    def tick(self) -> None:
        """Before each poll (SinkLoop): finish files by age even when no message comes."""
        with self._writing():
            self.rotate_due()

    def rotate_due(self) -> int:
        """Finish the files open for max_age_s or longer; returns how many."""
        now = self.clock()
        due = [k for k, f in self._open.items() if now - f.opened_at >= self.max_age_s]
        for k in due:
            self._finish(k)
        return len(due)

    def close(self) -> None:
        """Finish every open file and release the directory."""
        with self._writing():
            for k in list(self._open):
                self._finish(k)
        self._unlock()

    def abandon(self) -> None:
        """Drop the open files without finishing them (their messages were not committed)."""
        for f in self._open.values():
            f.abandon()  # never raises: every one is removed
        self._open.clear()
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _finish(self, k: tuple[str, str, int]) -> None:
        f = self._open[k]
        try:
            path = f.finish()
        except OSError:  # its messages were not committed: they come again, into a new file
            f.abandon()
            part = (f.topic, f.partition)
            self._unwritten[part] = min(self._unwritten.get(part, f.first_offset), f.first_offset)
            raise
        finally:
            del self._open[k]
        if not any(o[:2] == k[:2] for o in self._open):  # the (topic, run) has no file open any more
            self._ranks.pop(k[:2], None)
        done = ArchiveFile(f.topic, f.run_id, f.partition, f.first_offset, f.last_offset, path)
        self.archived[k] = f.last_offset
        self.index.append(f.summary.entry(done, self.root, self.codec))
        self.stats.files += 1

    @property
    def open_files(self) -> int:
        return len(self._open)


def _lock(root: Path) -> int:
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ArchiveError(f"another archive sink is writing to {root}: stop it or choose another "
                           "output directory") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


# -- running it --------------------------------------------------------------------------

@dataclass
class ArchiveProgress:
    messages: int
    value_bytes: int
    files: int
    open_files: int
    lag: int
    elapsed_s: float


def run_archive(conn: Connection | str, topics: Iterable[str], out_dir: Path | str, stop: threading.Event,
                group_id: str = "profstream-archive", instance_id: str = "0",
                progress: Callable[[ArchiveProgress], None] | None = None,
                ready: Callable[[ArchiveSink], None] | None = None, wait_topics_s: float = 0.0,
                **sink_options: Any) -> ArchiveStats:
    """Archive ``topics`` into ``out_dir`` until ``stop`` is set; then finish the open files and
    commit. Static group membership (``<group>-<instance>``) lets a restarted sink take its
    partitions back at once."""
    sink = ArchiveSink(out_dir, **sink_options)
    try:
        loop = SinkLoop(conn, list(topics), group_id, sink, wait_topics_s=wait_topics_s,
                        group_instance_id=f"{group_id}-{instance_id}")
    except BaseException:
        sink.abandon()
        raise
    if ready is not None:
        ready(sink)
    t0 = time.monotonic()
    watcher = None
    if progress is not None:
        def report() -> None:
            while not stop.wait(0.25):
                s = sink.stats
                progress(ArchiveProgress(s.messages, s.value_bytes, s.files, sink.open_files, loop.lag,
                                         time.monotonic() - t0))

        watcher = threading.Thread(target=report, name="archive-progress", daemon=True)
        watcher.start()
    try:
        loop.run(stop)
    except BaseException:
        sink.abandon()  # the open files' messages were not committed: they come again
        raise
    finally:
        stop.set()
        if watcher is not None:
            watcher.join()
    return sink.stats
