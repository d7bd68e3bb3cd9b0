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


def _topics(prefix: str):
    """``Topics`` of a --topic-prefix, or the one-line error that says what is wrong with it."""
    from profstream.kafka.topics import Topics, validate_prefix

    try:
        return Topics(validate_prefix(prefix))
    except ValueError as e:
        _fail(str(e))


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
    # the whole table: PROFSTREAM_OPTIONS may hold other Monitor options beside bootstrap
    return resolve(MONITOR_OPTIONS, {"bootstrap": given})["bootstrap"]


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

@sink_app.command("prometheus")
def sink_prometheus(
    bootstrap: BootstrapOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    port: Annotated[int, typer.Option(min=0, max=65535, help="serve /metrics on this port")] = 9464,
    addr: Annotated[str, typer.Option(help="address to listen on")] = "0.0.0.0",
    group_id: Annotated[str, typer.Option(help="consumer group; give every exporter replica its own")]
    = "profstream-prometheus",
    ttl_s: Annotated[float, typer.Option(min=1.0, help="drop the series of a run or rank silent this long")]
    = 900.0,
    top_k: Annotated[int, typer.Option(min=1, help="op types with series of their own per run (the "
                                                   "rest: other)")] = 10,
) -> None:
    """Serve every profstream figure to Prometheus (docs/metrics.md): steps, run and alerts topics in."""
    from profstream.sinks.prometheus import ExporterError, PrometheusExporter

    topics = _topics(topic_prefix)
    boot = _bootstrap(bootstrap)
    _require_broker(boot)
    exporter = PrometheusExporter(boot, topics, port=port, addr=addr, group_id=group_id,
                                  ttl_s=ttl_s, top_k=top_k)
    try:
        url = exporter.serve()
    except ExporterError as e:
        _fail(str(e))
    err.print(f"serving {url} from {boot} (topics {topic_prefix}.steps, .run, .alerts; group {group_id}); "
              "Ctrl-C stops", highlight=False, soft_wrap=True)
    try:
        exporter.run()
    except KeyboardInterrupt:
        pass
    finally:
        exporter.close()


GrafanaUrlOpt = Annotated[str | None, typer.Option("--url", help="Grafana base URL (default: "
                                                        "$PROFSTREAM_GRAFANA_URL, else http://localhost:3000)")]
GrafanaTokenOpt = Annotated[str | None, typer.Option("--token", help="Grafana service-account token (default: "
                                                            "$PROFSTREAM_GRAFANA_TOKEN); never printed")]


@grafana_app.command("push")
def grafana_push(
    url: GrafanaUrlOpt = None,
    token: GrafanaTokenOpt = None,
    dir: Annotated[Path | None, typer.Option("--dir", help="directory of the dashboard JSON files "
                                                           "(default: ./dashboards, else the checkout's)")] = None,
    folder_uid: Annotated[str, typer.Option(help="uid of the Grafana folder to put them in")] = "profstream",
) -> None:
    """Upload the profstream dashboards to Grafana (creating or replacing them)."""
    from profstream.sinks.grafana import (
        Grafana,
        GrafanaError,
        default_dashboards_dir,
        load_dashboards,
    )

    grafana = Grafana.from_options(url, token)
    dashboards = load_dashboards(dir or default_dashboards_dir())
    try:
        grafana.ensure_folder(folder_uid, "profstream")
        for dashboard in dashboards:
            answer = grafana.push_dashboard(dashboard, folder_uid)
            out.print(f"{dashboard['title']}: {grafana.link(answer.get('url', ''))} "
                      f"(version {answer.get('version', '?')})", highlight=False)
    except GrafanaError as e:
        _fail(str(e))


