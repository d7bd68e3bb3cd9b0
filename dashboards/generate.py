"""Generate profstream's Grafana dashboards (dashboards/*.json) with grafana-foundation-sdk.

    python dashboards/generate.py            # (re)write dashboards/*.json
    python dashboards/generate.py --check    # exit 1 when a committed file differs

The JSON files are what Grafana loads (provisioning, `profstream grafana push`); this
script is their source. Edit here, run `make dashboards`, commit both.

Every panel queries Prometheus through the ``datasource`` variable, so the dashboards work
with whatever Prometheus data source a Grafana has (the provisioned one is the default).
Metric names are those of the Prometheus exporter (profstream/sinks/prometheus.py) and of
the processors' health (profstream/processors/health.py); tests/test_dashboards.py holds
every query to them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, heatmap, stat, statetimeline, timeseries
from grafana_foundation_sdk.builders.common import (
    ReduceDataOptions,
    StackingConfig,
    VizLegendOptions,
    VizTooltipOptions,
)
from grafana_foundation_sdk.builders.dashboard import (
    AnnotationQuery,
    AnnotationTarget,
    Dashboard,
    DashboardLink,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.builders.heatmap import (
    CellValues,
    HeatmapColorOptions,
    RowsHeatmapOptions,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery as PromQuery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    AxisPlacement,
    BarGaugeDisplayMode,
    BigValueGraphMode,
    HeatmapCellLayout,
    LegendDisplayMode,
    LegendPlacement,
    LineInterpolation,
    SortOrder,
    StackingMode,
    TooltipDisplayMode,
    VizOrientation,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    DynamicConfigValue,
    Threshold,
    ThresholdsMode,
    ValueMap,
    ValueMappingResult,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.heatmap import HeatmapColorMode, HeatmapColorScale
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

HERE = Path(__file__).resolve().parent
TAG = "profstream"
PROMETHEUS = DataSourceRef(type_val="prometheus", uid="${datasource}")
# Grafana's own annotation store ("-- Grafana --"), where `profstream sink grafana` posts.
GRAFANA_ANNOTATIONS = DataSourceRef(type_val="datasource", uid="grafana")

RUN = 'run="$run"'
LAST = ReduceDataOptions().calcs(["lastNotNull"])
RUN_RANK = 'run="$run", rank=~"$rank"'
TOP_RANKS = 10  # ranks a Cluster top-K panel shows


# -- building blocks ----------------------------------------------------------------------

def prom(expr: str, legend: str = "__auto", ref: str = "A") -> PromQuery:
    return PromQuery().expr(expr).legend_format(legend).ref_id(ref).datasource(PROMETHEUS)


def series(title: str, description: str, unit: str, *queries: PromQuery, width: int = 12,
           height: int = 8) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit).span(width).height(height)
             .datasource(PROMETHEUS)
             .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
                     .show_legend(True))
             .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)))
    for q in queries:
        panel = panel.with_target(q)
    return panel


def ratio_series(title: str, description: str, *queries: PromQuery, width: int = 12) -> timeseries.Panel:
    return series(title, description, "percentunit", *queries, width=width).min(0).max(1)


def single(title: str, description: str, unit: str, *queries: PromQuery, width: int = 4) -> stat.Panel:
    panel = (stat.Panel().title(title).description(description).unit(unit).span(width).height(4)
             .datasource(PROMETHEUS).graph_mode(BigValueGraphMode.AREA).reduce_options(LAST))
    for q in queries:
        panel = panel.with_target(q)
    return panel


def thresholds(*steps: tuple[float | None, str]) -> ThresholdsConfig:
    return ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(
        [Threshold(value=v, color=c) for v, c in steps])


def datasource_variable() -> DatasourceVariable:
    return DatasourceVariable("datasource").label("Data source").type("prometheus")


def run_variable() -> QueryVariable:
    return (QueryVariable("run").label("Run").datasource(PROMETHEUS)
            .query("label_values(profstream_last_step, run)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_DESC))


def rank_variable() -> QueryVariable:
    return (QueryVariable("rank").label("Rank").datasource(PROMETHEUS)
            .query('label_values(profstream_last_step{run="$run"}, rank)')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.NUMERICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


def tag_annotations(name: str, color: str, tags: list[str]) -> AnnotationQuery:
    """Annotations from Grafana's store carrying all of ``tags`` (posted by the Grafana sink)."""
    return (AnnotationQuery().name(name).datasource(GRAFANA_ANNOTATIONS).enable(True).icon_color(color)
            .target(AnnotationTarget().type("tags").tags(tags).match_any(False).limit(200)))


