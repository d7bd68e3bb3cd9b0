"""`profstream simulate` and `profstream process`: a synthetic run in, the processors on it."""

from __future__ import annotations

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
    parse_range,
    step_progress,
)
from profstream.config import check_name
from profstream.processors.hangs import HANG_AFTER_S

# Ranks `simulate` runs with a Monitor each as a training process has it (its own producer and
# threads); past that, only with --shared-producer (docs/benchmarks.md, "16,384 ranks simulated")
MAX_OWN_PRODUCER_RANKS = 1024


def sim_config(run_id, ranks, steps, ops_per_step, step_time_ms, comm_share, seed, stall, straggler,
                straggler_factor, leak_bytes_per_step, rate, device_counters=False, throttle=None, **work):
    """A SimConfig of the command's options; ``work``: the SimConfig fields of the steps' work
    (batch_size, seq_len, flops_per_token, peak_tflops, slowdown as "A:B", slowdown_factor)."""
    from profstream.simulate import SimConfig

    check_name(run_id, "run id")
    try:
        if work.get("slowdown") is not None:
            work["slowdown"] = parse_range(work["slowdown"], "--slowdown")
        return SimConfig(run_id=run_id, ranks=ranks, steps=steps, ops_per_step=ops_per_step,
                         step_time_ms=step_time_ms, comm_share=comm_share, seed=seed,
                         stall=parse_range(stall, "--stall"), straggler_rank=straggler,
                         straggler_factor=straggler_factor, leak_bytes_per_step=leak_bytes_per_step,
                         rate=rate, device_counters=device_counters or throttle is not None,
                         throttle=parse_range(throttle, "--throttle"), **work)
    except ValueError as e:
        fail(str(e))



@app.command()
def simulate(
    bootstrap: BootstrapOpt = None,
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    run_id: Annotated[str, typer.Option(help="run identifier")] = "sim",
    ranks: Annotated[int, typer.Option(min=1, max=65536, help=f"ranks of the run (over {MAX_OWN_PRODUCER_RANKS}: "
                                                              "with --shared-producer)")] = 2,
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
    device_counters: Annotated[bool, typer.Option(help="two device counter samples per step, rank r on "
                                                       "cuda:r")] = False,
    throttle: Annotated[str | None, typer.Option(help="thermal throttling on steps A:B (inclusive); implies "
                                                      "--device-counters")] = None,
    batch_size: Annotated[int, typer.Option(min=0, help="samples per step, each of --seq-len tokens: the steps' "
                                                        "work, for throughput (0: none)")] = 0,
    seq_len: Annotated[int, typer.Option(min=1, help="tokens per sample")] = 512,
    flops_per_token: Annotated[float, typer.Option(min=0.0, help="model FLOPs of a token, given per step (MFU "
                                                               "with --peak-tflops)")] = 0.0,
    peak_tflops: Annotated[float | None, typer.Option(min=0.001, help="the Monitors' peak_tflops")] = None,
    slowdown: Annotated[str | None, typer.Option(help="steps A:B (inclusive) take --slowdown-factor longer "
                                                      "for the same work (MFURegression)")] = None,
    slowdown_factor: Annotated[float, typer.Option(min=0.01)] = 2.0,
    topic_prefix: PrefixOpt = "profstream",
    procs: Annotated[int, typer.Option(help="producer processes that share the ranks out, each with the "
                                            "Monitors of its ranks (1 to --ranks)")] = 1,
    shared_producer: Annotated[bool, typer.Option(help="the Monitors of each process share one Kafka producer and "
                                                       "one sender thread, record in Python and read no capture "
                                                       "requests: thousands of ranks a process (each still encodes "
                                                       "its own batches, producer id and seq)")] = False,
) -> None:
    """Simulate a training run through the real Monitor (deterministic for a seed).

    Prints what was sent and every family dropped; SIGTERM ends the run as a run ends (the
    Monitors closed, their end marks saying SIGTERM), prints that and exits 143."""
    from profstream.simulate import run_simulation
    from profstream.simulate_procs import run_in_processes, shares

    cfg = sim_config(run_id, ranks, steps, ops_per_step, step_time_ms, comm_share, seed, stall, straggler,
                      straggler_factor, leak_bytes_per_step, rate, device_counters, throttle, batch_size=batch_size,
                      seq_len=seq_len, flops_per_token=flops_per_token, peak_tflops=peak_tflops, slowdown=slowdown,
                      slowdown_factor=slowdown_factor)
    try:
        shares(cfg.ranks, procs)
    except ValueError:
        fail(f"--procs {procs}: expected 1 to {cfg.ranks} (the number of --ranks) producer processes")
    if cfg.ranks > MAX_OWN_PRODUCER_RANKS and not shared_producer:
        fail(f"--ranks {cfg.ranks}: over {MAX_OWN_PRODUCER_RANKS} ranks, add --shared-producer (a Monitor with a "
             "producer and threads of its own per rank does not fit one machine)")
    boot, _ = connect(bootstrap)
    monitor_options = {"connection": boot, "topic_prefix": topic_prefix}
    progress, advance = step_progress(cfg.ranks * cfg.steps, "simulate")
    with progress:
        if procs == 1:
            result = run_simulation(cfg, monitor_options, progress=advance, shared_producer=shared_producer)
        else:
            try:
                result = run_in_processes(cfg, procs, monitor_options, progress=lambda n: advance(None, n),
                                          shared_producer=shared_producer)
            except RuntimeError as e:
                fail(str(e))
    out.print(f"run {cfg.run_id}: {result.summary(boot)}", highlight=False, soft_wrap=True)
    if result.ended_by:  # told to end (SIGTERM): the status a process it ended has
        raise typer.Exit(128 + result.ended_by)
    if not result.flushed:
        raise typer.Exit(1)



