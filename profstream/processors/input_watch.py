"""Whether a processor's consumer still receives what its input partitions hold.

GroupWatch (group_watch.py) catches a consumer that fell out of its group. A consumer can
also stay in its group, keep its assignment and still deliver nothing: the CI run of
2026-11-28 had a run stage that polled for two minutes after the whole cluster came back,
in its group as far as GroupWatch could tell, while the step stage kept committing
StepMetrics to its input; no error was raised and nothing was consumed. Whatever
librdkafka state that was, the symptom is plain from the outside: the input partitions'
committed ends grow and nothing arrives.

So, while the loop has consumed nothing for :data:`PROBE_AFTER_S`, it asks the brokers how
far its partitions' ends are past its positions (the processor's lag probe, lag.py, on a
client of its own, at most every :data:`PROBE_EVERY_S`), the first answer after the last
message being the baseline. Nothing consumed means positions that stand still, so a lag
that grows is an input that grows. Once nothing has been consumed for
:data:`STUCK_AFTER_S` and the lag has grown past its baseline, the consumer is stuck: the
loop replaces it (its static membership takes the same partitions back, their state is
rebuilt from the last commit). An end grows without data only by aborted transactions,
which a replacement costs nothing to sit through. A broker that does not answer makes no
verdict: that is an outage, which the loop handles itself.
"""

from __future__ import annotations

import time

from profstream.kafka.connection import Connection
from profstream.processors.lag import LagProbe

PROBE_AFTER_S = 10.0  # consumed nothing this long: start asking for the ends
PROBE_EVERY_S = 10.0
STUCK_AFTER_S = 30.0  # consumed nothing this long while the input grew: stuck


class InputWatch:
    """Fed what the loop consumes (``consumed``); ``stuck(partitions, positions)`` is called
    each loop turn and says how much the input grew unseen once that makes the consumer stuck."""

    def __init__(self, conn: Connection, group_id: str, topic: str) -> None:
        self._probe = LagProbe(conn, group_id, topic, every_s=0.0)  # asked at this watch's own pace
        self._last_msg = time.monotonic()
        self._asked_at = -1e18
        self._baseline: int | None = None

    def consumed(self, now: float) -> None:
        self._last_msg = now
        self._baseline = None

    def reset(self) -> None:
        """A new consumer, or state rebuilt: it gets the full time again."""
        self.consumed(time.monotonic())

    def stuck(self, partitions: list[int], positions: dict[int, int], now: float) -> int | None:
        """Messages the input partitions gained since the baseline, once nothing has been
        consumed for STUCK_AFTER_S and that is more than 0; else None."""
        idle = now - self._last_msg
        if not partitions or idle < PROBE_AFTER_S or now - self._asked_at < PROBE_EVERY_S:
            return None
        self._asked_at = now
        lag = self._probe.measure(partitions, positions)
        if lag is None:
            return None
        if self._baseline is None:
            self._baseline = lag
        grown = lag - self._baseline
        return grown if idle >= STUCK_AFTER_S and grown > 0 else None

    def close(self) -> None:
        self._probe.close()
