"""Rank clock offsets learned from the collectives (processors/clocks.py), on synthetic
calls whose true times and clock offsets are known."""

from __future__ import annotations

import time

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


def test_calls_without_an_end_teach_nothing_and_timed_ones_still_do():
    """gloo's always-on records keep no end (end before start): their ends would make the
    arrival spread an offset. They teach nothing, on both paths (matrices and rows); the
    timed calls beside them still do."""
    from profstream.processors.collectives import pack_calls

    rng = np.random.default_rng(3)
    offsets = {0: 0.0, 1: 4 * MS}
    timed, _truth = synthetic_step(rng, 0, offsets)
    untimed = {r: calls_of([CollectiveCall("all_reduce", "0", 2, 100 + j, 8, s, s - 1)
                            for j, s in enumerate([10 * MS + r * 3 * MS, 30 * MS + r * 2 * MS])])
               for r in offsets}
    for learn in ("learn", "learn_packed"):
        clocks = RunClocks()
        given = untimed if learn == "learn" else {r: pack_calls(c) for r, c in untimed.items()}
        getattr(clocks, learn)(given)
        assert clocks.offsets() == {}, learn
        clocks.learn({r: calls_of([CollectiveCall(*row) for row in [*_rows(timed[r]), *_rows(untimed[r])]])
                      for r in offsets})
        assert abs(clocks.offsets()[1] - 4 * MS) < 0.1 * MS, learn


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


# -- end to end: Monitors whose clocks are shifted, a real broker, the processor ----------

WORLD = 4
E2E_STEPS = 10
E2E_CALLS = 4
SHIFTS = {0: 0, 1: 5 * MS, 2: -5 * MS, 3: 5 * MS}  # each rank's clock against true time


def _true_run(seed: int = 11) -> dict[int, dict[int, list[tuple[int, int]]]]:
    """step -> rank -> its calls' (start, end) on the true clock: rank step % WORLD arrives
    2.5 ms after the others (who arrive within 0.5 ms), the data moves 1 ms, each rank's end
    within 20 us of the others."""
    rng = np.random.default_rng(seed)
    out = {}
    for step in range(E2E_STEPS):
        calls: dict[int, list[tuple[int, int]]] = {r: [] for r in range(WORLD)}
        for j in range(E2E_CALLS):
            t0 = 10**18 + step * 100 * MS + 20 * MS + j * 15 * MS
            start = {r: t0 + int(rng.uniform(0, 0.5 * MS)) + (int(2.5 * MS) if r == step % WORLD else 0)
                     for r in range(WORLD)}
            done = max(start.values()) + MS
            for r in range(WORLD):
                calls[r].append((start[r], done + int(rng.uniform(0, 20 * US))))
        out[step] = calls
    return out


def _record_run(bootstrap: str, prefix: str, run_id: str, shifts: dict[int, int], truth, monkeypatch) -> None:
    """The run recorded by one Monitor per rank, every time read on the rank's own clock:
    the Monitor's clock source (``monitor._time_ns``) runs ``shifts[rank]`` from true time
    while that rank records, and its collectives' times are taken on the same clock."""
    from profstream import COMMUNICATION
    from profstream.producers import monitor as monitor_module
    from profstream.producers.monitor import Monitor

    now = [0]  # true time
    monitors = {r: Monitor(run_id=run_id, rank=r, world_size=WORLD, bootstrap=bootstrap, topic_prefix=prefix,
                           host_sample_interval_s=0, control=False, device_interval_ms=0) for r in range(WORLD)}
    try:
        for step, calls in truth.items():
            for r, mon in monitors.items():
                monkeypatch.setattr(monitor_module, "_time_ns", lambda r=r: now[0] + shifts[r])
                now[0] = 10**18 + step * 100 * MS
                mon.begin_step(step)
                for j, (start, end) in enumerate(calls[r]):
                    at = start + shifts[r]
                    mon.op("allreduce", at, end - start, COMMUNICATION)
                    mon.collective("all_reduce", "0", step * E2E_CALLS + j, at, end - start, WORLD,
                                   in_bytes=4096, out_bytes=4096, dtype="Float")
                now[0] = 10**18 + (step + 1) * 100 * MS - MS
                mon.end_step()
    finally:
        monkeypatch.setattr(monitor_module, "_time_ns", time.time_ns)
        for mon in monitors.values():
            assert mon.close(), "a Monitor could not deliver its batches"


