"""Synthetic Kineto (PyTorch profiler) GPU traces, written in the JSON format Kineto writes,
with their device figures known by construction.

``lagging_device_trace`` lays out ``steps`` host steps (``ProfilerStep#k``, ``STEP_US`` µs
each) whose kernels run ``lag`` of a step behind the host: launched in host step k, they
run in host step k + 1 and the first of them spans the host boundary. Per step on the
device, relative to its first device op at d_k = S_k + lag × STEP_US (µs):

    memcpy  stream 9 (copy)  [0, 50)          input copy, HtoD
    gemm A  stream 7         [60, 300)        compute; A and B overlap on two streams,
    gemm B  stream 8         [200, 400)       and B holds a nested-looking tail of A
    gemm C  stream 7         [420, 700)
    nccl    stream 20        [500, 980)       all-reduce, overlapped by C and D
    adam D  stream 7         [910, 960)       optimizer

so each step's device work: compute ∪ = [60,400) ∪ [420,700) ∪ [910,960) = 670 µs,
communication 480 µs, overlap 200 + 50 = 250 µs, busy (every device op) 950 µs; the step
ends on the device at d_k + 980, and the next one starts 20 µs later.

With ``early``, each step also launches two ops early in its host step (a prefetch) that
run while the previous step's work still runs on the device (``EARLY``, relative to d_k):

    memcpy  stream 10        [-300, -150)     the next input's copy, launched at S_k + 60
    kernel  stream 11        [-250, -40)      launched at S_k + 70, beside the previous
                                              step's all-reduce and optimizer kernels

so that consecutive steps' device work interleaves, as in traces of jobs that prefetch.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

STEP_US = 1000.0
HOST_PID, HOST_TID = 1000, 1000
GPU_PID = 0
KERNELS = (  # (name, category, stream, start, end) relative to the step's first device op, µs
    ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 9, 0.0, 50.0),
    ("void gemm_a_kernel<float, 128>(float const*, float*)", "kernel", 7, 60.0, 300.0),
    ("void gemm_b_kernel<float, 64>(float const*, float*)", "kernel", 8, 200.0, 400.0),
    ("void gemm_c_kernel<float, 128>(float const*, float*)", "kernel", 7, 420.0, 700.0),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "kernel", 20, 500.0, 980.0),
    ("void adam_kernel<float>(float*, float const*)", "kernel", 7, 910.0, 960.0),
)
EARLY = (  # (name, category, stream, start, end, launch) relative to d_k (launch: to S_k), µs
    ("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 10, -300.0, -150.0, 60.0),
    ("void prefetch_kernel<float>(float const*, float*)", "kernel", 11, -250.0, -40.0, 70.0),
)
PER_STEP = {"compute": 670.0, "comm": 480.0, "overlap": 250.0, "busy": 950.0, "device_span": 980.0,
            "first_compute": 60.0, "last_compute_end": 960.0,
            "kinds": {"compute": 240.0 + 200.0 + 280.0 + 50.0, "communication": 480.0, "memcpy": 50.0}}


@dataclass
class Trace:
    """A trace being built: Kineto's header and events."""

    rank: int = 0
    events: list[dict] = field(default_factory=list)
    correlation: int = 1_000_000  # Kineto numbers them from large values (HTA on pandas 3 needs > int8)

    def host(self, name: str, cat: str, ts: float, dur: float, **args) -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": HOST_PID, "tid": HOST_TID,
                            "ts": round(ts, 3), "dur": round(dur, 3), "args": args})

    def launch(self, ts: float, kernel: str, cat: str, stream: int, start: float, end: float,
               correlated: bool = True) -> None:
        """A cudaLaunchKernel (or cudaMemcpyAsync) at ``ts`` and the device op it launched."""
        self.correlation += 1
        c = self.correlation
        runtime = "cudaMemcpyAsync" if cat == "gpu_memcpy" else "cudaLaunchKernel"
        self.host(runtime, "cuda_runtime", ts, 5.0, correlation=c, **{"External id": c})
        args = {"device": 0, "stream": stream, "correlation": c, "External id": c}
        if not correlated:
            args.pop("correlation")
        self.events.append({"ph": "X", "cat": cat, "name": kernel, "pid": GPU_PID, "tid": stream,
                            "ts": round(start, 3), "dur": round(end - start, 3), "args": args})
        self.events.append({"ph": "s", "id": c, "pid": HOST_PID, "tid": HOST_TID, "ts": round(ts, 3),
                            "cat": "ac2g", "name": "ac2g"})
        self.events.append({"ph": "f", "id": c, "pid": GPU_PID, "tid": stream, "ts": round(start, 3),
                            "cat": "ac2g", "name": "ac2g", "bp": "e"})

    def document(self, base_ns: int) -> dict:
        meta = [{"ph": "M", "name": "process_name", "pid": HOST_PID, "tid": 0, "args": {"name": "python"}},
                {"ph": "M", "name": "thread_name", "pid": HOST_PID, "tid": HOST_TID, "args": {"name": "thread 1"}},
                {"ph": "M", "name": "process_name", "pid": GPU_PID, "tid": 0, "args": {"name": "GPU 0"}}]
        return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100", "totalGlobalMem": 85e9}],
                "distributedInfo": {"backend": "nccl", "rank": self.rank, "world_size": 1},
                "baseTimeNanoseconds": base_ns, "traceEvents": meta + self.events,
                "traceName": f"rank{self.rank}.json"}

    def write(self, path: Path, base_ns: int = 1_790_000_000_000_000_000) -> Path:
        text = json.dumps(self.document(base_ns))
        if path.name.endswith(".gz"):
            path.write_bytes(gzip.compress(text.encode()))
        else:
            path.write_text(text)
        return path


def lagging_device_trace(steps: int = 6, lag: float = 0.8, rank: int = 0, first_step: int = 1,
                         t0_us: float = 10_000.0, uncorrelated: tuple[int, ...] = (),
                         device_offset_us: float = 0.0, seed: int | None = None, early: bool = False) -> Trace:
    """See the module docstring. ``uncorrelated``: steps whose gemm C has no correlation
    (a device op the time rule must place); ``device_offset_us``: added to every device
    timestamp (a device clock that is not the host's); ``seed``: each step's device
    layout scaled by a random 0.7-1.0 and started up to 15 us late, timestamps with ns
    digits (the figures of PER_STEP then no longer hold; steps still do not interleave);
    ``early``: each step's ``EARLY`` ops too (steps interleave; a lag of at least 0.4)."""
    import random

    rng = random.Random(seed)
    t = Trace(rank=rank)
    for i in range(steps):
        k = first_step + i
        S = t0_us + i * STEP_US
        t.host(f"ProfilerStep#{k}", "user_annotation", S, STEP_US)
        t.host("aten::linear", "cpu_op", S + 80.0, 300.0)
        d = S + lag * STEP_US + device_offset_us
        scale = 1.0
        if seed is not None:
            d += round(rng.uniform(0.0, 15.0), 3)
            scale = rng.uniform(0.7, 1.0)
        for j, (name, cat, stream, a, b) in enumerate(KERNELS):
            launch = S + 100.0 + 50.0 * j
            t.launch(launch, name, cat, stream, d + round(a * scale, 3), d + round(b * scale, 3),
                     correlated=not (k in uncorrelated and j == 3))
        if early:
            assert lag >= 0.4, "an early op must start after its launch"
            for name, cat, stream, a, b, at in EARLY:
                t.launch(S + at, name, cat, stream, d + a, d + b)
        t.host("Optimizer.step#Adam.step", "user_annotation", S + 700.0, 100.0)
    return t
