"""The generated Grafana dashboards: fresh, and querying only what profstream exports.

The metric and label names are taken from the collectors themselves (the Prometheus
exporter fed one record of each kind, the processor health), not from a list kept here.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from profstream.kafka.topics import Topics
from profstream.schema.codec import encode
from tests.helpers import connected_exporter, health_of_a_processor

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
PER_RUN = ("training-run.json", "cluster.json")


def _generator():
    spec = importlib.util.spec_from_file_location("dashboards_generate", DASHBOARDS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(name: str) -> dict:
    return json.loads((DASHBOARDS / name).read_text(encoding="utf-8"))


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", ()))  # collapsed rows hold theirs
    return out


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p.get("targets", ())]


# -- what profstream exports ---------------------------------------------------------------------

Rec = namedtuple("Rec", "topic partition offset timestamp value")


def _exported() -> dict[str, set[str]]:
    """Every sample name profstream serves to Prometheus -> its label names (+ instance, job)."""
    topics = Topics("p")
    now_ns = time.time_ns()
    step = {"run_id": "r", "rank": 0, "world_size": 1, "host": "h", "device": "cpu", "step": 1,
            "start_ns": now_ns - 10**8, "end_ns": now_ns, "step_time_ns": 10**8, "data_wait_ns": 10**7,
            "fp_bp_ns": 8 * 10**7, "tail_ns": 10**7, "compute_ns": 7 * 10**7, "comm_ns": 10**7,
            "overlap_ns": 5 * 10**6, "pure_comm_ns": 5 * 10**6, "idle_ns": 2 * 10**7, "utilization": 0.7,
            "overlap_ratio": 0.5, "op_count": 1, "op_types": [{"op_type": "MatMul", "total_ns": 10**7, "count": 1}],
            "memory": {"peak": 3, "allocated": 2, "reserved": 4},
            "queues": [{"queue": "q", "min": 0, "mean": 1.0, "last": 2, "at_start": 1, "empty_ratio": 0.1}],
            "starved": True, "rolling": None, "closed_by": "watermark", "late_events": 0, "closed_ns": now_ns,
            "host_step_time_ns": 10**8, "device_start_ns": now_ns - 10**8, "device_end_ns": now_ns,
            "kernel_types": [{"op_type": "gemm", "total_ns": 10**7, "count": 1}],
            "device_kinds": [{"kind": "compute", "total_ns": 10**7, "count": 1}], "uncorrelated_ops": 0,
            "devices": [{"device": "cuda:0", "samples": 2, "gpu_util": 0.9, "mem_util": 0.3, "mem_used_peak": 10,
                         "mem_total": 80, "power_w": 300.0, "power_peak_w": 310.0, "power_limit_w": 700.0,
                         "temperature_max_c": 61.0, "sm_clock_mhz": 1980.0, "throttle_reasons": 0x20,
                         "throttled_power": False, "throttled_thermal": True, "pcie_rx": 1e9, "pcie_tx": 2e9,
                         "nvlink_rx": 3e9, "nvlink_tx": 4e9}],
            "work": {"tokens": 4096, "samples": 8, "flops": 1e13, "flops_source": "counted", "peak_flops": 989.5e12,
                     "tokens_per_s": 4e4, "samples_per_s": 80.0, "flops_per_s": 1e14, "mfu": 0.1,
                     "op_categories": [{"category": "matmul", "flops": 9e12, "time_ns": 5 * 10**7,
                                        "flops_per_s": 1.8e14}]},
            "resources": {"readings": 1, "cpu_user": 0.4, "cpu_system": 0.05, "cpu_iowait": 0.01, "cpu_idle": 0.54,
                          "process_cpu": 1.1, "rss_bytes": 3 << 30, "loader_readings": 2, "workers": 2,
                          "worker_cpu_mean": 0.9, "worker_cpu_max": 0.95, "worker_runnable_mean": 0.97,
                          "worker_runnable_max": 1.0, "worker_batches": 4, "worker_s_per_batch": 0.5,
                          "worker_cpu_s_per_batch": 0.45, "ctx_switches_per_s": 4000.0, "cpu_count": 8,
                          "per_worker": [{"worker": w, "readings": 1, "batches": 2, "s_per_batch": 0.5,
                                          "cpu_s_per_batch": 0.45} for w in range(2)]},
            "advice": [{"rule": "more_workers", "text": "raise num_workers", "source": "MindSpore",
                        "figures": {"workers_busy": 0.97}}]}
    run = {"run_id": "r", "step": 1, "ranks_reported": 1, "min_step_time_ns": 10**8, "median_step_time_ns": 1e8,
           "max_step_time_ns": 10**8, "skew": 0.0, "straggler_rank": 0, "step_times_ns": {"0": 10**8},
           "collectives_matched": 1, "late_rank": 0, "late_rank_held_ns": 10,
           "collective_ranks": [{"rank": 0, "wait_ns": 1, "transfer_ns": 2, "slowest_collective": "all_reduce",
                                 "slowest_ns": 3}],
           "by_collective": [{"collective": "all_reduce", "calls": 1, "bytes": 8, "transfer_ns": 2,
                              "algbw_bytes_per_s": 4e9, "busbw_bytes_per_s": 4e9}],
           "unmatched_collectives": [{"collective": "all_reduce", "group": "0", "seq": 2, "arrived": [0],
                                      "missing": [1], "expected": 2}],
           "work": {"ranks": 1, "tokens_per_s": 4e4, "samples_per_s": 80.0, "flops_per_s": 1e14, "mean_mfu": 0.1,
                    "min_mfu": 0.1, "min_mfu_rank": 0, "mfu_ranks": 1}}
    alert = {"name": "DataQueueStall", "state": "firing", "run_id": "r", "rank": 0, "step": 1, "ts_ns": now_ns,
             "summary": "s", "evidence": {}}
    exporter = connected_exporter(topics)
    exporter.handle([Rec(topics.steps, 0, 0, now_ns // 10**6, encode("StepMetrics", step)),
                     Rec(topics.run, 0, 0, now_ns // 10**6, encode("RunStepMetrics", run)),
                     Rec(topics.alerts, 0, 0, now_ns // 10**6, encode("Alert", alert))])
    stage = SimpleNamespace(open_runs=1, open_events=0,
                            ranks={("r", 0): SimpleNamespace(buffer_fill_ratio=0.1, send_latency_s=0.01)})
    health = health_of_a_processor(stage)
    health_registry = CollectorRegistry(auto_describe=False)
    health_registry.register(health)
    names: dict[str, set[str]] = {}
    for text in (exporter.exposition().decode(), generate_latest(health_registry).decode()):
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                names.setdefault(sample.name, {"instance", "job"}).update(sample.labels)
    return names


EXPORTED = _exported()
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset"}


def _metric_names(expr: str) -> set[str]:
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # range selectors
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    out = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if m.group() in _KEYWORDS or e[m.end():].lstrip().startswith("("):
            continue  # an operator, or a function or aggregation called
        out.add(m.group())
    return out


def _selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, label names matched) of every selector with a {...}."""
    return [(m.group(1), set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", m.group(2))))
            for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}", expr)]


def test_the_metric_name_extraction_finds_metrics_and_skips_functions_labels_and_ranges():
    expr = ('histogram_quantile(0.95, sum by (le, rank) (rate(profstream_a_bucket{run="$run", rank=~"$rank"}'
            '[$__rate_interval]))) / on(run) group_left max(profstream_b) - profstream_c offset 5m')
    assert _metric_names(expr) == {"profstream_a_bucket", "profstream_b", "profstream_c"}
    assert _selectors(expr) == [("profstream_a_bucket", {"run", "rank"})]
    assert "profstream_step_duration_seconds" in EXPORTED and "profstream_events_total" in EXPORTED


# -- the tests ------------------------------------------------------------------------------

def test_the_committed_dashboards_are_exactly_what_the_generator_makes():
    generator = _generator()
    stale = generator.stale(DASHBOARDS)
    assert stale == [], f"{stale} differ from dashboards/generate.py: run `make dashboards` and commit them"
    assert sorted(p.name for p in DASHBOARDS.glob("*.json")) == sorted(generator.DASHBOARDS), \
        "a dashboards/*.json file that the generator does not make would be provisioned too"


def test_the_generator_check_mode_fails_on_a_stale_file(tmp_path):
    generator = _generator()
    generator.write(tmp_path)
    assert generator.main(["--check", "--out", str(tmp_path)]) == 0
    path = tmp_path / "cluster.json"
    path.write_text(path.read_text().replace("Rank skew", "Rank skew (hand-edited)"))
    assert generator.main(["--check", "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("name", ["training-run.json", "cluster.json", "pipeline-health.json"])
def test_every_query_uses_only_metrics_and_labels_profstream_exports(name):
    dashboard = _load(name)
    exprs = _exprs(dashboard)
    assert exprs, "a dashboard without queries"
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+)(\{[^}]*\})?,\s*(\w+)\)", var["query"])
            assert m, f"variable {var['name']}: unexpected query {var['query']!r}"
            assert m.group(1) in EXPORTED and m.group(3) in EXPORTED[m.group(1)], var["query"]
            exprs.append(f"{m.group(1)}{m.group(2) or ''}")
    for expr in exprs:
        names = _metric_names(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - set(EXPORTED)
        assert not unknown, f"{name}: {expr!r} uses {unknown}, which profstream does not export"
        for metric, labels in _selectors(expr):
            assert labels <= EXPORTED[metric], f"{name}: {expr!r}: {metric} has no label {labels - EXPORTED[metric]}"
        for labels in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            have = set.union(*(EXPORTED[n] for n in names))
            assert {s.strip() for s in labels.split(",")} <= have | {"le"}, expr


def test_the_label_values_asked_for_are_the_ones_exported():
    exprs = "\n".join(e for n in PER_RUN for e in _exprs(_load(n)))
    assert set(re.findall(r'phase="(\w+)"', exprs)) <= {"data_wait", "fp_bp", "tail"}
    assert set(re.findall(r'kind="(\w+)"', exprs)) <= {"allocated", "reserved", "peak"}


@pytest.mark.parametrize("name", PER_RUN)
def test_per_run_dashboards_have_run_and_rank_variables_and_every_query_is_filtered_by_run(name):
    dashboard = _load(name)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "run", "rank"} <= set(variables)
    assert variables["run"]["query"] == "label_values(profstream_last_step, run)"
    assert not variables["run"].get("multi")  # one run at a time: the annotations follow it
    rank = variables["rank"]
    assert rank["multi"] and rank["includeAll"] and rank["allValue"] == ".*"
    assert '$run' in rank["query"]  # the ranks of the chosen run
    for expr in _exprs(dashboard):
        assert 'run="$run"' in expr, f"{name}: {expr!r} is not filtered by the run variable"
    if name == "training-run.json":
        assert all('rank=~"$rank"' in e for e in _exprs(dashboard))


