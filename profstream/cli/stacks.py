"""`profstream stacks`: every rank's Python stacks now, merged across ranks (docs/capture.md)."""

from __future__ import annotations

import json
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
    out,
    stop_on_signals,
)
from profstream.config import ConfigError, check_name


@app.command()
def stacks(
    run: Annotated[str, typer.Option(help="the run whose ranks to ask")],
    ranks: Annotated[str, typer.Option(help="all, or ranks such as 0,3-5")] = "all",
    timeout_s: Annotated[float, typer.Option(min=0.5, help="wait this long at most for the ranks' answers (a "
                                                           "live rank answers within a second)")] = 15.0,
    own_threads: Annotated[bool, typer.Option("--own-threads", help="also show profstream's own threads (the "
                                                                    "Monitor's sender and reader)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print every rank's answer as JSON instead")] = False,
    latest: Annotated[bool, typer.Option("--latest", help="ask nothing: print the answers to the run's latest "
                                                          "stacks request, whoever sent it (autocapture asks on "
                                                          "TrainingHang), read back from the control topic "
                                                          "(--ranks, --timeout-s, --reason do not apply)")] = False,
    since_s: Annotated[float, typer.Option(min=1.0, help="with --latest: look this many seconds back")] = 86400.0,
    reason: Annotated[str, typer.Option(help="why, kept with the request")] = "",
    bootstrap: BootstrapOpt = None,
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    topic_prefix: PrefixOpt = "profstream",
) -> None:
    """Every rank's Python thread stacks now, the training thread's included: ranks whose stacks are the same are
    merged, the odd one out first. With --latest, the answers already on the control topic instead (those autocapture
    asked for when TrainingHang fired). Exit status 1 when some rank did not answer, 2 (one line) when none did."""
    import getpass
    import socket

    from profstream.cli.control import LIVE_ANSWER_S, UNSEEN_ANSWER_S, unanswered
    from profstream.control.client import RUN_SEEN_S, runs_seen
    from profstream.control.records import RequestError, parse_ranks
    from profstream.control.stacks import ask_stacks, latest_stacks, stacks_lines

    try:
        check_name(run, "run id")
        asked = parse_ranks(ranks)
    except (ConfigError, RequestError) as e:
        fail(str(e))
    boot, topics = connect(bootstrap, topic_prefix)
    if latest:
        try:
            answer = latest_stacks(boot, topics, run, since_s, own_threads)
        except LookupError as e:
            fail(str(e))
        if answer is None:
            fail(f"no rank of run {run} answered a stacks request in the last {since_s / 3600:g} h: ask now with "
                 f"`profstream stacks --run {run}`, or look further back with --since-s")
    else:
        seen = runs_seen(boot, topics, RUN_SEEN_S, run).get(run)
        stop = stop_on_signals()
        try:
            answer = ask_stacks(boot, topics, run, ranks=asked, timeout_s=timeout_s, reason=reason,
                                unanswered_s=min(timeout_s, UNSEEN_ANSWER_S if seen is None else LIVE_ANSWER_S),
                                requested_by=f"{getpass.getuser()}@{socket.gethostname()}", own_threads=own_threads,
                                stop=stop.is_set)
        except LookupError as e:
            fail(str(e))
        if not answer.progress.ranks and answer.progress.whole is None:
            fail(unanswered(run, seen, answer.waited_s, boot, topics, "stacks"))
    if as_json:
        out.print_json(json.dumps({"request_id": answer.request["request_id"], "run_id": run,
                                   "answered": answer.answered, "refused": answer.refused,
                                   "missing": answer.missing(),
                                   "groups": [{"ranks": g.ranks, "hosts": g.hosts} for g in answer.groups]}))
    else:
        for line in stacks_lines(answer):
            out.print(line, highlight=False, soft_wrap=True, markup=False)
    if answer.missing() or answer.refused or answer.progress.whole is not None:
        err.print(f"not every rank answered: see above ({len(answer.answered)} did)", highlight=False)
        raise typer.Exit(1)
