"""The group field of collective records: a process group's name, with its members.

A collective call is matched across ranks by (group, seq). So that the processors know
which ranks a call must come from, a group that does not hold every rank of the run is
named ``<name>@<ranks>``, its global ranks in short (``ranks_text``): ``0-3``, ``1-7/2``
(first-last/stride) or ``0,2,5``. The default group (every rank) keeps its plain name, as
op capture has always named it.
"""

from __future__ import annotations

from collections.abc import Sequence


def ranks_text(ranks: Sequence[int]) -> str:
    """Global ranks of a group in short: '0-3', '1-7/2' (first-last/stride), or '0,2,5'."""
    ranks = list(ranks)
    if len(ranks) > 2:
        stride = ranks[1] - ranks[0]
        if stride > 0 and all(b - a == stride for a, b in zip(ranks, ranks[1:])):
            return f"{ranks[0]}-{ranks[-1]}" + (f"/{stride}" if stride > 1 else "")
    return ",".join(str(r) for r in ranks)


def group_label(name: str, ranks: Sequence[int] | None, world_size: int | None) -> str:
    """A group as collective records name it: ``name``, with ``@<ranks_text>`` unless it
    holds every rank of the run."""
    if ranks is None or (world_size is not None and list(ranks) == list(range(world_size))):
        return name
    return f"{name}@{ranks_text(ranks)}"


def group_members(label: str) -> list[int] | None:
    """The global ranks a ``group_label`` names; None for a plain name (every rank of the run)
    or one that does not parse."""
    _, at, text = label.rpartition("@")
    if not at or not text:
        return None
    try:
        if "-" in text:
            span, _, stride = text.partition("/")
            first, _, last = span.partition("-")
            step = int(stride or 1)
            return list(range(int(first), int(last) + 1, step)) if step > 0 else None
        return [int(r) for r in text.split(",")]
    except ValueError:
        return None
