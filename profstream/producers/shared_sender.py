"""Many Monitors of one process sending through one Kafka producer and one thread.

A real training process has one Monitor: its own sender thread and librdkafka producer
(``sender.py``, ``native_sender.py``). A simulator that runs thousands of ranks in one
process cannot give each of them that (docs/benchmarks.md, "16,384 ranks simulated": 12
threads and 4 broker connections a Monitor). ``SenderPool`` is what such a process shares:

    pool = SenderPool()
    monitors = [Monitor(rank=r, native=False, control=False, sender_factory=pool.sender, ...)
                for r in ranks]
    ...  # record through the Monitors as usual; close them, then
    pool.close()

Each Monitor keeps its own buffer and its own ``Sender`` (a ``SharedSender``): it builds and
encodes its own batches, with its own producer id and seq, exactly as it would alone (the
Python Sender's code, bytes equal to the native one's). What is shared is the thread that
runs the Senders' cycles, one after another, and the producer they hand their messages to;
a Sender's message goes out in the cycle after its step ended (or its batch filled, or a
flush asked), and in any case within ``IDLE_SEND_S``. For simulators and benchmarks only:
a training job's Monitor never shares its thread with another rank's.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from profstream.kafka.clients import make_native_producer
from profstream.kafka.connection import Connection
from profstream.kafka.topics import Topics, ensure_topics
from profstream.producers.sender import IDLE_SEND_S, MONITOR_TOPICS, Sender

log = logging.getLogger("profstream.monitor")


class SenderPool(threading.Thread):
    """One producer and one thread for the ``SharedSender`` of every Monitor made with
    ``sender_factory=pool.sender``. The first such Monitor's connection, topics and options
    (compression, connect_timeout_s, batch_interval_ms) are the pool's; it connects (and
    creates the topics) once, on its thread."""

    def __init__(self) -> None:
        super().__init__(name="profstream-sender-pool", daemon=True)
        self.connection: Connection | None = None
        self.topics: Topics | None = None
        self._compression: str | None = None
        self._connect_timeout = 5.0
        self._interval = 0.05
        self.producer: Any = None
        self._senders: list[SharedSender] = []
        self._added: list[SharedSender] = []  # made since the last round (any thread)
        self._gone: set[int] = set()  # id() of those stopped since the last round
        self._list_lock = threading.Lock()
        self.cycle_lock = threading.Lock()  # held while one Sender cycles (its flush reads it between)
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._round = threading.Condition()
        self.rounds = 0
        self._next_connect = 0.0
        self._backoff = 0.5
        self._warned = False

    def sender(self, monitor: Any) -> SharedSender:
        """The ``sender_factory`` of a Monitor that shares this pool."""
        if self.connection is None:
            opts = monitor.options
            self.connection, self.topics = monitor.connection, monitor.topics
            self._compression, self._connect_timeout = opts["compression"], opts["connect_timeout_s"]
            self._interval = opts["batch_interval_ms"] / 1000.0
        return SharedSender(monitor, self)

    def add(self, sender: SharedSender) -> None:
        with self._list_lock:
            self._added.append(sender)
        if not self.is_alive() and not self._stopping.is_set():
            try:
                self.start()
            except RuntimeError:  # another Monitor's start() started it meanwhile
                pass

    def remove(self, sender: SharedSender) -> None:
        with self._list_lock:
            self._gone.add(id(sender))

    def wake(self) -> None:
        self._wake.set()

    def wait_round(self, timeout: float) -> None:
        """Until the thread has gone once more over its Senders (or ``timeout`` s)."""
        with self._round:
            seen = self.rounds
            self._round.wait_for(lambda: self.rounds > seen or self._stopping.is_set(), timeout)

    # -- thread -----------------------------------------------------------------------

    def run(self) -> None:
        idle_due = 0.0
        while not self._stopping.is_set():
            started = time.monotonic()
            if self.producer is None:
                self._connect(started)
            else:
                self.producer.poll()  # every Sender's delivery reports, on this thread
            with self._list_lock:
                if self._added or self._gone:
                    self._senders = [s for s in self._senders + self._added if id(s) not in self._gone]
                    self._added, self._gone = [], set()
                senders = self._senders
            every = started >= idle_due  # what is buffered leaves at least every IDLE_SEND_S
            if every:
                idle_due = started + IDLE_SEND_S
            for s in senders:
                if s.due(every):
                    with self.cycle_lock:
                        try:
                            s._cycle()  # noqa: SLF001 - the Sender's own cycle, on the thread that shares it
                            if s.stop_wanted and not s._buffered():  # its last batch (the end mark) is sent
                                s.retire()
                        except Exception:  # a bug here must not end every rank's profiling silently
                            log.exception("profstream sender pool: unexpected error; continuing")
            with self._round:
                self.rounds += 1
                self._round.notify_all()
            rest = self._interval - (time.monotonic() - started)
            if rest > 0:
                self._wake.wait(rest)
            self._wake.clear()

    def _retiring(self) -> bool:
        """Whether a closed Monitor's Sender still has its last batches to send."""
        with self._list_lock:
            return any(s.stop_wanted and not s.retired for s in self._senders + self._added)

    def _connect(self, now: float) -> None:
        if now < self._next_connect or self.connection is None:
            return
        try:
            producer = make_native_producer(self.connection, compression=self._compression,
                                            bootstrap_timeout_ms=int(self._connect_timeout * 1000))
            ensure_topics(self.connection, self.topics, timeout=self._connect_timeout, needed=MONITOR_TOPICS,
                          operation="WRITE")
        except Exception as e:  # the Senders keep buffering (bounded, then counted as dropped)
            self._next_connect = now + self._backoff
            self._backoff = min(self._backoff * 2, 30.0)
            if not self._warned:
                self._warned = True
                log.warning("profstream: Kafka at %s is not reachable (%s); the shared Monitors buffer and retry",
                            self.connection, type(e).__name__)
            return
        self.producer = producer

    def close(self, timeout: float = 10.0) -> bool:
        """Once every closed Monitor's last batch is sent (within ``timeout``), stop the
        thread, then flush and close the producer; True if all was delivered. Close the
        Monitors first."""
        deadline = time.monotonic() + timeout
        while self.is_alive() and time.monotonic() < deadline and self._retiring():
            self.wake()
            self.wait_round(0.1)
        timeout = max(0.1, deadline - time.monotonic())
        self._stopping.set()
        self._wake.set()
        if self.is_alive():
            self.join(timeout)
        with self._list_lock:
            left = [s for s in self._senders + self._added if s.stop_wanted and not s.retired]
        for s in left:  # Kafka away: what they still hold is counted as undelivered
            s.retire()
        with self._round:
            self._round.notify_all()
        producer, self.producer = self.producer, None
        return True if producer is None else producer.close(timeout)


