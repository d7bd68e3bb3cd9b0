"""The post-mortem report: figures equal the simulator's, nothing from the network, renders in Chromium."""

from __future__ import annotations

import re
import shutil
import statistics
import threading
import uuid
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from profstream.cli import app
from profstream.kafka.topics import Topics, delete_topics, ensure_topics
from profstream.offline import charts
from profstream.offline.archive import finished_files, iter_file
from profstream.simulate import SimConfig, expected, plan_run, run_simulation
from profstream.sinks.archive import run_archive
from tests.helpers import chromium, render_in_chromium, topic_size, wait_until

# ops captured on every 4th step, as docs/capture.md recommends for long runs; the run's
# clock starts on a day long before the report is made, so that an alert shown at the
# report's own time cannot pass for the alert's
START_NS = int(datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()) * 10**9
CFG = SimConfig(run_id="postmortem", ranks=3, steps=40, ops_per_step=60, seed=21, stall=(10, 19),
                straggler_rank=2, leak_bytes_per_step=1 << 20, device_counters=True, throttle=(30, 33),
                start_ns=START_NS, capture_every_n_steps=4, batch_size=4, seq_len=256, variable_tokens=True,
                flops_per_token=6 * 1.2e9, flops_source="counted", peak_tflops=989.5, resources=True,
                loader_fault="cpu_bound")
CAPTURED = range(0, CFG.steps, 4)


