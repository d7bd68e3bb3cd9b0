"""Hangs: where each rank of a run is (its RankProgress records), the TrainingHang alert
state of the run, and its Alert records.

A run hangs when a rank has been inside one step for more than ``hang_after_s``, measured
on that rank's clock (its report's ts_ns − step_started_ns), while it still reports. The
alert names the step: the highest step a rank sits in past the threshold (ranks that wait
in a collective are ahead of the rank they wait for, or in its step), every reporting rank
in it with how long (the first past the threshold fire it; the others entered the same
collective a little later, or are in it for another reason: a step says no more), with
their hosts, and the ranks that are elsewhere: in another step, between steps, silent (no report for
``SILENT_INTERVALS`` of their progress intervals, on the processor's clock) or never heard
of (below the producers' world_size). It fires once when the hang starts and resolves
when no reporting rank sits in any step past the threshold any more.

Where the ranks say which collective they sit in (RankProgress v2, torch's Flight
Recorder), the alert also names the call most of the hung ranks sit in (op, group,
sequence number, how long) and the members of its group that have not entered it (those
not in that call: the group's ranks from its name, schema/groups.py, else every rank of
the run), with their hosts and where they are instead.

The state lives in memory only: a restarted run stage learns every rank's place again
within one progress interval, and fires again for a hang still going on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from profstream.processors.stalls import FIRING, RESOLVED
from profstream.schema.groups import group_members

HANG_ALERT = "TrainingHang"
HANG_AFTER_S = 50.0  # + a progress interval (5 s) + a check (0.5 s): alerted within 60 s of the hang
SILENT_INTERVALS = 3  # progress intervals without a record: a rank went silent
CHECK_EVERY_S = 0.5  # a run's ranks are looked over at most this often
NAMED_RANKS = 16  # ranks named per group in a summary; the rest counted


@dataclass
class RankPlace:
    """Where one rank said it was, in its latest RankProgress."""

    host: str
    step: int | None
    step_started_ns: int | None
    last_step: int | None
    ts_ns: int
    interval_s: float
    seen: float  # the processor's clock when the record was read
    collective: tuple[str, str, int, int] | None = None  # (op, group, seq, since_ns) it sits in; None: none known

    def in_step_s(self) -> float | None:
        """How long it had been in its open step when it reported (its clock); None: none open."""
        if self.step is None or self.step_started_ns is None:
            return None
        return (self.ts_ns - self.step_started_ns) / 1e9

    def silent_s(self, now: float) -> float | None:
        """Seconds since its latest record, when that is past SILENT_INTERVALS intervals; else None."""
        quiet = now - self.seen
        return quiet if quiet > SILENT_INTERVALS * self.interval_s else None


class HangWatch:
    """The TrainingHang state of one run, fed its ranks' RankProgress records."""

    def __init__(self, hang_after_s: float = HANG_AFTER_S) -> None:
        if hang_after_s <= 0:
            raise ValueError("hang_after_s must be > 0")
        self.hang_after_s = hang_after_s
        self.places: dict[int, RankPlace] = {}
        self.world_size: int | None = None
        self.firing_step: int | None = None  # the step the firing hang named
        self._next_check = 0.0

    def report(self, m: Mapping[str, Any], now: float) -> None:
        """Fold in one RankProgress record."""
        old = self.places.get(m["rank"])
        if old is not None and m["ts_ns"] < old.ts_ns:
            return  # an older record read late (a resend)
        if m["world_size"] is not None:
            self.world_size = m["world_size"]
        call = m.get("collective")
        self.places[m["rank"]] = RankPlace(m["host"], m["step"], m["step_started_ns"], m["last_step"], m["ts_ns"],
                                           max(m["interval_ms"], 1) / 1000, now,
                                           None if call is None else (call["collective"], call["group"], call["seq"],
                                                                      call["since_ns"]))

    def forget(self, rank: int) -> None:
        """A rank that ended: it is no longer anywhere."""
        self.places.pop(rank, None)

    def live(self, now: float) -> bool:
        """Whether a rank still reports."""
        return any(p.silent_s(now) is None for p in self.places.values())

    def check(self, run_id: str, now: float) -> list[dict]:
        """The Alert records of the state changes since the last check (at most every CHECK_EVERY_S)."""
        if now < self._next_check:
            return []
        self._next_check = now + CHECK_EVERY_S
        out: list[dict] = []
        hung = self._hung(now)
        if self.firing_step is not None and hung is None:
            out.append(self._resolved(run_id))
            self.firing_step = None
        elif hung is not None and self.firing_step is None:
            self.firing_step = hung[0]
            out.append(self._firing(run_id, now, *hung))
        return out

    def _hung(self, now: float) -> tuple[int, dict[int, float]] | None:
        """(step, {rank: seconds in it}): the highest step some reporting rank sits in past the
        threshold, and those ranks; None when no rank does."""
        stuck = {r: (p.step, t) for r, p in self.places.items()
                 if (t := p.in_step_s()) is not None and t > self.hang_after_s and p.silent_s(now) is None}
        if not stuck:
            return None
        step = max(s for s, _ in stuck.values())
        return step, {r: t for r, p in self.places.items()
                      if p.step == step and (t := p.in_step_s()) is not None and p.silent_s(now) is None}

    def _firing(self, run_id: str, now: float, step: int, hung: dict[int, float]) -> dict:
        places = self.places
        evidence: dict[str, float] = {"hang_after_s": self.hang_after_s, "in_step_s": max(hung.values()),
                                      "ranks_in_step": float(len(hung))}
        elsewhere: list[str] = []
        groups: dict[str, list[int]] = {}  # what a rank elsewhere is doing -> its ranks
        times: dict[str, list[float]] = {}
        for r in sorted(places):
            if r in hung:
                evidence[f"rank.{r}.in_step_s"] = hung[r]
                continue
            p = places[r]
            silent = p.silent_s(now)
            if silent is not None:
                evidence[f"rank.{r}.silent_s"] = silent
                where = f"silent for {silent:.0f} s (last in step {p.step})" if p.step is not None else \
                    f"silent for {silent:.0f} s"
            elif p.step is None:
                evidence[f"rank.{r}.step"] = -1.0
                if p.last_step is not None:
                    evidence[f"rank.{r}.last_step"] = float(p.last_step)
                where = "between steps" + (f" after step {p.last_step}" if p.last_step is not None else "")
            else:
                evidence[f"rank.{r}.step"] = float(p.step)
                where = f"in step {p.step}"
                if (t := p.in_step_s()) is not None:
                    evidence[f"rank.{r}.in_step_s"] = t
                    times.setdefault(where, []).append(t)
            groups.setdefault(where, []).append(r)
        for where, ranks in groups.items():
            since = f" for {_span(times[where])}" if where in times else ""
            elsewhere.append(f"{_ranks_text(ranks, places)} {where}{since}")
        if self.world_size:
            unheard = [r for r in range(self.world_size) if r not in places]
            if unheard:
                evidence["ranks_unheard"] = float(len(unheard))
                elsewhere.append(f"{_ranks_text(unheard, places)} never reported")
        evidence["ranks_elsewhere"] = float(sum(len(g) for g in groups.values()) + evidence.get("ranks_unheard", 0))
        summary = (f"run {run_id}: {_ranks_text(sorted(hung), places)} in step {step} for "
                   f"{_span(hung.values())} (past {self.hang_after_s:g} s)")
        summary += "; " + "; ".join(elsewhere) if elsewhere else "; no rank elsewhere"
        summary += self._collective(hung, now, evidence)
        ts_ns = max(places[r].ts_ns for r in hung)
        return {"name": HANG_ALERT, "state": FIRING, "run_id": run_id, "rank": None, "step": step, "ts_ns": ts_ns,
                "summary": summary, "evidence": evidence}

    def _collective(self, hung: Mapping[int, float], now: float, evidence: dict[str, float]) -> str:
        """'; ranks .. in all_reduce of group g, seq q for t s; not entered: rank r (host h) in
        step s': the call most hung ranks sit in (the oldest on ties) and the members of its
        group not in it; '' where no hung rank said it sits in one."""
        places = self.places
        inside = {r: places[r].collective for r in hung if places[r].collective is not None}
        if not inside:
            return ""
        calls: dict[tuple[str, int], list[int]] = {}
        for r, (_op, group, seq, _since) in inside.items():
            calls.setdefault((group, seq), []).append(r)
        group, seq = max(calls, key=lambda k: (len(calls[k]), -min(inside[r][3] for r in calls[k])))
        in_call = sorted(calls[(group, seq)])
        op = inside[in_call[0]][0]
        members = group_members(group)
        if members is None:
            members = range(self.world_size) if self.world_size else sorted(places)
        not_entered = [r for r in members if r not in in_call]
        held = [(places[r].ts_ns - inside[r][3]) / 1e9 for r in in_call]
        evidence.update({"collective_seq": float(seq), "collective_s": max(held),
                         "ranks_in_collective": float(len(in_call)), "ranks_not_entered": float(len(not_entered))})
        text = (f"; {_ranks_text(in_call, places)} in {op} of group {group}, seq {seq} for {_span(held)}; ")
        if not not_entered:
            return text + "every member of its group entered it"
        wheres: dict[str, list[int]] = {}
        for r in not_entered:
            evidence[f"rank.{r}.not_entered"] = 1.0
            wheres.setdefault(self._where(r, now), []).append(r)
        return text + "not entered: " + "; ".join(f"{_ranks_text(ranks, places)} {where}"
                                                   for where, ranks in wheres.items())

    def _where(self, rank: int, now: float) -> str:
        """Where a rank that has not entered a call is, in a few words."""
        p = self.places.get(rank)
        if p is None:
            return "never reported"
        if p.silent_s(now) is not None:
            return f"silent for {p.silent_s(now):.0f} s"
        if p.collective is not None:
            op, group, seq, _since = p.collective
            return f"in {op} of group {group}, seq {seq}"
        if p.step is None:
            return "between steps"
        return f"in step {p.step}, in no collective"

    def _resolved(self, run_id: str) -> dict:
        step = self.firing_step
        ts_ns = max((p.ts_ns for p in self.places.values()), default=0)
        return {"name": HANG_ALERT, "state": RESOLVED, "run_id": run_id, "rank": None, "step": step, "ts_ns": ts_ns,
                "summary": f"run {run_id}: no reporting rank sits in a step past {self.hang_after_s:g} s any more "
                           f"(the hang named step {step})",
                "evidence": {"hang_after_s": self.hang_after_s}}


