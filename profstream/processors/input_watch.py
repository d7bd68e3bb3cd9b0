"""Whether a processor's consumer still receives what its input partitions hold.

GroupWatch (group_watch.py) catches a consumer that fell out of its group. A consumer can
also stay in its group, keep its assignment and still deliver nothing: the CI run of
2026-11-28 had a run stage that polled for two minutes after the whole cluster came back,
in its group as far as GroupWatch could tell, while the step stage kept committing
StepMetrics to its input; no error was raised and nothing was consumed. Whatever
librdkafka state that was, the symptom is plain from the outside: the input partitions'
committed ends grow and nothing arrives.

So, while the loop has consumed nothing for :data:`PROBE_AFTER_S`, it asks the brokers for
the read_committed ends of its partitions (one ListOffsets request, at most every
:data:`PROBE_EVERY_S`), the first answer after the last message being the baseline. Once
nothing has been consumed for :data:`STUCK_AFTER_S` and an end has grown past its baseline,
the consumer is stuck: the loop replaces it (its static membership takes the same
partitions back, their state is rebuilt from the last commit). An end grows without data
only by aborted transactions, which a replacement costs nothing to sit through. A broker
that does not answer makes no verdict: that is an outage, which the loop handles itself.
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import OffsetSpec

from profstream.kafka.acls import admin_client
from profstream.kafka.connection import Connection

PROBE_AFTER_S = 10.0  # consumed nothing this long: start asking for the ends
PROBE_EVERY_S = 10.0
STUCK_AFTER_S = 30.0  # consumed nothing this long while an end grew: stuck
ASK_TIMEOUT_S = 3.0

log = logging.getLogger("profstream.processor")


class InputWatch:
    """Fed what the loop consumes (``consumed``); ``stuck(partitions)`` is called each loop
    turn and says how much the input grew unseen once that makes the consumer stuck."""

    def __init__(self, conn: Connection, topic: str) -> None:
        self._conn, self._topic = conn, topic
        self._admin = None
        self._last_msg = time.monotonic()
        self._asked_at = -1e18
        self._baseline: dict[int, int] = {}

    def consumed(self, now: float) -> None:
        self._last_msg = now
        self._baseline.clear()

    def reset(self) -> None:
        """A new consumer, or state rebuilt: it gets the full time again."""
        self.consumed(time.monotonic())

    def stuck(self, partitions: list[int], now: float) -> int | None:
        """Messages the input partitions gained since the baseline, once nothing has been
        consumed for STUCK_AFTER_S and that is more than 0; else None."""
        idle = now - self._last_msg
        if not partitions or idle < PROBE_AFTER_S or now - self._asked_at < PROBE_EVERY_S:
            return None
        self._asked_at = now
        ends = self._ends(partitions)
        if ends is None:
            return None
        base = self._baseline
        grown = sum(max(0, end - base[p]) for p, end in ends.items() if p in base)
        for p, end in ends.items():
            base.setdefault(p, end)
        return grown if idle >= STUCK_AFTER_S and grown > 0 else None

    def _ends(self, partitions: list[int]) -> dict[int, int] | None:
        """The read_committed end offsets of ``partitions``; None when the brokers do not answer."""
        try:
            if self._admin is None:
                self._admin = admin_client(self._conn)
            futures = self._admin.list_offsets(
                {TopicPartition(self._topic, p): OffsetSpec.latest() for p in partitions},
                isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=ASK_TIMEOUT_S)
            return {tp.partition: f.result(timeout=ASK_TIMEOUT_S + 1).offset for tp, f in futures.items()}
        except (KafkaException, TimeoutError, RuntimeError) as e:
            log.debug("input watch: the ends of %s are not known now (%s)", self._topic, e)
            return None
