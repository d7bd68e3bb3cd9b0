"""``profstream analyze`` of a ~50 MB Kineto GPU trace: seconds from command to summary.

The input, written once before timing: a Kineto-style trace with launch correlations
(per op a ``cpu_op``, its ``cudaLaunchKernel`` and the kernel it launched, sharing a
``correlation``; the device runs 0.8 of a step behind the host; one kernel in 20 an NCCL
all-reduce on a second stream, one in 50 a memcpy on a copy stream), ``--mb`` MB of JSON
(default 50) in 200 ``ProfilerStep#N`` steps.

Timed, per repeat:

- ``command``: ``profstream analyze TRACE`` in a fresh process, until it exits (interpreter
  start and imports included): what a user waits for. Target: under 2 s.
- ``in_process``: ``offline.analyze.analyze([TRACE])`` in this process, split into
  ``parse_s`` (reading the trace into a profile) and ``figures_s`` (raw batches and the
  processors). Both with the default parse workers (one per CPU).

Every repeat must give one StepMetrics per step, all of them measured on the device's
window (checked). Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from _common import emit, envelope, note, summary
from bench_ingest import BASE_NS, CPU_OPS, KERNELS  # the same kernels and CPU ops

TARGET_S = 2.0


def write_trace(path: Path, megabytes: float, steps: int = 200) -> tuple[int, int]:
    """The trace (see the module docstring); returns (events, ops)."""
    per_op_bytes = 460  # measured: three events of ~150 bytes each
    ops_per_step = max(1, int(megabytes * 1e6 / per_op_bytes / steps))
    step_us = 5.0 * ops_per_step + 20.0
    out: list[dict] = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
                       {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}}]
    t, corr = 1000.0, 1_000_000
    for step in range(steps):
        start = t
        out.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                    "ts": start, "dur": step_us, "args": {}})
        lag = 0.8 * step_us
        for i in range(ops_per_step):
            k = i % len(CPU_OPS)
            corr += 1
            out.append({"ph": "X", "cat": "cpu_op", "name": CPU_OPS[k], "pid": 1, "tid": 1, "ts": t,
                        "dur": 4.125, "args": {"External id": corr}})
            out.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                        "ts": t + 1.5, "dur": 2.25, "args": {"correlation": corr, "External id": corr}})
            if i % 20 == 19:
                kernel = {"cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "tid": 13, "dur": 9.5}
            elif i % 50 == 7:
                kernel = {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "tid": 9, "dur": 2.0}
            else:
                kernel = {"cat": "kernel", "name": KERNELS[k], "tid": 7, "dur": 3.75}
            out.append({"ph": "X", "pid": 0, "ts": t + 3.0 + lag, **kernel,
                        "args": {"stream": kernel["tid"], "correlation": corr, "External id": corr}})
            t += 5.0
        t = start + step_us
    path.write_bytes(msgspec.json.encode({"schemaVersion": 1, "baseTimeNanoseconds": BASE_NS,
                                          "distributedInfo": {"rank": 0}, "traceEvents": out}))
    return len(out), steps * ops_per_step * 3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=50.0, help="size of the trace's JSON (MB)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    profstream = Path(sys.executable).with_name("profstream")
    with tempfile.TemporaryDirectory(prefix="bench-analyze-") as tmp:
        path = Path(tmp) / "trace.json"
        events, ops = write_trace(path, args.mb)
        size = path.stat().st_size
        note(f"trace: {size / 1e6:.1f} MB, {events:,} events, {ops:,} ops")
        from profstream.offline.analyze import analyze

        command, parse, figures = [], [], []
        for r in range(args.repeats):
            t0 = time.perf_counter()
            res = subprocess.run([str(profstream), "analyze", str(path)], capture_output=True, text=True,
                                 env={**os.environ, "COLUMNS": "200"})
            wall = time.perf_counter() - t0
            if res.returncode != 0:
                raise SystemExit(f"profstream analyze failed: {res.stderr}")
            command.append(round(wall, 3))
            result = analyze([path])
            steps = len(result.steps)
            device = sum(s["device_end_ns"] is not None for s in result.steps)
            if steps != 200 or device != 200:
                raise SystemExit(f"expected 200 steps on device windows, got {steps} ({device})")
            parse.append(round(result.parse_s, 3))
            figures.append(round(result.figures_s, 3))
            note(f"repeat {r + 1}/{args.repeats}: command {wall:.2f} s; in process parse {result.parse_s:.2f} s, "
                 f"figures {result.figures_s:.2f} s")
    med = summary(command)["median"]
    emit(envelope("analyze", args, {
        "metric": "seconds from `profstream analyze TRACE` to its exit", "unit": "s",
        "workload": {"trace_bytes": size, "events": events, "ops": ops, "steps": 200},
        "per_repeat": command, "median": med, "target": {"max_s": TARGET_S}, "meets_target": med < TARGET_S,
        "figures": {"command_s": {"values": command, "summary": summary(command)},
                    "in_process_parse_s": {"values": parse, "summary": summary(parse)},
                    "in_process_figures_s": {"values": figures, "summary": summary(figures)}}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