@sink_app.command("grafana")
def sink_grafana(
    bootstrap: BootstrapOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    url: GrafanaUrlOpt = None,
    token: GrafanaTokenOpt = None,
    group_id: Annotated[str, typer.Option(help="consumer group of the Grafana sink")] = "profstream-grafana",
    run_idle_s: Annotated[float, typer.Option(min=0.1, help="a run without steps this long is marked "
                                                            "ended")] = 60.0,
    max_pending: Annotated[int, typer.Option(min=1, help="annotations kept while Grafana is down (the "
                                                         "oldest are dropped beyond)")] = 10000,
) -> None:
    """Annotate Grafana: run start and end, alerts firing and resolved (steps and alerts topics in)."""
    import signal
    import threading

    from profstream.sinks.grafana import Grafana, GrafanaAnnotationSink
    from profstream.sinks.runner import SinkLoop

    topics = _topics(topic_prefix)
    grafana = Grafana.from_options(url, token)
    boot = _bootstrap(bootstrap)
    _require_broker(boot)
    sink = GrafanaAnnotationSink(grafana, run_idle_s=run_idle_s, max_pending=max_pending)
    try:
        loop = SinkLoop(boot, [topics.steps, topics.alerts], group_id, sink)
    except RuntimeError as e:
        sink.close()
        _fail(str(e))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    err.print(f"annotating Grafana at {grafana.display_url} from {topics.steps} and {topics.alerts} ({boot}, "
              f"group {group_id}); Ctrl-C stops", highlight=False, soft_wrap=True)
    loop.run(stop)


@sink_app.command("archive")
def sink_archive(
    out_dir: Annotated[Path, typer.Argument(help="archive directory (created if missing)")],
    bootstrap: BootstrapOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    topics: Annotated[str, typer.Option(help="comma-separated topics to archive, by their name after the "
                                             "prefix")] = "raw,steps",
    group_id: Annotated[str, typer.Option(help="consumer group of the archive sink")] = "profstream-archive",
    instance_id: Annotated[str, typer.Option(help="stable across restarts (static group membership)")] = "0",
    codec: Annotated[str, typer.Option(help="zstandard, deflate or null")] = "zstandard",
    max_bytes: Annotated[str, typer.Option(help="start a new file beyond this size")] = "64MiB",
    max_age_s: Annotated[float, typer.Option(min=0.001, help="finish a file this old")] = 300.0,
    progress: Annotated[bool | None, typer.Option("--progress/--no-progress", help="show progress (default: "
                                                  "when stderr is a terminal)")] = None,
) -> None:
    """Archive topics into Avro files (<dir>/<topic>/<run>/p<partition>/<first>-<last>.avro), exactly once."""
    import signal
    import threading

    from profstream.config import PARSERS
    from profstream.kafka.topics import Topics, validate_prefix
    from profstream.sinks.archive import CODECS, ArchiveError, run_archive

    try:
        prefix = Topics(validate_prefix(topic_prefix))
        check_name(instance_id, "instance id")
        size = PARSERS["size"](max_bytes)
    except ValueError as e:
        _fail(str(e))
    if codec not in CODECS:
        _fail(f"--codec {codec!r}: expected one of {', '.join(CODECS)}")
    names = [f"{prefix.prefix}.{t.strip()}" for t in topics.split(",") if t.strip()]
    boot = _bootstrap(bootstrap)
    _require_broker(boot)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    bar, show = _work_progress("archive", progress, unit="messages")

    def started(sink) -> None:
        err.print(f"archiving {', '.join(names)} from {boot} into {sink.root} (group {group_id}); Ctrl-C stops",
                  highlight=False, soft_wrap=True)

    try:
        with bar:
            stats = run_archive(boot, names, out_dir, stop, group_id=group_id, instance_id=instance_id,
                                progress=show, ready=started, codec=codec, max_bytes=size, max_age_s=max_age_s)
    except (ArchiveError, RuntimeError) as e:
        _fail(str(e))
    err.print(f"archived {stats.messages} messages in {stats.files} files", highlight=False)



