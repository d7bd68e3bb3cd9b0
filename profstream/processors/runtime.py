"""The processor service: raw topic in, StepMetrics and alerts out.

Knows Kafka and nothing of the figures: it decodes batches (undecodable ones go to the
dead-letter topic with their reason and origin), hands them to one ``RankAssembler`` per
(run, rank), turns closed steps into records through ``RankFigures`` and sends them.

Delivery: outputs of a poll are flushed before the consumed offsets are committed
(at-least-once). Open steps live in memory only, so a restart recomputes nothing that
was committed but loses the events of steps open at the crash; issue 3's transactional
checkpoint replaces this.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from profstream.kafka.clients import make_consumer, make_producer
from profstream.kafka.topics import Topics
from profstream.processors.assembler import RankAssembler
from profstream.processors.figures import FigureOptions, RankFigures
from profstream.schema.batch import decode_batch
from profstream.schema.codec import DecodeError, encode

log = logging.getLogger("profstream.processor")


@dataclass
class ProcessorHealth:
    batches: int = 0
    events: Counter = field(default_factory=Counter)  # by family: ops, memory, queues, steps
    decode_errors: Counter = field(default_factory=Counter)  # by reason
    steps_closed: int = 0
    alerts: int = 0


@dataclass
class _Rank:
    assembler: RankAssembler
    figures: RankFigures


class Processor:
    """One member of the processor consumer group."""

    def __init__(self, bootstrap: str, topics: Topics, group_id: str = "profstream-processor",
                 grace_s: float = 2.0, idle_timeout_s: float = 60.0,
                 figure_options: FigureOptions | None = None, compression: str = "lz4") -> None:
        self.topics = topics
        self.grace_s = grace_s
        self.idle_timeout_s = idle_timeout_s
        self.figure_options = figure_options or FigureOptions()
        self.health = ProcessorHealth()
        self.ranks: dict[tuple[str, int], _Rank] = {}
        self._consumer = make_consumer(bootstrap, topics.raw, group_id=group_id)
        self._producer = make_producer(bootstrap, compression=compression)
        self._stop = threading.Event()

    # -- loop -------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None, poll_ms: int = 100) -> None:
        """Process until ``stop`` (or ``self.stop()``) is set."""
        stop = stop or self._stop
        try:
            while not stop.is_set() and not self._stop.is_set():
                self.poll_once(poll_ms)
        finally:
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def poll_once(self, poll_ms: int = 100) -> int:
        """One poll: fold records in, close what is ready, send, commit. Returns steps closed."""
        polled = self._consumer.poll(timeout_ms=poll_ms)
        now = time.monotonic()
        for records in polled.values():
            for rec in records:
                self._fold(rec, now)
        closed = self._close_ready(now)
        if polled or closed:
            self._producer.flush()
            if polled:
                self._consumer.commit()
        return closed

    def _fold(self, rec, now: float) -> None:
        try:
            batch = decode_batch(rec.value)
        except DecodeError as e:
            self._dead_letter(rec, e)
            return
        key = (batch.run_id, batch.rank)
        rank = self.ranks.get(key)
        if rank is None:
            rank = self.ranks[key] = _Rank(RankAssembler(batch.run_id, batch.rank, self.grace_s),
                                           RankFigures(self.figure_options))
        if rank.assembler.add(batch, now):
            self.health.batches += 1
            for section in ("ops", "memory", "queues", "steps"):
                self.health.events[section] += batch.n(section)

    def _dead_letter(self, rec, error: DecodeError) -> None:
        self.health.decode_errors[error.reason] += 1
        headers = [("reason", error.reason.encode()), ("detail", str(error)[:500].encode()),
                   ("origin", f"{rec.topic}/{rec.partition}/{rec.offset}".encode())]
        self._producer.send(self.topics.dlq, value=rec.value if isinstance(rec.value, bytes) else b"",
                            key=rec.key, headers=headers)

    def _close_ready(self, now: float) -> int:
        closed = 0
        for key, rank in list(self.ranks.items()):
            asm = rank.assembler
            ready = asm.close_ready(now)
            if not ready and now - asm.last_seen >= self.idle_timeout_s:
                ready = [(ev, "idle") for ev in asm.close_all()]
                del self.ranks[key]
            for ev, reason in ready:
                self._emit(rank, ev, reason)
                closed += 1
        return closed

    def _emit(self, rank: _Rank, ev, reason: str) -> None:
        record, transition = rank.figures.step_metrics(ev, reason, rank.assembler.late_events)
        self._producer.send(self.topics.steps, value=encode("StepMetrics", record),
                            key=f"{ev.run_id}/{ev.rank}".encode())
        self.health.steps_closed += 1
        if transition is not None:
            self.health.alerts += 1
            alert = {
                "name": "DataQueueStall", "state": transition, "run_id": ev.run_id, "rank": ev.rank,
                "step": ev.step, "ts_ns": time.time_ns(),
                "summary": (f"rank {ev.rank} of run {ev.run_id}: data queue starved for "
                            f"{self.figure_options.stall_steps} consecutive steps" if transition == "firing"
                            else f"rank {ev.rank} of run {ev.run_id}: data queue healthy again"),
                "evidence": {"data_wait_ns": float(record["data_wait_ns"]),
                             "step_time_ns": float(record["step_time_ns"])},
            }
            self._producer.send(self.topics.alerts, value=encode("Alert", alert), key=ev.run_id.encode())

    def close(self) -> None:
        try:
            self._producer.flush(timeout=10)
        finally:
            self._producer.close(timeout=5)
            self._consumer.close()