def dashboard(uid: str, title: str, description: str) -> Dashboard:
    return (Dashboard(title).uid(uid).description(description).tags([TAG]).editable()
            .time("now-30m", "now").refresh("5s").timezone("browser")
            .tooltip(DashboardCursorSync.CROSSHAIR)
            .link(DashboardLink("profstream").type(DashboardLinkType.DASHBOARDS).tags([TAG])
                  .as_dropdown(True).include_vars(True).keep_time(True)))


def _hidden_axis_override(min_: float = 0, max_: float = 1) -> list[DynamicConfigValue]:
    return [DynamicConfigValue(id_val="custom.axisPlacement", value=AxisPlacement.HIDDEN),
            DynamicConfigValue(id_val="min", value=min_), DynamicConfigValue(id_val="max", value=max_),
            DynamicConfigValue(id_val="custom.fillOpacity", value=25),
            DynamicConfigValue(id_val="custom.lineWidth", value=0),
            DynamicConfigValue(id_val="custom.lineInterpolation", value=LineInterpolation.STEP_AFTER),
            DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "red"})]


# -- Training run -------------------------------------------------------------------------

def training_run() -> Dashboard:
    return (
        dashboard("profstream-training-run", "profstream / Training run",
                  "Per-step figures of one run, per rank: step time and its phases, throughput and MFU, device "
                  "utilization and overlap, memory, data queues, top op types. Annotations: run start/end, alerts and op "
                  "captures (linking their timeline files).")
        .with_variable(datasource_variable()).with_variable(run_variable()).with_variable(rank_variable())
        .annotation(tag_annotations("Alerts", "red", [TAG, "alert", "run:$run"]))
        .annotation(tag_annotations("Run start and end", "blue", [TAG, "run", "run:$run"]))
        .annotation(tag_annotations("Op captures", "purple", [TAG, "capture", "run:$run"]))
        .with_row(Row("Step time"))
        .with_panel(single("Last step", "highest step closed by the processors", "none",
                           prom(f"max(profstream_last_step{{{RUN_RANK}}})", "last step"), width=4))
        .with_panel(single("Step time (mean of ranks)", "latest step time, mean over the selected ranks", "s",
                           prom(f"avg(profstream_step_duration_seconds{{{RUN_RANK}}})", "step time"), width=4))
        .with_panel(single("Starved steps", "steps in the time range whose data queue was empty at the start "
                           "or whose data wait was at least stall_ratio of the step", "none",
                           prom(f"sum(increase(profstream_starved_steps_total{{{RUN_RANK}}}[$__range]))",
                                "starved steps"), width=4)
                    .thresholds(thresholds((None, "green"), (1, "orange"), (5, "red"))))
        .with_panel(single("Device utilization (mean of ranks)", "ops: compute time / step time of each rank's "
                           "latest step whose ops were captured (no value, never 0, before one was); NVML: the share "
                           "of time a kernel ran, read by the device counters without op capture", "percentunit",
                           prom(f"avg(profstream_device_utilization_ratio{{{RUN_RANK}}})", "ops"),
                           prom(f"avg(profstream_device_gpu_utilization_ratio{{{RUN_RANK}}})", "NVML", "B"),
                           width=4).min(0).max(1))
        .with_panel(single("Compute/comm overlap (mean of ranks)", "share of communication hidden behind "
                           "compute", "percentunit",
                           prom(f"avg(profstream_comm_overlap_ratio{{{RUN_RANK}}})", "overlap"), width=4)
                    .min(0).max(1))
        .with_panel(single("Data stall", "ranks whose DataQueueStall alert is firing", "none",
                           prom(f"sum(profstream_data_stall{{{RUN_RANK}}})", "stalled ranks"), width=4)
                    .thresholds(thresholds((None, "green"), (1, "red"))))
        .with_panel(series("Step time per rank", "E - S of the latest closed step; dashed: p95 of every step "
                           "in the last 5 min (from the step-time histogram)", "s",
                           prom(f"profstream_step_duration_seconds{{{RUN_RANK}}}", "rank {{rank}}"),
                           prom("histogram_quantile(0.95, sum by (le, rank) (rate("
                                f"profstream_step_duration_seconds_hist_bucket{{{RUN_RANK}}}[5m])))",
                                "p95 5m rank {{rank}}", "B"))
                    .override_by_query("B", [DynamicConfigValue(id_val="custom.lineStyle",
                                                                value={"fill": "dash", "dash": [10, 10]})]))
        .with_panel(series("Step phases (stacked, mean of ranks)",
                           "data_wait = F - S (waiting for input), fp_bp = B - F (forward and backward), "
                           "tail = E - B (optimizer, unhidden sync)", "s",
                           prom(f"avg by (phase) (profstream_step_phase_seconds{{{RUN_RANK}}})", "{{phase}}"))
                    .stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(40))
        .with_row(Row("Throughput"))
        .with_panel(single("Tokens/s (sum of ranks)", "tokens / step time of each rank's latest step with work "
                           "figures, summed over the selected ranks (no value, never 0, where the producers send "
                           "none)", "short",
                           prom(f"sum(profstream_tokens_per_second{{{RUN_RANK}}})", "tokens/s"), width=4))
        .with_panel(single("Samples/s (sum of ranks)", "samples / step time, summed over the selected ranks",
                           "short", prom(f"sum(profstream_samples_per_second{{{RUN_RANK}}})", "samples/s"),
                           width=4))
        .with_panel(single("Achieved FLOP/s (sum of ranks)", "model FLOPs / step time, summed over the selected "
                           "ranks", "flops",
                           prom(f"sum(profstream_achieved_flops_per_second{{{RUN_RANK}}})", "achieved"),
                           width=4))
        .with_panel(single("MFU (mean of ranks)", "model FLOPs utilization: FLOPs / (step time x the device's "
                           "dense peak FLOP/s); no value where the peak is unknown (set peak_tflops)",
                           "percentunit", prom(f"avg(profstream_mfu_ratio{{{RUN_RANK}}})", "MFU"), width=4)
                    .min(0).max(1))
        .with_panel(single("Lowest MFU", "the lowest MFU among the selected ranks", "percentunit",
                           prom(f"min(profstream_mfu_ratio{{{RUN_RANK}}})", "lowest"), width=4).min(0).max(1))
        .with_panel(single("Peak FLOP/s (per device)", "the dense peak MFU divides by: profstream's table for "
                           "the device and dtype, or peak_tflops", "flops",
                           prom(f"max(profstream_peak_flops_per_second{{{RUN_RANK}}})", "peak"), width=4))
        .with_panel(series("Tokens/s per rank", "tokens / step time of each rank's latest step with work figures; "
                           "dashed: the rate of its token counter over 1 min", "short",
                           prom(f"profstream_tokens_per_second{{{RUN_RANK}}}", "rank {{rank}}"),
                           prom(f"rate(profstream_tokens_total{{{RUN_RANK}}}[1m])", "1m rank {{rank}}", "B"),
                           width=8)
                    .override_by_query("B", [DynamicConfigValue(id_val="custom.lineStyle",
                                                                value={"fill": "dash", "dash": [10, 10]})]))
        .with_panel(ratio_series("MFU per rank", "model FLOPs utilization of each rank's latest step with one "
                                 "(MFURegression fires when the run's falls 20% below its 2-hour median)",
                                 prom(f"profstream_mfu_ratio{{{RUN_RANK}}}", "rank {{rank}}"), width=8))
        .with_panel(series("Achieved FLOP/s by op category", "matmul, attention, conv: the category's FLOPs / "
                           "the time of its ops, in the latest step whose ops were captured", "flops",
                           prom(f"profstream_op_category_flops_per_second{{{RUN_RANK}}}",
                                "rank {{rank}} {{category}}"), width=8))
        .with_row(Row("Device"))
        .with_panel(ratio_series("Device utilization and idle",
                                 "utilization = |compute| / step time; idle = share of the step with neither "
                                 "compute nor communication; of each rank's latest step whose ops were captured "
                                 "(steps without captured ops are not measured: no point, never 0)",
                                 prom(f"profstream_device_utilization_ratio{{{RUN_RANK}}}", "util rank {{rank}}"),
                                 prom(f"profstream_idle_ratio{{{RUN_RANK}}}", "idle rank {{rank}}", "B"), width=8))
        .with_panel(ratio_series("Compute/communication overlap",
                                 "|compute ∩ comm| / |comm|: 1 = communication fully hidden (0 without comm)",
                                 prom(f"profstream_comm_overlap_ratio{{{RUN_RANK}}}", "rank {{rank}}"), width=8))
        .with_panel(series("Device memory", "allocated and reserved at the step end, peak in the step", "bytes",
                           prom(f"profstream_memory_bytes{{{RUN_RANK}}}", "rank {{rank}} {{kind}}"), width=8))
        .with_row(Row("Data queues"))
        .with_panel(series("Queue sizes (starved steps shaded)",
                           "size of each data queue at the step end; red bands: steps that were starved", "none",
                           prom(f"profstream_queue_size{{{RUN_RANK}}}", "rank {{rank}} {{queue}}"),
                           prom(f"clamp_max(sum by (rank) (increase(profstream_starved_steps_total{{{RUN_RANK}}}"
                                "[$__rate_interval])), 1)", "starved rank {{rank}}", "B"), width=12)
                    .override_by_query("B", _hidden_axis_override()))
        .with_panel(ratio_series("Queue empty ratio", "share of a step's queue samples at 0",
                                 prom(f"profstream_queue_empty_ratio{{{RUN_RANK}}}", "rank {{rank}} {{queue}}"),
                                 width=6))
        .with_panel(statetimeline.Panel().title("DataQueueStall").span(6).height(8).datasource(PROMETHEUS)
                    .description("firing after 5 consecutive starved steps, resolved after 5 healthy ones")
                    .with_target(prom(f"profstream_data_stall{{{RUN_RANK}}}", "rank {{rank}}"))
                    .mappings([ValueMap(options={"0": ValueMappingResult(text="ok", color="green"),
                                                 "1": ValueMappingResult(text="stalled", color="red")})]))
        .with_row(Row("Host and data loader"))
        .with_panel(ratio_series("Machine CPU", "the machine's CPU time by mode (user, system, iowait), share of all its "
                                 "CPUs, over each rank's latest step with host readings (one a second)",
                                 prom(f"profstream_host_cpu_ratio{{{RUN_RANK}, mode!=\"idle\"}}",
                                      "rank {{rank}} {{mode}}"), width=8))
        .with_panel(ratio_series("Loader workers: busy and CPU", "busy: share of the time a DataLoader worker ran or "
                                 "waited to run (near 1: computing; low: waiting for reads); CPU: its CPU time, of one "
                                 "core; mean over the workers",
                                 prom(f'profstream_loader_worker_runnable_ratio{{{RUN_RANK}, stat="mean"}}',
                                      "busy rank {{rank}}"),
                                 prom(f'profstream_loader_worker_cpu_ratio{{{RUN_RANK}, stat="mean"}}',
                                      "CPU rank {{rank}}", "B"), width=8))
        .with_panel(series("Seconds a batch (per worker)", "seconds each DataLoader worker takes to make a batch "
                           "(none for a worker without a batch counted in the rank's latest step with readings), "
                           "and all the workers pooled", "s",
                           prom(f"profstream_loader_worker_seconds_per_batch{{{RUN_RANK}}}",
                                "rank {{rank}} worker {{worker}}"),
                           prom(f"profstream_loader_seconds_per_batch{{{RUN_RANK}}}", "rank {{rank}} all workers", "B"),
                           width=8))
        .with_panel(series("Context switches", "the machine's context switches per second", "short",
                           prom(f"profstream_context_switches_per_second{{{RUN_RANK}}}", "rank {{rank}}"), width=12))
        .with_panel(statetimeline.Panel().title("Advice").span(12).height(8).datasource(PROMETHEUS)
                    .description("what the rank's figures say to do about its latest starved step or long tail "
                                 "(profstream advise --run prints the lines with their figures): threads, transfer, "
                                 "more_workers, input_io, tail_allreduce")
                    .with_target(prom(f"profstream_advice{{{RUN_RANK}}}", "rank {{rank}} {{rule}}"))
                    .mappings([ValueMap(options={"1": ValueMappingResult(text="advised", color="orange")})]))
        .with_row(Row("Operators"))
        .with_panel(bargauge.Panel().title("Top op types (device time in range)").span(12).height(9)
                    .description("summed op time by op type over the time range; top K per step + other")
                    .datasource(PROMETHEUS).unit("s").orientation(VizOrientation.HORIZONTAL)
                    .display_mode(BarGaugeDisplayMode.GRADIENT).reduce_options(LAST)
                    .with_target(prom("topk(10, sum by (op_type) (increase(profstream_op_type_seconds_total"
                                      f"{{{RUN_RANK}}}[$__range])))", "{{op_type}}").instant()))
        .with_panel(series("Op type time per second", "device seconds per second by op type (top 10)", "s",
                           prom("topk(10, sum by (op_type) (rate(profstream_op_type_seconds_total"
                                f"{{{RUN_RANK}}}[$__rate_interval])))", "{{op_type}}"), height=9)
                    .stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(30))
        .with_row(Row("Kernels (steps measured on the device)"))
        .with_panel(bargauge.Panel().title("Kernel breakdown (share of device time in range)").span(8).height(8)
                    .description("summed device op time by kind (compute, communication, memcpy, memset) "
                                 "over the time range, as a share of their sum")
                    .datasource(PROMETHEUS).unit("percentunit").min(0).max(1).orientation(VizOrientation.HORIZONTAL)
                    .display_mode(BarGaugeDisplayMode.GRADIENT).reduce_options(LAST)
                    .with_target(prom("sum by (kind) (increase(profstream_device_kind_seconds_total"
                                      f"{{{RUN_RANK}}}[$__range])) / scalar(sum(increase("
                                      f"profstream_device_kind_seconds_total{{{RUN_RANK}}}[$__range])))",
                                      "{{kind}}").instant()))
        .with_panel(bargauge.Panel().title("Top kernels (device time in range)").span(8).height(8)
                    .description("summed device op time by kernel type over the time range; on steps whose "
                                 "device ops carry their launch time; top K per run + other")
                    .datasource(PROMETHEUS).unit("s").orientation(VizOrientation.HORIZONTAL)
                    .display_mode(BarGaugeDisplayMode.GRADIENT).reduce_options(LAST)
                    .with_target(prom("topk(10, sum by (kernel) (increase(profstream_kernel_seconds_total"
                                      f"{{{RUN_RANK}}}[$__range])))", "{{kernel}}").instant()))
        .with_panel(series("Host and device step time", "E - S on the host, and the step time the figures are "
                           "measured on: the device's where the step has a device window (a lagging device "
                           "shows the same mean, offset)", "s",
                           prom(f"profstream_host_step_duration_seconds{{{RUN_RANK}}}", "host rank {{rank}}"),
                           prom(f"profstream_step_duration_seconds{{{RUN_RANK}}}", "figures rank {{rank}}", "B"),
                           width=8, height=8))
        .with_row(Row("Device counters (NVML, per device)"))
        .with_panel(ratio_series("GPU and memory utilization", "share of time a kernel ran (gpu) and device memory "
                                 "was read or written (memory), mean over each step's samples; needs no op capture",
                                 prom(f"profstream_device_gpu_utilization_ratio{{{RUN_RANK}}}",
                                      "gpu {{device}} rank {{rank}}"),
                                 prom(f"profstream_device_memory_utilization_ratio{{{RUN_RANK}}}",
                                      "memory {{device}} rank {{rank}}", "B"), width=8))
        .with_panel(series("Power", "power drawn (mean and peak of each step) against the enforced limit", "watt",
                           prom(f"profstream_device_power_watts{{{RUN_RANK}}}", "mean {{device}} rank {{rank}}"),
                           prom(f"profstream_device_power_peak_watts{{{RUN_RANK}}}", "peak {{device}} rank {{rank}}",
                                "B"),
                           prom(f"max by (device) (profstream_device_power_limit_watts{{{RUN_RANK}}})",
                                "limit {{device}}", "C"), width=8))
        .with_panel(series("Temperature and SM clock", "highest GPU temperature of each step (left) and its mean "
                           "SM clock: a clock that drops as the temperature rises is thermal throttling", "celsius",
                           prom(f"profstream_device_temperature_celsius{{{RUN_RANK}}}",
                                "temperature {{device}} rank {{rank}}"),
                           prom(f"profstream_device_sm_clock_hertz{{{RUN_RANK}}} / 1e6",
                                "SM MHz {{device}} rank {{rank}}", "B"), width=8)
                    .override_by_query("B", [DynamicConfigValue(id_val="unit", value="rotmhz"),
                                             DynamicConfigValue(id_val="custom.axisPlacement",
                                                                value=AxisPlacement.RIGHT)]))
        .with_panel(statetimeline.Panel().title("Throttled (DeviceThrottled)").span(8).height(8)
                    .description("clocks held down for power (power cap, power brake) or temperature in a step; "
                                 "DeviceThrottled fires after 5 minutes of it")
                    .datasource(PROMETHEUS)
                    .with_target(prom(f"max by (device, reason) (profstream_device_throttled{{{RUN_RANK}}})",
                                      "{{device}} {{reason}}"))
                    .mappings([ValueMap(options={"0": ValueMappingResult(text="full clocks", color="green"),
                                                 "1": ValueMappingResult(text="throttled", color="red")})]))
        .with_panel(series("Device memory used", "device memory in use by every process on the device (highest "
                           "in each step) against its size", "bytes",
                           prom(f"profstream_device_memory_used_bytes{{{RUN_RANK}}}", "used {{device}} rank {{rank}}"),
                           prom(f"max by (device) (profstream_device_memory_total_bytes{{{RUN_RANK}}})",
                                "total {{device}}", "B"), width=8))
        .with_panel(series("PCIe and NVLink throughput", "bytes per second by direction, mean over each step",
                           "Bps",
                           prom(f"profstream_device_pcie_bytes_per_second{{{RUN_RANK}}}",
                                "PCIe {{direction}} {{device}} rank {{rank}}"),
                           prom(f"profstream_device_nvlink_bytes_per_second{{{RUN_RANK}}}",
                                "NVLink {{direction}} {{device}} rank {{rank}}", "B"), width=8))
    )