def _span(seconds: Iterable[float]) -> str:
    """'65 s', or '55-65 s' when the times differ in whole seconds."""
    seconds = list(seconds)
    lo, hi = f"{min(seconds):.0f}", f"{max(seconds):.0f}"
    return f"{hi} s" if lo == hi else f"{lo}-{hi} s"


def _ranks_text(ranks: Iterable[int], places: Mapping[int, RankPlace]) -> str:
    """'rank 2 (host b)' or 'ranks 0, 1, 3 (hosts a, b)', at most NAMED_RANKS named."""
    ranks = list(ranks)
    named = ", ".join(str(r) for r in ranks[:NAMED_RANKS])
    if len(ranks) > NAMED_RANKS:
        named += f" and {len(ranks) - NAMED_RANKS} more"
    hosts = sorted({places[r].host for r in ranks if r in places and places[r].host})
    where = f" ({'host' if len(hosts) == 1 else 'hosts'} {', '.join(hosts[:NAMED_RANKS])}" + \
        (f" and {len(hosts) - NAMED_RANKS} more" if len(hosts) > NAMED_RANKS else "") + ")" if hosts else ""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {named}{where}"


def hang_state(alert: Mapping[str, Any]) -> tuple[str, bool] | None:
    """(run id, firing) of a TrainingHang Alert record; None for any other alert."""
    if alert["name"] != HANG_ALERT:
        return None
    return alert["run_id"], alert["state"] == FIRING
