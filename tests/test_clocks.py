"""Rank clock offsets learned from the collectives (processors/clocks.py), on synthetic
calls whose true times and clock offsets are known."""

from __future__ import annotations

import numpy as np
import pytest

from profstream.processors.clocks import RunClocks
from profstream.processors.collectives import CollectiveCall, calls_of, step_collectives

MS = 1_000_000
US = 1_000


def synthetic_step(rng, step: int, offsets: dict[int, float], calls: int = 6, step_ms: float = 100.0,
                   group: str = "0", members: list[int] | None = None, seq0: int = 0,
                   drift_ns_per_step: dict[int, float] | None = None):
    """One step of all_reduces over ``members``: true arrivals spread over 0-3 ms, the data
    moving 1 ms after the last arrival, each rank's end up to 50 us after that; every time
    read on the rank's clock (true + offset, + drift x step). Returns ({rank: calls}, truth
    {rank: [(start, end)]} on the true clock)."""
    members = sorted(offsets) if members is None else members
    out = {r: [] for r in members}
    truth = {r: [] for r in members}
    for j in range(calls):
        t0 = step * step_ms * MS + j * 10 * MS
        start = {r: t0 + int(rng.uniform(0, 3 * MS)) for r in members}
        done = max(start.values()) + MS
        for r in members:
            end = done + int(rng.uniform(0, 50 * US))
            shift = offsets[r] + (drift_ns_per_step or {}).get(r, 0.0) * step
            out[r].append(CollectiveCall("all_reduce", group, len(members), seq0 + step * calls + j, 4096,
                                         int(start[r] + shift), int(end + shift)))
            truth[r].append((start[r], end))
    return {r: calls_of(c) for r, c in out.items()}, truth


def test_offsets_are_recovered_within_their_error_bound_and_the_bound_is_the_transfer_tail():
    rng = np.random.default_rng(1)
    offsets = {0: 0.0, 1: 5 * MS, 2: -5 * MS, 3: 2.3 * MS}
    clocks = RunClocks()
    for step in range(20):
        calls, _ = synthetic_step(rng, step, offsets)
        clocks.learn(calls)
    est = {e["rank"]: e for e in clocks.estimates()}
    assert clocks.reference == 0 and est[0] == {"rank": 0, "offset_ns": 0, "error_ns": 0}
    for r in (1, 2, 3):
        err = abs(est[r]["offset_ns"] - offsets[r])
        assert err <= est[r]["error_ns"], (r, est[r])
        assert err < 50 * US  # the ends' own spread
        assert est[r]["error_ns"] < 2.1 * MS  # no wider than the shortest transfer after the last arrival, twice


def test_figures_on_the_run_clock_equal_the_true_clock_figures():
    """Wait, transfer and the late rank computed with the learned offsets equal those of the
    true times within the ends' spread, where the raw clocks give figures 5 ms off."""
    rng = np.random.default_rng(2)
    offsets = {0: 0.0, 1: 5 * MS, 2: -5 * MS}
    clocks = RunClocks()
    for step in range(10):
        calls, truth = synthetic_step(rng, step, offsets)
        clocks.learn(calls)
    true_calls = {r: calls_of([CollectiveCall("all_reduce", "0", 3, 100 + j, 4096, s, e)
                               for j, (s, e) in enumerate(truth[r])]) for r in truth}
    shifted = {r: calls_of([CollectiveCall("all_reduce", "0", 3, 100 + j, 4096, int(s + offsets[r]),
                                           int(e + offsets[r])) for j, (s, e) in enumerate(truth[r])])
               for r in truth}
    want = step_collectives(true_calls, [0, 1, 2])
    got = step_collectives(shifted, [0, 1, 2], clocks.offsets())
    raw = step_collectives(shifted, [0, 1, 2])
    for w, g, x in zip(want["collective_ranks"], got["collective_ranks"], raw["collective_ranks"]):
        assert abs(g["wait_ns"] - w["wait_ns"]) < 0.1 * MS and abs(g["transfer_ns"] - w["transfer_ns"]) < 0.1 * MS
        assert abs(x["wait_ns"] - w["wait_ns"]) > 1 * MS  # the old figures: the clocks' offsets, not waits
    assert got["late_rank"] == want["late_rank"]
    assert abs(got["late_rank_held_ns"] - want["late_rank_held_ns"]) < 0.1 * MS


