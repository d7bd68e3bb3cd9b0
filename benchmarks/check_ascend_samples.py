"""Agreement with the producing tools on the full Ascend samples (not in the repository).

    python benchmarks/check_ascend_samples.py [SAMPLES]     # default: ../shared/ascend-samples

For each sample set of SAMPLES (its README says where they come from), a copy without the
tools' own results (step_trace_time.csv, the Overlap Analysis tracks, MindInsight's op
table) goes through ``profstream.offline.analyze``; its figures are compared with those
results. Prints one JSON object: per set and figure, profstream's value, the tool's and
the largest relative difference; exit 1 when one is past 0.1 %.

- torch_npu (msinsight/torch-npu-level0-2ranks): step_trace_time.csv per rank;
- msprof (mindinsight/msprof-2ranks-alexnet): per rank and iteration, the Iteration event
  (time, FP_BP, Iteration Refresh) and the Overlap Analysis sums; profstream's idle is
  msprof's Free plus the step's time before its first task and after its last;
- MindSpore 1.x (mindinsight/ms1x-run1): MindInsight's means over steps 2-322 and its op
  table (every type's calls and total), MatMul as in its tests.
"""

from __future__ import annotations

import csv
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from profstream.offline.analyze import analyze
from profstream.processors.figures import FigureOptions
from profstream.processors.stream import StreamOptions

OPTIONS = StreamOptions(figures=FigureOptions(top_k=1000))
LIMIT = 1e-3


class Agreement:
    def __init__(self) -> None:
        self.figures: dict[str, dict] = {}

    def add(self, name: str, mine: float, tool: float) -> None:
        rel = abs(mine - tool) / abs(tool) if tool else abs(mine - tool)
        row = self.figures.setdefault(name, {"worst_rel_diff": 0.0, "pairs": 0})
        row["pairs"] += 1
        if rel >= row["worst_rel_diff"]:
            row.update(worst_rel_diff=rel, profstream=round(mine, 6), tool=round(tool, 6))


def _strip(src: Path, dst: Path, drop: tuple[str, ...]) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*drop))
    for trace in list(dst.rglob("*.json")):
        try:
            events = json.loads(trace.read_bytes())
        except ValueError:
            continue
        if not isinstance(events, list):
            continue
        derived = {e.get("pid") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                   and (e.get("args") or {}).get("name") == "Overlap Analysis"}
        if derived:
            trace.write_text(json.dumps([e for e in events if e.get("pid") not in derived]))
    return dst


def torch_npu(samples: Path, tmp: Path) -> dict:
    src = samples / "msinsight/torch-npu-level0-2ranks"
    result = analyze([_strip(src, tmp / "tnpu", ("step_trace_time.csv",))], options=OPTIONS)
    a = Agreement()
    pairs = {"compute_ns": "Computing", "comm_ns": "Communication", "overlap_ns": "Overlapped",
             "pure_comm_ns": "Communication(Not Overlapped)", "idle_ns": "Free", "step_time_ns": "Stage"}
    for s in result.steps:
        with (src / f"rank{s['rank']}_ascend_pt/ASCEND_PROFILER_OUTPUT/step_trace_time.csv").open() as f:
            tool = next(csv.DictReader(f))
        for mine, theirs in pairs.items():
            a.add(f"{mine} vs {theirs}", s[mine] / 1000, float(tool[theirs]))
        a.add("device_start_ns - start_ns vs Preparing", (s["device_start_ns"] - s["start_ns"]) / 1000,
              float(tool["Preparing"]))
    return {"ranks": len(result.ranks), "steps": len(result.steps), "figures_us": a.figures}