@pytest.fixture(scope="module")
def archive(kafka_bootstrap, tmp_path_factory) -> Path:
    """A simulated run (data stall on steps 10-19, rank 2 a straggler) archived from the real broker."""
    topics = Topics(f"t-report-{uuid.uuid4().hex[:8]}")
    ensure_topics(kafka_bootstrap, topics, raw_partitions=4, partitions=3)
    out = tmp_path_factory.mktemp("report") / "archive"
    stop = threading.Event()
    sink = threading.Thread(target=run_archive, args=(kafka_bootstrap, [topics.raw], out, stop),
                            kwargs={"group_id": f"a-{topics.prefix}", "max_age_s": 0.5}, daemon=True)
    sink.start()
    try:
        run_simulation(CFG, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
        total = topic_size(kafka_bootstrap, topics.raw)
        wait_until(lambda: sum(1 for f in finished_files(out) for r, _ in iter_file(f) if r) == total, 60,
                   "the archive to hold every raw message")
    finally:
        stop.set()
        sink.join(30)
    yield out
    delete_topics(kafka_bootstrap, topics, timeout=5.0)


class _Page(HTMLParser):
    """The parts of the page a test reads: summary cells, alert rows, charts, links, scripts."""

    def __init__(self) -> None:
        super().__init__()
        self.summary: dict[tuple[int, str], float] = {}
        self.alerts: list[tuple[str, str]] = []
        self.alert_rows: list[list[str]] = []  # the cells of each alert row, as shown
        self.points: dict[tuple[str, str], list[tuple[float, float]]] = {}  # (chart, series) -> drawn (x, y)
        self.kpis: dict[str, str] = {}  # data-kpi -> the text shown
        self.charts: list[str] = []
        self.series: list[str] = []
        self.urls: list[str] = []
        self.links: list[str] = []
        self._rank: int | None = None
        self._chart = self._series = self._series_tag = self._kpi = None
        self._cells: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "svg":
            self._chart = a.get("data-chart")
        if a.get("class") == "series" and self._chart is not None:
            self._series, self._series_tag = a.get("data-series"), tag
        if self._series is not None and tag in ("polyline", "circle"):
            pts = a["points"].split() if tag == "polyline" else [f'{a["cx"]},{a["cy"]}']
            self.points.setdefault((self._chart, self._series), []).extend(
                tuple(map(float, p.split(","))) for p in pts)
        if tag == "div" and "data-kpi" in a:
            self._kpi = a["data-kpi"]
            self.kpis[self._kpi] = ""
        if tag == "td" and self._cells is not None:
            self._cells.append("")
        if tag == "tr" and "data-rank" in a:
            self._rank = int(a["data-rank"])
        if tag == "td" and "data-metric" in a and self._rank is not None:
            self.summary[(self._rank, a["data-metric"])] = float(a["data-value"])
        if tag == "tr" and "data-alert" in a:
            self.alerts.append((a["data-alert"], a["data-state"]))
            self._cells = []
        if tag == "svg" and "data-chart" in a:
            self.charts.append(a["data-chart"])
        if tag in ("polyline", "polygon") or (tag == "g" and a.get("class") == "series"):
            self.series.append(a.get("data-series", ""))
        for key in ("src", "href"):
            if key in a:
                self.urls.append(a[key])
        if tag == "a":
            self.links.append(a.get("href", ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._chart = None
        if tag == self._series_tag:
            self._series = self._series_tag = None
        if tag == "tr" and self._cells is not None:
            self.alert_rows.append(self._cells)
            self._cells = None
        if tag == "div":
            self._kpi = None

    def handle_data(self, data: str) -> None:
        if self._cells:
            self._cells[-1] += data
        if self._kpi is not None:
            self.kpis[self._kpi] += data


def _report(archive: Path, out: Path, *args: str) -> tuple[_Page, str]:
    result = CliRunner().invoke(app, ["report", str(archive), "--run", CFG.run_id, "-o", str(out), *args])
    assert result.exit_code == 0, result.output
    text = out.read_text(encoding="utf-8")
    page = _Page()
    page.feed(text)
    return page, text


def test_the_report_shows_the_simulators_figures_and_the_stall(archive, tmp_path):
    page, text = _report(archive, tmp_path / "report.html")
    truth = expected(CFG)
    for rank in range(CFG.ranks):
        times = np.array([truth[(rank, s)]["step_time_ns"] for s in range(CFG.steps)], float)
        waits = np.array([truth[(rank, s)]["data_wait_ns"] for s in range(CFG.steps)], float)
        assert page.summary[(rank, "steps")] == CFG.steps
        assert page.summary[(rank, "mean_step_ms")] == pytest.approx(times.mean() / 1e6, rel=1e-12)
        assert page.summary[(rank, "p95_step_ms")] == pytest.approx(np.percentile(times, 95) / 1e6, rel=1e-12)
        assert page.summary[(rank, "data_wait_share")] == pytest.approx(waits.sum() / times.sum(), rel=1e-12)
        assert page.summary[(rank, "starved_steps")] == 10  # steps 10-19
    # the straggler has the slowest mean, and is named the slowest rank on the steps it held up
    assert max(range(CFG.ranks), key=lambda r: page.summary[(r, "mean_step_ms")]) == CFG.straggler_rank
    assert re.search(rf'<tr data-straggler="{CFG.straggler_rank}">', text)
    # DataQueueStall fired and resolved on every rank, each at its own time: the end of the step
    # at which it changed (starved steps 10-19: firing at the 5th, 14; resolved after 5 healthy, 24)
    assert sorted(page.alerts) == sorted([("DataQueueStall", "firing"), ("DataQueueStall", "resolved")] * CFG.ranks)
    assert sorted(row[:5] for row in page.alert_rows) == _alert_rows_at_their_steps()
    # utilization: the mean over the steps whose ops were captured, drawn at those steps alone
    for rank in range(CFG.ranks):
        assert page.summary[(rank, "measured_steps")] == len(CAPTURED)
        assert page.summary[(rank, "utilization")] == pytest.approx(
            np.mean([truth[(rank, s)]["utilization"] for s in CAPTURED]), rel=1e-12)
    _no_point_at_0(page)
    assert page.kpis["utilization"] == f"{np.mean([t['utilization'] for (r, s), t in truth.items() if s in CAPTURED]):.1%}" \
        f"utilization (of the {len(CAPTURED)} of {CFG.steps} steps with ops captured)"
    # ... and is marked once per transition along the step-time chart
    assert text.count('data-mark="DataQueueStall firing"') == 1 and text.count('data-mark="DataQueueStall resolved"') == 1
    for chart in ("step-time", "utilization", "overlap", "memory", "queues", "op-types", "skew", "rank-heat",
                  *(f"phases-rank-{r}" for r in range(CFG.ranks))):
        assert chart in page.charts, chart
    assert "AllReduce" in page.series and "rank 2" in page.series


def _shown(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _alert_rows_at_their_steps() -> list[list[str]]:
    """(alert, state, rank, step, time) of the run's DataQueueStall transitions."""
    ends = {(p.rank, p.step): p.end_ns for p in plan_run(CFG)}
    return sorted(["DataQueueStall", state, str(rank), str(step), _shown(ends[(rank, step)])]
                  for rank in range(CFG.ranks) for state, step in (("firing", 14), ("resolved", 24)))


def _no_point_at_0(page: _Page) -> None:
    """Every rank's utilization is drawn at its captured steps only, none at 0 %."""
    zero_y = charts.HEIGHT - charts.BOTTOM  # the y of 0 (the chart starts at 0)
    for rank in range(CFG.ranks):
        points = page.points[("utilization", f"rank {rank}")]
        assert len(points) == len(CAPTURED) and all(y < zero_y - 50 for _, y in points), points


def test_the_report_has_a_device_counter_section_with_the_simulators_readings(archive, tmp_path):
    page, text = _report(archive, tmp_path / "report.html")
    truth = expected(CFG)
    for rank in range(CFG.ranks):
        dev = [truth[(rank, s)]["device"] for s in range(CFG.steps)]
        assert re.search(rf'<tr data-rank="{rank}" data-device="cuda:{rank}">', text)
        assert page.summary[(rank, "counter_steps")] == CFG.steps
        assert page.summary[(rank, "gpu_util")] == pytest.approx(np.mean([d["gpu_util"] for d in dev]), rel=1e-12)
        assert page.summary[(rank, "power_peak_w")] == max(d["power_peak_w"] for d in dev)
        assert page.summary[(rank, "temperature_max_c")] == max(d["temperature_max_c"] for d in dev)
        assert page.summary[(rank, "throttled_thermal_steps")] == 4  # steps 30-33
        assert page.summary[(rank, "throttled_power_steps")] == 0
    assert "throttled steps: 30–33" in text
    assert "device-util" in page.charts and "device-temperature" in page.charts


def test_the_report_shows_each_ranks_throughput_and_mfu_over_the_run_and_per_step(archive, tmp_path):
    page, text = _report(archive, tmp_path / "report.html")
    truth = expected(CFG)
    run_tokens = []
    for rank in range(CFG.ranks):
        steps = [truth[(rank, s)] for s in range(CFG.steps)]
        seconds = sum(t["step_time_ns"] for t in steps) / 1e9
        tokens_per_s = sum(t["work"]["tokens"] for t in steps) / seconds
        run_tokens.append(tokens_per_s)
        assert page.summary[(rank, "work_steps")] == CFG.steps
        assert page.summary[(rank, "tokens_per_s")] == pytest.approx(tokens_per_s, rel=1e-12)
        assert page.summary[(rank, "tflops")] == pytest.approx(
            sum(t["work"]["flops"] for t in steps) / seconds / 1e12, rel=1e-12)
        assert page.summary[(rank, "mfu")] == pytest.approx(
            sum(t["work"]["flops"] for t in steps) / seconds / 989.5e12, rel=1e-12)
        assert page.summary[(rank, "peak_tflops")] == 989.5
        # the per-step chart draws every step's MFU (no gap: every step had one)
        assert len(page.points[("mfu", f"rank {rank}")]) == CFG.steps
    assert page.kpis["tokens/s"].startswith(f"{sum(run_tokens):,.0f}")
    assert "op-categories" in page.charts and "counted (40)" in text


def test_the_report_says_what_to_do_about_the_stall_with_the_figures_and_the_rule(archive, tmp_path):
    page, text = _report(archive, tmp_path / "report.html")
    for rank in range(CFG.ranks):  # every stalled step (10-19) of every rank: its workers busy, its queue empty
        assert re.search(rf'<tr data-rank="{rank}" data-rule="more_workers">', text)
        assert page.summary[(rank, "advised_steps")] == 10
    assert text.count('data-rule="') == CFG.ranks  # that rule only
    assert "raise num_workers" in text and "MindSpore data preparation" in text
    assert "loader-busy" in page.charts


def test_the_report_has_each_loader_workers_seconds_per_batch(archive, tmp_path):
    _page, text = _report(archive, tmp_path / "report.html")
    truth = expected(CFG)
    for rank in range(CFG.ranks):
        for worker in (0, 1):  # 1 s a batch while busy (steps 10-19), 0.5 s otherwise
            values = [w["s_per_batch"] for step in range(CFG.steps)
                      for w in truth[(rank, step)]["resources"]["per_worker"] if w["worker"] == worker]
            row = re.search(rf'<tr data-rank="{rank}" data-worker="{worker}"><td>rank {rank}</td><td>{worker}</td>'
                            rf'<td>{len(values)}</td><td data-metric="s_per_batch_median" data-value="([^"]+)">.*?'
                            rf'data-metric="s_per_batch_latest" data-value="([^"]+)"', text)
            assert row, (rank, worker)
            assert float(row[1]) == pytest.approx(statistics.median(values), rel=1e-5)
            assert float(row[2]) == pytest.approx(values[-1], rel=1e-5)


def test_the_report_needs_no_network_and_links_timelines_relatively(archive, tmp_path):
    timelines = tmp_path / "timeline" / CFG.run_id / "rank-0"
    timelines.mkdir(parents=True)
    (timelines / "steps-0-39.json.gz").write_bytes(b"")
    page, _text = _report(archive, tmp_path / "out" / "report.html", "--timeline-dir", str(tmp_path / "timeline"))
    assert not [u for u in page.urls if re.match(r"(?i)\s*(https?:)?//", u)], page.urls
    assert page.links == ["../timeline/postmortem/rank-0/steps-0-39.json.gz"]
    assert (tmp_path / "out" / page.links[0]).resolve() == (timelines / "steps-0-39.json.gz").resolve()


def test_an_unknown_run_is_a_one_line_error_naming_the_runs_there(archive, tmp_path):
    result = CliRunner().invoke(app, ["report", str(archive), "--run", "other", "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 2
    assert CFG.run_id in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "r.html").exists()


def test_the_report_renders_in_chromium_without_console_errors(archive, tmp_path):
    chromium()  # fails (or skips on request) before any work when Chromium is missing
    out = tmp_path / "report.html"
    _report(archive, out)
    dom, console = render_in_chromium(out)
    assert console == []
    rendered = _Page()
    rendered.feed(dom)
    assert len(rendered.charts) >= 8 + CFG.ranks and rendered.summary
    assert dom.count("<polyline") >= 2 * CFG.ranks  # step time, memory lines
    # as a reader sees it: each alert at its own time, not the report's; no 0 % utilization
    # for the steps whose ops were not captured, and the headline says what it is over
    assert sorted(row[:5] for row in rendered.alert_rows) == _alert_rows_at_their_steps()
    made = re.search(r"made (\d{4}-\d\d-\d\d \d\d:\d\d) UTC", dom).group(1)
    assert not [row for row in rendered.alert_rows if row[4].startswith(made)]
    _no_point_at_0(rendered)
    assert "0.0%" not in rendered.kpis["utilization"] and "steps with ops captured" in rendered.kpis["utilization"]
    # the check itself sees a page that fails
    broken = tmp_path / "broken.html"
    broken.write_text(out.read_text().replace("</body>", "<script>notAFunction();</script></body>"))
    assert any("notAFunction" in line for line in render_in_chromium(broken)[1])


def _rank_of(record: dict) -> int:
    return int(record["key"].decode().rsplit("/", 1)[1])  # keys are "<run>/<rank>"


def test_a_damaged_archive_file_is_named_with_its_lost_offsets_and_the_report_still_written(archive, tmp_path):
    damaged = tmp_path / "archive"
    shutil.copytree(archive, damaged)
    victim = max((f for f in finished_files(damaged) if f.run_id == CFG.run_id), key=lambda f: f.path.stat().st_size)
    in_victim = {_rank_of(r) for r, _ in iter_file(victim) if r}
    victim.path.write_bytes(victim.path.read_bytes()[:-200])  # the end of its last block is gone
    out = tmp_path / "report.html"
    result = CliRunner().invoke(app, ["report", str(damaged), "--run", CFG.run_id, "-o", str(out)])
    assert result.exit_code == 1, result.output  # written, but the loss is not hidden behind exit 0
    lost = re.search(rf"{re.escape(victim.path.name)}: damaged .*offsets (\d+)\.\.(\d+)", result.output)
    assert lost and int(lost.group(2)) == victim.last_offset, result.output
    assert victim.first_offset <= int(lost.group(1)) <= victim.last_offset
    text = out.read_text(encoding="utf-8")
    assert '<ul id="losses">' in text and victim.path.name in text
    # the ranks whose messages are all in intact files are reported with the simulator's figures
    intact = {_rank_of(r) for f in finished_files(damaged) if f.path != victim.path for r, _ in iter_file(f) if r}
    intact -= in_victim
    assert intact, "the test needs a rank outside the damaged file"
    page = _Page()
    page.feed(text)
    truth = expected(CFG)
    for rank in intact:
        times = np.array([truth[(rank, s)]["step_time_ns"] for s in range(CFG.steps)], float)
        assert page.summary[(rank, "steps")] == CFG.steps
        assert page.summary[(rank, "mean_step_ms")] == pytest.approx(times.mean() / 1e6, rel=1e-12)
    assert sum(page.summary[(rank, "steps")] for rank in range(CFG.ranks) if (rank, "steps") in page.summary) \
        < CFG.ranks * CFG.steps