@pytest.mark.parametrize("name", ["training-run.json", "cluster.json", "pipeline-health.json"])
def test_every_panel_queries_prometheus_through_the_datasource_variable(name):
    dashboard = _load(name)
    assert dashboard["uid"].startswith("profstream-") and "profstream" in dashboard["tags"]
    (ds,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_the_training_run_dashboard_has_the_promised_panels_and_annotations():
    dashboard = _load("training-run.json")
    exprs = "\n".join(_exprs(dashboard))
    for metric in ("profstream_step_duration_seconds", "profstream_step_phase_seconds",
                   "profstream_device_utilization_ratio", "profstream_comm_overlap_ratio", "profstream_memory_bytes",
                   "profstream_queue_size", "profstream_starved_steps_total", "profstream_op_type_seconds_total",
                   "profstream_device_gpu_utilization_ratio", "profstream_device_power_watts",
                   "profstream_device_temperature_celsius", "profstream_device_throttled",
                   "profstream_device_memory_used_bytes", "profstream_device_nvlink_bytes_per_second"):
        assert metric in exprs, metric
    stacked = [p for p in _panels(dashboard) if p["title"].startswith("Step phases")]
    assert stacked and stacked[0]["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    queues = next(p for p in _panels(dashboard) if p["title"].startswith("Queue sizes"))
    assert any("starved_steps_total" in t["expr"] for t in queues["targets"])  # the shaded series
    tags = [a["target"]["tags"] for a in dashboard["annotations"]["list"]]
    assert ["profstream", "alert", "run:$run"] in tags and ["profstream", "run", "run:$run"] in tags


def test_the_utilization_stat_shows_the_measured_figure_and_nvml_labelled_never_a_0_of_its_own():
    """With ops captured every N steps the stat read 0 between captures; the exporter now has
    no sample for what was not measured, and the stat shows NVML's reading beside it, named."""
    stat = next(p for p in _panels(_load("training-run.json")) if p["title"].startswith("Device utilization (mean"))
    legends = {t["legendFormat"]: t["expr"] for t in stat["targets"]}
    assert set(legends) == {"ops", "NVML"}
    assert "profstream_device_utilization_ratio" in legends["ops"] and "or" not in legends["ops"].split()  # no fill
    assert "profstream_device_gpu_utilization_ratio" in legends["NVML"]
    assert "never 0" in stat["description"]


def test_the_cluster_and_pipeline_dashboards_show_what_they_promise():
    cluster = "\n".join(_exprs(_load("cluster.json")))
    for metric in ("profstream_rank_skew_ratio", "profstream_straggler_rank", "profstream_step_duration_seconds"):
        assert metric in cluster
    assert any(p["type"] == "heatmap" for p in _panels(_load("cluster.json")))
    pipeline = "\n".join(_exprs(_load("pipeline-health.json")))
    for metric in ("profstream_events_total", "profstream_consumer_lag_messages", "profstream_producer_dropped_total",
                   "profstream_decode_errors_total", "profstream_step_freshness_seconds_bucket"):
        assert metric in pipeline


def test_the_cluster_dashboard_shows_every_rank_as_a_heat_map_and_the_slowest_as_a_top_k():
    """At 1,024 ranks: all ranks through the exporter's per-run figures (a heat map of the
    ranks' step-time histogram, quantiles), the slowest through topk, never a line per rank."""
    from profstream.sinks.rank_summary import STATS

    panels = [p for p in _panels(_load("cluster.json")) if p["type"] != "row"]
    every_rank = [t for p in panels if p["type"] == "heatmap" for t in p["targets"]
                  if "profstream_ranks_step_duration_seconds_hist_bucket" in t["expr"]]
    assert every_rank and every_rank[0]["format"] == "heatmap" and every_rank[0]["legendFormat"] == "{{le}}"
    assert any(p["type"] == "bargauge" and re.search(r"topk\(\d+, profstream_step_duration_seconds\{", t["expr"])
               for p in panels for t in p["targets"])
    spread = "\n".join(_exprs(_load("cluster.json")))
    asked = set(re.findall(r'stat="(\w+)"', spread))
    assert {"p50", "p95", "max"} <= asked <= {label for _, label in STATS}
    for panel in panels:
        if panel["type"] not in ("timeseries", "bargauge"):
            continue
        for target in panel["targets"]:
            expr = target["expr"]
            if any("rank" in EXPORTED[name] for name in _metric_names(expr)):
                bounded = re.search(r"\b(topk|bottomk)\s*\(", expr) or (
                    re.match(r"\s*(sum|avg|max|min|quantile|count)\b", expr) and "rank" not in expr.split("(")[0])
                assert bounded, f"{panel['title']}: {expr!r} draws one line per rank"
