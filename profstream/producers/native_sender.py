"""``NativeSender``: the Sender of a Monitor that records natively (``native.NativeBuffer``).

The batches are built, encoded and handed to librdkafka by the compiled ``Batcher`` with
the GIL released, and in the steady state the thread stays in native code cycle after
cycle: it waits for the batch interval or a wake-up, builds, sends and hears the broker's
acknowledgements without taking the GIL once. It comes back to Python only for what
Python does: connecting (and topic creation), a flush or stop, a log line to write (an
outage, lost events, invalid values), host samples where /proc cannot be read, and every
``STEADY_S`` seconds, and rows of the sections the native encoder does not write (device
samples, collective calls: ``native.foreign_sections``), which the Python encoder sends from
here in batches of their own, queued before the next native batch (the Batcher holds the
watermark back while they wait), so no step is complete on the wire before them.
While the Monitor spools (``spool_sending.py``), Python builds, writes and reads back the
batches, and the Batcher sends what it is handed and hears the broker.
Everything else, and every rule, is ``sender.Sender``'s.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import confluent_kafka

from profstream.kafka.clients import monitor_producer_settings
from profstream.kafka.connection import Connection
from profstream.kafka.limits import MAX_MESSAGE_BYTES
from profstream.producers import native
from profstream.producers.sender import (
    COLLECTIVE_PRODUCER_SUFFIX,
    COLLECTIVE_ROWS_PER_BATCH,
    Sender,
    Source,
    fill_collectives,
    host_sample,
)
from profstream.schema.batch import KIND_CODES

log = logging.getLogger("profstream.monitor")
_librdkafka_log = logging.getLogger("kafka.librdkafka")

STEADY_S = 10.0  # the longest the thread stays in native code while nothing needs Python


def make_direct_producer(conn: Connection | str, compression: str | None = "lz4", bootstrap_timeout_ms: int = 5000,
                         on_error: Any = None, *, topic: str, key: bytes, sink: Any) -> Any:
    """The native sender's producer: librdkafka with the Monitor's settings
    (``kafka.clients.monitor_producer_settings``), sending to ``topic`` with ``key``, its
    deliveries and errors heard by ``sink`` (the Batcher) without the GIL. Raises
    ConnectionError when no broker answers in ``bootstrap_timeout_ms``. ``on_error`` is
    unused: client errors come back as the Batcher's events."""
    module, why = native.load()
    if module is None:
        raise RuntimeError(why)
    conn = Connection.of(conn)
    try:
        return module.Producer(monitor_producer_settings(conn, compression), topic, key, sink, bootstrap_timeout_ms)
    except (ValueError, ConnectionError) as e:  # librdkafka's words may quote a setting's value: never a secret's
        raise type(e)(conn.redact(str(e))) from None


