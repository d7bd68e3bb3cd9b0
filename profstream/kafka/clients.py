"""Producer and consumer factories: every Kafka client setting profstream uses, in one place.

Each takes the ``Connection`` (kafka/connection.py: the bootstrap address and the security
properties, built once from the options) or, for tests and tools, a bare bootstrap address.

Two clients: librdkafka (confluent-kafka) where Kafka is on the hot path (the training
process's Monitor, the processors' exactly-once loop), kafka-python for the rest (sinks,
admin, tools), whose pure-Python I/O costs more CPU per message but is simpler to drive."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import confluent_kafka
from kafka import KafkaConsumer, KafkaProducer

from profstream.kafka.connection import Connection
from profstream.kafka.limits import MAX_MESSAGE_BYTES

# kafka-python logs every failed reconnect at ERROR; a training job with a broker down
# would get a line every few seconds. profstream reports outages itself, once. Users who
# set the "kafka" logger's level themselves keep theirs.
_kafka_log = logging.getLogger("kafka")
if _kafka_log.level == logging.NOTSET:
    _kafka_log.setLevel(logging.CRITICAL)
# librdkafka's FATAL line (a producer id refused for want of an ACL, say) is said by
# profstream, explained, once: not twice.
_librdkafka_log = logging.getLogger("kafka.librdkafka")
if _librdkafka_log.level == logging.NOTSET:
    _librdkafka_log.setLevel(logging.CRITICAL + 1)


_PRODUCER_DEFAULTS: dict[str, Any] = {
    "acks": "all",
    "enable_idempotence": True,
    "linger_ms": 5,
    "batch_size": MAX_MESSAGE_BYTES,
    "max_request_size": MAX_MESSAGE_BYTES,
    "request_timeout_ms": 15000,
    "delivery_timeout_ms": 60000,
    "max_block_ms": 5000,
    "bootstrap_timeout_ms": 5000,
    "reconnect_backoff_max_ms": 5000,
    # kafka-python's client metrics (sensors updated several times per request, in Python)
    # cost about a third of a small batch's send; profstream reports its own.
    "metrics_enabled": False,
}

_CONSUMER_DEFAULTS: dict[str, Any] = {
    "enable_auto_commit": False,
    "auto_offset_reset": "earliest",
    "isolation_level": "read_committed",
    "fetch_max_bytes": 32 * 1024 * 1024,
    "max_partition_fetch_bytes": 4 * 1024 * 1024,
    "max_poll_records": 2000,
    "request_timeout_ms": 30000,
    "session_timeout_ms": 10000,
    "heartbeat_interval_ms": 3000,
    "bootstrap_timeout_ms": 5000,
    "reconnect_backoff_max_ms": 5000,
    "metrics_enabled": False,  # as for producers: consumer_lag() and our own metrics instead
}


def _compression(name: str | None) -> str | None:
    return None if name in (None, "none") else name


def refused(conn: Connection | str, timeout: float = 1.0) -> str | None:
    """Why no bootstrap server of ``conn`` takes a TCP connection (a name that does not
    resolve, a refused or unanswered port), or None when one does: a wrong address is known
    at once, not after a client's whole bootstrap timeout. Says nothing of Kafka itself."""
    import socket

    reasons = []
    for item in Connection.of(conn).bootstrap.split(","):
        host, _, port = item.strip().rpartition(":")
        try:
            with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout):
                return None
        except (OSError, ValueError) as e:
            reasons.append(f"{item.strip()}: {getattr(e, 'strerror', None) or e}")
    return "; ".join(reasons)


def make_producer(conn: Connection | str, compression: str | None = "lz4", **overrides: Any) -> KafkaProducer:
    """An idempotent producer (acks=all). Raises kafka.errors.NoBrokersAvailable when the
    bootstrap servers do not answer within bootstrap_timeout_ms."""
    config = dict(_PRODUCER_DEFAULTS, **Connection.of(conn).kafka_python(),
                  compression_type=_compression(compression))
    config.update(overrides)
    return KafkaProducer(**config)


def _native_common(conn: Connection | str) -> dict[str, Any]:
    return {
        **Connection.of(conn).librdkafka(),
        # A broker back from a restart is found within a second: the Monitor's flush and
        # the processors' recovery wait on that (docs/exactly-once.md, "Faults").
        "reconnect.backoff.max.ms": 1000,
        "socket.nagle.disable": True,
        "statistics.interval.ms": 0,
        # librdkafka's own log lines go to the "kafka" logger (quiet unless the user
        # lowers its level), not to the process's stderr
        "logger": logging.getLogger("kafka.librdkafka"),
    }