# -- process --------------------------------------------------------------------------

@app.command()
def process(
    bootstrap: BootstrapOpt = None,
    kafka_config: KafkaConfigOpt = None,
    kafka_property: KafkaPropertyOpt = None,
    topic_prefix: PrefixOpt = "profstream",
    group_id: Annotated[str, typer.Option(help="consumer group of the processors")] = "profstream-processor",
    instance_id: Annotated[str, typer.Option(help="unique per processor process and stable across its "
                                                  "restarts (transactional id, static membership)")] = "0",
    stages: Annotated[str, typer.Option(help="all, steps (raw -> steps) or run (steps -> run)")] = "all",
    grace_s: Annotated[float, typer.Option(min=0.0, help="wait after a step's end mark when "
                                                         "the producer sends no watermark")] = 2.0,
    run_grace_s: Annotated[float, typer.Option(min=0.0, help="wait for missing ranks of a step, from its "
                                                             "latest report")] = 10.0,
    idle_timeout_s: Annotated[float, typer.Option(min=1.0, help="close a run after this long silent")] = 60.0,
    hang_after_s: Annotated[float, typer.Option(min=0.5, help="TrainingHang fires when a rank still reporting has "
                                                              "been inside one step this long, on its own clock "
                                                              "(its RankProgress records; docs/figures.md, "
                                                              "Hangs)")] = HANG_AFTER_S,
    commit_interval_ms: Annotated[float, typer.Option(min=1.0, help="transaction commit interval")] = 100.0,
    run_idle_commit_ms: Annotated[float, typer.Option(min=1.0, help="the run stage commits a transaction with no "
                                                          "run step, alert or moved input offset in it at most this "
                                                          "often (its checkpoint waits; run steps commit at once)")
                                  ] = 5000.0,  # processors.runtime.RUN_IDLE_COMMIT_MS (too slow to import here)
    stall_ratio: Annotated[float, typer.Option(min=0.0, max=1.0, help="data_wait/step_time of a starved step")] = 0.3,
    stall_steps: Annotated[int, typer.Option(min=1, help="consecutive starved steps that fire DataQueueStall")] = 5,
    top_k: Annotated[int, typer.Option(min=1, help="op types reported per step (the rest: other)")] = 10,
    rolling_steps: Annotated[int, typer.Option(min=1, help="steps in the rolling window")] = 100,
    metrics_port: Annotated[int, typer.Option(min=0, max=65535, help="serve health metrics here (0: off)")] = 9465,
    metrics_addr: Annotated[str, typer.Option(help="address the health metrics listen on (127.0.0.1: this machine "
                                                   "only)")] = "0.0.0.0",
    web_config: WebConfigOpt = None,
    raw_partitions: Annotated[int, typer.Option(min=1, help="partitions of a raw topic created here")] = 12,
    max_outage_s: Annotated[float, typer.Option(min=1.0, help="exit (status 2, one line on stderr) when Kafka "
                                                              "has not come back after this long, for a "
                                                              "supervisor to restart the processor")] = 300.0,
) -> None:
    """Run a stream processor: raw events in; StepMetrics, RunStepMetrics and alerts out, exactly once."""
    from profstream.kafka.topics import ensure_topics
    from profstream.processors.figures import FigureOptions
    from profstream.processors.runtime import PROCESSOR_TOPICS, Processor

    try:
        check_name(instance_id, "instance id")
    except ValueError as e:
        fail(str(e))
    if stages not in ("all", "steps", "run"):
        fail(f"--stages {stages!r}: expected all, steps or run")
    web = None
    if web_config is not None:
        from profstream.config import ConfigError
        from profstream.web_config import WebConfig

        try:
            web = WebConfig(web_config)
        except ConfigError as e:
            fail(str(e))
    boot, topics = connect(bootstrap, topic_prefix, timeout=30.0)
    ensure_topics(boot, topics, raw_partitions=raw_partitions, needed=PROCESSOR_TOPICS)
    try:
        processor = Processor(boot, topics, group_id=group_id, instance_id=instance_id, grace_s=grace_s,
                              idle_timeout_s=idle_timeout_s, run_grace_s=run_grace_s,
                              figure_options=FigureOptions(top_k, stall_ratio, stall_steps, rolling_steps),
                              commit_interval_ms=commit_interval_ms, stages=stages, max_outage_s=max_outage_s,
                              hang_after_s=hang_after_s, run_idle_commit_ms=run_idle_commit_ms)
    except RuntimeError as e:  # a topic it may not use, a transaction Kafka would not start: one line
        fail(str(e))
    if metrics_port:
        try:
            processor.health.serve(metrics_port, metrics_addr, web)
        except OSError as e:
            fail(f"cannot serve metrics on port {metrics_port} ({e.strerror}): choose another --metrics-port "
                  "or 0 to turn them off")
    where = f"{web.scheme if web else 'http'}://{metrics_addr}:{metrics_port}/metrics"
    err.print(f"processing {topics.raw} from {boot} (group {group_id}, instance {instance_id})"
              + (f", metrics on {where}" if metrics_port else "") + "; Ctrl-C or SIGTERM stops", highlight=False)
    _dump_state_on_usr1(processor)
    from profstream.processors.stop_signals import stop_on_signals

    with stop_on_signals(processor.stop, lambda line: err.print(line, highlight=False)):
        processor.run()


def _dump_state_on_usr1(processor) -> None:
    """`kill -USR1` of a processor logs where each stage stands (partitions, positions, fetch
    and group states, what it waits for) after the threads' stacks that faulthandler prints."""
    import faulthandler
    import logging
    import signal

    log = logging.getLogger("profstream.processor")

    def dump(*_) -> None:  # runs on the main thread, inside the step stage's loop: must not raise there
        try:
            log.warning("profstream processor state:\n%s", processor.describe())
        except Exception as e:  # another stage's thread changed what was being read: say so, go on
            log.warning("profstream processor state: not readable now (%r); send USR1 again", e)

    faulthandler.unregister(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, dump)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
