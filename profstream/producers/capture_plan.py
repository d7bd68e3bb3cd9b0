"""``CapturePlan``: capture requests handed from the control reader to the training thread.

The reader thread (``control.py``) accepts a request for this rank with ``offer`` and
appends it to ``offers``; whatever captures ops (the Monitor's own gate, or torch's
``OpCapture``) calls ``claim(step)`` at every step boundary, which takes the offer up at
the first step it may start on and says for each step whether a request captures it.
``ended`` and ``captured`` report each captured step's end and ops; the last one finishes
the request. Statuses go back to the reader through ``outbox``.

No lock: one thread appends and one pops each deque (atomic in CPython), and a capture
is in flight from the moment the training thread sets ``current`` until it finishes, so
the reader sees a busy rank at every moment between. ``claim`` costs two attribute reads
when nothing is asked.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from profstream.control.records import (
    ARMED,
    FINISHED,
    REFUSED,
    STARTED,
    describe_request,
    refusal,
    settings_of,
)


class ArmedCapture:
    """One accepted request on this rank, from its offer to its last step."""

    __slots__ = ("request", "settings", "first", "last", "ops", "start_ns", "end_ns", "last_ended")

    def __init__(self, request: dict) -> None:
        self.request = request
        self.settings = settings_of(request)
        self.first: int | None = None  # set when the training thread starts it
        self.last: int | None = None
        self.ops = 0
        self.start_ns: int | None = None
        self.end_ns: int | None = None
        self.last_ended: int | None = None  # the last captured step that has ended

    @property
    def started(self) -> bool:
        return self.first is not None

    def __contains__(self, step: int) -> bool:
        return self.first is not None and self.first <= step <= self.last


class CapturePlan:
    """The requests of one rank: offered by the reader, taken up by the training thread."""

    def __init__(self, rank: int, max_steps: int, activities: frozenset[str] = frozenset(("cpu", "cuda"))) -> None:
        self.rank = rank
        self.max_steps = max_steps
        self.activities = activities  # what this rank's capture can record (set by the integration)
        self.unavailable: str | None = None  # why this rank cannot capture now (set by the integration)
        self.offers: deque[ArmedCapture] = deque()  # appended by the reader, popped by the training thread
        self.current: ArmedCapture | None = None  # taken up by the training thread, not finished
        self.outbox: deque[tuple[str, ArmedCapture, str, int]] = deque()  # (state, capture, reason, ts_ns)
        self.started = self.finished = self.refused = 0

    # -- reader thread ------------------------------------------------------------------

    def offer(self, request: dict, now_ns: int | None = None) -> str | None:
        """Accept ``request`` (it is armed: None) or say why not (a refusal reason)."""
        now = time.time_ns() if now_ns is None else now_ns
        if self.unavailable is not None:
            return refusal("unavailable", self.unavailable)
        if request["steps"] > self.max_steps:
            return refusal("over_limit", f"{request['steps']} steps asked, this rank captures at most "
                                         f"{self.max_steps} per request (capture_max_steps)")
        if now >= request["expires_at_ns"]:
            return refusal("expired", f"expired {(now - request['expires_at_ns']) / 1e9:.1f} s before it "
                                      "reached this rank")
        if not self.activities & frozenset(request["activities"]):
            return refusal("unavailable", f"this rank records {', '.join(sorted(self.activities))} only, "
                                          f"not {', '.join(request['activities'])}")
        busy = self.offers[0] if self.offers else self.current
        if busy is not None:
            what = describe_request(busy.request) if not busy.started else f"steps {busy.first}-{busy.last}"
            return refusal("busy", f"capture already running: request {busy.request['request_id']} ({what})")
        self.offers.append(ArmedCapture(request))
        return None

    # -- training thread (at step boundaries) ---------------------------------------------

    def claim(self, step: int) -> ArmedCapture | None:
        """The request that captures ``step`` (about to begin), if any; takes up an offer
        that may start now, refuses one that expired or whose start step has passed."""
        cur = self.current
        if cur is None:
            if not self.offers:
                return None
            cur = self.offers[0]
            self.current = cur  # busy from here on, for the reader
            self.offers.popleft()
        if cur.first is None:
            now = time.time_ns()
            request = cur.request
            if now >= request["expires_at_ns"]:
                self._end(cur, REFUSED, refusal("expired", f"expired before step {step}, the rank's next step, "
                                                           "began"), now)
                return None
            start = request["start_step"]
            if start is not None and step < start:
                return None
            if start is not None and step > start:
                self._end(cur, REFUSED, refusal("start_passed", f"step {start} has passed: this rank is at "
                                                                f"step {step}"), now)
                return None
            cur.first, cur.last, cur.start_ns = step, step + request["steps"] - 1, now
            self.started += 1
            self.outbox.append((STARTED, cur, "", now))
        return cur if cur.first <= step <= cur.last else None

    def ended(self, step: int, ts_ns: int) -> None:
        """Step ``step`` ended at ``ts_ns`` (called for every step; cheap when nothing is captured)."""
        cur = self.current
        if cur is not None and cur.first is not None and cur.first <= step <= cur.last:
            cur.last_ended, cur.end_ns = step, ts_ns

    def captured(self, step: int, ops: int) -> None:
        """``ops`` ops of step ``step`` were sent (after it ended); the last step finishes
        the request. May run on a conversion thread."""
        cur = self.current
        if cur is not None and cur.first is not None and cur.first <= step <= cur.last:
            cur.ops += ops
            if step == cur.last:
                self._end(cur, FINISHED, "", time.time_ns())

    # -- either side, at the end ----------------------------------------------------------

    def close(self, why: str) -> None:
        """Nothing more will be captured (the run or its capture ended): the open request
        finishes with what it has, offers are refused."""
        self.unavailable = why
        now = time.time_ns()
        cur = self.current
        if cur is not None:
            if cur.started and cur.last_ended is not None:
                cur.last = cur.last_ended
                self._end(cur, FINISHED, refusal("ended", why), now)
            else:
                self._end(cur, REFUSED, refusal("ended", why), now)
        while self.offers:
            offer = self.offers.popleft()
            self.refused += 1
            self.outbox.append((REFUSED, offer, refusal("ended", why), now))

    def _end(self, cur: ArmedCapture, state: str, reason: str, ts_ns: int) -> None:
        if state == FINISHED:
            self.finished += 1
        else:
            self.refused += 1
        self.outbox.append((state, cur, reason, ts_ns))
        if self.current is cur:
            self.current = None

    def status_fields(self, state: str, cur: ArmedCapture) -> dict[str, Any]:
        """The fields of a status of ``cur`` beyond its state and reason."""
        if state == STARTED:
            return {"first_step": cur.first, "last_step": cur.last}
        if state == FINISHED:
            return {"first_step": cur.first, "last_step": cur.last, "ops": cur.ops,
                    "window_start_ns": cur.start_ns, "window_end_ns": cur.end_ns}
        return {}


__all__ = ["ARMED", "ArmedCapture", "CapturePlan"]