def test_a_drifting_clock_is_followed():
    """Rank 1's clock runs 50 ppm fast (5 us a 100 ms step), 1 ms apart after 200 steps."""
    rng = np.random.default_rng(3)
    offsets = {0: 0.0, 1: 3 * MS}
    clocks = RunClocks()
    for step in range(200):
        calls, _ = synthetic_step(rng, step, offsets, drift_ns_per_step={1: 5 * US})
        clocks.learn(calls)
        if step in (50, 199):
            now = offsets[1] + 5 * US * step
            e = clocks.estimates([1])[0]
            assert abs(e["offset_ns"] - now) <= e["error_ns"]
            assert abs(e["offset_ns"] - now) < 0.1 * MS


def test_a_rank_without_collectives_has_no_offset_and_a_subgroup_is_reached_through_others():
    """Ranks 2 and 3 only ever meet in their own group, rank 1 in the world group and in
    rank 2's: rank 3 gets its offset through rank 2. Rank 4 makes no call: absent, not 0."""
    rng = np.random.default_rng(4)
    offsets = {0: 0.0, 1: 4 * MS, 2: -3 * MS, 3: 6 * MS}
    clocks = RunClocks()
    for step in range(5):
        world, _ = synthetic_step(rng, step, offsets, members=[0, 1], group="world")
        pair, _ = synthetic_step(rng, step, offsets, members=[1, 2], group="dp")
        tp, _ = synthetic_step(rng, step, offsets, members=[2, 3], group="tp")
        calls = {r: calls_of([CollectiveCall(n, g, int(s), int(q), int(b), int(a), int(z))
                              for part in (world, pair, tp) if r in part
                              for n, g, s, q, b, a, z in _rows(part[r])]) for r in range(4)}
        calls[4] = calls_of([])
        clocks.learn(calls)
    got = clocks.offsets()
    assert sorted(got) == [0, 1, 2, 3]
    for r in (1, 2, 3):
        assert abs(got[r] - offsets[r]) < 0.15 * MS, (r, got[r])
    assert 4 not in clocks.offsets([4]) and clocks.estimates([4]) == []


def test_broadcasts_and_unmatched_calls_teach_nothing():
    clocks = RunClocks()
    calls = {0: calls_of([CollectiveCall("broadcast", "0", 2, 1, 8, 0, 10 * MS),
                          CollectiveCall("all_reduce", "0", 2, 2, 8, 20 * MS, 30 * MS)]),
             1: calls_of([CollectiveCall("broadcast", "0", 2, 1, 8, 7 * MS, 8 * MS)])}
    clocks.learn(calls)
    assert clocks.offsets() == {} and clocks.estimates() == []


def test_a_restored_estimate_gives_the_same_offsets_until_new_steps_come():
    rng = np.random.default_rng(5)
    offsets = {0: 0.0, 1: -5 * MS, 2: 5 * MS}
    clocks = RunClocks()
    for step in range(8):
        clocks.learn(synthetic_step(rng, step, offsets)[0])
    back = RunClocks.restore(clocks.snapshot())
    assert back.estimates() == clocks.estimates() and back.reference == 0
    assert RunClocks.restore(None).estimates() == []


@pytest.mark.parametrize("window", [0, -1])
def test_a_window_below_one_step_is_refused(window):
    with pytest.raises(ValueError, match="window"):
        RunClocks(window)


def _rows(calls):
    names = calls.names
    cols = calls.cols
    return [(names[n], names[g], s, q, b, a, z) for n, g, s, q, b, a, z in zip(
        *(cols[c].tolist() for c in ("name_idx", "group_idx", "group_size", "seq", "bytes", "start_ns", "end_ns")))]
