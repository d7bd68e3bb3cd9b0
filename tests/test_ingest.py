"""profstream ingest against the real broker and processor: a trace from a real torch.profiler
run, and MindSpore / msprof samples written here from their documented columns. The
StepMetrics the processor computes from an ingested profile equal what the files say."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from profstream.integrations.ingest import IngestError, ingest, load_profile
from profstream.processors.figures import FigureOptions
from tests.helpers import step_records
from tests.test_processor import RunningProcessor

BASE_NS = 1_790_000_000_000_000_000  # an absolute clock: ns since the epoch (2026)
NS = pytest.approx  # trace files hold microseconds with 3 decimals: allow the ns rounding


def _ingest_and_process(bootstrap, topics, path, run_id, count, **kw):
    with RunningProcessor(bootstrap, topics, figure_options=FigureOptions(top_k=200)):
        result = ingest(path, {"bootstrap": bootstrap, "run_id": run_id, "topic_prefix": topics.prefix}, **kw)
        steps = step_records(bootstrap, topics.steps, run_id, count)
    assert result.sent.flushed and result.sent.dropped_ops == 0
    return result, sorted(steps, key=lambda s: s["step"])


def _types(record) -> dict[str, int]:
    return {t["op_type"]: t["total_ns"] for t in record["op_types"]}


# -- PyTorch ---------------------------------------------------------------------------

def _torch_trace(path: Path, steps: int = 7) -> None:
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, schedule

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(16, 32) for _ in range(steps)]
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=4, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path)), profile_memory=True) as prof:
        for x in batches:
            time.sleep(0.002)  # the data wait: no op runs before the forward pass
            loss = model(x).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            prof.step()


def _us_ns(us: float) -> int:
    return round(us * 1000)


def test_torch_profiler_trace_gives_step_metrics_equal_to_the_trace(kafka_bootstrap, topics, tmp_path):
    path = tmp_path / "trace.json"
    _torch_trace(path)
    trace = json.loads(path.read_text())
    base = trace["baseTimeNanoseconds"]
    events = trace["traceEvents"]
    marks = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    assert len(marks) == 4

    result, steps = _ingest_and_process(kafka_bootstrap, topics, path, "torch-trace", len(marks))
    assert result.profile.source == "pytorch trace"
    assert [s["step"] for s in steps] == sorted(int(m["name"].split("#")[1]) for m in marks)
    for mark, rec in zip(sorted(marks, key=lambda m: m["ts"]), steps):
        S = base + _us_ns(mark["ts"])
        E = S + _us_ns(mark["dur"])
        ops = [e for e in events if e.get("cat") == "cpu_op" and S <= base + _us_ns(e["ts"]) < E]
        F = min(base + _us_ns(e["ts"]) for e in ops)
        B = min(max(base + _us_ns(e["ts"]) + _us_ns(e["dur"]) for e in ops), E)
        assert rec["start_ns"] == NS(S, abs=2) and rec["end_ns"] == NS(E, abs=2)
        assert rec["step_time_ns"] == NS(E - S, abs=2)
        assert rec["data_wait_ns"] == NS(F - S, abs=4) and rec["data_wait_ns"] >= 2_000_000  # the sleep
        assert rec["fp_bp_ns"] == NS(B - F, abs=4) and rec["tail_ns"] == NS(E - B, abs=4)
        assert rec["data_wait_ns"] + rec["fp_bp_ns"] + rec["tail_ns"] == rec["step_time_ns"]
        assert {"aten::addmm", "aten::relu", "aten::mm"} <= set(_types(rec))
        allocated = [e["args"]["Total Allocated"] for e in events
                     if e.get("name") == "[memory]" and S <= base + _us_ns(e["ts"]) <= E]
        assert rec["memory"]["peak"] == max(allocated)


# -- MindSpore profiler directory ------------------------------------------------------

STEP_HEADER = "step_num,start_point,end_point,total,fp_point,bp_point,iteration_interval,fp_and_bp,tail"
MS = 1_000_000


def _mindspore_dir(folder: Path, rank: int = 3) -> list[dict]:
    """Five steps of 100 ms; step 3 waits 30 ms for data with an empty device queue."""
    folder.mkdir(parents=True)
    rows, t = [], BASE_NS
    for step in range(1, 6):
        wait = 30 * MS if step == 3 else 5 * MS
        start, fp = t, t + wait
        bp = fp + 80 * MS
        end = t + 100 * MS + wait
        rows.append({"step": step, "start": start, "end": end, "fp": fp, "bp": bp})
        t = end
    lines = [STEP_HEADER] + [f"{r['step']},{r['start']},{r['end']},{r['end'] - r['start']},{r['fp']},{r['bp']},"
                             f"{r['fp'] - r['start']},{r['bp'] - r['fp']},{r['end'] - r['bp']}" for r in rows]
    lines.append("-,-,-,105000000,-,-,10000000,80000000,15000000")  # the averages row
    (folder / f"step_trace_raw_{rank}_detail_time.csv").write_text("\n".join(lines) + "\n")
    # operator statistics: execution_time in ms over the 5 steps
    (folder / f"aicore_intermediate_{rank}_type.csv").write_text(
        "op_type,execution_time,execution_frequency,percent\n"
        "MatMul,150.0,50,60.0\nConv2D,75.0,25,30.0\nAllReduce,25.0,5,10.0\n")
    queue = [f"0 0 {r['step']} 3 {r['start'] // MS}\n1 64 {r['step']} {0 if r['step'] == 3 else 5} "
             f"{r['start'] // MS}\n" for r in rows]
    (folder / f"device_queue_profiling_{rank}.txt").write_text("".join(queue))
    return rows


def test_mindspore_profiler_dir_gives_its_step_trace_ops_and_queue(kafka_bootstrap, topics, tmp_path):
    rows = _mindspore_dir(tmp_path / "profiler")
    result, steps = _ingest_and_process(kafka_bootstrap, topics, tmp_path, "ms-dir", 5, pace="realtime")
    assert result.profile.rank == 3 and {s["rank"] for s in steps} == {3}
    for r, rec in zip(rows, steps):
        assert rec["step"] == r["step"]
        assert rec["step_time_ns"] == r["end"] - r["start"]
        assert rec["data_wait_ns"] == r["fp"] - r["start"]  # iteration_interval
        assert rec["fp_bp_ns"] == r["bp"] - r["fp"]  # fp_and_bp
        assert rec["tail_ns"] == r["end"] - r["bp"]  # tail
        assert _types(rec) == {"MatMul": 30 * MS, "Conv2D": 15 * MS, "AllReduce": 5 * MS}  # totals / 5 steps
        assert rec["comm_ns"] == 5 * MS
        (queue,) = rec["queues"]
        assert queue["queue"] == "device_queue" and queue["at_start"] == (0 if r["step"] == 3 else 5)
    assert [s["starved"] for s in steps] == [False, False, True, False, False]


# -- msprof and MindSpore timelines ----------------------------------------------------

def _meta(pid, name):
    return {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}


def _x(name, pid, ts_us, dur_us, tid=0, cat=None, as_str=False):
    e = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": str(ts_us) if as_str else ts_us, "dur": dur_us}
    if cat:
        e["cat"] = cat
    return e


def _timeline(flavour: str) -> tuple[list[dict], list[tuple[int, int]]]:
    """Three steps of 10 ms; per step: 6 ms of compute, 2 ms all-reduce overlapping it by 1 ms,
    a 0.5 ms copy, a host API call, and one event of a category nobody knows."""
    base_us = BASE_NS // 1000
    msprof = flavour == "msprof"
    hw, comm, host, steps_pid = (1, 2, 3, 4)
    events = [_meta(hw, "Ascend Hardware" if msprof else "Ascend Op"), _meta(comm, "HCCL"),
              _meta(host, "CANN" if msprof else "Host CPU Op"), _meta(steps_pid, "Step Trace"),
              _meta(9, "Overlap Analysis" if msprof else "Merged Computation Op")]
    bounds = []
    for i in range(3):
        s = base_us + i * 10_000
        bounds.append((s, s + 10_000))
        step_name = f"Iteration {i + 1}" if msprof else f"Step {i + 1}"
        events += [
            _x(step_name, steps_pid, s, 10_000, as_str=msprof),
            _x("MatMul_1" if msprof else "Default/network/MatMul-op12", hw, s + 1000, 4000, as_str=msprof),
            _x("Add_2" if msprof else "Default/network/Add-op3", hw, s + 5000, 2000, as_str=msprof),
            _x("hcom_allReduce__123_0" if msprof else "Default/AllReduce-op7", comm, s + 6000, 2000, as_str=msprof),
            _x("MemcpyAsync", hw, s + 8500, 500, tid=1, as_str=msprof),
            _x("aclnnMatmul" if msprof else "HostOp", host, s + 500, 300, as_str=msprof),
            _x("mystery", 7, s + 9200, 100, cat="mystery_cat", as_str=msprof),
            _x("Computing", 9, s + 1000, 6000, as_str=msprof),  # derived: must not count
        ]
    return events, bounds


@pytest.mark.parametrize("flavour,gz", [("msprof", False), ("mindspore", True)])
def test_npu_timelines_give_kinds_from_tracks_and_names(kafka_bootstrap, topics, tmp_path, flavour, gz):
    events, bounds = _timeline(flavour)
    raw = json.dumps(events).encode()
    path = tmp_path / ("timeline.json.gz" if gz else "msprof_0.json")
    path.write_bytes(gzip.compress(raw) if gz else raw)
    result, steps = _ingest_and_process(kafka_bootstrap, topics, path, f"tl-{flavour}", 3)
    assert result.profile.source == ("msprof timeline" if flavour == "msprof" else "mindspore timeline")
    assert result.profile.unknown_categories == {"mystery_cat": 3}  # recorded as host, counted
    for (s, e), rec in zip(bounds, steps):
        assert rec["start_ns"] == s * 1000 and rec["step_time_ns"] == (e - s) * 1000
        assert rec["compute_ns"] == 6 * MS  # MatMul 1-5 ms + Add 5-7 ms
        assert rec["comm_ns"] == 2 * MS and rec["overlap_ns"] == 1 * MS and rec["pure_comm_ns"] == 1 * MS
        assert rec["data_wait_ns"] == 1 * MS and rec["fp_bp_ns"] == 6 * MS and rec["tail_ns"] == 3 * MS
        types = _types(rec)
        assert types["MemcpyAsync"] == 500_000 and types["mystery"] == 100_000  # the unknown one is kept
        assert "Computing" not in types
        assert ("MatMul_1" if flavour == "msprof" else "MatMul") in types


# -- bad input ---------------------------------------------------------------------------

def _cli(*args, bootstrap):
    return subprocess.run([sys.executable, "-m", "profstream.cli", "ingest", *args, "--run-id", "bad",
                           "--bootstrap", bootstrap], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400"})


def test_a_file_that_is_not_the_format_claimed_gets_one_line_naming_it(kafka_bootstrap, tmp_path):
    csv_file = tmp_path / "ops.csv"
    csv_file.write_text("op_type,execution_time\nMatMul,1.0\n")
    truncated = tmp_path / "cut.json"
    truncated.write_text(json.dumps({"traceEvents": [_x("a", 1, 0, 1)] * 50})[:300])
    cases = [((str(csv_file), "--format", "chrome"), "ops.csv", "Chrome trace JSON"),
             ((str(csv_file),), "ops.csv", "expected"),
             ((str(truncated),), "cut.json", "truncated"),
             ((str(tmp_path), "--format", "mindspore"), str(tmp_path), "step_trace_raw_<rank>_detail_time.csv")]
    for args, name, expected in cases:
        done = _cli(*args, bootstrap=kafka_bootstrap)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, done.stderr
        assert len(lines) == 1 and name in lines[0] and expected in lines[0], lines
    with pytest.raises(IngestError, match="step_num"):  # a step trace without its columns
        bad = tmp_path / "p"
        bad.mkdir()
        (bad / "step_trace_raw_0_detail_time.csv").write_text("a,b\n1,2\n")
        load_profile(bad)


def test_a_relative_trace_with_odd_fields_and_no_steps_is_one_step_ending_at_the_file_time(tmp_path):
    events = [{"ph": "X", "name": "conv", "cat": "kernel", "pid": 1.0, "tid": "stream 7", "ts": 100, "dur": 50,
               "args": ["not", "an", "object"]},  # odd types: parsed by the tolerant path
              {"ph": "X", "name": "ncclAllReduce", "cat": "kernel", "pid": 1.0, "tid": "stream 9", "ts": 120,
               "dur": 40}]
    path = tmp_path / "relative.json"
    path.write_text(json.dumps({"traceEvents": events}))
    mtime_ns = BASE_NS + 5_000_000_000
    os.utime(path, ns=(mtime_ns, mtime_ns))
    profile = load_profile(path)
    assert profile.steps == 1 and profile.notes  # the whole trace is step 0, and it says so
    base = mtime_ns - 160_000  # the last event ends (160 us) at the file's modification time
    assert profile.step_start_ns.tolist() == [base + 100_000]
    assert sorted(profile.op_start_ns.tolist()) == [base + 100_000, base + 120_000]
    assert sorted(profile.op_kind.tolist()) == [0, 1]  # compute, communication (by name)


def test_many_memory_samples_in_a_step_keep_its_peak_and_last_value():
    import numpy as np

    from profstream.integrations.ingest.model import Profile
    from profstream.integrations.ingest.replay import _MEMORY_PER_STEP, _memory_picks

    rng = np.random.default_rng(1)
    profile = Profile(source="test", path=Path("x"))
    profile.mem_allocated = rng.integers(0, 10**9, 5000)
    idx = np.arange(5000)
    picks = _memory_picks(profile, idx)
    assert len(picks) <= _MEMORY_PER_STEP and picks[-1] == 4999  # time order, the last one kept
    assert profile.mem_allocated[picks].max() == profile.mem_allocated.max()