def msprof(samples: Path, tmp: Path) -> dict:
    src = samples / "mindinsight/msprof-2ranks-alexnet"
    result = analyze([_strip(src, tmp / "msprof", ())], options=OPTIONS)
    steps = {(s["rank"], s["step"]): s for s in result.steps}
    a = Agreement()
    for trace in sorted(src.glob("PROF_*/device_*/timeline/msprof_*.json")):
        rank, it = int(trace.stem.split("_")[1]), int(trace.stem.split("_")[3])
        events = json.loads(trace.read_bytes())
        names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
        overlap = [e for e in events if e.get("ph") == "X" and names.get(e["pid"]) == "Overlap Analysis"]
        sums = {n: sum(e["dur"] for e in overlap if e["name"] == n)
                for n in ("Computing", "Communication", "Communication(Not Overlapped)", "Free")}
        (iteration,) = [e for e in events if e.get("name") == f"Iteration {it}"]
        args, s = iteration["args"], steps[(rank, it)]
        lead = min(e["ts"] for e in overlap) - iteration["ts"]
        trail = iteration["ts"] + iteration["dur"] - max(e["ts"] + e["dur"] for e in overlap)
        for mine, tool in (("step_time_ns vs Iteration", iteration["dur"]),
                           ("fp_bp_ns vs FP_BP Time", args["BP End"] - args["FP Start"]),
                           ("tail_ns vs Iteration Refresh", iteration["ts"] + iteration["dur"] - args["BP End"]),
                           ("compute_ns vs Computing", sums["Computing"]), ("comm_ns vs Communication",
                                                                           sums["Communication"]),
                           ("pure_comm_ns vs Communication(Not Overlapped)", sums["Communication(Not Overlapped)"]),
                           ("idle_ns vs Free + before first task + after last task", sums["Free"] + lead + trail)):
            a.add(mine, s[mine.split(" ")[0]] / 1000, tool)
        a.add("overlap_ns vs Communication - Communication(Not Overlapped) (both 0 here)",
              s["overlap_ns"] / 1000, sums["Communication"] - sums["Communication(Not Overlapped)"])
    return {"ranks": len(result.ranks), "steps": len(result.steps), "figures_us": a.figures}


def ms1x(samples: Path, tmp: Path) -> dict:
    src = samples / "mindinsight/ms1x-run1"
    result = analyze([_strip(src, tmp / "ms1x", ("aicore_intermediate_1_type.csv",))], options=OPTIONS)
    a = Agreement()
    later = [s for s in result.steps if s["step"] >= 2]
    mindinsight_ms = {"step_time_ns": 205.3809, "data_wait_ns": 0.2038, "fp_bp_ns": 118.054, "tail_ns": 87.1231}
    for field, tool in mindinsight_ms.items():  # MindInsight rounds its means to 4 decimals
        a.add(f"mean {field} over steps 2-322 (ms)", statistics.mean(s[field] for s in later) / 1e6, tool)
    types: dict[str, list[int]] = {}
    for s in result.steps:
        for t in s["op_types"]:
            row = types.setdefault(t["op_type"], [0, 0])
            row[0] += t["count"]
            row[1] += t["total_ns"]
    with (src / "aicore_intermediate_1_type.csv").open() as f:
        table = {r["kernel_type"]: (int(r["execution_frequency"]), float(r["total_time"])) for r in csv.DictReader(f)}
    for name, (calls, total_ms) in table.items():
        a.add("op type calls", types.get(name, [0, 0])[0], calls)
        a.add("op type total (ms)", types.get(name, [0, 0])[1] / 1e6, total_ms)
    matmul = types.get("MatMul", [0, 0])
    return {"steps": len(result.steps), "figures": a.figures, "op_types": len(types), "op_types_in_table": len(table),
            "MatMul": {"total_us": matmul[1] / 1000, "calls": matmul[0],
                       "average_us": round(matmul[1] / 1000 / max(matmul[0], 1), 3),
                       "mindinsight": {"total_us": 2807.82, "calls": 25, "average_us": 112.313}}}


def main() -> int:
    samples = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "shared/ascend-samples"
    if not samples.is_dir():
        print(f"error: {samples}: no such folder: give the Ascend samples' folder", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = {"samples": str(samples), "limit_rel_diff": LIMIT,
               "torch_npu": torch_npu(samples, Path(tmp)), "msprof": msprof(samples, Path(tmp)),
               "mindspore_1x": ms1x(samples, Path(tmp))}
    worst = max(row["worst_rel_diff"] for part in ("torch_npu", "msprof", "mindspore_1x")
                for row in (out[part].get("figures_us") or out[part]["figures"]).values())
    out["worst_rel_diff"] = worst
    print(json.dumps(out, indent=2))
    return 0 if worst <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
