"""The run stage reads StepPartials (processors/partials.py): the same RunStepMetrics, byte
for byte, as from every rank's StepMetrics; the step stage sends one partial per run step
and input partition a transaction, before the RankEnds. No Kafka (tests/test_processor.py
runs both stages through the broker)."""

from __future__ import annotations

import json
from collections import namedtuple
from pathlib import Path

import numpy as np

from profstream.kafka.topics import Topics
from profstream.processors.collectives import (
    Calls,
    CollectiveCall,
    calls_of,
    pack_calls,
    unpack_calls,
)
from profstream.processors.health import ProcessorHealth, StageCounts
from profstream.processors.partials import PartialBuilder, rows_of_partial
from profstream.processors.runtime import RunStage, StepStage
from profstream.schema.codec import (
    NO_COLLECTIVE_CALLS,
    VERSIONS,
    decode,
    encode,
    encode_step_metrics,
    record_name,
)
from tests.test_step_stage import Streams

Rec = namedtuple("Rec", "topic partition offset key value")
MS = 1_000_000
RANKS = 8
DATA = Path(__file__).parent / "data"


def _metrics(rank: int, step: int, calls: list[CollectiveCall], op_count: int = 50, step_ms: float = 100.0,
             work: dict | None = None) -> dict:
    t0 = 10**15 + step * 200 * MS
    step_ns = int(step_ms * MS)
    return {"run_id": "r", "rank": rank, "world_size": RANKS, "host": f"h{rank}", "device": "cpu", "step": step,
            "start_ns": t0, "end_ns": t0 + step_ns, "step_time_ns": step_ns, "data_wait_ns": 0, "fp_bp_ns": step_ns,
            "tail_ns": 0, "compute_ns": 0, "comm_ns": 0, "overlap_ns": 0, "pure_comm_ns": 0, "idle_ns": 0,
            "utilization": 0.0, "overlap_ratio": 0.0, "op_count": op_count, "op_types": [], "memory": None,
            "queues": [], "starved": False, "rolling": None, "closed_by": "watermark", "late_events": 0,
            "closed_ns": 0, "collectives": pack_calls(calls_of(calls)) if calls else NO_COLLECTIVE_CALLS,
            "work": work}


def _work(rank: int, mfu: float | None) -> dict:
    return {"tokens": 4096, "samples": 4, "flops": 1e15, "flops_source": "counted", "peak_flops": 1e15,
            "tokens_per_s": 4096 / (0.1 + rank / 1000), "samples_per_s": None if rank % 3 == 0 else 40.0 + rank / 7,
            "flops_per_s": 1e16 / (3 + rank), "mfu": mfu, "op_categories": []}


def _reports() -> list[dict]:
    """Three run steps of 8 ranks with what the cross-rank figures tell apart: a straggler,
    stragglers' waits in all_reduce on the run's clock (rank clocks 0 / +3 ms off), work
    with figures absent, a step where a subgroup's call is unmatched, a rank without ops
    (not measured), a rank whose collectives are always on, a rank missing after the
    grace, and a rank that reports a step twice (its last report counts)."""
    rng = np.random.default_rng(7)
    out = []
    for step in range(3):
        t0 = 10**15 + step * 200 * MS
        arrive = t0 + rng.integers(0, 4 * MS, (RANKS, 4)) + np.arange(4)[None, :] * 10 * MS
        end = arrive.max(axis=0)[None, :] + MS + rng.integers(0, 30_000, (RANKS, 4))
        for rank in range(RANKS):
            if step == 2 and rank == 6:
                continue  # missing: the step is emitted after the grace without it
            shift = 3 * MS * (rank % 2)
            calls = [CollectiveCall("all_reduce", "0", RANKS, step * 4 + j, 1 << 20, int(arrive[rank, j]) + shift,
                                    int(end[rank, j]) + shift) for j in range(4)]
            if step == 1 and rank < 3:  # a call of group tp (ranks 0-3) that rank 3 never made
                calls.append(CollectiveCall("all_gather", "tp@0-3", 4, 0, 4096, int(end[rank, 3]) + shift,
                                            int(end[rank, 3]) + shift + MS))
            op_count = 0 if (step == 1 and rank == 2) or rank == 5 else 50
            if step == 1 and rank == 2:
                calls = []  # its ops, collectives included, were not captured
            work = _work(rank, None if rank == 4 else 0.3 + rank / 100) if rank != 7 else None
            out.append(_metrics(rank, step, calls, op_count, 100 + 7 * rank + step, work))
    out.insert(5, {**out[1], "step_time_ns": out[1]["step_time_ns"] + 5 * MS})  # rank 1 twice in step 0
    return out


