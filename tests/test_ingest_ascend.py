"""Real Ascend profiler output (trimmed copies in tests/data/ascend, see its README) read
as its producers define it: profstream's figures, computed from the tasks and ops with the
tools' own results removed from the input, equal those results.

- torch_npu (2 ranks): step_trace_time.csv's Computing, Communication, Overlapped,
  Communication(Not Overlapped), Free, Stage and Preparing;
- msprof timeline (MindSpore, 2 ranks x 2 iterations): each Iteration's time, FP_BP and
  Iteration Refresh, and its Overlap Analysis track's sums;
- MindSpore 1.x directory: the step trace's own iteration_interval, fp_and_bp, tail and
  total (in the 100 MHz counter's ticks), and the per-type op table.
"""

from __future__ import annotations

import csv
import gzip
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from profstream.cli import app
from profstream.integrations.ingest import IngestError, load_profile
from profstream.offline.analyze import analyze
from profstream.processors.figures import FigureOptions
from profstream.processors.stream import StreamOptions
from profstream.schema.batch import COMMUNICATION, COMPUTE, HOST, MEMCPY

DATA = Path(__file__).parent / "data" / "ascend"
OPTIONS = StreamOptions(figures=FigureOptions(top_k=500))
REFEREES = ("step_trace_time.csv", "op_statistic.csv", "aicore_intermediate_1_type.csv")