def _native_producer_config(conn: Connection | str, compression: str | None) -> dict[str, Any]:
    """librdkafka names for :data:`_PRODUCER_DEFAULTS`, plus murmur2 key partitioning (the
    Java and kafka-python default): a key lands on the same partition whichever client
    sent it."""
    return dict(_native_common(conn), **{
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": _PRODUCER_DEFAULTS["linger_ms"],
        "batch.size": MAX_MESSAGE_BYTES,
        "message.max.bytes": MAX_MESSAGE_BYTES,
        "compression.type": _compression(compression) or "none",
        "partitioner": "murmur2_random",
        "request.timeout.ms": _PRODUCER_DEFAULTS["request_timeout_ms"],
    })


# The Monitor's producer, on top of _native_producer_config: no delivery timeout (see
# NativeProducer), whichever client sends; no linger, as the Monitor batches itself (one
# message per batch interval at most) and a linger timer only woke librdkafka's broker
# thread once more per message (3 wake-ups a message instead of 2; each one on a box with
# no idle core is taken from the training loop). One produce request in flight: with two,
# a first one refused for a moment (a partition the broker has not applied yet, just
# after the topic was created, or while it moves) lets the second be written first, and
# a broker with no state for a new producer id takes any first sequence (KIP-360, until
# Kafka 4.5's KAFKA-15591); the first batch can then never be written, or is written
# after later ones: the Monitor's first batches were lost that way (issue 28). A request
# carries every message queued for the partition, so one at a time still sends a
# backlog in 1 MiB requests.
_MONITOR_PRODUCER: dict[str, Any] = {"message.timeout.ms": 0, "linger.ms": 0,
                                     "max.in.flight.requests.per.connection": 1}


def monitor_producer_settings(conn: Connection | str, compression: str | None = "lz4") -> dict[str, str]:
    """The librdkafka settings of the Monitor's producer as strings, for the native sender,
    which opens librdkafka itself (producers/native_sender.py). Same as NativeProducer's,
    but for the log destination: its lines are forwarded to the same "kafka.librdkafka"
    logger by the sender thread."""
    config = dict(_native_producer_config(conn, compression), **_MONITOR_PRODUCER)
    del config["logger"]
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in config.items()}


class NativeProducer:
    """The training process's producer: librdkafka (confluent-kafka) under a small surface.

    kafka-python spends ~2.3 ms of CPU per message in Python threads of the training
    process; librdkafka does the same work in C threads for ~0.35 ms (docs/benchmarks.md
    section 3). Delivery reports (``on_done(error_or_None)``) and client errors
    (``on_error``) are served by :meth:`poll`, :meth:`flush` and :meth:`close`, on the
    calling thread: the Sender's. Same settings as :func:`make_producer`.
    """

    def __init__(self, conn: Connection | str, compression: str | None = "lz4", bootstrap_timeout_ms: int = 5000,
                 on_error: Callable[[Exception], None] | None = None) -> None:
        conn = Connection.of(conn)
        self._on_error = on_error
        # No delivery timeout: a batch waits in librdkafka for the broker to come back however
        # long it is away (retried in order, bounded in memory by the Monitor's in-flight share).
        # It fails only when purged at close, and is counted then. Idempotence keeps retries
        # from writing a batch twice, except across the epoch bump librdkafka makes after some
        # errors around a leader change: the processors take such a copy once (assembler.py).
        self._producer = confluent_kafka.Producer(dict(
            _native_producer_config(conn, compression), **_MONITOR_PRODUCER, error_cb=self._error))
        try:  # like kafka-python's constructor: fail now when no broker answers
            self._producer.list_topics(timeout=bootstrap_timeout_ms / 1000)
        except confluent_kafka.KafkaException as e:
            self._producer.purge()
            raise ConnectionError(conn.redact(f"no Kafka broker answered at {conn}: {e}")) from None

    def _error(self, err: confluent_kafka.KafkaError) -> None:
        if self._on_error is not None:
            self._on_error(confluent_kafka.KafkaException(err))

    def send(self, topic: str, value: bytes, key: bytes | None, on_done: Callable[[Exception | None], None]) -> None:
        """Queue one message; raises BufferError when librdkafka's queue is full."""

        def report(err, _msg) -> None:
            on_done(None if err is None else confluent_kafka.KafkaException(err))

        self._producer.produce(topic, value=value, key=key, on_delivery=report)

    def poll(self) -> None:
        """Serve the delivery reports and errors that are due, without waiting."""
        self._producer.poll(0)

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every queued message's report; True if none is left."""
        return self._producer.flush(timeout) == 0

    def close(self, timeout: float) -> bool:
        """Flush for up to ``timeout`` s, then drop what is left (its reports say so) and
        stop librdkafka's threads. True if everything was delivered."""
        delivered = self.flush(timeout)
        if not delivered:
            self._producer.purge()
            self._producer.poll(0)
        self._producer.close()
        return delivered


def make_native_producer(conn: Connection | str, compression: str | None = "lz4", **kw: Any) -> NativeProducer:
    """A :class:`NativeProducer`; raises ConnectionError when no broker answers in
    ``bootstrap_timeout_ms``."""
    return NativeProducer(conn, compression=compression, **kw)


