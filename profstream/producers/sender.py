"""The Monitor's background thread: buffer -> columnar EventBatch -> Kafka.

The Sender drains the Monitor's ``EventBuffer`` (``buffer.py``, which also keeps the
watermark's order) and reads nothing else of the Monitor but the public ``Source``.

Seq numbers are given when a batch is built; a batch the broker cannot take yet is kept
and sent again (same seq), so a gap in seq always means a lost batch. With a spool
(``spool_sending.py``) the batches Kafka cannot take go to disk instead, in order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import confluent_kafka
import numpy as np
import psutil

from profstream.kafka.clients import make_native_producer, refused
from profstream.kafka.connection import Connection
from profstream.kafka.limits import MAX_MESSAGE_BYTES
from profstream.kafka.topics import Topics
from profstream.producers.buffer import EventBuffer, OpChunk, rows_chunk
from profstream.producers.spool_sending import SpoolSending
from profstream.schema.batch import (
    COLUMN_FILL,
    HOST,
    I32,
    I64,
    KIND_CODES,
    NO_VALUE,
    SECTIONS,
    U8,
    EventBatch,
    dictionary_codes,
    empty_section,
    encode_batch,
)

log = logging.getLogger("profstream.monitor")

# Device counter samples travel in batches of their own, under a producer id of their own
# (seq counts per producer id): written as EventBatch v5, where the Monitor's other batches
# stay v4, so a processor older than v5 loses nothing but the device counters.
DEVICE_PRODUCER_SUFFIX = ".devices"
DEVICE_ROWS_PER_BATCH = 4096  # ~0.5 MB encoded: under Kafka's message limit
# The native Monitor (native_sender) sends collective calls the same way, as EventBatch v6
# batches of their own: its compiled encoder writes v4 alone (docs/monitor.md).
COLLECTIVE_PRODUCER_SUFFIX = ".collectives"
COLLECTIVE_ROWS_PER_BATCH = 1024  # their names travel with them: a smaller batch
# At most one message per batch interval, and after the interval one as soon as a step has
# ended (or a batch filled, or a completed step waits); while no step ends (a long step),
# what is recorded still leaves at least this often. So a step is sent when it ends, and
# the sender thread wakes once per message rather than once per step: on a box with no
# idle core every wake-up of a profstream thread is taken from the training loop.
IDLE_SEND_S = 1.0
# The topics a Monitor writes: on a broker with ACLs it may create (and see) no other.
MONITOR_TOPICS = ("raw", "control")
# A connection attempt off the sender thread (with a spool) that has not ended after this
# long (or three connect timeouts) is given up on and another one started.
ATTEMPT_LIMIT_S = 30.0
_CHECK_BOOTSTRAP = "; check --bootstrap (PROFSTREAM_BOOTSTRAP) or start a broker with `profstream stack up`"


class Source(Protocol):
    """What the Sender reads of the Monitor it sends for."""

    options: dict[str, Any]
    connection: Connection
    run_id: str
    rank: int
    producer_id: str
    key: bytes
    topics: Topics
    buffer: EventBuffer
    inflight_limit_bytes: int


def _dictionary(values) -> tuple[list[str], np.ndarray]:
    codes, table = dictionary_codes(values)
    return [str(v) for v in table], codes


def chunk_rows(chunk: OpChunk) -> list[tuple]:
    """The inverse of rows_chunk (scalar columns repeated): for row-by-row validation."""
    n = chunk.n
    launch = NO_VALUE if chunk.launch_ns is None else chunk.launch_ns
    col = [c if isinstance(c, (list, tuple, np.ndarray)) else [c] * n
           for c in (chunk.names, chunk.op_types, chunk.kinds, chunk.streams, chunk.step, chunk.start_ns,
                     chunk.dur_ns, launch)]
    return list(zip(*col))


def _numbers(value, n: int, dtype) -> np.ndarray:
    if isinstance(value, (list, tuple, np.ndarray)):
        return np.asarray(value, dtype=dtype)
    return np.full(n, value, dtype=dtype)


def _kinds(value, n: int) -> tuple[np.ndarray, int]:
    """u8 kind codes and how many names were unknown (recorded as host)."""
    if isinstance(value, str):
        code = KIND_CODES.get(value, -1)
        return np.full(n, HOST if code == -1 else code, U8), n * (code == -1)
    try:
        return _numbers(value, n, U8), 0
    except (ValueError, TypeError, OverflowError):
        codes = [KIND_CODES.get(k, -1) if isinstance(k, str) else k for k in value]
        unknown = codes.count(-1)
        return np.array([HOST if c == -1 else c for c in codes], dtype=U8), unknown


def op_columns(chunks: list[OpChunk]) -> tuple[list[str], list[str], dict[str, np.ndarray], int]:
    """Columns of op chunks: (names, op_types, columns, unknown kind names). Values that
    are not numbers raise ValueError/TypeError (the caller then drops them row by row)."""
    names: list = []
    types: list = []
    parts: dict[str, list[np.ndarray]] = {c: [] for c in ("kind", "stream", "step", "start_ns", "dur_ns",
                                                          "launch_ns")}
    unknown = 0
    for c in chunks:
        n = c.n
        names.extend(c.names)
        if c.op_types is None:
            types.extend(c.names)
        elif isinstance(c.op_types, str):
            types.extend([c.op_types] * n)
        else:
            t = list(c.op_types)
            if None in t:
                t = [nm if tp is None else tp for nm, tp in zip(c.names, t)]
            types.extend(t)
        kind, k_unknown = _kinds(c.kinds, n)
        unknown += k_unknown
        parts["kind"].append(kind)
        parts["stream"].append(_numbers(c.streams, n, I32))
        parts["step"].append(_numbers(c.step, n, I64))
        parts["start_ns"].append(_numbers(c.start_ns, n, I64))
        parts["dur_ns"].append(_numbers(c.dur_ns, n, I64))
        parts["launch_ns"].append(_numbers(NO_VALUE if c.launch_ns is None else c.launch_ns, n, I64))
    name_list, name_idx = _dictionary(names)
    type_list, type_idx = _dictionary(types)
    cols = {"name_idx": name_idx, "type_idx": type_idx}
    for col, arrays in parts.items():
        cols[col] = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    return name_list, type_list, cols, unknown


def _valid_op(row: tuple) -> bool:
    try:
        op_columns([rows_chunk([row])])
        return True
    except (ValueError, TypeError, OverflowError):
        return False


def sample_columns(rows: list[tuple], columns: tuple[tuple[str, Any], ...]) -> dict[str, np.ndarray]:
    """Sample tuples (at least one) as the columns of a batch section (``SECTIONS``)."""
    return {c: np.array(v, dtype=d) for (c, d), v in zip(columns, zip(*rows))}


_MARK_FILL = tuple(COLUMN_FILL.get(("steps", c), NO_VALUE) for c, _ in SECTIONS["steps"])


def mark_columns(rows: list[tuple]) -> dict[str, np.ndarray]:
    """Step mark tuples as the steps section: a mark without its work (or with part of it)
    has the rest filled as absent (``COLUMN_FILL``), as the native recorder fills it."""
    width = len(_MARK_FILL)
    if any(len(row) != width for row in rows):
        rows = [row + _MARK_FILL[len(row):] for row in rows]
    return sample_columns(rows, SECTIONS["steps"])


def host_sample(process: psutil.Process) -> tuple | None:
    """One host_samples row (``SECTIONS["host_samples"]``) by psutil, None when it fails:
    host samples are best effort, a vanished /proc entry is not worth a warning."""
    try:
        cpu = psutil.cpu_times_percent(interval=None)
        return (time.time_ns(), cpu.user / 100, cpu.system / 100, cpu.idle / 100, getattr(cpu, "iowait", 0.0) / 100,
                process.cpu_percent(interval=None) / 100, process.memory_info().rss)
    except psutil.Error:
        return None


def collective_columns(rows: list[tuple]) -> tuple[list[str], dict[str, np.ndarray]]:
    """Collective sample tuples (``EventBuffer.collectives``) as collective_names and the
    collectives section: the three names share one dictionary."""
    names, codes = _dictionary([v for row in rows for v in row[:3]])
    cols = sample_columns([row[3:] for row in rows], SECTIONS["collectives"][3:])
    return names, {"name_idx": codes[0::3], "group_idx": codes[1::3], "dtype_idx": codes[2::3], **cols}


def _fill_device_samples(batch: EventBatch, rows: list[tuple]) -> None:
    batch.device_samples = sample_columns(rows, SECTIONS["device_samples"])


def _take(rows) -> list:
    pop = rows.popleft
    return [pop() for _ in range(len(rows))]


def _fill_loader_samples(batch: EventBatch, rows: list[tuple]) -> None:
    batch.loader_samples = sample_columns(rows, SECTIONS["loader_samples"])


def fill_collectives(batch: EventBatch, rows: list[tuple]) -> None:
    """Collective sample tuples into ``batch``'s collectives section and collective_names."""
    batch.collective_names, batch.collectives = collective_columns(rows)


