"""The exporter's throughput and MFU series (docs/metrics.md, "Throughput and MFU").

Per rank, from the latest step whose producer sent work figures (a step without them keeps
the values, as utilization does; a rank that never sent any has no series, never a 0):
tokens/s, samples/s, achieved FLOP/s, MFU and the peak it was measured against, counters of
tokens, samples and FLOPs, and the achieved FLOP/s per op category of the latest captured
step. Per run, from the RunStepMetrics of its latest step with work figures: the
throughputs summed over the ranks, the mean and lowest MFU and the rank with the lowest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# (metric without the prefix, help, WorkFigures field)
RANK_GAUGES = (
    ("tokens_per_second", "tokens / step time of the latest step with work figures", "tokens_per_s"),
    ("samples_per_second", "samples / step time of the latest step with work figures", "samples_per_s"),
    ("achieved_flops_per_second", "model FLOPs / step time of the latest step with FLOPs (achieved FLOP/s)",
     "flops_per_s"),
    ("mfu_ratio", "model FLOPs utilization of the latest step with FLOPs and a known peak: FLOPs / (step time "
     "x peak FLOP/s)", "mfu"),
    ("peak_flops_per_second", "dense peak FLOP/s of the rank's device for its compute dtype, MFU's denominator",
     "peak_flops"),
)
RANK_COUNTERS = (
    ("tokens_total", "tokens trained on, summed over the steps with work figures", "tokens"),
    ("samples_total", "samples trained on, summed over the steps with work figures", "samples"),
    ("model_flops_total", "model FLOPs, summed over the steps with FLOPs", "flops"),
)
# (metric, help, RunWorkFigures field)
RUN_GAUGES = (
    ("run_tokens_per_second", "tokens/s summed over the ranks of the run's latest step with work figures",
     "tokens_per_s"),
    ("run_samples_per_second", "samples/s summed over those ranks", "samples_per_s"),
    ("run_achieved_flops_per_second", "achieved FLOP/s summed over those ranks", "flops_per_s"),
    ("run_mfu_ratio", "mean MFU over the ranks of the run's latest step with MFU (MFURegression reads it)",
     "mean_mfu"),
    ("run_min_mfu_ratio", "lowest MFU among those ranks", "min_mfu"),
    ("run_min_mfu_rank", "rank with the lowest MFU", "min_mfu_rank"),
)


@dataclass(eq=False)
class RankWork:
    """What the exporter keeps of one rank's work figures."""

    gauges: dict[str, float] = field(default_factory=dict)  # WorkFigures field -> value of the latest step with it
    totals: dict[str, float] = field(default_factory=dict)  # tokens, samples, flops summed
    categories: dict[str, float] = field(default_factory=dict)  # op category -> achieved FLOP/s


def fold_work(into: RankWork | None, work: dict | None, newest: bool) -> RankWork | None:
    """Fold a StepMetrics ``work`` into a rank's (created at its first); ``newest``: the
    step is the rank's latest, whose values the gauges take."""
    if work is None:
        return into
    if into is None:
        into = RankWork()
    for _metric, _doc, key in RANK_COUNTERS:
        value = work[key]
        if value is not None:
            into.totals[key] = into.totals.get(key, 0) + value
    if newest:
        for _metric, _doc, key in RANK_GAUGES:
            if work[key] is not None:
                into.gauges[key] = work[key]
        for c in work["op_categories"]:
            if c["flops_per_s"] is not None:
                into.categories[c["category"]] = c["flops_per_s"]
    return into


def fold_run_work(into: dict[str, float] | None, work: dict | None) -> dict[str, float] | None:
    """A run's figures from the RunStepMetrics ``work`` of its latest step with them."""
    if work is None:
        return into
    return {key: work[key] for _metric, _doc, key in RUN_GAUGES if work[key] is not None}


def work_lines(prefix: str, ranks: list[tuple[Any, int, Any]], runs: list[tuple[str, Any]],
               num: Callable[[float], str]) -> list[str]:
    """The text-format lines of the work series of ``ranks`` [(run, rank, r)] (``r.labels``,
    ``r.work``: a RankWork or None) and of ``runs`` [(escaped run id, run)] (``run.work``)."""
    out: list[str] = []
    for metric, doc, key in RANK_GAUGES:
        full = prefix + metric
        out.append(f"# HELP {full} {doc}\n# TYPE {full} gauge\n")
        out.extend(f"{full}{{{r.labels}}} {num(r.work.gauges[key])}\n"
                   for _, _, r in ranks if r.work is not None and key in r.work.gauges)
    for metric, doc, key in RANK_COUNTERS:
        full = prefix + metric
        out.append(f"# HELP {full} {doc}\n# TYPE {full} counter\n")
        out.extend(f"{full}{{{r.labels}}} {num(r.work.totals[key])}\n"
                   for _, _, r in ranks if r.work is not None and key in r.work.totals)
    full = prefix + "op_category_flops_per_second"
    out.append(f"# HELP {full} achieved FLOP/s of an op category (matmul, attention, conv) in the latest step "
               f"whose ops were captured: its FLOPs / its ops' time\n# TYPE {full} gauge\n")
    out.extend(f'{full}{{{r.labels},category="{category}"}} {num(v)}\n'
               for _, _, r in ranks if r.work is not None for category, v in sorted(r.work.categories.items()))
    for metric, doc, key in RUN_GAUGES:
        full = prefix + metric
        out.append(f"# HELP {full} {doc}\n# TYPE {full} gauge\n")
        out.extend(f'{full}{{run="{run_id}"}} {num(run.work[key])}\n'
                   for run_id, run in runs if run.work is not None and key in run.work)
    return out
