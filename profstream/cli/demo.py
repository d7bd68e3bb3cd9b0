"""`profstream demo`: everything end to end on one machine, then a summary."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from profstream.cli.common import PrefixOpt, app, connect, err, fail, out, step_progress
from profstream.cli.pipeline import sim_config

# -- demo -----------------------------------------------------------------------------

@app.command()
def demo(
    bootstrap: Annotated[str | None, typer.Option(help="use this broker instead of starting a local one")] = None,
    ranks: Annotated[int, typer.Option(min=1, max=64)] = 2,
    steps: Annotated[int, typer.Option(min=1, max=100000)] = 50,
    ops_per_step: Annotated[int, typer.Option(min=4, max=100000)] = 200,
    stall: Annotated[str | None, typer.Option(help="inject a data stall on steps A:B")] = None,
    topic_prefix: PrefixOpt = "profstream",
    seed: int = 0,
    out_dir: Annotated[Path, typer.Option("--out", help="where the archive, timelines, report.html and "
                                                        "Prometheus's data go")] = Path("demo-out"),
    serve: Annotated[bool | None, typer.Option("--serve/--no-serve", help="keep the exporter and Prometheus "
                                               "up after the summary until Ctrl-C (default: when stdout "
                                               "is a terminal)")] = None,
) -> None:
    """Start a local broker (unless --bootstrap), simulate a run, process it, print a summary; leave
    an archive, timelines and report.html in --out; serve /metrics (and Prometheus, if installed)."""
    import time

    from profstream.demo import demo_bootstrap, run_demo
    from profstream.demo_outputs import DemoOutputs
    from profstream.processors.health import ProcessorHealth

    def starting() -> None:
        err.print("starting the local Kafka broker (the first run fetches its jars with Maven)...")

    bootstrap, topics = connect(demo_bootstrap(bootstrap, starting), topic_prefix)
    out.print(f"Kafka: {bootstrap}", highlight=False)
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    # the steps' work too: batches of 8 x 1,024 tokens of a 1.3-billion-parameter model on an
    # H100 SXM's dense bf16 peak, so the figures, the report and the dashboards show throughput and MFU
    cfg = sim_config(run_id, ranks, steps, ops_per_step, 100.0, 0.2, seed, stall, None, 1.5, 0, "max",
                     batch_size=8, seq_len=1024, flops_per_token=6 * 1.3e9, peak_tflops=989.5)
    health = ProcessorHealth()
    outputs = DemoOutputs(bootstrap, topics, out_dir, health)
    try:
        paths = outputs.start()
    except OSError as e:
        outputs.close()
        fail(f"cannot write into --out {out_dir} ({e.strerror or e}): choose a directory you can write")
    try:
        out.print(f"metrics: {paths.exporter_url} (figures), {paths.health_url} (processor health)", highlight=False)
        if paths.prometheus_url:
            out.print(f"Prometheus: {paths.prometheus_url} (alert rules of deploy/prometheus/alerts.yml)",
                      highlight=False)
        progress, advance = step_progress(cfg.ranks * cfg.steps, "simulate")
        with progress:
            result = run_demo(bootstrap, cfg, topics, progress=advance, health=health)
        print_summary(cfg, result)
        if len(result.steps) != cfg.ranks * cfg.steps:
            fail(f"only {len(result.steps)} of {cfg.ranks * cfg.steps} steps came back from the processor "
                  "within the timeout: check the broker (profstream stack status) and retry")
        paths = outputs.finish(run_id)
        out.print(f"archive:   {paths.archive}  (profstream replay / report / export parquet)", highlight=False)
        out.print(f"timelines: {paths.timeline / run_id}  (open the .json.gz files in ui.perfetto.dev)",
                  highlight=False)
        out.print(f"report:    {paths.report}", highlight=False)
        for note in paths.notes:
            err.print(f"[yellow]note:[/yellow] {note}", highlight=False, soft_wrap=True)
        if serve if serve is not None else sys.stdout.isatty():
            out.print("serving the metrics" + (" and Prometheus" if paths.prometheus_url else "")
                      + "; Ctrl-C stops", highlight=False)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    finally:
        outputs.close()


def _percent(ratio: float) -> str:
    return "—" if math.isnan(ratio) else f"{100 * ratio:.1f}"  # NaN: not measured


def print_summary(cfg, result) -> None:
    table = Table(title=f"run {cfg.run_id}: {cfg.ranks} ranks x {cfg.steps} steps "
                        f"({result.sim.ops_recorded} ops) in {result.wall_s:.1f} s")
    for col in ("rank", "steps", "step ms mean", "p50", "p95", "data wait ms", "fp+bp ms", "tail ms",
                "util %", "overlap %", "queue", "empty %", "starved", "= truth"):
        table.add_column(col, justify="right")
    for r in result.per_rank():
        table.add_row(str(r["rank"]), str(r["steps"]), f"{r['step_ms_mean']:.2f}", f"{r['step_ms_p50']:.2f}",
                      f"{r['step_ms_p95']:.2f}", f"{r['data_wait_ms']:.2f}", f"{r['fp_bp_ms']:.2f}",
                      f"{r['tail_ms']:.2f}", _percent(r["utilization"]), _percent(r["overlap_ratio"]),
                      f"{r['queue_mean']:.1f}", f"{100 * r['queue_empty_ratio']:.0f}",
                      str(r["starved_steps"]), "yes" if r["matches_truth"] else "NO")
    out.print(table)
    for a in result.alerts:
        out.print(f"alert {a['name']} {a['state']} at step {a['step']}: {a['summary']}", highlight=False)
