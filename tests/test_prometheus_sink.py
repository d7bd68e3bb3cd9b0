"""The Prometheus exporter against the real broker: what a scrape shows equals the
simulator's truth, silent runs expire, bad records are counted and skipped, a busy port is
a one-line error, and the exposition passes `promtool check metrics`."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from profstream.kafka.clients import make_producer
from profstream.kafka.topics import Topics
from profstream.processors.figures import FigureOptions
from profstream.schema.codec import encode
from profstream.simulate import SimConfig, expected, plan_run, run_simulation
from profstream.sinks.prometheus import STEP_BUCKETS, ExporterState, start_exporter
from tests.helpers import connected_exporter, health_of_a_processor, wait_until
from tests.test_alert_rules import prometheus_tool
from tests.test_processor import RunningProcessor

ROOT = Path(__file__).resolve().parent.parent


class Scrape:
    """One /metrics scrape: ``s("name", run="r", rank="0")`` is the one matching sample."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def all(self, name: str, **labels: str) -> list:
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def __call__(self, name: str, **labels: str) -> float:
        found = self.all(name, **labels)
        assert len(found) == 1, f"{len(found)} samples of {name}{labels}"
        return found[0].value


def scrape(url: str) -> Scrape:
    return Scrape(urllib.request.urlopen(url, timeout=5).read().decode())


@contextmanager
def exporter(bootstrap, topics, **kw):
    url, stop = start_exporter(bootstrap, topics, port=0, addr="127.0.0.1",
                               group_id=kw.pop("group_id", f"prom-{topics.prefix}"), **kw)
    try:
        yield url
    finally:
        stop()


def sim(bootstrap, topics, cfg: SimConfig):
    return run_simulation(cfg, {"bootstrap": bootstrap, "topic_prefix": topics.prefix})


def _steps_seen(url: str, run: str, ranks: int, last: int):
    """The scrape once every rank of ``run`` shows step ``last`` (and its run-level figures)."""
    def ready():
        s = scrape(url)
        done = [x.value for x in s.all("profstream_last_step", run=run)] == [last] * ranks
        return s if done and s.all("profstream_rank_skew_ratio", run=run) else None
    return ready


