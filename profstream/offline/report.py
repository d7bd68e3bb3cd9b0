"""The post-mortem report: one self-contained HTML file for a run in an archive.

``gather`` runs the processors offline over the run's archived raw topic (the same code
as the live processors and ``profstream replay --offline``); ``render`` turns what they
produced into a page with inline SVG charts (``charts``), a few lines of script and no
external resource, so it opens anywhere without a network. Every figure shown is one the
live pipeline computed or would have computed for the same events.
"""

from __future__ import annotations

import html
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path

import numpy as np

from profstream.config import check_name
from profstream.control.stacks import StacksAnswer
from profstream.offline import charts
from profstream.offline.archive import ArchiveError, Loss, Tally, archive_files
from profstream.offline.captures import Capture, archived_control, render_captures
from profstream.offline.replay import default_workers, replay_offline
from profstream.offline.report_advice import advice_section
from profstream.offline.report_collectives import communication_section
from profstream.offline.report_devices import device_counter_section
from profstream.offline.report_stacks import stacks_section
from profstream.offline.report_work import work_kpis, work_section
from profstream.processors.stream import StreamOptions

MAX_RANK_PANELS = 8  # per-rank stacked phase charts; the rest are in the tables


class ReportError(ValueError):
    """A report that cannot be made from what was given; the message says what to do."""


@dataclass
class ReportData:
    run_id: str
    archive: Path
    steps: list[dict] = field(default_factory=list)  # StepMetrics, sorted by (rank, step)
    run_steps: list[dict] = field(default_factory=list)  # RunStepMetrics, sorted by step
    alerts: list[dict] = field(default_factory=list)
    losses: list[Loss] = field(default_factory=list)
    messages: int = 0
    events: int = 0
    timeline_files: list[Path] = field(default_factory=list)
    timeline_dir: Path | None = None
    captures: list[Capture] = field(default_factory=list)  # capture requests of the run (archived control topic)
    ends: list[dict] = field(default_factory=list)  # RankEnd of each rank that ended normally
    stacks: StacksAnswer | None = None  # the answers to the run's latest stacks request (archived control topic)

    @cached_property
    def by_rank(self) -> dict[int, list[dict]]:
        """StepMetrics grouped by rank, ranks in order: grouped once, since every chart and
        table reads it (64 ranks x 10,000 steps would otherwise be scanned per rank per
        chart). Read it only once ``steps`` is complete, as ``gather`` returns it."""
        groups: dict[int, list[dict]] = {}
        for s in self.steps:
            groups.setdefault(s["rank"], []).append(s)
        return dict(sorted(groups.items()))

    def ranks(self) -> list[int]:
        return list(self.by_rank)

    def of_rank(self, rank: int) -> list[dict]:
        return self.by_rank.get(rank, [])


def gather(archive: Path | str, run_id: str, timeline_dir: Path | None = None, workers: int = 0,
           options: StreamOptions | None = None, progress: Callable[[Tally], None] | None = None,
           on_loss: Callable[[Loss], None] | None = None) -> ReportData:
    """Everything the report shows for ``run_id``, computed offline from ``archive``."""
    check_name(run_id, "run id")
    archive = Path(archive)
    files = archive_files(archive, "raw", None, run_id)
    if not files:
        runs = sorted({f.run_id for f in archive_files(archive, "raw")})
        raise ReportError(f"run {run_id!r} is not in {archive}: it holds "
                          f"{', '.join(runs) if runs else 'no archived run'}; choose one with --run")
    data = ReportData(run_id, archive)
    result = replay_offline(files, options, workers=workers or default_workers(), on_step=data.steps.append,
                            on_run_step=data.run_steps.append, on_alert=data.alerts.append, progress=progress,
                            on_loss=on_loss, on_rank_end=data.ends.append)
    data.steps.sort(key=lambda s: (s["rank"], s["step"]))
    data.run_steps.sort(key=lambda r: r["step"])
    data.alerts.sort(key=lambda a: (a["ts_ns"], -1 if a["rank"] is None else a["rank"]))  # rank: None = the run
    data.losses, data.messages, data.events = list(result.losses), result.messages, result.events
    data.captures, data.stacks = archived_control(archive, run_id, on_loss)
    if timeline_dir is not None:
        data.timeline_dir = Path(timeline_dir)
        root = Path(timeline_dir) / run_id
        data.timeline_files = sorted(root.glob("rank-*/*.json.gz")) if root.is_dir() else []
    return data


