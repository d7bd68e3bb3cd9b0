"""``AutoCaptureService``: ``AutoCapture`` between Kafka and Alertmanager's webhook.

One group-less consumer reads, from positions found by time (no committed state: a
restart rebuilds everything): the run topic from ``run_ttl_s`` ago (which runs are alive,
their stragglers), the request topics and the control topic from 24 hours ago (its own
automatic requests, on its own request topic, which the rate limits count: no other
principal can write there, so none can use up its allowance; then new requests of every
requester to guard, and the statuses) and, unless it only serves the webhook,
the alerts topic from ``ALERTS_LOOKBACK_S`` ago (DataQueueStall comes from the processors
there; StepTimeRegression and RankStraggler are Prometheus rules and come through the
webhook). As the guard (``profstream autocapture``; not ``profstream webhook``, which may
run beside it) it refuses requests for unknown runs and sends undecodable control records
to the dead-letter topic with their reason. It looks for new request topics every
``SCAN_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kafka import TopicPartition

from profstream.control.autocapture import AutoCapture, Outcome
from profstream.control.policy import DAY_S, CapturePolicy
from profstream.control.records import (
    REQUEST,
    control_key,
    decode_control,
    encode_request,
    encode_status,
    request_from,
)
from profstream.kafka.clients import make_consumer, make_producer, seek_to_times
from profstream.kafka.connection import Connection
from profstream.kafka.topics import Topics
from profstream.processors.runtime import dead_letter
from profstream.schema.codec import DecodeError, decode

log = logging.getLogger("profstream.autocapture")

ALERTS_LOOKBACK_S = 60.0
SCAN_S = 10.0  # how often new request topics are looked for


class AutoCaptureService:
    """Runs until ``stop`` is set; ``serve_webhook(port)`` adds Alertmanager's receiver."""

    def __init__(self, conn: Connection | str, topics: Topics, policy: CapturePolicy, read_alerts: bool = True,
                 guard: bool = True, on_outcome: Callable[[Outcome], None] | None = None) -> None:
        from profstream.control.client import ensure_request_topic, request_topic

        self.conn = conn = Connection.of(conn)
        self.topics = topics
        self.request_topic = request_topic(conn, topics)  # its own: where its requests go, and are counted
        try:
            ensure_request_topic(conn, topics, self.request_topic)
        except LookupError as e:  # no control topic: run() says which topic is missing
            log.debug("%s", e)
        self.read_alerts = read_alerts
        self.guard = guard  # one guard per deployment: `profstream webhook` beside `autocapture` leaves it
        self.on_outcome = on_outcome
        self._producer = make_producer(conn)
        self.auto = AutoCapture(policy, self, requester=topics.requester_of(self.request_topic))
        self._server = None
        self._assigned: dict[str, int] = {}
        self._next_scan = 0.0
        self.dead_letters = 0
        self.requests_sent = 0

    # -- Outlet -----------------------------------------------------------------------------

    def send_request(self, request: dict) -> None:
        self._producer.send(self.request_topic, encode_request(request), control_key(request["run_id"]))
        self._producer.flush(timeout=10)
        self.requests_sent += 1

    def send_status(self, status: dict) -> None:
        self._producer.send(self.topics.control, encode_status(status), control_key(status["run_id"]))
        self._producer.flush(timeout=10)

    # -- inputs -----------------------------------------------------------------------------

    def serve_webhook(self, port: int, addr: str = "127.0.0.1", token: str = "", web=None) -> str:
        """Alertmanager's receiver on ``port`` (OSError if it cannot be bound), each POST
        with ``Bearer <token>``, TLS with ``web`` (a ``web_config.WebConfig``); its URL."""
        from profstream.control.webhook import serve_webhook

        self._server = serve_webhook(addr, port, self.webhook_alert, token, web)
        scheme = web.scheme if web is not None else "http"
        return f"{scheme}://{addr if addr not in ('0.0.0.0', '::') else 'localhost'}:{self._server.server_port}/alerts"

    def webhook_alert(self, name: str, run_id: str, rank: int | None, state: str) -> Outcome:
        return self._report(self.auto.alert(name, run_id, rank, state, "Alertmanager"))

    def _report(self, outcome: Outcome) -> Outcome:
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        return outcome

    def run(self, stop: threading.Event, ready: Callable[[], None] | None = None) -> None:
        consumer = make_consumer(self.conn, group_id=None)
        try:
            live_from = int(time.time() * 1000)  # records written since the start are live
            self._assign(consumer)
            if ready is not None:
                ready()
            while not stop.is_set():
                if time.monotonic() >= self._next_scan:
                    self._assign(consumer)
                for records in consumer.poll(timeout_ms=200).values():
                    for rec in records:
                        self._handle(rec, live_from)
                for outcome in self.auto.tick():
                    self._report(outcome)
        finally:
            consumer.close()
            if self._server is not None:
                self._server.shutdown()
            self._producer.close(timeout=5)

    def _assign(self, consumer) -> None:
        """Assign every partition of the input topics (and of request topics not read yet)
        at its start by time; the ones assigned before keep their positions."""
        from profstream.control.client import request_topics

        self._next_scan = time.monotonic() + SCAN_S
        now_ms = int(time.time() * 1000)
        day_ago = now_ms - int(DAY_S * 1000)
        starts = {} if self._assigned else {self.topics.run: now_ms - int(self.auto.policy.run_ttl_s * 1000),
                                           self.topics.control: day_ago}
        if self.read_alerts and not self._assigned:
            starts[self.topics.alerts] = now_ms - int(ALERTS_LOOKBACK_S * 1000)
        for topic in request_topics(consumer, self.topics):
            if topic not in self._assigned:
                starts[topic] = day_ago
        tps: dict[TopicPartition, int] = {}
        for topic, since_ms in starts.items():
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                raise RuntimeError(f"topic {topic} does not exist: start a processor (it creates the topics) or "
                                   "check --topic-prefix (or this client may not read it: docs/security.md)")
            for p in parts:
                tps[TopicPartition(topic, p)] = since_ms
        if not tps:
            return
        consumer.assign(sorted(set(consumer.assignment()) | set(tps)))
        seek_to_times(consumer, tps)
        self._assigned.update(starts)

    def _handle(self, rec, live_from: int) -> None:
        topic = rec.topic
        if topic == self.topics.run:
            try:
                self.auto.run_step(decode("RunStepMetrics", rec.value))
            except DecodeError:
                pass  # the processors' own output: its dead letters are theirs
        elif topic == self.topics.alerts:
            try:
                a = decode("Alert", rec.value)
            except DecodeError:
                return
            self._report(self.auto.alert(a["name"], a["run_id"], a["rank"], a["state"], "alerts topic"))
        elif topic == self.topics.control or self.topics.requester_of(topic):
            live = self.guard and rec.timestamp >= live_from
            try:
                name, record = decode_control(rec.value)
            except DecodeError as e:
                if live:
                    self._dead_letter(rec, e)
                return
            if name == REQUEST:
                record = request_from(topic, self.topics.requests_prefix, record)
                if record is None:  # an older client's, on the control topic: never acted on
                    return
            self.auto.control(name, record, live)

    def _dead_letter(self, rec, error: DecodeError) -> None:
        out = dead_letter(self.topics.dlq, rec, error)
        self._producer.send(out.topic, value=out.value, key=out.key, headers=out.headers)
        self._producer.flush(timeout=10)
        self.dead_letters += 1
        log.warning("autocapture: an undecodable record on %s/%d/%d went to %s (%s)", rec.topic, rec.partition,
                    rec.offset, self.topics.dlq, error)
