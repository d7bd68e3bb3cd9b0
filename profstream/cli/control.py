"""`profstream capture`, `profstream autocapture` and `profstream webhook`: the control plane."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from profstream.cli.common import (
    BootstrapOpt,
    KafkaConfigOpt,
    KafkaPropertyOpt,
    PrefixOpt,
    WebConfigOpt,
    app,
    connect,
    err,
    fail,
    out,
    stop_on_signals,
)
from profstream.config import ConfigError, check_name

# -- capture ------------------------------------------------------------------------------

_STYLE = {"armed": "cyan", "started": "yellow", "finished": "green", "refused": "red"}


def _progress_table(progress):
    from rich.table import Table

    from profstream.control.records import format_ranks

    request = progress.request
    table = Table(title=f"capture {request['request_id'][:12]}: run {request['run_id']}, ranks "
                        f"{format_ranks(request['ranks'])}, {request['steps']} steps")
    for col in ("rank", "state", "steps", "ops", "note"):
        table.add_column(col, overflow="fold")
    if progress.whole is not None:
        table.add_row("all", f"[red]{progress.whole['state']}[/]", "", "", progress.whole["reason"])
    for rank in sorted(set(progress.ranks) | set(progress.expected() or ())):
        s = progress.ranks.get(rank)
        if s is None:
            table.add_row(str(rank), "[dim]waiting[/]", "", "", "")
            continue
        steps = f"{s['first_step']}-{s['last_step']}" if s["first_step"] is not None else ""
        ops = str(s["ops"]) if s["state"] == "finished" else ""
        table.add_row(str(rank), f"[{_STYLE[s['state']]}]{s['state']}[/]", steps, ops, s["reason"] or s["host"])
    return table


def _timeline_lines(progress, timeline_dir: Path | None, wait_s: float) -> list[str]:
    """Where each finished rank's captured steps are, as timeline files."""
    from profstream.sinks.timeline import window_files

    finished = progress.finished()
    if not finished:
        return []
    run_id = progress.request["run_id"]
    if timeline_dir is None:
        return [f"rank {r}: steps {s['first_step']}-{s['last_step']} in <timeline dir>/{run_id}/rank-{r}/ "
                f"(the --out of `profstream sink timeline`; give --timeline-dir to list the files)"
                for r, s in finished.items()]
    deadline = time.monotonic() + wait_s
    while True:  # the timeline sink writes the captured window once its last step has closed
        files = {r: window_files(timeline_dir, run_id, r, s["first_step"], s["last_step"]) for r, s in finished.items()}
        if all(files.values()) or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    return [f"rank {r}: " + (", ".join(str(p) for p in files[r]) or
                             f"no file for steps {s['first_step']}-{s['last_step']} under {timeline_dir}/{run_id}/"
                             f"rank-{r} yet (is `profstream sink timeline --out {timeline_dir}` running?)")
            for r, s in finished.items()]


