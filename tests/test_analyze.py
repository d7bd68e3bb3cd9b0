"""``profstream analyze``: existing profiles to figures in one process, no broker; the same
figures as ingesting the profile to Kafka and running the live processor on it."""

from __future__ import annotations

import pandas as pd
import pytest
from typer.testing import CliRunner

from profstream.cli import app
from profstream.integrations.ingest import ingest
from profstream.offline.analyze import analyze
from profstream.processors.figures import FigureOptions
from profstream.processors.stream import StreamOptions
from tests.helpers import step_records
from tests.kineto_traces import PER_STEP, lagging_device_trace
from tests.test_processor import RunningProcessor


def test_analyze_a_directory_of_ranks_prints_them_and_writes_report_and_parquet(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    lagging_device_trace(steps=5, rank=0).write(traces / "rank0.json")
    lagging_device_trace(steps=5, rank=1, lag=0.3, seed=4).write(traces / "rank1.json.gz")
    report, parquet = tmp_path / "out" / "report.html", tmp_path / "pq"
    result = CliRunner().invoke(app, ["analyze", str(traces), "-o", str(report), "--parquet", str(parquet),
                                      "--run-id", "gpu-run"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any("gpu-run: 2 rank(s), 10 steps" in line for line in lines)
    rows = [line.split("│") for line in lines if line.startswith("│")]
    assert [r[1].strip() for r in rows] == ["0", "1"]
    assert [r[3].strip() for r in rows] == ["5", "5"]  # every step measured on the device's window
    assert rows[0][10].strip() == f"{100 * 770 / 1300:.1f}"  # compute share of the device's op time

    page = report.read_text()
    assert "Device: kernel breakdown" in page and 'data-metric="compute_share"' in page
    steps = pd.read_parquet(parquet / "gpu-run.steps.parquet")
    assert len(steps) == 10 and set(steps["rank"]) == {0, 1}
    assert (steps["host_step_time_ns"] == 1_000_000).all() and steps["device_end_ns"].notna().all()
    assert (steps.loc[steps["rank"] == 0, "compute_ns"] == PER_STEP["compute"] * 1000).all()
    ops = pd.read_parquet(parquet / "gpu-run.ops.parquet")
    kernels = ops[ops["kind"] != "host"]
    assert len(kernels) == 2 * 5 * 6 and (kernels["launch_ns"] > 0).all()
    assert (ops.loc[ops["kind"] == "host", "launch_ns"] == -1).all()
    # a kernel's launch lies in the host step it is counted in, its run in the next one
    assert (kernels["launch_ns"] < kernels["start_ns"]).all()


def test_analyze_gives_the_figures_of_ingest_through_kafka_and_the_live_processor(kafka_bootstrap, topics,
                                                                                   tmp_path):
    path = _with_collectives(lagging_device_trace(steps=6, rank=2, seed=9, uncorrelated=(4,))).write(
        tmp_path / "trace.json")  # with a collective call per step: Monitor.collective against the raw batches
    options = FigureOptions(top_k=5)
    offline = analyze([path], "same-run", StreamOptions(figures=options))
    with RunningProcessor(kafka_bootstrap, topics, figure_options=options):
        sent = ingest(path, {"bootstrap": kafka_bootstrap, "run_id": "same-run", "topic_prefix": topics.prefix})
        live = step_records(kafka_bootstrap, topics.steps, "same-run", 6)
    assert sent.sent.flushed and sent.sent.dropped_ops == 0
    assert len(offline.steps) == 6

    def comparable(s: dict) -> dict:  # but wall clock, producer defaults (host, device) and world size
        return {k: v for k, v in s.items() if k not in ("closed_ns", "world_size", "host", "device")}

    assert [comparable(s) for s in sorted(live, key=lambda s: s["step"])] == [comparable(s) for s in offline.steps]
    assert sum(s["uncorrelated_ops"] for s in live) == 1
    assert [s["collectives"]["count"] for s in live] == [1] * 6


@pytest.mark.parametrize("case", ["not a trace", "same rank twice", "empty directory"])
def test_bad_input_is_one_line_that_names_the_file(tmp_path, case):
    if case == "not a trace":
        bad = tmp_path / "notes.json"
        bad.write_text("hello")
        args, expected = [str(bad)], str(bad)
    elif case == "same rank twice":
        a = lagging_device_trace(steps=2, rank=0).write(tmp_path / "a.json")
        b = lagging_device_trace(steps=2, rank=0).write(tmp_path / "b.json")
        args, expected = [str(a), str(b)], "both rank 0"
    else:
        (tmp_path / "empty").mkdir()
        args, expected = [str(tmp_path / "empty")], "no trace files"
    result = CliRunner().invoke(app, ["analyze", *args])
    assert result.exit_code == 2
    assert "error:" in result.output and expected in result.output.replace("\n", "")
    assert "Traceback" not in result.output


def _with_collectives(trace, late_us: float = 0.0):
    """The trace's NCCL kernels and a host record_param_comms per step as torch.distributed
    records them (all_reduce of 1 Mi floats on the default group, Seq = the step); the
    kernels of this rank start ``late_us`` later (and end where they did)."""
    for e in list(trace.events):
        if e["ph"] == "X" and e["name"].startswith("ncclKernel"):
            seq = len([x for x in trace.events if x.get("name") == "record_param_comms"])
            comms = {"Collective name": "allreduce", "Seq": seq, "Process Group Name": "0", "Group size": 2,
                     "In msg nelems": 1 << 20, "Out msg nelems": 1 << 20, "dtype": "Float"}
            e["args"].update(comms)
            e["ts"], e["dur"] = round(e["ts"] + late_us, 3), round(e["dur"] - late_us, 3)
            trace.host("record_param_comms", "cpu_op", e["ts"] - 400.0, 2.0, **comms)  # the host's: not the timing
    return trace


def test_analyze_matches_the_nccl_calls_of_kineto_traces_across_ranks(tmp_path):
    # rank 1's all-reduce kernels start 300 us after rank 0's: rank 0 waits 300 us a step
    paths = [_with_collectives(lagging_device_trace(steps=4, rank=r), late_us=300.0 * r).write(tmp_path / f"r{r}.json")
             for r in (0, 1)]
    result = analyze(paths, run_id="nccl")
    assert [r.profile.collectives[0][:4] for r in result.ranks] == [("allreduce", "0", "Float", 0)] * 2
    assert len(result.run_steps) == 4
    for run in result.run_steps:
        assert run["collectives_matched"] == 1 and run["unmatched_collectives"] == []
        assert run["late_rank"] == 1 and run["late_rank_held_ns"] == 300_000
        ranks = {c["rank"]: c for c in run["collective_ranks"]}
        assert (ranks[0]["wait_ns"], ranks[1]["wait_ns"]) == (300_000, 0)
        assert ranks[0]["transfer_ns"] == ranks[1]["transfer_ns"] == 180_000  # [800, 980) us of the step's device time
        (ar,) = run["by_collective"]
        assert ar["bytes"] == 2 * 4 << 20 and ar["algbw_bytes_per_s"] == pytest.approx(ar["bytes"] / 360e-6)
    steps = {(s["rank"], s["step"]): s for s in result.steps}
    assert all(steps[(0, run["step"])]["collectives"]["count"] == 1 for run in result.run_steps)


def test_the_reports_device_step_time_is_the_devices_period_when_steps_interleave(tmp_path):
    """A device 0.8 of a step behind, each step launching a copy and a kernel early, while
    the previous step still runs (tests/kineto_traces.py, ``early``): the report's mean
    device step is the device's span over its steps (1 ms a step, plus the first step's
    early copy, 300 us before its first kernel), not the 1.28 ms each step's work spans."""
    import re

    from profstream.offline.analyze import analyze_to

    path = lagging_device_trace(steps=6, lag=0.8, early=True).write(tmp_path / "rank0.json")
    analyze_to([path], report=tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    cell = dict(re.findall(r'data-metric="(host_step_ms|device_step_ms|device_steps)" data-value="([^"]+)"', page))
    assert float(cell["host_step_ms"]) == pytest.approx(1.0)
    assert int(cell["device_steps"]) == 6
    assert float(cell["device_step_ms"]) == pytest.approx((5 * 1000 + 1280) / 6 / 1000)