_PURGED = (confluent_kafka.KafkaError._PURGE_QUEUE, confluent_kafka.KafkaError._PURGE_INFLIGHT)


def _purged(error: BaseException) -> bool:
    """Whether a delivery failed because a close purged the message (not refused)."""
    return bool(error.args) and isinstance(error.args[0], confluent_kafka.KafkaError) and (
        error.args[0].code() in _PURGED)


class _Attempt(threading.Thread):
    """One connection attempt off the sender thread: ``outcome`` is (producer, None) or
    (None, the error). A producer opened after the Monitor began to stop, or after the
    sender gave up on this attempt (``abandon``: it ran past ``ATTEMPT_LIMIT_S``), is
    closed here."""

    def __init__(self, open_producer: Callable[[], Any], stopping: threading.Event) -> None:
        super().__init__(name="profstream-connect", daemon=True)
        self._open, self._stopping = open_producer, stopping
        self._abandoned = threading.Event()
        self.started_at = time.monotonic()
        self.outcome: tuple[Any, BaseException | None] = (None, None)

    def abandon(self) -> None:
        self._abandoned.set()

    def run(self) -> None:
        try:
            producer = self._open()
        except Exception as e:
            self.outcome = (None, e)
            return
        if self._stopping.is_set() or self._abandoned.is_set():
            producer.close(timeout=0)
            self.outcome = (None, ConnectionAbortedError("the Monitor stopped"))
            return
        self.outcome = (producer, None)


