"""What every command shares: the typer apps, the consoles, one-line errors, and the
opening of the commands that talk to Kafka (``connect``)."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from profstream.config import MONITOR_OPTIONS, resolve

if TYPE_CHECKING:
    from profstream.kafka.topics import Topics

app = typer.Typer(help="profstream: a live profiler for long training runs.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
stack_app = typer.Typer(help="A local Kafka (KRaft) for trying profstream out: one broker, or a cluster of "
                             "several on loopback (--brokers N) for fault tests.",
                        no_args_is_help=True)
app.add_typer(stack_app, name="stack")
sink_app = typer.Typer(help="Sinks: export the processed topics (Prometheus, Grafana, timeline files, archive).",
                       no_args_is_help=True)
app.add_typer(sink_app, name="sink")
grafana_app = typer.Typer(help="Grafana dashboards and annotations.", no_args_is_help=True)
app.add_typer(grafana_app, name="grafana")
export_app = typer.Typer(help="Files for notebooks from an archive.", no_args_is_help=True)

# Off a terminal rich assumes 80 columns, too narrow for the summary table.
out = Console(width=None if sys.stdout.isatty() else 140)
err = Console(stderr=True)


def fail(message: str) -> None:
    err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def resolve_bootstrap(given: str | None) -> str:
    """--bootstrap, else PROFSTREAM_BOOTSTRAP / PROFSTREAM_OPTIONS, else the running local
    stack's broker, else the default."""
    import os

    from profstream.config import _env_options

    if given is None and "PROFSTREAM_BOOTSTRAP" not in os.environ and "bootstrap" not in _env_options(os.environ):
        from profstream.stack import stack_status

        broker = stack_status()
        if broker is not None:
            return broker.bootstrap
    # the whole table: PROFSTREAM_OPTIONS may hold other Monitor options beside bootstrap
    return resolve(MONITOR_OPTIONS, {"bootstrap": given})["bootstrap"]


def connect(bootstrap: str | None, topic_prefix: str | None = None, timeout: float = 15.0) -> tuple[str, Topics]:
    """The opening of every command that talks to Kafka: the --topic-prefix checked (a
    one-line error), the broker resolved (``resolve_bootstrap``) and answering. Returns
    (bootstrap, topics of the prefix, or of the default prefix when none is given)."""
    from profstream.kafka.topics import DEFAULT_PREFIX, Topics, validate_prefix
    from profstream.stack import wait_for_broker

    try:
        topics = Topics(validate_prefix(DEFAULT_PREFIX if topic_prefix is None else topic_prefix))
    except ValueError as e:
        fail(str(e))
    boot = resolve_bootstrap(bootstrap)
    wait_for_broker(boot, timeout)
    return boot, topics


def stop_on_signals() -> threading.Event:
    """An event that SIGINT and SIGTERM set: a long-running command stops cleanly on either."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def parse_range(value: str | None, flag: str) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        a, b = (int(x) for x in value.split(":"))
    except ValueError:
        fail(f"{flag} {value!r}: expected A:B, two step numbers such as 20:34")
    if a > b or a < 0:
        fail(f"{flag} {value!r}: expected 0 <= A <= B")
    return a, b


DirOpt = Annotated[Path | None, typer.Option("--dir", help="state directory of the broker "
                                                          "(default: ~/.cache/profstream/stack)")]
BootstrapOpt = Annotated[str | None, typer.Option(help="Kafka bootstrap servers host:port (default: "
                                                       "$PROFSTREAM_BOOTSTRAP, else the local `stack up` broker)")]
PrefixOpt = Annotated[str, typer.Option(help="topic name prefix (<prefix>.raw, <prefix>.steps, ...)")]
WaitTopicsOpt = Annotated[float, typer.Option(min=0.0, help="wait this long for the input topics to exist (a sink "
                                                            "started beside the processor that creates them); 0: not")]


def step_progress(total: int, what: str):
    progress = Progress(TextColumn(f"[bold]{what}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                        TimeRemainingColumn(), console=err, transient=True)
    task = progress.add_task(what, total=total)
    return progress, lambda _plan, n=1: progress.advance(task, n)


def work_progress(what: str, enabled: bool | None, unit: str = "MB"):
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

