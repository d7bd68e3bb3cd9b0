"""The report's throughput and MFU: the headline figures, a table per rank and charts per
step (StepMetrics ``work``; docs/figures.md, "Throughput and MFU").

Over the run a rank's tokens/s is its tokens over the summed time of the steps that had
them, its achieved FLOP/s its FLOPs over the time of the steps with FLOPs, its MFU that over
the peak (steps with a known peak); the run's throughput sums the ranks', its MFU is the
ranks' mean. A run whose producers sent no work figures has none of this: no 0.
"""

from __future__ import annotations

import html
from collections import Counter

import numpy as np

from profstream.offline import charts


def with_work(steps: list[dict]) -> list[dict]:
    return [s for s in steps if s.get("work") is not None]


def _rate(steps: list[dict], key: str) -> float:
    """Σ key / Σ step time over the steps that have it (NaN: none)."""
    had = [s for s in steps if s["work"][key] is not None]
    seconds = sum(s["step_time_ns"] for s in had) / 1e9
    return sum(s["work"][key] for s in had) / seconds if had and seconds > 0 else float("nan")


def rank_work(steps: list[dict]) -> dict[str, float | int | str]:
    """One rank's figures over the run (see the module docstring)."""
    work = with_work(steps)
    peaked = [s for s in work if s["work"]["flops"] is not None and s["work"]["peak_flops"] is not None]
    flops_s = sum(s["step_time_ns"] for s in peaked) / 1e9
    mfu = (sum(s["work"]["flops"] / s["work"]["peak_flops"] for s in peaked) / flops_s
           if peaked and flops_s > 0 else float("nan"))
    sources = Counter(s["work"]["flops_source"] for s in work if s["work"]["flops_source"])
    peaks = sorted({s["work"]["peak_flops"] for s in peaked})
    return {"work_steps": len(work), "tokens_per_s": _rate(work, "tokens"), "samples_per_s": _rate(work, "samples"),
            "tflops": _rate(work, "flops") / 1e12, "mfu": mfu,
            "flops_source": ", ".join(f"{k} ({n})" for k, n in sources.most_common()) or "—",
            "peak_tflops": peaks[-1] / 1e12 if peaks else float("nan")}


def work_kpis(by_rank: dict[int, list[dict]]) -> list[tuple[str, str, str]]:
    """(key, value, label) of the headline: the run's tokens/s and mean MFU, where known."""
    figs = [rank_work(steps) for steps in by_rank.values() if with_work(steps)]
    if not figs:
        return []
    out = []
    tokens = [f["tokens_per_s"] for f in figs if not np.isnan(f["tokens_per_s"])]
    if tokens:
        out.append(("tokens/s", f"{sum(tokens):,.0f}", "tokens/s (sum of ranks)"))
    mfus = [f["mfu"] for f in figs if not np.isnan(f["mfu"])]
    if mfus:
        out.append(("MFU", f"{np.mean(mfus):.1%}", "MFU (mean of ranks)"))
    return out


_COLUMNS = (("work_steps", "steps with work", "{:d}"), ("tokens_per_s", "tokens/s", "{:,.0f}"),
            ("samples_per_s", "samples/s", "{:,.1f}"), ("tflops", "achieved TFLOP/s", "{:,.2f}"),
            ("mfu", "MFU", "{:.1%}"), ("peak_tflops", "peak TFLOP/s", "{:,.1f}"))


def work_section(by_rank: dict[int, list[dict]]) -> str:
    """The section's HTML ("" when no step had work figures)."""
    ranks = [r for r, steps in sorted(by_rank.items()) if with_work(steps)]
    if not ranks:
        return ""
    rows = []
    for rank in ranks:
        fig = rank_work(by_rank[rank])
        cells = "".join(f'<td data-metric="{k}" data-value="{fig[k]!r}">'
                        f'{"—" if isinstance(fig[k], float) and np.isnan(fig[k]) else f.format(fig[k])}</td>'
                        for k, _, f in _COLUMNS)
        rows.append(f'<tr data-rank="{rank}"><td>rank {rank}</td>{cells}'
                    f'<td style="text-align:left">{html.escape(str(fig["flops_source"]))}</td></tr>')
    head = "".join(f"<th>{html.escape(t)}</th>" for _, t, _ in _COLUMNS)
    table = (f'<table id="work"><tr><th>rank</th>{head}<th style="text-align:left">FLOPs from (steps)</th></tr>'
             f'{"".join(rows)}</table>')

    def series(value) -> list[charts.Series]:
        out = []
        for rank in ranks:
            recs = by_rank[rank]
            out.append((f"rank {rank}", np.array([s["step"] for s in recs]),
                        np.array([value(s["work"]) if s.get("work") is not None else np.nan for s in recs], float)))
        return out

    def known(key: str, scale: float = 1.0):
        return lambda w: w[key] * scale if w[key] is not None else np.nan

    categories: dict[str, list[float]] = {}
    for rank in ranks:
        for s in with_work(by_rank[rank]):
            for c in s["work"]["op_categories"]:
                if c["flops_per_s"] is not None:
                    categories.setdefault(c["category"], []).append(c["flops_per_s"] / 1e12)
    bars = sorted(((name, float(np.mean(v))) for name, v in categories.items()), key=lambda b: -b[1])
    return "".join([
        table,
        '<p class="sub">Over the run: a rank\'s tokens over the summed time of its steps with tokens, its FLOPs '
        'over that of its steps with FLOPs; MFU divides by the device\'s dense peak (steps with a known peak). '
        'A step without work figures has no point in the charts, never 0.</p>',
        charts.line_chart("tokens", "Tokens per second per rank", series(known("tokens_per_s")), "tokens/s"),
        charts.line_chart("mfu", "Model FLOPs utilization per rank", series(known("mfu", 100.0)), "% of peak"),
        charts.bar_chart("op-categories", "Achieved TFLOP/s by op category, mean over the captured steps", bars,
                         "TFLOP/s") if bars else "",
    ])