def _mean(values: list[float]) -> float:
    """The mean, NaN (shown as "—": not measured) of no value."""
    return float(np.mean(values)) if values else float("nan")


def measured(steps: list[dict]) -> list[dict]:
    """The steps whose op figures were measured (ops captured), StepMetrics v6's rule."""
    return [s for s in steps if s["utilization"] is not None]


def with_communication(steps: list[dict]) -> list[dict]:
    """Measured steps with communication: the ones an overlap ratio says something of."""
    return [s for s in steps if s["comm_ns"]]


def rank_summary(steps: list[dict]) -> dict[str, float | int]:
    """Per-rank figures of the summary table (times in ms). Utilization is the mean over the
    steps whose ops were captured and the overlap over those with communication; NaN
    (not measured) without one, never 0."""
    st = np.array([s["step_time_ns"] for s in steps], float)
    wait = np.array([s["data_wait_ns"] for s in steps], float)
    peaks = [s["memory"]["peak"] for s in steps if s.get("memory") and s["memory"]["peak"] >= 0]
    with_ops = measured(steps)
    return {
        "steps": len(steps),
        "mean_step_ms": float(st.mean() / 1e6),
        "p50_step_ms": float(np.percentile(st, 50) / 1e6),
        "p95_step_ms": float(np.percentile(st, 95) / 1e6),
        "data_wait_share": float(wait.sum() / st.sum()) if st.sum() > 0 else 0.0,
        "measured_steps": len(with_ops),
        "utilization": _mean([s["utilization"] for s in with_ops]),
        "overlap_ratio": _mean([s["overlap_ratio"] for s in with_communication(with_ops)]),
        "starved_steps": int(sum(bool(s["starved"]) for s in steps)),
        "peak_memory_mib": float(max(peaks) / 2**20) if peaks else float("nan"),
    }


DEVICE_KINDS = ("compute", "communication", "memcpy", "memset")


def kind_shares(steps: list[dict]) -> dict[str, float]:
    """The device's time by kind (summed op durations of compute, communication, memcpy,
    memset: HTA's kernel breakdown) as shares of their total over ``steps``."""
    totals = dict.fromkeys(DEVICE_KINDS, 0)
    for s in steps:
        for k in s["device_kinds"]:
            totals[k["kind"]] = totals.get(k["kind"], 0) + k["total_ns"]
    whole = sum(totals.values())
    return {k: (v / whole if whole else 0.0) for k, v in totals.items()}


def has_device_windows(steps: list[dict]) -> bool:
    return any(s["device_end_ns"] is not None for s in steps)


