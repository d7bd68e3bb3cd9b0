"""Timeline files: Chrome Trace Event Format, figures equal to the truth, windows, safety."""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import threading
from collections import Counter, defaultdict, namedtuple
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import profstream.sinks.gzfile as gzfile
import profstream.sinks.timeline as timeline
from profstream.config import ConfigError
from profstream.control.records import STARTED, control_key, encode_status, new_request, new_status
from profstream.kafka.clients import make_consumer
from profstream.kafka.topics import Topics
from profstream.processors.assembler import RankAssembler
from profstream.processors.collectives import CollectiveCall, calls_of, step_collectives
from profstream.processors.model import StepEvents
from profstream.processors.utilization import utilization
from profstream.schema.batch import (
    COMMUNICATION,
    COMPUTE,
    I32,
    I64,
    SECTIONS,
    U8,
    WORK_COLUMNS,
    EventBatch,
    decode_batch,
    encode_batch,
)
from profstream.simulate import (
    QUEUE_CAPACITY,
    QUEUE_NAME,
    SIM_FLOPS_SPLIT,
    SimConfig,
    expected,
    plan_run,
    run_simulation,
)
from profstream.sinks.runner import SinkLoop
from profstream.sinks.timeline import (
    TID_COMM,
    TID_COMPUTE,
    TID_FREE,
    TID_PURE_COMM,
    TID_STEPS,
    TimelineSink,
    TimelineWriter,
    timeline_events,
)
from profstream.sinks.timeline_collectives import TID_COLLECTIVES
from tests.helpers import wait_until
from tests.test_collectives import _rank_batch
from tests.test_step_stage import Streams

Rec = namedtuple("Rec", "topic partition offset key value")
TOPIC = "t.raw"
ORIGIN = 1_790_000_000_123_456_789  # not a whole microsecond: ns must survive


# -- input: the simulator's steps as a Monitor batches them ------------------------------

def _columns(cfg: SimConfig, plan, lo: int, hi: int, types: list[str], last: bool) -> dict:
    """Ops [lo, hi) of a step, and with ``last`` its mark and samples, as batch sections."""
    code = {t: i for i, t in enumerate(types)}
    part = {"op_names": plan.names[lo:hi],
            "ops": {"name_idx": np.arange(hi - lo, dtype=I32),
                    "type_idx": np.array([code[t] for t in plan.op_types[lo:hi]], I32),
                    "kind": np.array(plan.kinds[lo:hi], U8), "stream": np.array(plan.streams[lo:hi], I32),
                    "step": np.full(hi - lo, plan.step, I64), "start_ns": np.array(plan.op_start_ns[lo:hi], I64),
                    "dur_ns": np.array(plan.op_dur_ns[lo:hi], I64)}}
    if last:
        one = lambda v: np.array([v], I64)  # noqa: E731
        mem = np.array(plan.memory, I64)
        q = np.array(plan.queue, I64)
        part["steps"] = {"step": one(plan.step), "start_ns": one(plan.start_ns), "end_ns": one(plan.end_ns),
                         "fp_start_ns": one(plan.fp_start_ns), "bp_end_ns": one(plan.bp_end_ns)}
        if plan.work is not None:  # as the Monitor records it: FLOPs given, or counted with their split
            w, counted = plan.work, plan.work["source"] == "counted"
            flops = w["flops"] if w["flops"] is not None else math.nan
            split = [flops * SIM_FLOPS_SPLIT["matmul"], math.nan, flops * SIM_FLOPS_SPLIT["conv"]] if counted \
                else [math.nan] * 3
            values = [w["tokens"], w["samples"], flops, (2 if counted else 1) if w["flops"] is not None else 0,
                      cfg.peak_tflops * 1e12 if cfg.peak_tflops else math.nan, *split]
            part["steps"].update((col, np.array([v], dtype)) for (col, dtype), v in zip(WORK_COLUMNS, values))
        part["memory"] = {"ts_ns": mem[:, 0], "step": np.full(len(mem), plan.step, I64), "allocated": mem[:, 1],
                          "reserved": mem[:, 2], "peak": mem[:, 3]}
        part["queues"] = {"name_idx": np.zeros(len(q), I32), "ts_ns": q[:, 0], "step": np.full(len(q), plan.step, I64),
                          "size": q[:, 1], "capacity": np.full(len(q), QUEUE_CAPACITY, I64)}
        if plan.devices:
            rows = [(ts, plan.step, *sample) for ts, sample in plan.devices]
            part["device_samples"] = {col: np.array([r[i] for r in rows], dtype)
                                      for i, (col, dtype) in enumerate(SECTIONS["device_samples"])}
    return part


def _batch(cfg: SimConfig, rank: int, seq: int, parts: list[dict], types: list[str], watermark) -> EventBatch:
    b = EventBatch(run_id=cfg.run_id, rank=rank, world_size=cfg.ranks, host=f"node-{rank}", device=f"cuda:{rank}",
                   producer_id=f"p{rank}", seq=seq, complete_through_step=watermark,
                   op_names=[n for p in parts for n in p["op_names"]], op_types=types, queue_names=[QUEUE_NAME])
    first_name = np.cumsum([0] + [len(p["op_names"]) for p in parts])  # name indexes into the joined names
    b.ops = {k: np.concatenate([p["ops"][k] + (first_name[i] if k == "name_idx" else 0) for i, p in enumerate(parts)])
             for k in parts[0]["ops"]}
    for section in ("steps", "memory", "queues", "device_samples"):
        cols = [p[section] for p in parts if section in p]
        if cols:
            setattr(b, section, {k: np.concatenate([c[k] for c in cols]) for k in cols[0]})
    return b


def sim_records(cfg: SimConfig, origin: int = ORIGIN) -> list[Rec]:
    """Raw-topic records of a simulated run, rank r on partition r % 2. As a Monitor
    sends them while steps run, a batch straddles two steps: the second half of step k
    (ops, mark, samples, watermark k), then the first half of step k + 1."""
    types = sorted({t for p in plan_run(cfg, origin) for t in p.op_types})
    pending: dict[int, list[dict]] = defaultdict(list)
    batches: list[EventBatch] = []
    seqs: Counter = Counter()

    def send(rank: int, watermark: int | None) -> None:
        batches.append(_batch(cfg, rank, seqs[rank], pending.pop(rank), types, watermark))
        seqs[rank] += 1

    for plan in plan_run(cfg, origin):
        half = len(plan.names) // 2
        pending[plan.rank].append(_columns(cfg, plan, 0, half, types, False))
        send(plan.rank, plan.step - 1 if plan.step > cfg.first_step else None)
        pending[plan.rank].append(_columns(cfg, plan, half, len(plan.names), types, True))
    for rank in list(pending):
        send(rank, cfg.first_step + cfg.steps - 1)
    offsets: Counter = Counter()
    out = []
    for b in batches:
        part = b.rank % 2
        out.append(Rec(TOPIC, part, offsets[part], b.key, encode_batch(b)))
        offsets[part] += 1
    return out


