"""Replay an archive: republish a run to a topic, or run the processors on it offline.

Messages go in the archive's replay order (``offline.archive``: each partition in offset
order, partitions interleaved by their clock). Offline, the processors' public entry
point (``processors.stream``) computes the figures, with that clock as ``now``: what they
compute depends on each partition's own messages only, the same with one worker process
or several, and the same as the live processors wherever the figures do not depend on
wall-clock timing (steps closed by the producers' watermarks).

A damaged archive file costs only its damaged blocks: each is reported as a ``Loss``
(file, topic, partition, offsets) and the replay goes on.
"""

from __future__ import annotations

import heapq
import math
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from profstream.config import check_name
from profstream.kafka.topics import Topics
from profstream.offline.archive import ArchiveError, ArchiveFile, Loss, Reporter, Tally, merged
from profstream.offline.record_files import RecordWriter
from profstream.processors.stream import (
    ALERTS,
    DEAD_LETTERS,
    ENDS,
    Figure,
    RawMessage,
    RunFigures,
    StepFigures,
    StreamOptions,
)
from profstream.schema.batch import SECTIONS, EventBatch, decode_batch, encode_batch
from profstream.schema.codec import DecodeError, decode

# -- changing messages on the way: --rewrite-run, --steps --------------------------------------

def rewrite_key(key: bytes | None, run_id: str) -> bytes | None:
    """``<run>/<rank>`` -> ``<run_id>/<rank>``."""
    if key is None:
        return None
    sep, tail = key.rpartition(b"/")[1:]
    return run_id.encode() + sep + tail if sep else run_id.encode()


def _slice(batch: EventBatch, lo: int, hi: int, keep_host: bool) -> EventBatch:
    out = replace(batch)
    for section in SECTIONS:
        cols = getattr(batch, section)
        if section == "host_samples":
            if not keep_host:
                setattr(out, section, {c: a[:0] for c, a in cols.items()})
            continue
        steps = cols["step"]
        keep = (steps >= lo) & (steps <= hi)
        if not keep.all():
            setattr(out, section, {c: a[keep] for c, a in cols.items()})
    return out


