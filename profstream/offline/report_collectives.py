"""The report's communication section: collectives matched across ranks (RunStepMetrics v2)
and the ranks' clock offsets they were compared with (v4)."""

from __future__ import annotations

from collections import Counter, defaultdict
from html import escape

import numpy as np

from profstream.offline import charts


def communication_section(run_steps: list[dict]) -> str:
    """Wait per rank per step, the late ranks, bandwidth by collective and unmatched calls;
    a line saying so when no step had collectives."""
    steps = [r for r in run_steps if r.get("collectives_matched") or r.get("unmatched_collectives")]
    if not steps:
        return '<p class="sub">No collective calls (a single rank, or a producer without collective ' \
               'attributes).</p>'
    waits: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for r in steps:
        for rank in r["collective_ranks"]:
            waits[rank["rank"]].append((r["step"], rank["wait_ns"] / 1e6))
    series = [(f"rank {rank}", np.array([s for s, _ in v]), np.array([w for _, w in v]))
              for rank, v in sorted(waits.items())]
    chart = charts.line_chart("collective-wait", "Time each rank waited in collectives for the last rank", series,
                              "ms")
    late = Counter(r["late_rank"] for r in steps if r["late_rank"] is not None)
    held = defaultdict(list)
    for r in steps:
        if r["late_rank"] is not None:
            held[r["late_rank"]].append(r["late_rank_held_ns"] / 1e6)
    late_rows = "".join(f'<tr data-late="{rank}"><td>rank {rank}</td><td>{n}</td><td>{n / len(steps):.0%}</td>'
                        f'<td>{np.median(held[rank]):.1f}</td></tr>' for rank, n in late.most_common(10))
    late_table = ('<table id="late-ranks"><tr><th>late rank</th><th>steps</th><th>share of steps</th>'
                  f'<th>median held (ms)</th></tr>{late_rows}</table>')
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0, 0.0, 0])
    for r in steps:
        for c in r["by_collective"]:
            t = totals[c["collective"]]
            t[0] += c["calls"]
            t[1] += c["bytes"]
            if c["transfer_ns"] is not None:  # None: no call of it timed (no ends recorded): no bandwidth
                t[2] += c["transfer_ns"]
                t[3] += c["busbw_bytes_per_s"] * c["transfer_ns"]  # transfer-weighted
                t[4] += c["bytes"]

    def per_s(nbytes: float, transfer_ns: float) -> str:
        return f"{nbytes / transfer_ns * 1e9 / 2**20:.1f}" if transfer_ns else "—"

    bw_rows = "".join(
        f'<tr data-collective="{escape(name)}"><td>{escape(name)}</td><td>{int(t[0])}</td>'
        f'<td>{t[1] / 2**20:.1f}</td><td>{per_s(t[4], t[2])}</td>'
        f'<td>{per_s(t[3] / 1e9, t[2])}</td></tr>' for name, t in sorted(totals.items()))
    bw_table = ('<table id="collective-bandwidth"><tr><th>collective</th><th>calls</th><th>MiB (over ranks)</th>'
                f'<th>algbw MiB/s</th><th>busbw MiB/s</th></tr>{bw_rows}</table>')
    unmatched = [(r["step"], u) for r in steps for u in r["unmatched_collectives"]]
    un_rows = "".join(f'<tr><td>{step}</td><td>{escape(u["collective"])}</td><td>{escape(u["group"])}</td>'
                      f'<td>{u["seq"]}</td><td>{u["arrived"]}</td><td>{u["missing"] or "?"}</td></tr>'
                      for step, u in unmatched[:50])
    un_table = ('<table id="unmatched-collectives"><tr><th>step</th><th>collective</th><th>group</th><th>seq</th>'
                f'<th>arrived</th><th>missing</th></tr>{un_rows}</table>' if unmatched
                else '<p class="sub" id="unmatched-collectives">Every collective call was matched on all ranks.</p>')
    return chart + late_table + bw_table + un_table + clocks_table(steps)


def clocks_table(steps: list[dict]) -> str:
    """Each rank's clock offset against the run's as of the newest step that had offsets
    (with its error bound) and how far it moved over the run (drift)."""
    first: dict[int, int] = {}
    last: dict[int, dict] = {}
    for r in steps:
        for c in r.get("clock_offsets", ()):
            first.setdefault(c["rank"], c["offset_ns"])
            last[c["rank"]] = c
    if not last:
        return ('<p class="sub" id="clock-offsets">No clock offsets (no all_reduce-like call matched across ranks, '
                'or records from before them): waits compare each rank\'s own clock.</p>')
    rows = "".join(f'<tr data-rank="{rank}"><td>rank {rank}</td><td>{c["offset_ns"] / 1e6:+.3f}</td>'
                   f'<td>{c["error_ns"] / 1e6:.3f}</td><td>{(c["offset_ns"] - first[rank]) / 1e6:+.3f}</td></tr>'
                   for rank, c in sorted(last.items()))
    return ('<table id="clock-offsets"><tr><th>rank</th><th>clock offset (ms)</th><th>± error (ms)</th>'
            f'<th>moved over the run (ms)</th></tr>{rows}</table>')
