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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from kafka import ConsumerRebalanceListener, TopicPartition
from kafka.errors import KafkaError, ProducerFencedError
from kafka.structs import OffsetAndMetadata

from profstream.kafka.clients import consumer_lag, make_consumer, make_producer

log = logging.getLogger("profstream.processor")


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
    def fold(self, record: Any, now: float) -> list[Output]: ...
    def ready(self, now: float) -> list[Output]: ...
    def changed_state(self) -> list[Output]: ...
    def commit_offset(self, partition: int, position: int) -> int: ...
    def drop_partitions(self, partitions: Iterable[int]) -> None: ...


class FencedError(RuntimeError):
    """Another processor with the same instance id took over."""


class TransactionalLoop(ConsumerRebalanceListener):
    def __init__(self, bootstrap: str, stage: Stage, group_id: str, instance_id: str,
                 commit_interval_ms: float = 100.0, poll_ms: int = 50, compression: str = "lz4",
                 on_commit=None) -> None:
        self.bootstrap = bootstrap
        self.stage = stage
        self.commit_interval = commit_interval_ms / 1000.0
        self.poll_ms = poll_ms
        self.on_commit = on_commit  # called after each commit with the number of outputs
        self.transactional_id = f"{group_id}-{instance_id}"
        self._producer = make_producer(bootstrap, compression=compression, transactional_id=self.transactional_id,
                                       transaction_timeout_ms=30000, max_block_ms=30000)
        self._producer.init_transactions()
        self._consumer = make_consumer(bootstrap, group_id=group_id, group_instance_id=self.transactional_id,
                                       session_timeout_ms=10000)
        # Know the input's partitions before joining: a first assignment computed without
        # them is empty and forces an immediate rejoin, after which kafka-python 3.0 can
        # leave the member waiting forever for its SyncGroup answer (seen in our tests).
        if not self._consumer.partitions_for_topic(stage.input_topic):
            self._consumer.close()
            self._producer.close(timeout=1)
            raise RuntimeError(f"input topic {stage.input_topic} does not exist: create it first "
                               "(`profstream process` does)")
        self._consumer.subscribe([stage.input_topic], listener=self)
        self._max_poll_records = self._consumer.config["max_poll_records"]
        self._positions: dict[TopicPartition, int] = {}
        self._txn_started: float | None = None
        self._txn_outputs = 0
        self.transactions = 0
        self.aborts = 0
        self.lag = 0  # input messages not consumed yet; updated on the loop's thread
        self._lag_at = 0.0

    # -- rebalance --------------------------------------------------------------------

    def on_partitions_revoked(self, revoked) -> None:
        if self._txn_started is not None:
            self._commit()
        self.stage.drop_partitions(tp.partition for tp in revoked)
        for tp in revoked:
            self._positions.pop(tp, None)

    def on_partitions_assigned(self, assigned) -> None:
        self._restore(tp.partition for tp in assigned)

    def _restore(self, partitions: Iterable[int]) -> None:
        parts = [TopicPartition(self.stage.state_topic, p) for p in partitions]
        if not parts:
            return
        reader = make_consumer(self.bootstrap, group_id=None)
        try:
            reader.assign(parts)
            reader.seek_to_beginning(*parts)
            end = reader.end_offsets(parts)
            left = {tp for tp in parts if end[tp] > 0}
            now = time.monotonic()
            while left:
                for tp, records in reader.poll(timeout_ms=500).items():
                    for rec in records:
                        self.stage.restore(tp.partition, rec.key, rec.value, now)
                for tp in list(left):
                    if reader.position(tp) >= end[tp]:
                        left.discard(tp)
        finally:
            reader.close()

    # -- loop -------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self.step()
            if self._txn_started is not None:
                self._commit()
        finally:
            self.close()

    def step(self) -> None:
        polled = self._consumer.poll(timeout_ms=self.poll_ms)
        now = time.monotonic()
        if now - self._lag_at >= 1.0:  # consumers are not thread-safe: metrics read self.lag
            self.lag = consumer_lag(self._consumer)
            self._lag_at = now
        try:
            for tp, records in polled.items():
                self._begin()
                for rec in records:
                    self._send(self.stage.fold(rec, now))
                self._positions[tp] = records[-1].offset + 1
            outputs = self.stage.ready(now)
            if outputs:
                self._begin()
                self._send(outputs)
            if self._txn_started is not None and self._commit_due(now, polled):
                self._commit()
        except ProducerFencedError as e:
            raise FencedError(f"processor {self.transactional_id} was fenced by a newer one with the same "
                              f"instance id: run each processor with its own --instance-id ({e})") from None
        except KafkaError as e:
            self._abort(e)

    def _commit_due(self, now: float, polled: dict) -> bool:
        """Commit when the input is drained, when the interval is up, or, once outputs wait
        and the loop is at the head of its input (a short poll), after a fifth of it: figures
        become visible within tens of ms while live, and catching up keeps large transactions."""
        open_s = now - self._txn_started
        if not polled or open_s >= self.commit_interval:
            return True
        return (self._txn_outputs > 0 and open_s >= self.commit_interval / 5
                and sum(len(r) for r in polled.values()) < self._max_poll_records)

    def _begin(self) -> None:
        if self._txn_started is None:
            self._producer.begin_transaction()
            self._txn_started = time.monotonic()
            self._txn_outputs = 0

    def _send(self, outputs: list[Output]) -> None:
        send = self._producer.send
        for out in outputs:
            send(out.topic, value=out.value, key=out.key, partition=out.partition, headers=out.headers)
        self._txn_outputs += len(outputs)

    def _commit(self) -> None:
        self._send(self.stage.changed_state())
        offsets = {tp: OffsetAndMetadata(self.stage.commit_offset(tp.partition, pos), "", -1)
                   for tp, pos in self._positions.items()}
        if offsets:
            self._producer.send_offsets_to_transaction(offsets, self._consumer.group_metadata())
        self._producer.commit_transaction()
        self._txn_started = None
        self.transactions += 1
        if self.on_commit is not None:
            self.on_commit(self._txn_outputs)

    def _abort(self, error: Exception) -> None:
        """Abort, then rebuild the stage from the changelog and the committed offsets."""
        log.warning("profstream processor: transaction aborted (%s); rebuilding state from the checkpoint", error)
        self.aborts += 1
        if self._txn_started is not None:
            try:
                self._producer.abort_transaction()
            except KafkaError as e:
                log.warning("profstream processor: abort failed too (%s)", e)
        self._txn_started = None
        assigned = list(self._consumer.assignment())
        self.stage.drop_partitions(tp.partition for tp in assigned)
        self._positions.clear()
        self._restore(tp.partition for tp in assigned)
        committed = {tp: self._consumer.committed(tp) for tp in assigned}
        for tp, offset in committed.items():
            if offset is None:
                self._consumer.seek_to_beginning(tp)
            else:
                self._consumer.seek(tp, offset)

    def close(self) -> None:
        try:
            if self._txn_started is not None:
                self._producer.abort_transaction()
        except KafkaError:
            pass
        finally:
            self._producer.close(timeout=5)
            self._consumer.close()