def closed_steps(cfg: SimConfig, rank: int = 0, origin: int = ORIGIN) -> list:
    """StepEvents of one rank as the RankAssembler closes them."""
    asm = RankAssembler(cfg.run_id, rank)
    out = []
    for rec in sim_records(cfg, origin):
        b = decode_batch(rec.value)
        if b.rank == rank:
            asm.add(b, 0.0, rec.offset)
            out += [ev for ev, _ in asm.close_ready(0.0)]
    return out


# -- reading files back ----------------------------------------------------------------

def read_trace(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def files(out: Path) -> list[Path]:
    return sorted(out.rglob("*.json.gz"))


def ns(us: float) -> int:
    return round(us * 1000)


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def check_trace_format(doc: dict) -> None:
    """The Trace Event Format's rules for the phases we write (JSON object format)."""
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    assert doc.get("displayTimeUnit", "ms") in ("ns", "ms")
    assert isinstance(doc.get("otherData", {}), dict)
    named_processes, named_threads, used = set(), set(), set()
    open_slices: dict = defaultdict(list)
    for e in doc["traceEvents"]:
        ph = e["ph"]
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and e["pid"] > 0, e
        if ph == "X":
            assert _number(e["ts"]) and _number(e["dur"]) and e["dur"] >= 0 and isinstance(e["tid"], int), e
            used.add((e["pid"], e["tid"]))
        elif ph == "C":
            assert _number(e["ts"]) and isinstance(e["args"], dict) and e["args"], e
            assert all(_number(v) for v in e["args"].values()), e
        elif ph == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index"), e
            if e["name"].startswith("thread"):
                assert isinstance(e["tid"], int), e
            if e["name"].endswith("_name"):
                assert isinstance(e["args"]["name"], str) and e["args"]["name"], e
            else:
                assert isinstance(e["args"]["sort_index"], int), e
            if e["name"] == "process_name":
                named_processes.add(e["pid"])
            if e["name"] == "thread_name":
                named_threads.add((e["pid"], e["tid"]))
        elif ph in ("B", "E"):
            stack = open_slices[(e["pid"], e["tid"])]
            if ph == "B":
                stack.append(e["name"])
            else:
                assert stack, f"E without B: {e}"
                stack.pop()
        else:
            raise AssertionError(f"unexpected phase {ph!r}: {e}")
    assert not any(open_slices.values()), "unbalanced B/E"
    assert used <= named_threads, f"threads without a name: {used - named_threads}"
    assert {pid for pid, _ in used} <= named_processes


def check_nesting(events: list[dict]) -> None:
    """Complete events on one thread never partly overlap (they nest or follow)."""
    by_thread = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_thread[(e["pid"], e["tid"])].append((ns(e["ts"]), -ns(e["dur"])))
    for thread, slices in by_thread.items():
        stack: list[int] = []
        for start, neg_dur in sorted(slices):
            while stack and stack[-1] <= start:
                stack.pop()
            end = start - neg_dur
            assert not stack or end <= stack[-1], f"partly overlapping slices on {thread} at {start}"
            stack.append(end)


def op_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e["ph"] == "X" and e["tid"] >= 100]


def all_events(out: Path) -> list[dict]:
    return [e for p in files(out) for e in read_trace(p)["traceEvents"] if e["ph"] != "M"]


def base_of(path: Path) -> int:
    return read_trace(path)["otherData"]["base_time_ns"]


def feed(sink: TimelineSink, records: list[Rec], chunk: int = 7) -> None:
    for i in range(0, len(records), chunk):
        sink.handle(records[i:i + chunk])
        sink.durable_offsets()


# -- the events --------------------------------------------------------------------------

CFG = SimConfig(run_id="tl", ranks=2, steps=12, ops_per_step=60, seed=3)


