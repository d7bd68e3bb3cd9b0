"""Exactly-once consume-transform-produce: the one place that decides what commits when.

A ``Stage`` folds input records into state and hands back output records. This loop
runs it inside Kafka transactions: every commit interval, the outputs, a changelog
record per changed state key (to the stage's compacted state topic, in the partition of
the input partition it belongs to) and the consumed offsets commit together, or not at
all. The offset committed for an input partition is the stage's ``commit_offset``: the
first input offset it would need again to rebuild what it holds in memory only.

After a restart or a rebalance, a partition's owner reads the committed offset, then that
partition's changelog to its end (read_committed), then consumes from the offset. A
transaction that fails is aborted and the stage is rebuilt the same way, so nothing is
counted twice. Kafka makes a commit's offsets and its changelog records visible at
different moments (the coordinator writes the commit markers to each partition after
``commit_transaction`` returns; a new leader may not yet expose the last records): so a
transaction that writes state to a partition ends it with a commit marker (key
:data:`COMMIT_KEY`, a growing token), the committed offset names that token in its
metadata, and a restore reads the changelog until it has seen it. A state older than the
offsets would take steps re-read after the offset for new ones and emit them twice.
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import confluent_kafka
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from profstream.kafka.clients import make_native_consumer, make_transactional_producer
from profstream.kafka.connection import Connection
from profstream.kafka.deadline import CallTimeout, DeadlineCaller
from profstream.processors.group_watch import STATS_INTERVAL_MS, GroupWatch
from profstream.processors.input_watch import STUCK_AFTER_S as INPUT_STUCK_AFTER_S
from profstream.processors.input_watch import InputWatch

log = logging.getLogger("profstream.processor")

# Another client with our transactional id or group.instance.id took over.
_FENCED = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.FENCED_INSTANCE_ID}
CALL_TIMEOUT_S = 10.0  # a transactional call, a committed-offsets request, a changelog read without progress
# send_offsets_to_transaction goes to the group coordinator. When the broker that was it
# dies, librdkafka keeps it cached and waits for a change of some broker's connection state
# before it asks for the new one (rdkafka_coord.c): after a leader kill the call outlived
# 10 s in 2 of 3 runs, though the coordinator had moved after 4. It returns in milliseconds
# otherwise: its deadline is shorter, the producer replaced sooner.
OFFSETS_TIMEOUT_S = 4.0
MAX_OUTAGE_S = 300.0  # Kafka unreachable this long: give up, exit, let a supervisor restart us
FENCE_AFTER_FAULT_S = 600.0  # a fence this soon after a fault may be the fault's doing: recover once
_SAY_EVERY_S = 60.0  # the same trouble is logged at most once a minute
# The loop's own changelog record (see the module docstring): a stage's keys are run ids
# and "run/rank", never this.
COMMIT_KEY = b"\x00profstream-commit"


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


def commit_marker(state_topic: str, partition: int, token: int) -> Output:
    """The changelog record that ends a transaction's state writes to ``partition``; the
    committed offset names ``token`` in its metadata."""
    return Output(state_topic, COMMIT_KEY, str(token).encode(), partition)


def _token(metadata: str | None) -> int | None:
    """The commit token an offset's metadata names (None: an offset of a processor that
    wrote none)."""
    return int(metadata) if metadata and metadata.isdigit() else None


class Stage(Protocol):
    name: str  # in health metrics: steps, run
    input_topic: str
    state_topic: str

    def restore(self, partition: int, key: bytes, value: bytes | None, now: float) -> None: ...
    def fold(self, record: Record, now: float) -> list[Output]: ...
    def ready(self, now: float) -> list[Output]: ...
    def changed_state(self) -> list[Output]: ...
    # what a stage sends once per transaction rather than per ready() (StepStage: its
    # StepPartials, one per run step a transaction instead of one per poll)
    def transaction_outputs(self) -> list[Output]: ...
    def commit_offset(self, partition: int, position: int) -> int: ...
    def drop_partitions(self, partitions: Iterable[int]) -> None: ...


class FencedError(RuntimeError):
    """Another processor with the same instance id took over."""


class ProcessorUnavailable(RuntimeError):
    """Kafka did not come back within the loop's outage limit: exit and be restarted."""


class _ConsumerFailure(KafkaException):
    """A fatal error of the consumer (a fenced static member, say): it must be replaced."""


