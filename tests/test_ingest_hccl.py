"""HCCL communication ops of MindSpore profiler directories (``communication_<rank>.json``)
matched across ranks by ``profstream analyze``, as Kineto's NCCL calls are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from profstream.cli import app
from profstream.integrations.ingest import ingest, load_profile
from profstream.integrations.ingest.hccl import collective_name
from profstream.offline.analyze import analyze
from profstream.processors.collectives import unpack_calls
from tests.helpers import step_records
from tests.test_processor import RunningProcessor

BASE_NS = 1_790_000_000_000_000_000  # ns since the epoch
STEP_NS = 100_000_000
STEPS = 4
GROUP = "12690838471558012345"
LATE_US = 300.0
STEP_HEADER = "step_num,start_point,end_point,total,fp_point,bp_point,iteration_interval,fp_and_bp,tail"
# per step: (op, start within the step in us, elapse on the rank that is on time in ms, transit MB per link)
OPS = (("hcom_allReduce__184_{n}_1", 60_000.5, 2.0, {"HCCS": 3.0, "RDMA": 1.0, "PCIE": 0}),
       ("hcom_allGather__184_{n}_1", 70_000.0, 1.5, {"HCCS": 2.0, "SDMA": 0}))


def _profiler_dir(root: Path, rank: int, late_us: float = 0.0) -> Path:
    """A MindSpore profiler directory of ``rank``: 4 steps of 100 ms and, per step, an
    all-reduce and an all-gather on one group; this rank's ops start ``late_us`` later and
    end where they would have."""
    folder = root / f"rank{rank}" / "profiler"
    folder.mkdir(parents=True)
    lines = [STEP_HEADER]
    steps: dict = {}
    for i in range(STEPS):
        start = BASE_NS + i * STEP_NS
        end, fp, bp = start + STEP_NS, start + 5_000_000, start + 90_000_000
        lines.append(f"{i + 1},{start},{end},{STEP_NS},{fp},{bp},{fp - start},{bp - fp},{end - bp}")
        collective = {}
        for op, at_us, elapse_ms, sizes in OPS:
            name = f"{op.format(n=i)}@{GROUP}"
            collective[name] = {
                "Communication Time Info": {
                    "Start Timestamp(us)": start / 1000 + at_us + late_us,
                    "Elapse Time(ms)": elapse_ms - late_us / 1000, "Transit Time(ms)": 0.5,
                    "Wait Time(ms)": 0.0, "Synchronization Time(ms)": 0.0, "Idle Time(ms)": 0.1},
                "Communication Bandwidth Info": {
                    link: {"Transit Size(MB)": mb, "Transit Time(ms)": 0.5, "Bandwidth(GB/s)": 0,
                           "Large Packet Ratio": 0, "Size Distribution": {}} for link, mb in sizes.items()}}
        collective["Total Op Info"] = {"Communication Time Info": {"Start Timestamp(us)": 0, "Elapse Time(ms)": 3.5}}
        steps[f"step{i + 1}"] = {"collective": collective, "p2p": {}}
    lines.append("-,-,-,100000000,-,-,5000000,85000000,10000000")
    (folder / f"step_trace_raw_{rank}_detail_time.csv").write_text("\n".join(lines) + "\n")
    (folder / f"communication_{rank}.json").write_text(json.dumps(steps))
    return folder


def test_hccl_ops_of_two_ranks_are_matched_and_the_late_rank_named(tmp_path):
    dirs = [_profiler_dir(tmp_path, r, late_us=LATE_US * r) for r in (0, 1)]
    result = analyze(dirs, run_id="hccl")
    rows = [r.profile.collectives for r in result.ranks]
    # names, group, seq in the group's order, group size from the ranks given, bytes = transit sizes summed
    assert [(c[0], c[1], c[3], c[8]) for c in rows[0]] == [
        ("all_reduce" if s % 2 == 0 else "all_gather", GROUP, s, 2) for s in range(2 * STEPS)]
    assert [c[6] for c in rows[0]] == [4 << 20, 2 << 20] * STEPS
    assert [(c[4], c[5]) for c in rows[1]] == [(a + 300_000, d - 300_000) for _, _, _, _, a, d, *_ in rows[0]]
    assert [r.profile.collective_step.tolist() for r in result.ranks] == [[1, 1, 2, 2, 3, 3, 4, 4]] * 2

    assert [run["step"] for run in result.run_steps] == [1, 2, 3, 4]
    for run in result.run_steps:
        assert run["collectives_matched"] == 2 and run["unmatched_collectives"] == []
        assert run["late_rank"] == 1 and run["late_rank_held_ns"] == 2 * 300_000
        ranks = {c["rank"]: c for c in run["collective_ranks"]}
        assert (ranks[0]["wait_ns"], ranks[1]["wait_ns"]) == (2 * 300_000, 0)  # 300 us in each of 2 calls
        # transfer: from rank 1's start to the common end, (2 - 0.3) ms and (1.5 - 0.3) ms
        assert ranks[0]["transfer_ns"] == ranks[1]["transfer_ns"] == 1_700_000 + 1_200_000
        by = {c["collective"]: c for c in run["by_collective"]}
        assert by["all_reduce"]["bytes"] == 2 * (4 << 20) and by["all_gather"]["bytes"] == 2 * (2 << 20)
        assert by["all_reduce"]["algbw_bytes_per_s"] == pytest.approx((4 << 20) / 1.7e-3)
        assert by["all_gather"]["algbw_bytes_per_s"] == pytest.approx((2 << 20) / 1.2e-3)
        assert by["all_reduce"]["busbw_bytes_per_s"] == pytest.approx(by["all_reduce"]["algbw_bytes_per_s"])  # 2(n-1)/n, n=2


def test_analyze_command_reads_the_hccl_ops_of_each_rank_directory(tmp_path):
    dirs = [_profiler_dir(tmp_path, r, late_us=LATE_US * r) for r in (0, 1)]
    result = CliRunner().invoke(app, ["analyze", *map(str, dirs), "--run-id", "hccl-cli"])
    assert result.exit_code == 0, result.output
    out = result.output.replace("\n", " ")
    assert all(f"8 HCCL ops from communication_{r}.json (1 groups)" in out for r in (0, 1))


def test_ingest_sends_the_hccl_calls_of_a_rank_to_the_live_processor(kafka_bootstrap, topics, tmp_path):
    folder = _profiler_dir(tmp_path, 1, late_us=LATE_US)
    offline = analyze([folder], "hccl-live")
    with RunningProcessor(kafka_bootstrap, topics):
        sent = ingest(folder, {"bootstrap": kafka_bootstrap, "run_id": "hccl-live", "topic_prefix": topics.prefix})
        live = sorted(step_records(kafka_bootstrap, topics.steps, "hccl-live", STEPS), key=lambda s: s["step"])
    assert sent.sent.flushed and [s["step"] for s in live] == [1, 2, 3, 4]
    for got, want in zip(live, offline.steps):
        calls, expected = unpack_calls(got["collectives"]), unpack_calls(want["collectives"])
        assert [calls.names[i] for i in calls.cols["name_idx"]] == ["all_reduce", "all_gather"]
        for col in ("seq", "bytes", "start_ns", "end_ns"):
            assert calls.cols[col].tolist() == expected.cols[col].tolist()
        # no group size in the file: ingest sends 0, analyze the ranks it was given (here 1)
        assert calls.cols["group_size"].tolist() == [0, 0] and expected.cols["group_size"].tolist() == [1, 1]


@pytest.mark.parametrize("text", ['{"step1": {"collective": ', "[1, 2]"])
def test_a_malformed_communication_file_is_one_note_naming_it_and_the_steps_stand(tmp_path, text):
    folder = _profiler_dir(tmp_path, 0)
    bad = folder / "communication_0.json"
    bad.write_text(text)
    profile = load_profile(folder.parent, "mindspore", 0)
    assert profile.steps == STEPS and profile.collectives == []
    (note,) = [n for n in profile.notes if str(bad) in n]
    assert "\n" not in note and "expected a communication analysis JSON" in note


def test_entries_without_times_are_skipped_and_counted(tmp_path):
    folder = _profiler_dir(tmp_path, 0)
    doc = json.loads((folder / "communication_0.json").read_text())
    del doc["step2"]["collective"][f"hcom_allGather__184_1_1@{GROUP}"]["Communication Time Info"]["Start Timestamp(us)"]
    doc["step3"]["p2p"] = ["not", "ops"]
    (folder / "communication_0.json").write_text(json.dumps(doc))
    profile = load_profile(folder, "mindspore", 0)
    assert [c[3] for c in profile.collectives] == list(range(2 * STEPS - 1))
    assert any("2 entries skipped (not an op with a numeric start and elapse time)" in n for n in profile.notes)


@pytest.mark.parametrize("op,name", [("hcom_allReduce__184_1_1", "all_reduce"), ("hcom_allGather__3_0_1", "all_gather"),
                                     ("hcom_reduceScatter__9_2_1", "reduce_scatter"), ("hcom_broadcast__1_0_1", "broadcast"),
                                     ("hcom_alltoallv__5_1_1", "all_to_all"), ("hcom_send__7_0_1", "send"),
                                     ("hcom_receive__7_0_1", "recv")])
def test_hccl_op_names_become_collective_names(op, name):
    assert collective_name(op) == name
