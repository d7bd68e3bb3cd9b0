"""How far a processor is behind its input, as the broker sees it now.

The loop's own view of the end offsets goes stale exactly when it matters: a loop stuck
in a call, or cut off from the broker, keeps the last end offsets it fetched and reports
no lag. The probe asks the broker for the end offsets on its own client, at scrape time
(at most once a second), and subtracts where the loop is: the next offset it will consume
in each of its partitions, or the group's committed offset where it has consumed nothing
since it took the partition over.
"""

from __future__ import annotations

import threading
import time

import confluent_kafka
from confluent_kafka import TopicPartition

from profstream.kafka.clients import make_native_consumer
from profstream.kafka.connection import Connection

TIMEOUT_S = 1.0  # per broker request; a scrape must not wait for a broker that is gone


class LagProbe:
    def __init__(self, conn: Connection | str, group_id: str, topic: str, every_s: float = 1.0) -> None:
        self._conn, self._group_id, self._topic = conn, group_id, topic
        self._every_s = every_s
        self._lock = threading.Lock()
        self._client: confluent_kafka.Consumer | None = None
        self._at = -1e18
        self.lag: int | None = 0
        self.reachable = True  # the broker answered the last probe

    def measure(self, partitions: list[int], positions: dict[int, int]) -> int | None:
        """Messages in ``partitions`` beyond ``positions`` (a loop's next offsets); None
        (unknown, not 0) when the broker does not answer (``reachable`` then says so)."""
        with self._lock:
            if time.monotonic() - self._at < self._every_s:
                return self.lag
            self._at = time.monotonic()
            try:
                self.lag = self._measure(partitions, positions)
                self.reachable = True
            except (confluent_kafka.KafkaException, RuntimeError):
                self.lag = None
                self.reachable = False
                self._drop_client()  # the next probe looks the coordinator up afresh
            return self.lag

    def _measure(self, partitions: list[int], positions: dict[int, int]) -> int:
        if not partitions:
            return 0
        if self._client is None:
            self._client = make_native_consumer(self._conn, self._group_id)
        client, topic = self._client, self._topic
        unknown = [TopicPartition(topic, p) for p in partitions if p not in positions]
        start = dict(positions)
        if unknown:
            for tp in client.committed(unknown, timeout=TIMEOUT_S):
                start[tp.partition] = tp.offset  # < 0: nothing committed, counted from the low watermark
        total = 0
        for p in partitions:
            low, high = client.get_watermark_offsets(TopicPartition(topic, p), timeout=TIMEOUT_S, cached=False)
            at = start.get(p, -1)
            total += max(0, high - (at if at >= 0 else low))
        return total

    def _drop_client(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            threading.Thread(target=client.close, name="profstream-lag-close", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._drop_client()
