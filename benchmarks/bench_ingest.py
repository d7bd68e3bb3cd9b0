"""Ingest: Chrome trace events/s from a JSON file into op columns, and end to end to the broker.

The input is a Kineto-style trace written once before timing (default 1,000,000 trace
events, ~150 B each): per step a ``ProfilerStep#N`` annotation, then for each op a CPU
op, its ``cudaLaunchKernel`` and the kernel on a stream; one in 20 kernels is an NCCL
all-reduce on a second stream, one in 50 a memcpy; ``[memory]`` instant events and the
metadata events of every track. 500 steps.

Timed, per repeat:

- parse: ``load_profile(path, workers=W)``: read the file, msgspec typed decoding, every complete
  event into the op columns (kind from category/track/name, ns timestamps, step of each op),
  step marks, memory samples; in W worker processes, each a chunk of the events array
  (default: one per CPU; ``--workers 1``: in this process). events/s = trace events in the
  file / wall time; per CPU second counts this process and its workers. Target: >= 1,000,000.
- end to end (``--e2e``, on by default): ``ingest()`` to the broker through the real
  Monitor at ``pace=max`` until every batch is acknowledged; ops/s = ops sent / wall time.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from _common import broker_bootstrap, drop_topics, emit, envelope, note, summary, unique_prefix

from profstream.integrations.ingest import ingest, load_profile
from profstream.integrations.ingest.chunks import default_workers

TARGET_EVENTS_PER_S = 1_000_000
BASE_NS = 1_790_000_000_000_000_000
KERNELS = ("ampere_sgemm_128x64_tn", "void at::native::vectorized_elementwise_kernel<4>",
           "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm>", "void at::native::reduce_kernel<512, 1>",
           "void layer_norm_kernel<float>", "softmax_warp_forward<float, float, float, 8, false>")
CPU_OPS = ("aten::addmm", "aten::add_", "aten::mm", "aten::sum", "aten::native_layer_norm", "aten::_softmax")


def write_trace(path: Path, events: int, steps: int) -> int:
    """A Kineto-like trace of about ``events`` events; returns the exact count."""
    per_op = 3
    ops_per_step = max(1, (events // steps - 1) // per_op)
    out: list[dict] = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
                       {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
                       {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}},
                       {"ph": "M", "name": "thread_name", "pid": 0, "tid": 13, "args": {"name": "stream 13"}}]
    t = 1000.0
    for step in range(steps):
        start = t
        body: list[dict] = []
        for i in range(ops_per_step):
            k = i % len(CPU_OPS)
            body.append({"ph": "X", "cat": "cpu_op", "name": CPU_OPS[k], "pid": 1, "tid": 1, "ts": t,
                         "dur": 4.125, "args": {"External id": i}})
            body.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                         "ts": t + 1.5, "dur": 2.25, "args": {"correlation": i}})
            if i % 20 == 19:
                body.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                             "pid": 0, "tid": 13, "ts": t + 3.0, "dur": 9.5, "args": {"stream": 13}})
            elif i % 50 == 7:
                body.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)",
                             "pid": 0, "tid": 7, "ts": t + 3.0, "dur": 2.0, "args": {"stream": 7}})
            else:
                body.append({"ph": "X", "cat": "kernel", "name": KERNELS[k], "pid": 0, "tid": 7, "ts": t + 3.0,
                             "dur": 3.75, "args": {"stream": 7}})
            t += 5.0
        out.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                    "ts": start, "dur": t - start + 20.0, "args": {}})
        out.extend(body)
        t += 20.0
    path.write_bytes(msgspec.json.encode({"schemaVersion": 1, "baseTimeNanoseconds": BASE_NS, "traceEvents": out}))
    return len(out)


def _cpu() -> float:
    """CPU seconds of this process and of its finished workers."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                resource.getrusage(resource.RUSAGE_CHILDREN)))


def time_parse(path: Path, events: int, repeats: int, workers: int | None) -> dict:
    rates, cpu_rates, ops = [], [], 0
    for r in range(repeats):
        t0, c0 = time.perf_counter(), _cpu()
        profile = load_profile(path, workers=workers)
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        ops = profile.ops
        rates.append(round(events / wall, 1))
        cpu_rates.append(round(events / cpu, 1))
        note(f"parse {r + 1}/{repeats}: {events / wall:,.0f} events/s ({ops} ops, {profile.steps} steps)")
    return {"events_per_s": rates, "median": summary(rates)["median"], "summary": summary(rates),
            "cpu_events_per_s": cpu_rates, "cpu_median": summary(cpu_rates)["median"], "ops": ops}


def time_e2e(path: Path, bootstrap: str, repeats: int) -> dict:
    from profstream.kafka.topics import Topics, ensure_topics

    prefix = unique_prefix()
    ensure_topics(bootstrap, Topics(prefix), raw_partitions=4)
    rates, sent = [], 0
    try:
        for r in range(repeats):
            t0 = time.perf_counter()
            result = ingest(path, {"bootstrap": bootstrap, "run_id": f"bench-ingest-{r}", "topic_prefix": prefix})
            wall = time.perf_counter() - t0
            if not result.sent.flushed or result.sent.dropped_ops:
                raise SystemExit(f"end to end run {r}: not all delivered ({result.sent})")
            sent = result.sent.ops
            rates.append(round(sent / wall, 1))
            note(f"e2e {r + 1}/{repeats}: {sent / wall:,.0f} ops/s to the broker ({wall:.1f} s)")
    finally:
        drop_topics(bootstrap, prefix)
    return {"ops_per_s": rates, "median": summary(rates)["median"], "summary": summary(rates), "ops": sent}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--e2e-repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None,
                    help="processes that parse the trace (default: one per CPU; 1: this process only)")
    ap.add_argument("--no-e2e", dest="e2e", action="store_false")
    ap.add_argument("--bootstrap", default=None, help="broker (default: the local `profstream stack up` one)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        events = write_trace(path, args.events, args.steps)
        size = path.stat().st_size
        note(f"trace: {events:,} events, {size / 1e6:.0f} MB")
        load_profile(path, workers=args.workers)  # warm the page cache and imports
        results: dict = {"trace_events": events, "file_bytes": size,
                         "workers": args.workers or default_workers(),
                         "parse": time_parse(path, events, args.repeats, args.workers)}
        results["target"] = {"min_events_per_s": TARGET_EVENTS_PER_S}
        results["meets_target"] = results["parse"]["median"] >= TARGET_EVENTS_PER_S
        if args.e2e:
            results["end_to_end"] = time_e2e(path, broker_bootstrap(args.bootstrap), args.e2e_repeats)
    emit(envelope("ingest", args, results))


if __name__ == "__main__":
    sys.exit(main())