def make_transactional_producer(conn: Connection | str, transactional_id: str, compression: str | None = "lz4",
                                transaction_timeout_ms: int = 30000, **overrides: Any) -> confluent_kafka.Producer:
    """A librdkafka producer for the processors' exactly-once loop (idempotent, acks=all,
    murmur2 partitioning like :func:`make_producer`); the caller runs init_transactions.
    ``overrides`` are librdkafka property names."""
    config = dict(_native_producer_config(conn, compression),
                  **{"transactional.id": transactional_id, "transaction.timeout.ms": transaction_timeout_ms,
                     "message.timeout.ms": transaction_timeout_ms})
    config.update(overrides)
    return confluent_kafka.Producer(config)


def make_native_consumer(conn: Connection | str, group_id: str, **overrides: Any) -> confluent_kafka.Consumer:
    """A librdkafka consumer with the settings of :func:`make_consumer` (read_committed,
    never commits on its own, from the earliest offset). librdkafka fetches and parses in
    its own C threads, ahead of the application: kafka-python's Python fetcher was what
    two processors in one group waited on (docs/benchmarks.md section 6).
    ``overrides`` are librdkafka property names."""
    return confluent_kafka.Consumer(native_consumer_config(conn, group_id, **overrides))


def native_consumer_config(conn: Connection | str, group_id: str, **overrides: Any) -> dict[str, Any]:
    """The configuration of :func:`make_native_consumer`, for callers that add callbacks."""
    config = dict(
        _native_common(conn),
        **{"group.id": group_id,
           "enable.auto.commit": False,
           "enable.auto.offset.store": False,
           "auto.offset.reset": "earliest",
           "isolation.level": "read_committed",
           "fetch.max.bytes": _CONSUMER_DEFAULTS["fetch_max_bytes"],
           "max.partition.fetch.bytes": _CONSUMER_DEFAULTS["max_partition_fetch_bytes"],
           "session.timeout.ms": _CONSUMER_DEFAULTS["session_timeout_ms"],
           "heartbeat.interval.ms": _CONSUMER_DEFAULTS["heartbeat_interval_ms"],
           # prefetched messages held in memory (default 64 MiB): 16 MiB is hundreds of
           # messages ahead of the loop, and keeps a processor's RSS well under its target
           "queued.max.messages.kbytes": 16 * 1024})
    config.update(overrides)
    return config


def make_consumer(conn: Connection | str, *topics: str, group_id: str | None = None,
                  **overrides: Any) -> KafkaConsumer:
    """A read_committed consumer that never commits on its own: callers commit (or use
    transactions) once their output is durable."""
    config = dict(_CONSUMER_DEFAULTS, **Connection.of(conn).kafka_python(), group_id=group_id)
    config.update(overrides)
    return KafkaConsumer(*topics, **config)


def position_by(consumer: KafkaConsumer, tp: Any, deadline: float | None) -> int | None:
    """``consumer.position(tp)``, waiting for a broker (an offset lookup or validation) no
    later than ``deadline`` (``time.monotonic()``; None: until it answers); None when it was
    not known by then (Kafka away)."""
    left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
    return consumer.position(tp, timeout_ms=left)


def seek_to_times(consumer: KafkaConsumer, times: dict[Any, int]) -> dict[Any, int]:
    """Seek each assigned partition of ``times`` to its first record at or after its time
    (ms), or to its end where there is none; returns the ends. The ends are taken before the
    times: a record written in between is then found by its time, where ends taken after it
    would start past it."""
    ends = consumer.end_offsets(list(times))
    found = consumer.offsets_for_times(times)
    for tp in times:
        at = found.get(tp)
        consumer.seek(tp, at.offset if at is not None else ends[tp])
    return ends


def consumer_lag(consumer: KafkaConsumer, timeout_ms: int | None = None) -> int | None:
    """Messages behind the end of the consumer's assigned partitions, as of its last fetch.
    ``timeout_ms``: the longest to wait in all for positions that need a broker (None: until
    it answers); None when one was not known by then (Kafka away)."""
    deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
    total = 0
    for tp in consumer.assignment():
        high = consumer.highwater(tp)
        if high is not None:
            position = position_by(consumer, tp, deadline)
            if position is None:
                return None
            total += max(0, high - position)
    return total


def read_topic(conn: Connection | str, topic: str, want, count: int, timeout: float,
               decode=None) -> list:
    """Read ``topic`` from the start (read_committed, no group) until ``count`` values
    satisfying ``want(value)`` are seen or ``timeout`` seconds pass; returns those seen.

    ``decode`` turns the raw message value into the value handed to ``want``."""
    from kafka import TopicPartition

    consumer = make_consumer(conn, group_id=None, enable_auto_commit=False)
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        seen: list = []
        deadline = time.monotonic() + timeout
        while len(seen) < count and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=200).values():
                for rec in records:
                    value = decode(rec.value) if decode else rec.value
                    if want(value):
                        seen.append(value)
        return seen
    finally:
        consumer.close()
