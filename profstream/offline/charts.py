"""Inline SVG charts for the post-mortem report: no JavaScript library, no network.

Each function returns one ``<svg>`` element as text. Series are (label, xs, ys) with
numeric arrays; x is the step number. Charts carry ``data-chart`` and their series
``data-series`` attributes so that tests and the page's small script can find them.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import numpy as np

WIDTH, HEIGHT = 920, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 150, 16, 34
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")

Series = tuple[str, np.ndarray, np.ndarray]


def step_ranges(steps: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive step numbers as inclusive ranges (for ``shaded``)."""
    out: list[tuple[int, int]] = []
    for s in sorted(set(steps)):
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.1f}"
    return f"{v:.2g}"


class _Frame:
    """Scales from data to pixels, and the axes, grid and legend around a plot."""

    def __init__(self, x_lo: float, x_hi: float, y_lo: float, y_hi: float) -> None:
        if x_hi <= x_lo:
            x_hi = x_lo + 1
        if y_hi <= y_lo:
            y_hi = y_lo + 1
        self.x_lo, self.x_hi, self.y_lo, self.y_hi = x_lo, x_hi, y_lo, y_hi
        self.w = WIDTH - LEFT - RIGHT
        self.h = HEIGHT - TOP - BOTTOM

    def x(self, v) -> np.ndarray:
        return LEFT + (np.asarray(v, float) - self.x_lo) / (self.x_hi - self.x_lo) * self.w

    def y(self, v) -> np.ndarray:
        return TOP + self.h - (np.asarray(v, float) - self.y_lo) / (self.y_hi - self.y_lo) * self.h

    def axes(self, x_label: str, y_label: str) -> list[str]:
        out = []
        for t in _nice_ticks(self.y_lo, self.y_hi):
            py = float(self.y(t))
            out.append(f'<line x1="{LEFT}" x2="{LEFT + self.w}" y1="{py:.1f}" y2="{py:.1f}" class="grid"/>'
                       f'<text x="{LEFT - 6}" y="{py + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
        for t in _nice_ticks(self.x_lo, self.x_hi, 8):
            px = float(self.x(t))
            out.append(f'<text x="{px:.1f}" y="{TOP + self.h + 16}" text-anchor="middle">{_fmt(t)}</text>')
        out.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + self.h}" class="axis"/>'
                   f'<line x1="{LEFT}" x2="{LEFT + self.w}" y1="{TOP + self.h}" y2="{TOP + self.h}" class="axis"/>'
                   f'<text x="{LEFT + self.w / 2:.0f}" y="{HEIGHT - 4}" text-anchor="middle">{_esc(x_label)}</text>'
                   f'<text x="12" y="{TOP + self.h / 2:.0f}" text-anchor="middle" '
                   f'transform="rotate(-90 12 {TOP + self.h / 2:.0f})">{_esc(y_label)}</text>')
        return out

    def legend(self, labels: Sequence[str]) -> list[str]:
        out = []
        for i, label in enumerate(labels[:12]):
            y = TOP + 6 + i * 16
            out.append(f'<g class="legend" data-series="{_esc(label)}"><rect x="{WIDTH - RIGHT + 12}" y="{y}" '
                       f'width="10" height="10" fill="{PALETTE[i % len(PALETTE)]}"/>'
                       f'<text x="{WIDTH - RIGHT + 27}" y="{y + 9}">{_esc(label)}</text></g>')
        if len(labels) > 12:
            out.append(f'<text x="{WIDTH - RIGHT + 12}" y="{TOP + 6 + 12 * 16 + 9}">+{len(labels) - 12} more</text>')
        return out


def _svg(name: str, title: str, body: list[str], height: int = HEIGHT) -> str:
    return (f'<figure><figcaption>{_esc(title)}</figcaption><svg class="chart" data-chart="{_esc(name)}" '
            f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{_esc(title)}" '
            f'xmlns="http://www.w3.org/2000/svg"><title>{_esc(title)}</title>{"".join(body)}</svg></figure>')


