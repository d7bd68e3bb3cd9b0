"""The exporter's collective series: ``profstream_collective_*{run, ...}``, from each run's
newest RunStepMetrics that had collectives (processors/collectives.py). Labels stay
bounded: rank (at most ``max_ranks`` per run: those that waited longest; every missing
rank), and collective (at most ``MAX_COLLECTIVE_NAMES`` per run), never a call. The
ranks' clock offsets against the run's (processors/clocks.py) go out as
``profstream_clock_offset_seconds{run, rank}`` and its error bound (at most ``max_ranks``
ranks: the farthest off), for the ranks that have one.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MAX_COLLECTIVE_NAMES = 16  # collective label values per run (c10d has about a dozen)


@dataclass(eq=False)
class RunCollectives:
    """The collective figures of a run's newest step that had collectives."""

    late_rank: int  # -1: none waited
    held_s: float
    held_ratio: float  # held / median step time
    ranks: dict[int, tuple[float, float | None]]  # rank -> (wait s, transfer s or None: no call timed)
    bandwidth: dict[str, tuple[float, float]]  # collective -> (algbw, busbw) bytes/s, those with a timed call
    unmatched: int
    missing: list[int]
    clocks: dict[int, tuple[float, float]]  # rank -> (clock offset s, its error bound s)


def run_collectives(m: dict) -> RunCollectives | None:
    """The exported collective figures of a RunStepMetrics record (None: no collectives)."""
    if not (m["collectives_matched"] or m["unmatched_collectives"]):
        return None
    median = m["median_step_time_ns"]
    held = m["late_rank_held_ns"]
    return RunCollectives(
        -1 if m["late_rank"] is None else m["late_rank"], held / 1e9, held / median if median > 0 else 0.0,
        {r["rank"]: (r["wait_ns"] / 1e9, None if r["transfer_ns"] is None else r["transfer_ns"] / 1e9)
         for r in m["collective_ranks"]},
        {c["collective"]: (c["algbw_bytes_per_s"], c["busbw_bytes_per_s"])
         for c in m["by_collective"][:MAX_COLLECTIVE_NAMES] if c["transfer_ns"] is not None},
        len(m["unmatched_collectives"]), sorted({r for c in m["unmatched_collectives"] for r in c["missing"]}),
        {c["rank"]: (c["offset_ns"] / 1e9, c["error_ns"] / 1e9) for c in m["clock_offsets"]})


def longest_waits(c: RunCollectives, max_ranks: int | None) -> dict[int, tuple[float, float]]:
    """The ranks of ``c`` whose wait and transfer get series: the ``max_ranks`` (None: all)
    that waited longest, ties to the lower rank."""
    if max_ranks is None or len(c.ranks) <= max_ranks:
        return c.ranks
    return dict(sorted(heapq.nsmallest(max_ranks, c.ranks.items(), key=lambda kv: (-kv[1][0], kv[0]))))


def farthest_clocks(c: RunCollectives, max_ranks: int | None) -> dict[int, tuple[float, float]]:
    """The ranks of ``c`` whose clock offsets get series: the ``max_ranks`` (None: all)
    farthest from the run's clock, ties to the lower rank."""
    if max_ranks is None or len(c.clocks) <= max_ranks:
        return c.clocks
    return dict(sorted(heapq.nsmallest(max_ranks, c.clocks.items(), key=lambda kv: (-abs(kv[1][0]), kv[0]))))


def collective_lines(prefix: str, runs: list[tuple[str, RunCollectives | None]], esc: Callable[[str], str],
                     num: Callable[[float], str], max_ranks: int | None = None) -> list[str]:
    """The text-format lines of the collective series of ``runs`` [(run id, its figures or
    None)], wait and transfer for at most ``max_ranks`` ranks per run (None: every rank)."""
    p = prefix + "collective_"
    have = [(esc(run_id), c) for run_id, c in runs if c is not None]
    out: list[str] = []

    def family(name: str, doc: str, lines: Iterable[str]) -> None:
        out.append(f"# HELP {p}{name} {doc}\n# TYPE {p}{name} gauge\n")
        out.extend(lines)

    def per_run(name: str, doc: str, value: Callable[[RunCollectives], float]) -> None:
        family(name, doc, (f'{p}{name}{{run="{r}"}} {num(value(c))}\n' for r, c in have))

    def per_key(name: str, doc: str, label: str, items: Callable[[RunCollectives], Iterable]) -> None:
        family(name, doc, (f'{p}{name}{{run="{r}",{label}="{esc(str(k))}"}} {num(v)}\n'
                           for r, c in have for k, v in items(c)))

    per_key("wait_seconds", "time the rank waited in collectives for the last rank to arrive, latest step "
            "with collectives", "rank", lambda c: ((k, v[0]) for k, v in longest_waits(c, max_ranks).items()))
    per_key("transfer_seconds", "time the rank's collectives ran once every rank had arrived, latest step "
            "with collectives (no series for a rank that timed none of its calls)", "rank",
            lambda c: ((k, v[1]) for k, v in longest_waits(c, max_ranks).items() if v[1] is not None))
    per_key("algbw_bytes_per_second", "algorithm bandwidth (bytes / transfer time) by collective",
            "collective", lambda c: ((k, v[0]) for k, v in c.bandwidth.items()))
    per_key("busbw_bytes_per_second", "bus bandwidth (algbw x NCCL's factor) by collective",
            "collective", lambda c: ((k, v[1]) for k, v in c.bandwidth.items()))
    per_run("late_rank", "rank the others waited for most in the latest step with collectives (-1: none)",
            lambda c: c.late_rank)
    per_run("late_rank_held_seconds", "longest time one rank waited for the late rank in that step",
            lambda c: c.held_s)
    per_run("late_rank_held_ratio", "late_rank_held_seconds / median step time", lambda c: c.held_ratio)
    per_run("unmatched", "collective calls some rank of the group never made in that step", lambda c: c.unmatched)
    per_key("missing", "1 for each rank missing from an unmatched collective call of that step", "rank",
            lambda c: ((k, 1) for k in c.missing))
    p = prefix + "clock_"  # the families below: profstream_clock_*
    per_key("offset_seconds", "the rank's clock minus the run's clock (its reference rank's), learned from the "
            "ends of its collectives; ranks without one: no series", "rank",
            lambda c: ((k, v[0]) for k, v in farthest_clocks(c, max_ranks).items()))
    per_key("offset_error_seconds", "error bound of profstream_clock_offset_seconds: the true offset lies "
            "within it", "rank", lambda c: ((k, v[1]) for k, v in farthest_clocks(c, max_ranks).items()))
    return out
