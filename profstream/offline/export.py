"""Files for notebooks: a run's step metrics and op table as Parquet (or JSON lines).

- ``<run>.steps.parquet``: one row per (rank, step), the StepMetrics fields, nested records
  flattened (``memory.peak``, ``rolling.p95_step_time_ns``...); read from an archive of the
  steps topic, or computed offline from an archive of the raw topic.
- ``<run>.ops.parquet``: one row per op from the raw archive: run, rank, step, name,
  op_type, kind, stream, start_ns, dur_ns, launch_ns (-1: none).

``pandas.read_parquet(path)`` opens either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from profstream.offline.archive import (
    ArchiveError,
    ArchiveFile,
    Loss,
    Tally,
    finished_files,
    missing_run,
    records,
    select_files,
)
from profstream.offline.record_files import RecordWriter
from profstream.offline.replay import replay_offline
from profstream.schema.batch import KIND_NAMES, decode_batch, launch_column
from profstream.schema.codec import DecodeError, decode, record_name

ROWS_PER_GROUP = 1_000_000  # Parquet row group of the op table


# -- the op table ----------------------------------------------------------------------------

_OP_FIELDS = (("run_id", "string"), ("rank", "int32"), ("step", "int64"), ("name", "string"),
              ("op_type", "string"), ("kind", "string"), ("stream", "int32"), ("start_ns", "int64"),
              ("dur_ns", "int64"), ("launch_ns", "int64"))


def op_schema():
    import pyarrow as pa

    return pa.schema([pa.field(n, getattr(pa, t)()) for n, t in _OP_FIELDS])


class OpTableWriter:
    """Ops of EventBatches as Parquet rows, in row groups of ``ROWS_PER_GROUP``."""

    def __init__(self, path: Path, steps: tuple[int, int] | None = None) -> None:
        import pyarrow.parquet as pq

        self.path, self.steps = Path(path), steps
        self.rows = 0
        self._schema = op_schema()
        self._writer = pq.ParquetWriter(self.path, self._schema)
        self._chunks: list = []
        self._pending = 0

    def add(self, batch) -> int:
        import pyarrow as pa
        import pyarrow.compute as pc

        ops = batch.ops
        n = len(ops["step"])
        if not n:
            return 0
        if self.steps is not None:
            keep = (ops["step"] >= self.steps[0]) & (ops["step"] <= self.steps[1])
            if not keep.all():
                ops = {c: a[keep] for c, a in ops.items()}
                n = int(keep.sum())
                if not n:
                    return 0
        names = pc.take(pa.array(batch.op_names, pa.string()), pa.array(ops["name_idx"]))
        types = pc.take(pa.array(batch.op_types, pa.string()), pa.array(ops["type_idx"]))
        kinds = pc.take(_kind_names(), pa.array(ops["kind"].astype(np.int32)))
        self._chunks.append(pa.record_batch([
            pa.array([batch.run_id] * n, pa.string()), pa.array(np.full(n, batch.rank, np.int32)),
            pa.array(ops["step"]), names, types, kinds, pa.array(ops["stream"]), pa.array(ops["start_ns"]),
            pa.array(ops["dur_ns"]), pa.array(launch_column(ops))], schema=self._schema))
        self._pending += n
        self.rows += n
        if self._pending >= ROWS_PER_GROUP:
            self._flush()
        return n

    def _flush(self) -> None:
        import pyarrow as pa

        if self._chunks:
            self._writer.write_table(pa.Table.from_batches(self._chunks, self._schema))
            self._chunks, self._pending = [], 0

    def close(self) -> None:
        self._flush()
        self._writer.close()


@functools.cache
def _kind_names():
    import pyarrow as pa

    return pa.array(list(KIND_NAMES) + [f"kind{i}" for i in range(len(KIND_NAMES), 256)], pa.string())


# -- export ----------------------------------------------------------------------------------

@dataclass
class ExportResult:
    paths: list[Path] = field(default_factory=list)
    step_rows: int = 0
    op_rows: int = 0
    steps_source: str = ""  # "steps archive" or "computed offline from the raw archive"
    undecodable: int = 0
    losses: list[Loss] = field(default_factory=list)


def _runs_of(files: Iterable[ArchiveFile]) -> set[str]:
    return {f.run_id for f in files}


def export_parquet(archive: Path, out_dir: Path, run: str | None = None, steps: tuple[int, int] | None = None,
                   source: str = "auto", what: tuple[str, ...] = ("steps", "ops"), topic_prefix: str | None = None,
                   progress: Callable[[Any], None] | None = None,
                   on_loss: Callable[[Loss], None] | None = None) -> ExportResult:
    """Write ``<run>.steps.parquet`` and/or ``<run>.ops.parquet`` into ``out_dir``.

    ``source`` of the step metrics: "steps" (the archived steps topic), "raw" (computed
    offline by the processors from the archived raw topic), or "auto" (steps if archived)."""
    if source not in ("auto", "steps", "raw"):
        raise ValueError(f"source {source!r}: expected auto, steps or raw")
    archive = Path(archive)
    everything = finished_files(archive)
    named = (lambda kind: f"{topic_prefix}.{kind}") if topic_prefix else (lambda kind: None)
    raw = select_files(everything, "raw", named("raw"), None, archive, required=False)
    steps_files = select_files(everything, "steps", named("steps"), None, archive, required=False)
    runs = sorted(_runs_of(raw) | _runs_of(steps_files))
    if run is None:
        if len(runs) != 1:
            raise ArchiveError(f"{archive} holds {len(runs)} runs ({', '.join(runs[:10]) or 'none'}): "
                               "pass --run")
        run = runs[0]
    raw = [f for f in raw if f.run_id == run]
    steps_files = [f for f in steps_files if f.run_id == run]
    if not raw and not steps_files:
        raise missing_run(archive, run, runs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = ExportResult()

    def lost(loss: Loss) -> None:
        result.losses.append(loss)
        if on_loss is not None:
            on_loss(loss)

    if "steps" in what:
        use_steps = source == "steps" or (source == "auto" and steps_files)
        if use_steps and not steps_files:
            raise ArchiveError(f"no archive of the steps topic for run {run} in {archive}: use --source raw")
        if not use_steps and not raw:
            raise ArchiveError(f"no archive of the raw topic for run {run} in {archive}")
        path = out_dir / f"{run}.steps.parquet"
        writer = RecordWriter(path, "StepMetrics", "parquet")
        try:
            if use_steps:
                result.steps_source = "steps archive"
                tally = Tally("export steps", len(steps_files), sum(f.path.stat().st_size for f in steps_files))
                seen: set[tuple[int, int]] = set()
                for rec in records(steps_files, lost, tally, progress):
                    if record_name(rec["value"]) in ("RankEnd", "RankProgress", "StepPartial"):  # not a step
                        continue
                    try:
                        m = decode("StepMetrics", rec["value"])
                    except DecodeError:
                        result.undecodable += 1
                        continue
                    key = (m["rank"], m["step"])
                    if key in seen or (steps is not None and not steps[0] <= m["step"] <= steps[1]):
                        continue
                    seen.add(key)
                    writer.write(m)
                    tally.steps += 1
            else:
                result.steps_source = "computed offline from the raw archive"
                offline = replay_offline(raw, steps=steps, progress=progress, on_loss=lost,
                                                on_step=writer.write)
                result.undecodable += offline.undecodable
        finally:
            writer.close()
        result.step_rows = writer.rows
        result.paths.append(path)
    if "ops" in what:
        if not raw:
            raise ArchiveError(f"no archive of the raw topic for run {run} in {archive}: the op table needs it")
        path = out_dir / f"{run}.ops.parquet"
        ops = OpTableWriter(path, steps)
        tally = Tally("export ops", len(raw), sum(f.path.stat().st_size for f in raw))
        try:
            for rec in records(raw, lost, tally, progress):
                try:
                    batch = decode_batch(rec["value"])
                except DecodeError:
                    result.undecodable += 1
                    continue
                tally.events += ops.add(batch)
        finally:
            ops.close()
        result.op_rows = ops.rows
        result.paths.append(path)
    return result
