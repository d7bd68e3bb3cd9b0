"""`profstream doctor`: what a user needs, checked, with what to do about each problem."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from profstream.cli.common import (
    KafkaConfigOpt,
    KafkaPropertyOpt,
    PrefixOpt,
    app,
    kafka_arguments,
    out,
)


@app.command()
def doctor(
    bootstrap: Annotated[str | None, typer.Option(help="check this broker and its topics (default: "
                                                       "$PROFSTREAM_BOOTSTRAP, else the local `stack up` broker if it runs)")] = None,
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    gpu: Annotated[bool, typer.Option("--gpu", help="a GPU machine: no NVML is a failure, not information")] = False,
    build_walk: Annotated[bool, typer.Option("--build-walk", help="build op capture's compiled trace walk "
                                                                  "now if it is not built (about 25 s)")] = False,
    timeout: Annotated[float, typer.Option(min=0.1, help="seconds to wait for the broker")] = 5.0,
    role: Annotated[str | None, typer.Option(help="also check each ACL this role needs (trainer, processor, sink, "
                                                  "capture, autocapture) with the connection's credentials")] = None,
    group: Annotated[list[str] | None, typer.Option("--group", help="with --role: its consumer group (default: "
                                                                     "profstream's)")] = None,
) -> None:
    """Check what profstream needs (Python, PROFSTREAM_* options, Java, Kafka jars, broker and topics or, with
    --kafka-config and --role, the connection and each ACL the role needs, Prometheus, torch and the compiled
    walk, NVML, free ports) and say what to do about each problem; exit 1 on a failure."""
    from rich.markup import escape

    from profstream.doctor import failed, run_checks

    findings = run_checks(bootstrap, topic_prefix, gpu=gpu, build_walk=build_walk, broker_timeout_s=timeout,
                          kafka=kafka_arguments(), role=role, groups=tuple(group or ()))
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
