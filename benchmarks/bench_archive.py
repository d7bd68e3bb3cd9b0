"""Archive sink MB/s and offline replay op events/s, on one core.

The input is what 8 Monitors send for a simulated run (``monitor_messages`` of
bench_processor_throughput: 2,000 ops per step, 3 messages per step and rank), keyed
``run/rank`` on 12 partitions, with Kafka timestamps 1 ms apart.

- ``archive_write`` (target >= 50 MB/s): ``ArchiveSink.handle`` over records already
  consumed, then ``close``: every file written (zstandard), fsynced, renamed, its
  directory fsynced and its index line appended; the projection decode of each batch's
  step columns for the index included. MB/s = message value bytes / time. Each repeat
  writes a fresh directory.
- ``archive_end_to_end`` (reported, no target): the real broker. The messages are
  pre-filled into a fresh ``<prefix>.raw``; the time runs from ``run_archive`` (group join
  included) until every message is in a finished file and the sink has stopped.
- ``offline_replay`` (target >= 1,000,000 op events/s): ``replay_offline`` over the files
  of ``archive_write`` (read, decompressed, StepStage per partition, RunStage), with 1 and
  with 2 worker processes; every (rank, step) must come out exactly once with the
  simulator's step time, op count and compute time.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

from _common import broker_bootstrap, drop_topics, emit, envelope, note, summary, unique_prefix
from bench_processor_throughput import fold_all, monitor_messages, prefill, verify

from profstream.kafka.topics import Topics, ensure_topics
from profstream.offline.archive import finished_files
from profstream.offline.archive import records as archive_records
from profstream.offline.replay import replay_offline
from profstream.schema.codec import encode
from profstream.simulate import SimConfig
from profstream.sinks.archive import ArchiveSink, run_archive

TARGET_MB_S = 50.0
TARGET_OPS_PER_S = 1_000_000
ORIGIN_MS = 1_790_000_000_000

Record = namedtuple("Record", "topic partition offset timestamp key value headers")


def as_records(topic: str, messages: list[tuple[bytes, bytes]], partitions: int = 12) -> list[Record]:
    """Consumer records: rank r on partition r % partitions, offsets counted per partition."""
    next_offset = [0] * partitions
    out = []
    for i, (key, value) in enumerate(messages):
        part = int(key.rpartition(b"/")[2]) % partitions
        out.append(Record(topic, part, next_offset[part], ORIGIN_MS + i, key, value, []))
        next_offset[part] += 1
    return out


def archive_write(records: list[Record], repeats: int, scratch: Path) -> tuple[dict[str, Any], Path]:
    value_bytes = sum(len(r.value) for r in records)
    rates, last = [], None
    for r in range(repeats):
        out = scratch / f"write-{r}"
        t0 = time.perf_counter()
        sink = ArchiveSink(out)
        sink.handle(records)
        sink.close()
        elapsed = time.perf_counter() - t0
        rates.append(value_bytes / elapsed / 1e6)
        files = finished_files(out)
        disk = sum(f.path.stat().st_size for f in files)
        note(f"archive_write repeat {r + 1}/{repeats}: {rates[-1]:.1f} MB/s ({len(files)} files, "
             f"{disk / 1e6:.1f} MB on disk)")
        if last is not None:
            shutil.rmtree(last)
        last = out
    return {"mb_per_s": rates, "summary": summary(rates), "value_bytes": value_bytes, "files": len(files),
            "bytes_on_disk": disk, "compression_ratio": disk / value_bytes}, last


def archive_end_to_end(bootstrap: str, messages: list[tuple[bytes, bytes]], scratch: Path, timeout: float,
                       keep: bool) -> dict[str, Any]:
    prefix = unique_prefix()
    topics = Topics(prefix)
    out = scratch / f"e2e-{prefix}"
    try:
        ensure_topics(bootstrap, topics, raw_partitions=12)
        value_bytes = prefill(bootstrap, topics, messages)
        sinks: list[ArchiveSink] = []
        stop = threading.Event()
        errors: list[BaseException] = []

        def work() -> None:
            try:
                run_archive(bootstrap, [topics.raw], out, stop, group_id=f"{prefix}-archive", ready=sinks.append)
            except BaseException as e:  # re-raised below
                errors.append(e)

        t0 = time.perf_counter()
        thread = threading.Thread(target=work, name="bench-archive", daemon=True)
        thread.start()
        deadline = t0 + timeout
        t_first = None
        while not errors and time.perf_counter() < deadline:
            stats = sinks[0].stats if sinks else None
            if stats and stats.messages and t_first is None:
                t_first = time.perf_counter()
            if stats and stats.messages >= len(messages):
                break
            time.sleep(0.002)
        stop.set()  # finishes the open files and commits
        thread.join(60)
        elapsed = time.perf_counter() - t0
        if errors:
            raise errors[0]
        got = sinks[0].stats.messages if sinks else 0
        if got < len(messages):
            raise SystemExit(f"end to end: only {got} of {len(messages)} messages archived within {timeout} s")
        return {"topic_prefix": prefix, "elapsed_s": elapsed, "mb_per_s": value_bytes / elapsed / 1e6,
                "mb_per_s_from_first_message": value_bytes / (time.perf_counter() - t_first) / 1e6 if t_first else None,
                "first_message_after_s": (t_first - t0) if t_first else None, "files": sinks[0].stats.files}
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if not keep:
            drop_topics(bootstrap, prefix)


def offline_replay(archive: Path, truth: dict, total_ops: int, repeats: int, workers: int) -> dict[str, Any]:
    files = finished_files(archive)
    rates, check = [], None
    for r in range(repeats):
        values: list[bytes] = []
        t0 = time.perf_counter()
        result = replay_offline(files, workers=workers, on_step=values.append)
        elapsed = time.perf_counter() - t0
        if check is None:
            check = verify([encode("StepMetrics", m) for m in values], truth)
            if not (check["each_once"] and check["values_match_truth"]):
                raise SystemExit(f"offline replay ({workers} workers): StepMetrics wrong: {check}")
        if result.events != total_ops:
            raise SystemExit(f"offline replay: {result.events} op events folded, expected {total_ops}")
        rates.append(total_ops / elapsed)
        note(f"offline_replay workers={workers} repeat {r + 1}/{repeats}: {rates[-1] / 1e6:.3f} M ops/s "
             f"({elapsed:.2f} s, {result.steps} steps, {result.run_steps} run steps)")
    return {"workers": workers, "ops_per_s": rates, "summary": summary(rates), "check": check}


def diagnostics(archive: Path, records: list[Record], total_ops: int, repeats: int) -> dict[str, Any]:
    """Where offline replay's time goes: reading the archive alone, and the step stage alone
    (fold + ready over the same records in memory, as bench_processor_throughput)."""
    files = finished_files(archive)
    value_bytes = sum(len(r.value) for r in records)
    read, fold = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = sum(1 for _ in archive_records(files, lambda loss: None))
        read.append(value_bytes / (time.perf_counter() - t0) / 1e6)
        assert n == len(records)
        fold.append(total_ops / fold_all(records, Topics("bench"))["elapsed_s"])
    note(f"diagnostics: archive read alone {statistics.median(read):.0f} MB/s, step stage alone "
         f"{statistics.median(fold) / 1e6:.3f} M ops/s")
    return {"archive_read_alone_mb_per_s": summary(read), "step_stage_alone_ops_per_s": summary(fold)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", help="broker host:port (default: start/reuse `profstream stack up`)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=100, help="steps per rank")
    p.add_argument("--ops-per-step", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--e2e-repeats", type=int, default=3, help="repeats through the broker (0: skip)")
    p.add_argument("--e2e-timeout", type=float, default=180.0)
    p.add_argument("--keep-topics", action="store_true")
    args = p.parse_args(argv)

    cfg = SimConfig(run_id="bench-archive", ranks=args.ranks, steps=args.steps, ops_per_step=args.ops_per_step,
                    step_time_ms=50.0)
    t0 = time.perf_counter()
    messages, truth = monitor_messages(cfg)
    total_ops = args.ranks * args.steps * args.ops_per_step
    records = as_records("bench.raw", messages)
    note(f"built {len(messages)} messages ({sum(len(v) for _, v in messages) / 1e6:.1f} MB, {total_ops} ops) "
         f"in {time.perf_counter() - t0:.1f} s")
    scratch = Path(tempfile.mkdtemp(prefix="bench-archive-"))
    try:
        write, archive = archive_write(records, args.repeats, scratch)
        replay = {f"workers_{w}": offline_replay(archive, truth, total_ops, args.repeats, w) for w in (1, 2)}
        figures: dict[str, Any] = {"archive_write": write, "offline_replay": replay,
                                   "diagnostics": diagnostics(archive, records, total_ops, args.repeats)}
        bootstrap = None
        if args.e2e_repeats:
            bootstrap = broker_bootstrap(args.bootstrap)
            reps = []
            for r in range(args.e2e_repeats):
                reps.append(archive_end_to_end(bootstrap, messages, scratch, args.e2e_timeout, args.keep_topics))
                note(f"archive_end_to_end repeat {r + 1}/{args.e2e_repeats}: {reps[-1]['mb_per_s']:.1f} MB/s "
                     f"({reps[-1]['elapsed_s']:.2f} s, first message after {reps[-1]['first_message_after_s']:.2f} s)")
            rates = [r["mb_per_s"] for r in reps]
            figures["archive_end_to_end"] = {
                "label": "real broker, pre-filled topic: message value MB / (run_archive start, group join "
                         "included -> every message in a finished file, sink stopped)",
                "mb_per_s": rates, "summary": summary(rates),
                "median_mb_per_s_from_first_message": statistics.median(
                    [r["mb_per_s_from_first_message"] for r in reps if r["mb_per_s_from_first_message"]]),
                "repeats": reps}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    write_median = write["summary"]["median"]
    best_replay = max(replay.values(), key=lambda r: r["summary"]["median"])
    results = {
        "bootstrap": bootstrap,
        "metric": "archive_write: MB/s of raw message values into finished archive files, one thread; "
                  "offline_replay: op events/s through the processors from the archive",
        "workload": {"ranks": args.ranks, "steps_per_rank": args.steps, "ops_per_step": args.ops_per_step,
                     "op_events": total_ops, "steps": len(truth), "messages": len(messages),
                     "value_bytes": write["value_bytes"]},
        "median": {"archive_write_mb_per_s": write_median,
                   **{f"offline_replay_{k}_ops_per_s": v["summary"]["median"] for k, v in replay.items()}},
        "target": {"archive_write_min_mb_per_s": TARGET_MB_S, "offline_replay_min_ops_per_s": TARGET_OPS_PER_S},
        "meets_target": {"archive_write": write_median >= TARGET_MB_S,
                         "offline_replay": best_replay["summary"]["median"] >= TARGET_OPS_PER_S},
        "figures": figures,
    }
    emit(envelope("archive", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
