"""Producer and consumer factories: every Kafka client setting profstream uses, in one place."""

from __future__ import annotations

import logging
from typing import Any

from kafka import KafkaConsumer, KafkaProducer

# kafka-python logs every failed reconnect at ERROR; a training job with a broker down
# would get a line every few seconds. profstream reports outages itself, once. Users who
# set the "kafka" logger's level themselves keep theirs.
_kafka_log = logging.getLogger("kafka")
if _kafka_log.level == logging.NOTSET:
    _kafka_log.setLevel(logging.CRITICAL)

# The largest message the broker takes by default is ~1 MB; a producer batch of many
# of our messages goes in one request.
MAX_REQUEST_BYTES = 1024 * 1024

_PRODUCER_DEFAULTS: dict[str, Any] = {
    "acks": "all",
    "enable_idempotence": True,
    "linger_ms": 5,
    "batch_size": MAX_REQUEST_BYTES,
    "max_request_size": MAX_REQUEST_BYTES,
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


def make_producer(bootstrap: str, compression: str | None = "lz4", **overrides: Any) -> KafkaProducer:
    """An idempotent producer (acks=all). Raises kafka.errors.NoBrokersAvailable when the
    bootstrap servers do not answer within bootstrap_timeout_ms."""
    config = dict(_PRODUCER_DEFAULTS, bootstrap_servers=bootstrap.split(","),
                  compression_type=_compression(compression))
    config.update(overrides)
    return KafkaProducer(**config)


def make_consumer(bootstrap: str, *topics: str, group_id: str | None = None, **overrides: Any) -> KafkaConsumer:
    """A read_committed consumer that never commits on its own: callers commit (or use
    transactions) once their output is durable."""
    config = dict(_CONSUMER_DEFAULTS, bootstrap_servers=bootstrap.split(","), group_id=group_id)
    config.update(overrides)
    return KafkaConsumer(*topics, **config)


def consumer_lag(consumer: KafkaConsumer) -> int:
    """Messages behind the end of the consumer's assigned partitions, as of its last fetch."""
    total = 0
    for tp in consumer.assignment():
        high = consumer.highwater(tp)
        if high is not None:
            total += max(0, high - consumer.position(tp))
    return total


def read_topic(bootstrap: str, topic: str, want, count: int, timeout: float,
               decode=None) -> list:
    """Read ``topic`` from the start (read_committed, no group) until ``count`` values
    satisfying ``want(value)`` are seen or ``timeout`` seconds pass; returns those seen.

    ``decode`` turns the raw message value into the value handed to ``want``."""
    import time

    from kafka import TopicPartition

    consumer = make_consumer(bootstrap, group_id=None, enable_auto_commit=False)
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
