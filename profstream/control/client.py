"""Sending capture requests and following their statuses (``profstream capture``).

``send_request`` puts a request on the requester's own request topic
(``<prefix>.requests.<user>``, created on first use where the broker lets it); the statuses
come back on the control topic. ``CaptureProgress`` folds the
statuses of one request into a state per rank and says when every rank it waits for has
finished or refused; ``follow`` reads them as they come; ``recent_requests`` lists the
requests of the last hours with what became of them. kafka-python: nothing here runs in a
training process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from profstream.control.records import (
    FINISHED,
    REFUSED,
    REQUEST,
    STATUS,
    control_key,
    control_partition,
    decode_control,
    encode_request,
    listed_ranks,
    request_from,
)
from profstream.kafka.clients import make_consumer, make_producer, position_by, seek_to_times
from profstream.kafka.connection import Connection
from profstream.kafka.topics import Topics
from profstream.schema.codec import DecodeError

TERMINAL = (FINISHED, REFUSED)
SETTLE_S = 3.0  # for "all ranks" of a run that does not say its world size: wait this long for more
RUN_SEEN_S = 900.0  # a run the processors showed this recently is live (autocapture's run_ttl_s)


def request_topic(conn: Connection | str, topics: Topics, requester: str | None = None) -> str:
    """The request topic of ``requester`` (default: the connection's principal)."""
    try:
        return topics.requests(requester or Connection.of(conn).principal())
    except ValueError as e:
        raise LookupError(str(e)) from None


def send_request(conn: Connection | str, topics: Topics, request: dict, timeout: float = 10.0,
                 requester: str | None = None) -> int:
    """Put ``request`` on the request topic of ``requester`` (default: the principal of
    ``conn``; key: its run); returns its offset. LookupError (one line) when that topic
    does not exist and cannot be made, or the broker denies writing it."""
    from kafka.errors import KafkaError, KafkaTimeoutError, TopicAuthorizationFailedError

    conn = Connection.of(conn)
    topic = request_topic(conn, topics, requester)
    ensure_request_topic(conn, topics, topic, timeout)
    producer = make_producer(conn)
    try:
        meta = producer.send(topic, encode_request(request), control_key(request["run_id"]))
        return meta.get(timeout=timeout).offset
    except TopicAuthorizationFailedError:
        raise LookupError(_denied_write(conn, topic)) from None
    except KafkaTimeoutError:  # no metadata for the topic: it does not exist
        raise LookupError(f"topic {topic} does not exist on {conn}: have an admin run `profstream acl apply --role "
                          f"capture --user {topic[len(topics.requests_prefix):]}` (it creates it)") from None
    except KafkaError as e:
        from profstream.kafka.diagnose import failure

        raise LookupError(f"the request was not written to {topic} ({failure(conn, e)})") from None
    finally:
        producer.close(timeout=5)


def _denied_write(conn: Connection, topic: str) -> str:
    from profstream.kafka.diagnose import authorization_error

    return authorization_error(conn.principal(), "WRITE", "TOPIC", topic,
                               hint="a requester writes its own request topic only (`profstream acl show --role "
                                    "capture`); check --kafka-config")


def ensure_request_topic(conn: Connection, topics: Topics, topic: str, timeout: float = 10.0) -> None:
    """Create the request topic ``topic`` when this client can see it does not exist and
    the broker lets it (a broker without ACLs; with them, `profstream acl apply` made it).
    LookupError when the control topic, where the answers come, does not exist."""
    from kafka.errors import KafkaError

    from profstream.kafka.topics import _admin, ensure_topic_exists

    with _admin(conn, timeout) as admin:
        if topics.control not in set(admin.list_topics()):
            raise LookupError(_no_topic(conn, topics))
        try:
            ensure_topic_exists(admin, topic)
        except KafkaError:
            pass  # denied: the send says so


def request_topics(consumer, topics: Topics) -> list[str]:
    """The request topics this consumer may see (kafka-python), sorted."""
    return sorted(t for t in consumer.topics() if topics.requester_of(t))


def _no_topic(conn: Connection | str, topics: Topics) -> str:
    from profstream.kafka.diagnose import topic_denied

    denied = topic_denied(Connection.of(conn), topics.control, "READ",
                          hint="`profstream acl show --role capture` lists a requester's ACLs")
    return denied or (f"topic {topics.control} does not exist on {conn}: start a processor or a Monitor of this "
                      "version (they create it), or check --topic-prefix")


@dataclass
class CaptureProgress:
    """What the statuses of one request say so far."""

    request: dict
    ranks: dict[int, dict] = field(default_factory=dict)  # rank -> its latest status
    whole: dict | None = None  # a status for the whole request (rank None): a service refused it
    world_size: int | None = None
    last_new_rank: float = 0.0
    times: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> state -> its status's ts_ns

    def add(self, status: dict, now: float | None = None) -> bool:
        """Fold one status in; False when it is not of this request."""
        if status["request_id"] != self.request["request_id"]:
            return False
        if status["rank"] is None:
            self.whole = status
            return True
        rank = status["rank"]
        if rank not in self.ranks:
            self.last_new_rank = time.monotonic() if now is None else now
        self.times.setdefault(rank, {}).setdefault(status["state"], status["ts_ns"])
        previous = self.ranks.get(rank)
        if previous is None or previous["state"] not in TERMINAL:  # a terminal state stays
            self.ranks[rank] = status
        if status["world_size"] is not None:
            self.world_size = status["world_size"]
        return True

    def expected(self) -> list[int] | None:
        """The ranks to wait for: those asked, else every rank of the world size, else
        None (unknown: the ranks that answer)."""
        asked = listed_ranks(self.request["ranks"])
        if asked is not None:
            return asked
        if self.world_size is not None:
            return list(range(self.world_size))
        return None

    def done(self, now: float | None = None) -> bool:
        if self.whole is not None and self.whole["state"] == REFUSED:
            return True
        expected = self.expected()
        if expected is None:
            now = time.monotonic() if now is None else now
            return bool(self.ranks) and all(s["state"] in TERMINAL for s in self.ranks.values()) and (
                now - self.last_new_rank >= SETTLE_S)
        return all(r in self.ranks and self.ranks[r]["state"] in TERMINAL for r in expected)

    def missing(self) -> list[int]:
        """Ranks waited for that have not said finished or refused."""
        expected = self.expected() or sorted(self.ranks)
        return [r for r in expected if r not in self.ranks or self.ranks[r]["state"] not in TERMINAL]

    def finished(self) -> dict[int, dict]:
        return {r: s for r, s in sorted(self.ranks.items()) if s["state"] == FINISHED}


def _control_consumer(conn: Connection | str, topics: Topics, run_id: str | None, since_ms: int,
                      with_requests: bool = False):
    """A group-less consumer of the control partition of ``run_id`` (all partitions when
    None) and, ``with_requests``, of every request topic it may read, from the first record
    at or after ``since_ms``."""
    from kafka import TopicPartition

    consumer = make_consumer(conn, group_id=None)
    parts = sorted(consumer.partitions_for_topic(topics.control) or ())
    if not parts:
        consumer.close()
        raise LookupError(_no_topic(conn, topics))
    tps = []
    for topic in [topics.control] + (request_topics(consumer, topics) if with_requests else []):
        parts = sorted(consumer.partitions_for_topic(topic) or ())
        if parts and run_id is not None:
            parts = [control_partition(run_id, len(parts))]
        tps += [TopicPartition(topic, p) for p in parts]
    consumer.assign(tps)
    return consumer, seek_to_times(consumer, dict.fromkeys(tps, since_ms))


def _polls(consumer, run_id: str | None, topics: Topics, poll_ms: int = 200) -> Iterator[list[tuple[str, dict]]]:
    """The decodable (name, record) pairs of ``run_id`` of each poll (an empty list: none
    came); a request of a request topic carries its ``requester``."""
    key = control_key(run_id) if run_id is not None else None
    while True:
        got = []
        for records in consumer.poll(timeout_ms=poll_ms).values():
            for rec in records:
                if key is not None and rec.key != key:
                    continue
                try:
                    name, record = decode_control(rec.value)
                except DecodeError:
                    continue
                if name == REQUEST:
                    record = request_from(rec.topic, topics.requests_prefix, record) or record
                got.append((name, record))
        yield got


def follow(conn: Connection | str, topics: Topics, request: dict, timeout: float,
           on_change: Callable[[CaptureProgress], None] | None = None,
           stop: Callable[[], bool] | None = None, unanswered_s: float | None = None) -> CaptureProgress:
    """Read the statuses of ``request`` until it is done, ``timeout`` passes or ``stop()``;
    with ``unanswered_s``, also once that long has passed without any status of it."""
    progress = CaptureProgress(request)
    consumer, _ends = _control_consumer(conn, topics, request["run_id"], request["requested_ns"] // 10**6 - 1000)
    started = time.monotonic()
    deadline = started + timeout
    try:
        for got in _polls(consumer, request["run_id"], topics):
            changed = [record for name, record in got if name == STATUS and progress.add(record)]
            if on_change is not None and (changed or not got):  # also refreshed when idle (the time shown)
                on_change(progress)
            now = time.monotonic()
            unanswered = unanswered_s is not None and not progress.ranks and progress.whole is None and (
                now - started >= unanswered_s)
            if progress.done() or now >= deadline or unanswered or (stop is not None and stop()):
                return progress
    finally:
        consumer.close()
    return progress


def runs_seen(conn: Connection | str, topics: Topics, since_s: float, run_id: str | None = None,
              timeout: float = 10.0) -> dict[str, float]:
    """The runs the processors showed on the run topic in the last ``since_s`` seconds (of
    ``run_id`` alone: only its partition is read), each with the time of its newest
    cross-rank step there (Kafka's timestamp, s). Empty where the topic does not exist."""
    from kafka import TopicPartition

    consumer = make_consumer(conn, group_id=None)
    seen: dict[str, float] = {}
    try:
        parts = sorted(consumer.partitions_for_topic(topics.run) or ())
        if not parts:
            return seen
        if run_id is not None:
            parts = [control_partition(run_id, len(parts))]  # keyed by run, as the control topic
        tps = [TopicPartition(topics.run, p) for p in parts]
        consumer.assign(tps)
        ends = seek_to_times(consumer, dict.fromkeys(tps, int((time.time() - since_s) * 1000)))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(
                (position_by(consumer, tp, deadline) or 0) >= end for tp, end in ends.items()):
            for records in consumer.poll(timeout_ms=200).values():
                for rec in records:
                    run = rec.key.decode(errors="replace") if rec.key else ""
                    if run_id is None or run == run_id:
                        seen[run] = max(seen.get(run, 0.0), rec.timestamp / 1000)
    finally:
        consumer.close()
    return seen


@dataclass
class RequestSummary:
    request: dict
    progress: CaptureProgress


def recent_requests(conn: Connection | str, topics: Topics, since_s: float, run_id: str | None = None) -> list[RequestSummary]:
    """The requests of the last ``since_s`` seconds (of ``run_id``, or of every run), oldest
    first, each with its statuses so far: from the request topics this client may read, and
    those of older clients on the control topic (their requester not authenticated)."""
    by_id: dict[str, RequestSummary] = {}
    orphans: list[dict] = []
    for name, record in _records_since(conn, topics, since_s, run_id, with_requests=True):
        if name == REQUEST:
            by_id.setdefault(record["request_id"], RequestSummary(record, CaptureProgress(record)))
        else:
            orphans.append(record)
    for status in orphans:
        summary = by_id.get(status["request_id"])
        if summary is not None:
            summary.progress.add(status, now=0.0)
    return sorted(by_id.values(), key=lambda s: s.request["requested_ns"])


def _records_since(conn: Connection | str, topics: Topics, since_s: float, run_id: str | None,
                   with_requests: bool = False, timeout: float = 30.0) -> Iterator[tuple[str, dict]]:
    """The decodable control records (of ``run_id``, or of every run) of the last
    ``since_s`` seconds up to the ends found at the start, read within ``timeout``."""
    consumer, ends = _control_consumer(conn, topics, run_id, int((time.time() - since_s) * 1000),
                                       with_requests=with_requests)
    try:
        deadline = time.monotonic() + timeout
        for got in _polls(consumer, run_id, topics):
            yield from got
            if time.monotonic() >= deadline or all(
                    (position_by(consumer, tp, deadline) or 0) >= end for tp, end in ends.items()):
                break  # a position Kafka could not confirm in time counts as still behind
    finally:
        consumer.close()


def recent_statuses(conn: Connection | str, topics: Topics, since_s: float, run_id: str) -> list[dict]:
    """The CaptureStatus records of ``run_id`` on the control topic of the last ``since_s``
    seconds, oldest first (every requester's: statuses are readable by all who ask)."""
    return [record for name, record in _records_since(conn, topics, since_s, run_id) if name == STATUS]