def _kafka_error(e: BaseException) -> KafkaError | None:
    if isinstance(e, KafkaException) and e.args and isinstance(e.args[0], KafkaError):
        return e.args[0]
    return None


def _describe(e: BaseException) -> str:
    err = _kafka_error(e)
    return err.str() if err is not None else str(e)


def _dispose(client) -> None:
    """Close a replaced client on a thread of its own: its close may wait on a broker."""

    def close(c=client) -> None:
        try:
            if isinstance(c, confluent_kafka.Consumer):
                c.close()
            else:
                c.purge()
                c.flush(0)
        except (KafkaException, RuntimeError):
            pass  # a fenced or closed client: nothing left to release but its memory

    threading.Thread(target=close, name="profstream-dispose", daemon=True).start()


class TransactionalLoop:
    """Runs one Stage exactly once (see the module docstring).

    Faults: a failed transaction is aborted and the stage rebuilt from the last commit. A
    client with a fatal error, or one whose call outlived ``call_timeout_s`` (librdkafka
    has calls that ignore their own timeout after a broker restart), is replaced. While
    Kafka does not answer the loop retries with a backoff and says so once a minute; after
    ``max_outage_s`` it raises ProcessorUnavailable so that a supervisor restarts the
    process. Nothing here waits without a deadline.
    """

    def __init__(self, conn: Connection | str, stage: Stage, group_id: str, instance_id: str,
                 commit_interval_ms: float = 100.0, poll_ms: int = 50, compression: str = "lz4",
                 on_commit: Callable[[int], None] | None = None, max_poll_records: int = 500,
                 on_abort: Callable[[], None] | None = None, call_timeout_s: float = CALL_TIMEOUT_S,
                 max_outage_s: float = MAX_OUTAGE_S, idle_commit_interval_ms: float | None = None) -> None:
        self.conn = conn = Connection.of(conn)
        self.stage = stage
        self.group_id = group_id
        self.commit_interval = commit_interval_ms / 1000.0
        # A transaction with no outputs that would move no committed offset waits this long
        # (see _commit_due); None: as any other.
        self.idle_commit_interval = max(idle_commit_interval_ms or 0.0, commit_interval_ms) / 1000.0
        self.poll_s = poll_ms / 1000.0
        self.on_commit = on_commit  # after each commit, with the number of outputs
        self.on_abort = on_abort  # when an open transaction's work is thrown away
        self.call_timeout = call_timeout_s
        self.max_outage = max_outage_s
        self.transactional_id = f"{group_id}-{instance_id}"
        self._compression = compression
        self._max_poll_records = max_poll_records
        self._call = DeadlineCaller(f"profstream-{self.transactional_id}")
        self._stop = threading.Event()
        self._producer_generation = 0
        self._producer_lost_brokers = False  # every broker went away since it was made
        try:
            self._producer = self._new_producer()
        except (KafkaException, CallTimeout) as e:
            raise RuntimeError(f"processor {self.transactional_id}: Kafka at {conn} did not start a "
                               f"transaction ({conn.redact(_describe(e))}): check --bootstrap and the Kafka client "
                               "properties") from None
        self._consumer = self._new_consumer()
        topic = self._consumer.list_topics(stage.input_topic, timeout=self.call_timeout).topics.get(stage.input_topic)
        if topic is None or topic.error is not None or not topic.partitions:
            self._consumer.close()
            from profstream.kafka.diagnose import topic_denied

            raise RuntimeError(topic_denied(conn, stage.input_topic, "READ", hint="`profstream acl show --role "
                                                                                "processor` lists a processor's ACLs")
                               or f"input topic {stage.input_topic} does not exist: create it first "
                               "(`profstream process` does)")
        self._subscribe()
        self._input_watch = InputWatch(conn, group_id, stage.input_topic)  # see processors/input_watch.py
        self._positions: dict[int, int] = {}  # input partition -> next offset to consume
        self._assigned: set[int] = set()
        self._txn_started: float | None = None
        self._txn_outputs = 0
        self._txn_state_parts: set[int] = set()  # changelog partitions the open transaction wrote to
        self._state_token: dict[int, int] = {}  # input partition -> commit token of its latest state
        self._offsets_written: dict[int, int] = {}  # input partition -> offset this loop last committed for it
        self._last_token = 0
        self._failure: BaseException | None = None  # raised in a rebalance callback, handled after consume()
        self._fault_at = -1e18  # monotonic time of the last fault
        # An outage outlives a recovery that needed no broker (a stuck consumer replaced, no
        # partitions to rebuild): it ends only when Kafka is heard from again.
        self._outage_started: float | None = None
        self._heard = False  # from Kafka since the last recovery: a message, a commit, an assignment
        self._fence_taken_at = -1e18  # of the last fence recovered from rather than obeyed
        self._said_at: dict[str, float] = {}
        self.transactions = 0
        self.aborts = 0
        self.recoveries = 0  # faults recovered from (clients replaced or state rebuilt)
        self.last_commit_s: float | None = None  # wall clock of the last commit
        self.last_poll_s = time.time()  # wall clock of the last poll of Kafka

    def assignment(self) -> list[int]:
        """The input partitions this loop owns now (as of its last poll)."""
        return sorted(self._assigned)

    def positions(self) -> dict[int, int]:
        """Next input offset to consume, per partition consumed from since it was assigned
        (a copy: read from other threads)."""
        return dict(self._positions)

    def describe(self) -> str:
        """One line on where this loop stands, for a state dump (``kill -USR1`` of a processor):
        its partitions and positions, the open transaction, its group and fetch states as
        librdkafka's last statistics tell them, and what the stage holds."""
        now = time.monotonic()
        txn = "none" if self._txn_started is None else f"open {now - self._txn_started:.1f} s, {self._txn_outputs} out"
        last = "never" if self.last_commit_s is None else f"{time.time() - self.last_commit_s:.1f} s ago"
        watch = self._group_watch
        fetch = "; ".join(f"p{p}: {f}" for p, f in sorted(watch.fetch.items())) or "none"
        held = getattr(self.stage, "describe", lambda: "")()
        return (f"{self.transactional_id}: assigned {self.assignment()} positions {self.positions()}; transaction "
                f"{txn}; last commit {last}; recoveries {self.recoveries}; group {watch.state}; fetch {fetch}"
                + (f"; holds {held}" if held else ""))

    # -- clients ----------------------------------------------------------------------

    def _client_error(self, err: KafkaError) -> None:
        """librdkafka's client-wide errors (every broker down, say), served on this thread."""
        self._fault_at = time.monotonic()
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self._say("brokers", f"no broker of {self.conn} answers ({err.str()}); librdkafka retries")

    def _producer_error(self, err: KafkaError, generation: int) -> None:
        self._client_error(err)
        if err.code() == KafkaError._ALL_BROKERS_DOWN and generation == self._producer_generation:
            # Its coordinators went with the brokers: its next send_offsets_to_transaction may
            # wait for them for good. Replaced before that commit instead of after a deadline.
            self._producer_lost_brokers = True

    def _make_producer(self) -> confluent_kafka.Producer:
        """A transactional producer, not initialised yet."""
        self._producer_generation += 1
        generation = self._producer_generation
        return make_transactional_producer(
            self.conn, self.transactional_id, self._compression,
            error_cb=lambda err: self._producer_error(err, generation))  # a replaced one's errors are moot

    def _init(self, producer: confluent_kafka.Producer) -> None:
        """init_transactions: fences every older producer of our transactional id and aborts
        what it left open."""
        self._call("init_transactions", self.call_timeout, producer.init_transactions, self.call_timeout)
        self._producer_lost_brokers = False

    def _new_producer(self) -> confluent_kafka.Producer:
        producer = self._make_producer()
        self._init(producer)
        return producer

    def _new_consumer(self) -> confluent_kafka.Consumer:
        """A consumer with our static membership, and a fresh GroupWatch fed by its statistics."""
        self._group_watch = watch = GroupWatch()
        # Heartbeats every 0.5 s: a member learns of a rebalance (a processor joining or
        # leaving) at its next heartbeat, and the whole group waits for the slowest.
        return make_native_consumer(self.conn, self.group_id, **{
            "group.instance.id": self.transactional_id, "heartbeat.interval.ms": 500, "error_cb": self._client_error,
            "statistics.interval.ms": STATS_INTERVAL_MS, "stats_cb": watch.update})

    def _subscribe(self) -> None:
        # A replaced consumer may still call back while it closes: only the current one counts.
        def assigned(consumer, parts: list[TopicPartition]) -> None:
            if consumer is self._consumer:
                self._on_assign(parts)

        def revoked(consumer, parts: list[TopicPartition]) -> None:
            if consumer is self._consumer:
                self._on_revoke(parts)

        self._consumer.subscribe([self.stage.input_topic], on_assign=assigned, on_revoke=revoked,
                                 on_lost=revoked)

    # -- rebalance (called by librdkafka inside consume(), on the loop's thread) ------

    def _on_revoke(self, revoked: list[TopicPartition]) -> None:
        if self._txn_started is not None and self._failure is None:
            try:
                self._commit()
            except (KafkaException, CallTimeout) as e:  # the next owner re-reads from the last commit
                self._failure = e
        parts = {tp.partition for tp in revoked}
        self.stage.drop_partitions(parts)
        for p in parts:
            self._positions.pop(p, None)
            self._state_token.pop(p, None)
            self._offsets_written.pop(p, None)
        self._assigned -= parts

    def _on_assign(self, assigned: list[TopicPartition]) -> None:
        self._heard = True
        self._input_watch.reset()
        parts = [tp.partition for tp in assigned]
        self._assigned.update(parts)
        if self._failure is None:
            try:
                start = self._load(parts)
                # from the offsets the state was restored for, not from those librdkafka would fetch
                self._consumer.assign([TopicPartition(tp.topic, tp.partition, start[tp.partition]) for tp in assigned])
            except (KafkaException, CallTimeout) as e:  # rebuilt with the rest after consume()
                self._failure = e

    def _load(self, partitions: list[int]) -> dict[int, int]:
        """Restore the stage's state of ``partitions`` as of their committed offsets; returns
        the offset to consume each from."""
        committed = self._committed(partitions)
        self._restore(partitions, {p: t for p, tp in committed.items() if (t := _token(tp.metadata)) is not None})
        self._offsets_written.update((p, tp.offset) for p, tp in committed.items() if tp.offset >= 0)
        return {p: tp.offset if tp.offset >= 0 else confluent_kafka.OFFSET_BEGINNING for p, tp in committed.items()}

    def _committed(self, partitions: list[int]) -> dict[int, TopicPartition]:
        """The group's committed offsets of ``partitions`` (stable ones: librdkafka waits out
        an open transaction's)."""
        topic = self.stage.input_topic
        # Asked with a client of its own, which looks the group coordinator up afresh: after
        # a broker restart the consumer's own committed() timed out again and again.
        reader = make_native_consumer(self.conn, self.group_id)
        try:
            committed = self._call("committed", self.call_timeout, reader.committed,
                                   [TopicPartition(topic, p) for p in partitions], self.call_timeout)
        finally:
            _dispose(reader)
        failed = [tp for tp in committed if tp.error is not None]
        if failed:  # e.g. the coordinator moving: not "nothing committed", which would re-read from the start
            raise KafkaException(failed[0].error)
        return {tp.partition: tp for tp in committed}

    def _restore(self, partitions: Iterable[int], tokens: dict[int, int]) -> None:
        """Read the changelog partitions to their end (read_committed) into the stage, and
        on until each has shown the commit marker of ``tokens`` (what its committed offset
        names). CallTimeout when a read makes no progress for ``call_timeout`` s."""
        topic = self.stage.state_topic
        reader = make_native_consumer(self.conn, f"{self.transactional_id}-restore",
                                      **{"enable.partition.eof": True})
        seen: dict[int, int] = {}  # partition -> latest commit token read
        try:
            left = set()
            for p in partitions:
                self._state_token.pop(p, None)
                low, high = reader.get_watermark_offsets(TopicPartition(topic, p), timeout=self.call_timeout)
                if high > low or p in tokens:
                    left.add(p)
            if not left:
                return
            reader.assign([TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING) for p in sorted(left)])
            now = time.monotonic()
            progress = now
            while left:
                msgs = reader.consume(num_messages=1000, timeout=0.5)
                if msgs:
                    progress = time.monotonic()
                elif time.monotonic() - progress > self.call_timeout:
                    raise CallTimeout(f"reading changelog {topic} made no progress for {self.call_timeout:g} s")
                for msg in msgs:
                    err, p = msg.error(), msg.partition()
                    if err is None:
                        if msg.key() == COMMIT_KEY:
                            seen[p] = max(seen.get(p, 0), int(msg.value()))
                        else:
                            self.stage.restore(p, msg.key(), msg.value(), now)
                    elif err.code() == KafkaError._PARTITION_EOF:
                        if seen.get(p, 0) >= tokens.get(p, 0):
                            left.discard(p)
                        # else its last commit is not readable here yet: read on to the next end
                    else:
                        raise KafkaException(err)
        finally:
            _dispose(reader)
        self._state_token.update(seen)
        self._last_token = max([self._last_token, *seen.values()])

    # -- loop -------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self._stop = stop
        try:
            while not stop.is_set():
                self.step()
            if self._txn_started is not None:
                try:
                    self._commit()
                except (KafkaException, CallTimeout) as e:  # close() aborts; the next owner re-reads
                    log.warning("profstream processor %s: last commit failed (%s)", self.transactional_id,
                                _describe(e))
        finally:
            self.close()

    def step(self) -> None:
        self._guarded(self._step)

    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except (KafkaException, CallTimeout) as e:
            self._recover(e)

    def _step(self) -> None:
        self._producer.poll(0)  # its error callbacks (every broker down: see _producer_error)
        msgs = self._poll()
        if self._failure is not None:  # from a rebalance callback: msgs may predate the rebuild
            failure, self._failure = self._failure, None
            raise failure
        stuck = self._group_watch.stuck_for()
        if stuck is not None:  # see processors/group_watch.py
            raise _ConsumerFailure(KafkaError(KafkaError._STATE, f"the consumer has been out of its group for "
                                              f"{stuck:.0f} s (librdkafka: {self._group_watch.state})"))
        now = time.monotonic()
        self.last_poll_s = time.time()
        consumed = 0
        # per message (hundreds a poll): no call beyond the stage's fold where there is nothing to do
        fold, assigned, positions = self.stage.fold, self._assigned, self._positions
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.fatal() or err.code() == KafkaError._FATAL:
                    raise _ConsumerFailure(err)
                if err.code() != KafkaError._PARTITION_EOF:
                    self._fault_at = now
                    self._say("consumer", f"consumer error ({err.str()}); librdkafka retries")
                continue
            partition = msg.partition()
            if partition not in assigned:
                continue  # revoked within this consume() call
            if self._txn_started is None:
                self._begin()
            offset = msg.offset()
            outputs = fold(Record(msg.topic(), partition, offset, msg.key(), msg.value()), now)
            if outputs:
                self._send(outputs)
            positions[partition] = offset + 1
            consumed += 1
        if consumed:
            self._heard = True
            self._input_watch.consumed(now)
        else:
            grown = self._input_watch.stuck(self.assignment(), self._positions, now)
            if grown is not None:
                raise _ConsumerFailure(KafkaError(KafkaError._STATE, (
                    f"the consumer received nothing for {INPUT_STUCK_AFTER_S:g} s or more while its partitions of "
                    f"{self.stage.input_topic} gained {grown} messages")))
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
        if not self._txn_outputs and open_s < self.idle_commit_interval and not self._offsets_move():
            return False  # nothing to show and no offset to move: only the stage's state changed
        if not consumed or open_s >= self.commit_interval:
            return True
        return self._txn_outputs > 0 and open_s >= self.commit_interval / 5 and consumed < self._max_poll_records

    def _offsets_move(self) -> bool:
        """Whether a commit now would move a committed input offset. When none moves and no
        output waits, a commit would write only the stage's changed state, which a restart
        rebuilds anyway by re-reading from those same offsets: deferring it loses nothing
        (the run stage, while a step's partials trickle in, holds its offsets at the step's
        first record; docs/exactly-once.md)."""
        offset, committed = self.stage.commit_offset, self._offsets_written
        return any(committed.get(p) != offset(p, pos) for p, pos in self._positions.items())

    def _begin(self) -> None:
        if self._txn_started is None:
            self._producer.begin_transaction()
            self._txn_started = time.monotonic()
            self._txn_outputs = 0
            self._txn_state_parts.clear()

    def _send(self, outputs: list[Output]) -> None:
        produce, state_topic = self._producer.produce, self.stage.state_topic
        for out in outputs:
            if out.topic == state_topic:
                self._txn_state_parts.add(out.partition)
            full_since = None
            while True:
                try:
                    if out.partition is None:
                        produce(out.topic, out.value, out.key, headers=out.headers)
                    else:
                        produce(out.topic, out.value, out.key, out.partition, headers=out.headers)
                    break
                except BufferError:  # librdkafka's queue is full: let it send, then go on
                    now = time.monotonic()
                    full_since = full_since or now
                    if now - full_since > self.call_timeout:
                        raise CallTimeout(f"librdkafka's send queue stayed full for {self.call_timeout:g} s") from None
                    self._producer.poll(0.05)
        self._txn_outputs += len(outputs)

    def _commit(self) -> None:
        if self._producer_lost_brokers:
            raise CallTimeout("the producer lost every broker; replaced before it commits")
        self._send(self.stage.transaction_outputs())
        self._send(self.stage.changed_state())
        tokens = dict(self._state_token)
        if self._txn_state_parts:
            token = self._last_token = max(time.time_ns(), self._last_token + 1)
            written = sorted(self._txn_state_parts)
            self._send([commit_marker(self.stage.state_topic, p, token) for p in written])
            tokens.update(dict.fromkeys(written, token))
        topic = self.stage.input_topic
        offsets = [TopicPartition(topic, p, self.stage.commit_offset(p, pos), metadata=str(tokens.get(p, "")))
                   for p, pos in self._positions.items()]
        producer, timeout = self._producer, self.call_timeout
        if offsets:
            self._send_offsets(offsets)
        self._call("commit_transaction", timeout, producer.commit_transaction, timeout)
        self._offsets_written.update((tp.partition, tp.offset) for tp in offsets)
        self._state_token = tokens
        self._txn_started = None
        self.transactions += 1
        self._heard = True
        self.last_commit_s = time.time()
        if self.on_commit is not None:
            self.on_commit(self._txn_outputs)

    def _send_offsets(self, offsets: list[TopicPartition]) -> None:
        """send_offsets_to_transaction, called again after a retriable error (a coordinator
        still loading, another operation on the transaction under way: a leader just moved)
        until ``call_timeout``; each call under :data:`OFFSETS_TIMEOUT_S`."""
        deadline = time.monotonic() + self.call_timeout
        while True:
            left = min(OFFSETS_TIMEOUT_S, max(deadline - time.monotonic(), 0.1))
            try:
                self._call("send_offsets_to_transaction", left, self._producer.send_offsets_to_transaction, offsets,
                           self._consumer.consumer_group_metadata(), left)
                return
            except KafkaException as e:
                err = _kafka_error(e)
                if err is None or not err.retriable() or time.monotonic() >= deadline - 0.2:
                    raise
                self._fault_at = time.monotonic()
                self._stop.wait(0.1)

    # -- faults -----------------------------------------------------------------------

    def _say(self, what: str, message: str) -> None:
        """Log ``message`` unless the same kind of trouble was logged in the last minute."""
        now = time.monotonic()
        if now - self._said_at.get(what, -1e18) >= _SAY_EVERY_S:
            self._said_at[what] = now
            log.warning("profstream processor %s: %s", self.transactional_id, message)

    def _check_fence(self, e: BaseException) -> None:
        """A fence in steady state means another processor has our instance id: obey it.
        Soon after a fault it may be the fault's doing (a transaction the coordinator timed
        out, a static member the restarted coordinator replaced): recover, once."""
        err = _kafka_error(e)
        if err is None or err.code() not in _FENCED:
            return
        now = time.monotonic()
        if now - self._fault_at > FENCE_AFTER_FAULT_S or now - self._fence_taken_at < FENCE_AFTER_FAULT_S:
            raise FencedError(f"processor {self.transactional_id} was fenced by a newer one with the same "
                              f"instance id: run each processor with its own --instance-id ({err.str()})")
        self._fence_taken_at = now

    def _recover(self, cause: BaseException) -> None:
        """Abort the open transaction (or replace the clients), then rebuild the stage from
        the changelog and the committed offsets; retry until Kafka answers or the outage
        limit is reached."""
        self._check_fence(cause)
        now = self._fault_at = time.monotonic()
        if self._outage_started is None or self._heard or self._group_watch.joined:
            self._outage_started = now
        started = self._outage_started
        answered = False  # a call in this recovery that only a broker can answer
        self.aborts += 1
        if self.on_abort is not None:
            self.on_abort()
        err = _kafka_error(cause)
        replace_consumer = isinstance(cause, _ConsumerFailure)
        replace_producer = isinstance(cause, CallTimeout) or (
            not replace_consumer and err is not None and (err.fatal() or err.code() in _FENCED))
        self._say("abort", f"transaction aborted ({_describe(cause)}); rebuilding state from the last commit")
        if now - started > self.max_outage:  # recoveries that reached no broker, one after another
            raise self._unavailable(now - started, cause)
        fresh = None  # the replacement producer, until its init_transactions succeeds
        backoff = 0.5
        while True:
            try:
                if self._txn_started is not None and not replace_producer:
                    try:
                        self._call("abort_transaction", self.call_timeout, self._producer.abort_transaction,
                                   self.call_timeout)
                        answered = True
                    except (KafkaException, CallTimeout):
                        replace_producer = True  # init_transactions of a new one aborts it
                self._txn_started = None
                if replace_producer:
                    if fresh is None:
                        _dispose(self._producer)
                        fresh = self._make_producer()
                    try:
                        self._init(fresh)
                    except (KafkaException, CallTimeout) as e:
                        err = _kafka_error(e)
                        # "retry call to resume": the same producer, or its init, still running in
                        # librdkafka, would fence the next one's
                        if isinstance(e, CallTimeout) or err is None or err.fatal() or not err.retriable():
                            _dispose(fresh)
                            fresh = None
                        raise
                    self._producer, fresh = fresh, None
                    replace_producer, answered = False, True
                if replace_consumer:
                    self._replace_consumer()
                    replace_consumer = False
                answered = self._rebuild() or answered
                break
            except (KafkaException, CallTimeout) as e:
                self._check_fence(e)
                replace_consumer = replace_consumer or isinstance(e, _ConsumerFailure)
                out_s = time.monotonic() - started
                if out_s > self.max_outage:
                    raise self._unavailable(out_s, e) from None
                self._say("outage", f"Kafka at {self.conn} does not answer ({_describe(e)}); retrying, "
                                    f"giving up after {self.max_outage:g} s")
                if self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, 5.0)
        self.recoveries += 1
        self._heard = self._group_watch.joined = False
        self._input_watch.reset()
        if answered:
            self._outage_started = None
            log.warning("profstream processor %s: resumed from the last commit %.1f s after the fault",
                        self.transactional_id, time.monotonic() - now)
        else:
            log.warning("profstream processor %s: recovered with no state to rebuild and no broker asked; until "
                        "Kafka is heard from, the outage counts from %.0f s ago (giving up after %g s)",
                        self.transactional_id, time.monotonic() - started, self.max_outage)
        self._said_at.clear()

    def _unavailable(self, out_s: float, e: BaseException) -> ProcessorUnavailable:
        return ProcessorUnavailable(
            f"processor {self.transactional_id}: Kafka at {self.conn} has not recovered for {out_s:.0f} s "
            f"({_describe(e)}); exiting so that a supervisor restarts it")

    def _replace_consumer(self) -> None:
        """A new consumer with the same static membership; the group hands it the same
        partitions, whose state on_assign restores."""
        parts = self.assignment()
        self.stage.drop_partitions(parts)
        self._positions.clear()
        self._offsets_written.clear()  # read again from Kafka's (_load)
        self._assigned.clear()
        _dispose(self._consumer)
        self._consumer = self._new_consumer()
        self._subscribe()

    def _rebuild(self) -> bool:
        """Rebuild the stage from the committed offsets and the changelog; whether that
        needed Kafka (no partitions: nothing to read)."""
        parts = self.assignment()
        self.stage.drop_partitions(parts)
        self._positions.clear()
        self._offsets_written.clear()  # read again from Kafka's (_load)
        if not parts:
            return False
        topic = self.stage.input_topic
        for p, offset in self._load(parts).items():
            # confluent-kafka's seek() waits for librdkafka to take it, without a deadline: in
            # the cluster-down fault test it never returned, and the run stage stood still for
            # good. One that outlives its deadline costs the consumer, not the loop.
            try:
                self._call("seek", self.call_timeout, self._consumer.seek, TopicPartition(topic, p, offset))
            except CallTimeout as e:
                raise _ConsumerFailure(KafkaError(KafkaError._TIMED_OUT, f"{e}: the consumer is replaced")) from None
        return True

    def close(self) -> None:
        """Abort what is open and close both clients, each within a deadline."""
        producer, timeout = self._producer, min(self.call_timeout, 5.0)
        try:
            if self._txn_started is not None:
                self._call("abort_transaction", timeout, producer.abort_transaction, timeout)
            self._call("flush", timeout, producer.flush, timeout)
            self._call("close", timeout, self._consumer.close)
        except (KafkaException, CallTimeout, RuntimeError) as e:
            log.warning("profstream processor %s: closing its Kafka clients failed (%s)",
                        self.transactional_id, _describe(e))
        finally:
            self._call.close()
            self._input_watch.close()
