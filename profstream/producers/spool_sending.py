"""The Sender's side of the disk spool (``spool.py``), shared by both Senders.

Batches go to the spool instead of Kafka while the Monitor records only (``record_only``),
while records there wait to be handed to Kafka (so that order holds: new batches queue
behind them), while no producer has reached Kafka yet or Kafka is away, and while
librdkafka holds the whole in-flight share. Whenever a producer is there, the spool's
records are handed to it in order, up to the in-flight share; they leave the spool when
Kafka acknowledges them (a refused one is counted as undelivered). Once every record is
handed over and Kafka is reachable, batches go straight to Kafka again, behind them in
librdkafka's queue. At close, the batches librdkafka still held go to the spool where they
belong (after the records handed before them, before those spooled after), and whatever
is still in memory behind everything, so nothing recorded is lost while the disk takes it.

A Sender provides the hooks at the end of ``SpoolSending``; everything here runs on the
sender thread.
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import Any

from profstream.kafka.limits import MAX_MESSAGE_BYTES
from profstream.producers.spool import Spool, SpoolError, rank_dir

log = logging.getLogger("profstream.monitor")

DRAIN_SLICE_S = 0.002  # the longest one cycle reads the spool back (the GIL held, mostly)


class SpoolSending:
    """Mixed into the Sender: the spool, when the Monitor has one (``spool_dir``)."""

    m: Any
    _producer: Any
    _down_since: float | None

    def _open_spool(self) -> None:
        opts = self.m.options
        self._spool: Spool | None = None
        self._record_only: bool = opts["record_only"]
        self._spool_settled_seen = 0
        self._spool_full_said = False
        self._spool_now = False  # whether the last cycle spooled
        self._resume_at: int | None = None  # the first segment spooled since batches last went straight to Kafka
        self._spool_last: dict[str, Any] = {"spooling": False}  # the stats of a spool closed
        if not opts["spool_dir"]:
            return
        path = rank_dir(opts["spool_dir"], self.m.run_id, self.m.rank)
        try:
            self._spool = Spool(path, opts["spool_max_bytes"])
        except SpoolError as e:
            log.warning("profstream: %s; the Monitor runs without a spool%s", e,
                        " and records nothing" if self._record_only else "")
            return
        if self._spool.backlog:
            log.info("profstream: the spool at %s holds %.1f MiB of an earlier Monitor of %s rank %d: they are "
                     "sent first", path, self._spool.disk_bytes / 2**20, self.m.run_id, self.m.rank)

    def _spooling(self) -> bool:
        """Whether batches go to the spool now (see the module)."""
        s = self._spool
        if s is None:
            return False
        return (self._record_only or s.unread or self._producer is None or self._down_since is not None
                or self._inflight() >= self.m.inflight_limit_bytes)

    def _spool_cycle(self) -> None:
        """One cycle while spooling: acknowledgements heard, every batch built written
        behind the others, and the oldest records handed to Kafka if a producer is there."""
        s = self._spool
        if not self._spool_now:  # from sending straight to Kafka: what is spooled now starts a segment
            s.rotate()
            self._resume_at = s.next_segment
            self._spool_now = True
        self._spool_poll()
        self._spool_settle()
        self._spool_write_built()
        while s is self._spool and s.has_room(MAX_MESSAGE_BYTES) and self._build_batch():
            self._spool_write_built()
        if self._spool is not None and not s.has_room(MAX_MESSAGE_BYTES) and not self._spool_full_said:
            self._spool_full_said = True
            log.warning("profstream: the spool at %s is full (%d MiB, spool_max_bytes): new events wait in memory "
                        "and drop from there, counted", s.dir, s.max_bytes >> 20)
        if self._spool is not None and self._producer is not None:
            self._spool_drain()

    def _spool_write_built(self) -> None:
        """The batches built and not yet handed to Kafka, behind the others on disk, in
        order; a write the disk refuses ends the spool (one warning) and counts the batch."""
        for value, ops, samples in self._take_built():
            s = self._spool
            if s is None:
                self._count_lost_batch(ops, samples, "the spool failed")
                continue
            try:
                s.append(self.m.key, value, ops, samples, force=True)
            except OSError as e:
                self._count_lost_batch(ops, samples, f"the spool failed: {e}")
                self._spool_failed(e)

    def _spool_drain(self) -> None:
        """Hand the spool's records to Kafka in order while the in-flight share allows, for
        at most DRAIN_SLICE_S of this thread's time a cycle: reading records back holds the
        GIL, which the training thread must not wait on for long (a cycle comes every batch
        interval: ~50 records of 12 KB a ms, 20 times a second, is still 40 times what a
        rank records at 4,000 ops/s)."""
        s = self._spool
        limit = self.m.inflight_limit_bytes
        until = time.perf_counter() + DRAIN_SLICE_S
        while self._inflight() < limit and time.perf_counter() < until:
            record = s.next_record()
            if record is None or not self._hand_spooled(record.value, record.ops, record.samples):
                return
            s.advance(record)

    def _spool_settle(self) -> None:
        s = self._spool
        if s is None:
            return
        settled = self._spool_settled_count()
        if settled > self._spool_settled_seen:
            s.settle(settled - self._spool_settled_seen)
            self._spool_settled_seen = settled
            if not s.backlog:
                s.sync()  # the position, so that a restart sends none of it again

    def _spool_failed(self, error: OSError) -> None:
        s = self._spool
        log.warning("profstream: the spool at %s stopped (%s); the Monitor goes on with its memory buffer. What "
                    "the spool holds is sent by the next Monitor of this run and rank, or `profstream spool "
                    "publish %s`", s.dir, error.strerror or error, s.dir.parent.parent)
        self._spool_rescue(False)
        try:
            s.close()
        except OSError:
            pass
        self._spool = None
        self._spool_last = {"spooling": False, **s.stats()}

    def _spool_close(self) -> None:
        """At close, after the producer's: the batches it purged in front of the spool,
        what is still in memory behind it; then the spool synced and closed (its directory
        removed when nothing is left in it)."""
        s = self._spool
        if s is None:
            return
        rescued = self._take_rescued()
        if rescued:
            try:
                s.insert([(self.m.key, value, ops, samples) for value, ops, samples in rescued], self._resume_at)
            except OSError as e:
                for _value, ops, samples in rescued:
                    self._count_lost_batch(ops, samples, f"the spool failed: {e}")
                self._spool_failed(e)
                return
        self._spool_settle()
        self._spool_write_built()
        while self._spool is s and s.has_room(MAX_MESSAGE_BYTES) and self._build_batch():
            self._spool_write_built()
        if self._spool is None:
            return
        backlog = s.backlog
        s.close()
        self._spool = None
        self._spool_last = {"spooling": False, **s.stats()}
        if backlog:
            log.log(logging.INFO if self._record_only else logging.WARNING,
                    "profstream: %.1f MiB of %s rank %d %s the spool at %s: `profstream spool publish %s` sends "
                    "them%s", s.disk_bytes / 2**20, self.m.run_id, self.m.rank,
                    "recorded in" if self._record_only else "wait in", s.dir, s.dir.parent.parent,
                    "" if self._record_only else ", or the next Monitor of this run and rank")
        else:
            shutil.rmtree(s.dir, ignore_errors=True)
            try:
                s.dir.parent.rmdir()  # the run's directory, once no rank is left in it
            except OSError:
                pass

    def _spool_flushed(self) -> bool:
        """While spooling, a flush is done once nothing waits in memory: what Kafka has not
        acknowledged is on disk, or (what librdkafka held when Kafka went away) goes there
        at close."""
        return self._spool is not None and self._spool_now

    def _spool_sending(self) -> bool:
        """Whether the spool holds records not yet acknowledged while Kafka is there to take
        them (an earlier Monitor's, or this one's from an outage that ended): a flush, and so
        a close, waits for them too (within its timeout) rather than leaving them for the
        next Monitor of the rank."""
        s = self._spool
        return (s is not None and not self._record_only and self._producer is not None
                and self._down_since is None and s.backlog)

    def spool_stats(self) -> dict[str, Any]:
        s = self._spool
        if s is None:
            return self._spool_last
        return {"spooling": self._spool_now, **s.stats()}

    # -- hooks of the Sender ---------------------------------------------------------

    def _spool_poll(self) -> None:
        """Hear Kafka's acknowledgements and send what was handed over."""
        raise NotImplementedError

    def _build_batch(self) -> bool:
        raise NotImplementedError

    def _take_built(self) -> list[tuple[bytes, int, int]]:
        raise NotImplementedError

    def _hand_spooled(self, value: bytes, ops: int, samples: int) -> bool:
        raise NotImplementedError

    def _spool_settled_count(self) -> int:
        raise NotImplementedError

    def _spool_rescue(self, on: bool) -> None:
        """Keep (or stop keeping) the bytes of batches a close purges, for the spool."""

    def _take_rescued(self) -> list[tuple[bytes, int, int]]:
        raise NotImplementedError

    def _inflight(self) -> int:
        raise NotImplementedError

    def _count_lost_batch(self, ops: int, samples: int, why: str) -> None:
        raise NotImplementedError