class SharedSender(Sender):
    """A Monitor's Sender that runs on its ``SenderPool``'s thread and sends through the
    pool's producer; everything else (batches, seq, drops, stats) is ``Sender``'s."""

    def __init__(self, monitor: Any, pool: SenderPool) -> None:
        super().__init__(monitor)
        self.pool = pool
        self._flush_wanted = False
        self.stop_wanted = False  # the Monitor closed: send what is left, then leave the pool
        self.retired = False

    def start(self) -> None:
        self.pool.add(self)

    def is_alive(self) -> bool:
        return not self._stopping.is_set() and self.pool.is_alive()

    def due(self, every: bool) -> bool:
        """Whether the pool's thread runs this Sender's cycle now: a step ended or a batch
        filled (the buffer's wake), something built waits, a flush asks; ``every``: also
        anything buffered (the idle send)."""
        wake = self.buffer.wake
        if wake.is_set() or self._flush_wanted or self.stop_wanted or self._pending or (self._producer is None and
                                                                     self.pool.producer is not None):
            wake.clear()
            return True
        return every and (not self.buffer.empty or self.buffer.watermark != self._sent_watermark)

    def _connect(self, now: float) -> bool:
        producer = self.pool.producer
        if producer is None or self._stopping.is_set():
            return False
        return self._attempted(now, producer, None)

    def _delivered(self, acked: bool) -> bool:
        with self.pool.cycle_lock:  # not between a drain and its batch being queued
            return (not self._buffered() and self.buffer.watermark == self._sent_watermark
                    and (not acked or self._inflight() == 0))

    def flush(self, timeout: float, acked: bool = True) -> bool:
        """Wait up to ``timeout`` s until all that is buffered is sent and, ``acked``,
        acknowledged; True if it was."""
        deadline = time.monotonic() + timeout
        self._flush_wanted = True
        try:
            while not self._delivered(acked):
                left = deadline - time.monotonic()
                if left <= 0 or not self.is_alive():
                    return False
                self.pool.wake()
                self.pool.wait_round(min(left, 0.1))
            return True
        finally:
            self._flush_wanted = False

    def stop(self, timeout: float) -> bool:
        """The Monitor closes: the pool's thread sends what is buffered (its end mark) in its
        next round and retires this Sender (``retire``); the pool's close waits for that and
        for the acknowledgements. Returns at once: thousands of Monitors closing one after
        another do not each wait for a round and the broker."""
        self.stop_wanted = True
        self.pool.wake()
        return True

    def retire(self) -> None:
        """On the pool's thread: leave the pool; what could not be sent is counted."""
        self._stopping.set()
        self.pool.remove(self)
        self._close_producer()
        self.retired = True

    def _close_producer(self) -> None:
        self._producer = None  # the pool's: it closes it, after every Monitor
        super()._close_producer()
