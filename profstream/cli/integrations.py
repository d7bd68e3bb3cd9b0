"""`profstream ingest` and `profstream run`: existing profiles and unchanged PyTorch scripts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from profstream.cli.common import (
    BootstrapOpt,
    KafkaConfigOpt,
    KafkaPropertyOpt,
    PrefixOpt,
    app,
    connect,
    err,
    fail,
    monitor_kafka_options,
    out,
    resolve_connection,
)
from profstream.config import check_name

# -- ingest ---------------------------------------------------------------------------

@app.command()
def ingest(
    path: Annotated[Path, typer.Argument(help="Chrome trace JSON (.json/.json.gz: PyTorch, Kineto, MindSpore "
                                              "or msprof timeline), a MindSpore profiler output directory, a "
                                              "torch_npu / MindSpore *_ascend_pt / *_ascend_ms folder or an "
                                              "msprof PROF_* directory")],
    run_id: Annotated[str, typer.Option(help="run identifier the profile is sent as")],
    rank: Annotated[int | None, typer.Option(min=0, help="rank (default: the one the profile names, else 0)")]
    = None,
    pace: Annotated[str, typer.Option(help="max: as fast as possible; realtime: steps as far apart as "
                                           "they were")] = "max",
    format: Annotated[str, typer.Option(help="auto, chrome, mindspore, ascend or msprof")] = "auto",
    base_ns: Annotated[int | None, typer.Option(help="ns since the epoch of time 0 of a relative trace "
                                                     "(default: it ended at the file's modification time)")]
    = None,
    step_trace_unit_ns: Annotated[float | None, typer.Option(min=0.001, help="ns per unit of a MindSpore step "
                                                                           "trace (default: from the profiler's "
                                                                           "files; 10 for Ascend's 100 MHz counter)")]
    = None,
    device: Annotated[str | None, typer.Option(help="device reported with the events, e.g. cuda:0, npu:3 "
                                                    "(default: the profile's, else the Monitor's)")] = None,
    workers: Annotated[int | None, typer.Option(min=1, help="processes that parse a Chrome trace of 16 MiB or "
                                                           "more (default: one per CPU; 1: one process)")] = None,
    bootstrap: BootstrapOpt = None,
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    topic_prefix: PrefixOpt = "profstream",
) -> None:
    """Send an existing profile to Kafka as raw events, as a live producer would (docs/ingest.md)."""
    from profstream.integrations.ingest import IngestError
    from profstream.integrations.ingest import ingest as ingest_profile

    check_name(run_id, "run id")
    boot, _ = connect(bootstrap, topic_prefix)
    try:
        result = ingest_profile(path, {"connection": boot, "run_id": run_id, "topic_prefix": topic_prefix,
                                       "device": device}, format=format, pace=pace, rank=rank, base_ns=base_ns,
                                step_trace_unit_ns=step_trace_unit_ns, workers=workers)
    except IngestError as e:
        fail(str(e))
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
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    run_id: Annotated[str | None, typer.Option(help="run identifier (default: one per launch)")] = None,
    topic_prefix: Annotated[str | None, typer.Option(help="topic name prefix")] = None,
    start_step: Annotated[int | None, typer.Option(help="first step whose ops are captured")] = None,
    stop_step: Annotated[int | None, typer.Option(help="last step whose ops are captured")] = None,
    every_n_steps: Annotated[int | None, typer.Option(help="capture ops on every n-th step")] = None,
    capture_ops: Annotated[bool | None, typer.Option("--capture-ops/--no-capture-ops",
                                                     help="op capture with torch.profiler (default: on)")] = None,
    collective_bytes: Annotated[bool | None, typer.Option(
        "--collective-bytes", help="record tensor shapes so collectives carry their message size (bandwidth)")] = None,
    spool_dir: Annotated[str | None, typer.Option(help="disk spool: what Kafka cannot take is written there and "
                                                       "sent when it is back")] = None,
    record_only: Annotated[bool | None, typer.Option(
        "--record-only", help="no broker: every batch goes to --spool-dir, for `profstream spool publish`")] = None,
) -> None:
    """Profile a PyTorch training script without changing it: profstream run -- python train.py ARGS (docs/torch.md).

    Every signal it gets (TERM, INT, HUP, QUIT, USR1, USR2) is passed on to the script, and
    it exits with the script's status; killed, it takes the script with it."""
    from profstream.integrations.launch import run_profiled

    options = {**monitor_kafka_options(resolve_connection(bootstrap)), "run_id": run_id, "topic_prefix": topic_prefix,
               "start_step": start_step, "stop_step": stop_step, "every_n_steps": every_n_steps,
               "collective_bytes": collective_bytes, "spool_dir": spool_dir, "record_only": record_only}
    passed: list[str] = []

    def say(what: str) -> None:
        passed.append(what)
        err.print(f"profstream run: {what}", highlight=False, soft_wrap=True)

    try:
        code = run_profiled(command, options, {"capture_ops": capture_ops}, say)
    except FileNotFoundError:
        fail(f"command not found: {command[0]!r} (give the full command after --, e.g. profstream run -- "
              "python train.py)")
    except ValueError as e:  # ConfigError is a ValueError
        fail(str(e))
    if passed:  # told to end: say how it did (its Monitors said what they sent and dropped)
        err.print(f"profstream run: {command[0]} exited with status {code}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)
