"""`profstream spool show / publish`: a Monitor's disk spool, seen and sent later."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from profstream.cli.common import BootstrapOpt, app, connect, err, fail, out

spool_app = typer.Typer(help="A Monitor's disk spool (spool_dir): what it holds, and sending it to Kafka later "
                             "(docs/monitor.md, \"Disk spool\").", no_args_is_help=True)
app.add_typer(spool_app, name="spool")

SpoolArg = Annotated[Path, typer.Argument(help="the spool_dir the Monitors wrote to")]
RunOpt = Annotated[str | None, typer.Option(help="only this run (default: every run in the spool)")]


def _print(rows, verb: str) -> None:
    from rich.table import Table

    table = Table("run", "rank", "records", "MiB", "ops", "samples", "damaged", verb)
    for r in rows:
        damaged = f"{r.corrupt_regions} ({r.corrupt_bytes} B)" if r.corrupt_regions else "-"
        table.add_row(r.run_id, str(r.rank), str(r.records), f"{r.bytes / 2**20:.1f}", str(r.ops), str(r.samples),
                      damaged, r.skipped and "skipped" or (f"{r.refused} refused" if r.refused else "yes"))
    out.print(table)
    for r in rows:
        if r.skipped:
            err.print(f"[yellow]warning:[/yellow] {r.skipped}", highlight=False, soft_wrap=True)
        if r.corrupt_regions:
            err.print(f"[yellow]warning:[/yellow] {r.path}: {r.corrupt_regions} damaged stretch(es), {r.corrupt_bytes} "
                      "bytes, skipped: their batches are lost (the processors count them as lost by seq)",
                      highlight=False, soft_wrap=True)
        for e in r.errors:
            err.print(f"[yellow]warning:[/yellow] {r.run_id} rank {r.rank}: Kafka refused a record: {e}",
                      highlight=False, soft_wrap=True)


@spool_app.command("show")
def show(spool: SpoolArg, run: RunOpt = None) -> None:
    """What each run and rank in the spool still has to send (every record read and checked)."""
    from profstream.producers.spool_publish import show_spool

    try:
        rows = show_spool(spool, run)
    except FileNotFoundError as e:
        fail(str(e))
    if not rows:
        fail(f"no spool of {'run ' + run if run else 'any run'} in {spool}")
    _print(rows, "readable")


@spool_app.command("publish")
def publish(
    spool: SpoolArg,
    bootstrap: BootstrapOpt = None,
    topic_prefix: Annotated[str | None, typer.Option(help="topic name prefix (<prefix>.raw)")] = None,
    run: RunOpt = None,
    keep: Annotated[bool, typer.Option(help="leave the spool as it is (a later publish sends it again; the "
                                            "processors count each batch once)")] = False,
    timeout_s: Annotated[float, typer.Option(min=1.0, help="longest wait for Kafka's acknowledgements of a "
                                                           "rank")] = 120.0,
) -> None:
    """Send the spool's records to <prefix>.raw in order, and take them off the spool as Kafka acknowledges them."""
    from profstream.producers.spool_publish import publish_spool

    boot, topics = connect(bootstrap, topic_prefix)
    try:
        rows = publish_spool(spool, boot, topics.prefix, run, keep=keep, timeout_s=timeout_s)
    except FileNotFoundError as e:
        fail(str(e))
    except (ConnectionError, TimeoutError) as e:
        fail(str(e))
    if not rows:
        fail(f"no spool of {'run ' + run if run else 'any run'} in {spool}")
    _print(rows, "published")
    if any(r.skipped or r.refused or r.corrupt_regions for r in rows):
        raise typer.Exit(1)
