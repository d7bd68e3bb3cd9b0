"""1,024 ranks at their real pace through 1, 2 and 4 processor processes: throughput,
freshness, processor RSS and the cross-rank stage's cost per step.

**The ranks.** ``--ranks`` (1,024) ranks of one run, each stepping ``--steps-per-s`` (2)
times a second with ``--ops-per-step`` ops, for ``--duration-s`` seconds. A real
deployment has one Monitor per training process on hundreds of hosts; on this 2-core box
1,024 Monitors cost ~1 ms of CPU per rank-step (plan, record, encode) plus a librdkafka
producer and a sender thread each, more than the box has (``simulate --procs 4`` at 1,024
ranks: 465 CPU seconds for 20 s of run, docs/benchmarks.md section 20). So the messages
are the real Monitor's, built before the run for ``--template-ranks`` (16) ranks by
real Monitors and Senders (``bench_processor_throughput.monitor_messages``) on a virtual
clock that starts when the run starts; rank r sends rank r % 16's messages with its own
rank, world size and producer id patched into the Avro header (the rest of the bytes as
they are). ``--replay-procs`` (2) processes send them, each with one librdkafka producer
(acks=all, idempotent, lz4, key ``run/rank``: the Monitor's settings), each message at
the wall time its Monitor would send it (end of the step's start, body and end phases).
How late the replay ran is reported (``replay_late_ms``).

**The processors.** ``profstream process`` subprocesses, distinct ``--instance-id``, one
group; the raw topic has ``--partitions`` (16) partitions. ``--run-stage shared``: each
process runs both stages (the default deployment); ``own``: the processes run the step
stage only, and one more process the run stage, whose CPU per run step is the cross-rank
stage's cost; after the run, the records of the topic it read are counted by type
(``run_stage_input_records``: the partials topic, or the steps topic on a checkout from
before it).

**Freshness.** A librdkafka read_committed consumer in this process reads the steps topic
(fetch wait 10 ms) and takes, per StepMetrics, the wall time it is seen minus the step's
``end_ns`` (parsed from the record's first fields): step end -> StepMetrics committed and
visible. Steps that end in the first ``--warmup-s`` seconds are left out of the headline.

**Faults** (issue #35). ``--silent-ranks N``: N ranks spread over the run send nothing after
``--silent-after-step`` (not even their end): the run steps after it must still come out, a
grace (``--run-grace-s``) after their last report, with exactly those ranks missing.
``--flood-rank R``: rank R steps ``--flood-factor`` (10) times as often as the others (its own
template rank, as many more steps); the freshness headline is the other ranks'.

**Or simulated** (issue #35, item 4). ``--simulate-procs P``: instead of the replay, one
``profstream simulate --procs P --shared-producer --rate realtime`` (``nice -n
--simulate-nice``) runs every rank through the real Monitor API, the Monitors of each of its
P processes sharing one producer and one sender thread (``producers/shared_sender.py``);
the truth is then every rank's own plans, not a template's. Reported: the simulator's
CPU (its processes together) and each process's RSS.

**Stopping.** The processors get SIGINT (Ctrl-C) at the end; how long each took to exit,
and its status, are reported (``stop_s``, ``exit_codes``; killed after 15 s).

**Why replayed.** ``--footprint N`` opens N real Monitors in this process instead and
prints what each one holds, connected and idle: threads, file descriptors, broker
connections, RSS and CPU (docs/benchmarks.md, "16,384 ranks simulated").

**Run figures against the truth.** Every RunStepMetrics read back is compared with the
simulator's plans (rank r has template rank r % 16's step times): the ranks that reported,
each one's step time, min / median / max and the straggler (``run_figures``).

Prints one JSON object on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import resource
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import psutil
from _common import (
    broker_bootstrap,
    drop_topics,
    emit,
    envelope,
    note,
    percentile,
    summary,
    unique_prefix,
)
from bench_processor_scaleout import cpu_seconds, processor_command, stop_process
from kafka import KafkaAdminClient
from kafka.errors import KafkaError

from profstream.kafka.topics import Topics, ensure_topics
from profstream.schema.codec import HEADER_LEN, SCHEMAS, decode_any

TARGET_P99_S = 2.0
START_MARGIN_S = 8.0  # replay processes spawn and build their templates before the run starts
IDLE_PROBE_S = 10.0  # the processors' idle CPU, measured after the group is stable and before the run


# -- Avro varints: the few header fields a clone rewrites ------------------------------

def _read_long(data: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return (value >> 1) ^ -(value & 1), pos
        shift += 7


def _long(value: int) -> bytes:
    n = (value << 1) ^ (value >> 63)
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _skip_string(data: bytes, pos: int) -> int:
    n, pos = _read_long(data, pos)
    return pos + n


def clone_batch(value: bytes, rank: int, world_size: int, producer_id: bytes) -> bytes:
    """An EventBatch (v4 to v6: run_id, host, rank, world_size, device, producer_id first) as
    another rank's Monitor would send it: rank, world size and producer id replaced."""
    pos = _skip_string(value, _skip_string(value, HEADER_LEN))  # run_id, host
    head = value[:pos]
    _, pos = _read_long(value, pos)  # rank
    branch, pos = _read_long(value, pos)  # world_size: ["null", "int"]
    if branch:
        _, pos = _read_long(value, pos)
    device_end = _skip_string(value, pos)
    device = value[pos:device_end]
    rest = value[_skip_string(value, device_end):]  # after producer_id
    return b"".join((head, _long(rank), _long(1), _long(world_size), device, _long(len(producer_id)), producer_id,
                     rest))