class Sender(SpoolSending, threading.Thread):
    """Builds and sends the batches of one Monitor."""

    default_producer = staticmethod(make_native_producer)
    idle_send_s = IDLE_SEND_S

    def __init__(self, monitor: Source, producer_factory=None) -> None:
        super().__init__(name=f"profstream-sender-{monitor.run_id}-{monitor.rank}", daemon=True)
        self.m = monitor
        self.buffer = monitor.buffer
        # The batches' sent_ns stamps: this sender's own clock, so that a test can set the
        # stamps of one sender without touching what other threads read from time.time_ns.
        self.now_ns = time.time_ns
        opts = monitor.options
        self._producer_factory = producer_factory or self.default_producer
        self._interval = opts["batch_interval_ms"] / 1000.0
        self._host_interval = opts["host_sample_interval_s"]
        self._connect_timeout = opts["connect_timeout_s"]
        self._producer = None
        self._seq = 0
        self._side_seq = {DEVICE_PRODUCER_SUFFIX: 0, COLLECTIVE_PRODUCER_SUFFIX: 0}  # batches of their own
        self._sent_watermark: int | None = None
        self._reported_dropped_ops = 0
        self._reported_dropped_samples = 0
        self._pending: deque[tuple[bytes, int, int]] = deque()  # (value, ops, samples) built, not yet handed to Kafka
        self._host_rows: list[tuple] = []
        self._next_host_sample = 0.0
        self._process = psutil.Process()

        self._lock = threading.Lock()  # guards the counters updated by Kafka's callbacks
        self._inflight_bytes = 0
        self._acked_batches = 0
        self._failed_batches = 0
        self._last_latency_ns = NO_VALUE
        self.batches_sent = 0
        self.bytes_sent = 0
        self.unknown_kinds = 0
        self.bad_ops = 0

        self._stopping = threading.Event()
        self._flush_requested = 0
        self._flush_done = 0
        self._flush_deadline = 0.0
        self._flush_ok = False
        self._flush_cv = threading.Condition()
        # events that will never reach Kafka: purged at close, refused, left in the buffer
        self.undelivered_ops = 0
        self.undelivered_samples = 0
        self._lost_said_at = -1e18
        self._ops_limit = 1 << 30  # lowered when a batch encodes over the message limit
        self._down_since: float | None = None
        self._warned_down = False
        self._next_connect = 0.0
        self._connect_backoff = 0.5
        self._attempt: _Attempt | None = None  # a connection attempt on a thread of its own (with a spool)
        self._diagnosed = False  # a failed connection was looked into (once: diagnose.check)
        self._spool_acks = 0  # spooled messages acknowledged or refused for good (spool_sending.py)
        self._rescued: list[tuple[bytes, int, int]] = []  # batches a close purged, for the spool
        self._open_spool()

    # -- thread -----------------------------------------------------------------------

    def run(self) -> None:
        wake = self.buffer.wake
        while True:
            stopping = self._stopping.is_set()
            cycle_started = time.monotonic()
            try:
                self._cycle()
            except Exception:  # a bug here must not end profiling silently
                log.exception("profstream sender: unexpected error; continuing")
            if self._serve_flush():  # a flush waits for more: go again soon
                continue
            if stopping:
                self._close_producer()
                return
            # The rest of the batch interval (each message costs ~0.2-0.35 ms of CPU in this
            # process, librdkafka's threads: short steps must not each become one); only a
            # stop cuts it short. Then a cycle once a step ends, a batch fills or a flush
            # waits (wake), or a completed step waits; else at the latest IDLE_SEND_S after
            # this one (IDLE_SEND_S above).
            rest = self._interval - (time.monotonic() - cycle_started)
            if rest > 0:
                self._stopping.wait(rest)
            if not wake.is_set() and self._nothing_complete():
                wake.wait(max(0.0, self._idle_deadline(cycle_started) - time.monotonic()))
            wake.clear()  # before the cycle takes the rows: a step that ends during it sets it again

    def _nothing_complete(self) -> bool:
        """Whether a cycle now would only send steps still running: nothing built waits, no
        acknowledgement is due (a cycle hears them), no completed step (watermark) waits."""
        return not self._pending and self._inflight() == 0 and self.buffer.watermark == self._sent_watermark

    def _idle_deadline(self, cycle_started: float) -> float:
        """When a cycle is due though no step ended: ``idle_send_s`` after the last, or a host
        sample or connection attempt before that."""
        deadline = cycle_started + max(self.idle_send_s, self._interval)
        if self._host_interval:
            deadline = min(deadline, self._next_host_sample)
        if self._producer is None and not self._record_only:
            deadline = min(deadline, self._next_connect)
        return deadline

    def _serve_flush(self) -> bool:
        """Settle the flush that waits, if any: once everything buffered is acknowledged,
        or at its deadline. True while it stays open (the broker may come back meanwhile)."""
        with self._flush_cv:
            target, deadline = self._flush_requested, self._flush_deadline
        if target <= self._flush_done:
            return False
        left = deadline - time.monotonic()
        delivered = not self._buffered() and not self._spool_sending() and (
            self._inflight() == 0 or self._spool_flushed())
        if left > 0 and not delivered:
            if self._producer is None:  # reconnect within a second of the broker's return
                self._next_connect = min(self._next_connect, time.monotonic() + 1.0)
                time.sleep(min(0.05, left))
            elif self._buffered():  # more to build and send than the in-flight share: go on
                self._producer.poll()
                time.sleep(min(0.005, left))
            else:
                self._producer.flush(min(0.1, left))  # returns as soon as all is acknowledged
            return True
        with self._flush_cv:
            self._flush_ok = delivered
            self._flush_done = target
            if self._flush_requested == target:  # the next flush brings its own deadline
                self._flush_deadline = 0.0
            self._flush_cv.notify_all()
        return False

    def _close_producer(self) -> None:
        """Close the producer; whatever it still held (purged) or was never sent counts as
        undelivered: the Monitor's stats and the caller's report say so."""
        attempt, self._attempt = self._attempt, None
        if attempt is not None and not attempt.is_alive() and attempt.outcome[0] is not None:
            attempt.outcome[0].close(timeout=0)  # (one still under way closes its own: it sees the stop)
        if self._producer is not None:
            try:
                self._producer.close(timeout=0.5)
            except Exception as e:
                log.warning("profstream: closing the Kafka producer failed: %s", e)
            self._producer = None
        self._spool_close()
        ops, samples = self._drop_unsent()
        if ops or samples:
            self._undelivered(ops, samples, "the Monitor closed before Kafka took them")
        lost_ops, lost_samples = self._undelivered_totals()
        if lost_ops or lost_samples:
            # a warning, unless the outage's one warning already said events are dropped
            level = logging.WARNING if self._acked() or not self._warned_down else logging.INFO
            log.log(level, "profstream: %d ops and %d samples of %s rank %d never reached Kafka at %s: they are "
                    "counted as dropped%s", lost_ops, lost_samples, self.m.run_id, self.m.rank,
                    self.m.connection, "" if self._acked() else _CHECK_BOOTSTRAP)

    def _drop_unsent(self) -> tuple[int, int]:
        """Forget the batches built and not handed to Kafka; (ops, samples) of those and of
        what is still buffered."""
        buf = self.buffer
        ops = sum(n for _v, n, _s in self._pending) + buf.buffered_ops
        samples = sum(s for _v, _n, s in self._pending) + buf.buffered_samples
        self._pending.clear()
        return ops, samples

    def _undelivered_totals(self) -> tuple[int, int]:
        return self.undelivered_ops, self.undelivered_samples

    def _acked(self) -> int:
        with self._lock:
            return self._acked_batches

    def _undelivered(self, ops: int, samples: int, why: str) -> None:
        """Count events that will never reach Kafka (the next batch header carries them)."""
        self._count_undelivered(ops, samples)
        self._say_lost(ops, samples, why)

    def _count_undelivered(self, ops: int, samples: int) -> None:
        self.undelivered_ops += ops
        self.undelivered_samples += samples

    def _say_lost(self, ops: int, samples: int, why: str) -> None:
        """One warning a minute at most; none while stopping (the close says it once)."""
        now = time.monotonic()
        if now - self._lost_said_at >= 60.0 and not self._stopping.is_set():  # at close: one summary
            self._lost_said_at = now
            if "authorization failed" in why.lower():  # an ACL: say which one is missing
                from profstream.kafka.diagnose import authorization_error

                why = authorization_error(self.m.connection.principal(), "WRITE", "TOPIC", self.m.topics.raw,
                                          hint="`profstream acl show --role trainer` lists a training job's ACLs")
            log.warning("profstream: %d ops and %d samples lost (%s); counted as dropped", ops, samples, why)

    def _buffered(self) -> bool:
        return bool(self._pending) or not self.buffer.empty

    def _cycle(self) -> None:
        now = time.monotonic()
        if self._host_interval and now >= self._next_host_sample:
            self._sample_host()
            self._next_host_sample = now + self._host_interval
        if self._producer is None and not self._record_only:
            self._connect(now)
        if self._spooling():
            self._spool_cycle()
            return
        self._spool_now = False
        if self._producer is None:
            return
        self._producer.poll()  # delivery reports and client errors, on this thread
        self._spool_settle()  # records handed over before batches went straight to Kafka again
        self._send_pending()
        while not self._pending and self._inflight() < self.m.inflight_limit_bytes and self._build():
            self._send_pending()

    # -- connection -------------------------------------------------------------------

    def _connect(self, now: float) -> bool:
        """One attempt to reach Kafka, when one is due; True once connected. With a spool
        the attempt runs on a thread of its own (``_Attempt``), so that this one goes on
        writing batches to disk while it waits for a broker (up to connect_timeout_s)."""
        attempt = self._attempt
        if attempt is not None:
            if attempt.is_alive():
                if now - attempt.started_at < max(ATTEMPT_LIMIT_S, 3 * self._connect_timeout):
                    return False
                attempt.abandon()  # stuck (a broker that came back in the middle of it): another one
                self._attempt = attempt = None
                self._next_connect = now
            else:
                self._attempt = None
                return self._attempted(now, *attempt.outcome)
        if now < self._next_connect:
            return False
        if self._down_since is None and not self._acked():  # the first attempt: a wrong address is said at once
            why = refused(self.m.connection)
            if why is not None:
                self._mark_down(now, ConnectionError(why))
        if self._spool is not None:
            self._attempt = _Attempt(self._open_producer, self._stopping)
            self._attempt.start()
            return False
        try:
            return self._attempted(now, self._open_producer(), None)
        except Exception as e:
            return self._attempted(now, None, e)

    def _open_producer(self) -> Any:
        """A producer that reached a broker, the topics there; raises what failed (a
        ``SecurityError`` saying what, when the broker refused this Monitor)."""
        from profstream.kafka.diagnose import SecurityError
        from profstream.kafka.topics import ensure_topics
        from profstream.stack.errors import TopicAccessError

        opts = self.m.options
        try:
            producer = self._producer_factory(
                self.m.connection, compression=opts["compression"],
                bootstrap_timeout_ms=int(self._connect_timeout * 1000), on_error=self._on_client_error,
                **self._producer_options())
        except Exception as e:
            raise self._explained(e) from None
        try:
            ensure_topics(self.m.connection, self.m.topics, timeout=self._connect_timeout, needed=MONITOR_TOPICS,
                          operation="WRITE")
        except TopicAccessError as e:
            producer.close(timeout=0)
            raise SecurityError(str(e)) from None
        except Exception:
            producer.close(timeout=0)
            raise
        return producer

    def _explained(self, error: Exception) -> Exception:
        """``error`` of a failed connection, or the security problem behind it (credentials,
        certificate, TLS vs plaintext: ``diagnose.check``), found out once per Monitor."""
        conn = self.m.connection
        if self._diagnosed or not conn.secured and not isinstance(error, ConnectionError):
            return error
        self._diagnosed = True
        from profstream.kafka.diagnose import SecurityError, check

        why = check(conn, timeout=min(5.0, self._connect_timeout))
        return SecurityError(why) if why is not None else error

    def _attempted(self, now: float, producer: Any, error: BaseException | None) -> bool:
        if error is not None:
            self._mark_down(now, error)
            self._next_connect = now + self._connect_backoff
            self._connect_backoff = min(self._connect_backoff * 2, 30.0)
            return False
        if self._stopping.is_set():  # closed while we were connecting
            producer.close(timeout=0)
            return False
        self._producer = producer
        self._connect_backoff = 0.5
        self._mark_up()
        self._connected()
        return True

    def _producer_options(self) -> dict[str, Any]:
        """More keyword arguments of the producer factory (NativeSender's)."""
        return {}

    def _connected(self) -> None:
        """The producer is there (NativeSender sends through it from then on)."""

    def _mark_down(self, now: float, error: BaseException) -> None:
        if self._down_since is None:
            self._down_since = now
        if not self._warned_down and not self._stopping.is_set():
            self._warned_down = True
            where = (f"written to the spool at {self._spool.dir} (up to {self._spool.max_bytes >> 20} MiB) and "
                     "sent when it is back" if self._spool is not None else
                     f"buffered up to {self.m.options['buffer_bytes'] >> 20} MiB and then dropped and counted")
            why = self._refusal(error)
            if why is not None:  # the broker answered and refused us: say what to fix
                log.warning("profstream: Kafka at %s refused this Monitor: %s; training continues, events are %s.",
                            self.m.connection, why, where)
                return
            log.warning("profstream: Kafka at %s is not reachable (%s); training continues, events are %s. Check "
                        "--bootstrap or start a broker with `profstream stack up`.",
                        self.m.connection, type(error).__name__, where)

    def _refusal(self, error: BaseException) -> str | None:
        """What the broker refused this Monitor, in one line, when ``error`` says it did:
        a ``SecurityError`` (credentials, certificates), a write its ACLs deny."""
        from profstream.kafka.diagnose import SecurityError, authorization_error

        if isinstance(error, SecurityError):
            return str(error)
        text = str(error).lower()
        if "fatal error" in text and self.m.connection.secured:  # the producer's own words say no more
            from profstream.kafka.diagnose import fatal_reason

            text = (fatal_reason(self.m.connection) or "").lower()
        if "authorization failed" in text:
            return authorization_error(self.m.connection.principal(), "WRITE", "TOPIC", self.m.topics.raw,
                                       hint="`profstream acl show --role trainer` lists a training job's ACLs")
        return None

    def _mark_up(self) -> None:
        if self._warned_down:
            log.warning("profstream: Kafka at %s reachable again; %d ops dropped so far",
                        self.m.connection, self.buffer.dropped_ops + self._undelivered_totals()[0])
        self._down_since = None
        self._warned_down = False

    # -- batches ----------------------------------------------------------------------

    def _build(self) -> bool:
        """Drain one batch from the buffers into self._pending. False if nothing to send."""
        m, buf = self.m, self.buffer
        (watermark, marks, memory, queues, ops, more_ops, dropped_ops, dropped_samples, devices,
         collectives, loader) = buf.drain(min(buf.batch_max_ops, self._ops_limit))
        if devices:  # before the batch that may move the watermark past their steps
            self._queue_device_batches(devices)
        # what never reached Kafka is reported downstream with what the buffer dropped
        total_dropped_ops = dropped_ops + self.undelivered_ops
        total_dropped_samples = dropped_samples + self.undelivered_samples
        host = self._host_rows
        self._host_rows = []
        if buf.host:  # readings given to Monitor.host_sample (a simulator's)
            host += _take(buf.host)
        dropped_ops = total_dropped_ops - self._reported_dropped_ops
        dropped_samples = total_dropped_samples - self._reported_dropped_samples
        if not (marks or memory or queues or collectives or loader or host or ops or dropped_ops
                or dropped_samples) and watermark == self._sent_watermark:
            return bool(devices)
        batch = EventBatch(
            run_id=m.run_id, rank=m.rank, world_size=m.options["world_size"], host=m.options["host"],
            device=m.options["device"],
            producer_id=m.producer_id, seq=self._seq, sent_ns=self.now_ns(),
            buffer_fill_ratio=buf.fill_ratio, send_latency_ns=self._last_latency_ns,
        )
        if ops:
            dropped_ops += self._fill_ops(batch, ops)
        # Ops beyond this batch stay buffered: the watermark waits for the last of them.
        batch.complete_through_step = self._sent_watermark if more_ops else watermark
        batch.dropped_ops = dropped_ops
        batch.dropped_samples = dropped_samples
        if host:
            batch.host_samples = sample_columns(host, SECTIONS["host_samples"])
        samples = len(marks) + len(memory) + len(queues) + len(collectives) + len(loader)
        # Sections of user code's values; a section with no samples keeps the batch's empty one.
        # A value its column cannot hold drops that section alone, counted (the step marks stay).
        if marks:
            samples -= self._section(batch, marks, lambda: setattr(batch, "steps", mark_columns(marks)))
        if memory:
            samples -= self._section(batch, memory, lambda: setattr(batch, "memory", sample_columns(
                memory, SECTIONS["memory"])))
        if queues:
            def fill_queues() -> None:
                names, qidx = _dictionary([q[0] for q in queues])
                batch.queues = {"name_idx": qidx, **sample_columns([q[1:] for q in queues], SECTIONS["queues"][1:])}
                batch.queue_names = names
            samples -= self._section(batch, queues, fill_queues)
        if collectives:
            samples -= self._section(batch, collectives, lambda: fill_collectives(batch, collectives))
        if loader:  # in the rank's own batch (v8), not one of their own: a processor folds one message fewer
            samples -= self._section(batch, loader, lambda: _fill_loader_samples(batch, loader))
        try:
            value = encode_batch(batch)
        except (ValueError, TypeError, OverflowError) as e:  # bad sample values from user code
            log.warning("profstream: dropped a batch of samples with invalid values (%s)", e)
            batch.dropped_samples += samples
            batch.steps, batch.memory, batch.queues, batch.collectives, batch.loader_samples = (
                empty_section(s) for s in ("steps", "memory", "queues", "collectives", "loader_samples"))
            batch.queue_names = batch.collective_names = []
            value = encode_batch(batch)
        while len(value) > MAX_MESSAGE_BYTES:
            value = self._shrink(batch, len(value))
        self._reported_dropped_ops = total_dropped_ops
        self._reported_dropped_samples = total_dropped_samples
        self._sent_watermark = batch.complete_through_step
        self._seq += 1
        self._queue_message(value, batch.n("ops"), samples)
        return True

    @staticmethod
    def _section(batch: EventBatch, rows: list[tuple], fill: Callable[[], None]) -> int:
        """Fill one sample section; rows whose values its columns cannot hold are dropped,
        counted in the batch and logged. Returns how many were dropped."""
        try:
            fill()
            return 0
        except (ValueError, TypeError, OverflowError) as e:  # bad sample values from user code
            log.warning("profstream: dropped %d samples with invalid values (%s)", len(rows), e)
            batch.dropped_samples += len(rows)
            return len(rows)

    def _queue_device_batches(self, rows: list[tuple]) -> None:
        """Device counter samples into batches of their own (DEVICE_PRODUCER_SUFFIX);
        samples with values that are not numbers are dropped and counted."""
        self._queue_side_batches(rows, DEVICE_PRODUCER_SUFFIX, DEVICE_ROWS_PER_BATCH, _fill_device_samples,
                                 "device samples with values that are not numbers")

    def _queue_side_batches(self, rows: list[tuple], suffix: str, per_batch: int, fill: Any, bad: str) -> None:
        """Rows of one section into batches of their own, under the producer id + ``suffix``
        (with no watermark: the Monitor's own batches carry it); ``fill(batch, rows)`` puts
        them in; rows it or the encoder refuses are dropped and counted, said as ``bad``."""
        m = self.m
        for i in range(0, len(rows), per_batch):
            part = rows[i:i + per_batch]
            batch = EventBatch(
                run_id=m.run_id, rank=m.rank, world_size=m.options["world_size"], host=m.options["host"],
                device=m.options["device"], producer_id=m.producer_id + suffix,
                seq=self._side_seq[suffix], sent_ns=self.now_ns(), buffer_fill_ratio=self._drained_fill_ratio(),
                send_latency_ns=self._last_latency_ns)
            try:
                fill(batch, part)
                value = encode_batch(batch)
            except (ValueError, TypeError, OverflowError) as e:  # from the Monitor's caller
                self._undelivered(0, len(part), f"{bad}: {e}")
                continue
            self._side_seq[suffix] += 1
            self._queue_message(value, 0, len(part))

    def _drained_fill_ratio(self) -> float:
        """The buffer's fill once this cycle's batch has taken its ops."""
        return self.buffer.fill_ratio

    def _queue_message(self, value: bytes, ops: int, samples: int) -> None:
        """A built message, to be sent after those built before it."""
        self._pending.append((value, ops, samples))

    def _shrink(self, batch: EventBatch, size: int) -> bytes:
        """A batch over Kafka's message limit (long op names, say): give its second half of
        ops back to the buffer and send the first; later batches take as few ops. A batch
        that cannot shrink (one op, or samples alone) is dropped and counted."""
        ops, n = batch.ops, batch.n("ops")
        if n > 1:
            keep = n // 2
            names, types = batch.op_names, batch.op_types
            self.buffer.give_back(OpChunk(
                n - keep, [names[i] for i in ops["name_idx"][keep:]], [types[i] for i in ops["type_idx"][keep:]],
                *(ops[c][keep:].copy() for c in ("kind", "stream", "step", "start_ns", "dur_ns", "launch_ns"))))
            head = {c: a[:keep] for c, a in ops.items()}
            batch.op_names, head["name_idx"] = _dictionary([names[i] for i in head["name_idx"]])
            batch.op_types, head["type_idx"] = _dictionary([types[i] for i in head["type_idx"]])
            batch.ops = head
            batch.complete_through_step = self._sent_watermark  # the rest is buffered again
            if keep < self._ops_limit:
                self._ops_limit = keep
                log.warning("profstream: a batch of %d ops encoded to %d bytes, over Kafka's %d byte limit; "
                            "sending at most %d ops a batch from now on", n, size, MAX_MESSAGE_BYTES, keep)
        else:
            samples = batch.n("steps") + batch.n("memory") + batch.n("queues") + batch.n("collectives")
            self._undelivered(n, samples, f"a batch of {size} bytes is over Kafka's message limit")  # the next batch reports it
            for section in ("ops", "steps", "memory", "queues", "collectives"):
                setattr(batch, section, empty_section(section))
            batch.op_names, batch.op_types, batch.queue_names, batch.collective_names = [], [], [], []
        return encode_batch(batch)

    def _fill_ops(self, batch: EventBatch, ops: list[OpChunk]) -> int:
        """Put ops into the batch; returns how many were invalid and dropped."""
        bad = 0
        try:
            names, types, cols, unknown = op_columns(ops)
        except (ValueError, TypeError, OverflowError):
            rows = [row for chunk in ops for row in chunk_rows(chunk)]
            good = [row for row in rows if _valid_op(row)]
            bad = len(rows) - len(good)
            if bad and not self.bad_ops:
                log.warning("profstream: dropped ops with non-numeric start/duration/step/stream "
                            "(first: %r); they are counted as dropped", next(r for r in rows if not _valid_op(r)))
            self.bad_ops += bad
            if not good:
                return bad
            names, types, cols, unknown = op_columns([rows_chunk(good)])
        if unknown and not self.unknown_kinds:
            log.warning("profstream: op kinds not in %s are recorded as 'host'", sorted(KIND_CODES))
        self.unknown_kinds += unknown
        batch.op_names, batch.op_types, batch.ops = names, types, cols
        return bad

    def _send_pending(self) -> None:
        producer = self._producer
        topic = self.m.topics.raw
        while self._pending:
            value, n_ops, n_samples = self._pending[0]
            size = len(value)
            # with a spool, a batch a close purges goes there: its bytes are kept until then
            done = partial(self._on_delivery, size=size, n_ops=n_ops, n_samples=n_samples,
                           sent_at=time.monotonic_ns(), value=value if self._spool is not None else None)
            try:
                producer.send(topic, value, self.m.key, done)
            except BufferError:  # librdkafka's queue is full (a long outage): keep it, retry later
                return
            except confluent_kafka.KafkaException as e:
                if e.args[0].code() != confluent_kafka.KafkaError.MSG_SIZE_TOO_LARGE:
                    self._mark_down(time.monotonic(), e)  # keep the batch, report the outage once
                    return
                self._pending.popleft()  # never sendable (the size check failed us): count it
                self._undelivered(n_ops, n_samples, f"a batch of {size} bytes is over the message limit")
                continue
            except Exception as e:  # anything else: keep the batch, report the outage once
                self._mark_down(time.monotonic(), e)
                return
            self._pending.popleft()
            with self._lock:
                self._inflight_bytes += size
            self.batches_sent += 1
            self.bytes_sent += size

    def _on_delivery(self, error: Exception | None, size: int, n_ops: int, n_samples: int, sent_at: int,
                     value: bytes | None = None, spooled: bool = False) -> None:
        """A delivery report. ``spooled``: a record read back from the spool, which stays
        there unless acknowledged or refused for good; ``value``: a batch's bytes, kept for
        the spool should a close purge it."""
        with self._lock:
            self._inflight_bytes -= size
            if error is None:
                self._acked_batches += 1
                self._last_latency_ns = time.monotonic_ns() - sent_at
            else:
                self._failed_batches += 1
        if error is None:
            self._spool_acks += spooled
            if self._down_since is not None:
                self._mark_up()
        elif _purged(error) and (spooled or (value is not None and self._spool is not None)):
            if not spooled:  # in front of the spool (spool_sending.py); a spooled one is still there
                self._rescued.append((value, n_ops, n_samples))
        else:  # purged at close, or refused by the broker (a topic's own smaller limit, say)
            self._spool_acks += spooled
            self._undelivered(n_ops, n_samples, str(error))

    # -- the spool's hooks (spool_sending.py) -----------------------------------------

    def _spool_poll(self) -> None:
        if self._producer is not None:
            self._producer.poll()

    def _build_batch(self) -> bool:
        return self._build()

    def _take_built(self) -> list[tuple[bytes, int, int]]:
        built = list(self._pending)
        self._pending.clear()
        return built

    def _hand_spooled(self, value: bytes, ops: int, samples: int) -> bool:
        size = len(value)
        done = partial(self._on_delivery, size=size, n_ops=ops, n_samples=samples, sent_at=time.monotonic_ns(),
                       spooled=True)
        try:
            self._producer.send(self.m.topics.raw, value, self.m.key, done)
        except BufferError:  # librdkafka's queue is full: the rest waits
            return False
        except Exception as e:  # the record stays first in the spool; the outage is reported once
            self._mark_down(time.monotonic(), e)
            return False
        with self._lock:
            self._inflight_bytes += size
        self.batches_sent += 1
        self.bytes_sent += size
        return True

    def _spool_settled_count(self) -> int:
        return self._spool_acks

    def _take_rescued(self) -> list[tuple[bytes, int, int]]:
        rescued, self._rescued = self._rescued, []
        return rescued

    def _count_lost_batch(self, ops: int, samples: int, why: str) -> None:
        self._undelivered(ops, samples, why)

    def _on_client_error(self, error: Exception) -> None:
        """librdkafka's client-wide errors: every broker down is an outage (reported once);
        single connection drops are retried by librdkafka and not worth a line."""
        code = error.args[0].code() if error.args else None
        if code == confluent_kafka.KafkaError._ALL_BROKERS_DOWN:
            self._mark_down(time.monotonic(), error)

    def _inflight(self) -> int:
        with self._lock:
            return self._inflight_bytes

    def _sample_host(self) -> None:
        row = host_sample(self._process)
        if row is not None:
            self._host_rows.append(row)

    # -- control (called from other threads) ------------------------------------------

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until everything buffered is acknowledged, the broker's
        return from an outage included; True if it was."""
        deadline = time.monotonic() + timeout
        with self._flush_cv:
            self._flush_requested += 1
            target = self._flush_requested
            self._flush_deadline = max(self._flush_deadline, deadline)
        self._poke()
        with self._flush_cv:
            while self._flush_done < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self.is_alive():
                    return False
                self._flush_cv.wait(left)
            return self._flush_ok

    def stop(self, timeout: float) -> bool:
        """Flush within ``timeout``, then end the thread; the thread closes its producer
        itself (what is left then is counted as undelivered), so a stuck connect never
        holds the caller for long."""
        deadline = time.monotonic() + timeout
        ok = self.flush(timeout)
        self._stopping.set()
        self._poke()
        self.join(timeout=max(1.0, deadline - time.monotonic()))  # about ``timeout`` in all
        if self.is_alive() and not self._acked() and not self._warned_down:  # still in its first connect
            log.warning("profstream: Kafka at %s was not reached before the Monitor closed: %s rank %d's events "
                        "were not sent%s", self.m.connection, self.m.run_id, self.m.rank,
                        _CHECK_BOOTSTRAP)
        return ok and not self._has_pending()

    def _poke(self) -> None:
        """Wake the thread: a flush or stop waits."""
        self.buffer.wake.set()

    def _has_pending(self) -> bool:
        return bool(self._pending)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"batches_sent": self.batches_sent, "bytes_sent": self.bytes_sent,
                    "batches_acked": self._acked_batches, "batches_failed": self._failed_batches,
                    "undelivered_ops": self.undelivered_ops, "undelivered_samples": self.undelivered_samples,
                    "inflight_bytes": self._inflight_bytes, "send_latency_ns": self._last_latency_ns,
                    "pending_batches": len(self._pending), "connected": self._producer is not None,
                    "seq": self._seq, **self.spool_stats()}
