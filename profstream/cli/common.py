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
    from profstream.kafka.connection import Connection
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
acl_app = typer.Typer(help="Least privilege on a broker with ACLs: the ACLs of each role (trainer, processor, sink, "
                           "capture, autocapture), shown or applied (docs/security.md).", no_args_is_help=True)
app.add_typer(acl_app, name="acl")
app.add_typer(grafana_app, name="grafana")
export_app = typer.Typer(help="Files for notebooks from an archive.", no_args_is_help=True)

# Off a terminal rich assumes 80 columns, too narrow for the summary table.
out = Console(width=None if sys.stdout.isatty() else 140)
err = Console(stderr=True)


def fail(message: str) -> None:
    err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def kafka_arguments() -> dict:
    """--kafka-config and -X of the command being run (every command that talks to Kafka
    declares them: ``KafkaConfigOpt``, ``KafkaPropertyOpt``), as option arguments."""
    try:  # typer vendors click from 0.2x on; before that, click's own
        from typer._click.globals import get_current_context
    except ImportError:
        from click import get_current_context

    ctx = get_current_context(silent=True)
    params = ctx.params if ctx is not None else {}
    return {"kafka_config": params.get("kafka_config"),
            "kafka_properties": list(params["kafka_property"]) if params.get("kafka_property") else None}


def resolve_connection(given: str | None, arguments: dict | None = None) -> Connection:
    """The command's Kafka connection, built once: --bootstrap, else PROFSTREAM_BOOTSTRAP /
    PROFSTREAM_OPTIONS, else bootstrap.servers of the client properties, else the running
    local stack's broker, else the default; the client properties of --kafka-config /
    PROFSTREAM_KAFKA_CONFIG with -X / PROFSTREAM_KAFKA_PROPERTIES over them."""
    import os

    from profstream.config import option_given
    from profstream.kafka.connection import Connection

    args = dict(kafka_arguments() if arguments is None else arguments, bootstrap=given)
    # the whole table: PROFSTREAM_OPTIONS may hold other Monitor options beside these
    options = resolve(MONITOR_OPTIONS, args)
    given_anywhere = option_given("bootstrap", args, os.environ)
    conn = Connection.from_options(options, bootstrap_given=given_anywhere)
    if not given_anywhere and conn.bootstrap == options["bootstrap"]:  # not from the properties either
        from profstream.stack import stack_status

        broker = stack_status()
        if broker is not None:
            return conn.with_bootstrap(broker.bootstrap)
    return conn


def monitor_kafka_options(conn: Connection) -> dict:
    """The Monitor options that give Monitors this command's connection: its bootstrap and
    the command's --kafka-config / -X as given (references unread: a child process reads
    its own ${env:...})."""
    args = kafka_arguments()
    if args["kafka_config"]:
        args["kafka_config"] = str(Path(args["kafka_config"]).expanduser().resolve())
    return {"bootstrap": conn.bootstrap, **{k: v for k, v in args.items() if v is not None}}


def connect(bootstrap: str | None, topic_prefix: str | None = None, timeout: float = 15.0) -> tuple[Connection, Topics]:
    """The opening of every command that talks to Kafka: the --topic-prefix checked (a
    one-line error), the connection built (``resolve_connection``) and the broker answering
    it (a refused credential or certificate: one line at once). Returns (the connection,
    topics of the prefix, or of the default prefix when none is given)."""
    from profstream.kafka.topics import DEFAULT_PREFIX, Topics, validate_prefix
    from profstream.stack import wait_for_broker

    try:
        topics = Topics(validate_prefix(DEFAULT_PREFIX if topic_prefix is None else topic_prefix))
    except ValueError as e:
        fail(str(e))
    conn = resolve_connection(bootstrap)
    wait_for_broker(conn, timeout)
    return conn, topics


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
WebConfigOpt = Annotated[Path | None, typer.Option(
    "--web-config", metavar="FILE",
    help="TLS and basic auth of this endpoint: a web config file as Prometheus's exporters take it "
         "(tls_server_config, basic_auth_users with bcrypt hashes; docs/security.md)")]
KafkaConfigOpt = Annotated[str | None, typer.Option(
    "--kafka-config", "-F", metavar="FILE",
    help="Kafka client properties file (security.protocol, sasl.*, ssl.*: the standard names, as kcat -F or "
         "--command-config; default: $PROFSTREAM_KAFKA_CONFIG; docs/security.md)")]
KafkaPropertyOpt = Annotated[list[str] | None, typer.Option(
    "--kafka-property", "-X", metavar="KEY=VALUE",
    help="a Kafka client property over those of --kafka-config (repeat it; a secret as ${env:NAME} or "
         "${file:PATH})")]
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

