"""Scale-out: throughput of 2 processor processes in one group against 1, on the same input.

Input: a simulated run of ``--ranks`` ranks (24) x ``--steps`` steps x 2,000 ops, as the
Monitors send it (``bench_processor_throughput.monitor_messages``: 3 messages per step and
rank; 8 ranks are simulated and re-keyed to give the others). It is pre-filled into two
fresh topic prefixes with identical contents, a 12-partition ``raw`` each; rank r goes to
partition r % 12, so each partition holds 2 ranks and both processes get the same work.

Per repeat: ``profstream process --stages steps`` once on one prefix, and twice (two
processes, distinct ``--instance-id``, one group) on the other; the order of the two
configurations alternates between repeats. Each configuration has its own group. Its
time runs from launching the process(es) until a read_committed consumer in this
process has seen every StepMetrics on the steps topic: Python start-up, group join and
rebalances are inside it. A second figure starts the clock when the group is first
Stable with all its members (polled every 0.1 s). CPU seconds of each processor and of
the broker during the run say what the two cores were doing, and
``machine_cpu_scaling_2_vs_1`` (2 busy-loop processes against 1) what the machine gives
two CPU-bound processes at the time.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import psutil
from _common import broker_bootstrap, drop_topics, emit, envelope, note, summary, unique_prefix
from bench_processor_throughput import monitor_messages, prefill
from kafka import KafkaAdminClient, TopicPartition

from profstream.kafka.clients import make_consumer
from profstream.kafka.topics import Topics, ensure_topics
from profstream.schema.batch import decode_batch, encode_batch
from profstream.simulate import SimConfig

TARGET_RATIO = 1.6
PARTITIONS = 12


def clone_ranks(messages: list[tuple[bytes, bytes]], simulated: int, ranks: int) -> list[tuple[bytes, bytes]]:
    """Messages of ``ranks`` ranks from those of ``simulated`` ranks: rank r copies rank r % simulated."""
    by_rank: dict[int, list[bytes]] = {}
    for key, value in messages:
        by_rank.setdefault(int(key.rpartition(b"/")[2]), []).append(value)
    out = list(messages)
    for rank in range(simulated, ranks):
        for value in by_rank[rank % simulated]:
            b = decode_batch(value)
            b.rank = rank
            b.producer_id = f"bench-clone-{rank}"
            out.append((b.key, encode_batch(b)))
    return out


def rank_partition(key: bytes) -> int:
    return int(key.rpartition(b"/")[2]) % PARTITIONS


def processor_command(bootstrap: str, prefix: str, group: str, instance: str, stages: str = "steps",
                      metrics_port: int = 0) -> list[str]:
    return [sys.executable, "-m", "profstream.cli", "process", "--bootstrap", str(bootstrap), "--topic-prefix", prefix,
            "--group-id", group, "--instance-id", instance, "--stages", stages, "--metrics-port", str(metrics_port)]


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> int:
    """Ctrl-C (the processor commits and leaves its group), then kill if it has not ended."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def cpu_seconds(pid: int) -> float:
    if pid <= 0:  # a broker given by --bootstrap: its process is not ours to watch
        return float("nan")
    try:
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return float("nan")


