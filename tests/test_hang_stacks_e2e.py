"""A hang brings every rank's stacks with no command typed, through the real broker.

Real rank processes with real Monitors (progress every 1 s) block in step 3: one sleeps in
``stuck_in_data_loading``, the others wait in ``wait_in_all_reduce`` (an Event, as a
collective waits for its peers). A Processor with ``--hang-after-s 3`` fires TrainingHang;
the autocapture service, reading the alerts topic, asks every rank for its stacks; the
answers are on the control topic, where ``profstream stacks --latest`` reads them, the
timeline sink writes them as the run's stacks file and the archive keeps them for the
report. Each shows the sleeping rank apart, first, in its function.
"""

from __future__ import annotations

import gzip
import json
import threading
from html.parser import HTMLParser

import pytest
from typer.testing import CliRunner

from profstream.cli import app
from profstream.control.autocapture import AUTO_BY
from profstream.control.policy import CapturePolicy
from profstream.offline.archive import finished_files, iter_file
from profstream.sinks.archive import run_archive
from profstream.sinks.timeline import TimelineSink
from tests.helpers import wait_until
from tests.test_autocapture import RunningService, _requests
from tests.test_capture import RunningSink, control_records
from tests.test_processor import RunningProcessor
from tests.test_stacks import RANK_SCRIPT as STACKS_SCRIPT
from tests.test_stacks import STUCK, WORLD, Ranks

RUN = "hung-run"

# test_stacks.py's ranks (one asleep in stuck_in_data_loading, the others in
# wait_in_all_reduce, all in step 3), telling where they are every second
RANK_SCRIPT = STACKS_SCRIPT.replace("host_sample_interval_s=0)", "host_sample_interval_s=0, progress_interval_s=1.0)")
assert RANK_SCRIPT != STACKS_SCRIPT


class _Pre(HTMLParser):
    """The text of the report's ``<pre id="stacks">``."""

    def __init__(self):
        super().__init__()
        self.inside, self.text = False, ""

    def handle_starttag(self, tag, attrs):
        self.inside = self.inside or (tag == "pre" and ("id", "stacks") in attrs)

    def handle_endtag(self, tag):
        self.inside = self.inside and tag != "pre"

    def handle_data(self, data):
        if self.inside:
            self.text += data


def _assert_stuck_rank_first(text: str) -> None:
    others = ",".join(str(r) for r in range(WORLD) if r != STUCK)
    first = text.index(f"rank {STUCK} (1 of {WORLD}) on node-{STUCK}")
    second = text.index(f"ranks {others} (2 of {WORLD})")
    assert first < text.index("in stuck_in_data_loading\n      time.sleep(600)") < second, text
    assert second < text.index("in wait_in_all_reduce"), text
    assert text.count("in stuck_in_data_loading") == 1, text


@pytest.mark.multiproc  # ~35 s: rank processes start, hang past 3 s, are asked, archived, reported
def test_a_hang_brings_every_rank_s_stacks_with_no_command_typed(kafka_bootstrap, topics, tmp_path):
    archive_dir, timeline_dir = tmp_path / "archive", tmp_path / "timeline"
    stop_archive = threading.Event()
    archiver = threading.Thread(target=run_archive, args=(kafka_bootstrap, [topics.raw, topics.control], archive_dir,
                                                          stop_archive),
                                kwargs={"group_id": f"a-{topics.prefix}", "max_age_s": 0.5}, daemon=True)
    archiver.start()
    timeline = TimelineSink(timeline_dir, window_steps=1000, control_topic=topics.control)
    try:
        with RunningProcessor(kafka_bootstrap, topics, hang_after_s=3.0), \
                RunningService(kafka_bootstrap, topics, CapturePolicy()) as svc, \
                RunningSink(kafka_bootstrap, [topics.raw, topics.control], f"tl-{topics.prefix}", timeline), \
                Ranks(kafka_bootstrap, topics, RUN, tmp_path, RANK_SCRIPT) as ranks:
            wait_until(ranks.entered, 60, "every rank to reach its blocking call")
            # nobody asks: the hang's alert does, and every rank answers on the control topic
            answers = [s for _n, s in control_records(
                kafka_bootstrap, topics, lambda x: x[0] == "CaptureStatus" and x[1]["run_id"] == RUN
                and x[1]["threads"] is not None, WORLD, timeout=90)]
            assert sorted(s["rank"] for s in answers) == list(range(WORLD))
            assert {s["request_reason"] for s in answers} == {"TrainingHang firing (alerts topic)"}

            result = CliRunner().invoke(app, ["stacks", "--run", RUN, "--latest", "--bootstrap", kafka_bootstrap,
                                              "--topic-prefix", topics.prefix])
            assert result.exit_code == 0, result.output
            assert f"(TrainingHang firing (alerts topic)): {WORLD} of {WORLD} ranks answered" in result.output
            _assert_stuck_rank_first(result.output)

            stacks_file = timeline_dir / RUN / "stacks.json.gz"
            wait_until(stacks_file.is_file, 30, "the timeline sink's stacks file")
            wait_until(lambda: json.loads(gzip.decompress(stacks_file.read_bytes()))["otherData"]["ranks"] == WORLD,
                       30, "every rank's stacks in the file")
            trace = json.loads(gzip.decompress(stacks_file.read_bytes()))
            assert trace["otherData"]["groups"] == [[STUCK], [r for r in range(WORLD) if r != STUCK]]
            marks = {(e["pid"] - 1, e["name"]) for e in trace["traceEvents"] if e["ph"] == "i"}
            assert (STUCK, "MainThread: in stuck_in_data_loading") in marks
            assert {(r, "MainThread: in wait") for r in range(WORLD) if r != STUCK} <= marks  # Event.wait's inner

            wait_until(lambda: any(f.topic == topics.control for f in finished_files(archive_dir))
                       and sum(1 for f in finished_files(archive_dir) if f.topic == topics.control
                               for r, _ in iter_file(f) if r) >= WORLD, 30, "the archive to hold the answers")
            # once per hang: the hang fired once and was asked for once
            assert [o.action for o in svc.outcomes if o.alert == "TrainingHang"] == ["requested"]
        (request,) = _requests(kafka_bootstrap, topics, RUN, 2, timeout=5)
        assert request["kind"] == "stacks" and request["ranks"] is None and request["requested_by"] == AUTO_BY
    finally:
        stop_archive.set()
        archiver.join(30)

    out = tmp_path / "report.html"
    result = CliRunner().invoke(app, ["report", str(archive_dir), "--run", RUN, "-o", str(out), "--timeline-dir",
                                      str(timeline_dir)])
    assert result.exit_code == 0, result.output
    page = _Pre()
    page.feed(out.read_text())
    _assert_stuck_rank_first(page.text)
    assert 'href="timeline/hung-run/stacks.json.gz"' in out.read_text()