def test_files_follow_the_trace_event_format_and_nest_per_thread(tmp_path):
    sink = TimelineSink(tmp_path, window_steps=5)
    feed(sink, sim_records(CFG))
    sink.close()
    paths = files(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == [
        f"tl/rank-{r}/steps-{a}-{b}.json.gz" for r in (0, 1) for a, b in ((0, 4), (10, 11), (5, 9))]
    for p in paths:
        doc = read_trace(p)
        check_trace_format(doc)
        check_nesting(doc["traceEvents"])
        names = {(e["tid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "thread_name"}
        assert {(TID_STEPS, "Steps"), (TID_COMPUTE, "Overlap: merged compute"), (TID_FREE, "Overlap: free"),
                (100, "stream 0"), (101, "stream 1")} <= names
        rank = doc["otherData"]["rank"]
        process = next(e for e in doc["traceEvents"] if e["name"] == "process_name")
        assert process["args"]["name"] == f"tl rank {rank} (cuda:{rank} on node-{rank})"


def test_ops_keep_their_nanoseconds_type_and_step(tmp_path):
    sink = TimelineSink(tmp_path, window_steps=100)
    feed(sink, sim_records(CFG))
    sink.close()
    got = Counter()
    for p in files(tmp_path):
        doc = read_trace(p)
        base = doc["otherData"]["base_time_ns"]
        assert base % 86_400_000_000_000 == 0  # UTC midnight: ts stay small enough for float64
        for e in op_events(doc["traceEvents"]):
            assert e["name"] == e["args"]["op_type"]
            got[(doc["otherData"]["rank"], e["args"]["step"], e["name"], e["cat"], e["tid"] - 100,
                 base + ns(e["ts"]), ns(e["dur"]))] += 1
    want = Counter((p.rank, p.step, t, "compute" if k == 0 else "communication", s, start, dur)
                   for p in plan_run(CFG, ORIGIN)
                   for t, k, s, start, dur in zip(p.op_types, p.kinds, p.streams, p.op_start_ns, p.op_dur_ns))
    assert got == want


def test_steps_and_overlap_tracks_equal_the_simulator_truth(tmp_path):
    cfg = SimConfig(run_id="truth", ranks=2, steps=8, ops_per_step=80, seed=11, stall=(3, 4))
    sink = TimelineSink(tmp_path)
    feed(sink, sim_records(cfg))
    sink.close()
    sums: dict = defaultdict(Counter)
    memory, queue = Counter(), Counter()
    for p in files(tmp_path):
        rank = read_trace(p)["otherData"]["rank"]
        for e in read_trace(p)["traceEvents"]:
            if e["ph"] == "X" and e["tid"] < 100:
                sums[(rank, e["args"]["step"])][(e["tid"], e["name"].split()[0])] += ns(e["dur"])
            elif e["ph"] == "C":
                (memory if e["name"].startswith("memory") else queue)[(rank, e["name"])] += 1
    truth = expected(cfg)
    assert set(sums) == set(truth)
    for key, t in truth.items():
        s = sums[key]
        assert s[(TID_STEPS, "step")] == t["step_time_ns"], key
        assert s[(TID_STEPS, "data_wait")] == t["data_wait_ns"], key
        assert s[(TID_STEPS, "fp_bp")] == t["fp_bp_ns"], key
        assert s[(TID_STEPS, "tail")] == t["tail_ns"], key
        assert s[(TID_COMPUTE, "compute")] == t["compute_ns"], key
        assert s[(TID_COMM, "communication")] == t["comm_ns"], key
        assert s[(TID_PURE_COMM, "pure")] == t["pure_comm_ns"], key
        assert s[(TID_FREE, "free")] == t["idle_ns"], key
    # two memory samples (allocated, reserved, peak) and two queue samples per step
    assert memory == {(r, f"memory {k}"): 2 * cfg.steps for r in (0, 1) for k in ("allocated", "reserved", "peak")}
    assert queue == {(r, "queue device_queue"): 2 * cfg.steps for r in (0, 1)}


ops_strategy = st.lists(st.tuples(st.integers(0, 90), st.integers(0, 25), st.sampled_from([COMPUTE, COMMUNICATION])),
                        max_size=12)


@settings(max_examples=300, deadline=None)
@given(ops_strategy, st.integers(0, 40), st.integers(0, 60))
def test_overlap_tracks_cover_exactly_the_right_nanoseconds(ops, S, length):
    """Any ops (overlapping, outside the step, empty steps): each track is disjoint
    intervals covering exactly its nanoseconds, and the sums are utilization()'s figures;
    a step without ops (not captured) has no track, not a free one."""
    E = S + length
    ev = StepEvents(run_id="p", rank=0, step=0, start_ns=S, end_ns=E,
                    op_kind=np.array([k for _, _, k in ops], np.uint8), op_type=np.zeros(len(ops), np.int32),
                    op_stream=np.zeros(len(ops), np.int32), op_start_ns=np.array([a for a, _, _ in ops], np.int64),
                    op_dur_ns=np.array([d for _, d, _ in ops], np.int64), type_names=["t"])

    def mask(kind):
        m = np.zeros(200, bool)
        for a, d, k in ops:
            if k == kind:
                m[max(a, S):min(a + d, E)] = True
        return m

    step = np.zeros(200, bool)
    step[S:E] = bool(ops)
    want = [mask(COMPUTE), mask(COMMUNICATION), mask(COMMUNICATION) & ~mask(COMPUTE),
            step & ~mask(COMPUTE) & ~mask(COMMUNICATION)]
    for (start, end), expect in zip(timeline.overlap_tracks(ev), want):
        assert np.all(end > start) and np.all(start[1:] >= end[:-1])
        got = np.zeros(200, bool)
        for a, b in zip(start.tolist(), end.tolist()):
            got[a:b] = True
        assert np.array_equal(got, expect)
    figures = utilization(ev)
    sums = [int((e - s).sum()) for s, e in timeline.overlap_tracks(ev)]
    assert sums == [figures["compute_ns"] or 0, figures["comm_ns"] or 0, figures["pure_comm_ns"] or 0,
                    figures["idle_ns"] or 0]
    assert (figures["idle_ns"] is None) == (not ops)


@pytest.mark.parametrize("block_rows", [7, 32768])
def test_the_file_holds_exactly_timeline_events(tmp_path, monkeypatch, block_rows):
    monkeypatch.setattr(timeline, "_BLOCK_ROWS", block_rows)  # rows are rendered block by block
    steps = closed_steps(CFG, rank=1)
    (path,) = TimelineWriter(tmp_path).write(steps)
    key = lambda e: json.dumps(e, sort_keys=True)  # noqa: E731
    assert sorted(map(key, read_trace(path)["traceEvents"])) == sorted(map(key, timeline_events(steps)))


def test_an_event_before_the_base_midnight_is_written_with_its_sign(tmp_path):
    cfg = SimConfig(run_id="midnight", ranks=1, steps=2, ops_per_step=20, seed=1)
    origin = 1_790_035_200_000_000_000 + 2_000  # 2 us after a UTC midnight
    steps = closed_steps(cfg, 0, origin)
    steps[0].op_start_ns[0] = origin - 5_500  # starts 3.5 us before that midnight
    (path,) = TimelineWriter(tmp_path).write(steps)
    doc = read_trace(path)
    check_trace_format(doc)
    (early,) = [e for e in op_events(doc["traceEvents"]) if e["ts"] < 0]
    assert doc["otherData"]["base_time_ns"] + ns(early["ts"]) == origin - 5_500


# -- windows -------------------------------------------------------------------------------

def test_a_window_closes_after_n_steps_and_the_rest_on_close(tmp_path):
    cfg = SimConfig(run_id="rot", ranks=1, steps=25, ops_per_step=20, seed=2)
    sink = TimelineSink(tmp_path, window_steps=10)
    feed(sink, sim_records(cfg))
    assert [p.name for p in files(tmp_path)] == ["steps-0-9.json.gz", "steps-10-19.json.gz"]
    sink.close()
    assert [p.name for p in files(tmp_path)] == ["steps-0-9.json.gz", "steps-10-19.json.gz",
                                                 "steps-20-24.json.gz"]
    assert [read_trace(p)["otherData"]["steps"] for p in files(tmp_path)] == [10, 10, 5]


def test_the_size_cap_splits_windows_and_every_op_is_written_once(tmp_path):
    cap = 64 * 1024
    small = SimConfig(run_id="cap", ranks=1, steps=30, ops_per_step=40, seed=4)  # several steps per file
    big = SimConfig(run_id="big", ranks=1, steps=3, ops_per_step=1500, seed=4)  # a step > the cap
    sink = TimelineSink(tmp_path, window_steps=100, max_bytes=cap)
    feed(sink, sim_records(small) + sim_records(big))
    sink.close()
    for cfg in (small, big):
        paths = files(tmp_path / cfg.run_id)
        assert len(paths) > (1 if cfg is small else cfg.steps)
        seen = Counter()
        steps_seen = Counter()
        for p in paths:
            raw = gzip.decompress(p.read_bytes())
            assert len(raw) <= cap, f"{p.name}: {len(raw)} bytes of JSON"
            doc = json.loads(raw)
            check_trace_format(doc)
            base = doc["otherData"]["base_time_ns"]
            for e in op_events(doc["traceEvents"]):
                seen[(e["args"]["step"], e["name"], e["tid"], base + ns(e["ts"]), ns(e["dur"]))] += 1
            for e in doc["traceEvents"]:
                if e["ph"] == "X" and e["tid"] == TID_STEPS and e["name"].startswith("step "):
                    steps_seen[e["args"]["step"]] += 1
        want = Counter((p.step, t, 100 + s, start, dur) for p in plan_run(cfg, ORIGIN)
                       for t, s, start, dur in zip(p.op_types, p.streams, p.op_start_ns, p.op_dur_ns))
        assert seen == want  # nothing lost, nothing twice
        assert steps_seen == {s: 1 for s in range(cfg.steps)}
    parts = [p.name for p in files(tmp_path / "big")]
    assert parts[0].startswith("steps-0-0.part1of") and all(".part" in n for n in parts)


def test_the_writer_alone_packs_a_long_window_into_files_under_the_cap(tmp_path):
    cap = 48 * 1024
    cfg = SimConfig(run_id="offline", ranks=1, steps=20, ops_per_step=40, seed=9)
    steps = closed_steps(cfg)
    paths = TimelineWriter(tmp_path, max_bytes=cap).write(steps)
    assert len(paths) > 2
    ranges = []
    for p in paths:
        raw = gzip.decompress(p.read_bytes())
        assert len(raw) <= cap
        doc = json.loads(raw)
        first, last = doc["otherData"]["first_step"], doc["otherData"]["last_step"]
        assert p.name == f"steps-{first}-{last}.json.gz"
        ranges.append((first, last))
        per_step = Counter(e["args"]["step"] for e in op_events(doc["traceEvents"]))
        assert per_step == {s: cfg.ops_per_step for s in range(first, last + 1)}  # whole steps only
    assert [a for a, _ in ranges] == [0] + [b + 1 for _, b in ranges[:-1]] and ranges[-1][1] == cfg.steps - 1


def test_max_bytes_below_the_minimum_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="max_bytes"):
        TimelineSink(tmp_path, max_bytes=1000)


# -- durability and atomic writes ---------------------------------------------------------

def test_offsets_are_durable_only_once_their_steps_are_in_a_file(tmp_path):
    cfg = SimConfig(run_id="dur", ranks=2, steps=15, ops_per_step=20, seed=5)
    records = sim_records(cfg)
    sink = TimelineSink(tmp_path, window_steps=10)
    feed(sink, records)
    durable = sink.durable_offsets()
    # steps 10-14 wait in the window: their first batch is where a restart must read from
    first_unwritten = {(r.topic, r.partition): r.offset for r in reversed(records)
                       if max(_steps_of(r)) >= 10}
    assert durable == first_unwritten
    sink.close()
    assert sink.durable_offsets() == {(TOPIC, p): cfg.steps + 1 for p in (0, 1)}


class VisitEveryRank(TimelineSink):
    """The sink as it was before its close schedule: every rank visited, and every rank's
    pending offset looked at, on every poll."""

    def durable_offsets(self) -> dict[tuple[str, int], int]:
        now = self.clock()
        self.schedule.dirty.clear()
        for ident, rank in list(self.ranks.items()):
            self._close_ready(ident, now)
            if now - rank.assembler.last_seen >= self.idle_timeout_s:
                self._close_idle(ident)
        pending: dict[tuple[str, int], int] = {}
        for r in self.ranks.values():
            offset = r.pending_offset
            if offset is not None:
                where = (r.topic, r.assembler.partition)
                pending[where] = min(offset, pending.get(where, offset))
        return {where: min(position, pending.get(where, position)) for where, position in self._positions.items()}


def _written(out: Path) -> list[tuple[str, list[tuple[int, int]]]]:
    """Each file under ``out``: its path below ``out`` and the (rank, step) of its ops."""
    return [(str(p.relative_to(out)), sorted((read_trace(p)["otherData"]["rank"], e["args"]["step"])
                                             for e in op_events(read_trace(p)["traceEvents"])))
            for p in files(out)]


def test_the_sink_writes_and_commits_what_visiting_every_rank_does_poll_by_poll(tmp_path):
    """A seeded mix over 12 ranks: with and without watermarks, marks out of order, ranks
    that pause past the idle timeout and come back, a clock that steps back a little,
    captures that cut a rank's window. The files and the offsets the loop may commit are
    those of a sink that visits every rank."""
    topics = Topics(prefix="tlsame")
    rng = random.Random(23)
    now = [0.0]
    options = {"window_steps": 3, "grace_s": 2.0, "idle_timeout_s": 60.0, "clock": lambda: now[0],
               "control_topic": topics.control}
    lean, every = TimelineSink(tmp_path / "lean", **options), VisitEveryRank(tmp_path / "every", **options)
    feed_rec = Streams(topics)
    next_step = {rank: 0 for rank in range(12)}
    polls = 0
    for _ in range(1200):
        now[0] += rng.choice((0.0, 0.01, 0.3, 1.0, -0.05))
        rank = rng.randrange(12)
        if rank in (10, 11) and 40.0 < now[0] < 130.0:
            continue  # ranks 10 and 11 pause past the idle timeout, then come back
        step = next_step[rank]
        marks = [step] if rng.random() < 0.7 else []
        if marks and rng.random() < 0.1:
            marks = [step + 1, step]
        if marks:
            next_step[rank] = max(marks) + 1
        ops = [step, step + 1] if rng.random() < 0.3 else [step]
        rec = feed_rec(rank, ops_steps=ops, marks=marks, watermark=max(step - 1, 0) if rank % 3 else None)
        rec = rec._replace(partition=rank % 6)  # 2 ranks a partition: a rank's stale offset would show
        if rng.random() < 0.02:  # a capture of steps the rank's window may already hold
            first = max(step - rng.randrange(3), 0)
            status = new_status(new_request("r", steps=3), STARTED, rank, first_step=first, last_step=first + 2)
            feed_rec.offset += 1
            rec = Rec(topics.control, 0, feed_rec.offset, control_key("r"), encode_status(status))
        lean.handle([rec])
        every.handle([rec])
        if rng.random() < 0.6:
            polls += 1
            assert lean.durable_offsets() == every.durable_offsets(), f"poll {polls} at {now[0]:.2f}"
            assert lean.steps_written == every.steps_written, f"poll {polls} at {now[0]:.2f}"
    for later in (1.0, 2.0, 60.0, 63.0, 120.0):
        now[0] += later
        assert lean.durable_offsets() == every.durable_offsets()
    assert lean.ranks == {} and every.ranks == {}
    assert polls > 400 and lean.steps_written > 800
    cut = []  # files of fewer than 3 steps before a rank's last file: a capture cut them
    for rank_dir in {p.parent for p in files(tmp_path / "lean")}:
        ranges = sorted(tuple(map(int, p.name.split(".")[0].split("-")[1:3])) for p in rank_dir.glob("*.json.gz"))
        cut += [r for r in ranges[:-1] if r[1] - r[0] < 2]
    assert len(cut) >= 3, cut
    assert _written(tmp_path / "lean") == _written(tmp_path / "every")


def test_a_capture_that_cuts_a_window_lets_the_loop_commit_past_the_part_written(tmp_path):
    topics = Topics(prefix="tlcut")
    sink = TimelineSink(tmp_path, window_steps=10, control_topic=topics.control)
    feed_rec = Streams(topics)
    records = [feed_rec(0, ops_steps=[s], marks=[s], watermark=s)._replace(partition=0) for s in range(3)]
    sink.handle(records)
    assert sink.durable_offsets() == {(topics.raw, 0): 0}  # steps 0-2 wait in the window
    status = new_status(new_request("r", steps=3), STARTED, 0, first_step=2, last_step=4)
    sink.handle([Rec(topics.control, 0, 0, control_key("r"), encode_status(status))])
    assert [p.name for p in files(tmp_path)] == ["steps-0-1.json.gz"]  # the steps before the capture
    assert sink.durable_offsets() == {(topics.raw, 0): 2, (topics.control, 0): 1}  # step 2 is not in a file


def _steps_of(rec: Rec) -> set[int]:
    b = decode_batch(rec.value)
    return set(b.ops["step"].tolist()) | set(b.steps["step"].tolist())


def test_a_restart_reads_from_the_durable_offset_and_writes_no_step_twice(tmp_path):
    cfg = SimConfig(run_id="restart", ranks=2, steps=25, ops_per_step=20, seed=6)
    records = sim_records(cfg)
    first = TimelineSink(tmp_path, window_steps=10)
    feed(first, records[: len(records) * 2 // 3])
    durable = first.durable_offsets()
    before = {p: p.stat().st_mtime_ns for p in files(tmp_path)}
    assert before  # some windows were written before the "crash" (no close)
    second = TimelineSink(tmp_path, window_steps=10)
    feed(second, [r for r in records if r.offset >= durable[(r.topic, r.partition)]])
    second.close()
    assert {p: p.stat().st_mtime_ns for p in before} == before  # nothing rewritten
    seen = Counter((read_trace(p)["otherData"]["rank"], e["args"]["step"], ns(e["ts"]))
                   for p in files(tmp_path) for e in op_events(read_trace(p)["traceEvents"]))
    assert set(seen.values()) == {1}
    assert len(seen) == cfg.ranks * cfg.steps * cfg.ops_per_step


def test_each_partition_is_held_at_its_own_first_batch_not_in_a_file(tmp_path):
    """What the sink lets its loop commit: per partition, up to the first batch whose steps
    are not in a file yet, whatever the other partitions hold; once the ranks went idle and
    their steps were written, up to what was read."""
    cfg = SimConfig(run_id="held", ranks=4, steps=6, ops_per_step=20, seed=8)
    apart = {0: 0, 1: 1000}  # the partitions' offsets apart: one cannot pass for the other
    records = [r._replace(offset=r.offset + apart[r.partition]) for r in sim_records(cfg)]
    now = [0.0]
    sink = TimelineSink(tmp_path, window_steps=100, idle_timeout_s=60, clock=lambda: now[0])
    sink.handle(records)
    first, read = {}, {}
    for r in records:
        first.setdefault((r.topic, r.partition), r.offset)
        read[(r.topic, r.partition)] = r.offset + 1
    assert sink.durable_offsets() == first  # every step waits for its 100-step window
    assert files(tmp_path) == []
    now[0] = 61.0
    assert sink.durable_offsets() == read
    assert len(files(tmp_path)) == cfg.ranks


def test_a_file_appears_complete_under_its_name_or_not_at_all(tmp_path, monkeypatch):
    steps = closed_steps(CFG, rank=0)
    real_replace = os.replace
    renames = []

    def replace(src, dst):
        src, dst = Path(src), Path(dst)
        assert not src.name.endswith(".json.gz") and src.name.startswith(".")
        assert not dst.exists()
        assert [p.name for p in dst.parent.glob("*.json.gz")] == []
        check_trace_format(json.loads(gzip.decompress(src.read_bytes())))  # complete before the rename
        renames.append(dst.name)
        real_replace(src, dst)

    monkeypatch.setattr(timeline.os, "replace", replace)
    TimelineWriter(tmp_path).write(steps)
    assert renames == ["steps-0-11.json.gz"]


def test_a_failed_write_leaves_no_file_and_no_temporary(tmp_path, monkeypatch):
    class BrokenDeflate:
        DEFLATED = 8

        @staticmethod
        def compressobj(*args):
            class C:
                calls = 0

                def compress(self, data):
                    C.calls += 1
                    if C.calls == 2:
                        raise OSError(28, "No space left on device")
                    return b"x"

            return C()

    cfg = SimConfig(run_id="full", ranks=1, steps=3, ops_per_step=20, seed=7)
    records = sim_records(cfg)
    sink = TimelineSink(tmp_path, window_steps=2)
    monkeypatch.setattr(gzfile, "_deflate", BrokenDeflate)
    with pytest.raises(OSError, match="No space"):
        feed(sink, records, chunk=len(records))
    assert [p.name for p in (tmp_path / "full" / "rank-0").iterdir()] == []
    assert sink.durable_offsets() == {(TOPIC, 0): 0}  # nothing is committed past the lost file


# -- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("run_id", ["../escape", "..", "/etc/cron.d/x", "a/../../b", ".hidden", "x" * 200,
                                    "run\nid", ""])
def test_a_hostile_run_id_never_writes_outside_the_output_directory(tmp_path, run_id):
    out = tmp_path / "out"
    out.mkdir()
    records = sim_records(SimConfig(run_id=run_id, ranks=1, steps=2, ops_per_step=10, seed=1))
    sink = TimelineSink(out, window_steps=1)
    feed(sink, records)
    sink.close()
    # refused when decoded (a name no Monitor would send), or else by the path check
    assert sink.decode_errors["invalid_name"] + sink.rejected_batches == len(records)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert list(out.rglob("*")) == []


def test_a_link_under_the_output_directory_cannot_lead_outside(tmp_path):
    out, outside = tmp_path / "out", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    (out / "linked").symlink_to(outside)
    cfg = SimConfig(run_id="linked", ranks=1, steps=2, ops_per_step=10, seed=1)
    sink = TimelineSink(out, window_steps=1)
    feed(sink, sim_records(cfg))
    assert sink.rejected_batches > 0 and list(outside.iterdir()) == []

    # a link planted after the rank's first batch is caught when the file is written
    cfg = SimConfig(run_id="later", ranks=1, steps=2, ops_per_step=10, seed=1)
    records = sim_records(cfg)
    sink = TimelineSink(out, window_steps=10)
    feed(sink, records[:1])
    (out / "later").symlink_to(outside)
    feed(sink, records[1:])
    sink.close()
    assert sink.rejected_steps == 2 and list(outside.iterdir()) == []


def test_undecodable_messages_are_counted_and_skipped(tmp_path):
    cfg = SimConfig(run_id="mixed", ranks=1, steps=4, ops_per_step=20, seed=8)
    good = sim_records(cfg)
    bad = [b'{"op": "matmul"}', good[0].value[:20], b"\xc3\x01" + b"\x13" * 8 + good[0].value[10:]]
    records, offset = [], 0
    for value in [*bad[:1], *(r.value for r in good[:3]), *bad[1:], *(r.value for r in good[3:])]:
        records.append(Rec(TOPIC, 0, offset, b"mixed/0", value))
        offset += 1
    sink = TimelineSink(tmp_path, window_steps=10)
    feed(sink, records)
    sink.close()
    assert sink.decode_errors == {"not_avro": 1, "truncated": 1, "unknown_fingerprint": 1}
    (path,) = files(tmp_path)
    assert len(op_events(read_trace(path)["traceEvents"])) == cfg.steps * cfg.ops_per_step
    assert sink.durable_offsets() == {(TOPIC, 0): len(records)}


def test_the_cli_refuses_a_bad_size_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from profstream.cli import app

    result = CliRunner().invoke(app, ["sink", "timeline", "--bootstrap", "127.0.0.1:1", "--out", str(tmp_path),
                                      "--max-bytes", "lots"])
    assert result.exit_code == 2
    assert "--max-bytes" in result.output and "expected a size" in result.output


# -- end to end, real broker ------------------------------------------------------------

def test_end_to_end_from_the_raw_topic_to_files(kafka_bootstrap, topics, tmp_path):
    cfg = SimConfig(run_id="e2e", ranks=2, steps=30, ops_per_step=40, seed=12)
    run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
    group = f"tl-{topics.prefix}"
    sink = TimelineSink(tmp_path, window_steps=10)
    loop = SinkLoop(kafka_bootstrap, [topics.raw], group, sink)
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop.run(stop)
        except BaseException as e:  # surfaced below
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(files(tmp_path)) >= 6 or errors, 90, "6 timeline files")
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors
    assert [p.relative_to(tmp_path).as_posix() for p in files(tmp_path)] == [
        f"e2e/rank-{r}/steps-{a}-{a + 9}.json.gz" for r in (0, 1) for a in (0, 10, 20)]
    truth = expected(cfg)
    compute = Counter()
    for p in files(tmp_path):
        doc = read_trace(p)
        check_trace_format(doc)
        rank = doc["otherData"]["rank"]
        assert Counter(e["args"]["step"] for e in op_events(doc["traceEvents"])) == {
            s: cfg.ops_per_step for s in range(doc["otherData"]["first_step"], doc["otherData"]["last_step"] + 1)}
        for e in doc["traceEvents"]:
            if e["ph"] == "X" and e["tid"] == TID_COMPUTE:
                compute[(rank, e["args"]["step"])] += ns(e["dur"])
    assert compute == {k: t["compute_ns"] for k, t in truth.items()}
    # every raw message is in a file: the group's committed offsets reach the end
    consumer = make_consumer(kafka_bootstrap, group_id=group)
    try:
        from kafka import TopicPartition

        tps = [TopicPartition(topics.raw, p) for p in consumer.partitions_for_topic(topics.raw)]
        ends = consumer.end_offsets(tps)
        committed = {tp: consumer.committed(tp) or 0 for tp in tps}
    finally:
        consumer.close()
    assert committed == ends


def test_a_device_window_gets_a_device_steps_track_beside_the_host_steps(tmp_path):
    """A lagging device whose steps launch copies and kernels early, while the previous
    step's work still runs (tests/kineto_traces.py): the host Steps track keeps [S, E], the
    Device steps track shows the step and its phases on the device's window, one window
    after the other with neither gap nor overlap, and the overlap tracks cover that window;
    the file writer renders the same events."""
    from profstream.integrations.ingest import load_profile
    from profstream.integrations.ingest.batches import profile_batches
    from profstream.offline.analyze import analyze
    from profstream.sinks.timeline import TID_DEVICE_STEPS
    from tests.kineto_traces import lagging_device_trace

    path = lagging_device_trace(steps=4, lag=0.8, seed=3, early=True).write(tmp_path / "trace.json")
    metrics = {s["step"]: s for s in analyze([path], "dev").steps}
    now = [0.0]
    sink = TimelineSink(tmp_path / "out", window_steps=100, idle_timeout_s=60.0, clock=lambda: now[0])
    records = [Rec(TOPIC, 0, i, b"dev/0", encode_batch(b))
               for i, b in enumerate(profile_batches(load_profile(path), "dev", 0))]
    feed(sink, records)
    now[0] = 61.0  # the rank falls idle: step 4 closes with what it has
    assert sink.durable_offsets() == {(TOPIC, 0): records[-1].offset + 1}
    sink.close()
    (path_out,) = files(tmp_path / "out")
    doc = read_trace(path_out)
    check_trace_format(doc)
    check_nesting(doc["traceEvents"])
    base = doc["otherData"]["base_time_ns"]
    names = {(e["tid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert (TID_DEVICE_STEPS, "Device steps") in names and (TID_STEPS, "Steps") in names
    tracks: dict = defaultdict(dict)
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["tid"] < 100:
            tracks[(e["tid"], e["args"]["step"])].setdefault(e["name"].split()[0], []).append(
                (base + ns(e["ts"]), ns(e["dur"])))
    assert sorted(metrics) == [1, 2, 3, 4]
    for step, m in metrics.items():
        host, device = tracks[(TID_STEPS, step)], tracks[(TID_DEVICE_STEPS, step)]
        assert host == {"step": [(m["start_ns"], m["end_ns"] - m["start_ns"])]}  # no phases on the host's
        assert device["step"] == [(m["device_start_ns"], m["step_time_ns"])]
        if step > 1:  # each device step starts where the one before ended
            before = tracks[(TID_DEVICE_STEPS, step - 1)]["step"][0]
            assert device["step"][0][0] == before[0] + before[1]
        assert [device[p][0][1] for p in ("data_wait", "fp_bp", "tail")] == [
            m["data_wait_ns"], m["fp_bp_ns"], m["tail_ns"]]
        assert sum(d for _, d in tracks[(TID_COMPUTE, step)]["compute"]) == m["compute_ns"]
        assert sum(d for _, d in tracks[(TID_FREE, step)]["free"]) >= m["idle_ns"]  # free: no compute nor comm
        for tid in (TID_COMPUTE, TID_COMM, TID_FREE):
            for ts, dur in next(iter(tracks[(tid, step)].values()), []):
                assert m["device_start_ns"] <= ts and ts + dur <= m["device_end_ns"]


def test_device_counters_are_counter_tracks_per_device_with_the_values_read(tmp_path):
    cfg = SimConfig(run_id="dev", ranks=2, steps=4, ops_per_step=20, seed=5, device_counters=True, throttle=(2, 2))
    sink = TimelineSink(tmp_path)
    feed(sink, sim_records(cfg))
    sink.close()
    got: dict = defaultdict(list)
    for p in files(tmp_path):
        doc = read_trace(p)
        check_trace_format(doc)
        rank = doc["otherData"]["rank"]
        for e in doc["traceEvents"]:
            if e["ph"] == "C" and e["name"].startswith("cuda:"):
                got[(rank, e["name"])].append((doc["otherData"]["base_time_ns"] + ns(e["ts"]), e["args"]))
    for plan in plan_run(cfg, ORIGIN):
        for ts, s in plan.devices:
            d = f"cuda:{plan.rank}"
            for name, args in ((f"{d} power", {"watts": s.power_w}), (f"{d} temperature", {"celsius": s.temperature_c}),
                               (f"{d} utilization", {"gpu %": pytest.approx(s.gpu_util * 100),
                                                     "memory %": pytest.approx(s.mem_util * 100)}),
                               (f"{d} NVLink", {"rx bytes/s": s.nvlink_rx, "tx bytes/s": s.nvlink_tx}),
                               (f"{d} throttled", {"power": 0, "thermal": int(plan.step == 2)})):
                assert (ts, args) in got[(plan.rank, name)], (plan.rank, plan.step, name)
    assert all(len(v) == 2 * cfg.steps for v in got.values())  # two readings per step, none twice


def test_throughput_tokens_mfu_and_achieved_flops_are_counter_tracks_at_each_steps_start(tmp_path):
    """Counter tracks of the steps' work (timeline_work.py): tokens/s and samples/s, MFU in
    percent, achieved TFLOP/s (per op category on captured steps), each at its step's start
    with the simulator's values; a run without work figures has none of these tracks."""
    cfg = SimConfig(run_id="work", ranks=2, steps=5, ops_per_step=20, seed=5, batch_size=4, seq_len=128,
                    variable_tokens=True, flops_per_token=6e8, flops_source="counted", peak_tflops=2.0)
    sink = TimelineSink(tmp_path / "work")
    feed(sink, sim_records(cfg))
    sink.close()
    got: dict = defaultdict(dict)
    for p in files(tmp_path / "work"):
        doc = read_trace(p)
        check_trace_format(doc)
        for e in doc["traceEvents"]:
            if e["ph"] == "C" and e["name"] in ("throughput", "MFU", "achieved TFLOP/s"):
                got[(doc["otherData"]["rank"], e["name"])][doc["otherData"]["base_time_ns"] + ns(e["ts"])] = e["args"]
    truth = expected(cfg, ORIGIN)
    for plan in plan_run(cfg, ORIGIN):
        w = truth[(plan.rank, plan.step)]["work"]
        at = plan.start_ns
        assert got[(plan.rank, "throughput")][at] == {"tokens/s": pytest.approx(w["tokens_per_s"]),
                                                      "samples/s": pytest.approx(w["samples_per_s"])}
        assert got[(plan.rank, "MFU")][at] == {"MFU %": pytest.approx(w["mfu"] * 100)}
        achieved = {"model": pytest.approx(w["flops_per_s"] / 1e12)}
        achieved.update((c, pytest.approx(v[2] / 1e12)) for c, v in w["op_categories"].items())
        assert got[(plan.rank, "achieved TFLOP/s")][at] == achieved
    plain = SimConfig(run_id="plain", ranks=1, steps=3, ops_per_step=20, seed=5)
    sink = TimelineSink(tmp_path / "plain")
    feed(sink, sim_records(plain))
    sink.close()
    names = {e.get("name") for p in files(tmp_path / "plain") for e in read_trace(p)["traceEvents"] if e["ph"] == "C"}
    assert not names & {"throughput", "MFU", "achieved TFLOP/s"}


def test_each_collective_is_split_into_wait_and_transfer_on_the_collectives_track(tmp_path):
    # three ranks; rank 2 enters step 0's all_reduce 40 ms after rank 0 and 30 ms after rank 1;
    # rank 2 never makes the broadcast; in step 1 all arrive together
    calls = {0: [("all_reduce", 0, 1, 10, 50), ("broadcast", 0, 2, 70, 5), ("all_reduce", 1, 3, 110, 10)],
             1: [("all_reduce", 0, 1, 20, 40), ("broadcast", 0, 2, 70, 5), ("all_reduce", 1, 3, 110, 10)],
             2: [("all_reduce", 0, 1, 50, 10), ("all_reduce", 1, 3, 110, 10)]}
    got = {r: [(e["args"]["step"], e["name"], e["cat"], e["ts_ns"], ns(e["dur"])) for e in events]
           for r, events in _collective_track(tmp_path, calls, [0, 1], 3, "coll").items()}
    ms = 1_000_000
    assert sorted(got[0]) == [(0, "all_reduce", "collective_transfer", 50 * ms, 10 * ms),
                              (0, "broadcast (not matched)", "collective", 70 * ms, 5 * ms),
                              (0, "wait for rank 2 (all_reduce)", "collective_wait", 10 * ms, 40 * ms),
                              (1, "all_reduce", "collective_transfer", 110 * ms, 10 * ms)]
    assert sorted(got[1])[2] == (0, "wait for rank 2 (all_reduce)", "collective_wait", 20 * ms, 30 * ms)
    assert sorted(got[2]) == [(0, "all_reduce", "collective_transfer", 50 * ms, 10 * ms),
                              (1, "all_reduce", "collective_transfer", 110 * ms, 10 * ms)]
    # the wait slices add up to the processors' wait per rank
    figures = step_collectives({r: calls_of([CollectiveCall(c, "0", 3, seq, 4000, start * ms, (start + dur) * ms)
                                             for c, step, seq, start, dur in cs if step == 0])
                                for r, cs in calls.items()}, range(3))
    waits = {r["rank"]: r["wait_ns"] for r in figures["collective_ranks"]}
    for rank in range(3):
        assert sum(d for step, _, cat, _, d in got[rank] if cat == "collective_wait" and step == 0) == waits[rank]


def _collective_track(tmp_path, calls: dict, steps: list[int], world: int, run_id: str) -> dict[int, list[dict]]:
    """The Collectives track's slices per rank, of ranks' batches of ``calls`` through a sink
    (every file checked for the trace format), their ``ts`` made absolute in ns."""
    sink = TimelineSink(tmp_path)
    sink.handle([Rec(TOPIC, 0, r, None, _rank_batch(r, steps, c, world=world, run_id=run_id))
                 for r, c in calls.items()])
    sink.close()
    got: dict = defaultdict(list)
    for p in files(tmp_path):
        doc = read_trace(p)
        check_trace_format(doc)
        rank, base = doc["otherData"]["rank"], doc["otherData"]["base_time_ns"]
        events = [{**e, "ts_ns": ns(e["ts"]) + base} for e in doc["traceEvents"]
                  if e["ph"] == "X" and e["tid"] == TID_COLLECTIVES]
        if events:  # a named track
            assert {"ph": "M", "name": "thread_name", "pid": rank + 1, "tid": TID_COLLECTIVES,
                    "args": {"name": "Collectives: wait / transfer"}} in doc["traceEvents"]
        got[rank] += events
    return got


def test_calls_without_an_end_show_their_waits_and_no_transfer(tmp_path):
    # gloo's always-on records keep no end (dur -1): rank 1 waits 30 ms for rank 0; no
    # transfer slice, and an unmatched call is an instant, never a slice of negative length
    calls = {0: [("all_reduce", 0, 1, 40, -1e-6)], 1: [("all_reduce", 0, 1, 10, -1e-6), ("broadcast", 0, 2, 60, -1e-6)]}
    got = {r: [(e["name"], e["ts_ns"], ns(e["dur"])) for e in events]
           for r, events in _collective_track(tmp_path, calls, [0], 2, "untimed").items()}
    ms = 1_000_000
    assert got.get(0, []) == []
    assert sorted(got[1]) == [("broadcast (not matched)", 60 * ms, 0), ("wait for rank 0 (all_reduce)", 10 * ms, 30 * ms)]


def test_a_run_whose_ranks_all_went_idle_leaves_no_collective_arrivals_behind(tmp_path):
    """A long-lived sink sees run after run: a run's record of collective arrivals goes
    when its last rank here goes idle, not before, and another run's stays."""
    now = [0.0]
    sink = TimelineSink(tmp_path, idle_timeout_s=60.0, clock=lambda: now[0])
    call = [("all_reduce", 0, 1, 10, 50)]
    sink.handle([Rec(TOPIC, 0, r, None, _rank_batch(r, [0], call, run_id="old")) for r in range(3)])
    now[0] = 30.0
    sink.handle([Rec(TOPIC, 0, 3, None, _rank_batch(0, [0], call, world=1, run_id="new"))])
    sink.handle([Rec(TOPIC, 0, 4, None, _rank_batch(2, [1], [("all_reduce", 1, 2, 110, 10)], run_id="old"))])
    now[0] = 61.0  # ranks 0 and 1 of "old" are idle, its rank 2 is not
    sink.durable_offsets()
    assert set(sink.arrivals) == {"old", "new"}
    now[0] = 91.0  # "new" and the rest of "old" are idle
    sink.durable_offsets()
    assert sink.arrivals == {} and sink.ranks == {}


def test_a_call_not_yet_seen_on_every_rank_is_one_unsplit_slice(tmp_path):
    # rank 1's batch reaches the sink after rank 0's steps were written: no split for rank 0
    sink = TimelineSink(tmp_path, window_steps=1)
    sink.handle([Rec(TOPIC, 0, 0, None, _rank_batch(0, [0], [("all_reduce", 0, 1, 10, 50)], world=2, run_id="lag"))])
    sink.handle([Rec(TOPIC, 0, 1, None, _rank_batch(1, [0], [("all_reduce", 0, 1, 40, 20)], world=2, run_id="lag"))])
    sink.close()
    names = {read_trace(p)["otherData"]["rank"]: [e["name"] for e in read_trace(p)["traceEvents"]
                                                  if e["ph"] == "X" and e["tid"] == TID_COLLECTIVES]
             for p in files(tmp_path)}
    assert names == {0: ["all_reduce (not matched)"], 1: ["all_reduce"]}


def test_rank_tracks_are_drawn_on_the_runs_clock_once_its_offsets_are_known(tmp_path):
    """The calls of the test above, recorded on clocks 0, +5 and -5 ms off, with the run
    stage's offsets read first from the run topic: every rank's Steps and Collectives
    slices are those of the unshifted run (ns for ns, the offsets being exact here), and
    each file says the offset it applied."""
    from profstream.schema.codec import encode_run_step_metrics
    from tests.test_collectives import _hang_run

    calls = {0: [("all_reduce", 0, 1, 10, 50), ("broadcast", 0, 2, 70, 5), ("all_reduce", 1, 3, 110, 10)],
             1: [("all_reduce", 0, 1, 20, 40), ("broadcast", 0, 2, 70, 5), ("all_reduce", 1, 3, 110, 10)],
             2: [("all_reduce", 0, 1, 50, 10), ("all_reduce", 1, 3, 110, 10)]}
    shifts = {0: 0.0, 1: 5.0, 2: -5.0}
    ms = 1_000_000
    run_step = {**_hang_run()[1][0], "run_id": "coll",
                "clock_offsets": [{"rank": r, "offset_ns": int(s * ms), "error_ns": 100_000} for r, s in shifts.items()]}

    def slices(out: Path, shifted: bool) -> dict:
        sink = TimelineSink(out, run_topic="t.run")
        if shifted:
            sink.handle([Rec("t.run", 0, 0, None, encode_run_step_metrics(run_step))])
        sink.handle([Rec(TOPIC, 0, r, None, _rank_batch(r, [0, 1], c, run_id="coll",
                                                        shift_ms=shifts[r] if shifted else 0.0))
                     for r, c in calls.items()])
        sink.close()
        got: dict = defaultdict(list)
        for p in files(out):
            doc = read_trace(p)
            check_trace_format(doc)
            rank, other = doc["otherData"]["rank"], doc["otherData"]
            assert other.get("clock_offset_ns") == (int(shifts[rank] * ms) if shifted else None)
            got[rank] += sorted((e["args"]["step"], e["name"], e["tid"], ns(e["ts"]) + other["base_time_ns"],
                                 ns(e["dur"])) for e in doc["traceEvents"]
                                if e["ph"] == "X" and e["tid"] in (TID_COLLECTIVES, TID_STEPS))
        return got

    plain, shifted = slices(tmp_path / "plain", False), slices(tmp_path / "shifted", True)
    assert plain == shifted
    assert (0, "wait for rank 2 (all_reduce)", TID_COLLECTIVES, 10 * ms, 40 * ms) in shifted[0]