@sink_app.command("timeline")
def sink_timeline(
    out_dir: Annotated[Path, typer.Option("--out", help="directory of the timeline files (created if missing)")],
    bootstrap: BootstrapOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    window_steps: Annotated[int, typer.Option(min=1, help="steps per file")] = 100,
    max_bytes: Annotated[str, typer.Option(help="most JSON text per file, before gzip (a bigger window is "
                                                "split into more files)")] = "20MB",
    group_id: Annotated[str, typer.Option(help="consumer group of the timeline sink")] = "profstream-timeline",
) -> None:
    """Write Perfetto / chrome://tracing timelines from the raw topic (<out>/<run>/rank-<r>/steps-<a>-<b>.json.gz)."""
    import signal
    import threading

    from profstream.config import PARSERS
    from profstream.sinks.runner import SinkLoop
    from profstream.sinks.timeline import TimelineSink

    topics = _topics(topic_prefix)
    try:
        size = PARSERS["size"](max_bytes)
    except ValueError as e:
        _fail(f"--max-bytes {max_bytes!r}: {e}")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        sink = TimelineSink(out_dir, window_steps=window_steps, max_bytes=size)
    except ConfigError as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot create --out {out_dir} ({e.strerror}): choose a directory you can write")
    boot = _bootstrap(bootstrap)
    _require_broker(boot)
    try:
        loop = SinkLoop(boot, [topics.raw], group_id, sink)
    except RuntimeError as e:
        _fail(str(e))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    err.print(f"writing timelines of {topics.raw} ({boot}, group {group_id}) into {out_dir}; Ctrl-C stops",
              highlight=False, soft_wrap=True)
    try:
        loop.run(stop)
    except OSError as e:
        _fail(f"cannot write timeline files in {out_dir} ({e.strerror or e}): fix it and start again; "
              "nothing is lost, the sink goes on from its last file")
    stats = sink.stats()
    err.print(f"wrote {stats['files_written']} files ({stats['steps_written']} steps, {stats['ops_written']} ops)"
              + (f"; skipped undecodable messages: {stats['decode_errors']}" if stats["decode_errors"] else ""),
              highlight=False)

def _work_progress(what: str, enabled: bool | None, unit: str = "MB"):
    """A rich progress display on stderr (when it is a terminal, or --progress) and the callback
    that updates it from a replay.Tally or an archive.ArchiveProgress."""
    import contextlib

    if not (enabled if enabled is not None else sys.stderr.isatty()):
        return contextlib.nullcontext(), None
    progress = Progress(TextColumn(f"[bold]{what}"), BarColumn(), TextColumn("{task.fields[detail]}"),
                        TimeRemainingColumn(), console=err, transient=True)
    task = progress.add_task(what, total=None, detail="")

    def show(t) -> None:
        rate_s = max(t.elapsed_s, 1e-9)
        if hasattr(t, "lag"):  # the archive sink: done = archived, total = archived + still to read
            progress.update(task, completed=t.messages, total=t.messages + t.lag, detail=(
                f"{t.files} files ({t.open_files} open)  {t.messages:,} messages  "
                f"{t.value_bytes / 1e6 / rate_s:.1f} MB/s  lag {t.lag:,}"))
        else:
            detail = f"{t.files_done}/{t.files_total} files  {t.messages:,} messages"
            if t.events:
                detail += f"  {t.events:,} events  {t.steps:,} steps  {t.events / rate_s:,.0f} events/s"
            else:
                detail += f"  {t.messages / rate_s:,.0f} messages/s"
            progress.update(task, completed=t.bytes_done, total=t.bytes_total or None, detail=detail)

    return progress, show


# -- replay and export ------------------------------------------------------------------

export_app = typer.Typer(help="Files for notebooks from an archive.", no_args_is_help=True)
app.add_typer(export_app, name="export")

ArchiveArg = Annotated[Path, typer.Argument(help="archive directory written by `profstream sink archive`")]
ProgressOpt = Annotated[bool | None, typer.Option("--progress/--no-progress",
                                                  help="show progress (default: when stderr is a terminal)")]


def _report_losses(losses) -> None:
    for loss in losses:
        err.print(f"[yellow]warning:[/yellow] {loss}", highlight=False, soft_wrap=True)
    if losses:
        err.print(f"[red]{len(losses)} damaged stretch(es) of the archive skipped[/red]", highlight=False)
        raise typer.Exit(1)


