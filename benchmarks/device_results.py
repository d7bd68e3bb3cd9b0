"""The verdict of a GPU check, here: the files ``device_check.py`` wrote on the GPU machine.

``python benchmarks/device_results.py DIR`` (DIR holds summary.json, spool.tar.gz,
trace.json.gz, log.txt):

1. starts a broker of its own (``profstream stack up --dir``; or ``--bootstrap``) and a
   processor on a topic prefix of its own;
2. publishes the live run's spool into it (``profstream spool publish``'s code) and reads
   the StepMetrics the processor committed: one for every step; device windows from the
   CUDA kernels; CUDA kernel op types; CUDA memory; the NVML counters per step (GPU and
   memory-controller utilization, power, temperature, clock-event reasons), the work of
   every step (its tokens from the DataLoader's token ids, its model FLOPs counted once per
   input shape) and the MFU of the bf16 job against the card's dense peak — the GPU checks
   are "not applicable" on a ``--device cpu`` run, never passed by default;
3. compares ``profstream analyze`` of the exported trace with Holistic Trace Analysis
   (temporal breakdown, comm/comp overlap) within 1 % (as tests/test_hta_compare.py);
4. prints one JSON summary with the machine's figures (overhead series, sampler cost) and
   the targets: op capture off ≤ 0.5 % over plain, on ≤ 2 % over torch.profiler alone.

Exit status 0 when every applicable check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import uuid
from pathlib import Path
from typing import Any

from _common import emit, envelope, note

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HTA_TOLERANCE = 0.01
TARGETS = {"capture_off_over_plain": 0.005, "capture_on_over_profiler": 0.02}


def live_checks(records: list[dict], steps: int, gpu: bool) -> dict[str, Any]:
    """What the StepMetrics of the live run must show; GPU-only checks are None on CPU."""
    got = sorted({m["step"] for m in records})
    with_devices = [m for m in records if m["devices"]]

    def on_gpu(ok: bool) -> bool | None:
        return ok if gpu else None

    checks = {
        "step_metrics_for_every_step": set(range(steps)) <= set(got),
        "device_windows": on_gpu(sum(m["device_end_ns"] is not None for m in records) >= steps - 1),
        "cuda_kernel_op_types": on_gpu(any(m["kernel_types"] for m in records)),
        "cuda_memory_figures": on_gpu(any(m["memory"] and m["memory"]["peak"] > 0 for m in records)),
        "device_counters_in_steps": on_gpu(len(with_devices) >= steps // 2),
        "device_gpu_util_above_0": on_gpu(any((d["gpu_util"] or 0) > 0 for m in with_devices for d in m["devices"])),
        "device_mem_util_measured": on_gpu(any(d["mem_util"] is not None for m in with_devices for d in m["devices"])),
        "device_power_above_0": on_gpu(any((d["power_w"] or 0) > 0 for m in with_devices for d in m["devices"])),
        "device_temperature_measured": on_gpu(any(d["temperature_max_c"] is not None
                                                  for m in with_devices for d in m["devices"])),
        "device_utilization_above_0": on_gpu(any((m["utilization"] or 0) > 0 for m in records)),  # None: no ops
        "work_figures_every_step": all(m["work"] is not None and m["work"]["tokens"] and m["work"]["flops"]
                                       for m in records),
    }
    # MFU against the card's dense peak (profstream's table, for the dtype the count saw): a
    # card the table does not know has none, rightly (not applicable then, never a guess)
    peaks = [m["work"]["peak_flops"] for m in records if m["work"] is not None and m["work"]["peak_flops"]]
    checks["mfu_against_the_cards_peak"] = on_gpu(all(0 < (m["work"]["mfu"] or 0) <= 1 for m in records
                                                      if m["work"] is not None)) if peaks else None
    return checks


def work_figures(records: list[dict]) -> dict[str, Any]:
    """The live run's throughput and MFU, medians over its steps (the first step of a shape
    ran under the FLOP counter: the median leaves it out)."""
    import statistics

    works = [m["work"] for m in records if m["work"] is not None]

    def med(key: str, scale: float = 1.0) -> float | None:
        values = [w[key] * scale for w in works if w[key] is not None]
        return statistics.median(values) if values else None

    sources: dict[str, int] = {}
    for w in works:
        sources[str(w["flops_source"])] = sources.get(str(w["flops_source"]), 0) + 1
    return {"steps_with_work": len(works), "tokens_per_step": med("tokens"), "samples_per_step": med("samples"),
            "gflops_per_step": med("flops", 1e-9), "flops_source": sources, "tokens_per_s": med("tokens_per_s"),
            "samples_per_s": med("samples_per_s"), "achieved_tflops": med("flops_per_s", 1e-12),
            "peak_tflops": med("peak_flops", 1e-12), "mfu": med("mfu")}


def per_step(records: list[dict]) -> dict[str, Any]:
    """The live run's figures, medians over its steps (what docs/benchmarks.md quotes)."""
    import statistics

    def med(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    devs = [d for m in records for d in m["devices"]]
    kinds: dict[str, float] = {}
    for m in records:
        for k in m["device_kinds"]:
            kinds[k["kind"]] = kinds.get(k["kind"], 0.0) + k["total_ns"] / 1e6
    kernels: dict[str, float] = {}
    for m in records:
        for k in m["kernel_types"]:
            kernels[k["op_type"]] = kernels.get(k["op_type"], 0.0) + k["total_ns"] / 1e6
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
    return {
        "steps": len(records),
        "step_time_ms": med([m["step_time_ns"] / 1e6 for m in records]),
        "host_step_time_ms": med([m["host_step_time_ns"] / 1e6 for m in records]),
        "device_window_ms": med([(m["device_end_ns"] - m["device_start_ns"]) / 1e6 for m in records
                                 if m["device_end_ns"] is not None and m["device_start_ns"] is not None]),
        "compute_ms": med([m["compute_ns"] / 1e6 for m in records if m["compute_ns"] is not None]),
        "idle_ms": med([m["idle_ns"] / 1e6 for m in records if m["idle_ns"] is not None]),
        "utilization": med([m["utilization"] for m in records if m["utilization"] is not None]),
        "op_count": med([m["op_count"] for m in records]),
        "device_kinds_ms_total": {k: round(v, 2) for k, v in sorted(kinds.items())},
        "top_kernel_types_ms_total": {k: round(v, 2) for k, v in top},
        "memory_peak_mib": med([m["memory"]["peak"] / 2**20 for m in records if m["memory"]]),
        "memory_reserved_mib": med([m["memory"]["reserved"] / 2**20 for m in records
                                    if m["memory"] and m["memory"]["reserved"] >= 0]),
        "nvml": {
            "samples_per_step": med([d["samples"] for d in devs]),
            "gpu_util": med([d["gpu_util"] for d in devs if d["gpu_util"] is not None]),
            "mem_util": med([d["mem_util"] for d in devs if d["mem_util"] is not None]),
            "power_w": med([d["power_w"] for d in devs if d["power_w"] is not None]),
            "power_limit_w": med([d["power_limit_w"] for d in devs if d["power_limit_w"] is not None]),
            "temperature_max_c": med([d["temperature_max_c"] for d in devs if d["temperature_max_c"] is not None]),
            "sm_clock_mhz": med([d["sm_clock_mhz"] for d in devs if d["sm_clock_mhz"] is not None]),
            "throttle_reasons_seen": sorted({d["throttle_reasons"] for d in devs if d["throttle_reasons"]}),
        },
    }


def compare_with_hta(trace: Path) -> dict[str, Any]:
    """profstream's figures of the exported trace against HTA's, summed over its steps
    (HTA's ns rounding, % rounding and launch filter off, as tests/test_hta_compare.py)."""
    import functools
    import os

    import hta.analyzers.communication_analysis as comm
    from hta.common.trace import Trace
    from hta.trace_analysis import TraceAnalysis

    from profstream.offline.analyze import analyze

    os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
    Trace._filter_irrelevant_gpu_kernels = lambda self, include_last_profiler_step=False: None
    comm.round = lambda value, digits=None: value
    Trace.load_traces = functools.partialmethod(Trace.load_traces, use_multiprocessing=False)
    ta = TraceAnalysis(trace_dir=str(trace.parent))
    breakdown = ta.get_temporal_breakdown(visualize=False).set_index("rank")
    overlap = ta.get_comm_comp_overlap(visualize=False).set_index("rank")
    steps = [s for s in analyze([trace]).steps if s["utilization"] is not None]  # the steps with ops
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


def analyze_only(trace: Path) -> dict[str, Any]:
    from profstream.offline.analyze import analyze

    steps = analyze([trace]).steps
    return {"steps": len(steps), "within_1_percent": None,
            "note": "a CPU trace has no GPU kernels: HTA's breakdown does not apply"}


def profstream_cmd(*args: str, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profstream.cli", *args], text=True, capture_output=True, **kw)


def read_steps(bootstrap: str, prefix: str, run_id: str, steps: int) -> list[dict]:
    from profstream.kafka.clients import read_topic
    from profstream.kafka.topics import Topics
    from profstream.schema.codec import decode, record_name

    def step_metrics(raw: bytes) -> dict | None:  # the steps topic also carries RankEnd records
        return decode("StepMetrics", raw) if record_name(raw) == "StepMetrics" else None

    return read_topic(bootstrap, Topics(prefix).steps, lambda m: m is not None and m["run_id"] == run_id, steps,
                      120, decode=step_metrics)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the files device_check.py wrote ($OUT of the device call)")
    ap.add_argument("--bootstrap", help="a broker to use (default: one of its own, stopped at the end)")
    args = ap.parse_args()

    args.dir = Path(args.dir)
    summary = json.loads((args.dir / "summary.json").read_text())
    env = summary.get("environment") or {}
    gpu = str(summary["args"].get("device", "cuda")).startswith("cuda")
    work = Path(tempfile.mkdtemp(prefix="device-results-"))
    out: dict[str, Any] = {"device": {k: env.get(k) for k in ("gpu", "gpu_memory_gib", "driver", "torch", "cuda",
                                                              "python", "native_monitor")},
                           "device_wall_s": summary.get("wall_s"), "device_errors": summary.get("errors"),
                           "install": summary.get("install")}
    checks: dict[str, bool | None] = {"device_phases_ok": not summary.get("errors")}
    bootstrap, stack = args.bootstrap, None
    if bootstrap is None:
        stack = work / "stack"
        up = profstream_cmd("stack", "up", "--dir", str(stack), timeout=300)
        if up.returncode != 0:
            raise SystemExit(f"the local broker did not start: {up.stderr.strip()}")
        bootstrap = up.stdout.strip().splitlines()[-1]
    prefix = f"device-{uuid.uuid4().hex[:8]}"
    processor = subprocess.Popen([sys.executable, "-m", "profstream.cli", "process", "--bootstrap", bootstrap,
                                  "--topic-prefix", prefix, "--instance-id", "device-results", "--metrics-port", "0"],
                                 stdout=subprocess.DEVNULL, stderr=open(work / "processor.log", "w"))
    try:
        live = summary.get("live_run")
        parts = [args.dir / name for name in (live or {}).get("files", [])]
        if live and parts and all(p.exists() for p in parts):
            from profstream.producers.spool_publish import publish_spool

            packed = work / "spool.tar.gz"
            packed.write_bytes(b"".join(p.read_bytes() for p in parts))
            with tarfile.open(packed) as tar:
                tar.extractall(work, filter="data")
            note("publishing the live run's spool")
            published = publish_spool(work / "spool", bootstrap, prefix)
            out["spool"] = [{"run": r.run_id, "rank": r.rank, "records": r.records, "ops": r.ops,
                             "samples": r.samples, "damaged": r.corrupt_regions, "refused": r.refused}
                            for r in published]
            records = read_steps(bootstrap, prefix, live["run_id"], live["steps"])
            checks.update(live_checks(records, live["steps"], gpu))
            out["live_run"] = {**live, "figures": per_step(records), "work": work_figures(records)}
        else:
            checks["step_metrics_for_every_step"] = False
            note("no live run came back: its phase failed on the device (summary.json's errors)")
        parts = [args.dir / name for name in (summary.get("trace") or {}).get("files", [])]
        if parts and all(p.exists() for p in parts):
            trace = work / "trace" / "rank0.pt.trace.json.gz"
            trace.parent.mkdir()
            trace.write_bytes(b"".join(p.read_bytes() for p in parts))
            out["hta"] = compare_with_hta(trace) if gpu else analyze_only(trace)
            checks["hta_within_1_percent"] = out["hta"]["within_1_percent"]
    finally:
        processor.terminate()
        processor.wait(30)
        if stack is not None:
            profstream_cmd("stack", "down", "--dir", str(stack), timeout=120)
    ovh = summary.get("overhead") or {}
    if ovh.get("rounds"):
        out["overhead"] = {**ovh, "targets": TARGETS,
                           "meets_targets": {k: ovh[k] <= t for k, t in TARGETS.items() if k in ovh}}
    out["sampler"] = summary.get("sampler")
    out["checks"] = checks
    out["ok"] = all(v is not False for v in checks.values())
    emit(envelope("device_results", argparse.Namespace(dir=str(args.dir), bootstrap=args.bootstrap), out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
