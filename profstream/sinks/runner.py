"""The one consume loop every sink runs: read topics, hand records over, commit.

A sink implements ``handle(records)`` (records of one poll, in partition order) and may
implement ``durable_offsets()``: the offsets it has made durable so far (a file written
and renamed, say). Offsets are committed only up to what the sink says is durable, so a
crash neither loses nor, for sinks that deduplicate, repeats anything. Sinks that keep
nothing (an exporter serving current values) commit everything they handled. A sink may
also implement ``tick()`` (called before each poll, for work due by time) and ``close()``
(called once when the loop stops, before its last commit).

A commit the group refuses while it rebalances, or one that fails while Kafka is away,
is postponed, not fatal: the next poll commits again. While Kafka is away no call of the
loop waits longer than ``KAFKA_WAIT_MS`` (kafka-python's commit otherwise retries for its
whole request timeout, and a position for ever), so that ``tick()`` work and a stop go on.
On stop the loop polls on (at most ``FINAL_COMMIT_S``) until a commit goes through, and
after closing the sink retries a commit the group refused (partitions paused), so
that a restart re-reads as little as possible.

Readers use read_committed: they see the processors' transactional outputs only once
committed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import kafka.errors
from kafka import TopicPartition
from kafka.errors import CommitFailedError, RebalanceInProgressError
from kafka.structs import OffsetAndMetadata

from profstream.kafka.clients import consumer_lag, make_consumer
from profstream.kafka.connection import Connection

log = logging.getLogger("profstream.sink")

POSTPONED = (CommitFailedError, RebalanceInProgressError)  # the group is rebalancing: commit later
# Kafka away: poll and commit later. Every error kafka-python calls retriable: a cluster down
# for 30 s surfaced as a RequestTimedOutError from a position's metadata refresh, not only as
# the connection and timeout errors, and ended the archive sink (tests/faults).
UNREACHABLE = tuple(e for e in vars(kafka.errors).values()
                    if isinstance(e, type) and issubclass(e, kafka.errors.KafkaError) and e.retriable)
_SAY_EVERY_S = 60.0
FINAL_COMMIT_S = 10.0
KAFKA_WAIT_MS = 3000  # the longest a commit or the lag's positions wait for Kafka in one poll


def wait_for_topics(consumer: Any, topics: Sequence[str], wait_s: float,
                    denied: Callable[[str], str | None] | None = None) -> None:
    """Return once every topic exists; wait up to ``wait_s`` for the missing ones (a sink
    started beside the processor that creates them), saying so in one line; then raise
    RuntimeError naming the first missing topic and what to do. ``denied(topic)``: the
    one line of an ACL that keeps the client from seeing it (raised at once), or None."""
    missing = [t for t in topics if not consumer.partitions_for_topic(t)]
    for topic in missing if denied is not None else ():
        why = denied(topic)
        if why is not None:
            raise RuntimeError(why)
    if missing and wait_s > 0:
        log.warning("topic %s does not exist yet: waiting up to %g s for it (`profstream process` and the Monitors "
                    "create the topics)", ", ".join(missing), wait_s)
        deadline = time.monotonic() + wait_s
        while missing and time.monotonic() < deadline:
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            missing = [t for t in missing if not consumer.partitions_for_topic(t)]
    if missing:
        waited = f" after waiting {wait_s:g} s" if wait_s > 0 else ""
        raise RuntimeError(f"topic {missing[0]} does not exist{waited}: start a processor (`profstream process` "
                           "creates the topics), check --topic-prefix, or wait longer with --wait-topics-s")


class Sink(Protocol):
    def handle(self, records: Sequence[Any]) -> None: ...


class SinkLoop:
    """Consume ``topics`` in consumer group ``group_id`` and feed ``sink``. A name that ends
    with a dot is a prefix: every topic that starts with it, found as they come (the
    request topics, ``<prefix>.requests.``)."""

    def __init__(self, conn: Connection | str, topics: Sequence[str], group_id: str, sink: Sink,
                 poll_ms: int = 100, from_beginning: bool = True, wait_topics_s: float = 0.0,
                 **consumer_options: Any) -> None:
        self.sink = sink
        self.poll_ms = poll_ms
        self._consumer = make_consumer(conn, group_id=group_id,
                                       auto_offset_reset="earliest" if from_beginning else "latest",
                                       **consumer_options)
        literal = [t for t in topics if not t.endswith(".")]
        prefixes = [t for t in topics if t.endswith(".")]
        from profstream.kafka.connection import Connection
        from profstream.kafka.diagnose import topic_denied

        conn = Connection.of(conn)
        try:  # know the partitions before joining (see processors/checkpoint.py)
            wait_for_topics(self._consumer, literal, wait_topics_s, denied=lambda t: topic_denied(
                conn, t, hint="`profstream acl show --role sink` lists a sink's ACLs"))
        except RuntimeError:
            self._consumer.close()
            raise
        if prefixes:
            import re

            self._consumer.subscribe(pattern="^(?:" + "|".join(
                [re.escape(t) for t in literal] + [re.escape(p) + ".+" for p in prefixes]) + ")$")
        else:
            self._consumer.subscribe(list(topics))
        self._handled: dict[TopicPartition, int] = {}
        self._said_at = -1e18  # when a commit that timed out was last logged
        self._committed: dict[TopicPartition, int] = {}
        self._postponed = False  # the latest commit was refused during a rebalance
        self._away = False  # and that was because Kafka did not answer
        self.records = 0
        self.last_poll = 0.0
        self.lag = 0  # messages not consumed yet; updated on the loop's thread (consumers are not thread-safe)
        self.lag_known = True  # False while Kafka does not answer: ``lag`` is then the last one known
        self._lag_at = 0.0

    @property
    def lag_checked_at(self) -> float:
        """``time.monotonic()`` when ``lag`` was last computed."""
        return self._lag_at

    def poll_once(self) -> int:
        tick = getattr(self.sink, "tick", None)
        if tick is not None:
            tick()
        try:
            polled = self._consumer.poll(timeout_ms=self.poll_ms)
        except UNREACHABLE as e:  # nothing was handed to the sink: the next poll reads it
            self.lag_known = False
            self._unreachable("a poll", e)
            time.sleep(self.poll_ms / 1000)
            return 0
        self.last_poll = now = time.monotonic()
        if now - self._lag_at >= 1.0:
            # positions may need a broker (validation after a leader change); not known in
            # time (Kafka away): the last lag stays, and so does its time. What the poll
            # returned goes to the sink all the same: the consumer's position is past it
            try:
                lag = consumer_lag(self._consumer, KAFKA_WAIT_MS)
            except UNREACHABLE as e:
                self._unreachable("the lag's positions", e)
                lag = None
            self.lag_known = lag is not None
            if lag is not None:
                self.lag, self._lag_at = lag, now
        n = 0
        for tp, records in polled.items():
            self.sink.handle(records)
            self._handled[tp] = records[-1].offset + 1
            n += len(records)
        self.records += n
        self._commit()
        return n

    def _commit(self) -> bool:
        """Commit what the sink has made durable; False when the group refused it (rebalance)."""
        durable = getattr(self.sink, "durable_offsets", None)
        if durable is None:
            offsets = dict(self._handled)
        else:
            offsets = {TopicPartition(t, p): o for (t, p), o in durable().items()}
        offsets = {tp: o for tp, o in offsets.items() if self._committed.get(tp) != o}
        if offsets:
            try:
                self._consumer.commit({tp: OffsetAndMetadata(o, "", -1) for tp, o in offsets.items()},
                                      timeout_ms=KAFKA_WAIT_MS)
            except POSTPONED as e:
                log.info("offset commit postponed to the next poll: %s", type(e).__name__)
                self._postponed, self._away = True, False
                return False
            except UNREACHABLE as e:  # every broker, or the group's coordinator, away: what is durable stays so
                self._unreachable("an offset commit", e)
                self._postponed, self._away = True, True
                return False
            self._committed.update(offsets)
        self._postponed = False
        return True

    def _final_commit(self, deadline: float) -> bool:
        """The commit after the sink closed: a group that is rebalancing (a heartbeat late on
        a loaded machine) refuses it, so rejoin it with every partition paused (nothing more
        is read: the sink is closed) and try again until ``deadline``."""
        while not self._commit():
            if self._away or time.monotonic() >= deadline:  # Kafka away: a stop does not wait for it
                return False
            self._consumer.pause(*self._consumer.assignment())
            self._consumer.poll(timeout_ms=200)
        return True

    def _unreachable(self, what: str, error: Exception) -> None:
        if time.monotonic() - self._said_at >= _SAY_EVERY_S:
            self._said_at = time.monotonic()
            log.warning("%s failed, Kafka does not answer (%s): retried at the next poll", what, type(error).__name__)

    def run(self, stop: threading.Event) -> None:
        """Poll until ``stop`` is set; then close the sink, commit and close the consumer."""
        try:
            while not stop.is_set():
                self.poll_once()
            deadline = time.monotonic() + FINAL_COMMIT_S
            while self._postponed and time.monotonic() < deadline:
                self.poll_once()
            close = getattr(self.sink, "close", None)
            if close is not None:
                close()
            if not self._final_commit(time.monotonic() + FINAL_COMMIT_S):
                log.warning("last offset commit failed (the group is rebalancing or Kafka is away): a restart "
                            "re-reads a few records")
        finally:
            self._consumer.close()


def run_sink(conn: Connection | str, topics: Sequence[str], group_id: str, sink: Sink, stop: threading.Event,
             ready: Callable[[], None] | None = None, wait_topics_s: float = 0.0, **consumer_options: Any) -> None:
    """Feed ``sink`` from ``topics`` until ``stop`` is set, calling ``ready()`` once the
    consumer is subscribed. A topic still missing after ``wait_topics_s`` raises
    RuntimeError (one line) after closing the sink."""
    try:
        loop = SinkLoop(conn, topics, group_id, sink, wait_topics_s=wait_topics_s, **consumer_options)
    except RuntimeError:
        close = getattr(sink, "close", None)
        if close is not None:
            close()
        raise
    if ready is not None:
        ready()
    loop.run(stop)
