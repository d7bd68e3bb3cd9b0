"""The report's Stacks section: the run's latest stacks (every rank's Python threads, asked
by ``profstream stacks`` or by autocapture when TrainingHang fired), read from the
archived control topic and merged across ranks, the odd one out first."""

from __future__ import annotations

import html
import os
from pathlib import Path

from profstream.control.stacks import StacksAnswer, stacks_lines


def stacks_file(timeline_dir: Path | None, run_id: str) -> Path | None:
    """The timeline sink's file of the run's latest stacks, where it wrote one."""
    if timeline_dir is None:
        return None
    path = Path(timeline_dir) / run_id / "stacks.json.gz"
    return path if path.is_file() else None


def stacks_section(answer: StacksAnswer | None, timeline_dir: Path | None, run_id: str, out_dir: Path) -> str:
    """The Stacks section of the report page."""
    e = html.escape
    if answer is None:
        return ('<p class="sub" id="stacks">No stacks of this run in the archive: nobody asked (<code>profstream '
                'stacks</code>, or autocapture when TrainingHang fires), or the control topic is not archived '
                '(<code>profstream sink archive --topics raw,steps,control,requests</code>).</p>')
    lines = stacks_lines(answer)
    file = stacks_file(timeline_dir, run_id)
    link = (f' Also in the timeline files: <a href="{e(Path(os.path.relpath(file, out_dir)).as_posix())}">'
            f'{e(file.parent.name)}/{e(file.name)}</a>.' if file is not None else "")
    groups = "".join(f'<li data-ranks="{",".join(map(str, g.ranks))}">{len(g.ranks)} of {len(answer.answered)}'
                     f'</li>' for g in answer.groups)
    return (f'<p class="sub">Every rank\'s Python threads when they were asked, ranks with the same stacks '
            f'merged, the odd one out first; <code>profstream stacks --run {e(run_id)} --latest</code> prints the '
            f'same from the live control topic.{link}</p><ul id="stack-groups" hidden>{groups}</ul>'
            f'<pre id="stacks">{e(chr(10).join(lines))}</pre>')
