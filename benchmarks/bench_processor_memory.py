"""Memory: RSS of one processor process while 64 ranks stream 10,000 steps each.

One ``profstream process`` subprocess (both stages, as deployed) with its metrics
endpoint on; this process produces the raw batches with a plain lz4 producer, keyed
``run/rank`` as the Monitor sends them. Batches are built with numpy, not through the
simulator and Monitors (those would take longer than the processor): each holds
``--steps-per-batch`` whole steps of one rank (ops, step marks with F and B, two memory
and two queue samples per step) and a watermark through its last step. Ops per step are
few (20 by default) so the run is about steps, which is what state is kept per: what
must stay bounded is the per-rank state (rolling windows are ring buffers, closed steps
are freed), whatever the number of steps.

Two modes:

- ``paced`` (the target): the producer offers ``--rate`` steps/s in all (the ranks
  interleaved), below what the processor sustains on this machine (~850-950 steps/s),
  so the processor keeps up as it would with a live run.
- ``backlog``: every batch is on the topic before the processor starts, as after an
  outage: the processor catches up with full polls.

The default is 2,000 steps per rank (about 3 minutes paced); the target's 10,000 steps
is ``--steps 10000`` (about 15 minutes paced at 700 steps/s).

RSS (psutil) is sampled every 0.5 s; the run ends when the processor's metrics say that
every StepMetrics has been committed (``profstream_step_freshness_seconds_count``), or,
reported as not completed, when no step was committed for ``--no-progress-s``.
Reported: RSS at start (idle, before any input), max, final, and at each quarter of
the run. Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import psutil
from _common import broker_bootstrap, drop_topics, emit, envelope, note, unique_prefix
from bench_processor_scaleout import processor_command, stop_process

from profstream.kafka.clients import make_producer
from profstream.kafka.topics import Topics, ensure_topics
from profstream.schema.batch import COMMUNICATION, COMPUTE, I32, I64, U8, EventBatch, encode_batch

TARGET_MAX_RSS_MB = 300.0
STEP_NS = 50_000_000
ORIGIN_NS = 1_790_000_000_000_000_000
TYPES = ["MatMul", "LayerNorm", "Softmax", "GeLU", "Add", "MatMulGrad", "AllReduce", "AdamW"]
MB = 1024 * 1024


def step_batch(run_id: str, rank: int, first: int, steps: int, ops: int, seq: int) -> EventBatch:
    """``steps`` whole steps of one rank from step ``first``: ``ops - 2`` back-to-back compute
    ops between F (5 %) and B (85 %), an all-reduce over B, an optimizer op in the tail."""
    s = np.arange(first, first + steps, dtype=I64)
    S = ORIGIN_NS + s * STEP_NS
    F, B, E = S + STEP_NS // 20, S + STEP_NS * 17 // 20, S + STEP_NS
    n_compute = ops - 2
    width = (B[0] - F[0]) // n_compute
    compute_start = F[:, None] + np.arange(n_compute, dtype=I64)[None, :] * width
    starts = np.concatenate([compute_start, (B - STEP_NS // 10)[:, None], (B + STEP_NS // 50)[:, None]], axis=1)
    durs = np.concatenate([np.full((steps, n_compute), width, I64), np.full((steps, 1), STEP_NS * 3 // 20, I64),
                           np.full((steps, 1), STEP_NS // 10, I64)], axis=1)
    type_idx = np.concatenate([np.tile(np.arange(n_compute) % 6, (steps, 1)), np.full((steps, 1), 6),
                               np.full((steps, 1), 7)], axis=1).astype(I32)
    kind = np.where(type_idx == 6, COMMUNICATION, COMPUTE).astype(U8)
    b = EventBatch(run_id=run_id, rank=rank, host=f"node-{rank // 8}", device=f"cuda:{rank % 8}",
                   producer_id=f"bench-memory-{rank}", seq=seq, sent_ns=int(E[-1]),
                   complete_through_step=int(s[-1]), op_names=list(TYPES), op_types=list(TYPES),
                   queue_names=["device_queue"])
    b.ops = {"name_idx": type_idx.ravel(), "type_idx": type_idx.ravel(), "kind": kind.ravel(),
             "stream": (kind.ravel() == COMMUNICATION).astype(I32), "step": np.repeat(s, ops),
             "start_ns": starts.ravel(), "dur_ns": durs.ravel()}
    allocated = np.full(2 * steps, 2_000_000_000 + rank * 50_000_000, I64)
    b.memory = {"ts_ns": np.column_stack([S, E]).ravel(), "step": np.repeat(s, 2), "allocated": allocated,
                "reserved": allocated + 1_000_000_000, "peak": allocated + 500_000_000}
    b.queues = {"name_idx": np.zeros(2 * steps, I32), "ts_ns": np.column_stack([S, B]).ravel(),
                "step": np.repeat(s, 2), "size": np.full(2 * steps, 4, I64), "capacity": np.full(2 * steps, 8, I64)}
    b.steps = {"step": s, "start_ns": S, "end_ns": E, "fp_start_ns": F, "bp_end_ns": B}
    return b


def batches(run_id: str, ranks: int, steps: int, ops: int, per_batch: int):
    """(key, value, steps in it) of every batch: block of steps by block, ranks interleaved."""
    for block, first in enumerate(range(0, steps, per_batch)):
        n = min(per_batch, steps - first)
        for rank in range(ranks):
            b = step_batch(run_id, rank, first, n, ops, block)
            yield b.key, encode_batch(b), n


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """The processor's metrics, {name: value} (unlabelled samples and histogram counts)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class RssSampler(threading.Thread):
    def __init__(self, pid: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.done.is_set():
            try:
                self.samples.append((time.monotonic() - t0, self.proc.memory_info().rss))
            except psutil.Error:
                return
            self.done.wait(self.interval)


def produce(bootstrap: str, topic: str, run_id: str, args: argparse.Namespace, rate: float | None,
            progress: dict) -> None:
    producer = make_producer(bootstrap, compression="lz4")
    t0 = time.monotonic()
    sent_steps = 0
    stop = progress.setdefault("stop", threading.Event())
    try:
        for key, value, n in batches(run_id, args.ranks, args.steps, args.ops_per_step, args.steps_per_batch):
            if stop.is_set():
                break
            if rate:
                ahead = sent_steps / rate - (time.monotonic() - t0)
                if ahead > 0:
                    stop.wait(ahead)
            producer.send(topic, key=key, value=value)
            sent_steps += n
            progress["steps_sent"] = sent_steps
            progress["bytes_sent"] = progress.get("bytes_sent", 0) + len(value)
        producer.flush(timeout=120)
    finally:
        producer.close(timeout=10)
        progress["produce_s"] = time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", help="broker host:port (default: start/reuse `profstream stack up`)")
    p.add_argument("--mode", choices=("paced", "backlog"), default="paced")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--steps", type=int, default=2000, help="steps per rank (the target: 10000)")
    p.add_argument("--ops-per-step", type=int, default=20)
    p.add_argument("--steps-per-batch", type=int, default=20, help="steps of one rank in one raw message")
    p.add_argument("--rate", type=float, default=700.0, help="paced: steps/s offered, all ranks together")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--no-progress-s", type=float, default=180.0,
                   help="stop (and report) when no step has been committed for this long")
    p.add_argument("--keep-topics", action="store_true", help="do not delete the benchmark's topics")
    args = p.parse_args(argv)
    if args.ops_per_step < 3:
        raise SystemExit("--ops-per-step must be >= 3")

    bootstrap = broker_bootstrap(args.bootstrap)
    prefix = unique_prefix()
    topics = Topics(prefix)
    run_id = "bench-memory"
    expected = args.ranks * args.steps
    note(f"broker {bootstrap}, topic prefix {prefix}, {expected} steps, mode {args.mode}")
    progress: dict[str, Any] = {"stop": threading.Event()}
    port = free_port()
    timeline: list[dict[str, Any]] = []
    scrape_errors: list[str] = []
    try:
        ensure_topics(bootstrap, topics, raw_partitions=12)
        if args.mode == "backlog":
            produce(bootstrap, topics.raw, run_id, args, None, progress)
            note(f"pre-filled {progress['steps_sent']} steps ({progress['bytes_sent'] / MB:.0f} MiB) "
                 f"in {progress['produce_s']:.1f} s")
        with tempfile.NamedTemporaryFile("w+", prefix="bench-processor-", suffix=".log", delete=False) as log:
            log_path = log.name
            proc = subprocess.Popen(processor_command(bootstrap, prefix, f"{prefix}-g", "p0", stages="all",
                                                      metrics_port=port), stdout=log, stderr=subprocess.STDOUT)
            sampler = RssSampler(proc.pid)
            sampler.start()
            t0 = time.monotonic()
            producer = None
            try:
                metrics: dict[str, float] = {}
                while time.monotonic() - t0 < 60 and proc.poll() is None:
                    try:
                        metrics = scrape(port)
                        break
                    except OSError:
                        time.sleep(0.2)
                idle_rss = psutil.Process(proc.pid).memory_info().rss
                if args.mode == "paced":
                    producer = threading.Thread(target=produce, args=(bootstrap, topics.raw, run_id, args,
                                                                      args.rate, progress), daemon=True)
                    producer.start()
                committed = 0.0
                last_note = 0.0
                last_progress = time.monotonic()
                stopped_because = "all steps committed"
                while committed < expected:
                    if proc.poll() is not None:
                        stopped_because = f"the processor exited ({proc.returncode})"
                        break
                    if time.monotonic() - t0 > args.timeout:
                        stopped_because = f"--timeout {args.timeout:g} s"
                        break
                    if time.monotonic() - last_progress > args.no_progress_s:
                        stopped_because = f"no step committed for {args.no_progress_s:g} s"
                        break
                    time.sleep(1.0)
                    try:
                        metrics = scrape(port)
                    except urllib.error.HTTPError as e:  # the collector raised inside the processor
                        scrape_errors.append(f"{time.monotonic() - t0:.1f} s: HTTP {e.code}")
                        continue
                    if metrics.get("profstream_step_freshness_seconds_count", 0.0) != committed:
                        committed = metrics.get("profstream_step_freshness_seconds_count", 0.0)
                        last_progress = time.monotonic()
                    now = time.monotonic() - t0
                    rss = sampler.samples[-1][1] if sampler.samples else 0
                    timeline.append({"t_s": round(now, 1), "steps_committed": int(committed), "rss_mb": rss / MB,
                                     "state_events": metrics.get("profstream_state_events"),
                                     "open_ranks": metrics.get("profstream_open_ranks"),
                                     "lag_messages": metrics.get("profstream_consumer_lag_messages")})
                    if now - last_note >= 15:
                        last_note = now
                        note(f"{now:.0f} s: {int(committed)}/{expected} steps committed, RSS {rss / MB:.0f} MiB, "
                             f"lag {metrics.get('profstream_consumer_lag_messages')}, load {os.getloadavg()[0]:.2f}")
                elapsed = time.monotonic() - t0
                final_rss = psutil.Process(proc.pid).memory_info().rss if proc.poll() is None else None
            finally:
                sampler.done.set()
                code = stop_process(proc)
                sampler.join(5)
                if producer is not None:
                    progress["stop"].set()
                    producer.join(60)
            if committed < expected:
                note(f"only {int(committed)} of {expected} steps committed in {elapsed:.0f} s: {stopped_because}; "
                     f"processor log {log_path}")
    finally:
        if not args.keep_topics:
            drop_topics(bootstrap, prefix)

    with open(log_path) as f:
        processor_log = f.read()
    rss = [r for _, r in sampler.samples]
    max_rss = max(rss)
    quarters = {}
    for q in (0.25, 0.5, 0.75, 1.0):
        at = next((x for x in timeline if x["steps_committed"] >= q * expected), None)
        quarters[f"{int(q * 100)}%"] = at
    changes = [(x["t_s"], x["steps_committed"]) for i, x in enumerate(timeline)
               if x["steps_committed"] and (i == 0 or x["steps_committed"] != timeline[i - 1]["steps_committed"])]
    gaps = [b[0] - a[0] for a, b in zip(changes, changes[1:])]
    results = {
        "bootstrap": bootstrap, "topic_prefix": prefix,
        "metric": "max RSS of the processor process (psutil, sampled every 0.5 s) over the whole run",
        "unit": "MiB",
        "workload": {"ranks": args.ranks, "steps_per_rank": args.steps, "steps": expected,
                     "ops_per_step": args.ops_per_step, "op_events": expected * args.ops_per_step,
                     "steps_per_batch": args.steps_per_batch, "mode": args.mode,
                     "offered_steps_per_s": args.rate if args.mode == "paced" else None,
                     "raw_mib": progress.get("bytes_sent", 0) / MB},
        "per_repeat": [max_rss / MB],
        "median": max_rss / MB,
        "idle_rss_mb": idle_rss / MB,
        "final_rss_mb": final_rss / MB if final_rss else None,
        "max_rss_at_s": sampler.samples[rss.index(max_rss)][0],
        "elapsed_s": elapsed,
        "steps_committed_per_s": committed / elapsed,
        "produce_s": progress.get("produce_s"),
        "rss_at_quarters": quarters,
        "first_commit_seen_after_s": changes[0][0] if changes else None,
        "longest_time_without_commit_s": max(gaps, default=None),
        "target": {"max_rss_mb": TARGET_MAX_RSS_MB},
        "meets_target": committed >= expected and max_rss / MB <= TARGET_MAX_RSS_MB,
        "completed": committed >= expected,
        "steps_committed": int(committed),
        "stopped_because": stopped_because,
        "rss_samples": len(rss),
        "metrics_scrape_errors": {"count": len(scrape_errors), "first": scrape_errors[:5]},
        "timeline": timeline[:: max(1, len(timeline) // 60)],
        "processor_exit_code": code,
        "processor_log": log_path,
        "transactions_aborted": processor_log.count("transaction aborted"),
        "processor_log_first_warnings": [ln[:300] for ln in processor_log.splitlines() if "WARNING" in ln][:3],
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    emit(envelope("processor_memory", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