def test_a_scrape_shows_the_simulators_figures_and_passes_promtool(kafka_bootstrap, topics):
    cfg = SimConfig(run_id="truth", ranks=3, steps=30, ops_per_step=40, stall=(10, 29), straggler_rank=2,
                    straggler_factor=1.4, leak_bytes_per_step=1000, seed=3)
    truth, last = expected(cfg), cfg.steps - 1
    with RunningProcessor(kafka_bootstrap, topics, figure_options=FigureOptions(top_k=20)), \
            exporter(kafka_bootstrap, topics, top_k=4) as url:
        t0 = time.time()
        sim(kafka_bootstrap, topics, cfg)  # its Monitors close normally: each rank sends its end mark
        seen = _steps_seen(url, "truth", 3, last)
        s = wait_until(lambda: (x := seen()) and x.all("profstream_run_ended", run="truth")[0].value == 1 and x, 60,
                       "every rank's last step and the run's end in the scrape")
    for rank in range(3):
        t, lab = truth[(rank, last)], {"run": "truth", "rank": str(rank)}
        assert s("profstream_step_duration_seconds", **lab) == t["step_time_ns"] / 1e9
        for phase in ("data_wait", "fp_bp", "tail"):
            assert s("profstream_step_phase_seconds", phase=phase, **lab) == t[f"{phase}_ns"] / 1e9
        assert s("profstream_device_utilization_ratio", **lab) == pytest.approx(t["utilization"], rel=1e-12)
        assert s("profstream_comm_overlap_ratio", **lab) == pytest.approx(t["overlap_ratio"], rel=1e-12)
        assert s("profstream_idle_ratio", **lab) == pytest.approx(t["idle_ns"] / t["step_time_ns"], rel=1e-12)
        for kind in ("allocated", "reserved", "peak"):
            assert s("profstream_memory_bytes", kind=kind, **lab) == t["memory"][kind]
        assert s("profstream_queue_size", queue="device_queue", **lab) == t["queue"]["last"]
        assert s("profstream_queue_empty_ratio", queue="device_queue", **lab) == t["queue"]["empty_ratio"]
        assert s("profstream_starved_steps_total", **lab) == 20  # steps 10..29
        assert s("profstream_data_stall", **lab) == 1  # the run ends stalled
        assert t0 - 1 < s("profstream_last_step_timestamp_seconds", **lab) < time.time() + 60
        # the histogram holds every step: each bucket counts the steps up to its bound
        times = [truth[(rank, step)]["step_time_ns"] / 1e9 for step in range(cfg.steps)]
        assert s("profstream_step_duration_seconds_hist_count", **lab) == cfg.steps
        assert s("profstream_step_duration_seconds_hist_sum", **lab) == pytest.approx(sum(times), rel=1e-12)
        for le in STEP_BUCKETS:
            assert s("profstream_step_duration_seconds_hist_bucket", le=str(le), **lab) == sum(x <= le for x in times)
        # op types: at most top_k series of their own plus other, and nothing lost
        ops = {x.labels["op_type"]: x.value for x in s.all("profstream_op_type_seconds_total", **lab)}
        per_type: dict[str, int] = {}
        for step in range(cfg.steps):
            for op_type, (ns, _count) in truth[(rank, step)]["op_types"].items():
                per_type[op_type] = per_type.get(op_type, 0) + ns
        assert len(ops) == 5 and "other" in ops
        for op_type, value in ops.items():
            if op_type != "other":
                assert value == per_type[op_type] / 1e9
        assert ops["other"] == pytest.approx(sum(per_type.values()) / 1e9 - (sum(ops.values()) - ops["other"]),
                                             rel=1e-9)
    # the same four op types for every rank, so that they sum across ranks
    assert len({x.labels["op_type"] for x in s.all("profstream_op_type_seconds_total", run="truth")}) == 5
    times = sorted(truth[(r, last)]["step_time_ns"] for r in range(3))
    assert s("profstream_straggler_rank", run="truth") == 2
    assert s("profstream_rank_skew_ratio", run="truth") == pytest.approx((times[2] - times[0]) / times[1], rel=1e-12)
    assert s("profstream_run_ranks_reported", run="truth") == 3
    assert s("profstream_sink_records_total", topic="steps") == 93  # 90 StepMetrics, then a RankEnd per rank
    assert sum(x.value for x in s.all("profstream_sink_decode_errors_total")) == 0

    res = subprocess.run([prometheus_tool("promtool"), "check", "metrics"], input=s.text, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0 and res.stdout + res.stderr == "", res.stdout + res.stderr


def test_a_silent_run_loses_its_series_after_the_ttl_while_an_active_run_keeps_them(kafka_bootstrap, topics):
    ttl = 3.0
    early = SimConfig(run_id="early", ranks=2, steps=10, ops_per_step=20, seed=1)
    # realtime: sends for 8 s, well beyond the TTL
    active = SimConfig(run_id="active", ranks=1, steps=80, ops_per_step=20, step_time_ms=100, rate="realtime")
    with RunningProcessor(kafka_bootstrap, topics), exporter(kafka_bootstrap, topics, ttl_s=ttl) as url:
        sim(kafka_bootstrap, topics, early)
        wait_until(_steps_seen(url, "early", 2, 9), 60, "the early run in the scrape")
        runner = threading.Thread(target=sim, args=(kafka_bootstrap, topics, active))
        runner.start()
        try:
            s = wait_until(lambda: (lambda s: s if not [x for x in s.samples if x.labels.get("run") == "early"]
                                    else None)(scrape(url)), 30, "the early run's series to expire")
            assert s("profstream_sink_expired_total", what="run") == 1
            assert s("profstream_sink_expired_total", what="rank") == 2
            # The active run's first steps are older than the TTL by step 60 (6 s at 100 ms), yet
            # it keeps every step: expiry follows silence, not age.
            s = wait_until(lambda: (lambda s: s if s.all("profstream_last_step", run="active")
                                    and s("profstream_last_step", run="active") >= 60 else None)(scrape(url)),
                           30, "the active run to pass step 60")
            assert runner.is_alive(), "the active run had finished: the test proved nothing"
            last = s("profstream_last_step", run="active")
            assert s("profstream_step_duration_seconds_hist_count", run="active") == last + 1
            assert s("profstream_sink_runs") == 1
        finally:
            runner.join(60)
        # once silent for the TTL, the active run goes too
        wait_until(lambda: scrape(url)("profstream_sink_runs") == 0, 30, "the active run's series to expire")
        assert not scrape(url).all("profstream_step_duration_seconds")
        assert scrape(url)("profstream_sink_expired_total", what="run") == 2


def test_malformed_records_are_counted_and_skipped(kafka_bootstrap, topics):
    cfg = SimConfig(run_id="bad", ranks=2, steps=10, ops_per_step=20, seed=2)
    alert = encode("Alert", {"name": "DataQueueStall", "state": "firing", "run_id": "bad", "rank": 0, "step": 1,
                             "ts_ns": time.time_ns(), "summary": "x", "evidence": {}})
    garbage = {topics.steps: [b"not avro", alert, alert[:12]],  # not_avro, wrong_type, truncated
               topics.run: [b"\xc3\x01" + b"\x13" * 8 + b"\x00"],  # unknown_fingerprint
               topics.alerts: [b"{}"]}  # not_avro
    with RunningProcessor(kafka_bootstrap, topics), exporter(kafka_bootstrap, topics) as url:
        producer = make_producer(kafka_bootstrap)
        for topic, values in garbage.items():
            for value in values:
                producer.send(topic, key=b"bad", value=value)
        producer.flush()
        sim(kafka_bootstrap, topics, cfg)
        producer.send(topics.steps, key=b"bad", value=b"after the run")
        producer.close()
        s = wait_until(lambda: (lambda s: s if s("profstream_sink_decode_errors_total", topic="steps",
                                                   reason="not_avro") == 2 else None)(scrape(url)),
                       60, "the trailing bad record to be counted")
        seen = _steps_seen(url, "bad", 2, 9)
        s = wait_until(lambda: (x := seen()) and x.all("profstream_run_ended", run="bad")[0].value == 1 and x, 30,
                       "the valid steps and the run's end in the scrape")
    errors = {(x.labels["topic"], x.labels["reason"]): x.value
              for x in s.all("profstream_sink_decode_errors_total") if x.value}
    assert errors == {("steps", "not_avro"): 2, ("steps", "wrong_type"): 1, ("steps", "truncated"): 1,
                      ("run", "unknown_fingerprint"): 1, ("alerts", "not_avro"): 1}
    assert s("profstream_sink_records_total", topic="steps") == 20 + 2 + 4  # steps, a RankEnd per rank, the bad
    truth = expected(cfg)
    assert s("profstream_step_duration_seconds", run="bad", rank="1") == truth[(1, 9)]["step_time_ns"] / 1e9
    assert s("profstream_step_duration_seconds_hist_count", run="bad", rank="0") == 10


def test_a_restarted_exporter_still_reports_a_stall_that_fired_before_it_started(kafka_bootstrap, topics):
    first = SimConfig(run_id="long", ranks=1, steps=20, ops_per_step=20, stall=(10, 19), seed=4)
    start = max(p.end_ns for p in plan_run(first, time.time_ns()))
    rest = SimConfig(run_id="long", ranks=1, steps=10, ops_per_step=20, stall=(20, 29), seed=4, first_step=20,
                     start_ns=start)
    group = f"prom-{topics.prefix}"
    with RunningProcessor(kafka_bootstrap, topics):
        with exporter(kafka_bootstrap, topics, group_id=group) as url:
            sim(kafka_bootstrap, topics, first)
            s = wait_until(_steps_seen(url, "long", 1, 19), 60, "the first part of the run")
            assert s("profstream_data_stall", run="long", rank="0") == 1
        # the processor's stall stays firing: no new alert comes for the second part
        with exporter(kafka_bootstrap, topics, group_id=group) as url:
            sim(kafka_bootstrap, topics, rest)
            s = wait_until(_steps_seen(url, "long", 1, 29), 60, "the second part of the run")
            assert s("profstream_data_stall", run="long", rank="0") == 1
            # it resumed after the first part: its counters hold the second part only
            assert s("profstream_step_duration_seconds_hist_count", run="long", rank="0") == 10


def test_a_busy_port_is_a_one_line_error_naming_it(kafka_bootstrap, topics):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "profstream.cli", "sink", "prometheus", "--bootstrap",
                              kafka_bootstrap, "--topic-prefix", topics.prefix, "--addr", "127.0.0.1",
                              "--port", str(port)], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and str(port) in lines[0] and "--port" in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_every_metric_of_the_exporter_and_the_processor_is_documented():

    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(profstream_\w+)`", doc, re.M))
    health = health_of_a_processor(SimpleNamespace(open_runs=0, open_events=0, ranks={}))
    families = [*text_string_to_metric_families(connected_exporter(Topics("docs")).exposition().decode()),
                *health.collect()]
    exported = {family.name + ("_total" if family.type == "counter" else "") for family in families}
    assert exported == documented, exported ^ documented


def test_while_kafka_does_not_answer_neither_lag_reads_0():
    """Issue 37: with profstream_kafka_reachable at 0 both lag gauges read 0 (all caught up).
    Unknown is absent: no sample, until Kafka answers again."""
    health = health_of_a_processor(SimpleNamespace(open_runs=0, open_events=0, ranks={}))
    health._processor.lag, health._processor.kafka_reachable = (lambda: None), False
    exporter = ExporterState(Topics("away"))
    exporter.source = SimpleNamespace(lag=0, lag_known=False)
    samples = {s.name: s.value for family in [*health.collect(),
                                              *text_string_to_metric_families(exporter.exposition().decode())]
               for s in family.samples}
    assert samples["profstream_kafka_reachable"] == 0
    assert "profstream_consumer_lag_messages" not in samples and "profstream_sink_consumer_lag_messages" not in samples
    exporter.source.lag_known, exporter.source.lag = True, 7  # back
    assert "profstream_sink_consumer_lag_messages 7.0" in exporter.exposition().decode()


def test_device_windows_give_host_and_device_step_times_kernels_and_device_time_by_kind(tmp_path):
    """StepMetrics of a lagging GPU trace (tests/kineto_traces.py): both step times, the
    kernel breakdown by kind, and kernel types bounded to top K plus other."""
    from collections import namedtuple

    from profstream.offline.analyze import analyze
    from tests.kineto_traces import PER_STEP, lagging_device_trace

    Rec = namedtuple("Rec", "topic partition offset timestamp value")
    steps = analyze([lagging_device_trace(steps=4).write(tmp_path / "t.json")], "gpu").steps
    topics = Topics("dev")
    state = ExporterState(topics, top_k=3)
    now_ms = time.time_ns() // 10**6
    state.handle([Rec(topics.steps, 0, i, now_ms, encode("StepMetrics", s)) for i, s in enumerate(steps)])
    s = Scrape(state.exposition().decode())
    rank = {"run": "gpu", "rank": "0"}
    assert s("profstream_host_step_duration_seconds", **rank) == pytest.approx(1e-3)
    assert s("profstream_step_duration_seconds", **rank) == pytest.approx(steps[-1]["step_time_ns"] / 1e9)
    for kind, us in PER_STEP["kinds"].items():
        assert s("profstream_device_kind_seconds_total", kind=kind, **rank) == pytest.approx(4 * us / 1e6)
    kernels = {x.labels["kernel"]: x.value for x in s.all("profstream_kernel_seconds_total", **rank)}
    assert len(kernels) == 4 and "other" in kernels  # 3 of their own, the rest summed
    assert sum(kernels.values()) == pytest.approx(4 * sum(PER_STEP["kinds"].values()) / 1e6)
    assert "cudaLaunchKernel" in {x.labels["op_type"] for x in s.all("profstream_op_type_seconds_total")}
    assert not {"gemm_a_kernel", "adam_kernel"} & {x.labels["op_type"] for x in s.all("profstream_op_type_seconds_total")}
    res = subprocess.run([prometheus_tool("promtool"), "check", "metrics"], input=s.text, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_device_counters_are_series_per_device_and_a_throttled_step_shows_its_reason(kafka_bootstrap, topics):
    cfg = SimConfig(run_id="hot", ranks=2, steps=6, ops_per_step=20, device_counters=True, throttle=(5, 5), seed=7)
    truth, last = expected(cfg), cfg.steps - 1
    with RunningProcessor(kafka_bootstrap, topics), exporter(kafka_bootstrap, topics) as url:
        sim(kafka_bootstrap, topics, cfg)
        s = wait_until(_steps_seen(url, "hot", 2, last), 60, "every rank's last step in the scrape")
    for rank in range(2):
        t, lab = truth[(rank, last)]["device"], {"run": "hot", "rank": str(rank), "device": f"cuda:{rank}"}
        p = "profstream_device_"
        assert s(p + "gpu_utilization_ratio", **lab) == pytest.approx(t["gpu_util"], rel=1e-12)
        assert s(p + "memory_used_bytes", **lab) == t["mem_used_peak"]
        assert s(p + "power_peak_watts", **lab) == t["power_peak_w"]
        assert s(p + "temperature_celsius", **lab) == t["temperature_max_c"]
        assert s(p + "sm_clock_hertz", **lab) == pytest.approx(t["sm_clock_mhz"] * 1e6, rel=1e-12)
        assert s(p + "throttled", reason="thermal", **lab) == 1
        assert s(p + "throttled", reason="power", **lab) == 0
        assert s(p + "nvlink_bytes_per_second", direction="rx", **lab) == pytest.approx(t["nvlink_rx"], rel=1e-12)
        # one device per rank: no other device label
        assert {x.labels["device"] for x in s.all(p + "power_watts", run="hot", rank=str(rank))} == {f"cuda:{rank}"}
    assert s("profstream_sink_devices_over_limit_total") == 0
    res = subprocess.run([prometheus_tool("promtool"), "check", "metrics"], input=s.text, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0 and res.stdout + res.stderr == "", res.stdout + res.stderr


def test_throughput_and_mfu_series_are_the_simulators_and_absent_for_a_rank_without_work():
    """The exporter's work series from a simulated run's StepMetrics and RunStepMetrics
    (processors run offline): per-rank throughput, MFU and counters equal the truth of the
    latest step; the run's sums, mean and lowest MFU; per-category FLOP/s of the latest
    captured step; a run without work figures has none of these series (not 0); promtool
    accepts it."""
    from collections import namedtuple

    from profstream.processors.stream import figures
    from tests.helpers import simulated_messages

    Rec = namedtuple("Rec", "topic partition offset timestamp value")
    with_work = SimConfig(run_id="mfu", ranks=2, steps=6, ops_per_step=30, batch_size=4, seq_len=128,
                          variable_tokens=True, flops_per_token=6e8, flops_source="counted", peak_tflops=2.0,
                          capture_every_n_steps=4, straggler_rank=1)
    plain = SimConfig(run_id="plain", ranks=1, steps=3, ops_per_step=30)
    topics = Topics("work")
    state = ExporterState(topics)
    now_ms = time.time_ns() // 10**6
    records = [Rec(topics.steps if f.kind == "steps" else topics.run, 0, i, now_ms, f.value)
               for cfg in (with_work, plain) for i, f in enumerate(figures(simulated_messages(cfg)))
               if f.kind in ("steps", "run")]
    state.handle(records)
    s = Scrape(state.exposition().decode())
    truth = expected(with_work)
    last = with_work.steps - 1
    for rank in range(2):
        w = truth[(rank, last)]["work"]
        labels = {"run": "mfu", "rank": str(rank)}
        assert s("profstream_tokens_per_second", **labels) == w["tokens_per_s"]
        assert s("profstream_samples_per_second", **labels) == w["samples_per_s"]
        assert s("profstream_achieved_flops_per_second", **labels) == w["flops_per_s"]
        assert s("profstream_mfu_ratio", **labels) == w["mfu"]
        assert s("profstream_peak_flops_per_second", **labels) == 2e12
        assert s("profstream_tokens_total", **labels) == sum(truth[(rank, k)]["work"]["tokens"] for k in range(6))
        assert s("profstream_model_flops_total", **labels) == pytest.approx(
            sum(truth[(rank, k)]["work"]["flops"] for k in range(6)))
        captured = truth[(rank, 4)]["work"]["op_categories"]  # every 4th step: 4 is the latest captured
        for category, (_flops, _time, per_s) in captured.items():
            assert s("profstream_op_category_flops_per_second", category=category, **labels) == per_s
    run_mfus = [truth[(r, last)]["work"]["mfu"] for r in range(2)]
    assert s("profstream_run_mfu_ratio", run="mfu") == pytest.approx(sum(run_mfus) / 2)
    assert s("profstream_run_min_mfu_ratio", run="mfu") == min(run_mfus)
    assert s("profstream_run_min_mfu_rank", run="mfu") == 1  # the straggler
    assert s("profstream_run_tokens_per_second", run="mfu") == pytest.approx(
        sum(truth[(r, last)]["work"]["tokens_per_s"] for r in range(2)))
    assert s("profstream_ranks_mfu_ratio", run="mfu", stat="min") == min(run_mfus)
    work_names = {"profstream_tokens_per_second", "profstream_mfu_ratio", "profstream_tokens_total",
                  "profstream_run_mfu_ratio", "profstream_ranks_mfu_ratio", "profstream_op_category_flops_per_second"}
    assert not [x for x in s.samples if x.labels.get("run") == "plain" and x.name in work_names]
    res = subprocess.run([prometheus_tool("promtool"), "check", "metrics"], input=s.text, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout + res.stderr