def _run(records: list[bytes]) -> list[bytes]:
    """RunStepMetrics of a run stage that reads ``records`` in order, then waits out the grace."""
    topics = Topics(prefix="rs")
    stage = RunStage(topics, StageCounts(keep_step_ends=False), grace_s=5.0)
    out = []
    for i, value in enumerate(records):
        stage.fold(Rec(topics.steps, 0, i, b"r", value), 0.0)
        out += stage.ready(0.0)
    out += stage.ready(10.0)
    assert stage.counts.decode_errors == {}
    return [o.value for o in out if o.topic == topics.run]


def _partials(reports: list[dict], partitions: int) -> list[bytes]:
    """The StepPartials one transaction of a step stage sends for ``reports`` (rank r read
    from input partition r % partitions)."""
    builder = PartialBuilder()
    for m in reports:
        builder.add(m, m["rank"] % partitions)
    return [encode("StepPartial", p) for p in builder.records()]


def test_run_steps_from_partials_equal_those_from_every_ranks_step_metrics_byte_for_byte():
    reports = _reports()
    expected = _run([encode_step_metrics(m) for m in reports])
    figures = [decode("RunStepMetrics", v) for v in expected]
    assert [(f["step"], f["ranks_reported"]) for f in figures] == [(0, 8), (1, 8), (2, 7)]
    assert figures[1]["unmatched_collectives"][0]["missing"] == [3]  # rank 3's call is missing, not rank 2's
    assert figures[0]["step_times_ns"]["1"] == reports[5]["step_time_ns"]  # the later report of rank 1
    assert figures[0]["clock_offsets"] and figures[0]["late_rank"] is not None
    assert figures[0]["work"]["mfu_ranks"] == 6 and figures[0]["work"]["ranks"] == 7

    by_step = [[m for m in reports if m["step"] == s] for s in range(3)]
    for partitions in (1, 3):  # one partial per run step, or one per input partition
        assert _run([v for step in by_step for v in _partials(step, partitions)]) == expected
    # as the live processor writes them: a transaction's StepMetrics, then its partials
    # (the run's first StepMetrics are read; once partials come, its StepMetrics are not)
    live = []
    for step in by_step:
        half = len(step) // 2
        for part in (step[:half], step[half:]):
            live += [encode_step_metrics(m) for m in part] + _partials(part, 2)
    assert _run(live) == expected


def test_once_a_run_has_partials_its_step_metrics_are_dropped_without_being_decoded(monkeypatch):
    """At 16,384 ranks, decoding every StepMetrics only to drop it cost the run stage ~0.9 s a
    run step through the broker (benchmarks §45): they are told apart by their header and run id."""
    from profstream.processors import runtime
    from profstream.schema import codec

    decoded = []

    def counted(value: bytes) -> tuple[str, dict]:
        got = codec.decode_any(value)
        decoded.append(got[0])
        return got

    monkeypatch.setattr(runtime, "decode_any", counted)
    reports = _reports()
    first, rest = reports[:2], reports[2:]
    other_run = [{**m, "run_id": "other"} for m in first]
    partials = _partials(first, 1) + _partials(rest, 1)
    records = ([encode_step_metrics(m) for m in first] + partials[:len(_partials(first, 1))]  # the first are read
               + [encode_step_metrics(m) for m in rest + other_run] + partials[len(_partials(first, 1)):])
    # the same run steps as from every rank's StepMetrics
    assert sorted(_run(records)) == sorted(_run([encode_step_metrics(m) for m in reports + other_run]))
    decoded.clear()
    _run(records)
    assert decoded.count("StepMetrics") == len(first) + len(other_run)  # not the partials' run's later ones
    assert decoded.count("StepPartial") == len(partials)


def test_step_partials_read_by_the_compiled_reader_are_fastavros_records():
    """The run stage reads thousands of StepPartials a run step at 16,384 ranks: by the compiled
    reader where it is built, into the very records fastavro reads."""
    import pytest

    from profstream.schema import codec

    sv = codec.CURRENT["StepPartial"]
    if sv.sparse is None:
        pytest.skip("the compiled extension is not built here (or PROFSTREAM_PURE_PROCESSORS is set)")
    for partitions in (1, 3, 8):
        for value in _partials(_reports(), partitions):
            record, end = sv.sparse(value, codec.HEADER_LEN)
            assert end == len(value) and record == codec._fastavro_read(value, sv)
            assert codec.decode_any(value) == ("StepPartial", record)