class StepRange:
    """Keeps the events of steps A..B of each producer's batches: batches before the first
    one with such events are dropped; later ones keep their header (seq, watermark) even when
    emptied, so the processors see no gap, until a watermark >= B has passed."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self._state: dict[tuple[str, int, str], int] = {}  # producer -> 1 started, 2 done

    def apply(self, batch: EventBatch) -> EventBatch | None:
        who = (batch.run_id, batch.rank, batch.producer_id)
        state = self._state.get(who, 0)
        if state == 2:
            return None
        inside = any(bool(((cols["step"] >= self.lo) & (cols["step"] <= self.hi)).any())
                     for name, cols in ((s, getattr(batch, s)) for s in SECTIONS) if name != "host_samples")
        if state == 0 and not inside:
            return None
        wm = batch.complete_through_step
        self._state[who] = 2 if wm is not None and wm >= self.hi else 1
        return _slice(batch, self.lo, self.hi, inside)


# -- republish -------------------------------------------------------------------------------

class Pacer:
    """Waits so that messages go out ``speed`` times as fast as their timestamps say
    (``speed`` None: as fast as possible)."""

    def __init__(self, speed: float | None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Any] = time.sleep) -> None:
        if speed is not None and not speed > 0:
            raise ValueError("speed must be > 0")
        self.speed, self.clock, self.sleep = speed, clock, sleep
        self._t0: float | None = None
        self._ts0 = 0.0

    def wait(self, timestamp_ms: int) -> None:
        if self.speed is None:
            return
        if self._t0 is None:
            self._t0, self._ts0 = self.clock(), timestamp_ms
            return
        delay = self._t0 + (timestamp_ms - self._ts0) / 1000.0 / self.speed - self.clock()
        if delay > 0:
            self.sleep(delay)


def parse_speed(value: str) -> float | None:
    """``max`` -> None (no pacing); ``1``, ``10``, ``0.5`` -> that factor."""
    if value.strip().lower() == "max":
        return None
    try:
        speed = float(value)
    except ValueError:
        speed = math.nan
    if not speed > 0 or math.isinf(speed):
        raise ValueError(f"--speed {value!r}: expected max or a number > 0 (1: as recorded, 10: ten times faster)")
    return speed


@dataclass
class ReplayResult:
    messages: int = 0  # read from the archive
    sent: int = 0  # republished
    dropped: int = 0  # left out by --steps (outside the range, or undecodable)
    events: int = 0
    steps: int = 0  # StepMetrics (offline)
    run_steps: int = 0  # RunStepMetrics (offline)
    alerts: int = 0  # (offline)
    undecodable: int = 0
    elapsed_s: float = 0.0
    losses: list[Loss] = field(default_factory=list)
    outputs: list[Path] = field(default_factory=list)


def _transform(rewrite_run: str | None, step_range: StepRange | None, result: ReplayResult):
    def change(key: bytes | None, value: bytes | None) -> tuple[bytes | None, bytes | None] | None:
        if rewrite_run is None and step_range is None:
            return key, value
        try:
            batch = decode_batch(value)
        except DecodeError:
            result.undecodable += 1
            if step_range is not None:
                return None  # no step to judge it by
            return rewrite_key(key, rewrite_run), value
        if step_range is not None:
            batch = step_range.apply(batch)
            if batch is None:
                return None
        if rewrite_run is not None:
            batch.run_id = rewrite_run
            key = rewrite_key(key, rewrite_run)
        return key, encode_batch(batch)

    return change


def republish(files: list[ArchiveFile], bootstrap: str, to_topic: str, speed: float | None = None,
              steps: tuple[int, int] | None = None, rewrite_run: str | None = None,
              stop: threading.Event | None = None, progress: Callable[[Tally], None] | None = None,
              on_loss: Callable[[Loss], None] | None = None) -> ReplayResult:
    """Send the archived messages of ``files`` to ``to_topic`` in replay order, keys kept
    (the producer partitions by key, as the Monitor does). Messages unchanged are sent
    byte for byte; ``rewrite_run`` renames the run in keys and batches; ``steps`` keeps the
    events of steps A..B (see ``StepRange``). A ``<prefix>.raw`` topic that does not exist
    is created with its prefix's other topics."""
    from profstream.kafka.clients import make_producer

    if rewrite_run is not None:
        check_name(rewrite_run, "run id")
    _ensure_topic(bootstrap, to_topic)
    stop = stop or threading.Event()
    result = ReplayResult()
    tally = Tally("replay", len(files), sum(f.path.stat().st_size for f in files))
    reporter = Reporter(tally, progress)
    change = _transform(rewrite_run, StepRange(*steps) if steps else None, result)
    pacer = Pacer(speed, sleep=stop.wait)
    failures: list[BaseException] = []
    producer = make_producer(bootstrap)
    try:
        partitions = len(producer.partitions_for(to_topic))
        for _now, _p, rec in merged(files, _collect(result, on_loss), tally):
            if stop.is_set():
                break
            result.messages += 1
            tally.messages += 1
            changed = change(rec["key"], rec["value"])
            if changed is None:
                result.dropped += 1
                continue
            pacer.wait(rec["timestamp"])
            key, value = changed
            headers = [(h["key"], h["value"] or b"") for h in rec["headers"]]
            future = producer.send(to_topic, key=key, value=value, headers=headers,
                                   partition=None if key else rec["partition"] % partitions)
            future.add_errback(failures.append)
            result.sent += 1
            reporter.tick()
        producer.flush(timeout=120)  # raises KafkaTimeoutError if not all are delivered by then
    finally:
        producer.close(timeout=10)
    if failures:
        raise RuntimeError(f"replay to {to_topic}: {len(failures)} messages failed ({failures[0]!r})")
    reporter.tick(force=True)
    result.elapsed_s = tally.elapsed_s
    return result


def _collect(result: ReplayResult, on_loss: Callable[[Loss], None] | None) -> Callable[[Loss], None]:
    def lost(loss: Loss) -> None:
        result.losses.append(loss)
        if on_loss is not None:
            on_loss(loss)

    return lost


