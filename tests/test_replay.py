"""Replay: the figures from an archive equal the live ones, offline and through a topic."""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

import tests.test_processor as live
from profstream.cli import app
from profstream.kafka.topics import Topics, delete_topics, ensure_topics
from profstream.offline.archive import archive_files, finished_files, iter_file
from profstream.offline.export import export_parquet
from profstream.offline.replay import Pacer, StepRange, replay_offline, republish
from profstream.processors.collectives import readable_calls
from profstream.schema.batch import EventBatch, decode_batch
from profstream.schema.codec import decode, record_name
from profstream.simulate import SimConfig, plan_run, run_simulation
from profstream.sinks.archive import run_archive
from tests.helpers import read_full, step_records, topic_size, wait_until

CFG = SimConfig(run_id="recorded", ranks=3, steps=30, ops_per_step=60, seed=11, straggler_rank=1)


def _plain(s: dict) -> dict:
    """A StepMetrics without what differs by design between two computations: when it closed."""
    return {k: v for k, v in s.items() if k != "closed_ns"}


def _by_step(records: list[dict]) -> dict:
    return {(s["rank"], s["step"]): _plain(s) for s in records}


@dataclass
class Recorded:
    bootstrap: str
    topics: Topics
    archive: Path
    steps: dict  # (rank, step) -> live StepMetrics
    ops: int