@app.command()
def capture(
    run: Annotated[str | None, typer.Option(help="the run whose ops to capture")] = None,
    ranks: Annotated[str, typer.Option(help="all, or ranks such as 0,3-5")] = "all",
    steps: Annotated[int, typer.Option(min=1, help="steps to capture (each rank refuses more than its "
                                                   "capture_max_steps, 100 by default)")] = 20,
    start_step: Annotated[int | None, typer.Option(min=0, help="first step to capture (default: each rank's "
                                                               "next step)")] = None,
    activities: Annotated[str, typer.Option(help="what the profiler records: cpu, cuda or cpu,cuda")] = "cpu,cuda",
    record_shapes: Annotated[bool, typer.Option("--record-shapes", help="torch.profiler's record_shapes")] = False,
    profile_memory: Annotated[bool, typer.Option("--profile-memory", help="torch.profiler's profile_memory")]
    = False,
    with_stack: Annotated[bool, typer.Option("--with-stack", help="torch.profiler's with_stack")] = False,
    reason: Annotated[str, typer.Option(help="why, shown with the capture")] = "",
    expires_s: Annotated[float, typer.Option(min=0.1, help="a rank that has not started by then refuses")] = 300.0,
    wait: Annotated[bool, typer.Option("--wait", help="show each rank's progress until all finished or "
                                                      "refused, then where the timeline files are")] = False,
    timeout_s: Annotated[float, typer.Option(min=0.1, help="with --wait: give up after this long")] = 600.0,
    timeline_dir: Annotated[Path | None, typer.Option(help="the --out of `profstream sink timeline`: list the "
                                                           "captured window's files")] = None,
    list_: Annotated[bool, typer.Option("--list", help="list recent requests and their states instead")] = False,
    since_s: Annotated[float, typer.Option(min=1.0, help="with --list: requests of this many seconds")] = 86400.0,
    bootstrap: BootstrapOpt = None,
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    topic_prefix: PrefixOpt = "profstream",
) -> None:
    """Ask the ranks of a running job to capture ops for some steps (docs/capture.md)."""
    import getpass
    import socket

    from profstream.control.client import (
        RUN_SEEN_S,
        follow,
        recent_requests,
        request_topic,
        runs_seen,
        send_request,
    )
    from profstream.control.records import RequestError, new_request, parse_ranks

    if run is not None:
        try:
            check_name(run, "run id")
        except ConfigError as e:
            fail(str(e))
    if list_:
        boot, topics = connect(bootstrap, topic_prefix)
        try:
            found = recent_requests(boot, topics, since_s, run)
        except LookupError as e:
            fail(str(e))
        _print_list(found, since_s)
        return
    if run is None:
        fail("give --run RUN (the run id of the job), or --list to see recent requests")
    try:
        request = new_request(run, ranks=parse_ranks(ranks), start_step=start_step, steps=steps,
                              activities=tuple(a.strip() for a in activities.split(",") if a.strip()),
                              record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack,
                              reason=reason, requested_by=f"{getpass.getuser()}@{socket.gethostname()}",
                              expires_s=expires_s)
    except RequestError as e:
        fail(str(e))
    bad = [a for a in request["activities"] if a not in ("cpu", "cuda")]
    if bad:
        fail(f"--activities {activities!r}: use cpu, cuda or cpu,cuda")
    boot, topics = connect(bootstrap, topic_prefix)
    seen = runs_seen(boot, topics, RUN_SEEN_S, run).get(run)  # the processors' last step of the run
    try:
        offset = send_request(boot, topics, request)
    except LookupError as e:
        fail(str(e))
    err.print(f"sent capture request {request['request_id']} to {request_topic(boot, topics)} (offset {offset})",
              highlight=False)
    if seen is None:
        err.print(f"warning: the processors have shown no step of run {run} in the last {RUN_SEEN_S / 60:g} min: "
                  "is the run id right?", highlight=False, soft_wrap=True)
    if not wait:
        out.print(request["request_id"], highlight=False)
        return
    from rich.live import Live

    stop = stop_on_signals()
    # a live Monitor answers within a second: an unknown run is said at once, not after --timeout-s
    unanswered_s = min(timeout_s, UNSEEN_ANSWER_S if seen is None else LIVE_ANSWER_S)
    started = time.monotonic()
    if err.is_terminal:  # a live table while it waits, gone when the final one is printed
        with Live(_progress_table(_empty(request)), console=err, auto_refresh=False, transient=True) as live:
            progress = follow(boot, topics, request, timeout_s, stop=stop.is_set, unanswered_s=unanswered_s,
                              on_change=lambda p: live.update(_progress_table(p), refresh=True))
    else:  # a log or a pipe: the final table once
        progress = follow(boot, topics, request, timeout_s, stop=stop.is_set, unanswered_s=unanswered_s)
    waited = time.monotonic() - started
    if not progress.ranks and progress.whole is None:
        fail(unanswered(run, seen, waited, boot, topics, "capture"))
    out.print(_progress_table(progress))
    for line in _timeline_lines(progress, timeline_dir, wait_s=30.0):
        out.print(line, highlight=False, soft_wrap=True)
    missing = progress.missing()
    if not progress.done():
        fail(f"ranks {', '.join(map(str, missing))} have not finished within {waited:.0f} s (--timeout-s): is the "
             "run still going? `profstream capture --list` shows what came back")
    if progress.whole is not None or missing or len(progress.finished()) < len(progress.ranks):
        raise typer.Exit(1)


