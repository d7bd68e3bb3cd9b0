"""``AutoCapture``: firing alerts become capture requests; the control topic is guarded.

Decisions only, no Kafka: the service (``service.py``) feeds it the alerts (from the
alerts topic or Alertmanager's webhook), the cross-rank figures of the run topic (which
runs are alive, their slowest and fastest ranks) and the control topic, and sends what it
returns through ``Outlet``.

- An alert of the policy's list that fires for a run asks for ``steps`` steps from each
  rank's next step, on the affected rank (the alert's, else the run's latest straggler)
  and ``healthy_ranks`` of the fastest other ranks for comparison, after ``delay_s`` (an
  alert resolved by then asks nothing), within the rate limits.
- An alert of ``stacks_alerts`` (TrainingHang: a hung run starts no next step) asks every
  rank of the run for its stacks instead, once per firing, after the same delay, within
  rate limits of their own (an op capture a minute before does not keep the stacks of a
  hang from being asked). The answers stay on the control topic (``profstream stacks
  --latest``, the report, the timeline sink).
- Guard: a request no rank can act on is refused for the whole request (``rank`` None):
  ``invalid`` at once, ``unknown_run`` when no rank answered within ``unknown_run_after_s``
  and the run topic has not shown the run for ``run_ttl_s``. Undecodable records go to
  the dead-letter topic (the service does that).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from profstream.control.policy import CapturePolicy, RateLimiter
from profstream.control.records import (
    OPS,
    REFUSED,
    REQUEST,
    STACKS,
    check_request,
    new_request,
    new_stacks_request,
    new_status,
    refusal,
)

log = logging.getLogger("profstream.autocapture")

AUTO_BY = "profstream autocapture"
FIRING, RESOLVED = "firing", "resolved"


class Outlet(Protocol):
    """Where AutoCapture's requests and statuses go (the control topic)."""

    def send_request(self, request: dict) -> None: ...

    def send_status(self, status: dict) -> None: ...


@dataclass
class RunSeen:
    """What the run topic last said of a run."""

    step: int
    step_times: dict[int, int]
    straggler: int
    seen_s: float


@dataclass
class Outcome:
    """What one alert led to: requested, delayed or skipped (with why)."""

    alert: str
    run_id: str
    rank: int | None
    action: str
    detail: str = ""
    request: dict | None = None

    def line(self) -> str:
        where = f"run {self.run_id}" + (f" rank {self.rank}" if self.rank is not None else "")
        return f"{self.alert} {where}: {self.action}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class _Pending:
    due_s: float
    name: str
    run_id: str
    rank: int | None
    source: str


