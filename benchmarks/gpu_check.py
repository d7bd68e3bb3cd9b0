"""``make gpu-check``: profstream's GPU path on a machine with an NVIDIA GPU, in one command.

``make gpu-check`` first builds what a fresh copy needs (virtual environment with the
torch extra, HTA, the Kafka jars); this script then

1. runs ``profstream doctor --gpu`` (NVML, torch with CUDA, Java, jars) and starts a local
   broker of its own (``profstream stack up --dir``) and a processor;
2. runs a small real training job on ``cuda:0``: a few transformer encoder blocks in bf16,
   a DataLoader with worker processes, AdamW (``TRAIN``, written to a temporary file),
   under ``profstream run`` with op capture on, and checks the StepMetrics the processor
   committed: one for every step; device windows (kernels with their launch times);
   CUDA kernel op types; CUDA memory figures; device counter figures (NVML) with GPU
   utilization and power > 0;
3. exports the Chrome trace of a window of the same job under torch.profiler alone and
   checks that profstream's figures of it (``profstream analyze``: the processors' code)
   equal Holistic Trace Analysis's temporal breakdown and comm/comp overlap within 1 %
   (HTA's ns rounding, % rounding and launch filter off, as tests/test_hta_compare.py);
4. measures the overhead on the GPU steps: the job plain, under ``profstream run
   --no-capture-ops``, under torch.profiler alone (one cycle per step, the schedule op
   capture uses, nothing exported) and under ``profstream run`` with op capture, in
   alternating order, ``--repeats`` times; medians of the per-run median step times
   (targets: <= 1 % capture off over plain, <= 3 % capture on over torch.profiler);
5. measures the device sampler's CPU time per reading on this GPU's real NVML.

Prints one JSON summary (``ok`` true when every check passed); exit status 0, 1 when a
check failed, 2 when this machine has no CUDA GPU (one line says so: nothing can be
checked here). The figures go into docs/benchmarks.md with the date and the command.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _common import emit, envelope, note, summary

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HTA_TOLERANCE = 0.01
TARGETS = {"capture_off_over_plain": 0.01, "capture_on_over_profiler": 0.03}
SKIP = 10  # first steps of a run left out of its step times (warm-up, cuDNN/cuBLAS autotuning)

# The training job. --mode plain | profiler (torch.profiler alone; with --trace-dir it
# exports the Chrome trace of steps 20-24 instead of a cycle per step); under profstream
# run, plain is what profstream instruments. Writes its step times (s) to --out.
TRAIN = r'''
import argparse, json, time
import torch
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--mode", default="plain")
ap.add_argument("--trace-dir")
ap.add_argument("--out", required=True)
args = ap.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(256, 512, generator=g), torch.randn(256, 512, generator=g)


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    model = nn.Sequential(*[nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True) for _ in range(4)])
    model = model.to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=16, num_workers=2, pin_memory=True,
                                         persistent_workers=True)
    prof = None
    if args.mode == "profiler":
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        if args.trace_dir:
            prof = torch.profiler.profile(activities=acts, schedule=torch.profiler.schedule(
                wait=18, warmup=2, active=5, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(args.trace_dir))
        else:
            prof = torch.profiler.profile(activities=acts, schedule=torch.profiler.schedule(
                wait=0, warmup=0, active=1, repeat=0), on_trace_ready=lambda p: None)
        prof.start()
    times, last = [], None
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        x = x.to(dev, torch.bfloat16, non_blocking=True)
        y = y.to(dev, torch.bfloat16, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = (model(x).float() - y.float()).pow(2).mean()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
        if prof is not None:
            prof.step()
    if prof is not None:
        prof.stop()
    json.dump(times, open(args.out, "w"))


main()
'''


def fail(msg: str, code: int = 1) -> None:
    print(json.dumps({"ok": False, "error": msg}))
    sys.exit(code)


def profstream(*args: str, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profstream.cli", *args], text=True, capture_output=True, **kw)


def run_job(train: Path, work: Path, variant: str, bootstrap: str, prefix: str, steps: int,
            run_id: str | None = None, trace_dir: Path | None = None) -> list[float]:
    out = work / f"{variant}-{uuid.uuid4().hex[:6]}.json"
    job = [sys.executable, str(train), "--steps", str(steps), "--out", str(out),
           "--mode", "profiler" if variant in ("profiler", "trace") else "plain"]
    if trace_dir is not None:
        job += ["--trace-dir", str(trace_dir)]
    if variant in ("capture_off", "capture_on"):
        job = [sys.executable, "-m", "profstream.cli", "run", "--bootstrap", bootstrap, "--topic-prefix", prefix,
               "--run-id", run_id or f"gpu-check-{variant}-{uuid.uuid4().hex[:6]}",
               "--capture-ops" if variant == "capture_on" else "--no-capture-ops", "--", *job]
    done = subprocess.run(job, text=True, capture_output=True, timeout=900)
    if done.returncode != 0:
        fail(f"the training job ({variant}) failed with status {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(out.read_text())


def median_step(times: list[float]) -> float:
    return statistics.median(times[SKIP:] if len(times) > 2 * SKIP else times)


def check_live_run(bootstrap: str, prefix: str, run_id: str, steps: int) -> dict[str, Any]:
    """The StepMetrics of the capture-on run: every step, device windows, kernels, memory,
    device counters."""
    from profstream.kafka.clients import read_topic
    from profstream.kafka.topics import Topics
    from profstream.schema.codec import decode, record_name

    records = read_topic(bootstrap, Topics(prefix).steps, lambda m: m is not None and m["run_id"] == run_id, steps,
                         120, decode=lambda raw: decode("StepMetrics", raw) if record_name(raw) == "StepMetrics" else None)
    got = sorted({m["step"] for m in records})
    with_devices = [m for m in records if m["devices"]]
    checks = {
        "step_metrics_for_every_step": len(got) == steps,
        "device_windows": sum(m["device_end_ns"] is not None for m in records) >= steps // 2,
        "cuda_kernel_op_types": any(m["kernel_types"] for m in records),
        "cuda_memory_figures": any(m["memory"] and m["memory"]["peak"] > 0 for m in records),
        "device_counters_in_steps": len(with_devices) >= steps // 2,
        "device_gpu_util_above_0": any((d["gpu_util"] or 0) > 0 for m in with_devices for d in m["devices"]),
        "device_power_above_0": any((d["power_w"] or 0) > 0 for m in with_devices for d in m["devices"]),
        "device_utilization_above_0": any((m["utilization"] or 0) > 0 for m in records),  # None: not captured
    }
    kinds = sorted({k["kind"] for m in records for k in m["device_kinds"]})
    return {"checks": checks, "steps_seen": len(got), "device_kinds": kinds,
            "top_kernels": sorted({k["op_type"] for m in records for k in m["kernel_types"]})[:10]}


def compare_with_hta(trace_dir: Path) -> dict[str, Any]:
    """profstream's figures of the exported traces against HTA's, summed over their steps."""
    import hta.analyzers.communication_analysis as comm
    from hta.common.trace import Trace
    from hta.trace_analysis import TraceAnalysis

    from profstream.offline.analyze import analyze

    os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
    Trace._filter_irrelevant_gpu_kernels = lambda self, include_last_profiler_step=False: None
    comm.round = lambda value, digits=None: value
    # no worker pool forked from this process (CUDA and the Monitor's threads in it): a fork
    # child can hang on a lock one of them held (tests/test_hta_compare.py)
    Trace.load_traces = functools.partialmethod(Trace.load_traces, use_multiprocessing=False)
    paths = sorted(trace_dir.glob("*.json*"))
    ta = TraceAnalysis(trace_dir=str(trace_dir))
    breakdown = ta.get_temporal_breakdown(visualize=False).set_index("rank")
    overlap = ta.get_comm_comp_overlap(visualize=False).set_index("rank")
    steps = [s for s in analyze(paths).steps if s["utilization"] is not None]  # steps with ops
    span = sum(s["step_time_ns"] for s in steps) / 1e3
    compute = sum(s["compute_ns"] for s in steps) / 1e3
    idle = sum(s["idle_ns"] for s in steps) / 1e3
    ours = {"kernel_time(us)": span, "compute_time(us)": compute, "idle_time(us)": idle,
            "non_compute_time(us)": span - compute - idle}
    rank = breakdown.index[0]
    theirs = {k: float(breakdown.loc[rank, k]) for k in ours}
    diffs = {k: abs(ours[k] - theirs[k]) / theirs[k] if theirs[k] else abs(ours[k]) for k in ours}
    comm_ns = sum(s["comm_ns"] for s in steps)
    if comm_ns:  # one GPU: usually no communication, and no overlap to compare
        ours["comp_comm_overlap_pctg"] = 100 * sum(s["overlap_ns"] for s in steps) / comm_ns
        theirs["comp_comm_overlap_pctg"] = float(overlap.loc[rank, "comp_comm_overlap_pctg"])
        diffs["comp_comm_overlap_pctg"] = abs(ours["comp_comm_overlap_pctg"] - theirs["comp_comm_overlap_pctg"]) / 100
    return {"steps": len(steps), "profstream": ours, "hta": theirs, "relative_difference": diffs,
            "within_1_percent": all(d <= HTA_TOLERANCE for d in diffs.values())}


def sampler_cost(readings: int = 200, interval_s: float = 0.02) -> dict[str, Any]:
    from profstream.devices.nvml import open_nvml
    from profstream.devices.sampler import DeviceSampler

    sampler = DeviceSampler(open_nvml([0]), lambda sample: None, interval_s)
    sampler.start()
    deadline = time.monotonic() + 60
    while sampler.readings < readings and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    per_reading = sampler.cpu_s / max(sampler.readings, 1)
    return {"readings": sampler.readings, "cpu_us_per_reading": per_reading * 1e6,
            "core_share_at_500ms": per_reading / 0.5, "unsupported_fields": sorted(sampler.backend.unsupported),
            "meets_target": per_reading / 0.5 <= 0.005}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="steps per training run")
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds of the four overhead variants")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        fail("torch is not installed: make gpu-check installs it (make .venv/.installed-torch-stamp)", 2)
    if not torch.cuda.is_available():
        fail("no CUDA GPU on this machine (torch.cuda.is_available() is false): make gpu-check needs one", 2)

    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    train = work / "train.py"
    train.write_text(TRAIN)
    up = profstream("stack", "up", "--dir", str(work / "stack"), timeout=300)
    if up.returncode != 0:
        fail(f"the local broker did not start: {up.stderr.strip()}")
    bootstrap = up.stdout.strip().splitlines()[-1]
    doctor = profstream("doctor", "--gpu", "--bootstrap", bootstrap, timeout=300)
    note(doctor.stdout)
    prefix = f"gpu-{uuid.uuid4().hex[:8]}"
    processor = subprocess.Popen([sys.executable, "-m", "profstream.cli", "process", "--bootstrap", bootstrap,
                                  "--topic-prefix", prefix, "--instance-id", "gpu-check"],
                                 stdout=subprocess.DEVNULL, stderr=open(work / "processor.log", "w"))
    try:
        note("live run with op capture and device counters")
        run_id = f"gpu-check-{uuid.uuid4().hex[:6]}"
        run_job(train, work, "capture_on", bootstrap, prefix, args.steps, run_id=run_id)
        live = check_live_run(bootstrap, prefix, run_id, args.steps)
        note("Chrome trace of the same job under torch.profiler, against HTA")
        run_job(train, work, "trace", bootstrap, prefix, 30, trace_dir=work / "trace")
        hta = compare_with_hta(work / "trace")
        note("overhead: alternating runs")
        variants = ("plain", "capture_off", "profiler", "capture_on")
        medians: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.repeats):
            for v in variants[r % 4:] + variants[:r % 4]:
                medians[v].append(median_step(run_job(train, work, v, bootstrap, prefix, args.steps)))
                note(f"round {r} {v}: {medians[v][-1] * 1e3:.2f} ms")
        med = {v: statistics.median(x) for v, x in medians.items()}
        overhead = {"capture_off_over_plain": med["capture_off"] / med["plain"] - 1,
                    "capture_on_over_profiler": med["capture_on"] / med["profiler"] - 1}
        sampler = sampler_cost()
    finally:
        processor.terminate()
        processor.wait(30)
        profstream("stack", "down", "--dir", str(work / "stack"), timeout=120)
    checks = {**live["checks"], "doctor_gpu": doctor.returncode == 0, "hta_within_1_percent": hta["within_1_percent"]}
    ok = all(checks.values())
    emit(envelope("gpu_check", args, {
        "ok": ok, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "checks": checks,
        "live_run": live, "hta": hta,
        "overhead": {"step_time_s": {v: summary(x) for v, x in medians.items()}, **overhead,
                     "targets": TARGETS, "meets_targets": all(overhead[k] <= t for k, t in TARGETS.items())},
        "sampler": sampler,
    }))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
