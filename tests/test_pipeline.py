"""The walking skeleton through the real broker: simulator -> Monitor -> Kafka -> processor."""

from __future__ import annotations

import os
import shutil
import threading
from collections import defaultdict

import pytest
import yaml

from profstream.demo import run_demo
from profstream.processors.runtime import Processor
from profstream.simulate import SimConfig, expected, run_simulation
from tests.helpers import raw_batches, render_in_chromium, step_records, topic_size


def _top_k(costs: dict[str, tuple[int, int]], k: int) -> dict[str, tuple[int, int]]:
    """The simulator's per-type costs folded as the processor reports them: top k by time, rest as other."""
    ranked = sorted(costs.items(), key=lambda kv: (-kv[1][0], kv[0]))
    top = dict(ranked[:k])
    if len(ranked) > k:
        top["other"] = (sum(v[0] for _, v in ranked[k:]), sum(v[1] for _, v in ranked[k:]))
    return top


def _process_until(bootstrap, topics, group, run_id, count, timeout=90):
    processor = Processor(bootstrap, topics, group_id=group, grace_s=0.5)
    stop = threading.Event()
    worker = threading.Thread(target=processor.run, kwargs={"stop": stop}, daemon=True)
    worker.start()
    try:
        return step_records(bootstrap, topics.steps, run_id, count, timeout), processor
    finally:
        stop.set()
        worker.join(30)


def test_every_step_time_equals_the_simulators_and_no_batch_is_lost(kafka_bootstrap, topics):
    cfg = SimConfig(run_id="skeleton", ranks=2, steps=50, ops_per_step=200, seed=11)
    sim = run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix,
                               "batch_max_ops": 1000})
    assert sim.flushed and sim.dropped_ops == 0

    batches = raw_batches(kafka_bootstrap, topics.raw, cfg.run_id, sum(s["seq"] for s in sim.stats))
    seqs = defaultdict(list)
    for b in batches:
        seqs[b.producer_id].append(b.seq)
    assert len(seqs) == cfg.ranks
    for producer, got in seqs.items():
        assert got == list(range(len(got))), f"producer {producer} has seq gaps: {got}"

    steps, _ = _process_until(kafka_bootstrap, topics, "g-skeleton", cfg.run_id, cfg.ranks * cfg.steps)
    truth = expected(cfg)
    got = {(r["rank"], r["step"]): r for r in steps}
    assert len(steps) == len(got) == cfg.ranks * cfg.steps  # each (rank, step) exactly once
    for key, want in truth.items():
        assert got[key]["step_time_ns"] == want["step_time_ns"], key
        assert got[key]["closed_by"] == "watermark"


@pytest.mark.parametrize("comm_share", [0.0, 0.2])
def test_every_figure_of_a_clean_run_equals_the_ground_truth(kafka_bootstrap, topics, comm_share):
    cfg = SimConfig(run_id=f"clean-{int(comm_share * 10)}", ranks=2, steps=50, ops_per_step=120,
                    comm_share=comm_share, seed=3)
    result = run_demo(kafka_bootstrap, cfg, topics, group_id=f"g-clean-{comm_share}", timeout=90)
    assert len(result.steps) == cfg.ranks * cfg.steps
    for rec in result.steps:
        want = result.truth[(rec["rank"], rec["step"])]
        for f in ("step_time_ns", "data_wait_ns", "fp_bp_ns", "tail_ns", "compute_ns", "comm_ns",
                  "overlap_ns", "pure_comm_ns", "idle_ns"):
            assert rec[f] == want[f], (rec["rank"], rec["step"], f)
        assert rec["utilization"] == pytest.approx(want["utilization"], rel=1e-12)
        assert rec["overlap_ratio"] == pytest.approx(want["overlap_ratio"], rel=1e-12)
        assert {t["op_type"]: (t["total_ns"], t["count"]) for t in rec["op_types"]} == _top_k(want["op_types"], 10)
        assert rec["memory"] == want["memory"]
        (queue,) = rec["queues"]
        assert queue["queue"] == "device_queue"
        assert {k: queue[k] for k in want["queue"]} == want["queue"]
        assert rec["starved"] is False
    if comm_share:
        assert any(r["pure_comm_ns"] > 0 for r in result.steps)  # the case is really exercised
    assert all(row["matches_truth"] for row in result.per_rank())


def test_demo_command_leaves_an_archive_timelines_and_a_report_and_prints_where(kafka_bootstrap, topics, tmp_path):
    import re

    from typer.testing import CliRunner

    from profstream.cli import app
    from profstream.offline.archive import finished_files, iter_file

    out = tmp_path / "demo"
    result = CliRunner().invoke(app, ["demo", "--bootstrap", kafka_bootstrap, "--topic-prefix", topics.prefix,
                                      "--steps", "20", "--ops-per-step", "40", "--stall", "5:11", "--out", str(out),
                                      "--no-serve"])
    assert result.exit_code == 0, result.output
    run_id = re.search(r"run (demo-\d{8}-\d{6})", result.output).group(1)
    assert re.search(r"metrics: http://127\.0\.0\.1:\d+/metrics", result.output)
    assert f"report:    {out / 'report.html'}" in result.output
    # every raw message of the run is in the archive, and each rank has a timeline file
    raw = [r for f in finished_files(out / "archive") if f.topic == topics.raw and f.run_id == run_id
           for r, _ in iter_file(f) if r]
    assert len(raw) == topic_size(kafka_bootstrap, topics.raw)  # the topics are this test's own
    for rank in (0, 1):
        assert list((out / "timeline" / run_id / f"rank-{rank}").glob("steps-0-19*.json.gz"))
    report = (out / "report.html").read_text()
    assert f"profstream post-mortem: {run_id}" in report
    assert report.count('data-alert="DataQueueStall"') == 4  # fired and resolved on both ranks
    assert f'href="timeline/{run_id}/rank-0/steps-0-19.json.gz"' in report
    # the page opens in a browser: no console error, its charts and summary rows are there
    dom, console = render_in_chromium(out / "report.html")
    summary = re.search(r'<table id="summary">(.*?)</table>', dom, re.S)
    assert console == [] and 'data-chart="step-time"' in dom and summary and summary.group(1).count('<tr data-rank="') == 2
    assert 'id="work"' in dom  # the demo's steps carry their work: the throughput table is there too
    # Prometheus ran with a copy of deploy/prometheus's configuration scraping the demo's exporter
    if shutil.which("prometheus") or os.environ.get("PROFSTREAM_SKIP_PROMETHEUS") != "1":
        assert re.search(r"Prometheus: http://127\.0\.0\.1:\d+", result.output), result.output
        exporter = re.search(r"metrics: http://(127\.0\.0\.1:\d+)/metrics", result.output).group(1)
        config = yaml.safe_load((out / "prometheus" / "prometheus.yml").read_text())
        assert [exporter] in [sc["targets"] for job in config["scrape_configs"] for sc in job["static_configs"]]
