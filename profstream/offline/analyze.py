"""``profstream analyze TRACE...``: the figures of existing profiles in one process, no broker.

Each rank's profile (one file per rank, a directory of them, or profiler folders as their
profilers wrote them: ``ingest.layout``) is read by ingest (``read_found``) and turned into
the raw batches a live producer would have sent (``profile_batches``, with the end mark
that ``ingest``'s Monitor sends when it closes); the processors' own entry point
(``processors.stream.figures``) computes StepMetrics, RunStepMetrics and alerts from
them, exactly as the live processors would. The ranks' batches are fed
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
from profstream.integrations.ingest import IngestError, Profile, read_found
from profstream.integrations.ingest.batches import profile_batches
from profstream.integrations.ingest.layout import Found, find_profiles, group_files
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
    problems: list[str] = field(default_factory=list)  # profiles not read (one line each, naming the file)
    dead_letters: int = 0
    messages: int = 0
    ops: int = 0
    parse_s: float = 0.0
    figures_s: float = 0.0


def profile_paths(paths: list[Path]) -> list[Found]:
    """What to read for each rank in ``paths`` (``ingest.layout``): files one by one (msprof's
    per-iteration files of a device together), folders as their profiler wrote them.
    IngestError naming a path that holds no profile."""
    files = [p for p in paths if p.is_file()]
    found = group_files(files) if files else []
    for path in paths:
        if not path.is_file():
            found += find_profiles(path)
    return found


def load_ranks(paths: list[Path], workers: int | None = None, problems: list[str] | None = None) -> list[RankProfile]:
    """Every rank's profile from ``paths``: ranks as the profiles name them (Kineto's
    ``distributedInfo``, MindSpore's file names, Ascend's info files), else in the order
    given. A profile that cannot be read is one line in ``problems`` (naming its file) and
    the others are read; IngestError when none can be, or ``problems`` is None. Two
    profiles of one rank are an error. Calls without a group size (HCCL's) get the number
    of profiles holding calls of their group."""
    from profstream.integrations.ingest.hccl import fill_group_sizes

    profiles: list[Profile] = []
    failed: list[str] = []
    for found in profile_paths(paths):
        try:
            profiles.append(load_one(found, workers))
        except IngestError as e:
            if problems is None:
                raise
            failed.append(str(e))
    if not profiles and failed:
        raise IngestError(failed[0] if len(failed) == 1 else f"no profile could be read: {'; '.join(failed)}")
    if problems is not None:
        problems += failed
        sources = sorted({p.source for p in profiles})
        if len(sources) > 1:
            problems.append(f"the ranks come from different profilers ({', '.join(sources)}): their figures may "
                            "not be comparable")
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


def load_one(found: Found, workers: int | None = None) -> Profile:
    """One rank's profile, as ``load_profile`` reads it (clock note included)."""
    profile = read_found(found, workers=workers)
    clocks = profile.check_clocks()
    if clocks is not None:
        profile.notes.append(clocks)
    return profile


def rank_messages(ranks: list[RankProfile], run_id: str, device: str = "",
                  on_batch: Callable[[EventBatch], None] | None = None) -> Iterator[RawMessage]:
    """The raw messages of every rank, each rank on a partition of its own, interleaved by
    the producer clock of their batches (``sent_ns``: the step's end)."""
    def of_rank(i: int, r: RankProfile) -> Iterator[tuple[float, int, RawMessage]]:
        host = r.profile.host if r.profile.host and is_valid_name(r.profile.host) else ""
        key = f"{run_id}/{r.rank}".encode()
        dev = device or r.profile.device
        for offset, batch in enumerate(profile_batches(r.profile, run_id, r.rank, host, dev, len(ranks),
                                                       ended=True)):
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
    problems: list[str] = []
    ranks = load_ranks([Path(p) for p in paths], workers, problems)
    result = AnalyzeResult(run_id, ranks, problems=problems, parse_s=time.perf_counter() - t0)
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
