"""``profstream analyze TRACE...``: the figures of existing profiles in one process, no broker.

Each trace (one file per rank, or a directory of them; a MindSpore profiler directory
gives one profile per rank it holds) is read by ingest (``load_profile``) and turned into
the raw batches a live producer would have sent (``profile_batches``); the processors'
own entry point (``processors.stream.figures``) computes StepMetrics, RunStepMetrics and
alerts from them, exactly as the live processors would. The ranks' batches are fed
interleaved by their step ends, so that the cross-rank stage sees them as it would live.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from profstream.config import check_name
from profstream.integrations.ingest import IngestError, Profile, load_profile, sniff
from profstream.integrations.ingest.batches import profile_batches
from profstream.processors.stream import (
    ALERTS,
    DEAD_LETTERS,
    RUN,
    STEPS,
    RawMessage,
    StreamOptions,
    figures,
)
from profstream.schema.batch import EventBatch, encode_batch
from profstream.schema.codec import decode
from profstream.schema.names import is_valid_name

TRACE_SUFFIXES = (".json", ".json.gz")


@dataclass
class RankProfile:
    rank: int
    profile: Profile


@dataclass
class AnalyzeResult:
    run_id: str
    ranks: list[RankProfile]
    steps: list[dict] = field(default_factory=list)  # StepMetrics, sorted by (rank, step)
    run_steps: list[dict] = field(default_factory=list)  # RunStepMetrics, sorted by step
    alerts: list[dict] = field(default_factory=list)
    dead_letters: int = 0
    messages: int = 0
    ops: int = 0
    parse_s: float = 0.0
    figures_s: float = 0.0


def trace_paths(paths: list[Path]) -> list[tuple[Path, str]]:
    """(path, format) of each profile to read: a file as it is; a directory holding a
    MindSpore step trace as a MindSpore profiler directory; another directory's trace
    files (``*.json``, ``*.json.gz``), each a rank. IngestError when there is nothing."""
    found: list[tuple[Path, str]] = []
    for path in paths:
        if not path.exists():
            raise IngestError(f"{path}: no such file or directory")
        if path.is_dir():
            try:
                from profstream.integrations.ingest.mindspore_dir import find_profiler_dir

                find_profiler_dir(path)
                found.append((path, "mindspore"))
                continue
            except IngestError:
                pass
            files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES))
            if not files:
                raise IngestError(f"{path}: no trace files (*.json, *.json.gz) and no MindSpore step trace here")
            found.extend((f, "chrome") for f in files)
        else:
            found.append((path, sniff(path)))
    return found


def load_ranks(paths: list[Path], workers: int | None = None) -> list[RankProfile]:
    """Every rank's profile from ``paths``: ranks as the files name them (Kineto's
    ``distributedInfo``, MindSpore's file names), else in the order given. Two profiles of
    one rank are an error. Calls without a group size (HCCL's) get the number of profiles
    holding calls of their group."""
    from profstream.integrations.ingest.hccl import fill_group_sizes

    profiles: list[Profile] = []
    for path, fmt in trace_paths(paths):
        if fmt == "mindspore":
            from profstream.integrations.ingest.mindspore_dir import find_profiler_dir, rank_of

            _, files = find_profiler_dir(path)
            profiles.extend(load_profile(path, "mindspore", rank_of(f)) for f in files)
        else:
            profiles.append(load_profile(path, fmt, workers=workers))
    fill_group_sizes(profiles)  # HCCL calls carry none: the ranks given that hold the group
    taken = {p.rank for p in profiles if p.rank is not None}
    free = (r for r in itertools.count() if r not in taken)
    ranks: dict[int, RankProfile] = {}
    for p in profiles:
        rank = p.rank if p.rank is not None else next(free)
        if rank in ranks:
            raise IngestError(f"{p.path} and {ranks[rank].profile.path} are both rank {rank}: give one trace per rank")
        ranks[rank] = RankProfile(rank, p)
    return [ranks[r] for r in sorted(ranks)]


def rank_messages(ranks: list[RankProfile], run_id: str, device: str = "",
                  on_batch: Callable[[EventBatch], None] | None = None) -> Iterator[RawMessage]:
    """The raw messages of every rank, each rank on a partition of its own, interleaved by
    the producer clock of their batches (``sent_ns``: the step's end)."""
    def of_rank(i: int, r: RankProfile) -> Iterator[tuple[float, int, RawMessage]]:
        host = r.profile.host if r.profile.host and is_valid_name(r.profile.host) else ""
        key = f"{run_id}/{r.rank}".encode()
        for offset, batch in enumerate(profile_batches(r.profile, run_id, r.rank, host, device, len(ranks))):
            if on_batch is not None:
                on_batch(batch)
            clock = batch.sent_ns / 1e9
            yield clock, i, RawMessage(clock, i, offset, key, encode_batch(batch))

    for _, _, message in heapq.merge(*(of_rank(i, r) for i, r in enumerate(ranks)), key=lambda t: t[:2]):
        yield message


def analyze(paths: list[Path | str], run_id: str = "analyze", options: StreamOptions | None = None,
            workers: int | None = None, device: str = "",
            on_batch: Callable[[EventBatch], None] | None = None) -> AnalyzeResult:
    """The figures of the profiles at ``paths`` (see the module docstring). ``on_batch``
    sees every raw batch (the op table of ``--parquet``)."""
    check_name(run_id, "run id")
    t0 = time.perf_counter()
    ranks = load_ranks([Path(p) for p in paths], workers)
    result = AnalyzeResult(run_id, ranks, parse_s=time.perf_counter() - t0)
    t1 = time.perf_counter()

    def counted(batch: EventBatch) -> None:
        result.messages += 1
        result.ops += batch.n("ops")
        if on_batch is not None:
            on_batch(batch)

    for f in figures(rank_messages(ranks, run_id, device, counted), options):
        if f.kind == STEPS:
            result.steps.append(decode("StepMetrics", f.value))
        elif f.kind == RUN:
            result.run_steps.append(decode("RunStepMetrics", f.value))
        elif f.kind == ALERTS:
            result.alerts.append(decode("Alert", f.value))
        elif f.kind == DEAD_LETTERS:
            result.dead_letters += 1
    result.steps.sort(key=lambda s: (s["rank"], s["step"]))
    result.run_steps.sort(key=lambda r: r["step"])
    result.alerts.sort(key=lambda a: (a["ts_ns"], -1 if a["rank"] is None else a["rank"]))
    result.figures_s = time.perf_counter() - t1
    return result


def rank_rows(result: AnalyzeResult) -> list[dict]:
    """The per-rank summary ``profstream analyze`` prints: the report's rank figures, the
    host step time beside the figures' own (the device's on a device window), and the
    device time by kind as shares of the device's busy time."""
    from profstream.offline.report import kind_shares, rank_summary

    rows = []
    for r in result.ranks:
        mine = [s for s in result.steps if s["rank"] == r.rank]
        row: dict = {"rank": r.rank, "path": str(r.profile.path), "source": r.profile.source}
        if mine:
            row.update(rank_summary(mine))
            row["mean_host_step_ms"] = sum(s["host_step_time_ns"] for s in mine) / len(mine) / 1e6
            row["device_steps"] = sum(s["device_end_ns"] is not None for s in mine)
            with_ops = [s for s in mine if s["idle_ns"] is not None]  # ops captured
            row["idle_share"] = (sum(s["idle_ns"] for s in with_ops) / total
                                 if (total := sum(s["step_time_ns"] for s in with_ops)) > 0 else math.nan)
            row["uncorrelated_ops"] = sum(s["uncorrelated_ops"] for s in mine)
            row["kinds"] = kind_shares(mine)
        rows.append(row)
    return rows


@dataclass
class AnalyzeOutputs:
    result: AnalyzeResult
    report: Path | None = None
    parquet: list[Path] = field(default_factory=list)


def analyze_to(paths: list[Path | str], report: Path | None = None, parquet_dir: Path | None = None,
               run_id: str = "analyze", options: StreamOptions | None = None, workers: int | None = None,
               device: str = "") -> AnalyzeOutputs:
    """``analyze``, then the HTML report at ``report`` and ``<run>.steps.parquet`` and
    ``<run>.ops.parquet`` in ``parquet_dir`` (each when given)."""
    from profstream.offline.export import OpTableWriter
    from profstream.offline.record_files import RecordWriter
    from profstream.offline.report import ReportData, write_report

    check_name(run_id, "run id")
    ops_writer = None
    if parquet_dir is not None:
        parquet_dir = Path(parquet_dir)
        parquet_dir.mkdir(parents=True, exist_ok=True)
        ops_writer = OpTableWriter(parquet_dir / f"{run_id}.ops.parquet")
    try:
        result = analyze(paths, run_id, options, workers, device, None if ops_writer is None else ops_writer.add)
    finally:
        if ops_writer is not None:
            ops_writer.close()
    outputs = AnalyzeOutputs(result)
    if parquet_dir is not None:
        steps_path = parquet_dir / f"{run_id}.steps.parquet"
        writer = RecordWriter(steps_path, "StepMetrics", "parquet")
        try:
            for s in result.steps:
                writer.write(s)
        finally:
            writer.close()
        outputs.parquet = [steps_path, parquet_dir / f"{run_id}.ops.parquet"]
    if report is not None:
        data = ReportData(run_id, Path(paths[0]) if len(paths) == 1 else Path(", ".join(map(str, paths))),
                          steps=result.steps, run_steps=result.run_steps, alerts=result.alerts,
                          messages=result.messages, events=result.ops)
        outputs.report = write_report(data, report)
    return outputs