# -- Cluster ------------------------------------------------------------------------------

def cluster() -> Dashboard:
    return (
        dashboard("profstream-cluster", "profstream / Cluster",
                  "Across the ranks of one run, built for 1,000 ranks and more: skew, the straggler, every "
                  "rank's step time as a heat map, quantiles over all ranks, and the slowest ranks "
                  "(the exporter keeps per-rank series for a run's --top-ranks slowest; never one line per rank).")
        .with_variable(datasource_variable()).with_variable(run_variable()).with_variable(rank_variable())
        .annotation(tag_annotations("Alerts", "red", [TAG, "alert", "run:$run"]))
        .annotation(tag_annotations("Run start and end", "blue", [TAG, "run", "run:$run"]))
        .annotation(tag_annotations("Op captures", "purple", [TAG, "capture", "run:$run"]))
        .with_panel(single("Rank skew", "(max - min) / median step time of the last step across ranks",
                           "percentunit", prom(f"profstream_rank_skew_ratio{{{RUN}}}", "skew"), width=6)
                    .thresholds(thresholds((None, "green"), (0.1, "orange"), (0.3, "red"))))
        .with_panel(single("Straggler rank", "rank with the largest step time in the last step", "none",
                           prom(f"profstream_straggler_rank{{{RUN}}}", "straggler"), width=6)
                    .graph_mode(BigValueGraphMode.NONE))
        .with_panel(single("Ranks reporting", "ranks in the run's latest complete step", "none",
                           prom(f"profstream_run_ranks_reported{{{RUN}}}", "ranks"), width=6))
        .with_panel(single("Slowest rank behind by", "steps between the most and least advanced rank, over "
                           "every rank", "none",
                           prom(f'max(profstream_ranks_last_step{{{RUN}, stat="max"}}) - '
                                f'max(profstream_ranks_last_step{{{RUN}, stat="min"}})', "steps"), width=6))
        .with_panel(series("Rank skew over time", "(max - min) / median step time across ranks, per step",
                           "percentunit", prom(f"profstream_rank_skew_ratio{{{RUN}}}", "skew")))
        .with_panel(statetimeline.Panel().title("Straggler rank over time").span(12).height(8)
                    .description("the rank with the largest step time; one colour per rank")
                    .datasource(PROMETHEUS)
                    .with_target(prom(f"profstream_straggler_rank{{{RUN}}}", "straggler")))
        .with_panel(heatmap.Panel().title("Step time of every rank (heat map)").span(24).height(10)
                    .description("how many ranks had each latest step time, over time, for all the run's ranks "
                                 "(profstream_ranks_step_duration_seconds_hist: buckets 1.5x apart); a band "
                                 "above the crowd is a straggler, a wide column a spread-out step")
                    .datasource(PROMETHEUS).calculate(False)
                    .rows_frame(RowsHeatmapOptions().layout(HeatmapCellLayout.LE).value("ranks"))
                    .y_axis(heatmap.YAxisConfig().unit("s"))
                    .cell_values(CellValues().unit("none"))
                    .color(HeatmapColorOptions().mode(HeatmapColorMode.SCHEME).scheme("Oranges")
                           .scale(HeatmapColorScale.EXPONENTIAL).exponent(0.5).steps(64))
                    .with_target(prom(f"sum by (le) (profstream_ranks_step_duration_seconds_hist_bucket{{{RUN}}})",
                                      "{{le}}").format(PromQueryFormat.HEATMAP)))
        .with_panel(series("Step time across all ranks", "min, median, p95 and max of the ranks' latest step "
                           "time, over every rank of the run", "s",
                           *(prom(f'profstream_ranks_step_duration_seconds{{{RUN}, stat="{stat}"}}', stat, ref)
                             for stat, ref in (("max", "A"), ("p95", "B"), ("p50", "C"), ("min", "D")))))
        .with_panel(bargauge.Panel().title(f"Slowest {TOP_RANKS} ranks (latest step)").span(12).height(8)
                    .description("the ranks with the longest latest step, from the ranks with series of their "
                                 "own (a large run's --top-ranks slowest, ranked by their last 5 steps)")
                    .datasource(PROMETHEUS).unit("s").orientation(VizOrientation.HORIZONTAL)
                    .display_mode(BarGaugeDisplayMode.GRADIENT).reduce_options(LAST)
                    .with_target(prom(f"sort_desc(topk({TOP_RANKS}, profstream_step_duration_seconds{{{RUN}}}))",
                                      "rank {{rank}} ({{host}})").instant()))
        .with_panel(heatmap.Panel().title("Step time of the slowest ranks (heat map)").span(24).height(10)
                    .description("one row per rank with series of its own (a large run's --top-ranks slowest), "
                                 "colour = latest step time; a slow row is a straggler")
                    .datasource(PROMETHEUS).calculate(False)
                    .rows_frame(RowsHeatmapOptions().layout(HeatmapCellLayout.UNKNOWN).value("step time"))
                    .cell_values(CellValues().unit("s"))
                    .color(HeatmapColorOptions().mode(HeatmapColorMode.SCHEME).scheme("Oranges")
                           .scale(HeatmapColorScale.EXPONENTIAL).exponent(0.5).steps(64))
                    .with_target(prom(f"profstream_step_duration_seconds{{{RUN_RANK}}}", "{{rank}}")))
        .with_panel(bargauge.Panel().title(f"Ranks furthest behind ({TOP_RANKS})").span(12).height(8)
                    .description("the ranks with series whose latest step is lowest; every rank: "
                                 "\"Slowest rank behind by\"").datasource(PROMETHEUS)
                    .orientation(VizOrientation.HORIZONTAL).display_mode(BarGaugeDisplayMode.BASIC)
                    .reduce_options(LAST)
                    .with_target(prom(f"sort(bottomk({TOP_RANKS}, profstream_last_step{{{RUN_RANK}}}))",
                                      "rank {{rank}}").instant()))
        .with_row(Row("Collectives (matched across ranks)"))
        .with_panel(series(f"Wait vs transfer, {TOP_RANKS} ranks that wait longest", "per rank, the latest step's "
                           "time in collectives waiting for the last rank to arrive, and transferring once all had",
                           "s", prom(f"topk({TOP_RANKS}, profstream_collective_wait_seconds{{{RUN_RANK}}})",
                                     "wait {{rank}}"),
                           prom(f"profstream_collective_transfer_seconds{{{RUN_RANK}}} and on (rank) topk({TOP_RANKS}, "
                                f"profstream_collective_wait_seconds{{{RUN_RANK}}})", "transfer {{rank}}", "B")))
        .with_panel(series("Bus bandwidth by collective", "algbw x NCCL's factor for the collective and group "
                           "size (0 without message sizes: --collective-bytes)", "Bps",
                           prom(f"profstream_collective_busbw_bytes_per_second{{{RUN}}}", "{{collective}}")))
        .with_panel(statetimeline.Panel().title("Late rank over time").span(12).height(8)
                    .description("the rank the others waited for most in their collectives (-1: none waited)")
                    .datasource(PROMETHEUS)
                    .with_target(prom(f"profstream_collective_late_rank{{{RUN}}}", "late rank")))
        .with_panel(ratio_series("Held by the late rank", "longest wait of one rank for the late rank / median "
                                 "step time (CollectiveWaitHigh at 20 %)",
                                 prom(f"profstream_collective_late_rank_held_ratio{{{RUN}}}", "held")))
    )