@app.command()
def replay(
    archive: ArchiveArg,
    run: Annotated[str | None, typer.Option(help="only this run (default: every run archived)")] = None,
    steps: Annotated[str | None, typer.Option(help="only steps A:B (inclusive)")] = None,
    speed: Annotated[str, typer.Option(help="1: as recorded, N: N times faster, max: no pacing")] = "max",
    to_topic: Annotated[str | None, typer.Option(help="topic to republish to (a <prefix>.raw that does "
                                                      "not exist is created)")] = None,
    rewrite_run: Annotated[str | None, typer.Option(help="republish the run under this run id")] = None,
    offline: Annotated[bool, typer.Option(help="no broker: run the processors on the archive and write "
                                               "their output to --output")] = False,
    output: Annotated[Path | None, typer.Option(help="directory for --offline results")] = None,
    format: Annotated[str, typer.Option(help="jsonl or parquet (--offline)")] = "jsonl",
    workers: Annotated[int, typer.Option(min=0, help="--offline processes (0: one per CPU, up to 4)")] = 0,
    topic: Annotated[str | None, typer.Option(help="archived raw topic, when the archive holds several")] = None,
    bootstrap: BootstrapOpt = None,
    progress: ProgressOpt = None,
    grace_s: Annotated[float, typer.Option(min=0.0, help="--offline: as for `profstream process`")] = 2.0,
    run_grace_s: Annotated[float, typer.Option(min=0.0, help="--offline: as for `profstream process`")] = 10.0,
    idle_timeout_s: Annotated[float, typer.Option(min=1.0, help="--offline: as for `profstream process`")] = 60.0,
    stall_ratio: Annotated[float, typer.Option(min=0.0, max=1.0, help="--offline: as for `profstream process`")]
    = 0.3,
    stall_steps: Annotated[int, typer.Option(min=1, help="--offline: as for `profstream process`")] = 5,
    top_k: Annotated[int, typer.Option(min=1, help="--offline: as for `profstream process`")] = 10,
    rolling_steps: Annotated[int, typer.Option(min=1, help="--offline: as for `profstream process`")] = 100,
) -> None:
    """Republish an archived run (keys kept, in partition order), or run the processors on it offline."""
    from profstream.processors.figures import FigureOptions
    from profstream.sinks.archive import ArchiveError
    from profstream.sinks.replay import (
        OfflineOptions,
        archive_files,
        default_workers,
        parse_speed,
        replay_offline_to,
        republish,
    )

    step_range = _parse_range(steps, "--steps")
    try:
        pace = parse_speed(speed)
        if rewrite_run is not None:
            check_name(rewrite_run, "run id")
        files = archive_files(archive, "raw", topic, run)
    except (ValueError, ArchiveError) as e:
        _fail(str(e))
    if rewrite_run is not None and len({f.run_id for f in files}) > 1:
        _fail("--rewrite-run renames one run: choose it with --run")
    if format not in ("jsonl", "parquet"):
        _fail(f"--format {format!r}: expected jsonl or parquet")
    bar, show = _work_progress("replay", progress)
    if offline:
        if output is None:
            _fail("--offline writes its results to a directory: give --output DIR")
        with bar:
            options = OfflineOptions(grace_s, run_grace_s, idle_timeout_s,
                                     FigureOptions(top_k, stall_ratio, stall_steps, rolling_steps))
            result = replay_offline_to(files, output, format, options=options, steps=step_range,
                                       rewrite_run=rewrite_run, workers=workers or default_workers(), progress=show)
        out.print(f"{result.messages} messages, {result.events} op events -> {result.steps} StepMetrics, "
                  f"{result.run_steps} RunStepMetrics, {result.alerts} alerts in {output} "
                  f"({result.elapsed_s:.1f} s)", highlight=False)
    else:
        target = to_topic or files[0].topic
        if target == files[0].topic and rewrite_run is None:
            _fail(f"replaying onto {target}, where the run already is, would feed the processors its "
                  "batches twice: give --to-topic or --rewrite-run")
        boot = _bootstrap(bootstrap)
        _require_broker(boot)
        try:
            with bar:
                result = republish(files, boot, target, pace, step_range, rewrite_run, progress=show)
        except ArchiveError as e:
            _fail(str(e))
        out.print(f"{result.sent} of {result.messages} messages sent to {target} ({result.dropped} left out) "
                  f"in {result.elapsed_s:.1f} s", highlight=False)
    _report_losses(result.losses)


