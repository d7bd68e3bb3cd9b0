"""`profstream replay`, `export parquet`, `report` (tools over an archive) and `analyze` (profiles, no broker)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from profstream.cli.common import (
    BootstrapOpt,
    KafkaConfigOpt,
    KafkaPropertyOpt,
    app,
    connect,
    err,
    export_app,
    fail,
    out,
    parse_range,
    work_progress,
)
from profstream.config import check_name

app.add_typer(export_app, name="export")

ArchiveArg = Annotated[Path, typer.Argument(help="archive directory written by `profstream sink archive`")]
ProgressOpt = Annotated[bool | None, typer.Option("--progress/--no-progress",
                                                  help="show progress (default: when stderr is a terminal)")]


def report_losses(losses) -> None:
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
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
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
    from profstream.offline.archive import ArchiveError, archive_files
    from profstream.offline.replay import (
        default_workers,
        parse_speed,
        replay_offline_to,
        republish,
    )
    from profstream.processors.figures import FigureOptions
    from profstream.processors.stream import StreamOptions

    step_range = parse_range(steps, "--steps")
    try:
        pace = parse_speed(speed)
        if rewrite_run is not None:
            check_name(rewrite_run, "run id")
        files = archive_files(archive, "raw", topic, run)
    except (ValueError, ArchiveError) as e:
        fail(str(e))
    if rewrite_run is not None and len({f.run_id for f in files}) > 1:
        fail("--rewrite-run renames one run: choose it with --run")
    if format not in ("jsonl", "parquet"):
        fail(f"--format {format!r}: expected jsonl or parquet")
    bar, show = work_progress("replay", progress)
    if offline:
        if output is None:
            fail("--offline writes its results to a directory: give --output DIR")
        with bar:
            options = StreamOptions(grace_s, run_grace_s, idle_timeout_s,
                                     FigureOptions(top_k, stall_ratio, stall_steps, rolling_steps))
            result = replay_offline_to(files, output, format, options=options, steps=step_range,
                                       rewrite_run=rewrite_run, workers=workers or default_workers(), progress=show)
        out.print(f"{result.messages} messages, {result.events} op events -> {result.steps} StepMetrics, "
                  f"{result.run_steps} RunStepMetrics, {result.alerts} alerts in {output} "
                  f"({result.elapsed_s:.1f} s)", highlight=False)
    else:
        target = to_topic or files[0].topic
        if target == files[0].topic and rewrite_run is None:
            fail(f"replaying onto {target}, where the run already is, would feed the processors its "
                  "batches twice: give --to-topic or --rewrite-run")
        boot, _ = connect(bootstrap)
        try:
            with bar:
                result = republish(files, boot, target, pace, step_range, rewrite_run, progress=show)
        except ArchiveError as e:
            fail(str(e))
        out.print(f"{result.sent} of {result.messages} messages sent to {target} ({result.dropped} left out) "
                  f"in {result.elapsed_s:.1f} s", highlight=False)
    report_losses(result.losses)


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
    from profstream.offline.archive import ArchiveError
    from profstream.offline.export import export_parquet

    parts = tuple(w.strip() for w in what.split(",") if w.strip())
    if not parts or set(parts) - {"steps", "ops"}:
        fail(f"--what {what!r}: expected steps, ops or steps,ops")
    if source not in ("auto", "steps", "raw"):
        fail(f"--source {source!r}: expected auto, steps or raw")
    step_range = parse_range(steps, "--steps")
    bar, show = work_progress("export", progress)
    try:
        with bar:
            result = export_parquet(archive, output, run, step_range, source, parts, topic_prefix, progress=show)
    except (ValueError, ArchiveError) as e:
        fail(str(e))
    for path in result.paths:
        out.print(str(path), highlight=False)
    out.print(f"{result.step_rows} step rows ({result.steps_source or 'not asked'}), {result.op_rows} op rows",
              highlight=False)
    report_losses(result.losses)


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
    """A self-contained HTML post-mortem of an archived run (no network needed to view it), with its capture
    requests and its latest stacks when the control topic is archived too."""
    from profstream.offline.archive import ArchiveError, archive_files
    from profstream.offline.report import ReportError, gather, write_report

    bar, show = work_progress("report", progress)
    try:
        if run is None:
            runs = sorted({f.run_id for f in archive_files(archive, "raw")})
            if len(runs) != 1:
                fail(f"{archive} holds {len(runs)} runs ({', '.join(runs) or 'none'}): choose one with --run")
            run = runs[0]
        with bar:
            data = gather(archive, run, timeline_dir, workers, progress=show)
        path = write_report(data, output)
    except (ValueError, ArchiveError, ReportError, OSError) as e:
        fail(str(e))
    out.print(f"{path}: {len(data.ranks())} ranks, {len({s['step'] for s in data.steps})} steps, "
              f"{len(data.alerts)} alert transitions, {len(data.timeline_files)} timeline files linked",
              highlight=False)
    report_losses(data.losses)


@app.command()
def analyze(
    traces: Annotated[list[Path], typer.Argument(help="profiles: Kineto/PyTorch, MindSpore or msprof timeline "
                                                      "JSON (.json/.json.gz), one file per rank, a directory of "
                                                      "them, a MindSpore profiler directory, torch_npu / MindSpore "
                                                      "*_ascend_pt / *_ascend_ms folders or msprof PROF_* "
                                                      "directories")],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="write the HTML report here")] = None,
    parquet: Annotated[Path | None, typer.Option(help="write <run>.steps.parquet and <run>.ops.parquet into "
                                                      "this directory")] = None,
    run_id: Annotated[str, typer.Option(help="run id the figures carry")] = "analyze",
    device: Annotated[str, typer.Option(help="device reported with the figures, e.g. cuda:0 (default: the "
                                             "profile's where it says, e.g. npu:0)")] = "",
    workers: Annotated[int | None, typer.Option(min=1, help="processes that parse a trace of 16 MiB or more "
                                                           "(default: one per CPU; 1: one process)")] = None,
    stall_ratio: Annotated[float, typer.Option(min=0.0, max=1.0, help="as for `profstream process`")] = 0.3,
    stall_steps: Annotated[int, typer.Option(min=1, help="as for `profstream process`")] = 5,
    top_k: Annotated[int, typer.Option(min=1, help="as for `profstream process`")] = 10,
    rolling_steps: Annotated[int, typer.Option(min=1, help="as for `profstream process`")] = 100,
) -> None:
    """The figures of existing profiles, in one process with no broker (the processors' own code):
    a summary per rank, and optionally the HTML report and Parquet files."""
    from profstream.integrations.ingest import IngestError
    from profstream.offline.analyze import analyze_to, rank_rows
    from profstream.processors.figures import FigureOptions
    from profstream.processors.stream import StreamOptions

    check_name(run_id, "run id")
    options = StreamOptions(figures=FigureOptions(top_k, stall_ratio, stall_steps, rolling_steps))
    try:
        done = analyze_to(traces, output, parquet, run_id, options, workers, device)
    except (IngestError, OSError) as e:
        fail(str(e))
    result = done.result
    for problem in result.problems:
        err.print(f"[red]not read:[/red] {problem}", highlight=False, soft_wrap=True)
    print_ranks(result, rank_rows(result))
    for r in result.ranks:
        for note in r.profile.notes:
            err.print(f"[yellow]note:[/yellow] rank {r.rank}: {note}", highlight=False, soft_wrap=True)
    for path in [done.report, *done.parquet]:
        if path is not None:
            out.print(str(path), highlight=False)
    if not result.steps:
        fail("no step could be computed: the profiles hold no step marks (ProfilerStep#N, Iteration N, Step N) "
             "or no ops inside them")


def print_ranks(result, rows: list[dict]) -> None:
    from rich.table import Table

    table = Table(title=f"{result.run_id}: {len(result.ranks)} rank(s), {len(result.steps)} steps, "
                        f"{result.ops:,} ops (read {result.parse_s:.2f} s, figures {result.figures_s:.2f} s)")
    cols = ("rank", "steps", "device steps", "step ms", "host step ms", "data wait %", "util %", "overlap %",
            "idle %", "compute %", "comm %", "memcpy %", "memset %", "uncorrelated")
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        if "steps" not in r:
            table.add_row(str(r["rank"]), "0", *["—"] * (len(cols) - 2))
            continue
        kinds = r["kinds"]
        table.add_row(str(r["rank"]), str(r["steps"]), str(r["device_steps"]), f"{r['mean_step_ms']:.3f}",
                      f"{r['mean_host_step_ms']:.3f}", f"{100 * r['data_wait_share']:.1f}",
                      *(("—" if math.isnan(r[k]) else f"{100 * r[k]:.1f}")  # NaN: not measured
                        for k in ("utilization", "overlap_ratio", "idle_share")),
                      *(f"{100 * kinds[k]:.1f}" for k in ("compute", "communication", "memcpy", "memset")),
                      str(r["uncorrelated_ops"]))
    out.print(table)
