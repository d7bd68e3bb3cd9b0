"""Exactly-once consume-transform-produce: the one place that decides what commits when.

A ``Stage`` folds input records into state and hands back output records. This loop
runs it inside Kafka transactions: every commit interval, the outputs, a changelog
record per changed state key (to the stage's compacted state topic, in the partition of
the input partition it belongs to) and the consumed offsets commit together, or not at
all. The offset committed for an input partition is the stage's ``commit_offset``: the
first input offset it would need again to rebuild what it holds in memory only.

After a restart or a rebalance, a partition's owner reads that partition's changelog to
its end (read_committed), then consumes from the committed offset. A transaction that
fails is aborted and the stage is rebuilt the same way, so nothing is counted twice.
Fencing: the transactional id is ``<group>-<instance>`` and offsets carry the consumer
group metadata (KIP-447); a processor restarted with the same instance id takes over
from its dead predecessor at once (static group membership).

Both clients are librdkafka's (confluent-kafka): it fetches and decompresses ahead of the
loop in C threads, so the loop's thread spends its time in the stage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import confluent_kafka
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from profstream.kafka.clients import (
    make_native_consumer,
    make_transactional_producer,
    native_consumer_lag,
)

log = logging.getLogger("profstream.processor")

_FENCED = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
_TIMEOUT_S = 30.0  # for a transaction call, a group metadata or committed-offsets request


class Record(NamedTuple):
    """One input message, as a Stage sees it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True)
class Output:
    topic: str
    key: bytes | None
    value: bytes | None
    partition: int | None = None
    headers: list[tuple[str, bytes]] | None = None


class Stage(Protocol):
    input_topic: str
    state_topic: str

    def restore(self, partition: int, key: bytes, value: bytes | None, now: float) -> None: ...
    def fold(self, record: Record, now: float) -> list[Output]: ...
    def ready(self, now: float) -> list[Output]: ...
    def changed_state(self) -> list[Output]: ...
    def commit_offset(self, partition: int, position: int) -> int: ...
    def drop_partitions(self, partitions: Iterable[int]) -> None: ...


class FencedError(RuntimeError):
    """Another processor with the same instance id took over."""