LIVE_ANSWER_S = 10.0  # a run the processors show: its ranks' readers answer within a second
UNSEEN_ANSWER_S = 5.0  # a run they do not: a rank starting now would still answer in this time


def unanswered(run: str, seen: float | None, waited: float, bootstrap: str, topics, what: str) -> str:
    """Why no Monitor of ``run`` answered a ``what`` (capture, stacks) request, in one line."""
    from profstream.control.client import RUN_SEEN_S, runs_seen

    if seen is not None:
        return (f"no Monitor of run {run} answered the {what} request within {waited:.0f} s, though the processors "
                f"showed a step of it {time.time() - seen:.0f} s ago: its Monitors read no requests (control=false, "
                f"or a Monitor older than {what} requests), or every rank is stuck holding the GIL")
    others = sorted(runs_seen(bootstrap, topics, 120.0))
    return (f"no rank of run {run} has been seen: no Monitor of it answered the {what} request within {waited:.0f} s and "
            "the processors have shown "
            f"no step of it in the last {RUN_SEEN_S / 60:g} min; check --run (runs of the last 2 min: "
            f"{', '.join(others[:10]) or 'none'}{' ...' if len(others) > 10 else ''})")


def _empty(request: dict):
    from profstream.control.client import CaptureProgress

    return CaptureProgress(request)


def _print_list(found, since_s: float) -> None:
    from datetime import UTC, datetime

    from rich.table import Table

    from profstream.control.records import describe_request, who_asked

    table = Table(title=f"capture requests of the last {since_s / 3600:g} h")
    for col in ("sent (UTC)", "request", "what", "by", "reason", "states"):
        table.add_column(col, overflow="fold")
    for item in found:
        r, p = item.request, item.progress
        states: dict[str, int] = {}
        for s in p.ranks.values():
            states[s["state"]] = states.get(s["state"], 0) + 1
        summary = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
        if p.whole is not None:
            summary = f"{p.whole['state']}: {p.whole['reason']}"
        table.add_row(datetime.fromtimestamp(r["requested_ns"] / 1e9, UTC).strftime("%m-%d %H:%M:%S"),
                      r["request_id"][:12], describe_request(r), who_asked(r), r["reason"],
                      summary or "no answer")
    out.print(table)


# -- autocapture and webhook --------------------------------------------------------------

PolicyOpt = Annotated[Path | None, typer.Option(help="the policy file (YAML; deploy/autocapture.yml lists every "
                                                     "key and its default)")]


TokenFileOpt = Annotated[Path | None, typer.Option(
    help="file of the bearer token every POST must carry (Alertmanager: http_config.authorization."
         "credentials_file; default: $PROFSTREAM_WEBHOOK_TOKEN itself); required with a webhook")]


def _webhook_token(token_file: Path | None) -> str:
    """The webhook's bearer token: --token-file, else $PROFSTREAM_WEBHOOK_TOKEN; one line
    saying what to give when neither is there."""
    import os

    from profstream.web_config import read_token

    if token_file is not None:
        return read_token(token_file)
    token = os.environ.get("PROFSTREAM_WEBHOOK_TOKEN", "").strip()
    if not token:
        fail("the webhook needs a bearer token: give --token-file FILE (or $PROFSTREAM_WEBHOOK_TOKEN) and the same "
             "token to Alertmanager (http_config.authorization.credentials_file; deploy/alertmanager.yml)")
    return token