@pytest.fixture(scope="module")
def recorded(kafka_bootstrap, tmp_path_factory) -> Recorded:
    """A simulated run processed live by a real Processor (its step stage) while the archive
    sink records the raw and steps topics."""
    topics = Topics(f"t-replay-{uuid.uuid4().hex[:8]}")
    ensure_topics(kafka_bootstrap, topics, raw_partitions=4, partitions=3)
    archive = tmp_path_factory.mktemp("replay") / "archive"
    stop = threading.Event()
    sink = threading.Thread(target=run_archive, args=(kafka_bootstrap, [topics.raw, topics.steps], archive, stop),
                            kwargs={"group_id": f"a-{topics.prefix}", "max_age_s": 0.5}, daemon=True)
    sink.start()
    total = CFG.ranks * CFG.steps
    try:
        with live.RunningProcessor(kafka_bootstrap, topics, stages="steps") as processor:
            sim = run_simulation(CFG, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
            steps = step_records(kafka_bootstrap, topics.steps, CFG.run_id, total)
            seen = (f"the live processor: {len(steps)} of {total} steps committed, {processor.health.steps_closed} "
                    f"closed, {processor.health.batches} batches folded, "
                    f"assignment {processor.loops[0].assignment()}; the simulator: flushed "
                    f"{sim.flushed}, dropped {sim.dropped_ops} ops; raw topic: "
                    f"{topic_size(kafka_bootstrap, topics.raw)} messages")
        assert len(steps) == total, seen
        raw_total = topic_size(kafka_bootstrap, topics.raw)

        def archived(topic: str, name: str | None = None) -> int:
            return sum(1 for f in finished_files(archive) if f.topic == topic for r, _ in iter_file(f)
                       if r and (name is None or record_name(r["value"]) == name))

        wait_until(lambda: archived(topics.raw) == raw_total and archived(topics.steps, "StepMetrics") == total
                   and archived(topics.steps, "RankEnd") == CFG.ranks, 60,
                   "the archive to hold every raw message, every StepMetrics and each rank's RankEnd")
        # the run stage's StepPartials have a topic of their own, not archived: replay rebuilds them
        assert archived(topics.steps, "StepPartial") == 0
    finally:
        stop.set()
        sink.join(30)
    yield Recorded(kafka_bootstrap, topics, archive, _by_step(steps), sim.ops_recorded)
    delete_topics(kafka_bootstrap, topics, timeout=5.0)


@pytest.mark.parametrize("workers", [1, 2])
def test_offline_replay_of_the_archive_equals_the_live_figures(recorded, workers):
    steps, runs, tallies = [], [], []
    result = replay_offline(archive_files(recorded.archive, run=CFG.run_id), workers=workers,
                            on_step=steps.append, on_run_step=runs.append, progress=tallies.append)
    assert _by_step(steps) == recorded.steps and len(steps) == len(recorded.steps)
    assert sorted(r["step"] for r in runs) == list(range(CFG.steps))
    for r in runs:  # the cross-rank figures of the live step times
        times = {rank: recorded.steps[(rank, r["step"])]["step_time_ns"] for rank in range(CFG.ranks)}
        assert r["step_times_ns"] == {str(k): v for k, v in times.items()} and r["ranks_reported"] == CFG.ranks
        assert (r["min_step_time_ns"], r["max_step_time_ns"]) == (min(times.values()), max(times.values()))
        assert r["straggler_rank"] == max(times, key=times.get) == CFG.straggler_rank
    assert result.events == recorded.ops and result.undecodable == 0 and not result.losses
    last = tallies[-1]  # progress: files, events and steps, up to the totals
    assert (last.files_done, last.bytes_done, last.events, last.steps) == (
        last.files_total, last.bytes_total, recorded.ops, len(recorded.steps))


def test_offline_replay_of_a_step_range_from_the_cli_equals_the_live_figures(recorded, tmp_path):
    result = CliRunner().invoke(app, ["replay", str(recorded.archive), "--run", CFG.run_id, "--steps", "10:14",
                                      "--offline", "--output", str(tmp_path), "--no-progress"])
    assert result.exit_code == 0, result.output
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    # JSON lines carry a step's packed collective columns as one dict per call
    assert _by_step(steps) == {k: {**v, "collectives": readable_calls(v["collectives"])}
                               for k, v in recorded.steps.items() if 10 <= k[1] <= 14}
    runs = [json.loads(line) for line in (tmp_path / "run_steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in runs] == list(range(10, 15))


def test_replay_to_a_fresh_prefix_gives_the_same_figures_byte_identical_batches_and_renames(recorded):
    fresh = Topics(f"t-replayed-{uuid.uuid4().hex[:8]}")
    boot = recorded.bootstrap
    files = archive_files(recorded.archive, run=CFG.run_id)
    try:
        as_is = republish(files, boot, fresh.raw)  # creates the fresh prefix's topics
        renamed = republish(files, boot, fresh.raw, rewrite_run="renamed")
        assert as_is.sent == renamed.sent == sum(1 for f in files for r, _ in iter_file(f) if r)
        with live.RunningProcessor(boot, fresh):  # both stages: the run stage reads the partials topic
            total = len(recorded.steps)
            again = step_records(boot, fresh.steps, CFG.run_id, total)
            moved = step_records(boot, fresh.steps, "renamed", total)
            runs = read_full(boot, fresh.run, lambda r: r["run_id"] == CFG.run_id, CFG.steps, 60,
                             decode=lambda v: decode("RunStepMetrics", v), what="RunStepMetrics")
        assert _by_step(again) == recorded.steps and len(again) == total
        # the partials are not archived: the replay's step stages write them again, and the run
        # figures are those the offline replay computes from the StepMetrics
        offline: list[dict] = []
        replay_offline(files, on_run_step=offline.append)
        assert sorted(runs, key=lambda r: r["step"]) == sorted(offline, key=lambda r: r["step"])
        assert {k: {**v, "run_id": CFG.run_id} for k, v in _by_step(moved).items()} == recorded.steps
        archived = sorted(r["value"] for f in files for r, _ in iter_file(f) if r)
        sent = read_full(boot, fresh.raw, lambda v: decode_batch(v).run_id == CFG.run_id, len(archived), 30,
                         what="replayed batches")
        assert sorted(sent) == archived  # byte for byte
    finally:
        delete_topics(boot, fresh, timeout=5.0)


def test_export_parquet_gives_the_live_step_metrics_and_every_op(recorded, tmp_path):
    from_steps = export_parquet(recorded.archive, tmp_path / "a", CFG.run_id, source="steps")
    from_raw = export_parquet(recorded.archive, tmp_path / "b", CFG.run_id, source="raw", what=("steps",))
    assert from_steps.steps_source == "steps archive" and from_steps.step_rows == len(recorded.steps)
    a = pd.read_parquet(from_steps.paths[0]).drop(columns="closed_ns").sort_values(["rank", "step"])
    b = pd.read_parquet(from_raw.paths[0]).drop(columns="closed_ns").sort_values(["rank", "step"])
    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))
    live_rows = [recorded.steps[(r, s)] for r, s in zip(a["rank"], a["step"])]
    assert list(a["step_time_ns"]) == [s["step_time_ns"] for s in live_rows]
    assert list(a["memory.peak"]) == [s["memory"]["peak"] for s in live_rows]
    assert list(a["rolling.p95_step_time_ns"]) == [s["rolling"]["p95_step_time_ns"] for s in live_rows]
    ops = pd.read_parquet(from_steps.paths[1])
    assert len(ops) == recorded.ops == from_steps.op_rows
    assert list(ops.columns) == ["run_id", "rank", "step", "name", "op_type", "kind", "stream", "start_ns", "dur_ns",
                                 "launch_ns"]
    assert (ops["launch_ns"] == -1).all()  # the simulator's ops carry no launch time
    # every op as planned by the simulator, per (rank, step, op type): count and summed duration
    truth = {(p.rank, p.step, t): c for p in plan_run(CFG, 0) for t, c in p.truth["op_types"].items()}
    got = ops.groupby(["rank", "step", "op_type"])["dur_ns"].agg(["sum", "count"])
    assert {k: (int(v["sum"]), int(v["count"])) for k, v in got.iterrows()} == truth
    assert set(ops["kind"]) == {"compute", "communication"}


def test_steps_a_b_keep_only_those_steps_with_headers_kept_until_the_watermark():
    def batch(seq: int, steps: list[int], wm: int | None) -> EventBatch:
        b = EventBatch(run_id="r", rank=0, producer_id="p", seq=seq, complete_through_step=wm,
                       op_names=["x"], op_types=["X"])
        n = len(steps)
        b.ops = {"name_idx": np.zeros(n, np.int32), "type_idx": np.zeros(n, np.int32), "kind": np.zeros(n, np.uint8),
                 "stream": np.zeros(n, np.int32), "step": np.array(steps, np.int64),
                 "start_ns": np.arange(n, dtype=np.int64), "dur_ns": np.ones(n, np.int64)}
        return b

    keep = StepRange(3, 5)
    out = [keep.apply(b) for b in (batch(0, [1, 2], 1), batch(1, [2, 3, 3], 2), batch(2, [4], 3),
                                   batch(3, [], 4), batch(4, [6, 6], 5), batch(5, [7], 6))]
    assert out[0] is None  # before the range
    assert list(out[1].ops["step"]) == [3, 3] and out[1].seq == 1
    assert list(out[2].ops["step"]) == [4]
    assert out[3] is not None and out[3].complete_through_step == 4  # header only: no seq gap
    assert list(out[4].ops["step"]) == [] and out[4].complete_through_step == 5  # closes step 5
    assert out[5] is None  # after the watermark passed the range


def test_pacing_follows_the_timestamps_scaled_by_speed():
    now = [0.0]
    slept = []

    def sleep(s: float) -> None:
        slept.append(round(s, 6))
        now[0] += s

    pacer = Pacer(2.0, clock=lambda: now[0], sleep=sleep)
    for ts in (10_000, 11_000, 11_000, 13_000, 12_000):
        pacer.wait(ts)
    assert slept == [0.5, 1.0]  # 1 s and 2 s of recorded time at twice the speed; never backwards
    assert now[0] == pytest.approx(1.5)
    fast = Pacer(None, clock=lambda: now[0], sleep=sleep)
    fast.wait(0)
    fast.wait(10**9)
    assert slept == [0.5, 1.0]