class TransactionalLoop:
    def __init__(self, bootstrap: str, stage: Stage, group_id: str, instance_id: str,
                 commit_interval_ms: float = 100.0, poll_ms: int = 50, compression: str = "lz4",
                 on_commit=None, max_poll_records: int = 500) -> None:
        self.bootstrap = bootstrap
        self.stage = stage
        self.commit_interval = commit_interval_ms / 1000.0
        self.poll_s = poll_ms / 1000.0
        self.on_commit = on_commit  # called after each commit with the number of outputs
        self.transactional_id = f"{group_id}-{instance_id}"
        self._max_poll_records = max_poll_records
        self._producer = make_transactional_producer(bootstrap, self.transactional_id, compression)
        try:
            self._producer.init_transactions(_TIMEOUT_S)
        except KafkaException as e:
            raise RuntimeError(f"processor {self.transactional_id}: Kafka at {bootstrap} did not start a "
                               f"transaction ({e.args[0].str()}): check --bootstrap") from None
        # Heartbeats every 0.5 s: a member learns of a rebalance (a processor joining or
        # leaving) at its next heartbeat, and the whole group waits for the slowest.
        self._consumer = make_native_consumer(bootstrap, group_id, **{"group.instance.id": self.transactional_id,
                                                                      "heartbeat.interval.ms": 500})
        topic = self._consumer.list_topics(stage.input_topic, timeout=_TIMEOUT_S).topics.get(stage.input_topic)
        if topic is None or topic.error is not None or not topic.partitions:
            self._consumer.close()
            raise RuntimeError(f"input topic {stage.input_topic} does not exist: create it first "
                               "(`profstream process` does)")
        self._consumer.subscribe([stage.input_topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_revoke)
        self._positions: dict[int, int] = {}  # input partition -> next offset to consume
        self._txn_started: float | None = None
        self._txn_outputs = 0
        self.transactions = 0
        self.aborts = 0
        self.lag = 0  # input messages not consumed yet; updated on the loop's thread
        self._lag_at = 0.0
        self._assigned: set[int] = set()

    def assignment(self) -> list[int]:
        """The input partitions this loop owns now (as of its last poll)."""
        return sorted(self._assigned)

    # -- rebalance (called by librdkafka inside consume(), on the loop's thread) ------

    def _on_revoke(self, _consumer, revoked: list[TopicPartition]) -> None:
        if self._txn_started is not None:
            try:
                self._commit()
            except KafkaException as e:  # the next owner re-reads from the last commit
                self._abort_open(e)
        parts = {tp.partition for tp in revoked}
        self.stage.drop_partitions(parts)
        for p in parts:
            self._positions.pop(p, None)
        self._assigned -= parts

    def _on_assign(self, _consumer, assigned: list[TopicPartition]) -> None:
        parts = [tp.partition for tp in assigned]
        self._restore(parts)
        self._assigned.update(parts)

    def _restore(self, partitions: Iterable[int]) -> None:
        """Read the changelog partitions to their end (read_committed) into the stage."""
        topic = self.stage.state_topic
        reader = make_native_consumer(self.bootstrap, f"{self.transactional_id}-restore",
                                      **{"enable.partition.eof": True})
        try:
            left = set()
            for p in partitions:
                low, high = reader.get_watermark_offsets(TopicPartition(topic, p), timeout=_TIMEOUT_S)
                if high > low:
                    left.add(p)
            if not left:
                return
            reader.assign([TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING) for p in sorted(left)])
            now = time.monotonic()
            while left:
                for msg in reader.consume(num_messages=1000, timeout=0.5):
                    err = msg.error()
                    if err is None:
                        self.stage.restore(msg.partition(), msg.key(), msg.value(), now)
                    elif err.code() == KafkaError._PARTITION_EOF:
                        left.discard(msg.partition())
                    else:
                        raise KafkaException(err)
        finally:
            reader.close()

    # -- loop -------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self.step()
            if self._txn_started is not None:
                self._guarded(self._commit)
        finally:
            self.close()

    def step(self) -> None:
        self._guarded(self._step)

    def _guarded(self, work) -> None:
        try:
            work()
        except KafkaException as e:
            err = e.args[0]
            if err.code() in _FENCED:
                raise FencedError(f"processor {self.transactional_id} was fenced by a newer one with the same "
                                  f"instance id: run each processor with its own --instance-id ({err.str()})") from None
            if err.fatal():
                raise RuntimeError(f"processor {self.transactional_id}: fatal Kafka error ({err.str()}); "
                                   "restart it: its state is rebuilt from the last commit") from None
            self._abort(e)

    def _step(self) -> None:
        msgs = self._poll()
        now = time.monotonic()
        if now - self._lag_at >= 1.0:  # metrics read self.lag from other threads
            self.lag = native_consumer_lag(self._consumer)
            self._lag_at = now
        consumed = 0
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("profstream processor: consumer error (%s); librdkafka retries", err.str())
                continue
            if msg.partition() not in self._assigned:
                continue  # revoked within this consume() call
            self._begin()
            rec = Record(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value())
            self._send(self.stage.fold(rec, now))
            self._positions[rec.partition] = rec.offset + 1
            consumed += 1
        outputs = self.stage.ready(now)
        if outputs:
            self._begin()
            self._send(outputs)
        if self._txn_started is not None and self._commit_due(now, consumed):
            self._commit()

    def _poll(self) -> list:
        """What the consumer has now, up to max_poll_records; when it has nothing, wait up
        to poll_ms for the first message only. (``consume(n, timeout)`` alone would wait the
        whole timeout for n messages whenever fewer are there: every live step ~50 ms late.)"""
        consume, n = self._consumer.consume, self._max_poll_records
        msgs = consume(n, 0)
        if not msgs:
            msgs = consume(1, self.poll_s)
            if msgs:
                msgs += consume(n - 1, 0)
        return msgs

    def _commit_due(self, now: float, consumed: int) -> bool:
        """Commit when the input is drained, when the interval is up, or, once outputs wait
        and the loop is at the head of its input (a short poll), after a fifth of it: figures
        become visible within tens of ms while live, and catching up keeps large transactions."""
        open_s = now - self._txn_started
        if not consumed or open_s >= self.commit_interval:
            return True
        return self._txn_outputs > 0 and open_s >= self.commit_interval / 5 and consumed < self._max_poll_records

    def _begin(self) -> None:
        if self._txn_started is None:
            self._producer.begin_transaction()
            self._txn_started = time.monotonic()
            self._txn_outputs = 0

    def _send(self, outputs: list[Output]) -> None:
        produce = self._producer.produce
        for out in outputs:
            while True:
                try:
                    if out.partition is None:
                        produce(out.topic, out.value, out.key, headers=out.headers)
                    else:
                        produce(out.topic, out.value, out.key, out.partition, headers=out.headers)
                    break
                except BufferError:  # librdkafka's queue is full: let it send, then go on
                    self._producer.poll(0.05)
        self._txn_outputs += len(outputs)

    def _commit(self) -> None:
        self._send(self.stage.changed_state())
        topic = self.stage.input_topic
        offsets = [TopicPartition(topic, p, self.stage.commit_offset(p, pos)) for p, pos in self._positions.items()]
        if offsets:
            self._producer.send_offsets_to_transaction(offsets, self._consumer.consumer_group_metadata(), _TIMEOUT_S)
        self._producer.commit_transaction(_TIMEOUT_S)
        self._txn_started = None
        self.transactions += 1
        if self.on_commit is not None:
            self.on_commit(self._txn_outputs)

    def _abort_open(self, error: Exception) -> None:
        log.warning("profstream processor: transaction aborted (%s); rebuilding state from the checkpoint", error)
        self.aborts += 1
        if self._txn_started is not None:
            try:
                self._producer.abort_transaction(_TIMEOUT_S)
            except KafkaException as e:
                log.warning("profstream processor: abort failed too (%s)", e)
        self._txn_started = None

    def _abort(self, error: Exception) -> None:
        """Abort, then rebuild the stage from the changelog and the committed offsets."""
        self._abort_open(error)
        parts = self.assignment()
        self.stage.drop_partitions(parts)
        self._positions.clear()
        self._restore(parts)
        topic = self.stage.input_topic
        committed = self._consumer.committed([TopicPartition(topic, p) for p in parts], timeout=_TIMEOUT_S)
        for tp in committed:
            offset = tp.offset if tp.offset >= 0 else confluent_kafka.OFFSET_BEGINNING
            self._consumer.seek(TopicPartition(topic, tp.partition, offset))

    def close(self) -> None:
        try:
            if self._txn_started is not None:
                self._producer.abort_transaction(5.0)
        except KafkaException:
            pass
        finally:
            self._producer.flush(5.0)
            self._consumer.close()