def _serve(bootstrap: str | None, topic_prefix: str, policy_file: Path | None, read_alerts: bool,
           webhook_port: int, addr: str, token_file: Path | None = None, web_config: Path | None = None) -> None:
    """autocapture (read_alerts: it also guards the control topic) or webhook alone."""
    from profstream.control.policy import CapturePolicy
    from profstream.control.service import AutoCaptureService
    from profstream.web_config import WebConfig

    try:
        policy = CapturePolicy.load(policy_file)
        token = _webhook_token(token_file) if webhook_port else ""
        web = WebConfig(web_config) if web_config is not None and webhook_port else None
    except ConfigError as e:
        fail(str(e))
    boot, topics = connect(bootstrap, topic_prefix)
    service = AutoCaptureService(boot, topics, policy, read_alerts=read_alerts, guard=read_alerts,
                                 on_outcome=lambda o: err.print(o.line(), highlight=False, soft_wrap=True))
    url = None
    if webhook_port:
        try:
            url = service.serve_webhook(webhook_port, addr, token, web)
        except OSError as e:
            fail(f"cannot serve the webhook on port {webhook_port} ({e.strerror}): choose another port")

    def ready() -> None:
        inputs = ([topics.alerts] if read_alerts else []) + ([url] if url else [])
        err.print(f"asking for captures on {', '.join(inputs)} alerts ({', '.join(policy.alerts)}; at most one per "
                  f"run per {policy.min_interval_s:g} s) into {service.request_topic} ({boot}); Ctrl-C stops",
                  highlight=False, soft_wrap=True)

    try:
        service.run(stop_on_signals(), ready=ready)
    except RuntimeError as e:
        fail(str(e))


@app.command()
def autocapture(
    bootstrap: BootstrapOpt = None,
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    policy: PolicyOpt = None,
    webhook_port: Annotated[int, typer.Option(min=0, max=65535, help="also serve Alertmanager's webhook here "
                                                                     "(0: off)")] = 0,
    addr: Annotated[str, typer.Option(help="address the webhook listens on (0.0.0.0: every interface)")]
    = "127.0.0.1",
    token_file: TokenFileOpt = None,
    web_config: WebConfigOpt = None,
) -> None:
    """Ask for op captures when alerts fire (DataQueueStall from the alerts topic; with --webhook-port, every
    alert Alertmanager sends), rate-limited per run; on TrainingHang ask every rank for its stacks instead (once per
    hang: `profstream stacks --run R --latest` prints them); refuse requests for runs that do not exist."""
    _serve(bootstrap, topic_prefix, policy, True, webhook_port, addr, token_file, web_config)


@app.command()
def webhook(
    bootstrap: BootstrapOpt = None,
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    policy: PolicyOpt = None,
    port: Annotated[int, typer.Option(min=1, max=65535, help="serve Alertmanager's webhook here")] = 9466,
    addr: Annotated[str, typer.Option(help="address to listen on (0.0.0.0: every interface)")] = "127.0.0.1",
    token_file: TokenFileOpt = None,
    web_config: WebConfigOpt = None,
) -> None:
    """Alertmanager's webhook receiver alone: firing alerts with a run label become capture requests."""
    _serve(bootstrap, topic_prefix, policy, False, port, addr, token_file, web_config)


@app.command()
def advise(
    run: Annotated[str, typer.Option("--run", help="the run to advise on")],
    bootstrap: BootstrapOpt = None,
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    steps: Annotated[int, typer.Option(min=1, help="newest StepMetrics of each rank to read, about")] = 200,
) -> None:
    """What to do about a live run's starved steps and long tails, rank by rank, with the figures."""
    from profstream.sinks.advise import advice_lines, run_advice

    boot, topics = connect(bootstrap, topic_prefix)
    try:
        ranks = run_advice(boot, topics, run, steps)
    except RuntimeError as e:
        fail(str(e))
    if not ranks:
        fail(f"no step of run {run} on {topics.steps}: check --run (and --topic-prefix), or that its processors run")
    for line in advice_lines(ranks):
        out.print(line, highlight=False, soft_wrap=True)