def step_end_ns(value: bytes) -> tuple[int, int, int] | None:
    """(rank, step, end_ns) of a StepMetrics record (its first fields, in every version), or
    None for another record."""
    sv = SCHEMAS.get(int.from_bytes(value[2:HEADER_LEN], "little"))
    if sv is None or sv.name != "StepMetrics":
        return None
    pos = _skip_string(value, HEADER_LEN)  # run_id
    rank, pos = _read_long(value, pos)
    branch, pos = _read_long(value, pos)
    if branch:
        _, pos = _read_long(value, pos)
    pos = _skip_string(value, _skip_string(value, pos))  # host, device
    step, pos = _read_long(value, pos)
    _, pos = _read_long(value, pos)  # start_ns
    end, _ = _read_long(value, pos)
    return rank, step, end


# -- what the ranks send: templates, a flooding rank, silent ranks ---------------------

FLOOD_TEMPLATE = -1  # the schedule's template id of the flooding rank's messages


def template_configs(args: dict):
    """The template ranks' SimConfig, and the flooding rank's (``flood_factor`` times the
    step rate, as many more steps; None without one): the ground truth of the figures.
    With ``simulate_procs`` every rank is its own template: the run's SimConfig."""
    from profstream.simulate import SimConfig

    step_ms = 1000.0 / args["steps_per_s"]
    cfg = SimConfig(run_id="scale", ranks=args["ranks"] if args.get("simulate_procs") else args["template_ranks"],
                    steps=args["steps"],
                    ops_per_step=args["ops_per_step"], step_time_ms=step_ms, seed=5)
    if args["flood_rank"] is None:
        return cfg, None
    factor = args["flood_factor"]
    return cfg, SimConfig(run_id="scale", ranks=1, steps=args["steps"] * factor, ops_per_step=args["ops_per_step"],
                          step_time_ms=step_ms / factor, seed=6)


def batch_step(value: bytes) -> int:
    """The highest step an EventBatch has events of (its end mark left out; -1: none)."""
    from profstream.schema.batch import END_MARK, decode_batch

    b = decode_batch(value)
    steps = [int(x) for x in b.steps["step"] if x != END_MARK] + [int(x) for x in b.ops["step"]]
    return max(steps, default=-1)


def _schedule(monitor_messages, cfg, origin_ns: int, template: int | None) -> list[tuple[int, int, int, bytes]]:
    """(send time, template rank, step, value) of every message of ``cfg``'s Monitors, each
    under its rank, or under ``template`` when given (the flooding rank's one-rank config)."""
    at: list = []
    messages, _ = monitor_messages(cfg, origin_ns=origin_ns, sent_at=at)
    last = max(t for t in at if t is not None)
    return [((t if t is not None else last), int(key.rpartition(b"/")[2]) if template is None else template,
             batch_step(value), value) for (key, value), t in zip(messages, at)]