def _ensure_topic(bootstrap: str, topic: str) -> None:
    from profstream.kafka.clients import make_consumer
    from profstream.kafka.topics import ensure_topics, validate_prefix

    consumer = make_consumer(bootstrap, group_id=None)
    try:
        exists = bool(consumer.partitions_for_topic(topic))
    finally:
        consumer.close()
    if exists:
        return
    prefix, _, base = topic.rpartition(".")
    if base != "raw" or not prefix:
        raise ArchiveError(f"topic {topic} does not exist on {bootstrap}: create it, or replay to a "
                           "<prefix>.raw topic (created with its prefix's other topics)")
    ensure_topics(bootstrap, Topics(validate_prefix(prefix)))


# -- offline ---------------------------------------------------------------------------------

def _step_figures(files: list[ArchiveFile], options: StreamOptions, on_loss, tally: Tally,
                  change=None) -> Iterator[Figure]:
    """The processors' step figures of ``files``, in ``Figure`` order."""
    steps = StepFigures(options, files[0].topic if files else "offline.raw")
    for now, p, rec in merged(files, on_loss, tally):
        key, value = rec["key"], rec["value"]
        if change is not None:
            changed = change(key, value)
            if changed is None:
                continue
            key, value = changed
        yield from steps.feed(RawMessage(now, p, rec["offset"], key, value))
        tally.messages += 1
        tally.events = steps.events
    yield from steps.finish()


def replay_offline(files: list[ArchiveFile], options: StreamOptions | None = None,
                   steps: tuple[int, int] | None = None, workers: int = 1, rewrite_run: str | None = None,
                   on_step: Callable[[dict], None] | None = None, on_run_step: Callable[[dict], None] | None = None,
                   on_alert: Callable[[dict], None] | None = None, progress: Callable[[Tally], None] | None = None,
                   on_loss: Callable[[Loss], None] | None = None,
                   on_rank_end: Callable[[dict], None] | None = None) -> ReplayResult:
    """Run the processors (``processors.stream``) over archived raw ``files`` without a
    broker; hand each StepMetrics / RunStepMetrics / Alert of steps A..B (``steps``; None:
    all), and each RankEnd (a rank that ended normally), to the callbacks. ``workers`` > 1 computes the step figures of disjoint partition
    sets in that many processes: the figures are the same."""
    options = options or StreamOptions()
    result = ReplayResult()
    lost = _collect(result, on_loss)
    if rewrite_run is not None:
        check_name(rewrite_run, "run id")
    change = _transform(rewrite_run, None, result) if rewrite_run else None
    tally = Tally("offline", len(files), sum(f.path.stat().st_size for f in files))
    reporter = Reporter(tally, progress)
    run = RunFigures(options)
    wanted = (lambda step: True) if steps is None else (lambda step: steps[0] <= step <= steps[1])
    partitions = sorted({f.partition for f in files})
    workers = max(1, min(workers, len(partitions)))
    if workers == 1:
        outputs = _step_figures(files, options, lost, tally, change)
    else:
        outputs = _parallel_figures(files, partitions, workers, options, lost, tally, rewrite_run)
    for figure in outputs:
        reporter.tick()
        if figure.kind == DEAD_LETTERS:
            result.undecodable += 1
            continue
        if figure.kind == ALERTS:
            alert = decode("Alert", figure.value)
            if wanted(alert["step"]):
                result.alerts += 1
                if on_alert is not None:
                    on_alert(alert)
            continue
        if figure.kind == ENDS:
            if on_rank_end is not None:
                on_rank_end(decode("RankEnd", figure.value))
            _run_figures(run.feed(figure), wanted, result, on_run_step)
            continue
        m = decode("StepMetrics", figure.value)
        if wanted(m["step"]):
            result.steps += 1
            tally.steps += 1
            if on_step is not None:
                on_step(m)
        _run_figures(run.feed(figure), wanted, result, on_run_step)
    _run_figures(run.finish(), wanted, result, on_run_step)
    reporter.tick(force=True)
    result.messages, result.events = tally.messages, tally.events
    result.elapsed_s = tally.elapsed_s
    return result


