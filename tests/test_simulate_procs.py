"""`profstream simulate --procs P`: the ranks of one run shared out over P producer processes."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from typer.testing import CliRunner

from profstream.cli import app
from profstream.schema.batch import END_MARK
from profstream.simulate import SimConfig, expected
from profstream.simulate_procs import shares
from tests.helpers import raw_batches, step_records, topic_size
from tests.test_processor import RunningProcessor, _run_steps


def test_every_rank_step_reaches_the_raw_topic_once_from_two_processes(kafka_bootstrap, topics):
    cfg = SimConfig(run_id="procs2", ranks=5, steps=12, ops_per_step=20, seed=4)
    result = CliRunner().invoke(app, ["simulate", "--bootstrap", kafka_bootstrap, "--topic-prefix", topics.prefix,
                                      "--run-id", cfg.run_id, "--ranks", str(cfg.ranks), "--steps", str(cfg.steps),
                                      "--ops-per-step", str(cfg.ops_per_step), "--seed", str(cfg.seed),
                                      "--procs", "2"])
    assert result.exit_code == 0, result.output
    assert f"{cfg.ranks * cfg.steps} steps, {cfg.ranks * cfg.steps * cfg.ops_per_step} ops" in result.output
    assert "dropped ops: 0, samples: 0 (step marks: 0, those steps lost whole); steps that lost events: 0; all delivered" \
        in result.output

    batches = raw_batches(kafka_bootstrap, topics.raw, cfg.run_id, topic_size(kafka_bootstrap, topics.raw))
    seqs: dict[str, list[int]] = defaultdict(list)
    steps: Counter = Counter()
    ends: Counter = Counter()
    durations = {}
    for b in batches:
        assert b.world_size == cfg.ranks
        seqs[b.producer_id].append(b.seq)
        for step, start, end in zip(b.steps["step"], b.steps["start_ns"], b.steps["end_ns"]):
            if step == END_MARK:  # each Monitor's close: counted apart
                ends[b.rank] += 1
                continue
            steps[(b.rank, int(step))] += 1
            durations[(b.rank, int(step))] = int(end - start)
    assert len(seqs) == cfg.ranks  # one Monitor per rank, whichever process ran it
    for producer, got in seqs.items():
        assert got == list(range(len(got))), f"producer {producer} has seq gaps: {got}"
    want = expected(cfg)
    assert steps == Counter(dict.fromkeys(want, 1))  # every (rank, step) once, no other
    assert ends == Counter(range(cfg.ranks))  # and every rank ended once
    # the same plans as one process would record
    assert durations == {key: truth["step_time_ns"] for key, truth in want.items()}


def test_sixty_four_ranks_sharing_one_producer_per_process_are_processed_as_sixty_four_ranks(kafka_bootstrap, topics):
    # --shared-producer: the 32 Monitors of each process send through one producer and one
    # thread; each encodes its own batches, so the processors see 64 separate ranks
    cfg = SimConfig(run_id="shared64", ranks=64, steps=4, ops_per_step=20, seed=8, straggler_rank=37)
    with RunningProcessor(kafka_bootstrap, topics):
        result = CliRunner().invoke(app, [
            "simulate", "--bootstrap", kafka_bootstrap, "--topic-prefix", topics.prefix, "--run-id", cfg.run_id,
            "--ranks", str(cfg.ranks), "--steps", str(cfg.steps), "--ops-per-step", str(cfg.ops_per_step),
            "--seed", str(cfg.seed), "--straggler", str(cfg.straggler_rank), "--procs", "2", "--shared-producer"])
        assert result.exit_code == 0, result.output
        assert "dropped ops: 0, samples: 0" in result.output and "all delivered" in result.output, result.output
        steps = step_records(kafka_bootstrap, topics.steps, cfg.run_id, cfg.ranks * cfg.steps)
        runs = _run_steps(kafka_bootstrap, topics, cfg.run_id, cfg.steps)
    truth = expected(cfg)
    assert Counter((s["rank"], s["step"]) for s in steps) == Counter(dict.fromkeys(truth, 1))  # each once
    for s in steps:
        want = truth[(s["rank"], s["step"])]
        assert (s["step_time_ns"], s["compute_ns"], s["overlap_ns"]) == (
            want["step_time_ns"], want["compute_ns"], want["overlap_ns"]), (s["rank"], s["step"])
    assert sorted(r["step"] for r in runs) == list(range(cfg.steps))  # each run step once
    for r in runs:
        times = {rank: truth[(rank, r["step"])]["step_time_ns"] for rank in range(cfg.ranks)}
        assert {int(k): v for k, v in r["step_times_ns"].items()} == times
        ordered = sorted(times.values())
        assert (r["ranks_reported"], r["min_step_time_ns"], r["max_step_time_ns"], r["median_step_time_ns"],
                r["straggler_rank"]) == (cfg.ranks, ordered[0], ordered[-1], (ordered[31] + ordered[32]) / 2, 37)
    # one producer id per rank, each with its own gapless seq, through two shared producers
    seqs: dict[str, list[int]] = defaultdict(list)
    ends: Counter = Counter()
    for b in raw_batches(kafka_bootstrap, topics.raw, cfg.run_id, topic_size(kafka_bootstrap, topics.raw)):
        seqs[b.producer_id].append(b.seq)
        ends[b.rank] += sum(1 for step in b.steps["step"] if step == END_MARK)
    assert len(seqs) == cfg.ranks
    assert all(got == list(range(len(got))) for got in seqs.values())
    assert ends == Counter(range(cfg.ranks))  # every Monitor's close sent its end mark, once


def test_more_than_1024_ranks_without_a_shared_producer_is_a_one_line_error():
    result = CliRunner().invoke(app, ["simulate", "--bootstrap", "127.0.0.1:1", "--ranks", "2048"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--shared-producer" in lines[0], result.output


@pytest.mark.parametrize("procs", ["0", "6", "-1"])
def test_a_procs_value_outside_one_to_ranks_is_a_one_line_error(procs):
    result = CliRunner().invoke(app, ["simulate", "--bootstrap", "127.0.0.1:1", "--ranks", "5", "--procs", procs])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --procs") and "expected 1 to 5" in lines[0], result.output


def test_shares_cover_every_rank_once_in_near_equal_contiguous_parts():
    parts = shares(1024, 3)
    assert [r for part in parts for r in part] == list(range(1024))
    assert sorted(len(p) for p in parts) == [341, 341, 342]