def test_peek_reads_the_record_name_and_run_id_or_says_it_cannot():
    from profstream.schema.codec import peek

    value = encode_step_metrics({**_reports()[0], "run_id": "rün-7"})
    assert peek(value) == ("StepMetrics", "rün-7")
    for bad in (value[:11], value[:10] + b"\xff" * 11, b"\x00" * 20, memoryview(value), None,
                value[:10] + b"\x04\xff\xfe"):  # truncated; a runaway varint; not Avro; not bytes; not UTF-8
        assert peek(bad) is None


def test_a_transactions_partial_joins_its_partitions_ranks_and_leaves_out_a_partition_taken_away():
    """One partial per run step a transaction, whatever the partitions its ranks came from
    (a 16,384-rank step closing over many transactions sent 16 a transaction); a partition
    revoked before the commit takes its ranks out of it."""
    step1 = [m for m in _reports() if m["step"] == 1]  # ranks 0-2 with a call of their own group
    builder = PartialBuilder()
    for m in step1:
        builder.add(m, m["rank"] % 3)
    (joined,) = builder.records()
    separate = [rows_of_partial(decode("StepPartial", v)) for v in _partials(step1, 1)]
    rows = rows_of_partial(joined)

    def by_rank(r):
        return {int(k): (r.name_lists[int(i)], int(t)) for k, i, t in zip(r.rank, r.call_names, r.step_time_ns)}

    assert by_rank(rows) == {k: v for s in separate for k, v in by_rank(s).items()}  # each rank's own names
    for m in step1:
        builder.add(m, m["rank"] % 3)
    builder.drop_partitions({1})
    assert sorted(np.frombuffer(builder.records()[0]["ranks"], "<i4").tolist()) == [0, 2, 3, 5, 6]


def test_a_partial_whose_columns_do_not_fit_is_refused_and_counted_and_the_rest_still_counts():
    reports = [m for m in _reports() if m["step"] == 0]
    good = _partials(reports[:4], 1)[0]
    record = decode("StepPartial", good)
    bad = encode("StepPartial", {**record, "step_time_ns": record["step_time_ns"][:-8]})
    topics = Topics(prefix="bad")
    stage = RunStage(topics, StageCounts(keep_step_ends=False), grace_s=5.0)
    for i, value in enumerate([bad, good, *_partials(reports[4:], 1)]):
        stage.fold(Rec(topics.steps, 0, i, b"r", value), 0.0)
    out = [decode("RunStepMetrics", o.value) for o in stage.ready(0.0) if o.topic == topics.run]
    assert stage.counts.decode_errors == {"malformed": 1}
    assert [(m["step"], m["ranks_reported"]) for m in out] == [(0, 8)]


def test_the_step_stage_sends_one_partial_per_run_step_a_transaction_and_before_a_rank_end():
    topics = Topics(prefix="tx")
    stage = StepStage(topics, 3, StageCounts(keep_step_ends=False), grace_s=2.0, idle_timeout_s=60.0)
    feed = Streams(topics)
    ready = []
    for step in range(2):
        for rank in range(4):  # each rank's step closes in a ready() of its own
            stage.fold(feed(rank, ops_steps=[step], marks=[step], watermark=step), 1.0)
            ready += stage.ready(1.0)
    names = [record_name(o.value) for o in ready if o.topic == topics.steps]
    assert names == ["StepMetrics"] * 8, "partials wait for the transaction's end"
    sent = stage.transaction_outputs()
    assert {o.topic for o in sent} == {topics.partials}, "the partials have a topic of their own"
    partials = [decode("StepPartial", o.value) for o in sent]
    # Streams reads rank r from raw partition r % 2: one partial per run step, its ranks by
    # partition (a partition's ranks, in the order they closed, then the next one's)
    got = sorted((p["step"], np.frombuffer(p["ranks"], "<i4").tolist()) for p in partials)
    assert got == [(0, [0, 2, 1, 3]), (1, [0, 2, 1, 3])]
    assert stage.transaction_outputs() == []

    stage.fold(feed(0, ops_steps=[2], marks=[2], watermark=2), 2.0)
    stage.fold(feed(0, marks=[-1], watermark=2), 2.0)  # rank 0 ends after step 2 (an end mark)
    out = stage.ready(2.0)
    assert [record_name(o.value) for o in out if o.topic == topics.steps] == ["StepMetrics", "RankEnd"]
    # the run stage's copy of the RankEnd follows the partial of the rank's last step on its topic
    # and partition: the run stage may end the run on it
    to_run_stage = [o for o in out if o.topic == topics.partials]
    assert [record_name(o.value) for o in to_run_stage] == ["StepPartial", "RankEnd"]
    assert len({o.partition for o in to_run_stage}) == 1