def _true_figures(calls: dict[int, list[tuple[int, int]]]) -> dict:
    """Per rank (wait, transfer) summed over the step's calls, the late rank and how long
    the one who waited longest for it waited: on the true clock, by direct arithmetic."""
    last = [max(calls[r][j][0] for r in calls) for j in range(E2E_CALLS)]
    ranks = {r: (sum(last[j] - calls[r][j][0] for j in range(E2E_CALLS)),
                 sum(calls[r][j][1] - last[j] for j in range(E2E_CALLS))) for r in calls}
    late = max(calls, key=lambda r: -ranks[r][0])  # the rank that never waited
    return {"ranks": ranks, "late_rank": late, "held_ns": max(w for r, (w, _t) in ranks.items() if r != late)}


def test_ranks_with_shifted_clocks_get_the_figures_of_the_unshifted_run(kafka_bootstrap, topics, monkeypatch,
                                                                         tmp_path):
    """Two runs of the same calls, one whose ranks' clocks are 0, +5, -5 and +5 ms off true
    time: every step's wait, transfer, late rank and held time equal the unshifted run's
    (and the truth) within 0.1 ms, and the run says the offsets it found, each within its
    error bound of the shift; the timeline files of both runs, written from what the broker
    holds, show every rank's Steps and Collectives slices at the same times within 0.1 ms.
    Without the offsets the waits are 5-10 ms off."""
    from tests.test_processor import RunningProcessor, _run_steps

    truth = _true_run()
    with RunningProcessor(kafka_bootstrap, topics, run_grace_s=30.0):
        _record_run(kafka_bootstrap, topics.prefix, "plain", dict.fromkeys(SHIFTS, 0), truth, monkeypatch)
        _record_run(kafka_bootstrap, topics.prefix, "shifted", SHIFTS, truth, monkeypatch)
        plain = {r["step"]: r for r in _run_steps(kafka_bootstrap, topics, "plain", E2E_STEPS)}
        shifted = {r["step"]: r for r in _run_steps(kafka_bootstrap, topics, "shifted", E2E_STEPS)}
    assert sorted(plain) == sorted(shifted) == list(range(E2E_STEPS))
    _same_timelines(kafka_bootstrap, topics, tmp_path)
    for step in range(E2E_STEPS):
        want = _true_figures(truth[step])
        for got in (plain[step], shifted[step]):
            assert got["collectives_matched"] == E2E_CALLS and got["ranks_reported"] == WORLD
            assert got["late_rank"] == want["late_rank"] == step % WORLD
            assert abs(got["late_rank_held_ns"] - want["held_ns"]) < 0.1 * MS, (step, got["late_rank_held_ns"])
            for x in got["collective_ranks"]:
                wait, transfer = want["ranks"][x["rank"]]
                assert abs(x["wait_ns"] - wait) < 0.1 * MS and abs(x["transfer_ns"] - transfer) < 0.1 * MS, (step, x)
        offsets = {c["rank"]: c for c in shifted[step]["clock_offsets"]}
        assert sorted(offsets) == list(range(WORLD))
        for r, shift in SHIFTS.items():
            assert abs(offsets[r]["offset_ns"] - shift) <= max(offsets[r]["error_ns"], 0), (step, offsets[r])
            assert abs(offsets[r]["offset_ns"] - shift) < 0.1 * MS
        assert all(abs(c["offset_ns"]) < 0.1 * MS for c in plain[step]["clock_offsets"])