def _run_figures(figures: list[Figure], wanted, result: ReplayResult, on_run_step) -> None:
    for f in figures:
        r = decode("RunStepMetrics", f.value)
        if wanted(r["step"]):
            result.run_steps += 1
            if on_run_step is not None:
                on_run_step(r)


# -- offline in several processes --------------------------------------------------------------

_CHUNK = 256


def _worker(files, options, rewrite_run, queue) -> None:
    tally = Tally("worker", 0, 0)
    losses: list[Loss] = []
    sent = [0, 0, 0]  # messages, events, bytes reported so far
    chunk: list = []
    last = time.monotonic()

    def delta() -> tuple[int, int, int, int]:
        d = (tally.messages - sent[0], tally.events - sent[1], tally.bytes_done - sent[2], tally.files_done)
        sent[:] = [tally.messages, tally.events, tally.bytes_done]
        return d

    try:
        change = _transform(rewrite_run, None, ReplayResult()) if rewrite_run else None
        for item in _step_figures(files, options, losses.append, tally, change):
            chunk.append(item)
            if len(chunk) >= _CHUNK or time.monotonic() - last >= 0.2:
                queue.put(("out", chunk, losses, delta()))
                chunk, losses, last = [], [], time.monotonic()
        queue.put(("out", chunk, losses, delta()))
        queue.put(("done", None, None, None))
    except BaseException as e:  # surfaced in the parent
        queue.put(("error", f"{type(e).__name__}: {e}", None, None))


def _context():
    """Workers come from a forkserver, never from forking the caller: a fork copies whatever
    the caller's other threads (Kafka clients, torch, a test run's leftovers) held mid-way,
    and a worker so made crashed (exit code -11, once in a full test run). The server is a
    fresh interpreter with this module imported, started once per caller (~0.3 s); each
    worker is a fork of it."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _parallel_figures(files, partitions, workers, options, lost, tally: Tally, rewrite_run):
    ctx = _context()
    shares = [partitions[i::workers] for i in range(workers)]
    queues, procs = [], []
    files_done = [0] * workers
    for share in shares:
        q = ctx.Queue(maxsize=64)
        mine = [f for f in files if f.partition in set(share)]
        proc = ctx.Process(target=_worker, args=(mine, options, rewrite_run, q), daemon=True)
        proc.start()
        queues.append(q)
        procs.append(proc)

    def stream(i: int, q) -> Iterator:
        while True:
            try:
                kind, chunk, losses, d = q.get(timeout=1.0)
            except queue.Empty:
                if not procs[i].is_alive():
                    raise RuntimeError(f"offline replay worker {i} died (exit code {procs[i].exitcode})") from None
                continue
            if kind == "error":
                raise RuntimeError(f"offline replay worker {i} failed: {chunk}")
            if kind == "done":
                return
            for loss in losses:
                lost(loss)
            tally.messages += d[0]
            tally.events += d[1]
            tally.bytes_done += d[2]
            files_done[i] = d[3]
            tally.files_done = sum(files_done)
            yield from chunk

    try:
        yield from heapq.merge(*(stream(i, q) for i, q in enumerate(queues)), key=lambda t: (t[0], t[1], t[2]))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()


def default_workers() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0))))


# -- writing offline results ---------------------------------------------------------------------

def replay_offline_to(files: list[ArchiveFile], out_dir: Path, fmt: str = "jsonl", **kw: Any) -> ReplayResult:
    """``replay_offline`` writing ``steps``, ``run_steps`` and ``alerts`` files (``.jsonl`` or
    ``.parquet``) into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ext = "jsonl" if fmt == "jsonl" else "parquet"
    writers = {name: RecordWriter(out_dir / f"{stem}.{ext}", name, fmt)
               for name, stem in (("StepMetrics", "steps"), ("RunStepMetrics", "run_steps"), ("Alert", "alerts"))}
    try:
        result = replay_offline(files, on_step=writers["StepMetrics"].write,
                                on_run_step=writers["RunStepMetrics"].write, on_alert=writers["Alert"].write, **kw)
    finally:
        for w in writers.values():
            w.close()
    result.outputs = [w.path for w in writers.values()]
    return result