@export_app.command("parquet")
def export_parquet_cmd(
    archive: ArchiveArg,
    output: Annotated[Path, typer.Option(help="directory for <run>.steps.parquet and <run>.ops.parquet")],
    run: Annotated[str | None, typer.Option(help="the run (default: the only run archived)")] = None,
    steps: Annotated[str | None, typer.Option(help="only steps A:B (inclusive)")] = None,
    source: Annotated[str, typer.Option(help="step metrics from the archived steps topic (steps), computed "
                                             "from the raw archive (raw), or steps if archived (auto)")] = "auto",
    what: Annotated[str, typer.Option(help="steps, ops or steps,ops")] = "steps,ops",
    topic_prefix: Annotated[str | None, typer.Option(help="the archived prefix, when there are several")] = None,
    progress: ProgressOpt = None,
) -> None:
    """A run's step metrics and op table as Parquet files for pandas."""
    from profstream.sinks.archive import ArchiveError
    from profstream.sinks.export import export_parquet

    parts = tuple(w.strip() for w in what.split(",") if w.strip())
    if not parts or set(parts) - {"steps", "ops"}:
        _fail(f"--what {what!r}: expected steps, ops or steps,ops")
    if source not in ("auto", "steps", "raw"):
        _fail(f"--source {source!r}: expected auto, steps or raw")
    step_range = _parse_range(steps, "--steps")
    bar, show = _work_progress("export", progress)
    try:
        with bar:
            result = export_parquet(archive, output, run, step_range, source, parts, topic_prefix, progress=show)
    except (ValueError, ArchiveError) as e:
        _fail(str(e))
    for path in result.paths:
        out.print(str(path), highlight=False)
    out.print(f"{result.step_rows} step rows ({result.steps_source or 'not asked'}), {result.op_rows} op rows",
              highlight=False)
    _report_losses(result.losses)


@app.command()
def report(
    archive: ArchiveArg,
    run: Annotated[str | None, typer.Option(help="the run to report on (default: the archive's only run)")] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="the HTML file to write")] = Path("report.html"),
    timeline_dir: Annotated[Path | None, typer.Option(help="output directory of `profstream sink timeline`: "
                                                           "the report links the run's files")] = None,
    workers: Annotated[int, typer.Option(min=0, help="processes (0: one per CPU, up to 4)")] = 0,
    progress: ProgressOpt = None,
) -> None:
    """A self-contained HTML post-mortem of an archived run (no network needed to view it)."""
    from profstream.sinks.archive import ArchiveError
    from profstream.sinks.replay import archive_files
    from profstream.sinks.report import ReportError, gather, write_report

    bar, show = _work_progress("report", progress)
    try:
        if run is None:
            runs = sorted({f.run_id for f in archive_files(archive, "raw")})
            if len(runs) != 1:
                _fail(f"{archive} holds {len(runs)} runs ({', '.join(runs) or 'none'}): choose one with --run")
            run = runs[0]
        with bar:
            data = gather(archive, run, timeline_dir, workers, progress=show)
        path = write_report(data, output)
    except (ValueError, ArchiveError, ReportError, OSError) as e:
        _fail(str(e))
    out.print(f"{path}: {len(data.ranks())} ranks, {len({s['step'] for s in data.steps})} steps, "
              f"{len(data.alerts)} alert transitions, {len(data.timeline_files)} timeline files linked",
              highlight=False)
    _report_losses(data.losses)


# -- ingest ---------------------------------------------------------------------------