def test_a_restarted_run_stage_keeps_the_offsets_it_had_learned():
    """Steps 0-5 teach rank 1's offset (+5 ms); the run stage restarts from its checkpoint;
    step 6 has only a broadcast, which teaches nothing: its wait is still measured on the
    run's clock, with the offset the stage had before its restart."""
    from profstream.kafka.topics import Topics
    from profstream.processors.collectives import pack_calls
    from profstream.processors.health import StageCounts
    from profstream.processors.runtime import RunStage
    from profstream.schema.codec import decode
    from tests.test_grafana_client import Feed, step_metrics

    topics, feed = Topics(prefix="clk"), Feed()
    shift = {0: 0, 1: 5 * MS}

    def report(rank: int, step: int, name: str):
        # rank 1 arrives 2 ms late (true time), the call ends 1 ms after
        start = step * 100 * MS + (2 * MS if rank else 0)
        call = CollectiveCall(name, "0", 2, step, 64, start + shift[rank], step * 100 * MS + 3 * MS + shift[rank])
        return feed(topics.steps, "StepMetrics", {**step_metrics("c", rank, step, 100 * step), "op_count": 1,
                                                   "collectives": pack_calls(calls_of([call]))})

    def emitted(stage):
        return {decode("RunStepMetrics", o.value)["step"]: decode("RunStepMetrics", o.value)
                for o in stage.ready(0.0) if o.topic == topics.run}

    first = RunStage(topics, StageCounts(keep_step_ends=False))
    for step in range(6):
        for rank in (0, 1):
            first.fold(report(rank, step, "all_reduce"), 0.0)
    before = emitted(first)
    assert before[5]["clock_offsets"][1]["offset_ns"] == pytest.approx(5 * MS, abs=1)
    checkpoint = first.changed_state()

    restarted = RunStage(topics, StageCounts(keep_step_ends=False))
    for out in checkpoint:
        restarted.restore(out.partition, out.key, out.value, 0.0)
    for rank in (0, 1):
        restarted.fold(report(rank, 6, "broadcast"), 0.0)
    after = emitted(restarted)[6]
    assert after["clock_offsets"] == before[5]["clock_offsets"]
    waits = {x["rank"]: x["wait_ns"] for x in after["collective_ranks"]}
    assert waits == {0: 2 * MS, 1: 0} and after["late_rank"] == 1


@pytest.mark.parametrize("seed", range(4))
def test_packed_records_teach_what_their_calls_teach(seed):
    """The run stage learns from StepMetrics' packed columns (rank x call matrices when
    every rank made the same calls): the same offsets as from the calls themselves, and
    from calls in another order on one rank (the rows path)."""
    from profstream.processors.collectives import Calls, pack_calls

    rng = np.random.default_rng(seed)
    offsets = {0: 0.0, 1: 3 * MS, 2: -2 * MS}
    by_calls, by_packed, shuffled = RunClocks(), RunClocks(), RunClocks()
    for step in range(6):
        calls, _ = synthetic_step(rng, step, offsets)
        by_calls.learn(calls)
        by_packed.learn_packed({r: pack_calls(c) for r, c in calls.items()})
        perm = rng.permutation(len(calls[1]))
        mixed = {**calls, 1: Calls(calls[1].names, {c: a[perm] for c, a in calls[1].cols.items()})}
        shuffled.learn_packed({r: pack_calls(c) for r, c in mixed.items()})
    assert by_packed.estimates() == by_calls.estimates() == shuffled.estimates()


def _same_timelines(bootstrap: str, topics, out) -> None:
    """The timeline sink over the run topic (the offsets) and then the raw topic, as the
    broker holds them: the shifted run's rank tracks equal the plain run's within 0.1 ms."""
    import gzip
    import json
    from collections import namedtuple

    from profstream.sinks.timeline import TID_STEPS, TimelineSink
    from profstream.sinks.timeline_collectives import TID_COLLECTIVES
    from tests.helpers import topic_records

    Rec = namedtuple("Rec", "topic partition offset key value")
    sink = TimelineSink(out, window_steps=E2E_STEPS, run_topic=topics.run)
    for topic in (topics.run, topics.raw):
        sink.handle([Rec(r.topic, r.partition, r.offset, r.key, r.value) for r in topic_records(bootstrap, topic)])
    sink.close()
    tracks: dict = {}
    for run_id in ("plain", "shifted"):
        for rank in range(WORLD):
            paths = sorted((out / run_id / f"rank-{rank}").glob("*.json.gz"))
            assert paths, f"no timeline of {run_id} rank {rank}"
            got = []
            for p in paths:
                doc = json.loads(gzip.decompress(p.read_bytes()))
                base = doc["otherData"]["base_time_ns"]
                got += [(e["args"]["step"], e["name"], e["tid"], base + round(e["ts"] * 1000), round(e["dur"] * 1000))
                        for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] in (TID_STEPS, TID_COLLECTIVES)]
            tracks[(run_id, rank)] = sorted(got)
    for rank in range(WORLD):
        plain, shifted = tracks[("plain", rank)], tracks[("shifted", rank)]
        assert [x[:3] for x in plain] == [x[:3] for x in shifted], rank  # the same slices, names included
        assert any(x[2] == TID_COLLECTIVES for x in plain)
        for a, b in zip(plain, shifted):
            assert abs(a[3] - b[3]) < 0.1 * MS and abs(a[4] - b[4]) < 0.1 * MS, (rank, a, b)