def silent_ranks(ranks: int, count: int) -> list[int]:
    """``count`` ranks spread over the run (never rank 0)."""
    if not 0 <= count < ranks:
        raise SystemExit(f"--silent-ranks {count}: expected 0 to {ranks - 1}")
    return [1 + i * (ranks - 1) // count for i in range(count)] if count else []


# -- why the ranks are replayed: what one real Monitor holds ----------------------------

def monitor_footprint(bootstrap, monitors: int, control: bool, idle_s: float = 5.0) -> dict[str, Any]:
    """Threads, file descriptors, broker connections, RSS and idle CPU that each of
    ``monitors`` real Monitors (one process, ``control``: reading capture requests, the
    default) adds, connected and idle: what ``simulate --procs`` would multiply by the ranks."""
    from profstream.producers.monitor import Monitor

    me = psutil.Process()
    threads, fds, rss = me.num_threads(), me.num_fds(), me.memory_info().rss
    opened = [Monitor(run_id="footprint", rank=r, world_size=monitors, connection=bootstrap,
                      topic_prefix=unique_prefix(), control=control, host_sample_interval_s=0, device_interval_ms=0)
              for r in range(monitors)]
    try:
        for m in opened:
            if not m.flush(60):
                raise SystemExit("a Monitor did not connect within 60 s")
        time.sleep(2.0)  # the control readers join their groups
        connections = sum(1 for c in me.net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED)
        cpu0 = time.process_time()
        time.sleep(idle_s)
        idle_cpu = (time.process_time() - cpu0) / idle_s
        return {"monitors": monitors, "control": control,
                "threads_per_monitor": (me.num_threads() - threads) / monitors,
                "fds_per_monitor": (me.num_fds() - fds) / monitors,
                "broker_connections_per_monitor": connections / monitors,
                "rss_mib_per_monitor": (me.memory_info().rss - rss) / monitors / 2**20,
                "idle_cpu_share_per_monitor": idle_cpu / monitors}
    finally:
        for m in opened:
            m.close(5)


# -- the replay processes --------------------------------------------------------------

def replay(bootstrap: str, prefix: str, args: dict, ranks: range, origin_ns: int, results) -> None:
    """One replay process: build the template ranks' messages, then send this share of the
    ranks' copies at their times. Reports ("ready", built_s), then ("done", stats)."""
    from bench_processor_throughput import monitor_messages

    from profstream.kafka.clients import make_native_producer

    try:
        t0 = time.process_time()
        cfg, flood_cfg = template_configs(args)
        schedule = sorted(_schedule(monitor_messages, cfg, origin_ns, None))
        if flood_cfg is not None:  # the flooding rank's own template: FLOOD_TEMPLATE
            schedule = sorted(schedule + _schedule(monitor_messages, flood_cfg, origin_ns, FLOOD_TEMPLATE))
        silent, silent_after = set(args["silent"]), args["silent_after_step"]
        results.put(("ready", ranks.start, time.process_time() - t0))
        producer = make_native_producer(bootstrap, compression="lz4")
        failed: list = []
        topic = Topics(prefix).raw
        by_template: dict[int, list[tuple[bytes, bytes]]] = {}
        for r in ranks:
            ident = f"scale-{r}".encode()
            template = FLOOD_TEMPLATE if r == args["flood_rank"] else r % cfg.ranks
            by_template.setdefault(template, []).append((f"{cfg.run_id}/{r}".encode(), ident))
        late_ms: list[float] = []
        cpu0 = time.process_time()
        sent = 0
        for at_ns, template, step, value in schedule:
            delay = (at_ns - time.time_ns()) / 1e9
            if delay > 0:
                time.sleep(delay)
            else:
                late_ms.append(-delay * 1000)
            for r_key, ident in by_template.get(template, ()):
                rank = int(r_key.rpartition(b"/")[2])
                if rank in silent and step > silent_after:  # fell silent: nothing more, not even its end
                    continue
                producer.send(topic, clone_batch(value, rank, args["ranks"], ident), r_key,
                              lambda e: e is not None and failed.append(e))
                sent += 1
            producer.poll()
        flushed = producer.flush(60)
        producer.close(10)
        results.put(("done", ranks.start, {"messages": sent, "failed": len(failed), "flushed": flushed,
                                           "cpu_s": time.process_time() - cpu0, "schedule": len(schedule),
                                           "late_ms_p99": percentile(late_ms, 99) if late_ms else 0.0,
                                           "late_ms_max": max(late_ms, default=0.0)}))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put(("error", ranks.start, f"{type(e).__name__}: {e}"))


# -- or the ranks simulated: simulate --procs --shared-producer ----------------------------

def simulate_command(bootstrap, prefix: str, args: argparse.Namespace, steps: int) -> list[str]:
    """The `profstream simulate` of the run's every rank (``template_configs``' SimConfig)."""
    cfg, _ = template_configs({**vars(args), "steps": steps})
    return ["nice", "-n", str(args.simulate_nice), sys.executable, "-m", "profstream.cli", "simulate",
            "--bootstrap", str(bootstrap), "--topic-prefix", prefix, "--run-id", cfg.run_id, "--ranks", str(cfg.ranks),
            "--steps", str(cfg.steps), "--ops-per-step", str(cfg.ops_per_step), "--step-time-ms",
            str(cfg.step_time_ms), "--seed", str(cfg.seed), "--rate", "realtime", "--procs", str(args.simulate_procs),
            "--shared-producer"]


class TreeSampler(threading.Thread):
    """The largest RSS each process under ``pid`` (its children: the simulator's) reached."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.max_rss: dict[int, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                for c in psutil.Process(self.pid).children(recursive=True):
                    try:
                        self.max_rss[c.pid] = max(self.max_rss.get(c.pid, 0), c.memory_info().rss)
                    except psutil.Error:
                        pass
            except psutil.Error:
                return


def run_simulator(command: list[str], timeout: float) -> dict[str, Any]:
    """Run the simulator to its end: its summary line, CPU seconds (its processes together,
    each reaped by its parent) and each process's RSS."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        raise SystemExit(f"the simulator did not end within {timeout:.0f} s: {output[-500:]}") from None
    finally:
        sampler.stop.set()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((ln for ln in reversed(output.splitlines()) if "steps," in ln), output[-300:])
    rss = sorted(sampler.max_rss.values(), reverse=True)
    return {"exit_code": proc.returncode, "summary": line.strip(), "wall_s": time.monotonic() - t0,
            "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "rss_mib_max": [round(r / 2**20, 1) for r in rss]}


# -- readers and samplers --------------------------------------------------------------

class Freshness(threading.Thread):
    """Reads the steps and run topics read_committed; per StepMetrics, seen - end_ns."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        super().__init__(daemon=True)
        from confluent_kafka import TopicPartition

        from profstream.kafka.clients import make_native_consumer

        self.consumer = make_native_consumer(bootstrap, f"bench-read-{topics.prefix}", **{"fetch.wait.max.ms": 10})
        parts = []
        for topic in (topics.steps, topics.run):
            meta = self.consumer.list_topics(topic, timeout=10).topics[topic]
            parts += [TopicPartition(topic, p, -2) for p in meta.partitions]  # -2: the beginning
        self.consumer.assign(parts)
        self.steps_topic = topics.steps
        self.fresh: list[tuple[int, int, float]] = []  # (rank, end_ns, seen - end_ns in s)
        self.keys: set[tuple[int, int]] = set()
        self.duplicates = 0
        self.run_records = 0
        self.run_steps: dict[int, list[dict]] = {}  # step -> its RunStepMetrics (more than one: a bug)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for msg in self.consumer.consume(1000, 0.1):
                if msg.error():
                    continue
                seen = time.time_ns()
                if msg.topic() != self.steps_topic:
                    self.run_records += 1
                    name, m = decode_any(msg.value())
                    if name == "RunStepMetrics":
                        self.run_steps.setdefault(m["step"], []).append(m)
                    continue
                parsed = step_end_ns(msg.value())
                if parsed is None:
                    continue
                rank, step, end = parsed
                if (rank, step) in self.keys:
                    self.duplicates += 1
                self.keys.add((rank, step))
                self.fresh.append((rank, end, (seen - end) / 1e9))
        self.consumer.close()


class RssSampler(threading.Thread):
    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.max_rss = [0] * len(pids)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            for i, pid in enumerate(self.pids):
                try:
                    self.max_rss[i] = max(self.max_rss[i], psutil.Process(pid).memory_info().rss)
                except psutil.Error:
                    pass


def wait_stable(bootstrap: str, group: str, members: int, timeout: float) -> float:
    """Seconds until ``group`` is Stable with ``members`` members (its coordinator may not
    exist yet on a fresh broker: retried)."""
    admin = KafkaAdminClient(bootstrap_servers=str(bootstrap), client_id="bench-group-watch")
    t0 = time.monotonic()
    seen = None
    try:
        while time.monotonic() - t0 < timeout:
            try:
                g = admin.describe_groups([group])[group]
                seen = (g["group_state"], len(g["members"]))
                if seen == ("Stable", members):
                    return time.monotonic() - t0
            except KafkaError as e:
                seen = type(e).__name__
            time.sleep(0.2)
    finally:
        admin.close()
    raise SystemExit(f"{members} processors: the group was not stable within {timeout} s (last: {seen})")


def distribution(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"n": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95),
            "p99": percentile(values, 99), "max": max(values)}


# -- one configuration -----------------------------------------------------------------

def brokers_cpu(pids: list[int]) -> float:
    """CPU seconds of the watched brokers together (nan when none is watched)."""
    return sum(cpu_seconds(pid) for pid in pids) if pids else float("nan")


def start_replay(bootstrap, prefix: str, args: argparse.Namespace, steps: int, silent: list[int]) -> tuple[int, list]:
    """The replay processes, started: (the run's origin in ns, the processes, each with
    ``results``, the queue they all report on)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    origin = time.time_ns() + int(START_MARGIN_S * 1e9)
    shares = [range(i * args.ranks // args.replay_procs, (i + 1) * args.ranks // args.replay_procs)
              for i in range(args.replay_procs)]
    spec = {"template_ranks": args.template_ranks, "steps": steps, "ops_per_step": args.ops_per_step,
            "steps_per_s": args.steps_per_s, "ranks": args.ranks, "silent": silent,
            "silent_after_step": args.silent_after_step, "flood_rank": args.flood_rank,
            "flood_factor": args.flood_factor}
    workers = [ctx.Process(target=replay, args=(bootstrap, prefix, spec, share, origin, results), daemon=True)
               for share in shares]
    for w in workers:
        w.results = results
        w.start()
    return origin, workers


def stop_timed(proc: subprocess.Popen, timeout: float = 15.0) -> tuple[int, float]:
    """Ctrl-C (SIGINT); killed after ``timeout`` s: (exit status, seconds it took)."""
    t0 = time.monotonic()
    code = stop_process(proc, timeout)
    return code, time.monotonic() - t0


def run_config(bootstrap: str, processes: int, args: argparse.Namespace, broker_pids: list[int]) -> dict[str, Any]:
    prefix = unique_prefix()
    topics = Topics(prefix)
    steps = int(args.duration_s * args.steps_per_s)
    silent = silent_ranks(args.ranks, args.silent_ranks)
    flood = args.flood_rank is not None
    run_steps = steps * (args.flood_factor if flood else 1)  # a flooding rank's steps beyond the others' too
    expected = (args.ranks - len(silent) - flood) * steps + len(silent) * min(steps, args.silent_after_step + 1) \
        + flood * run_steps
    ensure_topics(bootstrap, topics, raw_partitions=args.partitions, partitions=max(3, processes))
    group = f"{prefix}-g"
    stages = "all" if args.run_stage == "shared" else "steps"
    commands = [processor_command(bootstrap, prefix, group, f"p{i}", stages) for i in range(processes)]
    if args.run_stage == "own":
        commands.append(processor_command(bootstrap, prefix, group, "run", "run"))
        if args.run_commit_interval_ms is not None:
            commands[-1] += ["--commit-interval-ms", str(args.run_commit_interval_ms)]
    if args.run_grace_s is not None:
        commands = [c + ["--run-grace-s", str(args.run_grace_s)] for c in commands]
    logs = [tempfile.TemporaryFile("w+") for _ in commands]
    procs = [subprocess.Popen(c, stdout=log, stderr=subprocess.STDOUT)
             for c, log in zip(commands, logs)]
    reader = rss = None
    workers: list = []
    try:
        stable_s = wait_stable(bootstrap, group, processes, 90)
        reader = Freshness(bootstrap, topics)
        reader.start()
        rss = RssSampler([p.pid for p in procs])
        rss.start()
        # what each processor costs doing nothing (its polls, its idle transactions), to tell the
        # run stage's work per run step from its idle cost over a run of a few slow steps
        idle_from, idle_t = [cpu_seconds(p.pid) for p in procs], time.monotonic()
        time.sleep(IDLE_PROBE_S)
        idle_share = [(cpu_seconds(p.pid) - a) / (time.monotonic() - idle_t) for p, a in zip(procs, idle_from)]
        cpu0, t0 = [cpu_seconds(p.pid) for p in procs], time.monotonic()
        broker0 = brokers_cpu(broker_pids)
        load0 = os.getloadavg()[0]
        replays: dict[int, dict] = {}
        built: list[float] = []
        simulator = None
        if args.simulate_procs:
            simulator = run_simulator(simulate_command(bootstrap, prefix, args, steps), args.duration_s + 900)
            if simulator["exit_code"] != 0:
                raise SystemExit(f"the simulator failed: {simulator['summary']}")
            # the virtual clock's origin: the first step's earliest end, less its planned time (±3 %)
            origin = min((end for _rank, end, _f in reader.fresh), default=time.time_ns()) - int(1e9 / args.steps_per_s)
        else:
            origin, workers = start_replay(bootstrap, prefix, args, steps, silent)
            run_end = origin / 1e9 + args.duration_s
            while len(replays) < len(workers):
                try:
                    kind, start, value = workers[0].results.get(timeout=1)
                except queue.Empty:
                    if time.time() > run_end + 120:
                        raise SystemExit("the replay processes did not finish within 120 s of the run's end") from None
                    continue
                if kind == "error":
                    raise SystemExit(f"replay process of ranks from {start} failed: {value}")
                if kind == "ready":
                    built.append(value)
                    if time.time_ns() > origin:
                        note(f"warning: a replay process was ready {(time.time_ns() - origin) / 1e9:.1f} s after "
                             "the run's start")
                else:
                    replays[start] = value
        run_end = origin / 1e9 + args.duration_s
        t_sent = time.time()
        cpu1 = [cpu_seconds(p.pid) for p in procs]
        broker1 = brokers_cpu(broker_pids)
        window_s = t_sent - origin / 1e9
        deadline = time.monotonic() + args.drain_s
        while len(reader.keys) < expected and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.1)
        drained_s = time.time() - run_end
        cpu2 = [cpu_seconds(p.pid) for p in procs]
        broker2 = brokers_cpu(broker_pids)
        # the run stage's figures of the last steps follow theirs (a grace later where ranks are silent)
        deadline = time.monotonic() + 15 + (args.run_grace_s or 10.0) * 2
        while len(reader.run_steps) < run_steps and time.monotonic() < deadline and all(
                p.poll() is None for p in procs):
            time.sleep(0.1)
        cpu3, t3 = [cpu_seconds(p.pid) for p in procs], time.monotonic()
        load1 = os.getloadavg()[0]
        # what the run stage's consumer had to read, by record: the partials topic (the steps
        # topic where this checkout has none: the run stage read it before the partials topic)
        run_input = record_counts(bootstrap, getattr(topics, "partials", topics.steps)) \
            if args.run_stage == "own" else None
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()
        if reader is not None:
            reader.stop.set()
            reader.join(10)
        if rss is not None:
            rss.stop.set()
        stops = [stop_timed(p) for p in procs]
        if not args.keep_topics:
            drop_topics(bootstrap, prefix)
    warnings = []
    for log in logs:
        log.seek(0)
        warnings.append([line.strip()[:300] for line in log if "WARNING" in line or "rror" in line][:5])
        log.close()
    warm_until = origin + int(args.warmup_s * 1e9)
    steady = [f for rank, end, f in reader.fresh if end >= warm_until and rank != args.flood_rank]
    cpu = [b - a for a, b in zip(cpu0, cpu1)]
    cpu_all = [b - a for a, b in zip(cpu0, cpu2)]  # the run and its drain: every step's work
    steps_done = max(1, len(reader.keys))
    result: dict[str, Any] = {
        "processors": processes, "run_stage": args.run_stage, "topic_prefix": prefix,
        "steps_expected": expected, "steps_read_back": len(reader.keys), "steps_twice": reader.duplicates,
        "run_steps_expected": run_steps, "run_steps_read_back": reader.run_records,
        "run_figures": check_run_steps(reader.run_steps, args, steps, run_steps, silent),
        "group_stable_s": stable_s, "window_s": window_s, "drained_after_run_end_s": drained_s,
        "steps_per_s": len(reader.keys) / (window_s + max(0.0, drained_s)),
        "ops_per_s": len(reader.keys) * args.ops_per_step / (window_s + max(0.0, drained_s)),
        "freshness_s": distribution(steady), "freshness_s_warmup": distribution(
            [f for rank, end, f in reader.fresh if end < warm_until and rank != args.flood_rank]),
        "freshness_s_flooding_rank": distribution(
            [f for rank, end, f in reader.fresh if end >= warm_until and rank == args.flood_rank]),
        "processor_cpu_share": [c / window_s for c in cpu],
        "processor_rss_mib_max": [m / 2**20 for m in rss.max_rss],
        "broker_cpu_share": (broker1 - broker0) / window_s,
        "processor_cpu_s": cpu_all, "processor_cpu_ms_per_step": sum(cpu_all) / steps_done * 1000,
        "broker_cpu_ms_per_step": (broker2 - broker0) / steps_done * 1000,
        "replay": list(replays.values()), "replay_build_cpu_s": built,
        "replay_cpu_share": (sum(r["cpu_s"] for r in replays.values()) if simulator is None
                             else simulator["cpu_s"]) / window_s,
        "loadavg_1m": [round(load0, 2), round(load1, 2)], "exit_codes": [c for c, _ in stops],
        "stop_s": [round(t, 2) for _, t in stops], "processor_warnings": warnings,
    }
    if simulator is not None:
        result["simulator"] = simulator
        result["simulator_cpu_ms_per_rank_step"] = simulator["cpu_s"] / expected * 1000
    if args.run_stage == "own" and reader.run_records:
        result["run_stage_cpu_ms_per_run_step"] = (cpu3[-1] - cpu0[-1]) / reader.run_records * 1000
        result["run_stage_idle_cpu_share"] = idle_share[-1]
        result["run_stage_cpu_ms_per_run_step_over_idle"] = (
            (cpu3[-1] - cpu0[-1] - idle_share[-1] * (t3 - t0)) / reader.run_records * 1000)
        result["run_stage_cpu_share"] = cpu[-1] / window_s
        result["run_stage_input_records"] = run_input
        result["run_stage_input_records_per_run_step"] = sum(run_input.values()) / reader.run_records
    return result


def record_counts(bootstrap: str, topic: str) -> dict[str, int]:
    """How many committed records of each type ``topic`` holds (read to its end, after the run)."""
    from collections import Counter

    from confluent_kafka import TopicPartition

    from profstream.kafka.clients import make_native_consumer
    from profstream.schema.codec import record_name

    consumer = make_native_consumer(bootstrap, f"bench-count-{topic}")
    try:
        parts = [TopicPartition(topic, p, -2) for p in consumer.list_topics(topic, timeout=10).topics[topic].partitions]
        ends = {p.partition: consumer.get_watermark_offsets(p, timeout=10)[1] for p in parts}
        consumer.assign(parts)
        counts: Counter = Counter()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(
                p.offset < ends[p.partition] for p in consumer.position(parts) if ends[p.partition]):  # past markers too
            for msg in consumer.consume(1000, 0.5):
                if not msg.error():
                    counts[record_name(msg.value())] += 1
        return dict(counts)
    finally:
        consumer.close()


def check_run_steps(got: dict[int, list[dict]], args: argparse.Namespace, steps: int, run_steps: int,
                    silent: list[int]) -> dict[str, Any]:
    """The RunStepMetrics read back against the simulator's truth: per step, the ranks that
    reported it (all but the silent ones after ``--silent-after-step``), each one's step
    time, min / median / max and the straggler, computed here from the plans."""
    from profstream.simulate import expected as truth_of

    cfg, flood_cfg = template_configs({**vars(args), "steps": steps})
    truth = truth_of(cfg)
    flood_truth = truth_of(flood_cfg) if flood_cfg is not None else {}
    silent_set = set(silent)
    wrong: list[str] = []
    missing_listed = []
    for step in range(run_steps):
        records = got.get(step, [])
        if len(records) != 1:
            wrong.append(f"step {step}: {len(records)} records")
            continue
        want = {}
        if step < steps:
            want = {r: truth[(r % cfg.ranks, step)]["step_time_ns"] for r in range(args.ranks)
                    if r != args.flood_rank and not (r in silent_set and step > args.silent_after_step)}
        if args.flood_rank is not None:
            want[args.flood_rank] = flood_truth[(0, step)]["step_time_ns"]
        m = records[0]
        times = sorted(want.values())
        mid = len(times) // 2
        median = float(times[mid]) if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
        longest = max(times)
        figures = {"ranks_reported": len(want), "min_step_time_ns": times[0], "max_step_time_ns": longest,
                   "median_step_time_ns": median, "straggler_rank": min(r for r, t in want.items() if t == longest)}
        seen = {int(r): t for r, t in m["step_times_ns"].items()}
        if seen != want:
            wrong.append(f"step {step}: step times of {len(set(seen.items()) ^ set(want.items()))} ranks differ")
        wrong += [f"step {step}: {k} {m[k]} != {v}" for k, v in figures.items() if m[k] != v]
        if step < steps and step > args.silent_after_step and silent:
            missing_listed.append(sorted(set(range(args.ranks)) - seen.keys() - {args.flood_rank}) == silent)
    return {"steps_checked": run_steps, "equal_to_truth": not wrong, "differences": wrong[:10],
            "silent_ranks": len(silent), "steps_with_the_silent_ranks_missing": sum(missing_listed),
            "silent_ranks_missing_exactly": all(missing_listed) if missing_listed else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", help="broker host:port (default: start/reuse `profstream stack up`)")
    p.add_argument("--broker-pid", default="",
                   help="the broker's pid, or the pids of a cluster's brokers (comma-separated), for their CPU "
                        "together (default: not watched)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--processors", default="1,2,4", help="processor counts to run, in this order")
    p.add_argument("--run-stage", choices=("shared", "own"), default="shared",
                   help="shared: every process runs both stages; own: one more process runs the run stage")
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps-per-s", type=float, default=2.0, help="steps per second of each rank")
    p.add_argument("--ops-per-step", type=int, default=50)
    p.add_argument("--duration-s", type=float, default=40.0, help="seconds of run")
    p.add_argument("--warmup-s", type=float, default=5.0, help="steps ending in the first seconds left out")
    p.add_argument("--partitions", type=int, default=16, help="partitions of the raw topic")
    p.add_argument("--template-ranks", type=int, default=16, help="ranks built by real Monitors; the rest copy them")
    p.add_argument("--replay-procs", type=int, default=2, help="processes that send the ranks' messages")
    p.add_argument("--keep-topics", action="store_true")
    p.add_argument("--run-grace-s", type=float, help="the processors' --run-grace-s (default: theirs)")
    p.add_argument("--run-commit-interval-ms", type=float,
                   help="the run-stage process's --commit-interval-ms, with --run-stage own (default: theirs)")
    p.add_argument("--drain-s", type=float, default=90.0, help="wait this long after the run for every StepMetrics")
    p.add_argument("--silent-ranks", type=int, default=0, help="ranks (spread over the run) that fall silent")
    p.add_argument("--silent-after-step", type=int, default=0, help="the last step the silent ranks send")
    p.add_argument("--flood-rank", type=int, help="a rank that steps --flood-factor times faster than the others "
                                                  "(its figures left out of the freshness headline)")
    p.add_argument("--flood-factor", type=int, default=10)
    p.add_argument("--simulate-procs", type=int, default=0, metavar="P",
                   help="instead of the replay: `profstream simulate --procs P --shared-producer` runs every rank "
                        "through the Monitor API (no --silent-ranks, --flood-rank)")
    p.add_argument("--simulate-nice", type=int, default=10, help="the simulator's niceness")
    p.add_argument("--footprint", type=int, default=0, metavar="N",
                   help="instead: open N real Monitors in this process and print what each one holds (threads, "
                        "fds, broker connections, RSS, idle CPU), with and without the capture-request reader")
    args = p.parse_args(argv)
    if args.simulate_procs and (args.silent_ranks or args.flood_rank is not None):
        p.error("--simulate-procs simulates every rank alike: no --silent-ranks or --flood-rank with it")
    bootstrap = broker_bootstrap(args.bootstrap)
    if args.footprint:
        emit(envelope("monitor_footprint", args, {"bootstrap": str(bootstrap), "by_control": [
            monitor_footprint(bootstrap, args.footprint, control) for control in (True, False)]}))
        return 0
    counts = [int(n) for n in args.processors.split(",")]
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    for r in range(args.repeats):
        for n in counts:
            res = run_config(bootstrap, n, args, [int(pid) for pid in args.broker_pid.split(",") if pid])
            runs[n].append(res)
            f = res["freshness_s"] or {}
            note(f"repeat {r + 1}/{args.repeats}, {n} processor(s), run stage {args.run_stage}: "
                 f"{res['steps_read_back']}/{res['steps_expected']} steps, freshness p50 {f.get('p50', 0):.2f} s "
                 f"p99 {f.get('p99', 0):.2f} s, processor CPU {[round(c, 2) for c in res['processor_cpu_share']]}, "
                 f"{res['processor_cpu_ms_per_step']:.2f} ms CPU/step, RSS {[round(m) for m in res['processor_rss_mib_max']]} MiB, "
                 f"broker {res['broker_cpu_share']:.2f}, "
                 f"replay {res['replay_cpu_share']:.2f}, late p99 "
                 f"{max((x['late_ms_p99'] for x in res['replay']), default=0):.0f} ms, load {res['loadavg_1m']}, "
                 f"stopped in {res['stop_s']} s ({res['exit_codes']})")
    by_count = {}
    for n, rs in runs.items():
        p99 = [x["freshness_s"]["p99"] for x in rs if x["freshness_s"]]
        by_count[str(n)] = {
            "freshness_p50_s": summary([x["freshness_s"]["p50"] for x in rs if x["freshness_s"]]) if p99 else None,
            "freshness_p99_s": summary(p99) if p99 else None,
            "steps_per_s": summary([x["steps_per_s"] for x in rs]),
            "processor_rss_mib_max": max(m for x in rs for m in x["processor_rss_mib_max"]),
            "processor_cpu_share_total": summary([sum(x["processor_cpu_share"]) for x in rs]),
            "processor_cpu_ms_per_step": summary([x["processor_cpu_ms_per_step"] for x in rs]),
            "broker_cpu_ms_per_step": summary([x["broker_cpu_ms_per_step"] for x in rs]),
            "loadavg_1m": [x["loadavg_1m"] for x in rs],
            "all_steps_once": all(x["steps_read_back"] == x["steps_expected"] and not x["steps_twice"] for x in rs),
            "run_figures_equal_truth": all(x["run_figures"]["equal_to_truth"] for x in rs),
        }
        if args.run_stage == "own":
            for k in ("run_stage_cpu_ms_per_run_step", "run_stage_cpu_ms_per_run_step_over_idle",
                      "run_stage_idle_cpu_share"):
                by_count[str(n)][k] = summary([x[k] for x in rs if k in x])
    best = by_count.get("4", {}).get("freshness_p99_s")
    results = {
        "bootstrap": str(bootstrap),
        "metric": "p99 over steady-state steps of (StepMetrics seen by a read_committed reader) - step end_ns, "
                  "per processor count; median over repeats",
        "unit": "s",
        "workload": {"ranks": args.ranks, "steps_per_s_per_rank": args.steps_per_s,
                     "steps_per_s": args.ranks * args.steps_per_s, "ops_per_step": args.ops_per_step,
                     "ops_per_s": args.ranks * args.steps_per_s * args.ops_per_step,
                     "raw_partitions": args.partitions, "cpu_count": os.cpu_count()},
        "by_processors": by_count,
        "median": best["median"] if best else None,
        "target": {"max_p99_s": TARGET_P99_S, "processors": 4},
        "meets_target": bool(best and best["median"] <= TARGET_P99_S),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "runs": {str(n): rs for n, rs in runs.items()},
    }
    emit(envelope("scale_ranks", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
