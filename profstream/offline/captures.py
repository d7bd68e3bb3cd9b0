"""The report's Captures section: the run's capture requests, from the archived control
topic, and for each captured window its op types beside the run's baseline (and, from
the same records, the run's latest stacks: ``report_stacks.py``).

The baseline of a captured window on a rank is that rank's steps with ops before the
window and outside every requested window (the steps of the capture schedule, or an
earlier capture); the comparison is time per step per op type, before and during.
"""

from __future__ import annotations

import html
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from profstream.control.records import (
    FINISHED,
    OPS,
    REQUEST,
    decode_control,
    describe_request,
    request_from,
    who_asked,
)
from profstream.control.stacks import StacksAnswer, latest_answer
from profstream.offline.archive import Loss, records, select_files
from profstream.offline.archive import finished_files as archived_files
from profstream.schema.codec import DecodeError

TOP_OP_TYPES = 10


@dataclass
class Capture:
    """One request of the run and what each rank answered."""

    request: dict
    statuses: dict[int | None, dict] = field(default_factory=dict)  # rank (None: a service) -> latest status

    def windows(self) -> dict[int, tuple[int, int]]:
        """rank -> (first, last) captured step, of the ranks that finished."""
        return {r: (s["first_step"], s["last_step"]) for r, s in sorted(self.statuses.items(), key=lambda i: i[0] or 0)
                if r is not None and s["state"] == FINISHED}


def archived_captures(archive: Path, run_id: str, on_loss=None) -> list[Capture]:
    """The capture requests of ``run_id`` (``archived_control``'s first part)."""
    return archived_control(archive, run_id, on_loss)[0]


def archived_control(archive: Path, run_id: str, on_loss=None) -> tuple[list[Capture], StacksAnswer | None]:
    """The capture requests of ``run_id`` in the archive's request topics (each with its
    authenticated requester) and control topic (statuses, and the requests of older
    clients), oldest first; and the answers to the run's latest stacks request, merged
    (none of either when they are not archived: `profstream sink archive --topics
    raw,steps,control,requests`)."""
    every = archived_files(archive)
    files = select_files(every, "control", None, run_id, archive, required=False)
    prefixes = {f.topic[:-len("control")] + "requests." for f in files}
    files += [f for f in every if f.run_id == run_id and any(
        f.topic.startswith(p) and len(f.topic) > len(p) for p in prefixes)]
    by_id: dict[str, Capture] = {}
    statuses = []
    losses: list[Loss] = []
    by_topic: dict[str, list] = {}
    for f in files:
        by_topic.setdefault(f.topic, []).append(f)
    every_record = (rec for group in by_topic.values() for rec in records(group, on_loss or losses.append))
    for rec in every_record:  # each topic apart: records() merges the partitions of one topic
        try:
            name, record = decode_control(rec["value"])
        except DecodeError:
            continue
        if record["run_id"] != run_id:
            continue
        if name == REQUEST:
            if record["kind"] != OPS:  # stacks requests capture no steps
                continue
            topic = rec["topic"]
            record = next((request_from(topic, p, record) for p in prefixes if topic.startswith(p)), None) or record
            by_id.setdefault(record["request_id"], Capture(record))
        else:
            statuses.append(record)
    for status in statuses:
        capture = by_id.get(status["request_id"])
        if capture is not None:
            previous = capture.statuses.get(status["rank"])
            if previous is None or previous["state"] not in (FINISHED, "refused"):
                capture.statuses[status["rank"]] = status
    return sorted(by_id.values(), key=lambda c: c.request["requested_ns"]), latest_answer(statuses)


def _per_step(steps: list[dict]) -> dict[str, float]:
    """Mean time per step of each op type over ``steps`` (ns)."""
    totals: Counter = Counter()
    for s in steps:
        for c in s["op_types"]:
            totals[c["op_type"]] += c["total_ns"]
    return {t: ns / len(steps) for t, ns in totals.items()} if steps else {}


def op_type_change(rank_steps: list[dict], first: int, last: int, requested: list[tuple[int, int]]) -> dict:
    """Before (baseline) and during a captured window of one rank: mean ns per step of each
    op type, the steps each holds, and the op types by time during the window."""
    during = [s for s in rank_steps if first <= s["step"] <= last and s["op_types"]]
    before = [s for s in rank_steps if s["step"] < first and s["op_types"]
              and not any(a <= s["step"] <= b for a, b in requested)]
    d, b = _per_step(during), _per_step(before)
    order = sorted(d, key=d.get, reverse=True)[:TOP_OP_TYPES]
    return {"during_steps": len(during), "before_steps": len(before),
            "rows": [(t, b.get(t), d[t]) for t in order]}


def render_captures(captures: list[Capture], by_rank: dict[int, list[dict]], timeline_dir: Path | None,
                    out_dir: Path) -> str:
    """The Captures section of the report page."""
    from profstream.sinks.timeline import window_files

    if not captures:
        return ('<p class="sub" id="captures">No capture request for this run in the archive (archive the control '
                'and request topics too: <code>profstream sink archive --topics raw,steps,control,requests</code>).</p>')
    e = html.escape
    requested = [w for c in captures for w in c.windows().values()]
    parts = []
    for c in captures:
        r = c.request
        answers = ", ".join(f"{'all' if rank is None else f'rank {rank}'}: {s['state']}"
                            + (f" ({e(s['reason'])})" if s["reason"] else "")
                            for rank, s in sorted(c.statuses.items(), key=lambda i: -1 if i[0] is None else i[0]))
        parts.append(f'<h3 data-request="{e(r["request_id"])}">{e(describe_request(r))}</h3>'
                     f'<p class="sub">asked by {e(who_asked(r))}'
                     f'{": " + e(r["reason"]) if r["reason"] else ""}; {answers or "no answer archived"}</p>')
        for rank, (first, last) in c.windows().items():
            change = op_type_change(by_rank.get(rank, []), first, last, requested)
            rows = "".join(
                f'<tr data-op-type="{e(t)}"><td>{e(t)}</td><td>{"—" if before is None else f"{before / 1e6:.3f}"}</td>'
                f'<td>{during / 1e6:.3f}</td><td>{"new" if before is None else f"{(during - before) / 1e6:+.3f}"}'
                f'</td></tr>' for t, before, during in change["rows"])
            baseline = (f"{change['before_steps']} earlier steps with ops" if change["before_steps"] else
                        "no baseline: no earlier step of this rank has ops (capture on a schedule, every_n_steps, "
                        "to have one)")
            files = window_files(timeline_dir, r["run_id"], rank, first, last) if timeline_dir else []
            links = " ".join(f'<a href="{e(Path(os.path.relpath(p, out_dir)).as_posix())}">{e(p.name)}</a>'
                             for p in files)
            parts.append(
                f'<p>Rank {rank}, steps {first}–{last} ({c.statuses[rank]["ops"]:,} ops); baseline: {baseline}'
                f'{"; timeline: " + links if links else ""}.</p>'
                f'<table class="capture" data-rank="{rank}" data-first="{first}" data-last="{last}"><tr>'
                f'<th>op type</th><th>before (ms/step)</th><th>during (ms/step)</th><th>change</th></tr>{rows}</table>')
    return "".join(parts)
