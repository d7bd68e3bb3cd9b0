"""`profstream ...` commands: parse, call the package, print. Logic lives in the package."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from profstream.config import MONITOR_OPTIONS, ConfigError, check_name, resolve

app = typer.Typer(help="profstream: a live profiler for long training runs.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
stack_app = typer.Typer(help="A local single-node Kafka broker (KRaft) for trying profstream out.",
                        no_args_is_help=True)
app.add_typer(stack_app, name="stack")
sink_app = typer.Typer(help="Sinks: export the processed topics (Prometheus, Grafana, timeline files, archive).",
                       no_args_is_help=True)
app.add_typer(sink_app, name="sink")
grafana_app = typer.Typer(help="Grafana dashboards and annotations.", no_args_is_help=True)
app.add_typer(grafana_app, name="grafana")

# Off a terminal rich assumes 80 columns, too narrow for the summary table.
out = Console(width=None if sys.stdout.isatty() else 140)
err = Console(stderr=True)

_USER_ERRORS: tuple[type[Exception], ...] = (ConfigError,)


def _fail(message: str) -> None:
    err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _bootstrap(given: str | None) -> str:
    """--bootstrap, else PROFSTREAM_BOOTSTRAP / PROFSTREAM_OPTIONS, else the running local
    stack's broker, else the default."""
    import os

    from profstream.config import _env_options

    if given is None and "PROFSTREAM_BOOTSTRAP" not in os.environ and "bootstrap" not in _env_options(os.environ):
        from profstream.kafka.launcher import stack_status

        broker = stack_status()
        if broker is not None:
            return broker.bootstrap
    return resolve(tuple(o for o in MONITOR_OPTIONS if o.name == "bootstrap"), {"bootstrap": given})["bootstrap"]


def _parse_range(value: str | None, flag: str) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        a, b = (int(x) for x in value.split(":"))
    except ValueError:
        _fail(f"{flag} {value!r}: expected A:B, two step numbers such as 20:34")
    if a > b or a < 0:
        _fail(f"{flag} {value!r}: expected 0 <= A <= B")
    return a, b


DirOpt = Annotated[Path | None, typer.Option("--dir", help="state directory of the broker "
                                                          "(default: ~/.cache/profstream/stack)")]
BootstrapOpt = Annotated[str | None, typer.Option(help="Kafka bootstrap servers host:port (default: "
                                                       "$PROFSTREAM_BOOTSTRAP, else the local `stack up` broker)")]
PrefixOpt = Annotated[str, typer.Option(help="topic name prefix (<prefix>.raw, <prefix>.steps, ...)")]


# -- stack ----------------------------------------------------------------------------

@stack_app.command("up")
def stack_up_cmd(dir: DirOpt = None,
                 timeout: Annotated[float, typer.Option(help="seconds to wait for the broker")] = 120.0) -> None:
    """Start the local broker (or reuse the one running) and print its bootstrap address."""
    from profstream.kafka.launcher import stack_up

    broker = stack_up(dir, timeout=timeout)
    out.print(broker.bootstrap, highlight=False)


@stack_app.command("status")
def stack_status_cmd(dir: DirOpt = None) -> None:
    """Print the local broker's address and pid; exit 1 when none is running."""
    from profstream.kafka.launcher import stack_status

    broker = stack_status(dir)
    if broker is None:
        out.print("not running")
        raise typer.Exit(1)
    out.print(f"running  bootstrap={broker.bootstrap}  pid={broker.pid}  dir={broker.state_dir}", highlight=False)


@stack_app.command("down")
def stack_down_cmd(dir: DirOpt = None) -> None:
    """Stop the local broker."""
    from profstream.kafka.launcher import stack_down

    out.print("stopped" if stack_down(dir) else "not running")


# -- simulate -------------------------------------------------------------------------

def _sim_config(run_id, ranks, steps, ops_per_step, step_time_ms, comm_share, seed, stall, straggler,
                straggler_factor, leak_bytes_per_step, rate):
    from profstream.producers.simulate import SimConfig

    check_name(run_id, "run id")
    try:
        return SimConfig(run_id=run_id, ranks=ranks, steps=steps, ops_per_step=ops_per_step,
                         step_time_ms=step_time_ms, comm_share=comm_share, seed=seed,
                         stall=_parse_range(stall, "--stall"), straggler_rank=straggler,
                         straggler_factor=straggler_factor, leak_bytes_per_step=leak_bytes_per_step,
                         rate=rate)
    except ValueError as e:
        _fail(str(e))


