"""The report's host and data-loader figures and the advice: per rank, each rule that spoke,
on how many steps, its latest line with the figures it read and the profilers' rule it
follows; per data-loader worker its seconds per batch (median and latest over the steps
that counted a batch of it); and per step the loader workers' busy share and the machine's
CPU (a step without readings has no point). Empty for a run with neither readings nor advice."""

from __future__ import annotations

import html

import numpy as np

from profstream.offline import charts


def advice_section(by_rank: dict[int, list[dict]]) -> str:
    """The section's HTML ("" when no step had readings or advice)."""
    if not any(s.get("resources") is not None or s.get("advice") for steps in by_rank.values() for s in steps):
        return ""
    rows = []
    for rank, steps in sorted(by_rank.items()):
        latest: dict[str, tuple[int, dict]] = {}
        counts: dict[str, int] = {}
        for s in steps:
            for a in s.get("advice") or ():
                counts[a["rule"]] = counts.get(a["rule"], 0) + 1
                latest[a["rule"]] = (s["step"], a)
        for rule, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            step, a = latest[rule]
            figures = ", ".join(f"{html.escape(k)} {v:.3g}" for k, v in sorted(a["figures"].items()))
            rows.append(f'<tr data-rank="{rank}" data-rule="{html.escape(rule)}"><td>rank {rank}</td>'
                        f'<td>{html.escape(rule)}</td><td data-metric="advised_steps" data-value="{n}">{n}</td>'
                        f'<td>{step}</td><td style="text-align:left">{html.escape(a["text"])}<br>'
                        f'<span class="sub">{figures}; {html.escape(a["source"])}</span></td></tr>')
    table = ('<table id="advice"><tr><th>rank</th><th>rule</th><th>steps</th><th>latest</th>'
             f'<th style="text-align:left">what to do</th></tr>{"".join(rows)}</table>' if rows else
             '<p class="sub" id="advice">No advice: no starved step or long tail the figures explain.</p>')

    def series(key: str, scale: float = 100.0) -> list[charts.Series]:
        out = []
        for rank, steps in sorted(by_rank.items()):
            xs = np.array([s["step"] for s in steps])
            ys = np.array([(s["resources"] or {}).get(key) * scale
                           if s.get("resources") and s["resources"].get(key) is not None else np.nan for s in steps])
            if not np.isnan(ys).all():
                out.append((f"rank {rank}", xs, ys))
        return out

    busy = series("worker_runnable_mean")
    return "".join([
        table,
        _workers_table(by_rank),
        charts.line_chart("loader-busy", "Data-loader workers: share of the time they wanted a CPU (steps with "
                          "readings)", busy, "% of the time") if busy else "",
        charts.line_chart("host-cpu", "Machine CPU in the kernel (system) per step (steps with readings)",
                          series("cpu_system"), "% of all CPUs") if series("cpu_system") else "",
    ])


def _workers_table(by_rank: dict[int, list[dict]]) -> str:
    """Each worker's seconds per batch (StepMetrics v9 per_worker), per rank: the median and
    the latest over its steps with a batch counted ("" when no step had one)."""
    rows = []
    for rank, steps in sorted(by_rank.items()):
        seen: dict[int, list[tuple[int, float]]] = {}
        for s in steps:
            for w in (s.get("resources") or {}).get("per_worker") or ():
                if w["s_per_batch"] is not None:
                    seen.setdefault(w["worker"], []).append((s["step"], w["s_per_batch"]))
        for worker, values in sorted(seen.items()):
            median = float(np.median([v for _, v in values]))
            step, latest = values[-1]
            rows.append(f'<tr data-rank="{rank}" data-worker="{worker}"><td>rank {rank}</td><td>{worker}</td>'
                        f'<td>{len(values)}</td><td data-metric="s_per_batch_median" data-value="{median:.6g}">'
                        f'{median:.3g}</td><td data-metric="s_per_batch_latest" data-value="{latest:.6g}">'
                        f'{latest:.3g} (step {step})</td></tr>')
    if not rows:
        return ""
    return ('<table id="loader-workers"><tr><th>rank</th><th>worker</th><th>steps</th>'
            '<th>seconds per batch, median</th><th>latest</th></tr>' + "".join(rows) + "</table>")
