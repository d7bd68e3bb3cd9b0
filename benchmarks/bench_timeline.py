"""Timeline writing: op events/s from closed ``StepEvents`` to gzip trace files on disk, 1 thread.

The input is a window of closed steps of one rank (100 steps of 2,000 ops by default),
built once before timing, laid out as a GPU-bound training step: compute kernels on one
stream, back to back except that ``--gap-share`` of them (default 0.2) are followed by a
launch gap; all-reduce chunks (5 % of the ops) on a communication stream overlapping the
second half of backward; a few memcpy ops on a third stream; 24 op types; two memory and
two queue samples per step. Gaps matter: each one adds a merged-compute and a free slice
to the overlap tracks, so the trace has more events than ops.

The timed call is ``TimelineWriter.write(steps)`` with the sink's defaults (20 MB of JSON
per file, gzip level 1): building every event (``step_timeline``), rendering the JSON
text, compressing, writing, fsync and rename. ops/s = op events / time. Before timing,
the files of one call are read back and checked: every op once, same count of events
as ``timeline_events``.

Diagnostics: the same repeats by CPU time (the machine is shared: wall-clock figures
include the time other processes held the CPUs, see ``cpu_pressure_avg60``), the same
window with a gap after every op (``worst_case_gaps``) and with none (``no_gaps``), and
the rate at each gzip level.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import emit, envelope, note, summary

from profstream.processors.model import StepEvents
from profstream.schema.batch import COMMUNICATION, COMPUTE, MEMCPY
from profstream.sinks.timeline import DEFAULT_MAX_BYTES, TimelineWriter, timeline_events

TARGET_OPS_PER_S = 1_000_000
ORIGIN_NS = 1_790_000_000_000_000_000
OP_TYPES = ("MatMul", "MatMulGrad", "BatchMatMul", "BatchMatMulGrad", "LayerNorm", "LayerNormGrad",
            "Softmax", "SoftmaxGrad", "GeLU", "GeLUGrad", "Add", "Mul", "Dropout", "DropoutGrad",
            "FlashAttention", "FlashAttentionGrad", "Embedding", "EmbeddingGrad", "Cast", "Transpose",
            "AdamW", "ReduceSum", "AllReduce", "MemcpyHtoD")
COMPUTE_TYPES = len(OP_TYPES) - 2


def make_steps(n_steps: int, n_ops: int, gap_share: float, seed: int) -> list[StepEvents]:
    rng = np.random.default_rng(seed)
    steps = []
    t = ORIGIN_NS
    n_comm = n_ops // 20
    n_copy = max(1, n_ops // 100)
    n_comp = n_ops - n_comm - n_copy
    for step in range(n_steps):
        S = t
        F = S + int(rng.integers(1_000_000, 3_000_000))  # data wait
        dur = rng.integers(2_000, 80_000, n_comp)
        gap = np.where(rng.random(n_comp) < gap_share, rng.integers(1_000, 20_000, n_comp), 0)
        start = F + np.cumsum(dur + gap) - dur - gap
        B = int(start[-1] + dur[-1])
        comm_dur = rng.integers(200_000, 900_000, n_comm)
        comm_start = (F + B) // 2 + np.cumsum(comm_dur) - comm_dur
        copy_start = S + np.arange(n_copy) * 10_000
        copy_dur = np.full(n_copy, 8_000)
        E = max(B, int(comm_start[-1] + comm_dur[-1])) + 500_000
        steps.append(StepEvents(
            run_id="bench-run", rank=3, step=step, start_ns=S, end_ns=E, host="node-17", device="cuda:3",
            op_kind=np.concatenate([np.full(n_comp, COMPUTE), np.full(n_comm, COMMUNICATION),
                                    np.full(n_copy, MEMCPY)]).astype(np.uint8),
            op_type=np.concatenate([rng.integers(0, COMPUTE_TYPES, n_comp), np.full(n_comm, COMPUTE_TYPES),
                                    np.full(n_copy, COMPUTE_TYPES + 1)]).astype(np.int32),
            op_stream=np.concatenate([np.full(n_comp, 7), np.full(n_comm, 13), np.full(n_copy, 14)]).astype(np.int32),
            op_start_ns=np.concatenate([start, comm_start, copy_start]).astype(np.int64),
            op_dur_ns=np.concatenate([dur, comm_dur, copy_dur]).astype(np.int64),
            type_names=list(OP_TYPES),
            mem_ts_ns=np.array([S, E]), mem_allocated=np.array([8 << 30, 9 << 30]),
            mem_reserved=np.array([12 << 30, 12 << 30]), mem_peak=np.array([-1, 10 << 30]),
            queue=np.zeros(2, np.int32), queue_ts_ns=np.array([S, B]), queue_size=np.array([4, 3]),
            queue_names=["device_queue"]))
        t = E
    return steps


def check(paths: list[Path], steps: list[StepEvents]) -> dict[str, Any]:
    """Every op of every step exactly once across the files; event count as timeline_events."""
    per_step: dict[int, int] = {}
    events = 0
    for p in paths:
        doc = json.loads(gzip.decompress(p.read_bytes()))
        for e in doc["traceEvents"]:
            events += e["ph"] != "M"
            if e["ph"] == "X" and e["tid"] >= 100:
                per_step[e["args"]["step"]] = per_step.get(e["args"]["step"], 0) + 1
    assert per_step == {s.step: len(s.op_kind) for s in steps}, "ops lost or repeated"
    expected = sum(e["ph"] != "M" for e in timeline_events(steps))
    assert events == expected, f"{events} events in the files, timeline_events has {expected}"
    return {"files": len(paths), "events": events,
            "json_bytes": sum(len(gzip.decompress(p.read_bytes())) for p in paths),
            "gzip_bytes": sum(p.stat().st_size for p in paths)}


def rate(writer: TimelineWriter, steps: list[StepEvents], out: Path) -> tuple[float, float, list[Path]]:
    """(ops/s by the wall clock, ops/s by this process's CPU time, the files) of one write."""
    shutil.rmtree(out, ignore_errors=True)
    t0, c0 = time.perf_counter(), time.process_time()
    paths = writer.write(steps)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    ops = sum(len(s.op_kind) for s in steps)
    return ops / wall, ops / cpu, paths


def cpu_pressure() -> float | None:
    """Share of the last 60 s in which some runnable task waited for a CPU (Linux PSI)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split("avg60=")[1].split()[0]) / 100
    except (OSError, IndexError, ValueError):
        return None


def measure(steps: list[StepEvents], out: Path, repeats: int, level: int, label: str) -> dict[str, Any]:
    writer = TimelineWriter(out, DEFAULT_MAX_BYTES, compresslevel=level)
    _, _, paths = rate(writer, steps, out)  # warm-up, and the files that are checked
    shape = check(paths, steps)
    ops = sum(len(s.op_kind) for s in steps)
    rates, cpu_rates = [], []
    for r in range(repeats):
        ops_per_s, cpu_ops_per_s, _ = rate(writer, steps, out)
        rates.append(ops_per_s)
        cpu_rates.append(cpu_ops_per_s)
        note(f"{label} level {level} repeat {r + 1}/{repeats}: {ops_per_s / 1e6:.2f} M ops/s "
             f"({cpu_ops_per_s / 1e6:.2f} M by CPU time)")
    med = summary(rates)["median"]
    return {"ops_per_s": rates, "median": med, "summary": summary(rates),
            "cpu_ops_per_s": cpu_rates, "cpu_median": summary(cpu_rates)["median"], "ops": ops,
            "events_per_op": shape["events"] / ops, "events_per_s_median": med * shape["events"] / ops,
            "json_bytes_per_event": shape["json_bytes"] / shape["events"],
            "gzip_bytes_per_op": shape["gzip_bytes"] / ops, "files": shape["files"],
            "json_mb_per_s_median": med * shape["json_bytes"] / ops / 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=100, help="steps in the window")
    p.add_argument("--ops", type=int, default=2000, help="ops per step")
    p.add_argument("--gap-share", type=float, default=0.2, help="share of compute ops followed by a gap")
    p.add_argument("--level", type=int, default=1, help="gzip level of the target figure")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--dir", default=None, help="where files are written (default: a temporary directory)")
    args = p.parse_args(argv)

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-timeline-"))
    pressure = [cpu_pressure()]
    try:
        steps = make_steps(args.steps, args.ops, args.gap_share, args.seed)
        target = measure(steps, root / "target", args.repeats, args.level, "target")
        worst = measure(make_steps(args.steps, args.ops, 1.0, args.seed), root / "worst",
                        max(1, args.repeats // 2), args.level, "gap after every op")
        no_gaps = measure(make_steps(args.steps, args.ops, 0.0, args.seed), root / "no-gaps",
                          max(1, args.repeats // 2), args.level, "no gaps")
        levels = {}
        for level in (0, 1, 2, 3):
            levels[str(level)] = measure(steps, root / f"level{level}", 1, level, "levels")
        pressure.append(cpu_pressure())
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    results = {
        "metric": "op events/s from StepEvents to gzip trace files on disk (TimelineWriter.write), 1 thread",
        "unit": "ops/s",
        "per_repeat": target["ops_per_s"],
        "median": target["median"],
        "target": {"min_ops_per_s": TARGET_OPS_PER_S},
        "meets_target": target["median"] >= TARGET_OPS_PER_S,
        "figure": target,
        "diagnostics": {
            "cpu_time": {"what": "the same repeats timed by process CPU time: what the code costs when "
                                 "the machine is not shared", "median": target["cpu_median"],
                         "per_repeat": target["cpu_ops_per_s"]},
            "cpu_pressure_avg60": {"what": "Linux PSI: share of time runnable tasks waited for a CPU, "
                                           "at start and end", "values": pressure},
            "worst_case_gaps": {"what": "a gap after every compute op: 3 events per op", **worst},
            "no_gaps": {"what": "compute ops back to back, as the simulator lays them out", **no_gaps},
            "gzip_levels": {k: {"median": v["median"], "cpu_median": v["cpu_median"],
                                "gzip_bytes_per_op": v["gzip_bytes_per_op"]}
                            for k, v in levels.items()},
        },
    }
    emit(envelope("timeline", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
