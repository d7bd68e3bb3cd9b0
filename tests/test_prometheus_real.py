"""A real Prometheus server (the Debian binary) scraping the exporter and a processor with
the project's alert rules: the stored step figures are the simulator's, DataQueueStall
goes pending then firing on a stalled run, and nothing fires on a clean one."""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from profstream.simulate import SimConfig, expected, run_simulation
from profstream.sinks.prometheus import start_exporter
from tests.helpers import wait_until
from tests.test_alert_rules import PROMETHEUS_DIR, prometheus_tool
from tests.test_processor import RunningProcessor

FOR = "2s"  # every rule's `for:` in the test copy of alerts.yml
INTERVAL = "200ms"  # rule evaluation
# Scrapes every 500 ms, each given all of it: a scrape that times out marks the series stale,
# and an alert then starts again from pending (at 200 ms a loaded CI box flapped one so).
SCRAPE = "500ms"
# ranges of the test copy's rules that compare a recent window with a baseline, shortened
# so that a run of seconds has both
SHORT_WINDOWS = {"MFURegression": {"[10m]": "[3s]", "[2h]": "[1m]"}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus server on a free loopback port with a temporary storage directory."""

    def __init__(self, tmp: Path, targets: dict[str, int], scrape_configs: list[dict] | None = None) -> None:
        rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
        for group in rules["groups"]:
            for rule in group["rules"]:
                rule["for"] = FOR
                for long, short in SHORT_WINDOWS.get(rule.get("alert"), {}).items():
                    rule["expr"] = rule["expr"].replace(long, short)
        (tmp / "alerts.yml").write_text(yaml.safe_dump(rules))
        config = {
            "global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE, "evaluation_interval": INTERVAL},
            "rule_files": ["alerts.yml"],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                               for job, port in targets.items()] + (scrape_configs or []),
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = _free_port()
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [prometheus_tool("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"], stdout=self.log, stderr=subprocess.STDOUT)
        self.log_path = tmp / "prometheus.log"

    def api(self, path: str, **params: str):
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        body = json.loads(urllib.request.urlopen(url, timeout=5).read())
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited ({self.proc.returncode}): {self.log_path.read_text()[-2000:]}")
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def query(self, expr: str) -> dict[tuple, float]:
        """Instant query: {(labels without job/instance, sorted): value}."""
        out = {}
        for r in self.api("query", query=expr)["result"]:
            labels = tuple(sorted((k, v) for k, v in r["metric"].items() if k not in ("job", "instance")))
            out[labels] = float(r["value"][1])
        return out

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


@pytest.fixture
def prometheus_binary() -> str:
    return prometheus_tool("prometheus")


@pytest.fixture
def stack(kafka_bootstrap, topics, tmp_path, prometheus_binary) -> Iterator[Prometheus]:
    """Processor (health served) + exporter + Prometheus scraping both with the test rules."""
    health_port = _free_port()
    with RunningProcessor(kafka_bootstrap, topics) as processor:
        processor.health.serve(health_port, addr="127.0.0.1")
        url, stop_exporter = start_exporter(kafka_bootstrap, topics, port=0, addr="127.0.0.1",
                                            group_id=f"prom-{topics.prefix}")
        exporter_port = int(url.rsplit(":", 1)[1].split("/")[0])
        prom = Prometheus(tmp_path, {"profstream-exporter": exporter_port, "profstream-processor": health_port})
        try:
            wait_until(prom.ready, 30, "prometheus to be ready")
            wait_until(lambda: len(prom.api("query", query="up == 1")["result"]) == 2, 30, "both targets up")
            yield prom
        finally:
            prom.stop()
            stop_exporter()


def test_prometheus_stores_the_simulators_figures_and_fires_data_queue_stall_only_on_the_stalled_run(
        kafka_bootstrap, topics, stack):
    prom = stack
    clean = SimConfig(run_id="clean", ranks=2, steps=20, ops_per_step=40, seed=7)
    stalled = SimConfig(run_id="stalled", ranks=2, steps=30, ops_per_step=40, stall=(10, 29), seed=8)
    for cfg in (clean, stalled):  # the clean run first: its series are the older ones
        run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})

    # DataQueueStall: pending for `for:`, then firing, for each stalled rank
    seen: dict[str, list[str]] = {"0": [], "1": []}

    def stall_firing():
        for a in prom.alerts():
            labels = a["labels"]
            if labels["alertname"] == "DataQueueStall" and labels.get("run") == "stalled":
                states = seen[labels["rank"]]
                if not states or states[-1] != a["state"]:
                    states.append(a["state"])
        return all(s and s[-1] == "firing" for s in seen.values())

    wait_until(stall_firing, 60, f"DataQueueStall firing for both stalled ranks (states seen: {seen})")
    assert seen == {"0": ["pending", "firing"], "1": ["pending", "firing"]}

    # what Prometheus stored is the simulator's truth
    for cfg in (clean, stalled):
        last, truth = cfg.steps - 1, expected(cfg)
        run = f'run="{cfg.run_id}"'
        wait_until(lambda run=run, last=last: set(prom.query(f"profstream_last_step{{{run}}}").values())
                   == {float(last)}, 30,
                   f"the last step of {cfg.run_id} in Prometheus")
        durations = prom.query(f"profstream_step_duration_seconds{{{run}}}")
        assert {dict(k)["rank"]: v for k, v in durations.items()} == {
            str(r): truth[(r, last)]["step_time_ns"] / 1e9 for r in range(cfg.ranks)}
        waits = prom.query(f'profstream_step_phase_seconds{{{run},phase="data_wait"}}')
        assert {dict(k)["rank"]: v for k, v in waits.items()} == {
            str(r): truth[(r, last)]["data_wait_ns"] / 1e9 for r in range(cfg.ranks)}
        counts = prom.query(f"profstream_step_duration_seconds_hist_count{{{run}}}")
        assert set(counts.values()) == {float(cfg.steps)} and len(counts) == cfg.ranks
        starved = prom.query(f"profstream_starved_steps_total{{{run}}}")
        assert set(starved.values()) == {20.0 if cfg.stall else 0.0}
        assert set(prom.query(f"profstream_data_stall{{{run}}}").values()) == {1.0 if cfg.stall else 0.0}

    # By now the clean run's series have been evaluated for longer than `for:`: nothing
    # but the stalled run's DataQueueStall is pending or firing.
    active = sorted((a["labels"]["alertname"], a["labels"].get("run"), a["state"]) for a in prom.alerts())
    assert active == [("DataQueueStall", "stalled", "firing")] * 2
    assert prom.query('ALERTS{run="clean"}') == {}


def test_mfu_regression_fires_on_the_run_whose_steps_slow_down_and_not_on_a_steady_one(
        kafka_bootstrap, topics, stack):
    """Two simulated runs with known FLOPs per step, in real time: one whose steps take twice
    as long from step 240 on (the same work: MFU halves), one steady. MFURegression (its
    windows shortened to 3 s against 1 min) goes pending then firing for the first only, and
    Prometheus holds the simulator's MFU."""
    import threading

    prom = stack
    common = dict(ranks=2, steps=400, ops_per_step=12, step_time_ms=50.0, rate="realtime", batch_size=4,
                  seq_len=256, flops_per_token=6 * 124e6, peak_tflops=1.0)
    slowed = SimConfig(run_id="slowed", seed=3, slowdown=(240, 399), **common)
    steady = SimConfig(run_id="steady", seed=4, **common)
    errors: list[BaseException] = []

    def simulate(cfg: SimConfig) -> None:
        try:
            run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=simulate, args=(cfg,)) for cfg in (slowed, steady)]
    for t in threads:
        t.start()
    states: list[str] = []

    def firing() -> bool:
        assert not errors, errors
        for a in prom.alerts():
            if a["labels"]["alertname"] == "MFURegression":
                assert a["labels"]["run"] == "slowed", a
                if not states or states[-1] != a["state"]:
                    states.append(a["state"])
        return bool(states) and states[-1] == "firing"

    try:
        wait_until(firing, 90, f"MFURegression firing for the slowed run (states seen: {states})")
    finally:
        for t in threads:
            t.join(120)
    assert states == ["pending", "firing"] and not errors
    for cfg in (slowed, steady):
        truth, last = expected(cfg), cfg.steps - 1
        run = f'run="{cfg.run_id}"'
        wait_until(lambda run=run, last=last: set(prom.query(f"profstream_last_step{{{run}}}").values())
                   == {float(last)}, 30, f"the last step of {cfg.run_id} in Prometheus")
        mfu = prom.query(f"profstream_mfu_ratio{{{run}}}")
        assert {dict(k)["rank"]: v for k, v in mfu.items()} == {
            str(r): truth[(r, last)]["work"]["mfu"] for r in range(cfg.ranks)}
        tokens = prom.query(f"profstream_tokens_total{{{run}}}")
        assert set(tokens.values()) == {float(cfg.steps * 4 * 256)}
    assert not any(a["labels"].get("run") == "steady" for a in prom.alerts())