@app.command()
def ingest(
    path: Annotated[Path, typer.Argument(help="Chrome trace JSON (.json/.json.gz: PyTorch, Kineto, MindSpore "
                                              "or msprof timeline) or a MindSpore profiler output directory")],
    run_id: Annotated[str, typer.Option(help="run identifier the profile is sent as")],
    rank: Annotated[int | None, typer.Option(min=0, help="rank (default: the one the profile names, else 0)")]
    = None,
    pace: Annotated[str, typer.Option(help="max: as fast as possible; realtime: steps as far apart as "
                                           "they were")] = "max",
    format: Annotated[str, typer.Option(help="auto, chrome or mindspore")] = "auto",
    base_ns: Annotated[int | None, typer.Option(help="ns since the epoch of time 0 of a relative trace "
                                                     "(default: it ended at the file's modification time)")]
    = None,
    step_trace_unit_ns: Annotated[float, typer.Option(min=0.001, help="ns per unit of a MindSpore step trace "
                                                                    "(10 for Ascend's 100 MHz counter)")] = 1.0,
    device: Annotated[str, typer.Option(help="device reported with the events, e.g. cuda:0, npu:3")] = "cpu",
    workers: Annotated[int | None, typer.Option(min=1, help="processes that parse a Chrome trace of 16 MiB or "
                                                           "more (default: one per CPU; 1: one process)")] = None,
    bootstrap: BootstrapOpt = None,
    topic_prefix: PrefixOpt = "profstream",
) -> None:
    """Send an existing profile to Kafka as raw events, as a live producer would (docs/ingest.md)."""
    from profstream.producers.ingest import IngestError
    from profstream.producers.ingest import ingest as ingest_profile

    check_name(run_id, "run id")
    boot = _bootstrap(bootstrap)
    _require_broker(boot)
    try:
        result = ingest_profile(path, {"bootstrap": boot, "run_id": run_id, "topic_prefix": topic_prefix,
                                       "device": device}, format=format, pace=pace, rank=rank, base_ns=base_ns,
                                step_trace_unit_ns=step_trace_unit_ns, workers=workers)
    except IngestError as e:
        _fail(str(e))
    p, s = result.profile, result.sent
    unknown = ", ".join(f"{c}: {n}" for c, n in p.unknown_categories.most_common()) or "none"
    out.print(f"{path} ({p.source}; clock: {p.clock}) -> run {run_id} rank {p.rank or 0}: {s.steps} steps, "
              f"{s.ops} ops, {s.queue_samples} queue and {s.memory_samples} memory samples in {s.elapsed_s:.1f} s; "
              f"ops outside every step (not sent): {s.ops_outside_steps}; unknown categories recorded as host: "
              f"{unknown}; dropped ops: {s.dropped_ops}; {'all delivered' if s.flushed else 'NOT all delivered'}",
              highlight=False, soft_wrap=True)
    for note in p.notes:
        err.print(f"note: {note}", highlight=False, soft_wrap=True)
    if not s.flushed:
        raise typer.Exit(1)


# -- run ------------------------------------------------------------------------------

@app.command(context_settings={"allow_interspersed_args": False})
def run(
    command: Annotated[list[str], typer.Argument(help="the training command, after --")],
    bootstrap: BootstrapOpt = None,
    run_id: Annotated[str | None, typer.Option(help="run identifier (default: one per launch)")] = None,
    topic_prefix: Annotated[str | None, typer.Option(help="topic name prefix")] = None,
    start_step: Annotated[int | None, typer.Option(help="first step whose ops are captured")] = None,
    stop_step: Annotated[int | None, typer.Option(help="last step whose ops are captured")] = None,
    every_n_steps: Annotated[int | None, typer.Option(help="capture ops on every n-th step")] = None,
    capture_ops: Annotated[bool | None, typer.Option("--capture-ops/--no-capture-ops",
                                                     help="op capture with torch.profiler (default: on)")] = None,
) -> None:
    """Profile a PyTorch training script without changing it: profstream run -- python train.py ARGS (docs/torch.md)."""
    from profstream.producers.launch import run_profiled

    options = {"bootstrap": _bootstrap(bootstrap), "run_id": run_id, "topic_prefix": topic_prefix,
               "start_step": start_step, "stop_step": stop_step, "every_n_steps": every_n_steps}
    try:
        code = run_profiled(command, options, {"capture_ops": capture_ops})
    except FileNotFoundError:
        _fail(f"command not found: {command[0]!r} (give the full command after --, e.g. profstream run -- "
              "python train.py)")
    except ValueError as e:  # ConfigError is a ValueError
        _fail(str(e))
    raise typer.Exit(code)


