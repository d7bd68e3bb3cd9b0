"""The Prometheus deployment files: valid for promtool and amtool, every alert unit-tested,
and every series the rules read actually exported by profstream."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
REQUIRED_ALERTS = {"DataQueueStall", "StepTimeRegression", "RankStraggler", "ProducerDropping",
                   "PipelineLagging", "RunSilent"}


def prometheus_tool(name: str, package: str = "prometheus") -> str:
    """Path of a Prometheus binary; fails the test when it is missing (CI installs it),
    skips it only when PROFSTREAM_SKIP_PROMETHEUS=1 is set."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("PROFSTREAM_SKIP_PROMETHEUS") == "1":
            pytest.skip(f"{name} not installed and PROFSTREAM_SKIP_PROMETHEUS=1")
        pytest.fail(f"{name} not found on PATH: install the Debian package {package} "
                    f"(`apt-get install {package}`, as .ci/run does), or set PROFSTREAM_SKIP_PROMETHEUS=1 "
                    "to skip the tests that need it", pytrace=False)
    return path


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)


def _rules() -> list[dict]:
    doc = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_prometheus_config_and_its_rule_file_pass_promtool():
    res = _run(prometheus_tool("promtool"), "check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in res.stdout


def test_every_alert_of_the_issue_exists_and_tells_the_person_on_call_where_to_look():
    rules = {r["alert"]: r for r in _rules()}
    assert REQUIRED_ALERTS <= set(rules)
    for name, rule in rules.items():
        notes = rule["annotations"]
        assert notes["summary"].strip() and len(notes["description"]) > 100, name
        assert "profstream_" in notes["description"] or "profstream " in notes["description"], name
        assert rule["labels"]["severity"] in ("warning", "critical"), name


def test_alert_rule_unit_tests_pass_and_cover_every_alert():
    res = _run(prometheus_tool("promtool"), "test", "rules", str(PROMETHEUS_DIR / "alerts_test.yml"))
    assert res.returncode == 0, res.stdout + res.stderr
    tests = yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]}
    quiet = {case["alertname"] for t in tests for case in t["alert_rule_test"] if not case["exp_alerts"]}
    every = {r["alert"] for r in _rules()}
    assert fired == every, f"alerts never shown firing in alerts_test.yml: {every - fired}"
    assert quiet == every, f"alerts never shown staying quiet in alerts_test.yml: {every - quiet}"


def _exported_series() -> set[str]:
    """Every series name the exporter and the processor can expose."""
    from profstream.kafka.topics import Topics
    from tests.helpers import connected_exporter, health_of_a_processor

    health = health_of_a_processor()  # a bound processor adds its lag and loop health
    families = list(text_string_to_metric_families(connected_exporter(Topics("t")).exposition().decode()))
    names = set()
    for collector in (SimpleNamespace(collect=lambda: families), health):
        for family in collector.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            names.update(family.name + s for s in suffixes)
    return names


def test_the_rules_read_only_series_that_profstream_exports():
    exported = _exported_series()
    for rule in _rules():
        used = set(re.findall(r"\bprofstream_\w+", rule["expr"]))
        assert used <= exported, f"{rule['alert']} reads series nobody exports: {used - exported}"


def test_alertmanager_example_is_valid_and_pages_only_for_critical_alerts():
    amtool = prometheus_tool("amtool", "prometheus-alertmanager")
    config = str(ROOT / "deploy" / "alertmanager.yml")
    res = _run(amtool, "check-config", config)
    assert res.returncode == 0, res.stdout + res.stderr

    def receiver(*labels: str) -> str:
        out = _run(amtool, "config", "routes", "test", f"--config.file={config}", *labels)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout.strip()

    assert receiver("alertname=RunSilent", "severity=critical", "run=r1") == "ml-oncall-pager"
    # run alerts that ask for an op capture reach the people too
    assert receiver("alertname=DataQueueStall", "severity=warning", "run=r1") == "profstream-capture,ml-team"
    assert receiver("alertname=RankStraggler", "severity=warning", "run=r1") == "profstream-capture,ml-team"
    assert receiver("alertname=PipelineLagging", "severity=warning") == "profstream-operators"
