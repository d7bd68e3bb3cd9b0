"""The exporter at a thousand ranks: which ranks of a run keep series of their own, and the
per-run figures over all of its ranks that stand in for the others.

A run with more ranks than ``top_ranks`` keeps per-rank series only for its ``top_ranks``
slowest ranks: slowest by the mean step time of the rank's newest ``SLOW_WINDOW_STEPS``
steps (a short window, so that one noisy step does not swap ranks in and out of the set),
ties to the lower rank. The set is chosen again at every scrape from the figures held, so
a rank that leaves it leaves no series behind. Every run, whatever its size, also gets
``profstream_ranks_*{run, stat}``: the minimum, p50, p95 and maximum over all its ranks'
latest figures (interpolated as PromQL's ``quantile()``; the label is not ``quantile``,
which Prometheus keeps for summaries), and a histogram of its ranks' latest step times,
which Grafana draws as a heat map.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

DEFAULT_TOP_RANKS = 64  # a run of up to 64 ranks keeps every rank's series
SLOW_WINDOW_STEPS = 5  # newest steps of a rank whose mean step time ranks it
STATS = ((0.0, "min"), (0.5, "p50"), (0.95, "p95"), (1.0, "max"))  # (quantile, label value)
PHASES = ("data_wait", "fp_bp", "tail")

def _measured(value: float | None) -> tuple[tuple[str, float], ...]:
    """A figure of a rank if it was measured: a rank without one counts in no quantile."""
    return () if value is None else (("", value),)


# (metric without prefix and "ranks_", help, extra label, (label value, figure) of a rank)
_FIGURES: tuple[tuple[str, str, str, Callable[[Any], Iterable[tuple[str, float]]]], ...] = (
    ("step_duration_seconds", "duration of the latest step", "",
     lambda r: (("", r.step_s),)),
    ("host_step_duration_seconds", "host duration (end - start mark) of the latest step", "",
     lambda r: (("", r.host_step_s),)),
    ("step_phase_seconds", "phases of the latest step (data_wait, fp_bp, tail)", "phase",
     lambda r: zip(PHASES, r.phases)),
    ("device_utilization_ratio", "compute time / step time of the latest step with captured ops (ranks with "
     "one)", "", lambda r: _measured(r.utilization)),
    ("comm_overlap_ratio", "communication overlapped by compute / communication time of the latest step with "
     "captured ops (ranks with one)", "", lambda r: _measured(r.overlap_ratio)),
    ("idle_ratio", "time with neither compute nor communication / step time of the latest step with captured "
     "ops (ranks with one)", "", lambda r: _measured(r.idle_ratio)),
    ("tokens_per_second", "tokens / step time of the latest step with work figures (ranks with one)", "",
     lambda r: _measured(r.work.gauges.get("tokens_per_s") if r.work is not None else None)),
    ("mfu_ratio", "model FLOPs utilization of the latest step with one (ranks with one)", "",
     lambda r: _measured(r.work.gauges.get("mfu") if r.work is not None else None)),
    ("memory_bytes", "device memory of the latest step with samples, by kind (ranks that report the kind)",
     "kind", lambda r: r.memory),
    ("last_step", "number of the latest step", "",
     lambda r: (("", r.last_step),)),
    ("last_step_timestamp_seconds", "end of the latest step, Unix time (producer clock)", "",
     lambda r: (("", r.end_s),)),
)


def parse_top_ranks(text: str) -> int | None:
    """The value of ``--top-ranks``: "all" (None: every rank keeps its series) or a whole
    number of ranks >= 1. Raises ``ValueError`` with a one-line message saying what to give."""
    if text.strip().lower() == "all":
        return None
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"--top-ranks {text!r}: give a whole number of ranks >= 1 (each run's slowest ranks "
                         f"keep per-rank series; default {DEFAULT_TOP_RANKS}) or 'all'")
    return k


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``ordered`` (sorted, not empty) as PromQL's ``quantile()``
    computes it: linear interpolation at position q * (n - 1)."""
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    weight = pos - lo
    return ordered[lo] * (1 - weight) + ordered[hi] * weight


def window_step_s(r: Any) -> float:
    """Mean step time of the rank's newest steps (``r.recent``), what ranks it as slow."""
    return sum(r.recent) / len(r.recent) if r.recent else r.step_s


def slowest_ranks(ranks: dict[int, Any], top_ranks: int | None) -> dict[int, Any]:
    """The ranks that keep series of their own: all of them when there are at most
    ``top_ranks`` (or it is None), else the ``top_ranks`` slowest by ``window_step_s``."""
    if top_ranks is None or len(ranks) <= top_ranks:
        return ranks
    chosen = heapq.nsmallest(top_ranks, ranks.items(), key=lambda kv: (-window_step_s(kv[1]), kv[0]))
    return dict(sorted(chosen))


def summary_lines(prefix: str, runs: Iterable[tuple[str, dict[int, Any], int]], num: Callable[[float], str],
                  buckets: Sequence[float], les: Sequence[str]) -> list[str]:
    """The text-format lines of the per-run summaries over ranks of ``runs`` [(escaped run
    id, its ranks, how many of them keep series)]; ``buckets`` are the step-time bounds and
    ``les`` their ``le`` label values (+Inf last)."""
    runs = list(runs)
    p = prefix + "ranks_"
    out: list[str] = []
    for name, doc, label, figures in _FIGURES:
        out.append(f"# HELP {p}{name} {doc}, across the run's ranks: min, p50, p95, max\n"
                   f"# TYPE {p}{name} gauge\n")
        for run_id, ranks, _ in runs:
            by_label: dict[str, list[float]] = {}
            for r in ranks.values():
                for key, value in figures(r):
                    by_label.setdefault(key, []).append(value)
            for key, values in by_label.items():
                values.sort()
                extra = f',{label}="{key}"' if label else ""
                out.extend(f'{p}{name}{{run="{run_id}"{extra},stat="{stat}"}} {num(quantile(values, q))}\n'
                           for q, stat in STATS)
    name = p + "step_duration_seconds_hist"
    out.append(f"# HELP {name} the run's ranks by the duration of their latest step, at the scrape (buckets go "
               f"down as well as up: never rate() it)\n# TYPE {name} histogram\n")
    for run_id, ranks, _ in runs:
        counts = [0] * (len(buckets) + 1)
        for r in ranks.values():
            counts[bisect.bisect_left(buckets, r.step_s)] += 1
        out.extend(f'{name}_bucket{{run="{run_id}",le="{le}"}} {n}\n'
                   for le, n in zip(les, itertools.accumulate(counts)))
        out.append(f'{name}_sum{{run="{run_id}"}} {num(sum(r.step_s for r in ranks.values()))}\n'
                   f'{name}_count{{run="{run_id}"}} {len(ranks)}\n')
    for name, doc, value in (
            ("held", "ranks of the run the exporter holds figures for", lambda ranks, kept: len(ranks)),
            ("with_series", "ranks of the run with per-rank series (the slowest, --top-ranks)",
             lambda ranks, kept: kept)):
        out.append(f"# HELP {p}{name} {doc}\n# TYPE {p}{name} gauge\n")
        out.extend(f'{p}{name}{{run="{run_id}"}} {value(ranks, kept)}\n' for run_id, ranks, kept in runs)
    return out
