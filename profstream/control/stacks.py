"""Every rank's stacks on demand (``profstream stacks``): ask, wait, merge, say.

``ask_stacks`` sends a stacks request on the requester's request topic (``client.py``,
the same path as a capture request) and folds the ranks' answers (finished statuses with
their threads, producers/stacks.py) until every rank it waits for has answered or the
deadline passes. ``group_ranks`` merges the ranks whose threads stand at the same frames
and orders the groups smallest first: in a hang the odd one out is the rank to look at.
``stacks_lines`` writes it all for people, tracebacks as Python prints them.

The answers stay on the control topic (finished CaptureStatus records with their
``threads``, readable by every requester, and archived with it): ``latest_answer`` finds
the run's latest stacks request among them, whoever asked (``profstream stacks --latest``
after autocapture asked on TrainingHang; the report and the timeline sink from the same
records).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from profstream.control.client import CaptureProgress, follow, recent_statuses, send_request
from profstream.control.records import FINISHED, REFUSED, format_ranks, new_stacks_request
from profstream.kafka.connection import Connection
from profstream.kafka.topics import Topics


@dataclass
class StackGroup:
    """Ranks whose threads (profstream's own left aside, unless asked) stand at the same frames."""

    ranks: list[int]
    hosts: list[str]
    threads: list[dict]  # ThreadStack records of the first rank of the group


@dataclass
class StacksAnswer:
    """What the ranks of a run answered to one stacks request."""

    request: dict
    progress: CaptureProgress
    waited_s: float
    groups: list[StackGroup] = field(default_factory=list)
    read_back: bool = False  # read from the control topic afterwards (``latest_answer``), not waited for

    @property
    def answered(self) -> dict[int, dict]:
        return {r: s for r, s in sorted(self.progress.ranks.items()) if s["state"] == FINISHED}

    @property
    def refused(self) -> dict[int, dict]:
        return {r: s for r, s in sorted(self.progress.ranks.items()) if s["state"] == REFUSED}

    def missing(self) -> list[int]:
        """Ranks waited for (those asked, else those of the world size) that did not answer."""
        return self.progress.missing()


def _signature(threads: list[dict], own: bool) -> tuple:
    """What makes two ranks' stacks the same: each thread's name and frames."""
    return tuple((t["name"], t["frames_omitted"], tuple((f["file"], f["line"], f["function"]) for f in t["frames"]))
                 for t in threads if own or not t["own"])


class StackGrouper:
    """Ranks grouped by identical stacks, one answer at a time (the timeline sink folds them
    as they come): a group keeps the threads of the first rank added to it only."""

    def __init__(self, own_threads: bool = False) -> None:
        self.own_threads = own_threads
        self._by_sig: dict[tuple, StackGroup] = {}

    def add(self, rank: int, status: dict) -> None:
        """A rank's finished status, with its threads."""
        threads = [t for t in status["threads"] or () if self.own_threads or not t["own"]]
        group = self._by_sig.setdefault(_signature(threads, self.own_threads), StackGroup([], [], threads))
        bisect.insort(group.ranks, rank)
        if status["host"] not in group.hosts:
            group.hosts.append(status["host"])

    def groups(self) -> list[StackGroup]:
        """The groups, the smallest first (then by first rank)."""
        return sorted(self._by_sig.values(), key=lambda g: (len(g.ranks), g.ranks[0]))


def group_ranks(answered: dict[int, dict], own_threads: bool = False) -> list[StackGroup]:
    """The ranks of ``answered`` (rank -> its finished status) grouped by identical stacks,
    the smallest group first (then by first rank)."""
    grouper = StackGrouper(own_threads)
    for rank, status in sorted(answered.items()):
        grouper.add(rank, status)
    return grouper.groups()


def ask_stacks(conn: Connection | str, topics: Topics, run_id: str, *, ranks: list[dict] | None = None,
               timeout_s: float = 15.0, unanswered_s: float | None = None, requested_by: str = "",
               reason: str = "", own_threads: bool = False, stop: Callable[[], bool] | None = None) -> StacksAnswer:
    """Ask ``ranks`` (None: all) of ``run_id`` for their stacks and wait for the answers, at
    most ``timeout_s`` (and ``unanswered_s`` when no rank answers at all). LookupError (one
    line) when the request cannot be sent."""
    request = new_stacks_request(run_id, ranks=ranks, reason=reason, requested_by=requested_by,
                                 expires_s=max(timeout_s, 1.0))
    started = time.monotonic()
    send_request(conn, topics, request)
    progress = follow(conn, topics, request, timeout_s, stop=stop, unanswered_s=unanswered_s)
    answer = StacksAnswer(request, progress, time.monotonic() - started)
    answer.groups = group_ranks(answer.answered, own_threads)
    return answer


def latest_answer(statuses: Iterable[dict], own_threads: bool = False) -> StacksAnswer | None:
    """The answers of the latest stacks request among the CaptureStatus records
    ``statuses`` (of one run; the one whose newest answer is newest), merged; None when
    none answers a stacks request (its refusals are among its statuses too). Its request is
    what the statuses carry of it (id, run, requester, reason; every rank asked: the world
    size says which ranks did not answer)."""
    statuses = [s for s in statuses if s["rank"] is not None]
    by_id: dict[str, list[dict]] = {}
    for status in statuses:
        if status["threads"] is not None:
            by_id.setdefault(status["request_id"], []).append(status)
    if not by_id:
        return None
    answers = max(by_id.values(), key=lambda got: max(s["ts_ns"] for s in got))
    first = min(answers, key=lambda s: s["ts_ns"])
    answers += [s for s in statuses if s["request_id"] == first["request_id"] and s["threads"] is None]  # refusals
    request = {"request_id": first["request_id"], "run_id": first["run_id"], "ranks": None,
               "requester": first["requester"], "reason": first["request_reason"], "requested_ns": first["ts_ns"]}
    progress = CaptureProgress(request)
    for status in answers:
        progress.add(status, now=0.0)
    last_ns = max(s["ts_ns"] for s in answers if s["threads"] is not None)
    answer = StacksAnswer(request, progress, (last_ns - first["ts_ns"]) / 1e9, read_back=True)
    answer.groups = group_ranks(answer.answered, own_threads)
    return answer


def latest_stacks(conn: Connection | str, topics: Topics, run_id: str, since_s: float,
                  own_threads: bool = False) -> StacksAnswer | None:
    """``latest_answer`` of ``run_id``'s statuses of the last ``since_s`` seconds on the
    control topic; LookupError (one line) when that topic cannot be read."""
    return latest_answer(recent_statuses(conn, topics, since_s, run_id), own_threads)


def format_ranks_list(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    ranges: list[dict] = []
    for r in sorted(ranks):
        if ranges and r == ranges[-1]["last"] + 1:
            ranges[-1]["last"] = r
        else:
            ranges.append({"first": r, "last": r})
    return format_ranks(ranges)


def ranks_phrase(ranks: list[int]) -> str:
    """``rank 2`` or ``ranks 0-1,3``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks_list(ranks)}"


def traceback_lines(thread: dict, indent: str = "    ") -> list[str]:
    """One thread's stack as Python's tracebacks print it (most recent call last)."""
    lines = []
    if thread["frames_omitted"]:
        lines.append(f"{indent}... {thread['frames_omitted']} outer frames left out (a deep stack)")
    for f in thread["frames"]:
        line = "?" if f["line"] is None else f["line"]
        lines.append(f'{indent}File "{f["file"]}", line {line}, in {f["function"]}')
        if f["code"]:
            lines.append(f"{indent}  {f['code']}")
    return lines


def stacks_lines(answer: StacksAnswer) -> list[str]:
    """The answer for people: one block per group of ranks, the odd one out first; then the
    ranks that refused or did not answer."""
    answered = answer.answered
    expected = answer.progress.expected()
    of = f" of {len(expected)}" if expected is not None else ""
    distinct = f"{len(answer.groups)} distinct stack{'s' if len(answer.groups) != 1 else ''}"
    if answer.read_back:
        r = answer.request
        when = datetime.fromtimestamp(r["requested_ns"] / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        lines = [f"stacks of run {r['run_id']} asked by {r['requester'] or '?'}"
                 + (f" ({r['reason']})" if r["reason"] else "")
                 + f": {len(answered)}{of} ranks answered from {when} within {answer.waited_s:.1f} s, {distinct}"]
    else:
        lines = [f"stacks of run {answer.request['run_id']}: {len(answered)}{of} ranks answered in "
                 f"{answer.waited_s:.1f} s, {distinct}"]
    total = len(answered)
    for group in answer.groups:
        hosts = ", ".join(h or "?" for h in group.hosts)
        lines.append("")
        lines.append(f"{ranks_phrase(group.ranks)} ({len(group.ranks)} of {total}) on {hosts}:")
        omitted = max(answered[r]["threads_omitted"] for r in group.ranks)
        for thread in group.threads:
            lines.append(f"  thread {thread['name']}" + (" (main)" if thread["main"] else "")
                         + (" (profstream)" if thread["own"] else ""))
            lines += traceback_lines(thread)
        if omitted:
            lines.append(f"  ... {omitted} more threads left out (a rank sends at most its first ones)")
    if answer.refused:
        lines.append("")
        for rank, status in answer.refused.items():
            lines.append(f"rank {rank} refused: {status['reason']}")
    if answer.progress.whole is not None:
        lines.append(f"refused for every rank: {answer.progress.whole['reason']}")
    missing = answer.missing()
    if missing and answered:
        lines.append("")
        within = "" if answer.read_back else f" within {answer.waited_s:.0f} s"
        lines.append(f"{ranks_phrase(missing)} did not answer{within}: the process is gone, "
                     "cut off from Kafka, or one of its threads holds the GIL")
    return lines
