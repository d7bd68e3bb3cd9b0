"""The whole pipeline on a secured broker (`profstream stack up --secure`): Monitors,
processor, Prometheus exporter, archive and a capture, each with its own role's
credentials and nothing more (the broker's StandardAuthorizer enforces the ACLs), once
with SCRAM over SASL_SSL and once with client certificates (mutual TLS)."""

from __future__ import annotations

import threading
import urllib.request

import pytest

from profstream.control.client import follow, send_request
from profstream.control.records import new_request, parse_ranks
from profstream.kafka.clients import read_topic
from profstream.offline.archive import finished_files, iter_file
from profstream.schema.codec import decode, record_name
from profstream.sinks.archive import run_archive
from profstream.sinks.prometheus import PrometheusExporter
from tests.helpers import raw_batches, wait_until
from tests.test_capture import TrainingLoop
from tests.test_processor import RunningProcessor

RANKS = 2


@pytest.mark.parametrize("mtls", [False, True], ids=["scram", "mtls"])
def test_the_whole_pipeline_runs_with_each_role_s_own_credentials(secure_stack, mtls, tmp_path):
    run_id = f"secure-{'mtls' if mtls else 'scram'}"
    groups = {"processor": (f"proc-{run_id}",), "sink": (f"prom-{run_id}", f"archive-{run_id}")}
    topics = secure_stack.topics(run_id, groups)
    conn = {role: secure_stack.conn(role, mtls) for role in ("trainer", "processor", "sink", "capture")}
    exporter = PrometheusExporter(conn["sink"], topics, port=0, addr="127.0.0.1", group_id=f"prom-{run_id}",
                                  wait_topics_s=10)
    url = exporter.serve()
    exporting = threading.Thread(target=exporter.run, daemon=True)
    exporting.start()
    stop_archive = threading.Event()
    archive = tmp_path / "archive"
    archiving = threading.Thread(target=run_archive, args=(
        conn["sink"], [topics.raw, topics.steps, topics.control, topics.requests_prefix], archive, stop_archive),
        kwargs={"group_id": f"archive-{run_id}", "max_age_s": 0.5}, daemon=True)
    archiving.start()
    try:
        with RunningProcessor(conn["processor"], topics, group_id=f"proc-{run_id}"), \
                TrainingLoop(conn["trainer"], topics, run_id, ranks=RANKS) as ranks:
            wait_until(lambda: ranks.steps >= 5, 60, "the first steps")
            request = new_request(run_id, ranks=parse_ranks("1"), steps=3, reason="secure test",
                                  requested_by="someone else")
            send_request(conn["capture"], topics, request)
            progress = follow(conn["capture"], topics, request, timeout=60)
            assert sorted(progress.finished()) == [1], progress.ranks
            status = progress.finished()[1]
            # who asked is what the broker authenticated, not what the request says
            assert status["requester"] == "capture" and status["request_reason"] == "secure test"
            steps = read_topic(conn["sink"], topics.steps, lambda v: record_name(v) == "StepMetrics", 2 * 5, 60,
                               decode=lambda v: v)
            assert len(steps) >= 10
            for m in ranks.monitors:
                assert m.stats()["connected"] and m.stats()["dropped_ops"] == 0

            def exported() -> bool:
                with urllib.request.urlopen(url, timeout=5) as answer:
                    return f'run="{run_id}"' in answer.read().decode()

            wait_until(exported, 60, "the exporter to serve the run's figures")
        # the captured steps' ops, and only theirs, reached the raw topic (read by the sink role)
        captured = [b for b in raw_batches(conn["sink"], topics.raw, run_id, 10**6, timeout=10, full=False)
                    if b.n("ops")]
        assert {b.rank for b in captured} == {1}
        first, last = status["first_step"], status["last_step"]
        assert {int(s) for b in captured for s in b.ops["step"]} == set(range(first, last + 1))
        figures = decode("StepMetrics", steps[0])
        assert figures["run_id"] == run_id
        wait_until(lambda: {f.topic for f in finished_files(archive)} >= {
            topics.raw, topics.steps, topics.control, topics.requests("capture")}, 60,
            "the archive to hold the raw, steps, control and request topics")
        requests = [r for f in finished_files(archive) if f.topic == topics.requests("capture")
                    for r, _ in iter_file(f) if r]
        assert len(requests) == 1
    finally:
        stop_archive.set()
        archiving.join(30)
        exporter.stop()
        exporting.join(30)
        exporter.close()