# -- doctor ---------------------------------------------------------------------------

@app.command()
def doctor(
    bootstrap: Annotated[str | None, typer.Option(help="check this broker and its topics (default: "
                                                       "$PROFSTREAM_BOOTSTRAP, else the local `stack up` broker if it runs)")] = None,
    topic_prefix: PrefixOpt = "profstream",
    gpu: Annotated[bool, typer.Option("--gpu", help="a GPU machine: no NVML is a failure, not information")] = False,
    build_walk: Annotated[bool, typer.Option("--build-walk", help="build op capture's compiled trace walk "
                                                                  "now if it is not built (about 25 s)")] = False,
    timeout: Annotated[float, typer.Option(min=0.1, help="seconds to wait for the broker")] = 5.0,
) -> None:
    """Check what profstream needs (Python, PROFSTREAM_* options, Java, Kafka jars, broker and topics,
    Prometheus, torch and the compiled walk, NVML, free ports) and say what to do about each problem;
    exit 1 on a failure."""
    from rich.markup import escape

    from profstream.doctor import failed, run_checks

    findings = run_checks(bootstrap, topic_prefix, gpu=gpu, build_walk=build_walk, broker_timeout_s=timeout)
    table = Table(title="profstream doctor")
    for col in ("check", "status", "found", "what to do"):
        table.add_column(col, overflow="fold")
    colour = {"ok": "green", "info": "blue", "warn": "yellow", "fail": "red"}
    for f in findings:
        table.add_row(escape(f.check), f"[{colour[f.status]}]{f.status}[/]", escape(f.found),
                      escape(f.fix) if f.status != "ok" else "")
    out.print(table)
    if failed(findings):
        raise typer.Exit(1)


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

    from profstream.demo import run_demo
    from profstream.demo_outputs import DemoOutputs
    from profstream.kafka.launcher import stack_up
    from profstream.kafka.topics import ensure_topics
    from profstream.processors.health import ProcessorHealth

    if bootstrap is None:
        from profstream.kafka.launcher import stack_status

        if stack_status() is None:
            err.print("starting the local Kafka broker (the first run fetches its jars with Maven)...")
        bootstrap = stack_up().bootstrap
    _require_broker(bootstrap)
    topics = _topics(topic_prefix)
    out.print(f"Kafka: {bootstrap}", highlight=False)
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    cfg = _sim_config(run_id, ranks, steps, ops_per_step, 100.0, 0.2, seed, stall, None, 1.5, 0, "max")
    ensure_topics(bootstrap, topics)
    health = ProcessorHealth()
    outputs = DemoOutputs(bootstrap, topics, out_dir, health)
    try:
        paths = outputs.start()
    except OSError as e:
        outputs.close()
        _fail(f"cannot write into --out {out_dir} ({e.strerror or e}): choose a directory you can write")
    try:
        out.print(f"metrics: {paths.exporter_url} (figures), {paths.health_url} (processor health)", highlight=False)
        if paths.prometheus_url:
            out.print(f"Prometheus: {paths.prometheus_url} (alert rules of deploy/prometheus/alerts.yml)",
                      highlight=False)
        progress, advance = _progress(cfg.ranks * cfg.steps, "simulate")
        with progress:
            result = run_demo(bootstrap, cfg, topics, progress=advance, health=health)
        _print_summary(cfg, result)
        if len(result.steps) != cfg.ranks * cfg.steps:
            _fail(f"only {len(result.steps)} of {cfg.ranks * cfg.steps} steps came back from the processor "
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