class NativeSender(Sender):
    """Builds and sends the batches of one natively recording Monitor (see the module)."""

    default_producer = staticmethod(make_direct_producer)

    def __init__(self, monitor: Source, producer_factory=None) -> None:
        super().__init__(monitor, producer_factory)
        module, why = native.load()
        if module is None:
            raise RuntimeError(why)
        m, buf = monitor, monitor.buffer
        opts = m.options
        constants = {"run_id": m.run_id, "rank": m.rank, "world_size": opts["world_size"], "host": opts["host"],
                     "device": opts["device"], "producer_id": m.producer_id}
        self._core = module.Batcher(buf, native.batch_plan(constants), MAX_MESSAGE_BYTES, m.inflight_limit_bytes,
                                    self._interval, self.idle_send_s, self._host_interval or 0.0, buf.host,
                                    native.batch_plan(constants, marked=True))
        self._foreign_taken = 0  # foreign rows recorded and taken (buffer.foreign_recorded_count)
        self._spool_rescue(self._spool is not None)

    # -- thread -----------------------------------------------------------------------

    def run(self) -> None:
        core = self._core
        cycle = True
        while True:
            core.clear_interrupt()  # before reading what a flush or stop asks
            stopping = self._stopping.is_set()
            try:
                self._send_foreign()
                if cycle or stopping:
                    self._cycle()
                self._handle_events()
            except Exception:  # a bug here must not end profiling silently
                log.exception("profstream sender: unexpected error; continuing")
            if self._serve_flush():
                cycle = True
                continue
            if stopping:
                self._close_producer()
                self._handle_events()
                return
            if self._spool_now:  # Python's cycles: run() returns as soon as one is due
                core.run(STEADY_S if self._record_only or self._producer is not None
                         else max(self._next_connect - time.monotonic(), self._interval))
                cycle = True
            elif self._spooling():  # Kafka just went away (an event said so): spool from the next cycle on
                cycle = True
            elif self._producer is None:  # the next connection attempt; host samples meanwhile
                core.run(max(self._next_connect - time.monotonic(), self._interval))
                cycle = True
            else:  # the steady state: no GIL until something needs Python
                core.run(STEADY_S)
                cycle = self._stopping.is_set() or self._flush_waits()
                self._spool_settle()  # spooled records handed over before: off the disk once acknowledged

    def _flush_waits(self) -> bool:
        with self._flush_cv:
            return self._flush_requested > self._flush_done

    def _cycle(self) -> None:
        if self._producer is None and not self._record_only:
            self._connect(time.monotonic())
        self._send_foreign()
        spooling = self._spooling()
        self._core.set_spooling(spooling)
        if spooling:
            self._spool_cycle()
            return
        self._spool_now = False
        self._core.cycle()  # host samples even while Kafka is away
        self._spool_settle()  # records handed over before batches went straight to Kafka again

    def _send_foreign(self) -> None:
        """The rows of the sections the native encoder does not write (device samples,
        collective calls) in batches of their own, by the Python Sender's code, queued
        before the next native batch, which may complete their steps: the Batcher holds the
        watermark back until they are taken."""
        buf = self.buffer
        recorded = buf.foreign_recorded_count  # before taking: every row it counts is in
        if recorded == self._foreign_taken:
            return
        drained = buf.foreign.drain(0)
        if drained.devices or drained.collectives:
            self._last_latency_ns = self._core.stats()["send_latency_ns"]
        if drained.devices:
            self._queue_device_batches(drained.devices)
        if drained.collectives:
            self._queue_side_batches(drained.collectives, COLLECTIVE_PRODUCER_SUFFIX, COLLECTIVE_ROWS_PER_BATCH,
                                     fill_collectives, "collective calls with values out of range")
        buf.foreign_taken(recorded, drained.dropped_samples)  # the Python buffer's drops of every kind
        self._foreign_taken = recorded

    def _queue_message(self, value: bytes, ops: int, samples: int) -> None:
        self._core.enqueue(value, ops, samples)

    def _drained_fill_ratio(self) -> float:  # device batches go before the batch that takes the ops
        buf = self.buffer
        return max(0, buf.buffered_ops - min(buf.batch_max_ops, self._ops_limit)) / buf.max_ops

    def _handle_events(self) -> None:
        """What the native thread left for Python: log lines, outages, host samples."""
        for kind, a, b, text in self._core.take_events():
            if kind == "undelivered":
                self._say_lost(a, b, text)
            elif kind == "oversize":
                log.warning("profstream: a batch of %d ops encoded to %d bytes, over Kafka's %d byte limit; "
                            "sending at most %s ops a batch from now on", a, b, MAX_MESSAGE_BYTES, text)
            elif kind == "client_error":
                self._on_client_error(confluent_kafka.KafkaException(confluent_kafka.KafkaError(a, text)))
            elif kind == "produce_error":
                self._mark_down(time.monotonic(), confluent_kafka.KafkaException(confluent_kafka.KafkaError(a, text)))
            elif kind == "up":
                if self._down_since is not None:
                    self._mark_up()
            elif kind == "host_due":  # no /proc here: psutil, with the GIL
                row = host_sample(self._process)
                if row is not None:
                    self.buffer.add_sample(self.buffer.host, row)
            elif kind == "bad_ops":
                log.warning("profstream: dropped ops with non-numeric start/duration/step/stream (first: %r); "
                            "they are counted as dropped", self.buffer.first_bad()[0])
            elif kind == "bad_samples":
                log.warning("profstream: dropped samples with invalid values (first: %r); they are counted as "
                            "dropped", self.buffer.first_bad()[1])
            elif kind == "unknown_kinds":
                log.warning("profstream: op kinds not in %s are recorded as 'host'", sorted(KIND_CODES))
        if self._producer is not None:  # librdkafka's own lines, to the logger confluent-kafka's go to
            for line in self._producer.take_logs():
                level, _, text = line.partition(" ")
                if _librdkafka_log.isEnabledFor(_syslog_level(level)):
                    _librdkafka_log.log(_syslog_level(level), "%s", text)

    # -- the Sender's hooks -----------------------------------------------------------

    def _producer_options(self) -> dict[str, Any]:
        return {"topic": self.m.topics.raw, "key": self.m.key, "sink": self._core}

    def _connected(self) -> None:
        self._core.attach(self._producer)

    def _close_producer(self) -> None:
        producer = self._producer
        super()._close_producer()  # closes it: its reports of what it held are counted natively
        if producer is not None:
            self._core.attach(None)

    def _drop_unsent(self) -> tuple[int, int]:
        ops, samples = self._core.drop_pending()
        return ops + self.buffer.buffered_ops, samples + self.buffer.buffered_samples

    def _undelivered_totals(self) -> tuple[int, int]:
        stats = self._core.stats()
        return stats["undelivered_ops"], stats["undelivered_samples"]

    def _acked(self) -> int:
        return self._core.stats()["batches_acked"]

    def _count_undelivered(self, ops: int, samples: int) -> None:
        self._core.add_undelivered(ops, samples)

    def _mark_down(self, now: float, error: BaseException) -> None:
        self._core.set_down(True)
        super()._mark_down(now, error)

    def _mark_up(self) -> None:
        self._core.set_down(False)
        super()._mark_up()

    def _buffered(self) -> bool:
        return bool(self._core.pending()[0]) or not self.buffer.empty

    def _has_pending(self) -> bool:
        return bool(self._core.pending()[0])

    def _inflight(self) -> int:
        return self._core.inflight_bytes

    def _poke(self) -> None:
        super()._poke()
        self._core.interrupt()

    # -- the spool's hooks (spool_sending.py) -----------------------------------------

    def _spool_poll(self) -> None:
        self._core.cycle()  # in spooling mode: host samples, acknowledgements, what was handed over

    def _build_batch(self) -> bool:
        return self._core.build()

    def _take_built(self) -> list[tuple[bytes, int, int]]:
        built = []
        while (message := self._core.take_message()) is not None:
            built.append(message)
        return built

    def _hand_spooled(self, value: bytes, ops: int, samples: int) -> bool:
        core = self._core
        if not core.send():  # one handed over earlier still waits for room in librdkafka's queue
            return False
        core.enqueue(value, ops, samples, True)
        core.send()  # if librdkafka's queue is full it waits in the Batcher, handed over all the same
        return True

    def _spool_settled_count(self) -> int:
        return self._core.stats()["spool_settled"]

    def _spool_rescue(self, on: bool) -> None:
        self._core.set_rescue(on)

    def _take_rescued(self) -> list[tuple[bytes, int, int]]:
        return self._core.take_rescued()

    def stats(self) -> dict[str, Any]:
        out = self._core.stats()
        out["connected"] = self._producer is not None
        out.update(self.spool_stats())
        return out


def _syslog_level(level: str) -> int:
    """librdkafka's syslog levels (0 emergency .. 7 debug) as logging's."""
    n = int(level) if level.isdigit() else 7
    return logging.ERROR if n <= 3 else logging.WARNING if n == 4 else logging.INFO if n <= 6 else logging.DEBUG
