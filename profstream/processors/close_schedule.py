"""Which ranks a periodic close has to visit.

A consumer of the raw topic keeps one ``RankAssembler`` per (run, rank) and closes steps
after every poll. With 1,024 ranks in one process, visiting each rank on every poll cost
more than the steps themselves. ``CloseSchedule`` names only the ranks that may have
something to close now:

- the ranks whose step marks or watermark moved since their last visit (``touched``);
- the ranks whose first marked step (or the later step that a device step waits for:
  ``RankAssembler.grace_mark``) waits out the grace period with no watermark (a heap of
  mark times);
- the ranks whose idle timeout came (a heap of last-seen times).

The heaps are compared with the same expressions as the assembler's grace test and the
callers' idle test, so a step or an idle rank closes on the same call as when every rank
was visited. A heap entry counts only while its time is the one in the dict beside the
heap; entries left over from an earlier schedule are skipped when popped.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable

from profstream.processors.assembler import RankAssembler


class CloseSchedule:
    def __init__(self, grace_s: float, idle_timeout_s: float) -> None:
        self.grace_s = grace_s
        self.idle_timeout_s = idle_timeout_s
        self.dirty: set[Hashable] = set()  # marks or watermark moved since the last visit
        self._grace_heap: list[tuple[float, Hashable]] = []
        self._grace_at: dict[Hashable, float] = {}  # mark_seen_at of the first marked step, no watermark
        self._idle_heap: list[tuple[float, Hashable]] = []
        self._idle_at: dict[Hashable, float] = {}  # last_seen when scheduled (<= the rank's last_seen)

    def add(self, ident: Hashable, asm: RankAssembler) -> None:
        """A new or restored rank: whatever was scheduled for an earlier one is void."""
        self._grace_at.pop(ident, None)
        self._idle_at.pop(ident, None)
        self.visited(ident, asm)

    def forget(self, ident: Hashable) -> None:
        self.dirty.discard(ident)
        self._grace_at.pop(ident, None)  # its heap entries are skipped when popped
        self._idle_at.pop(ident, None)

    def folded(self, ident: Hashable, asm: RankAssembler, marks_moved: bool) -> None:
        """A batch went into the rank's assembler; ``marks_moved``: it brought step marks or
        moved the watermark, so a step may close at the next visit."""
        if marks_moved:
            self.dirty.add(ident)
        self.seen(ident, asm.last_seen)  # a no-op unless the clock went back (offline replay)

    def seen(self, ident: Hashable, last_seen: float) -> None:
        """Make sure the idle heap holds the rank at ``last_seen`` or earlier: a later batch
        only moves last_seen forward, which the entry's pop finds out."""
        if last_seen < self._idle_at.get(ident, math.inf):
            self._idle_at[ident] = last_seen
            heapq.heappush(self._idle_heap, (last_seen, ident))

    def visited(self, ident: Hashable, asm: RankAssembler) -> None:
        """Put a rank that was just visited (or is new) in the heaps where it belongs now."""
        self.seen(ident, asm.last_seen)
        first_mark = asm.grace_mark() if asm.watermark is None else None
        if first_mark is None:
            self._grace_at.pop(ident, None)
        elif self._grace_at.get(ident) != first_mark:
            self._grace_at[ident] = first_mark
            heapq.heappush(self._grace_heap, (first_mark, ident))

    def due(self, now: float, last_seen: Callable[[Hashable], float]) -> set[Hashable]:
        """The ranks to visit at ``now``: the touched ones, and those whose grace or idle time
        came (their entries leave the heaps; a visit puts the rank back with ``visited``).
        ``last_seen(ident)`` is the rank's assembler's last_seen now."""
        due = self.dirty
        self.dirty = set()
        heap, at = self._grace_heap, self._grace_at
        while heap and now - heap[0][0] >= self.grace_s:  # the assembler's test
            mark_seen_at, ident = heapq.heappop(heap)
            if at.get(ident) == mark_seen_at:
                del at[ident]
                due.add(ident)
        heap, at = self._idle_heap, self._idle_at
        while heap and now - heap[0][0] >= self.idle_timeout_s:  # the callers' idle test
            seen_then, ident = heapq.heappop(heap)
            if at.get(ident) == seen_then:
                del at[ident]
                seen = last_seen(ident)
                if seen == seen_then:
                    due.add(ident)
                else:  # it got batches since: due later (or now: popped again)
                    self.seen(ident, seen)
        return due