def _events(path: Path) -> list[dict]:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def _without_referees(src: Path, dst: Path) -> Path:
    """A copy of ``src`` without the tools' own results: their summary files, and the
    Overlap Analysis tracks of every trace."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*REFEREES, "trim.py"))
    for trace in list(dst.rglob("*.json.gz")):
        events = _events(trace)
        derived = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                   and e["args"]["name"] == "Overlap Analysis"}
        assert derived, trace  # every trace here has them: the check must run without them
        kept = [e for e in events if e.get("pid") not in derived]
        trace.write_bytes(gzip.compress(json.dumps(kept).encode()))
    return dst


def _close(mine_ns: int, tool_us: float, rel: float = 1e-4) -> bool:
    """Within ``rel`` (the tools' own figures carry float64 rounding of epoch µs, 0.25 µs)."""
    return abs(mine_ns / 1000 - tool_us) <= rel * abs(tool_us) + 0.001


# -- torch_npu --------------------------------------------------------------------------

def test_torch_npu_figures_equal_the_profiler_s_step_trace_time(tmp_path):
    result = analyze([_without_referees(DATA / "torch_npu", tmp_path / "run")], options=OPTIONS)
    assert [r.rank for r in result.ranks] == [0, 1] and not result.problems
    for rank in (0, 1):
        with (DATA / f"torch_npu/rank{rank}_ascend_pt/ASCEND_PROFILER_OUTPUT/step_trace_time.csv").open() as f:
            (tool,) = csv.DictReader(f)
        (s,) = [s for s in result.steps if s["rank"] == rank]
        assert s["step"] == int(tool["Step"]) == 50
        pairs = {"compute_ns": "Computing", "comm_ns": "Communication", "overlap_ns": "Overlapped",
                 "pure_comm_ns": "Communication(Not Overlapped)", "idle_ns": "Free", "step_time_ns": "Stage"}
        for mine, theirs in pairs.items():
            assert _close(s[mine], float(tool[theirs])), (rank, mine, s[mine], tool[theirs])
        # Preparing: from the host's step start to the first task, before the device's window
        assert _close(s["device_start_ns"] - s["start_ns"], float(tool["Preparing"]))
        assert s["device"] == "npu" and s["uncorrelated_ops"] == 0  # every task linked to its launch by flows


def test_torch_npu_tasks_are_classified_by_their_task_type():
    profile = load_profile(DATA / "torch_npu/rank0_ascend_pt")
    assert profile.source == "torch_npu trace" and profile.rank == 0 and profile.steps == 1
    device = profile.op_on_device
    kinds = {k: int((profile.op_kind[device] == k).sum()) for k in (COMPUTE, COMMUNICATION, MEMCPY)}
    # AI_CORE, MIX_AIV and DSA tasks; the HCCL track's four all-reduces; MEMCPY_ASYNC copies
    assert kinds == {COMPUTE: 187, COMMUNICATION: 4, MEMCPY: 24} and int(device.sum()) == 215
    assert (profile.op_kind[~device] == HOST).all()  # ProfilerStep's cpu_op events are the host's
    names = set(profile.name_table[profile.op_name[profile.op_kind == COMMUNICATION]].tolist())
    assert all(n.startswith("hcom_allReduce") for n in names)  # not "...BroadcastTo..." kernels
    assert {"Notify Wait", "Write Value", "SDMA", "EVENT_WAIT"}.isdisjoint(profile.name_table[profile.op_name])
    assert any("HCCL tasks not sent as ops" in n for n in profile.notes)
    assert any("wait/notify tasks" in n for n in profile.notes)


def test_torch_npu_folders_as_handed_over_read_the_same_ranks(tmp_path):
    run = _without_referees(DATA / "torch_npu", tmp_path / "run")
    rank0 = run / "rank0_ascend_pt"
    whole = analyze([run], options=OPTIONS).steps
    for given in (rank0, rank0 / "ASCEND_PROFILER_OUTPUT", rank0 / "ASCEND_PROFILER_OUTPUT/trace_view.json.gz"):
        steps = analyze([given], options=OPTIONS).steps
        assert [(s["rank"], s["step_time_ns"], s["compute_ns"]) for s in steps] == \
            [(s["rank"], s["step_time_ns"], s["compute_ns"]) for s in whole if s["rank"] == 0], given
    # the tools' own tracks in the input change nothing: they are never read
    with_tracks = analyze([DATA / "torch_npu"], options=OPTIONS).steps
    assert [{k: v for k, v in s.items() if k != "closed_ns"} for s in with_tracks] == \
        [{k: v for k, v in s.items() if k != "closed_ns"} for s in whole]


BASE_US = 1_790_000_000_000_000  # µs since the epoch


def _torch_npu_folder(folder: Path, steps: list[tuple[int, int]], tasks: list[tuple], collectives=()) -> Path:
    """A hand-made torch_npu folder: host ProfilerStep#N at (start, dur) µs from BASE_US;
    AI_CORE tasks (name, Type, start, dur), each launched 50 µs earlier by a flow; HCCL
    collectives (name, start, dur); kernel_details.csv typing the tasks."""
    hw, hccl, host = 1, 2, 3
    events = [{"ph": "M", "name": "process_name", "pid": p, "tid": 0, "args": {"name": n}}
              for p, n in ((hw, "Ascend Hardware"), (hccl, "HCCL"), (host, "Python"))]
    events.append({"ph": "M", "name": "thread_name", "pid": hccl, "tid": 0, "args": {"name": "Group 0 Communication"}})
    for n, (at, dur) in enumerate(steps, 1):
        events.append({"ph": "X", "name": f"ProfilerStep#{n}", "cat": "cpu_op", "pid": host, "tid": 0,
                       "ts": f"{BASE_US + at}.000", "dur": dur})
    rows = ["Step Id,Name,Type,Accelerator Core,Start Time(us),Duration(us),Wait Time(us),Block Dim"]
    for i, (name, kind, at, dur) in enumerate(tasks):
        events.append({"ph": "X", "name": name, "pid": hw, "tid": 2, "ts": f"{BASE_US + at}.000", "dur": dur,
                       "args": {"Task Type": "AI_CORE", "connection_id": i}})
        events += [{"ph": "s", "cat": "async_npu", "id": i, "pid": host, "tid": 0, "ts": f"{BASE_US + at - 50}.000",
                    "name": "torch_to_npu"},
                   {"ph": "f", "cat": "async_npu", "id": i, "pid": hw, "tid": 2, "ts": f"{BASE_US + at}.000",
                    "name": "torch_to_npu", "bp": "e"}]
        rows.append(f"1,{name},{kind},AI_CORE,{BASE_US + at}.000\t,{dur},0,8")
    for name, at, dur in collectives:
        events.append({"ph": "X", "name": name, "pid": hccl, "tid": 0, "ts": f"{BASE_US + at}.000", "dur": dur})
    out = folder / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    (out / "trace_view.json").write_text(json.dumps(events))
    (out / "kernel_details.csv").write_text("\n".join(rows) + "\n")
    (folder / "profiler_info_0.json").write_text(json.dumps({"rank_id": 0}))
    return folder


def test_kernel_details_types_give_the_op_statistic_table(tmp_path):
    """At profiler level 1+ kernel_details.csv types each kernel; op_statistic.csv is that
    table grouped by Type with HCCL left out."""
    tasks = [("Conv2D1", "Conv2D", 100, 400.125), ("Conv2D2", "Conv2D", 600, 300.5),
             ("aclnnMm_MatMulCommon_MatMulV2", "MatMulV2", 1000, 800.25), ("Conv2D1", "Conv2D", 2000, 399.875)]
    folder = _torch_npu_folder(tmp_path / "r_ascend_pt", [(0, 10_000)], tasks, [("hcom_allReduce__1_0_1", 2500, 3000.0)])
    op_statistic = {"Conv2D": (3, 400.125 + 300.5 + 399.875), "MatMulV2": (1, 800.25)}  # by its definition
    (s,) = analyze([folder], options=OPTIONS).steps
    kernels_by_type = {t["op_type"]: (t["count"], t["total_ns"] / 1000) for t in s["kernel_types"]}
    assert {t: v for t, v in kernels_by_type.items() if t != "hcom_allReduce"} == op_statistic
    assert kernels_by_type["hcom_allReduce"] == (1, 3000.0)  # the collective, which op_statistic leaves out


def test_a_later_torch_npu_step_is_its_stage_plus_the_gap_before_its_first_task(tmp_path):
    """docs/figures.md: device windows tile the device's time, torch_npu's Stage does not."""
    tasks = [("Conv2D1", "Conv2D", 100, 400), ("Conv2D2", "Conv2D", 1200, 400)]  # step 1: 100-500; 2: 1200-1600
    folder = _torch_npu_folder(tmp_path / "r_ascend_pt", [(0, 1000), (1000, 1000)], tasks,
                               [("hcom_allReduce__1_0_1", 1300, 500)])  # 1300-1800, under Conv2D2 for 300
    one, two = analyze([folder], options=OPTIONS).steps
    assert (one["step_time_ns"], one["data_wait_ns"], one["idle_ns"]) == (400_000, 0, 0)  # Stage 400, Free 0
    stage, free, gap = 1800 - 1200, 0, 1200 - 500
    assert two["step_time_ns"] == (stage + gap) * 1000 and two["data_wait_ns"] == gap * 1000
    assert two["idle_ns"] == (free + gap) * 1000
    assert (two["compute_ns"], two["comm_ns"], two["overlap_ns"], two["pure_comm_ns"]) == (
        400_000, 500_000, 300_000, 200_000)
    assert two["device_start_ns"] - two["start_ns"] == -500_000  # the window opens before the host step


# -- msprof -----------------------------------------------------------------------------

def _msprof_truth() -> dict[tuple[int, int], dict]:
    """Per (rank, iteration): what msprof computed (the Iteration event's marks, its
    Overlap Analysis sums and the track's first and last instant), in µs on its clock."""
    truth = {}
    for trace in sorted((DATA / "msprof").rglob("msprof_*.json.gz")):
        rank, it = int(trace.name.split("_")[1]), int(trace.name.split("_")[3].split(".")[0])
        events = _events(trace)
        names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
        overlap = [e for e in events if e.get("ph") == "X" and names.get(e["pid"]) == "Overlap Analysis"]
        (iteration,) = [e for e in events if e.get("name") == f"Iteration {it}"]
        sums = {n: sum(e["dur"] for e in overlap if e["name"] == n)
                for n in ("Computing", "Communication", "Communication(Not Overlapped)", "Free")}
        truth[(rank, it)] = {**sums, "iteration": iteration, "first": min(e["ts"] for e in overlap),
                             "last": max(e["ts"] + e["dur"] for e in overlap)}
    return truth


def test_msprof_figures_equal_its_step_trace_and_overlap_analysis(tmp_path):
    result = analyze([_without_referees(DATA / "msprof", tmp_path / "run")], options=OPTIONS)
    truth = _msprof_truth()
    assert sorted((s["rank"], s["step"]) for s in result.steps) == sorted(truth) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for s in result.steps:
        t = truth[(s["rank"], s["step"])]
        it, args = t["iteration"], t["iteration"]["args"]
        assert _close(s["step_time_ns"], it["dur"], 1e-6)  # Iteration
        assert _close(s["fp_bp_ns"], args["BP End"] - args["FP Start"], 1e-6)  # FP_BP Time
        assert _close(s["tail_ns"], it["ts"] + it["dur"] - args["BP End"], 1e-6)  # Iteration Refresh
        assert _close(s["data_wait_ns"], args["FP Start"] - it["ts"], 1e-6)
        assert _close(s["compute_ns"], t["Computing"], 1e-6) and _close(s["comm_ns"], t["Communication"], 1e-6)
        assert _close(s["pure_comm_ns"], t["Communication(Not Overlapped)"], 1e-6)
        assert _close(s["overlap_ns"], t["Communication"] - t["Communication(Not Overlapped)"], 1e-6)
        # msprof's Free spans its first task to its last; the step also holds the time
        # before the first (after the iteration's start) and after the last (docs/figures.md)
        lead, trail = t["first"] - it["ts"], it["ts"] + it["dur"] - t["last"]
        assert _close(s["idle_ns"], t["Free"] + lead + trail, 1e-6)
        assert s["device"] == f"npu:{s['rank']}" and s["device_start_ns"] is None  # its own step marks


def test_msprof_clock_rank_and_layout_come_from_its_own_files(tmp_path):
    device = next((DATA / "msprof").glob("PROF_*/device_0"))
    start = json.loads((device / "start_info.0").read_text())
    profile = load_profile(device)
    assert profile.rank == 0 and profile.device == "npu:0" and "start_info.0" in profile.clock
    first = _events(device / "timeline/msprof_0_2_1.json.gz")
    (iteration,) = [e for e in first if e.get("name") == "Iteration 1"]
    offset_ns = int(start["collectionTimeBegin"]) * 1000 - int(start["clockMonotonicRaw"])
    assert int(profile.step_start_ns[0]) == round(iteration["ts"] * 1000) + offset_ns  # ns since the epoch
    # its timeline folder, or its per-iteration files given one by one, are that one rank
    for given in ([device / "timeline"], sorted((device / "timeline").iterdir())):
        result = analyze(given, options=OPTIONS)
        assert [r.rank for r in result.ranks] == [0] and [s["step"] for s in result.steps] == [1, 2]


# -- MindSpore 1.x ----------------------------------------------------------------------

def test_mindspore_1x_directory_in_counter_ticks_gives_its_own_step_trace_and_op_table(tmp_path):
    folder = _without_referees(DATA / "ms1x", tmp_path / "ms1x") / "profiler"
    result = analyze([folder], options=OPTIONS)
    assert any("10 ns" in n and "min_cycle_counter_1.txt" in n for n in result.ranks[0].profile.notes)
    with (DATA / "ms1x/profiler/step_trace_raw_1_detail_time.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["step_num"].isdigit()]
    assert [s["step"] for s in result.steps] == [int(r["step_num"]) for r in rows]  # not the averages row
    for r, s in zip(rows, result.steps):  # the step trace's own differences, in 10 ns ticks
        assert s["step_time_ns"] == 10 * int(r["total"])
        assert s["data_wait_ns"] == 10 * int(r["iteration_interval"])
        assert s["fp_bp_ns"] == 10 * int(r["fp_and_bp"]) and s["tail_ns"] == 10 * int(r["tail"])
    # op types: the per-kernel file (average x calls) against MindInsight's per-type table
    with (DATA / "ms1x/profiler/aicore_intermediate_1_type.csv").open() as f:
        table = {r["kernel_type"]: (int(r["execution_frequency"]), float(r["total_time"])) for r in csv.DictReader(f)}
    mine: dict[str, list[int]] = {}
    for s in result.steps:
        for t in s["op_types"]:
            mine.setdefault(t["op_type"], [0, 0])
            mine[t["op_type"]][0] += t["count"]
            mine[t["op_type"]][1] += t["total_ns"]
    assert {t: c for t, (c, _) in mine.items()} == {t: c for t, (c, _) in table.items()}
    for t, (_, total_ms) in table.items():  # the table's ms have 5 decimals: to the 10 ns
        assert abs(mine[t][1] - total_ms * 1e6) <= 5, t
    assert mine["MatMul"] == [25, 2_807_820]  # MindInsight's own test: 2,807.82 us over 25 calls


def test_an_older_step_trace_s_zero_summary_row_is_not_a_step(tmp_path):
    folder = tmp_path / "profiler"
    folder.mkdir()
    shutil.copy(DATA / "ms1x/run2_step_trace_raw_1_detail_time.csv", folder / "step_trace_raw_1_detail_time.csv")
    profile = load_profile(folder, step_trace_unit_ns=10)
    assert profile.step.tolist() == [1]


# -- bad input ----------------------------------------------------------------------------

def test_a_rank_missing_its_trace_is_one_line_naming_it_and_the_others_are_read(tmp_path):
    run = _without_referees(DATA / "torch_npu", tmp_path / "run")
    (run / "rank1_ascend_pt/ASCEND_PROFILER_OUTPUT/trace_view.json.gz").unlink()
    result = CliRunner().invoke(app, ["analyze", str(run)])
    assert result.exit_code == 0, result.output
    (line,) = [ln for ln in result.output.splitlines() if "not read:" in ln]
    assert "rank1_ascend_pt" in line and "trace_view.json" in line
    assert "1 rank(s), 1 steps" in result.output


def test_a_truncated_iteration_file_is_named_and_the_rank_s_other_files_are_read(tmp_path):
    run = _without_referees(DATA / "msprof", tmp_path / "run")
    cut = next(run.rglob("msprof_1_0_2.json.gz"))
    cut.write_bytes(gzip.compress(gzip.decompress(cut.read_bytes())[:5000]))
    result = analyze([run], options=OPTIONS)
    assert sorted((s["rank"], s["step"]) for s in result.steps) == [(0, 1), (0, 2), (1, 1)]
    notes = [n for r in result.ranks for n in r.profile.notes if "msprof_1_0_2.json.gz" in n]
    assert len(notes) == 1 and "truncated" in notes[0]


def test_ranks_of_different_profilers_are_read_and_said_to_differ(tmp_path):
    run = tmp_path / "mixed"
    shutil.copytree(DATA / "torch_npu/rank0_ascend_pt", run / "rank0_ascend_pt")
    shutil.copytree(next((DATA / "msprof").glob("PROF_*567*")), run / "PROF_rank1")
    result = analyze([run], options=OPTIONS)
    assert [r.rank for r in result.ranks] == [0, 1]
    assert any("different profilers" in p for p in result.problems)


def test_a_folder_with_no_rank_readable_is_one_error_line(tmp_path):
    run = _without_referees(DATA / "torch_npu", tmp_path / "run")
    for trace in run.rglob("trace_view.json.gz"):
        trace.write_bytes(b"{\"traceEvents\": [")
    result = CliRunner().invoke(app, ["analyze", str(run)])
    assert result.exit_code == 2 and "error:" in result.output and "Traceback" not in result.output
    with pytest.raises(IngestError, match="2 ranks here"):
        load_profile(run)


# -- the live path ----------------------------------------------------------------------------

def test_ingest_through_kafka_gives_analyze_s_figures_for_each_format(kafka_bootstrap, topics, tmp_path):
    from profstream.integrations.ingest import ingest
    from tests.helpers import step_records
    from tests.test_processor import RunningProcessor

    inputs = {"tnpu": (DATA / "torch_npu/rank1_ascend_pt", 1), "msprof": (next((DATA / "msprof").rglob("device_0")), 2),
              "ms1x": (DATA / "ms1x/profiler", 12)}
    options = FigureOptions(top_k=500)
    with RunningProcessor(kafka_bootstrap, topics, figure_options=options):
        for run_id, (path, count) in inputs.items():
            offline = analyze([path], run_id, StreamOptions(figures=options)).steps
            sent = ingest(path, {"bootstrap": kafka_bootstrap, "run_id": run_id, "topic_prefix": topics.prefix})
            assert sent.sent.flushed and sent.sent.dropped_ops == 0
            live = sorted(step_records(kafka_bootstrap, topics.steps, run_id, count), key=lambda s: s["step"])
            same = ("step", "rank", "device", "step_time_ns", "data_wait_ns", "fp_bp_ns", "tail_ns", "compute_ns",
                    "comm_ns", "overlap_ns", "pure_comm_ns", "idle_ns", "op_types", "kernel_types", "device_start_ns")
            assert [{k: s[k] for k in same} for s in live] == [{k: s[k] for k in same} for s in offline], run_id


def test_mindspore_2x_cpu_op_table_totals_are_in_the_unit_its_header_names(tmp_path):
    """cpu_op_type_info as the mindspore 2.10 CPU wheel writes it: total_compute_time in ms,
    as avg_time(ms) beside it says."""
    folder = tmp_path / "profiler"
    folder.mkdir()
    base = 1_790_000_000_000_000_000
    (folder / "step_trace_raw_0_detail_time.csv").write_text(
        "step_num,start_point,end_point,total,fp_point,bp_point,iteration_interval,fp_and_bp,tail\n" +
        "".join(f"{s},{base + s * 10**7},{base + (s + 1) * 10**7},10000000,{base + s * 10**7},{base + (s + 1) * 10**7},"
                f"0,10000000,0\n" for s in (1, 2, 3)))
    (folder / "cpu_op_type_info_0.csv").write_text(
        "op_type,type_occurrences,execution_frequency(per-step),total_compute_time,avg_time(ms),percent\n"
        "MatMul,6,2,0.3,0.05,60.0\nReLU,3,1,0.06,0.02,12.0\n")
    (s1, s2, s3) = analyze([folder], options=OPTIONS).steps
    per_step = [{t["op_type"]: (t["count"], t["total_ns"]) for t in s["op_types"]} for s in (s1, s2, s3)]
    assert per_step == [{"MatMul": (2, 100_000), "ReLU": (1, 20_000)}] * 3  # 0.3 ms over 6 calls, 3 steps