def _empty(name: str, title: str) -> str:
    return _svg(name, title, [f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no data</text>'])


def _bands(frame: _Frame, shaded: Sequence[tuple[float, float]]) -> list[str]:
    out = []
    for lo, hi in shaded:
        x0, x1 = float(frame.x(lo - 0.5)), float(frame.x(hi + 0.5))
        x0, x1 = max(x0, LEFT), min(x1, LEFT + frame.w)
        out.append(f'<rect class="band" x="{x0:.1f}" y="{TOP}" width="{max(x1 - x0, 1):.1f}" height="{frame.h}"/>')
    return out


def _marks(frame: _Frame, marks: Sequence[tuple[float, str, str]]) -> list[str]:
    out, last_label_x = [], -1e9
    for step, label, colour in sorted(marks):
        px = float(frame.x(step))
        out.append(f'<line class="mark" data-mark="{_esc(label)}" x1="{px:.1f}" x2="{px:.1f}" y1="{TOP}" '
                   f'y2="{TOP + frame.h}" stroke="{colour}" stroke-dasharray="4 3"><title>{_esc(label)} '
                   f'(step {step:g})</title></line>')
        if px - last_label_x > 110:  # label a mark only where it does not overprint the previous one
            out.append(f'<text x="{px + 3:.1f}" y="{TOP + 10}" fill="{colour}">{_esc(label)}</text>')
            last_label_x = px
    return out


def line_chart(name: str, title: str, series: Sequence[Series], y_label: str, x_label: str = "step",
               shaded: Sequence[tuple[float, float]] = (), y_min: float | None = 0.0,
               marks: Sequence[tuple[float, str, str]] = ()) -> str:
    """Lines, one per series; ``shaded`` step ranges are drawn as bands behind them and
    ``marks`` (step, label, colour) as labelled vertical lines, e.g. alerts. A NaN value is
    a step not measured: the line breaks there (a point alone is a dot), never drawn at 0."""
    series = [(label, np.asarray(xs, float), np.asarray(ys, float)) for label, xs, ys in series if len(xs)]
    if not series:
        return _empty(name, title)
    x_all = np.concatenate([s[1] for s in series])
    y_all = np.concatenate([s[2] for s in series])
    y_all = y_all[np.isfinite(y_all)]
    y_hi = float(y_all.max()) * 1.05 if len(y_all) else 1.0
    if y_min is not None:
        y_lo = y_min
    else:  # a margin below the lowest line so that it does not sit on the axis
        lo = float(y_all.min()) if len(y_all) else 0.0
        y_lo = lo - max(0.05 * (y_hi - lo), 0.01 * abs(lo))
    frame = _Frame(float(x_all.min()), float(x_all.max()), y_lo, y_hi)
    body = _bands(frame, shaded) + frame.axes(x_label, y_label) + _marks(frame, marks)
    for i, (label, xs, ys) in enumerate(series):
        body.append(_line(frame, label, xs, ys, PALETTE[i % len(PALETTE)]))
    body += frame.legend([s[0] for s in series])
    return _svg(name, title, body)


def _line(frame: _Frame, label: str, xs: np.ndarray, ys: np.ndarray, colour: str) -> str:
    """One series: a polyline, or where values are missing (NaN) a group of the pieces
    between them, each a polyline or, alone, a dot."""
    ok = np.isfinite(ys)
    if ok.all():
        pts = " ".join(f"{px:.1f},{py:.1f}" for px, py in zip(frame.x(xs), frame.y(ys)))
        return (f'<polyline class="series" data-series="{_esc(label)}" fill="none" stroke-width="1.5" '
                f'stroke="{colour}" points="{pts}"/>')
    edges = np.flatnonzero(np.diff(np.concatenate(([False], ok, [False])).astype(np.int8)))
    pieces = []
    for lo, hi in zip(edges[::2], edges[1::2]):  # [lo, hi): a run of measured values
        px, py = frame.x(xs[lo:hi]), frame.y(ys[lo:hi])
        if hi - lo == 1:
            pieces.append(f'<circle cx="{px[0]:.1f}" cy="{py[0]:.1f}" r="2.5" fill="{colour}"/>')
        else:
            pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(px, py))
            pieces.append(f'<polyline fill="none" stroke-width="1.5" stroke="{colour}" points="{pts}"/>')
    return f'<g class="series" data-series="{_esc(label)}">{"".join(pieces)}</g>'


def stacked_chart(name: str, title: str, xs: np.ndarray, layers: Sequence[tuple[str, np.ndarray]],
                  y_label: str, x_label: str = "step") -> str:
    """Areas stacked from the bottom in the order given (e.g. data wait, fp+bp, tail)."""
    xs = np.asarray(xs, float)
    if not len(xs):
        return _empty(name, title)
    order = np.argsort(xs, kind="stable")
    xs = xs[order]
    tops = np.cumsum([np.asarray(v, float)[order] for _, v in layers], axis=0)
    frame = _Frame(float(xs.min()), float(xs.max()), 0.0, float(tops[-1].max()) * 1.05)
    body = frame.axes(x_label, y_label)
    below = np.zeros_like(xs)
    for i, ((label, _), top) in enumerate(zip(layers, tops)):
        upper = " ".join(f"{px:.1f},{py:.1f}" for px, py in zip(frame.x(xs), frame.y(top)))
        lower = " ".join(f"{px:.1f},{py:.1f}" for px, py in zip(frame.x(xs[::-1]), frame.y(below[::-1])))
        body.append(f'<polygon class="series" data-series="{_esc(label)}" fill="{PALETTE[i % len(PALETTE)]}" '
                    f'fill-opacity="0.75" stroke="none" points="{upper} {lower}"/>')
        below = top
    body += frame.legend([label for label, _ in layers])
    return _svg(name, title, body)


def bar_chart(name: str, title: str, bars: Sequence[tuple[str, float]], x_label: str) -> str:
    """Horizontal bars, largest first, labelled with their values."""
    if not bars:
        return _empty(name, title)
    height = TOP + BOTTOM + 22 * len(bars)
    top = max(v for _, v in bars) or 1.0
    label_w = 220
    w = WIDTH - label_w - 90
    body = []
    for i, (label, value) in enumerate(bars):
        y = TOP + i * 22
        bw = max(value / top * w, 1)
        body.append(f'<g class="series" data-series="{_esc(label)}"><text x="{label_w - 6}" y="{y + 14}" '
                    f'text-anchor="end">{_esc(label[:32])}</text><rect x="{label_w}" y="{y + 3}" width="{bw:.1f}" '
                    f'height="15" fill="{PALETTE[0]}"/><text x="{label_w + bw + 6:.1f}" y="{y + 14}">'
                    f'{_fmt(value)}</text></g>')
    body.append(f'<text x="{label_w + w / 2:.0f}" y="{height - 6}" text-anchor="middle">{_esc(x_label)}</text>')
    return _svg(name, title, body, height)


def heat_map(name: str, title: str, steps: np.ndarray, ranks: Sequence[int], values: np.ndarray,
             value_label: str) -> str:
    """Ranks (rows) × steps (columns), colour = value relative to the step's median rank."""
    if values.size == 0:
        return _empty(name, title)
    rows = len(ranks)
    cell_h = max(4, min(18, 200 // max(rows, 1)))
    height = TOP + BOTTOM + cell_h * rows
    frame_w = WIDTH - LEFT - RIGHT
    cell_w = frame_w / max(len(steps), 1)
    med = np.nanmedian(values, axis=0)
    rel = np.where(med > 0, values / np.where(med > 0, med, 1), 1.0)
    body = []
    for r, rank in enumerate(ranks):
        for c in range(len(steps)):
            v = rel[r, c]
            if not np.isfinite(v):
                continue
            heat = min(max((v - 1.0) / 0.5, 0.0), 1.0)  # 1.0x: white, >= 1.5x the median: full red
            colour = f"rgb(255,{int(255 - 200 * heat)},{int(255 - 200 * heat)})"
            body.append(f'<rect x="{LEFT + c * cell_w:.1f}" y="{TOP + r * cell_h}" width="{cell_w + 0.3:.1f}" '
                        f'height="{cell_h}" fill="{colour}"/>')
        body.append(f'<text x="{LEFT - 6}" y="{TOP + r * cell_h + cell_h - 2}" text-anchor="end" '
                    f'font-size="{min(cell_h, 11)}">{rank}</text>')
    body.append(f'<text x="{LEFT + frame_w / 2:.0f}" y="{height - 6}" text-anchor="middle">step '
                f'{int(steps[0])}–{int(steps[-1])}; {_esc(value_label)}: white = the step\'s median rank, '
                f'red = 1.5× it or more</text>')
    return _svg(name, title, [f'<g class="series" data-series="heat">{"".join(body)}</g>'], height)