# -- rendering ----------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:960px;color:#222}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;margin:28px 0 6px;border-bottom:1px solid #ddd}
.sub{color:#666}table{border-collapse:collapse;margin:8px 0;font-variant-numeric:tabular-nums}
td,th{border-bottom:1px solid #eee;padding:3px 9px;text-align:right}th{background:#f6f6f6}
td:first-child,th:first-child{text-align:left;white-space:nowrap}.chart{width:100%;height:auto;margin:2px 0}
figure{margin:10px 0}figcaption{font-weight:600;color:#333}
.chart text{font-size:11px;fill:#444}.grid{stroke:#eee}.axis{stroke:#999}.band{fill:#d62728;fill-opacity:.12}
.legend{cursor:pointer}.legend.off{opacity:.35}.warn{color:#b00}.kpis{display:flex;gap:18px;flex-wrap:wrap}
.kpi{background:#f6f8fa;border-radius:6px;padding:8px 14px}.kpi b{display:block;font-size:20px}
"""

# Clicking a legend entry hides or shows its series (the only script on the page).
_JS = """
document.querySelectorAll('svg.chart').forEach(function (svg) {
  svg.querySelectorAll('.legend').forEach(function (entry) {
    entry.addEventListener('click', function () {
      var name = entry.getAttribute('data-series'), off = !entry.classList.contains('off');
      entry.classList.toggle('off', off);
      svg.querySelectorAll('.series').forEach(function (s) {
        if (s.getAttribute('data-series') === name) { s.style.display = off ? 'none' : ''; }
      });
    });
  });
});
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _ms(ns: float) -> float:
    return ns / 1e6


def _time(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _summary_table(data: ReportData) -> str:
    cols = (("steps", "steps", "{:d}"), ("mean_step_ms", "mean step (ms)", "{:.2f}"),
            ("p50_step_ms", "p50 (ms)", "{:.2f}"), ("p95_step_ms", "p95 (ms)", "{:.2f}"),
            ("data_wait_share", "data wait", "{:.1%}"), ("measured_steps", "steps with ops", "{:d}"),
            ("utilization", "utilization", "{:.1%}"),
            ("overlap_ratio", "comm overlap", "{:.1%}"), ("starved_steps", "starved steps", "{:d}"),
            ("peak_memory_mib", "peak memory (MiB)", "{:.0f}"))
    rows = []
    for rank in data.ranks():
        fig = rank_summary(data.of_rank(rank))
        cells = "".join(f'<td data-metric="{k}" data-value="{fig[k]!r}">'
                        f'{"—" if isinstance(fig[k], float) and np.isnan(fig[k]) else f.format(fig[k])}</td>'
                        for k, _, f in cols)
        rows.append(f'<tr data-rank="{rank}"><td>rank {rank}</td>{cells}</tr>')
    head = "".join(f"<th>{_e(t)}</th>" for _, t, _ in cols)
    return f'<table id="summary"><tr><th>rank</th>{head}</tr>{"".join(rows)}</table>'


def _per_rank_series(data: ReportData, value: Callable[[dict], float]) -> list[charts.Series]:
    out = []
    for rank in data.ranks():
        recs = data.of_rank(rank)
        out.append((f"rank {rank}", np.array([s["step"] for s in recs]), np.array([value(s) for s in recs], float)))
    return out


def _step_time_series(data: ReportData) -> list[charts.Series]:
    """Each rank's step time; with device windows also its host step time (E - S)."""
    series = _per_rank_series(data, lambda s: _ms(s["step_time_ns"]))
    if has_device_windows(data.steps):
        series += [(f"{label} host", xs, ys) for label, xs, ys in
                   _per_rank_series(data, lambda s: _ms(s["host_step_time_ns"]))]
    return series


def _starved_ranges(data: ReportData) -> list[tuple[int, int]]:
    return charts.step_ranges([s["step"] for s in data.steps if s["starved"]])


def _phase_charts(data: ReportData) -> str:
    parts = []
    for rank in data.ranks()[:MAX_RANK_PANELS]:
        recs = data.of_rank(rank)
        xs = np.array([s["step"] for s in recs])
        parts.append(charts.stacked_chart(
            f"phases-rank-{rank}", f"Step phases of rank {rank}", xs,
            [("data wait", np.array([_ms(s["data_wait_ns"]) for s in recs])),
             ("forward + backward", np.array([_ms(s["fp_bp_ns"]) for s in recs])),
             ("tail", np.array([_ms(s["tail_ns"]) for s in recs]))], "ms"))
    if len(data.ranks()) > MAX_RANK_PANELS:
        parts.append(f'<p class="sub">Phases of the first {MAX_RANK_PANELS} ranks; the summary table has all.</p>')
    return "".join(parts)


def _queue_chart(data: ReportData) -> str:
    names = sorted({q["queue"] for s in data.steps for q in s["queues"]})
    series = []
    for name in names:
        for rank in data.ranks():
            pts = [(s["step"], q["mean"]) for s in data.of_rank(rank) for q in s["queues"] if q["queue"] == name]
            if pts:
                xs, ys = zip(*pts)
                series.append((f"{name} r{rank}", np.array(xs), np.array(ys)))
    return charts.line_chart("queues", "Data queue size per step (mean), starved steps shaded", series,
                             "batches in queue", shaded=_starved_ranges(data))


def _op_types(data: ReportData, top: int = 15, field: str = "op_types", chart: str = "op-types",
              what: str = "op type") -> str:
    totals: Counter = Counter()
    for s in data.steps:
        for c in s[field]:
            totals[c["op_type"]] += c["total_ns"]
    ranks = max(len(data.ranks()), 1)
    bars = [(name, _ms(ns) / ranks) for name, ns in totals.most_common(top)]
    with_ops, total = len({s["step"] for s in measured(data.steps)}), len({s["step"] for s in data.steps})
    over = "the run" if with_ops == total else f"the steps with captured ops ({with_ops:,} of {total:,})"
    return charts.bar_chart(chart, f"Time per {what}, summed over {over}, mean per rank", bars,
                            "ms per rank over those steps")


def _device(data: ReportData) -> str:
    """Per rank: host and device step time, and the kernel breakdown (HTA's: the device's
    time by kind as a share of it), then the top kernels."""
    rows = []
    for rank in data.ranks():
        recs = data.of_rank(rank)
        dev = [s for s in recs if s["device_end_ns"] is not None]
        shares = kind_shares(recs)
        host_ms = float(np.mean([s["host_step_time_ns"] for s in recs])) / 1e6  # a float's repr in data-value
        dev_ms = float(np.mean([s["step_time_ns"] for s in dev])) / 1e6 if dev else float("nan")
        cells = [f'<td data-metric="host_step_ms" data-value="{host_ms!r}">{host_ms:.2f}</td>',
                 f'<td data-metric="device_step_ms" data-value="{dev_ms!r}">'
                 f'{"—" if np.isnan(dev_ms) else f"{dev_ms:.2f}"}</td>',
                 f'<td data-metric="device_steps" data-value="{len(dev)}">{len(dev)}</td>']
        cells += [f'<td data-metric="{k}_share" data-value="{v!r}">{v:.1%}</td>' for k, v in shares.items()]
        rows.append(f'<tr data-rank="{rank}"><td>rank {rank}</td>{"".join(cells)}</tr>')
    head = "".join(f"<th>{_e(t)}</th>" for t in ("host step (ms)", "device step (ms)", "device steps",
                                                 *(f"{k} share" for k in DEVICE_KINDS)))
    return (f'<table id="device"><tr><th>rank</th>{head}</tr>{"".join(rows)}</table>'
            '<p class="sub">Device steps: steps measured on the device\'s own window (their device ops carry '
            'their launch time). Shares: each kind\'s summed op time over the device\'s summed op time.</p>'
            + _op_types(data, field="kernel_types", chart="kernels", what="device kernel type"))


def _cross_rank(data: ReportData) -> str:
    if not data.run_steps:
        return '<p class="sub">No cross-rank figures (one rank, or no step reported by every rank).</p>'
    xs = np.array([r["step"] for r in data.run_steps])
    skew = charts.line_chart("skew", "Skew across ranks per step: (max − min) / median step time",
                             [("skew", xs, np.array([r["skew"] for r in data.run_steps]))], "skew")
    counts = Counter(r["straggler_rank"] for r in data.run_steps if r["skew"] > 0)
    rows = "".join(f'<tr data-straggler="{rank}"><td>rank {rank}</td><td>{n}</td><td>{n / len(xs):.0%}</td></tr>'
                   for rank, n in counts.most_common(10))
    table = (f'<table id="stragglers"><tr><th>slowest rank</th><th>steps</th><th>share of steps</th></tr>'
             f'{rows}</table>')
    ranks = data.ranks()
    steps = np.array(sorted({s["step"] for s in data.steps}))
    index = {st: i for i, st in enumerate(steps)}
    grid = np.full((len(ranks), len(steps)), np.nan)
    for r, rank in enumerate(ranks):
        for s in data.of_rank(rank):
            grid[r, index[s["step"]]] = s["step_time_ns"]
    heat = charts.heat_map("rank-heat", "Step time per rank and step", steps, ranks, grid, "step time")
    return skew + table + heat


def _utilization_kpi(data: ReportData) -> tuple[str, str]:
    """(value, label) of the headline utilization: the mean over the steps whose ops were
    captured, saying how many; else the device counters' GPU utilization, named as such;
    else "not measured". Never 0 for what was not measured."""
    with_ops = measured(data.steps)
    if with_ops:
        label = "utilization" if len(with_ops) == len(data.steps) else \
            f"utilization (of the {len({s['step'] for s in with_ops}):,} of {len({s['step'] for s in data.steps}):,} " \
            "steps with ops captured)"
        return f"{np.mean([s['utilization'] for s in with_ops]):.1%}", label
    gpu = [f["gpu_util"] for s in data.steps for f in s.get("devices") or () if f["gpu_util"] is not None]
    if gpu:
        return f"{np.mean(gpu):.1%}", "GPU utilization (NVML; no op captured)"
    return "not measured", "utilization (no op captured)"


def _op_figure(key: str, scale: float = 100.0, only: Callable[[dict], bool] = lambda s: True
               ) -> Callable[[dict], float]:
    """A step's op figure for a chart: NaN (no point) where it was not measured."""
    return lambda s: scale * s[key] if s[key] is not None and only(s) else float("nan")


def _alert_marks(data: ReportData) -> list[tuple[float, str, str]]:
    """One mark per (step, alert, state), however many ranks it fired on."""
    colour = {"firing": "#d62728", "resolved": "#2ca02c"}
    return sorted({(a["step"], f'{a["name"]} {a["state"]}', colour.get(a["state"], "#7f7f7f"))
                   for a in data.alerts})


def _alerts(data: ReportData) -> str:
    if not data.alerts:
        return '<p id="alerts">No alert fired.</p>'
    rows = "".join(f'<tr data-alert="{_e(a["name"])}" data-state="{_e(a["state"])}"><td>{_e(a["name"])}</td>'
                   f'<td>{_e(a["state"])}</td><td>{"all" if a["rank"] is None else a["rank"]}</td><td>{a["step"]}</td>'
                   f'<td style="white-space:nowrap">{_time(a["ts_ns"])}</td>'
                   f'<td style="text-align:left">{_e(a["summary"])}</td></tr>' for a in data.alerts)
    return (f'<table id="alerts"><tr><th>alert</th><th>state</th><th>rank</th><th>step</th><th>time</th>'
            f'<th style="text-align:left">summary</th></tr>{rows}</table>')


def _ending(data: ReportData) -> str:
    """Whether the ranks ended normally (their Monitors closed), as the RunSilent alert sees it."""
    ended = {e["rank"] for e in data.ends}
    silent = [r for r in data.ranks() if r not in ended]
    if not silent:
        return '<p class="sub" id="ending">Every rank ended normally (its Monitor closed after its last step).</p>'
    ranks = ", ".join(map(str, silent[:20])) + (" ..." if len(silent) > 20 else "")
    return (f'<p class="warn" id="ending">Rank{"s" if len(silent) > 1 else ""} {ranks} did not say '
            f'{"they" if len(silent) > 1 else "it"} ended (no end mark): killed, hung, or exited on an error '
            '(or a Monitor older than the end mark).</p>')


def _timelines(data: ReportData, out_dir: Path) -> str:
    if not data.timeline_files:
        return ('<p class="sub">No timeline files given (<code>--timeline-dir</code>, written by '
                '<code>profstream sink timeline</code>).</p>')
    items = "".join(f'<li><a href="{_e(Path(os.path.relpath(p, out_dir)).as_posix())}">'
                    f'{_e(p.parent.name)}/{_e(p.name)}</a></li>' for p in data.timeline_files)
    return (f'<p>Open them in the Perfetto UI (ui.perfetto.dev) or chrome://tracing; '
            f'the links are relative to this page.</p><ul id="timelines">{items}</ul>')


def render(data: ReportData, out_path: Path) -> str:
    """The report page for ``data``, with links relative to ``out_path``'s directory."""
    title = f"profstream post-mortem: {data.run_id}"
    if not data.steps:
        body = ('<p class="warn">No step of this run could be computed from the archive.</p>'  # a run hung at once
                + ("<h2>Stacks</h2>" + stacks_section(data.stacks, data.timeline_dir, data.run_id, out_path.parent)
                   if data.stacks is not None else ""))
    else:
        start = min(s["start_ns"] for s in data.steps)
        end = max(s["end_ns"] for s in data.steps)
        fired = sum(a["state"] == "firing" for a in data.alerts)
        st = np.array([s["step_time_ns"] for s in data.steps], float)
        kpis = [("ranks", len(data.ranks())), ("steps", len({s["step"] for s in data.steps})),
                ("mean step", f"{st.mean() / 1e6:.1f} ms"),
                ("data wait", f"{sum(s['data_wait_ns'] for s in data.steps) / st.sum():.1%}"),
                ("utilization", *_utilization_kpi(data)),
                *work_kpis(data.by_rank),
                ("starved steps", len({s["step"] for s in data.steps if s["starved"]})), ("alerts fired", fired)]
        kpi_html = "".join(f'<div class="kpi" data-kpi="{_e(k)}"><b>{_e(v)}</b>{_e(label[0] if label else k)}</div>'
                           for k, v, *label in kpis)
        losses = "".join(f'<li class="warn">{_e(loss)}</li>' for loss in data.losses)
        body = "".join([
            f'<p class="sub">{_time(start)} – {_time(end)}; {data.messages:,} raw messages, {data.events:,} op '
            f'events from <code>{_e(data.archive)}</code></p>',
            f'<div class="kpis">{kpi_html}</div>', _ending(data),
            f'<h2>Lost while reading the archive</h2><ul id="losses">{losses}</ul>' if losses else "",
            "<h2>Per rank</h2>", _summary_table(data),
            "<h2>Step time</h2>",
            charts.line_chart("step-time", "Step time per rank", _step_time_series(data), "ms",
                              shaded=_starved_ranges(data), marks=_alert_marks(data)),
            '<p class="sub">Shaded: steps on which a rank was starved for data. Dashed: alerts firing (red) '
            'and resolved (green), listed under Alerts.</p>',
            "<h2>Step phases</h2>", _phase_charts(data),
            *(("<h2>Throughput and MFU</h2>", section) if (section := work_section(data.by_rank)) else ()),
            "<h2>Utilization and overlap</h2>",
            charts.line_chart("utilization", "Device utilization per rank (steps with captured ops)",
                              _per_rank_series(data, _op_figure("utilization")), "% of step time"),
            charts.line_chart("overlap", "Communication overlapped by compute (steps with communication)",
                              _per_rank_series(data, _op_figure("overlap_ratio", only=lambda s: bool(s["comm_ns"]))),
                              "% of communication"),
            '<p class="sub">Utilization and overlap come from the ops of a step: steps whose ops were not '
            'captured (op capture off, or between <code>every_n_steps</code> captures) have no point, not 0.</p>',
            "<h2>Memory</h2>",
            charts.line_chart("memory", "Peak memory per step", _per_rank_series(
                data, lambda s: s["memory"]["peak"] / 2**20 if s.get("memory") and s["memory"]["peak"] >= 0
                else float("nan")), "MiB", y_min=None),
            "<h2>Data queue</h2>", _queue_chart(data),
            *(("<h2>Host, data loader and advice</h2>", section) if (section := advice_section(data.by_rank)) else ()),
            *(("<h2>Device counters</h2>", section) if (section := device_counter_section(data.steps)) else ()),
            *(("<h2>Device: kernel breakdown</h2>", _device(data), "<h2>Host op types</h2>")
              if has_device_windows(data.steps) else ("<h2>Op types</h2>",)),
            _op_types(data),
            "<h2>Across ranks</h2>", _cross_rank(data),
            "<h2>Communication across ranks</h2>", communication_section(data.run_steps),
            "<h2>Alerts</h2>", _alerts(data),
            "<h2>Stacks</h2>", stacks_section(data.stacks, data.timeline_dir, data.run_id, out_path.parent),
            "<h2>Captures</h2>", render_captures(data.captures, data.by_rank, data.timeline_dir, out_path.parent),
            "<h2>Timelines</h2>", _timelines(data, out_path.parent),
        ])
    made = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head>'
            f'<body><h1>{_e(title)}</h1><p class="sub">made {made} by profstream report</p>{body}'
            f'<script>{_JS}</script></body></html>\n')


def write_report(data: ReportData, out_path: Path | str) -> Path:
    """Write the page atomically (a temporary name, then a rename)."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        tmp.write_text(render(data, out_path), encoding="utf-8")
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


__all__ = ["ArchiveError", "ReportData", "ReportError", "gather", "has_device_windows", "kind_shares", "rank_summary",
           "render", "write_report"]