def _progress(total: int, what: str):
    progress = Progress(TextColumn(f"[bold]{what}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                        TimeRemainingColumn(), console=err, transient=True)
    task = progress.add_task(what, total=total)
    return progress, lambda _plan: progress.advance(task)


@app.command()
def simulate(
    bootstrap: BootstrapOpt = None,
    run_id: Annotated[str, typer.Option(help="run identifier")] = "sim",
    ranks: Annotated[int, typer.Option(min=1, max=1024)] = 2,
    steps: Annotated[int, typer.Option(min=1)] = 50,
    ops_per_step: Annotated[int, typer.Option(min=4, max=100000)] = 200,
    step_time_ms: Annotated[float, typer.Option(min=0.01)] = 100.0,
    comm_share: Annotated[float, typer.Option(min=0.0, max=0.49, help="all-reduce time / step time")] = 0.2,
    seed: int = 0,
    stall: Annotated[str | None, typer.Option(help="inject a data stall on steps A:B (inclusive)")] = None,
    straggler: Annotated[int | None, typer.Option(help="make this rank a straggler")] = None,
    straggler_factor: Annotated[float, typer.Option(min=1.0)] = 1.5,
    leak_bytes_per_step: Annotated[int, typer.Option(min=0, help="inject a memory leak")] = 0,
    rate: Annotated[str, typer.Option(help="realtime: steps take their time; max: as fast as possible")] = "max",
    topic_prefix: PrefixOpt = "profstream",
) -> None:
    """Simulate a training run through the real Monitor (deterministic for a seed)."""
    from profstream.producers.simulate import run_simulation

    cfg = _sim_config(run_id, ranks, steps, ops_per_step, step_time_ms, comm_share, seed, stall, straggler,
                      straggler_factor, leak_bytes_per_step, rate)
    boot = _bootstrap(bootstrap)
    _require_broker(boot)
    progress, advance = _progress(cfg.ranks * cfg.steps, "simulate")
    with progress:
        result = run_simulation(cfg, {"bootstrap": boot, "topic_prefix": topic_prefix}, progress=advance)
    out.print(f"run {cfg.run_id}: {result.steps_recorded} steps, {result.ops_recorded} ops sent to {boot} "
              f"in {result.wall_s:.1f} s; dropped ops: {result.dropped_ops}; "
              f"{'all delivered' if result.flushed else 'NOT all delivered'}", highlight=False)
    if not result.flushed:
        raise typer.Exit(1)


def _require_broker(bootstrap: str, timeout: float = 15.0) -> None:
    from profstream.kafka.launcher import wait_for_broker

    wait_for_broker(bootstrap, timeout)


# -- process --------------------------------------------------------------------------

@app.command()
def process(
    bootstrap: BootstrapOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    group_id: Annotated[str, typer.Option(help="consumer group of the processors")] = "profstream-processor",
    instance_id: Annotated[str, typer.Option(help="unique per processor process and stable across its "
                                                  "restarts (transactional id, static membership)")] = "0",
    stages: Annotated[str, typer.Option(help="all, steps (raw -> steps) or run (steps -> run)")] = "all",
    grace_s: Annotated[float, typer.Option(min=0.0, help="wait after a step's end mark when "
                                                         "the producer sends no watermark")] = 2.0,
    run_grace_s: Annotated[float, typer.Option(min=0.0, help="wait for missing ranks of a step")] = 10.0,
    idle_timeout_s: Annotated[float, typer.Option(min=1.0, help="close a run after this long silent")] = 60.0,
    commit_interval_ms: Annotated[float, typer.Option(min=1.0, help="transaction commit interval")] = 100.0,
    stall_ratio: Annotated[float, typer.Option(min=0.0, max=1.0, help="data_wait/step_time of a starved step")] = 0.3,
    stall_steps: Annotated[int, typer.Option(min=1, help="consecutive starved steps that fire DataQueueStall")] = 5,
    top_k: Annotated[int, typer.Option(min=1, help="op types reported per step (the rest: other)")] = 10,
    rolling_steps: Annotated[int, typer.Option(min=1, help="steps in the rolling window")] = 100,
    metrics_port: Annotated[int, typer.Option(min=0, max=65535, help="serve health metrics here (0: off)")] = 9465,
    raw_partitions: Annotated[int, typer.Option(min=1, help="partitions of a raw topic created here")] = 12,
) -> None:
    """Run a stream processor: raw events in; StepMetrics, RunStepMetrics and alerts out, exactly once."""
    from profstream.kafka.topics import Topics, ensure_topics, validate_prefix
    from profstream.processors.figures import FigureOptions
    from profstream.processors.runtime import Processor

    try:
        validate_prefix(topic_prefix)
        check_name(instance_id, "instance id")
    except ValueError as e:
        _fail(str(e))
    if stages not in ("all", "steps", "run"):
        _fail(f"--stages {stages!r}: expected all, steps or run")
    boot = _bootstrap(bootstrap)
    topics = Topics(topic_prefix)
    ensure_topics(boot, topics, raw_partitions=raw_partitions)
    processor = Processor(boot, topics, group_id=group_id, instance_id=instance_id, grace_s=grace_s,
                          idle_timeout_s=idle_timeout_s, run_grace_s=run_grace_s,
                          figure_options=FigureOptions(top_k, stall_ratio, stall_steps, rolling_steps),
                          commit_interval_ms=commit_interval_ms, stages=stages)
    if metrics_port:
        try:
            processor.health.serve(metrics_port)
        except OSError as e:
            _fail(f"cannot serve metrics on port {metrics_port} ({e.strerror}): choose another --metrics-port "
                  "or 0 to turn them off")
    err.print(f"processing {topics.raw} from {boot} (group {group_id}, instance {instance_id})"
              + (f", metrics on :{metrics_port}/metrics" if metrics_port else "") + "; Ctrl-C stops",
              highlight=False)
    try:
        processor.run()
    except KeyboardInterrupt:
        processor.stop()


# -- sinks (one section per sink below) ------------------------------------------------


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
) -> None:
    """Start a local broker (unless --bootstrap), simulate a run, process it, print a summary."""
    import time

    from profstream.demo import run_demo
    from profstream.kafka.launcher import stack_up
    from profstream.kafka.topics import Topics

    if bootstrap is None:
        from profstream.kafka.launcher import stack_status

        if stack_status() is None:
            err.print("starting the local Kafka broker (the first run fetches its jars with Maven)...")
        bootstrap = stack_up().bootstrap
    _require_broker(bootstrap)
    out.print(f"Kafka: {bootstrap}", highlight=False)
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    cfg = _sim_config(run_id, ranks, steps, ops_per_step, 100.0, 0.2, seed, stall, None, 1.5, 0, "max")
    progress, advance = _progress(cfg.ranks * cfg.steps, "simulate")
    with progress:
        result = run_demo(bootstrap, cfg, Topics(topic_prefix), progress=advance)
    _print_summary(cfg, result)
    if len(result.steps) != cfg.ranks * cfg.steps:
        _fail(f"only {len(result.steps)} of {cfg.ranks * cfg.steps} steps came back from the processor "
              "within the timeout: check the broker (profstream stack status) and retry")


def _print_summary(cfg, result) -> None:
    table = Table(title=f"run {cfg.run_id}: {cfg.ranks} ranks x {cfg.steps} steps "
                        f"({result.sim.ops_recorded} ops) in {result.wall_s:.1f} s")
    for col in ("rank", "steps", "step ms mean", "p50", "p95", "data wait ms", "fp+bp ms", "tail ms",
                "util %", "overlap %", "queue", "empty %", "starved", "= truth"):
        table.add_column(col, justify="right")
    for r in result.per_rank():
        table.add_row(str(r["rank"]), str(r["steps"]), f"{r['step_ms_mean']:.2f}", f"{r['step_ms_p50']:.2f}",
                      f"{r['step_ms_p95']:.2f}", f"{r['data_wait_ms']:.2f}", f"{r['fp_bp_ms']:.2f}",
                      f"{r['tail_ms']:.2f}", f"{100 * r['utilization']:.1f}", f"{100 * r['overlap_ratio']:.1f}",
                      f"{r['queue_mean']:.1f}", f"{100 * r['queue_empty_ratio']:.0f}",
                      str(r["starved_steps"]), "yes" if r["matches_truth"] else "NO")
    out.print(table)
    for a in result.alerts:
        out.print(f"alert {a['name']} {a['state']} at step {a['step']}: {a['summary']}", highlight=False)


def main() -> None:
    from profstream.kafka.launcher import StackError
    from profstream.processors.checkpoint import FencedError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except (StackError, ConfigError, FencedError) as e:
        err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