# -- Pipeline health ----------------------------------------------------------------------

def pipeline_health() -> Dashboard:
    inst = 'instance=~"$instance"'
    return (
        dashboard("profstream-pipeline-health", "profstream / Pipeline health",
                  "The processors themselves: events folded in, consumer lag, drops and losses, decode errors "
                  "and how fresh the figures are.")
        .with_variable(datasource_variable())
        .with_variable(QueryVariable("instance").label("Processor").datasource(PROMETHEUS)
                       .query("label_values(profstream_consumer_lag_messages, instance)")
                       .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
                       .multi(True).include_all(True).all_value(".*"))
        .annotation(tag_annotations("Alerts", "red", [TAG, "alert"]))
        .with_panel(single("Events/s", "events folded in per second, all families", "cps",
                           prom(f"sum(rate(profstream_events_total{{{inst}}}[$__rate_interval]))", "events/s"),
                           width=6))
        .with_panel(single("Consumer lag", "raw messages not yet consumed", "none",
                           prom(f"sum(profstream_consumer_lag_messages{{{inst}}})", "lag"), width=6)
                    .thresholds(thresholds((None, "green"), (1000, "orange"), (100000, "red"))))
        .with_panel(single("Freshness p95", "end of a step to its figures committed, 95th percentile", "s",
                           prom("histogram_quantile(0.95, sum by (le) (rate(profstream_step_freshness_seconds_bucket"
                                f"{{{inst}}}[$__rate_interval])))", "p95"), width=6)
                    .thresholds(thresholds((None, "green"), (1, "orange"), (5, "red"))))
        .with_panel(single("Open runs", "runs with state in the processors", "none",
                           prom(f"sum(profstream_open_runs{{{inst}}})", "runs"), width=6))
        .with_panel(series("Events/s by family", "ops, memory, queue and step events folded in per second", "cps",
                           prom(f"sum by (family) (rate(profstream_events_total{{{inst}}}[$__rate_interval]))",
                                "{{family}}"))
                    .stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(30))
        .with_panel(series("Consumer lag", "messages not yet consumed: raw topic per processor, processed "
                           "topics per Prometheus exporter", "none",
                           prom(f"profstream_consumer_lag_messages{{{inst}}}", "processor {{instance}}"),
                           prom("profstream_sink_consumer_lag_messages", "exporter {{instance}}", "B")))
        .with_panel(series("Drops, losses, copies and late events",
                           "op events the producers dropped, raw batches missing from a producer's sequence, "
                           "raw batches the topic held twice (taken once), "
                           "events that arrived for an already closed step", "cps",
                           prom(f"sum(rate(profstream_producer_dropped_total{{{inst}}}[$__rate_interval]))",
                                "ops dropped by producers"),
                           prom(f"sum(rate(profstream_lost_batches_total{{{inst}}}[$__rate_interval]))",
                                "batches lost", "B"),
                           prom(f"sum(rate(profstream_late_events_total{{{inst}}}[$__rate_interval]))",
                                "late events", "C"),
                           prom(f"sum(rate(profstream_duplicate_batches_total{{{inst}}}[$__rate_interval]))",
                                "batch copies taken once", "D")))
        .with_panel(series("Device ops without a launch time",
                           "device ops in steps measured on the device that carried no launch correlation: "
                           "counted in the host step holding their start", "cps",
                           prom(f"sum(rate(profstream_uncorrelated_device_ops_total{{{inst}}}[$__rate_interval]))",
                                "uncorrelated device ops")))
        .with_panel(series("Producer buffer fill", "share of each producer's buffer in use at its latest batch: "
                           "at 1 it drops op events", "percentunit",
                           prom(f"max by (run, rank) (profstream_producer_buffer_fill_ratio{{{inst}}})",
                                "{{run}}/{{rank}}")))
        .with_panel(series("Producer send latency", "send-to-acknowledge latency of each producer's last "
                           "acknowledged batch", "s",
                           prom(f"max by (run, rank) (profstream_producer_send_latency_seconds{{{inst}}})",
                                "{{run}}/{{rank}}")))
        .with_panel(series("Decode errors by reason", "raw messages sent to the dead-letter topic", "cps",
                           prom(f"sum by (reason) (rate(profstream_decode_errors_total{{{inst}}}"
                                "[$__rate_interval]))", "{{reason}}")))
        .with_panel(series("Step freshness", "end of a step (producer clock) to its StepMetrics committed", "s",
                           *(prom(f"histogram_quantile({q}, sum by (le) (rate(profstream_step_freshness_seconds_bucket"
                                  f"{{{inst}}}[$__rate_interval])))", f"p{round(q * 100)}", ref)
                             for q, ref in ((0.5, "A"), (0.95, "B"), (0.99, "C"))), width=24)
                    .line_interpolation(LineInterpolation.SMOOTH))
    )


# -- output -------------------------------------------------------------------------------

DASHBOARDS: dict[str, Callable[[], Dashboard]] = {
    "training-run.json": training_run,
    "cluster.json": cluster,
    "pipeline-health.json": pipeline_health,
}


def render(builder: Dashboard) -> str:
    """The dashboard as the JSON text committed (sorted keys, so diffs stay small)."""
    model = builder.build()
    for i, panel in enumerate(model.panels or (), start=1):  # stable ids: links to a panel keep working
        panel.id_val = i
    return json.dumps(model, cls=JSONEncoder, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def rendered() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {name: render(build()) for name, build in DASHBOARDS.items()}


def stale(directory: Path = HERE) -> list[str]:
    """Names of the dashboard files in ``directory`` that are missing or differ from the generator."""
    return [name for name, text in rendered().items()
            if not (directory / name).is_file() or (directory / name).read_text(encoding="utf-8") != text]


def write(directory: Path = HERE) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in rendered().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="directory to write into (default: dashboards/)")
    parser.add_argument("--check", action="store_true", help="only check that the files are up to date")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale(args.out)
        for name in bad:
            print(f"{args.out / name} is stale: run `make dashboards` and commit the result", file=sys.stderr)
        return 1 if bad else 0
    for path in write(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