@dataclass
class AutoCapture:
    policy: CapturePolicy
    outlet: Outlet
    clock: object = time.time
    requester: str | None = None  # the user of the service's own request topic: only its requests count
    runs: dict[str, RunSeen] = field(default_factory=dict)
    outcomes: Counter = field(default_factory=Counter)  # action -> count

    def __post_init__(self) -> None:
        self.limiters = {OPS: RateLimiter(self.policy), STACKS: RateLimiter(self.policy)}  # by request kind
        self._lock = threading.Lock()  # alerts come from the webhook's threads too
        self._pending: dict[tuple, _Pending] = {}
        self._firing: set[tuple] = set()
        self._stacks_asked: set[tuple] = set()  # stacks alerts asked for while they fire: once per firing
        self._watched: dict[str, tuple[dict, float]] = {}  # request id -> (request, seen at): no rank answered yet
        self.guard_refusals = 0

    # -- inputs ---------------------------------------------------------------------------

    def alert(self, name: str, run_id: str, rank: int | None, state: str, source: str) -> Outcome:
        """An alert changed state; returns what it led to (a request may be sent here)."""
        key = (name, run_id, rank)
        with self._lock:
            if name not in self.policy.alerts:
                return self._count(Outcome(name, run_id, rank, "skipped", "not in the policy's alerts"))
            if state != FIRING:
                self._firing.discard(key)
                self._stacks_asked.discard(key)
                if self._pending.pop(key, None) is not None:
                    return self._count(Outcome(name, run_id, rank, "skipped", "resolved within delay_s"))
                return self._count(Outcome(name, run_id, rank, "skipped", "resolved"))
            self._firing.add(key)
            if key in self._pending:
                return self._count(Outcome(name, run_id, rank, "skipped", "already waiting for delay_s"))
            now = self.clock()
            if self.policy.delay_s > 0:
                self._pending[key] = _Pending(now + self.policy.delay_s, name, run_id, rank, source)
                return self._count(Outcome(name, run_id, rank, "delayed", f"asks in {self.policy.delay_s:g} s "
                                                                          "unless it resolves"))
            return self._ask(name, run_id, rank, source, now)

    def run_step(self, record: dict) -> None:
        """A RunStepMetrics record."""
        times = {int(r): int(t) for r, t in record["step_times_ns"].items()}
        with self._lock:
            seen = self.runs.get(record["run_id"])
            if seen is None or record["step"] >= seen.step:
                self.runs[record["run_id"]] = RunSeen(record["step"], times, record["straggler_rank"], self.clock())
            else:
                seen.seen_s = self.clock()

    def control(self, name: str, record: dict, live: bool) -> None:
        """A control record; ``live``: sent since the service started (older ones only
        feed the rate limits)."""
        with self._lock:
            if name == REQUEST:
                # an automatic request counts only from our own request topic: another principal
                # cannot write there, so it cannot use up our allowance by claiming to be us
                if record["requested_by"] == AUTO_BY and record.get("requester") == self.requester:
                    self.limiters[record["kind"]].record(record["request_id"], record["run_id"],
                                                         record["requested_ns"] / 1e9)
                if live:
                    self._guard(record)
            elif record["rank"] is not None:
                self._watched.pop(record["request_id"], None)  # a rank answered

    def tick(self) -> list[Outcome]:
        """Work due by time: delayed alerts, unanswered requests for unknown runs."""
        with self._lock:
            now = self.clock()
            out = []
            for key, p in list(self._pending.items()):
                if p.due_s <= now:
                    del self._pending[key]
                    out.append(self._ask(p.name, p.run_id, p.rank, p.source, now))
            for rid, (request, seen_at) in list(self._watched.items()):
                if now - seen_at < self.policy.unknown_run_after_s:
                    continue
                del self._watched[rid]
                if not self._known(request["run_id"], now):
                    self.guard_refusals += 1
                    self.outlet.send_status(new_status(request, REFUSED, None, reason=refusal(
                        "unknown_run", f"no rank of run {request['run_id']} answered within "
                                       f"{self.policy.unknown_run_after_s:g} s and the processors have not seen it "
                                       f"for {self.policy.run_ttl_s:g} s: check the run id (profstream capture "
                                       "--list shows recent ones)")))
            return out

    # -- inside ---------------------------------------------------------------------------

    def _known(self, run_id: str, now: float) -> bool:
        seen = self.runs.get(run_id)
        return seen is not None and now - seen.seen_s <= self.policy.run_ttl_s

    def _guard(self, request: dict) -> None:
        problem = check_request(request)
        if problem is not None:
            self.guard_refusals += 1
            self.outlet.send_status(new_status(request, REFUSED, None, reason=problem))
        elif not self._known(request["run_id"], self.clock()):
            self._watched[request["request_id"]] = (request, self.clock())

    def _ask(self, name: str, run_id: str, rank: int | None, source: str, now: float) -> Outcome:
        if (name, run_id, rank) not in self._firing:
            return self._count(Outcome(name, run_id, rank, "skipped", "resolved within delay_s"))
        kind = STACKS if name in self.policy.stacks_alerts else OPS
        if kind == STACKS and (name, run_id, rank) in self._stacks_asked:
            return self._count(Outcome(name, run_id, rank, "skipped", "its stacks were asked for while it fires"))
        why = self.limiters[kind].refusal(run_id, now)
        if why is not None:
            return self._count(Outcome(name, run_id, rank, "skipped", f"rate limit: {why}"))
        reason = f"{name} firing" + (f" on rank {rank}" if rank is not None else "") + f" ({source})"
        if kind == STACKS:
            request = new_stacks_request(run_id, reason=reason, requested_by=AUTO_BY, expires_s=self.policy.expires_s,
                                         now_ns=int(now * 1e9))
            self._stacks_asked.add((name, run_id, rank))
            return self._send(request, now, Outcome(name, run_id, rank, "requested", "stacks of every rank", request))
        ranks = self._ranks(name, run_id, rank)
        if ranks is None:
            return self._count(Outcome(name, run_id, rank, "skipped", "the alert names no rank and the run topic "
                                                                      "has not shown this run (no straggler known)"))
        p = self.policy
        request = new_request(
            run_id, ranks=[{"first": r, "last": r} for r in ranks], steps=p.steps, activities=p.activities,
            record_shapes=p.record_shapes, profile_memory=p.profile_memory, with_stack=p.with_stack,
            reason=reason, requested_by=AUTO_BY, expires_s=p.expires_s, now_ns=int(now * 1e9))
        return self._send(request, now, Outcome(name, run_id, rank, "requested", f"ranks {', '.join(map(str, ranks))}",
                                                request))

    def _send(self, request: dict, now: float, outcome: Outcome) -> Outcome:
        self.limiters[request["kind"]].record(request["request_id"], request["run_id"], now)
        self.outlet.send_request(request)
        return self._count(outcome)

    def _ranks(self, name: str, run_id: str, rank: int | None) -> list[int] | None:
        """The affected rank, then the fastest others (not firing the same alert)."""
        seen = self.runs.get(run_id)
        affected = rank if rank is not None else (seen.straggler if seen is not None else None)
        if affected is None:
            return None
        ranks = [affected]
        if seen is not None and self.policy.healthy_ranks:
            others = sorted((t, r) for r, t in seen.step_times.items()
                            if r != affected and (name, run_id, r) not in self._firing)
            ranks += [r for _t, r in others[:self.policy.healthy_ranks]]
        return ranks

    def _count(self, outcome: Outcome) -> Outcome:
        self.outcomes[outcome.action] += 1
        (log.info if outcome.action != "skipped" else log.debug)("autocapture: %s", outcome.line())
        return outcome