def test_a_run_step_too_large_for_a_message_goes_to_the_dead_letter_topic_and_the_next_ones_still_come(
        monkeypatch, caplog):
    """A RunStepMetrics over the message limit (tens of thousands of ranks with their calls)
    would fail its transaction again and again; it is dead-lettered, said once, and counted."""
    import profstream.processors.runtime as runtime

    reports = _reports()
    sizes = [len(v) for v in _run([encode_step_metrics(m) for m in reports])]
    # a limit between the run steps' sizes: the larger ones are too large, the others pass
    limit = sorted(sizes)[1]
    monkeypatch.setattr(runtime, "MAX_MESSAGE_BYTES", limit + runtime.DEAD_LETTER_ROOM_BYTES - 1)
    topics = Topics(prefix="big")
    stage = RunStage(topics, StageCounts(keep_step_ends=False), grace_s=5.0)
    for i, m in enumerate(reports):
        stage.fold(Rec(topics.steps, 0, i, b"r", encode_step_metrics(m)), 0.0)
    with caplog.at_level("ERROR", logger="profstream.processor"):
        out = stage.ready(0.0) + stage.ready(10.0)
    too_large = [s for s in sizes if s >= limit]
    dead = [o for o in out if o.topic == topics.dlq]
    assert len(dead) == len(too_large) >= 2
    assert all(dict(o.headers)["reason"] == b"too_large" for o in dead)
    assert sorted(int(dict(o.headers)["truncated_from"]) for o in dead) == sorted(too_large)
    assert [o.value for o in out if o.topic == topics.run] and stage.counts.run_steps == 3
    assert stage.counts.decode_errors == {"too_large": len(too_large)}
    said = [r for r in caplog.records if "too_large" in r.getMessage()]
    assert len(said) == 1 and "over the" in said[0].getMessage()
    health = ProcessorHealth()
    health.commit(stage.counts)  # what the processor's /metrics says once the transaction commits
    errors = next(f for f in health.collect() if f.name == "profstream_decode_errors")
    assert {s.labels["reason"]: s.value for s in errors.samples if s.name.endswith("_total")}["too_large"] == len(too_large)


def _untimed(reports: list[dict]) -> list[dict]:
    """``reports`` with rank 3's calls of step 0 without ends (gloo's Flight Recorder)."""
    out = []
    for m in reports:
        if m["rank"] == 3 and m["step"] == 0:
            c = unpack_calls(m["collectives"])
            m = {**m, "collectives": pack_calls(Calls(c.names, {**c.cols, "end_ns": c.cols["start_ns"] - 1}))}
        out.append(m)
    return out


def test_run_steps_written_as_v5_columns_read_as_the_v4_records_of_the_same_run_steps():
    """The RunStepMetrics main's run stage wrote (v4 and older, before the per-rank lists
    became columns) for these reports, kept in tests/data: the run stage now writes v5, and
    decoded it gives those records exactly (every rank's step time, wait, transfer, slowest
    call and clock offset; an untimed rank's figures null), from StepMetrics and from partials."""
    kept = json.loads((DATA / "runsteps-v4-of-reports.json").read_text())
    for name, reports in (("reports", _reports()), ("untimed", _untimed(_reports()))):
        v4 = [decode("RunStepMetrics", bytes.fromhex(x)) for x in kept[name]]
        by_step = [[m for m in reports if m["step"] == s] for s in range(3)]
        for messages in (_run([encode_step_metrics(m) for m in reports]),
                         _run([v for step in by_step for v in _partials(step, 3)])):
            assert {m[:10] for m in messages} == {VERSIONS[("RunStepMetrics", 5)].header}
            assert [decode("RunStepMetrics", m) for m in messages] == v4
    first = {name: decode("RunStepMetrics", bytes.fromhex(kept[name][0])) for name in kept}  # what was compared
    assert len(first["reports"]["clock_offsets"]) == RANKS and len(first["reports"]["step_times_ns"]) == RANKS
    assert {r["rank"]: r["transfer_ns"] for r in first["untimed"]["collective_ranks"]}[3] is None
