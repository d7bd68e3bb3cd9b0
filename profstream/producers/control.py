"""``ControlReader``: the training process's thread that reads capture and stacks requests.

One thread per Monitor, with its own librdkafka consumer and no consumer-group state: it
assigns itself, in every request topic ``<prefix>.requests.<user>`` it may read (one per
requester: who asked is what the broker authenticated, docs/security.md), the one
partition that carries its run (the key's murmur2 partition, as every Kafka producer
computes it), from the offset of the moment the Monitor was made, and never commits; it
looks for new request topics every ``SCAN_S``. Requests on the control topic itself
(older clients) are never acted on. Requests for its run and rank are checked and
offered to the ``CapturePlan``; the statuses that come back (armed, refused, and the
started / finished ones the training thread queues) are sent by a producer made at the
first status. A stacks request is answered here, at once, on this thread: every Python
thread's stack (``stacks.py``), the training thread's included, in one finished status.
Every ``progress_interval_s`` this thread also sends a RankProgress to the raw topic (the
rank's key, so its EventBatches' partition): the step the training thread is in and since
when, read from the Monitor without a lock (``Monitor.where``), and the collective it sits
in when a reader of collectives runs (``Monitor.open_collective``), so that the processors
see a hang while no step ends (docs/figures.md, Hangs); only while Kafka answers.
Nothing here runs on the training thread; a broker outage means no
captures, counted in ``Monitor.stats()`` (``control_connected``, ``control_outages``) and
logged at INFO level (the Sender already warns once per outage).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Protocol

import confluent_kafka

from profstream.control.records import (
    ARMED,
    FINISHED,
    REFUSED,
    REQUEST,
    STACKS,
    check_request,
    control_key,
    control_partition,
    decode_control,
    encode_status,
    new_status,
    rank_in,
    refusal,
    request_from,
)
from profstream.kafka.clients import make_native_producer, native_consumer_config
from profstream.kafka.connection import Connection
from profstream.kafka.topics import CONTROL_GROUP_PREFIX, Topics
from profstream.producers.capture_plan import CapturePlan
from profstream.producers.stacks import thread_stacks
from profstream.schema.codec import DecodeError, encode

log = logging.getLogger("profstream.monitor")

IDLE_POLL_S = 0.5  # poll timeout while nothing is asked: the thread wakes twice a second
BUSY_POLL_S = 0.05  # while a capture is armed or running: its statuses leave within this
SEEN_REQUESTS = 1024  # request ids remembered, so that a request is handled once
SCAN_S = 5.0  # how often the reader looks for request topics it does not read yet (a new requester's)


class Owner(Protocol):
    """What the reader reads of the Monitor it serves."""

    options: dict[str, Any]
    connection: Connection
    run_id: str
    rank: int
    producer_id: str
    topics: Topics

    def where(self) -> tuple[int | None, int | None, int | None]: ...

    def open_collective(self) -> Any: ...


class ControlReader(threading.Thread):
    """Reads the capture requests of one rank and sends their statuses."""

    def __init__(self, owner: Owner, plan: CapturePlan, since_ms: int | None = None) -> None:
        super().__init__(name=f"profstream-control-{owner.run_id}-{owner.rank}", daemon=True)
        self.owner = owner
        self.plan = plan
        self.topic = owner.topics.control  # where statuses go
        self.requests_prefix = owner.topics.requests_prefix
        self.key = control_key(owner.run_id)
        self.since_ms = int(time.time() * 1000) if since_ms is None else since_ms
        opts = owner.options
        self._conn = owner.connection
        self._connect_timeout = opts["connect_timeout_s"]
        self._stopping = threading.Event()
        self._consumer: confluent_kafka.Consumer | None = None
        self._producer: Any = None
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._next_connect = 0.0
        self._backoff = 0.5
        self._down_since: float | None = None
        self._next_probe = 0.0
        self._next_scan = 0.0
        self._reading: set[str] = set()  # request topics assigned
        self._progress_every = opts.get("progress_interval_s") or 0.0  # 0: no RankProgress
        self._next_progress = 0.0
        self._progress_key = f"{owner.run_id}/{owner.rank}".encode()  # the Monitor's: its batches' partition
        self._warned_down = False
        # counters (read by Monitor.stats)
        self.requests = 0  # requests for this rank
        self.armed = 0
        self.refused = 0  # by this thread, on arrival (the plan counts the training thread's)
        self.undecodable = 0
        self.stack_dumps = 0  # stacks requests answered with this process's threads
        self.stacks_refused = 0  # expired or invalid ones
        self.statuses_sent = 0
        self.statuses_undelivered = 0
        self.outages = 0
        self.progress_sent = 0
        self.progress_undelivered = 0

    # -- thread -------------------------------------------------------------------------

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                if self._consumer is None and not self._connect():
                    self._stopping.wait(0.1)
                else:
                    self._read()
                    self._send_progress()
                self._send_statuses()
            except Exception:  # a bug here must not end the reader silently
                log.exception("profstream control reader: unexpected error; continuing")
                self._stopping.wait(1.0)
        self._close_clients()

    def _read(self) -> None:
        plan = self.plan
        busy = plan.current is not None or bool(plan.offers) or bool(plan.outbox)
        consumer = self._consumer
        msg = consumer.poll(BUSY_POLL_S if busy else IDLE_POLL_S)
        while msg is not None:
            error = msg.error()
            if error is None:
                self._handle(msg.topic(), msg.key(), msg.value())
                self._mark_up()
            elif error.code() != confluent_kafka.KafkaError._PARTITION_EOF:
                self._mark_down(confluent_kafka.KafkaException(error))
            msg = consumer.poll(0)
        if self._down_since is not None and time.monotonic() >= self._next_probe:
            self._next_probe = time.monotonic() + 2.0
            try:  # librdkafka reconnects by itself; this only tells when it has
                consumer.list_topics(self.topic, timeout=1.0)
                self._mark_up()
            except confluent_kafka.KafkaException:
                pass
        if self._down_since is None and time.monotonic() >= self._next_scan:
            try:
                self._scan(consumer, 1.0)
            except (confluent_kafka.KafkaException, LookupError):
                self._next_scan = time.monotonic() + SCAN_S

    def _scan(self, consumer: confluent_kafka.Consumer, timeout: float) -> None:
        """Assign the run's partition of every request topic not read yet, from since_ms."""
        self._next_scan = time.monotonic() + SCAN_S
        meta = consumer.list_topics(timeout=timeout)
        tps = []
        for name, topic in meta.topics.items():
            if name in self._reading or not name.startswith(self.requests_prefix) or name == self.requests_prefix:
                continue
            if topic.error is not None or not topic.partitions:
                continue
            partition = control_partition(self.owner.run_id, len(topic.partitions))
            tps.append(confluent_kafka.TopicPartition(name, partition, self.since_ms))
        if not tps:
            return
        # The ends first, then the times: a request written in between is found by its time, and
        # one written after both is past the end taken first. (The ends taken after the times
        # skipped a request that a new requester wrote right after creating its topic.)
        ends = {(tp.topic, tp.partition): consumer.get_watermark_offsets(tp, timeout=timeout)[1] for tp in tps}
        found = consumer.offsets_for_times(tps, timeout=timeout)
        for tp in found:
            if tp.error is not None:
                raise confluent_kafka.KafkaException(tp.error)
            if tp.offset < 0:  # nothing written since: from that end, as a number (a logical
                # OFFSET_END would be resolved later, past requests written meanwhile)
                tp.offset = ends[(tp.topic, tp.partition)]
        consumer.incremental_assign(found)
        self._reading.update(tp.topic for tp in found)

    def _handle(self, topic: str, key: bytes | None, value: bytes | None) -> None:
        if key != self.key:  # another run on the same partition
            return
        try:
            name, record = decode_control(value)
        except DecodeError as e:
            self.undecodable += 1
            if self.undecodable == 1:
                log.warning("profstream: skipping undecodable messages on %s for run %s (first: %s); "
                            "`profstream autocapture` sends them to the dead-letter topic", self.topic,
                            self.owner.run_id, e)
            return
        if name != REQUEST or record["run_id"] != self.owner.run_id:
            return
        record = request_from(topic, self.requests_prefix, record)
        if record is None:  # not from a request topic: no authenticated requester
            return
        rid = record["request_id"]
        if rid in self._seen:
            return
        self._seen[rid] = None
        while len(self._seen) > SEEN_REQUESTS:
            self._seen.popitem(last=False)
        if not rank_in(record["ranks"], self.owner.rank):
            return
        if record["kind"] == STACKS:
            self._answer_stacks(record)
            return
        self.requests += 1
        reason = check_request(record) or self.plan.offer(record)
        if reason is None:
            self.armed += 1
            self._send_status(new_status(record, ARMED, self.owner.rank, **self._who()))
        else:
            self.refused += 1
            self._send_status(new_status(record, REFUSED, self.owner.rank, reason=reason, **self._who()))

    def _answer_stacks(self, record: dict) -> None:
        """Every thread's stack, taken on this thread now, in one finished status."""
        now = time.time_ns()
        reason = check_request(record)
        if reason is None and now >= record["expires_at_ns"]:
            reason = refusal("expired", f"read {(now - record['expires_at_ns']) / 1e9:.1f} s after it expired: "
                                        "the stacks now would not answer it")
        if reason is not None:
            self.stacks_refused += 1
            self._send_status(new_status(record, REFUSED, self.owner.rank, reason=reason, **self._who()))
            return
        threads, omitted = thread_stacks()
        self.stack_dumps += 1
        self._send_status(new_status(record, FINISHED, self.owner.rank, threads=threads, threads_omitted=omitted, ts_ns=now,
                              **self._who()))

    def _send_statuses(self) -> None:
        outbox = self.plan.outbox
        while outbox:
            state, cur, reason, ts_ns = outbox.popleft()
            self._send_status(new_status(cur.request, state, self.owner.rank, reason=reason, ts_ns=ts_ns,
                                  **self.plan.status_fields(state, cur), **self._who()))
        if self._producer is not None:
            self._producer.poll()

    def _send_progress(self) -> None:
        """A RankProgress every interval, while Kafka answers (a rank cut off has no one to tell)."""
        now = time.monotonic()
        if not self._progress_every or now < self._next_progress or self._down_since is not None:
            return
        self._next_progress = now + self._progress_every
        step, started_ns, last_step = self.owner.where()
        open_collective = getattr(self.owner, "open_collective", None)  # an owner of its own may have none
        call = open_collective() if open_collective is not None else None
        opts = self.owner.options
        record = {"run_id": self.owner.run_id, "rank": self.owner.rank, "world_size": opts.get("world_size"),
                  "host": opts.get("host", ""), "step": step, "step_started_ns": started_ns,
                  "last_step": last_step, "ts_ns": time.time_ns(), "interval_ms": int(self._progress_every * 1000)}
        if call is None:  # v1, which processors older than v2 read too
            value = encode("RankProgress", record, version=1)
        else:
            value = encode("RankProgress", {**record, "collective": {
                "collective": call.collective, "group": call.group, "seq": call.seq, "since_ns": call.since_ns}})
        if self._send(value, self.owner.topics.raw, self._progress_key, self._on_progress):
            self.progress_sent += 1

    def _on_progress(self, error: Exception | None) -> None:
        if error is not None:
            self.progress_undelivered += 1
            self.progress_sent -= 1

    def _who(self) -> dict[str, Any]:
        return {"world_size": self.owner.options.get("world_size"), "host": self.owner.options.get("host", "")}

    def _send_status(self, status: dict) -> None:
        if self._send(encode_status(status), self.topic, self.key, self._on_delivery):
            self.statuses_sent += 1
        else:
            self.statuses_undelivered += 1

    def _send(self, value: bytes, topic: str, key: bytes, on_delivery) -> bool:
        """Hand one message to this thread's producer (made at the first); False: not taken."""
        if self._producer is None:
            try:
                self._producer = make_native_producer(self._conn, compression=None,
                                                      bootstrap_timeout_ms=int(self._connect_timeout * 1000))
            except Exception as e:
                self._mark_down(e)
                return False
        try:
            self._producer.send(topic, value, key, on_delivery)
            return True
        except (BufferError, confluent_kafka.KafkaException) as e:
            self._mark_down(e)
            return False

    def _on_delivery(self, error: Exception | None) -> None:
        if error is not None:
            self.statuses_undelivered += 1
            self.statuses_sent -= 1

    # -- connection ---------------------------------------------------------------------

    def _connect(self) -> bool:
        now = time.monotonic()
        if now < self._next_connect:
            return False
        consumer = None
        try:
            # never subscribes or commits: the group id is required by librdkafka, unused by the broker
            config = native_consumer_config(self._conn, f"{CONTROL_GROUP_PREFIX}{self.owner.producer_id}",
                                            **{"queued.max.messages.kbytes": 1024, "fetch.max.bytes": 1 << 20,
                                               "max.partition.fetch.bytes": 1 << 20})
            config["error_cb"] = self._on_client_error
            consumer = confluent_kafka.Consumer(config)
            self._reading = set()
            self._scan(consumer, self._connect_timeout)
        except Exception as e:  # broker down, topic not made yet: try again later
            if consumer is not None:
                consumer.close()
            self._next_connect = now + self._backoff
            self._backoff = min(self._backoff * 2, 30.0)
            if not isinstance(e, LookupError):
                self._mark_down(e)
            return False
        self._consumer = consumer
        self._backoff = 0.5
        self._mark_up()
        return True

    def _on_client_error(self, error: confluent_kafka.KafkaError) -> None:
        if error.code() == confluent_kafka.KafkaError._ALL_BROKERS_DOWN:
            self._mark_down(confluent_kafka.KafkaException(error))

    def _mark_down(self, error: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            self.outages += 1
        if not self._warned_down and not self._stopping.is_set():
            # info: the Sender's one warning per outage already says that Kafka is down
            self._warned_down = True
            log.info("profstream: capture requests for run %s cannot be read from %s (%s: %s); no captures "
                        "on request until Kafka answers again", self.owner.run_id, self._conn,
                        type(error).__name__, error)

    def _mark_up(self) -> None:
        if self._down_since is None:
            return
        if self._warned_down:
            log.info("profstream: capture requests for run %s are read again", self.owner.run_id)
        self._down_since = None
        self._warned_down = False

    def _close_clients(self) -> None:
        self._send_statuses()
        if self._producer is not None:
            try:
                if not self._producer.close(timeout=2.0):
                    log.warning("profstream: capture statuses of run %s rank %d not delivered at close",
                                self.owner.run_id, self.owner.rank)
            except Exception as e:
                log.warning("profstream: closing the capture status producer failed: %s", e)
            self._producer = None
        if self._consumer is not None:
            try:
                self._consumer.close()
            except Exception as e:
                log.warning("profstream: closing the capture request consumer failed: %s", e)
            self._consumer = None

    # -- other threads --------------------------------------------------------------------

    def stop(self, timeout: float) -> None:
        """Send what the plan still has to say and close both clients; waits at most
        ``timeout`` (3 s at most: a reader cut off from Kafka has nothing to deliver)."""
        self._stopping.set()
        self.join(min(timeout, 3.0))

    @property
    def connected(self) -> bool:
        return self._consumer is not None and self._down_since is None

    def stats(self) -> dict[str, Any]:
        plan = self.plan
        return {"control_connected": self.connected, "control_outages": self.outages,
                "capture_requests": self.requests, "captures_started": plan.started,
                "captures_finished": plan.finished, "captures_refused": plan.refused + self.refused,
                "stack_dumps": self.stack_dumps, "stacks_refused": self.stacks_refused,
                "control_undecodable": self.undecodable, "statuses_undelivered": self.statuses_undelivered,
                "progress_sent": self.progress_sent, "progress_undelivered": self.progress_undelivered}


def start_control(owner: Owner, since_ms: int | None = None) -> tuple[CapturePlan, ControlReader]:
    """The plan of ``owner``'s rank and its reader thread, started."""
    opts = owner.options
    plan = CapturePlan(owner.rank, opts["capture_max_steps"])
    reader = ControlReader(owner, plan, since_ms)
    reader.start()
    return plan, reader
