"""`profstream sink ...` and `profstream grafana push`: the live consumers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from profstream.cli.common import (
    BootstrapOpt,
    KafkaConfigOpt,
    KafkaPropertyOpt,
    PrefixOpt,
    WaitTopicsOpt,
    WebConfigOpt,
    connect,
    err,
    fail,
    grafana_app,
    out,
    sink_app,
    stop_on_signals,
    work_progress,
)
from profstream.config import ConfigError, check_name

# -- sinks (one section per sink below) ------------------------------------------------

@sink_app.command("prometheus")
def sink_prometheus(
    bootstrap: BootstrapOpt = None,
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    port: Annotated[int, typer.Option(min=0, max=65535, help="serve /metrics on this port")] = 9464,
    addr: Annotated[str, typer.Option(help="address to listen on (127.0.0.1: this machine only)")] = "0.0.0.0",
    web_config: WebConfigOpt = None,
    group_id: Annotated[str, typer.Option(help="consumer group; give every exporter replica its own")]
    = "profstream-prometheus",
    ttl_s: Annotated[float, typer.Option(min=1.0, help="drop the series of a run or rank silent this long")]
    = 900.0,
    top_k: Annotated[int, typer.Option(min=1, help="op types with series of their own per run (the "
                                                   "rest: other)")] = 10,
    top_ranks: Annotated[str, typer.Option(metavar="K|all", help="a run with more ranks keeps per-rank series "
                                           "for its K slowest only (mean of their last 5 steps); every run "
                                           "also gets quantiles over all its ranks")] = "64",
    wait_topics_s: WaitTopicsOpt = 60.0,
) -> None:
    """Serve every profstream figure to Prometheus (docs/metrics.md): steps, run and alerts topics in."""
    from profstream.sinks.prometheus import ExporterError, PrometheusExporter
    from profstream.sinks.rank_summary import parse_top_ranks

    try:
        kept_ranks = parse_top_ranks(top_ranks)
    except ValueError as e:
        fail(str(e))
    web = _web(web_config)
    boot, topics = connect(bootstrap, topic_prefix)
    exporter = PrometheusExporter(boot, topics, port=port, addr=addr, group_id=group_id,
                                  ttl_s=ttl_s, top_k=top_k, top_ranks=kept_ranks, wait_topics_s=wait_topics_s, web=web)
    try:
        url = exporter.serve()
    except ExporterError as e:
        fail(str(e))
    err.print(f"serving {url} from {boot} (topics {topic_prefix}.steps, .run, .alerts; group {group_id}); "
              "Ctrl-C stops", highlight=False, soft_wrap=True)
    try:
        exporter.run()
    except KeyboardInterrupt:
        pass
    finally:
        exporter.close()


def _web(path):
    """The --web-config of an endpoint, read now (a bad file: one line)."""
    if path is None:
        return None
    from profstream.web_config import WebConfig

    try:
        return WebConfig(path)
    except ConfigError as e:
        fail(str(e))


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
        fail(str(e))


@sink_app.command("grafana")
def sink_grafana(
    bootstrap: BootstrapOpt = None,
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    url: GrafanaUrlOpt = None,
    token: GrafanaTokenOpt = None,
    group_id: Annotated[str, typer.Option(help="consumer group of the Grafana sink")] = "profstream-grafana",
    run_idle_s: Annotated[float, typer.Option(min=0.1, help="a run without steps this long is marked "
                                                            "ended")] = 60.0,
    max_pending: Annotated[int, typer.Option(min=1, help="annotations kept while Grafana is down (the "
                                                         "oldest are dropped beyond)")] = 10000,
    timeline_url: Annotated[str, typer.Option(help="URL where the --out of `profstream sink timeline` is served: "
                                                   "capture annotations link their timeline file there")] = "",
    wait_topics_s: WaitTopicsOpt = 60.0,
) -> None:
    """Annotate Grafana: run start and end, alerts firing and resolved, op captures (steps, alerts and control
    topics in)."""
    from profstream.sinks.grafana import Grafana, GrafanaAnnotationSink
    from profstream.sinks.runner import run_sink

    grafana = Grafana.from_options(url, token)
    boot, topics = connect(bootstrap, topic_prefix)
    sink = GrafanaAnnotationSink(grafana, run_idle_s=run_idle_s, max_pending=max_pending, timeline_url=timeline_url)

    def started() -> None:
        err.print(f"annotating Grafana at {grafana.display_url} from {topics.steps}, {topics.alerts} and "
                  f"{topics.control} ({boot}, group {group_id}); Ctrl-C stops", highlight=False, soft_wrap=True)

    try:
        run_sink(boot, [topics.steps, topics.alerts, topics.control], group_id, sink, stop_on_signals(),
                 ready=started, wait_topics_s=wait_topics_s)
    except RuntimeError as e:  # a topic missing
        fail(str(e))


@sink_app.command("archive")
def sink_archive(
    out_dir: Annotated[Path, typer.Argument(help="archive directory (created if missing)")],
    bootstrap: BootstrapOpt = None,
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    topics: Annotated[str, typer.Option(help="comma-separated topics to archive, by their name after the "
                                             "prefix (requests: every request topic <prefix>.requests.*)")]
    = "raw,steps,control,requests",
    group_id: Annotated[str, typer.Option(help="consumer group of the archive sink")] = "profstream-archive",
    instance_id: Annotated[str, typer.Option(help="stable across restarts (static group membership)")] = "0",
    codec: Annotated[str, typer.Option(help="zstandard, deflate or null")] = "zstandard",
    max_bytes: Annotated[str, typer.Option(help="start a new file beyond this size")] = "64MiB",
    max_age_s: Annotated[float, typer.Option(min=0.001, help="finish a file this old")] = 300.0,
    progress: Annotated[bool | None, typer.Option("--progress/--no-progress", help="show progress (default: "
                                                  "when stderr is a terminal)")] = None,
    wait_topics_s: WaitTopicsOpt = 60.0,
) -> None:
    """Archive topics into Avro files (<dir>/<topic>/<run>/p<partition>/<first>-<last>.avro), exactly once."""
    from profstream.config import PARSERS
    from profstream.sinks.archive import CODECS, ArchiveError, run_archive

    try:
        check_name(instance_id, "instance id")
        size = PARSERS["size"](max_bytes)
    except ValueError as e:
        fail(str(e))
    if codec not in CODECS:
        fail(f"--codec {codec!r}: expected one of {', '.join(CODECS)}")
    boot, prefix = connect(bootstrap, topic_prefix)
    names = [prefix.requests_prefix if t.strip() == "requests" else f"{prefix.prefix}.{t.strip()}"
             for t in topics.split(",") if t.strip()]
    stop = stop_on_signals()
    bar, show = work_progress("archive", progress, unit="messages")

    def started(sink) -> None:
        err.print(f"archiving {', '.join(names)} from {boot} into {sink.root} (group {group_id}); Ctrl-C stops",
                  highlight=False, soft_wrap=True)

    try:
        with bar:
            stats = run_archive(boot, names, out_dir, stop, group_id=group_id, instance_id=instance_id,
                                progress=show, ready=started, codec=codec, max_bytes=size, max_age_s=max_age_s,
                                wait_topics_s=wait_topics_s)
    except (ArchiveError, RuntimeError) as e:
        fail(str(e))
    err.print(f"archived {stats.messages} messages in {stats.files} files", highlight=False)


@sink_app.command("timeline")
def sink_timeline(
    out_dir: Annotated[Path, typer.Option("--out", help="directory of the timeline files (created if missing)")],
    bootstrap: BootstrapOpt = None,
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    window_steps: Annotated[int, typer.Option(min=1, help="steps per file")] = 100,
    max_bytes: Annotated[str, typer.Option(help="most JSON text per file, before gzip (a bigger window is "
                                                "split into more files)")] = "20MB",
    group_id: Annotated[str, typer.Option(help="consumer group of the timeline sink")] = "profstream-timeline",
    wait_topics_s: WaitTopicsOpt = 60.0,
) -> None:
    """Write Perfetto / chrome://tracing timelines from the raw topic (<out>/<run>/rank-<r>/steps-<a>-<b>.json.gz);
    the steps of a capture request get a file of their own, and a run's latest stacks (profstream stacks, or
    autocapture on TrainingHang) are <out>/<run>/stacks.json.gz. Ranks are drawn on the run's clock once the run
    stage's clock offsets (run topic) are known."""
    from profstream.config import PARSERS
    from profstream.sinks.runner import run_sink
    from profstream.sinks.timeline import TimelineSink

    try:
        size = PARSERS["size"](max_bytes)
    except ValueError as e:
        fail(f"--max-bytes {max_bytes!r}: {e}")
    boot, topics = connect(bootstrap, topic_prefix)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        sink = TimelineSink(out_dir, window_steps=window_steps, max_bytes=size, control_topic=topics.control,
                            run_topic=topics.run)
    except ConfigError as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot create --out {out_dir} ({e.strerror}): choose a directory you can write")

    def started() -> None:
        err.print(f"writing timelines of {topics.raw} ({boot}, group {group_id}) into {out_dir}; Ctrl-C stops",
                  highlight=False, soft_wrap=True)

    try:
        run_sink(boot, [topics.raw, topics.control, topics.run], group_id, sink, stop_on_signals(), ready=started,
                 wait_topics_s=wait_topics_s)
    except RuntimeError as e:  # a topic missing
        fail(str(e))
    except OSError as e:
        fail(f"cannot write timeline files in {out_dir} ({e.strerror or e}): fix it and start again; "
              "nothing is lost, the sink goes on from its last file")
    stats = sink.stats()
    err.print(f"wrote {stats['files_written']} files ({stats['steps_written']} steps, {stats['ops_written']} ops)"
              + (f"; skipped undecodable messages: {stats['decode_errors']}" if stats["decode_errors"] else ""),
              highlight=False)
