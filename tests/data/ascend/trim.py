"""How the fixtures in this folder were cut from the full samples (not run by the tests).

    python tests/data/ascend/trim.py /path/to/ascend-samples

The samples: Ascend's MindStudio Insight test data (torch_npu, Mulan PSL v2) and
mindspore-ai/mindinsight's test resources (msprof and MindSpore 1.x, Apache 2.0); see
README.md here. Events are kept whole (name, track, ts, dur); only args that no reader
uses are dropped, and whole families of events that no figure reads (counters, Python
functions, HCCL's per-plane tasks) are left out, so every figure the tools computed from
the full files holds for these.
"""

from __future__ import annotations

import csv
import gzip
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).parent
KEEP_ARGS = ("Task Type", "connection_id", "FP Start", "BP End", "Iteration ID", "name")


def _slim(e: dict) -> dict:
    out = {k: v for k, v in e.items() if k != "args"}
    args = {k: v for k, v in (e.get("args") or {}).items() if k in KEEP_ARGS}
    if args:
        out["args"] = args
    return out


def _write_gz(path: Path, events: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps(events, separators=(",", ":")).encode(), 9, mtime=0))


def torch_npu(src: Path) -> None:
    for rank in (0, 1):
        folder = src / f"msinsight/torch-npu-level0-2ranks/rank{rank}_ascend_pt"
        out = HERE / f"torch_npu/rank{rank}_ascend_pt"
        events = json.loads((folder / "ASCEND_PROFILER_OUTPUT/trace_view.json").read_bytes())
        kept = [_slim(e) for e in events
                if e.get("ph") == "M" or (e.get("ph") == "X" and e.get("cat") is None)
                or (e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#"))
                or (e.get("ph") in ("s", "f") and e.get("cat") in ("async_npu", "HostToDevice"))]
        _write_gz(out / "ASCEND_PROFILER_OUTPUT/trace_view.json.gz", kept)
        shutil.copy(folder / "ASCEND_PROFILER_OUTPUT/step_trace_time.csv", out / "ASCEND_PROFILER_OUTPUT")
        shutil.copy(folder / f"profiler_info_{rank}.json", out / f"profiler_info_{rank}.json")


def msprof(src: Path, iterations=(1, 2)) -> None:
    for prof in sorted((src / "mindinsight/msprof-2ranks-alexnet").glob("PROF_*")):
        for device in sorted(prof.glob("device_*")):
            out = HERE / "msprof" / prof.name / device.name
            n = device.name.split("_")[1]
            for f in sorted((device / "timeline").glob("msprof_*.json")):
                if int(f.stem.split("_")[-1]) not in iterations:
                    continue
                events = json.loads(f.read_bytes())
                planes = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                          and e["args"]["name"] == "HCCL"}
                kept = [_slim(e) for e in events if e.get("ph") != "X" or e["pid"] not in planes
                        or e["tid"] == 70000]  # HCCL: the collective track, not its planes
                _write_gz(out / "timeline" / (f.name + ".gz"), kept)
            for name in (f"start_info.{n}", f"info.json.{n}"):
                shutil.copy(device / name, out / name)


def ms1x(src: Path) -> None:
    run1, out = src / "mindinsight/ms1x-run1", HERE / "ms1x/profiler"
    out.mkdir(parents=True, exist_ok=True)
    with (run1 / "step_trace_raw_1_detail_time.csv").open() as f:
        rows = list(csv.reader(f))
    (out / "step_trace_raw_1_detail_time.csv").write_text(
        "\n".join(",".join(r[:9]) for r in rows[:13] + rows[-1:]) + "\n")
    for name in ("aicore_intermediate_1_detail.csv", "aicore_intermediate_1_type.csv", "min_cycle_counter_1.txt"):
        shutil.copy(run1 / name, out / name)
    with (run1 / "framework_raw_1.csv").open() as f:
        framework = [r[:7] for r in csv.reader(f)]  # op_info (shapes) left out
    with (out / "framework_raw_1.csv").open("w", newline="") as f:
        csv.writer(f).writerows(framework)
    lines = (run1 / "output_timeline_data_1.txt").read_text().splitlines()[:21]
    (out / "output_timeline_data_1.txt").write_text("\n".join(lines) + "\n")
    shutil.copy(src / "mindinsight/ms1x-run2-queues/step_trace_raw_1_detail_time.csv",
                HERE / "ms1x/run2_step_trace_raw_1_detail_time.csv")


if __name__ == "__main__":
    source = Path(sys.argv[1])
    torch_npu(source)
    msprof(source)
    ms1x(source)