class StepsWatcher:
    """Counts the records on a steps topic (read_committed) until ``expected``; when that happened."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = make_consumer(bootstrap, group_id=None, fetch_max_wait_ms=50)
        parts = self.consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        self.consumer.assign(tps)
        self.consumer.seek_to_beginning(*tps)
        self.count = 0

    def wait(self, expected: int, deadline: float, alive) -> float | None:
        while self.count < expected and time.monotonic() < deadline and alive():
            for records in self.consumer.poll(timeout_ms=100).values():
                self.count += len(records)
        return time.monotonic() if self.count >= expected else None

    def close(self) -> None:
        self.consumer.close()


class GroupWatcher(threading.Thread):
    """Polls the group's state; remembers when it was first Stable with ``members`` members."""

    def __init__(self, bootstrap: str, group: str, members: int) -> None:
        super().__init__(daemon=True)
        self.admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="bench-group-watch")
        self.group, self.members = group, members
        self.stable_at: float | None = None
        self.states: list[tuple[float, str, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        try:
            while not self.done.is_set() and self.stable_at is None:
                g = self.admin.describe_groups([self.group])[self.group]
                now = time.monotonic()
                state = (g["group_state"], len(g["members"]))
                if not self.states or self.states[-1][1:] != state:
                    self.states.append((now, *state))
                if state == ("Stable", self.members):
                    self.stable_at = now
                self.done.wait(0.1)
        finally:
            self.admin.close()


def run_config(bootstrap: str, prefix: str, processes: int, expected: int, total_ops: int, broker_pid: int,
               timeout: float) -> dict[str, Any]:
    group = f"{prefix}-g{processes}"
    topics = Topics(prefix)
    watcher = StepsWatcher(bootstrap, topics.steps)
    group_watch = GroupWatcher(bootstrap, group, processes)
    logs = [tempfile.TemporaryFile("w+") for _ in range(processes)]
    broker_cpu0 = cpu_seconds(broker_pid)
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    procs = [subprocess.Popen(processor_command(bootstrap, prefix, group, f"p{i}"), stdout=log,
                              stderr=subprocess.STDOUT) for i, log in enumerate(logs)]
    group_watch.start()
    try:
        t_end = watcher.wait(expected, t0 + timeout, lambda: all(p.poll() is None for p in procs))
        proc_cpu = [cpu_seconds(p.pid) for p in procs]
        broker_cpu = cpu_seconds(broker_pid) - broker_cpu0
        seen = watcher.count
    finally:
        group_watch.done.set()
        codes = [stop_process(p) for p in procs]
        watcher.close()
        group_watch.join(5)
    if t_end is None:
        tails = []
        for log in logs:
            log.seek(0)
            tails.append(log.read()[-500:])
        raise SystemExit(f"{processes} processor(s): {seen} of {expected} StepMetrics within {timeout} s; "
                         f"exit codes {codes}; log tails {tails}")
    warnings = []  # aborted transactions, fencing, rebalances: what a slow repeat did
    for log in logs:
        log.seek(0)
        warnings.append([line.strip()[:300] for line in log if "WARNING" in line or "abort" in line][:10])
        log.close()
    elapsed = t_end - t0
    stable = group_watch.stable_at
    return {
        "processes": processes, "group": group, "elapsed_s": elapsed, "ops_per_s": total_ops / elapsed,
        "steps_per_s": expected / elapsed,
        "group_stable_after_s": stable - t0 if stable else None,
        "ops_per_s_from_group_stable": total_ops / (t_end - stable) if stable else None,
        "group_states": [(round(t - t0, 2), s, n) for t, s, n in group_watch.states],
        "processor_cpu_s": proc_cpu, "processor_cpu_share": [c / elapsed for c in proc_cpu],
        "broker_cpu_s": broker_cpu, "broker_cpu_share": broker_cpu / elapsed,
        "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)], "exit_codes": codes,
        "processor_warnings": warnings,
    }


_BUSY = "x = 0\nfor i in range(30_000_000):\n    x += i"


def cpu_scaling(repeats: int = 3) -> dict[str, Any]:
    """What this machine gives two CPU-bound processes: the throughput of 2 concurrent
    pure-Python busy loops against 1, median of ``repeats``. The ceiling for the processor
    ratio here (the broker and other tenants share the same cores)."""
    def wall(n: int) -> float:
        t = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(n)]
        for proc in procs:
            proc.wait()
        return time.perf_counter() - t

    ratios = []
    for _ in range(repeats):
        one, two = wall(1), wall(2)
        ratios.append(2 * one / two)
    return summary(ratios)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", help="broker host:port (default: start/reuse `profstream stack up`)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=24)
    p.add_argument("--steps", type=int, default=600,
                   help="steps per rank (600: ~15 s of work for one process, so start-up and group join "
                        "are a small part of it)")
    p.add_argument("--ops-per-step", type=int, default=2000)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one configuration may take")
    p.add_argument("--keep-topics", action="store_true", help="do not delete the benchmark's topics")
    args = p.parse_args(argv)

    bootstrap = broker_bootstrap(args.bootstrap)
    from profstream.stack import stack_up

    broker_pid = stack_up().pid if not args.bootstrap else -1
    simulated = min(8, args.ranks)
    cfg = SimConfig(run_id="bench-scaleout", ranks=simulated, steps=args.steps, ops_per_step=args.ops_per_step,
                    step_time_ms=50.0)
    t0 = time.perf_counter()
    base, _ = monitor_messages(cfg)
    messages = clone_ranks(base, simulated, args.ranks)
    expected = args.ranks * args.steps
    total_ops = expected * args.ops_per_step
    note(f"built {len(messages)} messages ({total_ops} ops, {expected} steps) in {time.perf_counter() - t0:.1f} s")

    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for r in range(args.repeats):
        prefixes = {n: unique_prefix() for n in (1, 2)}
        try:
            fill_s = {}
            for n, prefix in prefixes.items():
                ensure_topics(bootstrap, Topics(prefix), raw_partitions=PARTITIONS)
                t = time.perf_counter()
                prefill(bootstrap, Topics(prefix), messages, partition_of=rank_partition)
                fill_s[n] = time.perf_counter() - t
            for n in ((1, 2) if r % 2 == 0 else (2, 1)):
                res = run_config(bootstrap, prefixes[n], n, expected, total_ops, broker_pid, args.timeout)
                res["prefill_s"] = fill_s[n]
                runs[n].append(res)
                note(f"repeat {r + 1}/{args.repeats}, {n} process(es): {res['ops_per_s'] / 1e6:.3f} M ops/s "
                     f"({res['elapsed_s']:.1f} s; group stable after {res['group_stable_after_s']}; "
                     f"processor CPU {[round(c, 2) for c in res['processor_cpu_share']]}, broker "
                     f"{res['broker_cpu_share']:.2f}; load {res['loadavg_1m']})")
        finally:
            if not args.keep_topics:
                for prefix in prefixes.values():
                    drop_topics(bootstrap, prefix)

    note("machine: 2 busy loops against 1 ...")
    machine_scaling = cpu_scaling()
    one = [x["ops_per_s"] for x in runs[1]]
    two = [x["ops_per_s"] for x in runs[2]]
    ratios = [b / a for a, b in zip(one, two)]
    one_s = [x["ops_per_s_from_group_stable"] for x in runs[1]]
    two_s = [x["ops_per_s_from_group_stable"] for x in runs[2]]
    ratios_stable = [b / a for a, b in zip(one_s, two_s) if a and b]
    median_ratio = statistics.median(ratios)
    results = {
        "bootstrap": bootstrap,
        "metric": "ratio of op events/s (launch -> all StepMetrics committed) of 2 processes in one group "
                  "to 1 process, per repeat; median over repeats",
        "unit": "ratio",
        "workload": {"ranks": args.ranks, "steps_per_rank": args.steps, "ops_per_step": args.ops_per_step,
                     "op_events": total_ops, "steps": expected, "messages": len(messages),
                     "raw_partitions": PARTITIONS, "cpu_count": os.cpu_count()},
        "per_repeat": ratios,
        "median": median_ratio,
        "one_process_ops_per_s": summary(one),
        "two_processes_ops_per_s": summary(two),
        "ratio_from_group_stable": summary(ratios_stable) if ratios_stable else None,
        "machine_cpu_scaling_2_vs_1": machine_scaling,
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "target": {"min_ratio": TARGET_RATIO},
        "meets_target": median_ratio >= TARGET_RATIO,
        "runs": {"one_process": runs[1], "two_processes": runs[2]},
    }
    emit(envelope("processor_scaleout", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
