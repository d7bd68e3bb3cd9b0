"""The disk spool: encoded batches that cannot reach Kafka, kept on local disk in order.

A Monitor with ``spool_dir`` writes the batches it cannot hand to Kafka (the broker away,
or librdkafka's in-flight share full) to append-only segment files under
``<spool_dir>/<run_id>/rank-<rank>/``, and sends them in their original order when the
broker is back, while new batches queue on disk behind them. With ``record_only`` it
writes every batch there and never connects; ``profstream spool publish`` sends such a
spool later (``spool_publish.py``). Only the Monitor's sender thread touches the disk.

A segment is ``SEGMENT_MAGIC`` followed by records, each a fixed header (``RECORD``:
magic byte, version, key length, value length, ops, samples, CRC-32 of the header's other
fields, the key and the value) and the Kafka key and value as they would go on the wire.
A record whose header or checksum is wrong (a torn tail after a crash, a corrupted
sector) is skipped up to the next record that checks, counted, and named once with its
file. The position up to which Kafka acknowledged the records is kept in ``acked``
(rewritten atomically); a restart sends from there, so a record may go twice, which the
processors drop by producer id and seq (docs/exactly-once.md).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import time
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("profstream.monitor")

SEGMENT_MAGIC = b"PSSPOOL1"
RECORD = struct.Struct("<BBHIIII")  # magic, version, key_len, value_len, ops, samples, crc32
RECORD_MAGIC = 0xA5
RECORD_VERSION = 1
MAX_KEY = 1024
MAX_VALUE = 64 * 1024 * 1024  # far above Kafka's message limit: anything larger is garbage
SEGMENT_SUFFIX = ".seg"
FIRST_SEGMENT = 10**15  # room below for segments written before the first (``insert``)
SEGMENT_STEP = 1000  # between the numbers of consecutive segments: room for ``insert``
ACKED_FILE = "acked"
LOCK_FILE = "lock"
READ_CHUNK = 4 * 1024 * 1024
ACKED_SAVE_S = 1.0  # the acknowledged position is saved at most this often (and at close)


class SpoolError(OSError):
    """The spool cannot be used (directory not writable, in use by another process)."""


@dataclass(frozen=True)
class Record:
    key: bytes
    value: bytes
    ops: int
    samples: int
    segment: int
    end: int  # offset just past this record in its segment

    @property
    def size(self) -> int:
        return RECORD.size + len(self.key) + len(self.value)


def encode_record(key: bytes, value: bytes, ops: int, samples: int) -> bytes:
    head = RECORD.pack(RECORD_MAGIC, RECORD_VERSION, len(key), len(value), ops & 0xFFFFFFFF,
                       samples & 0xFFFFFFFF, 0)[:-4]
    crc = zlib.crc32(value, zlib.crc32(key, zlib.crc32(head)))
    return b"".join((head, struct.pack("<I", crc), key, value))


def decode_at(data: bytes | memoryview, pos: int) -> tuple[bytes, bytes, int, int, int] | None:
    """(key, value, ops, samples, end) of the record at ``pos`` of ``data``; None when none
    that checks starts there (or it does not end within ``data``)."""
    if len(data) - pos < RECORD.size:
        return None
    magic, version, key_len, value_len, ops, samples, crc = RECORD.unpack_from(data, pos)
    if magic != RECORD_MAGIC or version != RECORD_VERSION or key_len > MAX_KEY or value_len > MAX_VALUE:
        return None
    end = pos + RECORD.size + key_len + value_len
    if end > len(data):
        return None
    view = memoryview(data)
    key = view[pos + RECORD.size:pos + RECORD.size + key_len]
    value = view[pos + RECORD.size + key_len:end]
    if zlib.crc32(value, zlib.crc32(key, zlib.crc32(view[pos:pos + RECORD.size - 4]))) != crc:
        return None
    return bytes(key), bytes(value), ops, samples, end


def rank_dir(root: str | os.PathLike, run_id: str, rank: int) -> Path:
    return Path(root) / run_id / f"rank-{rank}"


def _segment_name(number: int) -> str:
    return f"{number:020d}{SEGMENT_SUFFIX}"


def list_segments(directory: Path) -> list[int]:
    out = []
    for p in directory.iterdir():
        if p.name.endswith(SEGMENT_SUFFIX) and p.name[:-len(SEGMENT_SUFFIX)].isdigit():
            out.append(int(p.name[:-len(SEGMENT_SUFFIX)]))
    return sorted(out)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class Spool:
    """The segments of one (run, rank): appended by the sender thread, read back in order.

    ``append`` writes behind everything else; ``next_record`` / ``advance`` hand records
    out in order from the acknowledged position; ``settle(n)`` says the oldest ``n`` handed
    records are done with (acknowledged by Kafka, or refused by it for good), which moves
    the acknowledged position and deletes segments that are wholly behind it.
    """

    def __init__(self, directory: str | os.PathLike, max_bytes: int, segment_bytes: int | None = None,
                 write: bool = True) -> None:
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or max(1 << 20, min(64 << 20, max_bytes // 16))
        self._lock_fd = -1
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise SpoolError(errno.EBUSY, f"spool {self.dir} is in use by another process (a Monitor of the same "
                             "run and rank, or a publish): it sends its records itself") from None
        except OSError as e:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
            raise SpoolError(e.errno, f"spool directory {self.dir} is not writable: {e.strerror}") from None
        self.segments: list[int] = list_segments(self.dir)
        self.sizes: dict[int, int] = {n: (self.dir / _segment_name(n)).stat().st_size for n in self.segments}
        self.acked = self._load_acked()
        # the read position: the next record to hand out
        self._read_seg, self._read_pos = self.acked
        self._chunk: bytes = b""
        self._chunk_seg, self._chunk_at = -1, 0  # segment and offset of _chunk's first byte
        self._handed: deque[tuple[int, int]] = deque()  # (segment, end) of records handed, not settled
        self._acked_saved_at = 0.0
        self._acked_dirty = False
        # the writer: always a new segment, never behind a predecessor's (maybe torn) tail
        self._write_fd = -1
        self._write_seg = -1
        self.records_written = 0
        self.records_settled = 0
        self.corrupt_regions = 0
        self.corrupt_bytes = 0
        self._said_corrupt: set[int] = set()
        self.broken: str | None = None  # why writing stopped (a write error)
        self.writable = write

    # -- state ------------------------------------------------------------------------

    @property
    def disk_bytes(self) -> int:
        return sum(self.sizes.values())

    def _normal(self, at: tuple[int, int]) -> tuple[int, int]:
        """A position as the start of the record it is before: the end of a segment is the
        first record of the next one."""
        seg, pos = at
        pos = max(pos, len(SEGMENT_MAGIC))
        later = [n for n in self.segments if n > seg]
        if later and (seg not in self.sizes or pos >= self.sizes[seg]):
            return later[0], len(SEGMENT_MAGIC)
        return seg, pos

    def _end(self) -> tuple[int, int]:
        last = self.segments[-1]
        return last, self.sizes[last]

    @property
    def backlog(self) -> bool:
        """Whether records wait to be acknowledged (written and not yet settled)."""
        return bool(self.segments) and self._normal(self.acked) < self._end()

    @property
    def unread(self) -> bool:
        """Whether records wait to be handed out."""
        return bool(self.segments) and self._normal((self._read_seg, self._read_pos)) < self._end()

    @property
    def handed(self) -> int:
        return len(self._handed)

    def has_room(self, size: int) -> bool:
        return self.disk_bytes + size + RECORD.size + len(SEGMENT_MAGIC) <= self.max_bytes

    # -- writing ----------------------------------------------------------------------

    def append(self, key: bytes, value: bytes, ops: int, samples: int, force: bool = False) -> bool:
        """Write one record behind the others; False when the size cap leaves no room
        (``force``: written anyway, for a batch already built: callers check ``has_room``
        before building). Raises OSError when the disk refuses (full, read-only): the spool
        is then broken."""
        data = encode_record(key, value, ops, samples)
        if not force and not self.has_room(len(data)):
            return False
        if self._write_fd < 0 or self.sizes[self._write_seg] >= self.segment_bytes:
            self._open_segment(self.next_segment)
        seg = self._write_seg
        try:
            _write_all(self._write_fd, data)
        except OSError as e:
            self._broken(e, seg)
            raise
        self.sizes[seg] += len(data)
        self.records_written += 1
        return True

    @property
    def next_segment(self) -> int:
        """The number the next segment ``append`` opens will have."""
        last = max(self.segments[-1] if self.segments else FIRST_SEGMENT, self.acked[0])
        return last + SEGMENT_STEP

    def rotate(self) -> None:
        """Close the segment being written: the next ``append`` starts a new one (whose
        number ``next_segment`` says), so that records can be inserted before it."""
        self._close_segment()

    def insert(self, records: list[tuple[bytes, bytes, int, int]], before: int | None = None) -> None:
        """Write records that belong before segment ``before`` (and after every segment
        numbered lower) into a segment of their own; ``before`` None or not there: behind
        everything. Used for the batches librdkafka still held when the Monitor closed."""
        if not records:
            return
        if before is None or before not in self.sizes:
            self._close_segment()
            number = self.next_segment
        else:
            number = before - 1
            if number in self.sizes or (self.segments and self.segments.index(before) > 0
                                        and self.segments[self.segments.index(before) - 1] >= number):
                raise OSError(errno.EEXIST, f"no room for a segment before {_segment_name(before)} in {self.dir}")
        path = self.dir / _segment_name(number)
        data = SEGMENT_MAGIC + b"".join(encode_record(*r) for r in records)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, data)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        self.segments = sorted(self.segments + [number])
        self.sizes[number] = len(data)
        self.records_written += len(records)
        if (number, 0) < self.acked:  # before what was acknowledged: sent from here on
            self.acked = (number, 0)
            self._acked_dirty = True
            self._save_acked(force=True)
        if (number, 0) < (self._read_seg, self._read_pos):
            self._read_seg, self._read_pos = number, 0
            self._handed.clear()
        self._chunk, self._chunk_seg = b"", -1

    def _open_segment(self, number: int) -> None:
        self._close_segment()
        path = self.dir / _segment_name(number)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        try:
            _write_all(fd, SEGMENT_MAGIC)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            self._broken(e, number)
            raise
        self._write_fd, self._write_seg = fd, number
        self.segments.append(number)
        self.sizes[number] = len(SEGMENT_MAGIC)

    def _close_segment(self) -> None:
        if self._write_fd >= 0:
            try:
                os.fdatasync(self._write_fd)
            except OSError:
                pass  # reported by the write that failed, if any
            os.close(self._write_fd)
            self._write_fd = -1

    def _broken(self, error: OSError, segment: int) -> None:
        """A write failed: cut the segment back to its last whole record and stop writing."""
        self.broken = f"{self.dir / _segment_name(segment)}: {error.strerror or error}"
        if self._write_fd >= 0 and segment == self._write_seg:
            try:
                os.ftruncate(self._write_fd, self.sizes[segment])
            except OSError:
                pass  # the reader skips a torn tail anyway
        self.writable = False

    def sync(self) -> None:
        """Make what was written durable (fdatasync), and the acknowledged position."""
        if self._write_fd >= 0:
            try:
                os.fdatasync(self._write_fd)
            except OSError as e:
                log.warning("profstream: the spool at %s could not be synced to disk: %s", self.dir, e)
        self._save_acked(force=True)

    def close(self) -> None:
        self.sync()
        self._close_segment()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- reading ----------------------------------------------------------------------

    def next_record(self) -> Record | None:
        """The next record to hand out, without taking it (``advance`` does); None when
        every record written is handed out."""
        while True:
            if not self.segments:
                return None
            if self._read_seg not in self.sizes:  # deleted or never there: the next segment on
                later = [n for n in self.segments if n > self._read_seg]
                if not later:
                    return None
                self._read_seg, self._read_pos = later[0], 0
            seg, size = self._read_seg, self.sizes[self._read_seg]
            if self._read_pos == 0:
                self._read_pos = self._check_magic(seg)
            if self._read_pos < size:
                rec = self._decode(seg, size)
                if rec is not None:
                    return rec
                continue  # a bad stretch skipped: read on from where it ended
            if seg == self._write_seg or seg == self.segments[-1]:
                return None  # the writer's segment, read up to what it wrote
            self._read_seg, self._read_pos = self.segments[self.segments.index(seg) + 1], 0

    def advance(self, record: Record) -> None:
        """``record`` is handed out (to Kafka): the next one comes after it."""
        self._read_seg, self._read_pos = record.segment, record.end
        self._handed.append((record.segment, record.end))

    def rewind(self) -> None:
        """Hand out again from the acknowledged position (what was handed was lost)."""
        self._handed.clear()
        self._read_seg, self._read_pos = self.acked

    def settle(self, n: int) -> None:
        """The oldest ``n`` handed records are done with: move the acknowledged position
        past them and delete the segments wholly behind it."""
        if n <= 0:
            return
        end = None
        for _ in range(min(n, len(self._handed))):
            end = self._handed.popleft()
        if end is None:
            return
        self.records_settled += n
        self.acked = end
        self._acked_dirty = True
        while self.segments and self.segments[0] < self.acked[0]:
            self._delete(self.segments[0])
        seg, pos = self.acked
        if seg != self._write_seg and len(self.segments) > 1 and pos >= self.sizes.get(seg, 0):
            self._delete(seg)
            self.acked = (self.segments[0], len(SEGMENT_MAGIC))
        self._save_acked()

    def _delete(self, number: int) -> None:
        self.segments.remove(number)
        self.sizes.pop(number, None)
        (self.dir / _segment_name(number)).unlink(missing_ok=True)
        if self._chunk_seg == number:
            self._chunk, self._chunk_seg = b"", -1
        self._acked_dirty = True

    def _check_magic(self, seg: int) -> int:
        head = self._read(seg, 0, len(SEGMENT_MAGIC))
        if head != SEGMENT_MAGIC:
            self._corrupt(seg, 0, len(SEGMENT_MAGIC), "no segment header")
        return len(SEGMENT_MAGIC)

    def _read(self, seg: int, pos: int, n: int) -> bytes:
        """n bytes (fewer at the end) of segment ``seg`` from ``pos``, through a chunk cache."""
        if not (self._chunk_seg == seg and self._chunk_at <= pos and pos + n <= self._chunk_at + len(self._chunk)):
            want = max(n, READ_CHUNK)
            with open(self.dir / _segment_name(seg), "rb") as f:
                f.seek(pos)
                self._chunk = f.read(min(want, max(0, self.sizes[seg] - pos)))
            self._chunk_seg, self._chunk_at = seg, pos
        start = pos - self._chunk_at
        return self._chunk[start:start + n]

    def _decode(self, seg: int, size: int) -> Record | None:
        pos = self._read_pos
        head = self._read(seg, pos, RECORD.size)
        if len(head) == RECORD.size:
            magic, version, key_len, value_len, *_ = RECORD.unpack(head)
            if magic == RECORD_MAGIC and version == RECORD_VERSION and key_len <= MAX_KEY and value_len <= MAX_VALUE:
                body = self._read(seg, pos, RECORD.size + key_len + value_len)
                got = decode_at(body, 0)
                if got is not None:
                    key, value, ops, samples, end = got
                    return Record(key, value, ops, samples, seg, pos + end)
        # not a record that checks: find the next one that does, count the stretch between
        nxt = self._resync(seg, pos + 1, size)
        self._corrupt(seg, pos, nxt - pos, "torn or corrupted record" if nxt < size else "torn tail")
        self._read_pos = nxt
        return None

    def _resync(self, seg: int, pos: int, size: int) -> int:
        """The offset of the next record that checks at or after ``pos`` (``size`` if none)."""
        while pos < size:
            data = self._read(seg, pos, READ_CHUNK + RECORD.size + MAX_KEY)
            at = data.find(bytes([RECORD_MAGIC, RECORD_VERSION]))
            while at >= 0:
                full = self._read(seg, pos + at, RECORD.size)
                if len(full) == RECORD.size:
                    _m, _v, key_len, value_len, *_ = RECORD.unpack(full)
                    if key_len <= MAX_KEY and value_len <= MAX_VALUE and decode_at(
                            self._read(seg, pos + at, RECORD.size + key_len + value_len), 0) is not None:
                        return pos + at
                at = data.find(bytes([RECORD_MAGIC, RECORD_VERSION]), at + 1)
            pos += max(1, len(data) - RECORD.size)
        return size

    def _corrupt(self, seg: int, pos: int, n: int, what: str) -> None:
        self.corrupt_regions += 1
        self.corrupt_bytes += n
        if seg not in self._said_corrupt:
            self._said_corrupt.add(seg)
            log.warning("profstream: spool file %s: %s of %d bytes at offset %d skipped (its batches are lost and "
                        "counted); the records after it are sent", self.dir / _segment_name(seg), what, n, pos)

    # -- the acknowledged position ----------------------------------------------------

    def _load_acked(self) -> tuple[int, int]:
        first = (self.segments[0], 0) if self.segments else (FIRST_SEGMENT, 0)
        try:
            seg, pos = (int(x) for x in (self.dir / ACKED_FILE).read_text().split())
        except (OSError, ValueError):
            return first
        if not self.segments or seg < self.segments[0]:
            return first
        return (seg, pos)

    def _save_acked(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._acked_dirty or (not force and now - self._acked_saved_at < ACKED_SAVE_S):
            return
        tmp = self.dir / (ACKED_FILE + ".tmp")
        try:
            tmp.write_text(f"{self.acked[0]} {self.acked[1]}\n")
            os.replace(tmp, self.dir / ACKED_FILE)
        except OSError as e:  # the next save tries again; a restart sends a little twice
            log.debug("profstream: saving the spool's position failed: %s", e)
            return
        self._acked_saved_at = now
        self._acked_dirty = False

    def stats(self) -> dict[str, int | str | None]:
        return {"spool_bytes": self.disk_bytes, "spool_segments": len(self.segments),
                "spool_records_written": self.records_written, "spool_records_sent": self.records_settled,
                "spool_corrupt_regions": self.corrupt_regions, "spool_corrupt_bytes": self.corrupt_bytes,
                "spool_error": self.broken}
