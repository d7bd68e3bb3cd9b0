"""Recovery on a 3-broker cluster: how long after a fault the figures of every rank are fresh again.

A cluster of 3 brokers (replication factor 3, min.insync.replicas 2; the fault suite's
``cluster`` fixture in a temporary directory), and per repeat and fault fresh topics (raw:
6 partitions), a ``profstream process`` subprocess (health metrics on) and a simulated run
at its real pace: ``--ranks`` ranks (16) x 100 ms steps x 50 ops, ``--steps`` steps. Once
20 steps of every rank are committed, one fault (the fault suite's, tests/faults/
test_cluster_faults.py):

- ``leader-kill-9``: kill -9 the broker that leads most raw partitions (started again once
  the figures are fresh);
- ``processor-kill-9``: kill -9 the processor and start it again at once;
- ``leader-and-processor-kill-9``: both, then both started again;
- ``cluster-down-30s``: every broker stopped for 30 s, then started again.

``fresh_again_s``: from the end of the fault (the kill; the restart of both; the cluster
answering again) until every rank has a committed StepMetrics (read_committed, an
independent reader on kafka-python, as the sinks read; ``fresh_again_librdkafka_reader_s``
the same seen by a reader on librdkafka, as the processors read) of a step that ended
after that moment. Beside it, for a leader
kill, ``leaders_moved_s``: when every raw partition had a live leader again (polled every
0.25 s); for every fault, ``processor_recovered_s``: when the processor's
``profstream_processor_recoveries_total`` went up (None: it did not need to);
``raw_flowing_s``: when every raw partition had taken a new message (the Monitors deliver
again); ``steps_committed_s``: when the step stage first committed a transaction 0.5 s or
more after the fault (``profstream_processor_last_commit_timestamp_seconds``; it commits
every 0.1 s when healthy). The fault
suite checks on the same scenarios that nothing is lost or committed twice; this measures
only time.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import chosen, emit, envelope, note, summary, unique_prefix
from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition
from kafka.errors import KafkaError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the fault suite's fixtures

from profstream.kafka.clients import make_native_consumer  # noqa: E402
from profstream.kafka.topics import Topics, ensure_topics  # noqa: E402
from profstream.schema.codec import decode, record_name  # noqa: E402
from profstream.simulate import SimConfig, run_simulation  # noqa: E402
from profstream.stack import stack_down  # noqa: E402
from tests.faults.conftest import Broker, ProcessorProcess  # noqa: E402
from tests.faults.streaming import Tail  # noqa: E402
from tests.faults.test_cluster_faults import FAULTS, fresh_again  # noqa: E402

TARGET_LEADER_KILL_S = 15.0


class NativeTail(threading.Thread):
    """The same reader as the fault suite's Tail, on librdkafka (as the processors read):
    tells the processor's delay from the kafka-python reader's own."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic = bootstrap, topic
        self.seen: list[tuple[float, dict]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        consumer = make_native_consumer(self.bootstrap, f"tail-{self.topic}")
        parts = consumer.list_topics(self.topic, timeout=30).topics[self.topic].partitions
        consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in parts])
        try:
            while not self.halt.is_set():
                for m in consumer.consume(500, 0.1):
                    if m.error() is None and record_name(m.value()) == "StepMetrics":  # not a RankEnd
                        self.seen.append((time.monotonic(), decode("StepMetrics", m.value())))
        finally:
            consumer.close()


def _recoveries(processor: ProcessorProcess) -> float:
    metrics = processor.metrics() or {}
    return sum(v for k, v in metrics.items() if k.startswith("profstream_processor_recoveries_total"))


def _watch_leaders(cluster: Broker, topic: str, dead: int, since: float, stop: threading.Event,
                   out: dict[str, float]) -> None:
    """out["leaders_moved_s"]: when every partition of ``topic`` is led by a live broker."""
    while not stop.is_set():
        try:
            if all(leader not in (dead, -1) for leader in cluster.leaders(topic).values()):
                out["leaders_moved_s"] = time.monotonic() - since
                return
        except KafkaError:  # the admin client may fail while leadership moves: ask again
            pass
        stop.wait(0.25)


def _raw_ends(cluster: Broker, topics: Topics) -> dict[int, int]:
    """The raw partitions' end offsets now."""
    reader = make_native_consumer(cluster.bootstrap, f"watch-{topics.prefix}")
    try:
        parts = reader.list_topics(topics.raw, timeout=10).topics[topics.raw].partitions
        ends = {p: reader.get_watermark_offsets(TopicPartition(topics.raw, p), timeout=10)[1] for p in parts}
        return {p: end for p, end in ends.items() if end > 0}  # a partition no rank's key lands on stays empty
    finally:
        reader.close()


def _watch_progress(cluster: Broker, topics: Topics, processor: ProcessorProcess, ends: dict[int, int | None],
                    since: float, since_wall: float, stop: threading.Event, out: dict[str, float]) -> None:
    """out["raw_flowing_s"]: every raw partition grew past ``ends``; out["steps_committed_s"]:
    the step stage committed after the fault (both polled every 0.25 s)."""
    reader = make_native_consumer(cluster.bootstrap, f"watch-{topics.prefix}")
    try:
        while not stop.is_set() and len(out) < 2:
            if "steps_committed_s" not in out:
                commits = {k: v for k, v in (processor.metrics() or {}).items()
                           if k.startswith("profstream_processor_last_commit_timestamp_seconds") and "stage=steps" in k}
                if any(v >= since_wall + 0.5 for v in commits.values()):  # not one that was under way
                    out["steps_committed_s"] = time.monotonic() - since
            if "raw_flowing_s" not in out:
                try:
                    for p in [p for p, end in ends.items() if end is not None]:
                        if reader.get_watermark_offsets(TopicPartition(topics.raw, p), timeout=1)[1] > ends[p]:
                            ends[p] = None
                except KafkaException:  # the partition's leader is gone: ask again
                    pass
                if all(end is None for end in ends.values()):
                    out["raw_flowing_s"] = time.monotonic() - since
            stop.wait(0.25)
    finally:
        reader.close()


def one_run(cluster: Broker, fault_name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    topics = Topics(unique_prefix())
    ensure_topics(cluster.bootstrap, topics, raw_partitions=6, partitions=3)
    cfg = SimConfig(run_id="recovery", ranks=args.ranks, steps=args.steps, ops_per_step=50, step_time_ms=100,
                    seed=1, rate="realtime")
    processor = ProcessorProcess(cluster.bootstrap, topics, workdir / f"{topics.prefix}.log", "--run-grace-s",
                                 "90").start()
    tail = Tail(cluster.bootstrap, topics.steps, "StepMetrics")
    tail.start()
    native = NativeTail(cluster.bootstrap, topics.steps)
    native.start()
    run = threading.Thread(target=run_simulation, args=(cfg, {"bootstrap": cluster.bootstrap,
                                                              "topic_prefix": topics.prefix}), daemon=True)
    run.start()
    stop = threading.Event()
    moved: dict[str, float] = {}
    progress: dict[str, float] = {}
    result: dict[str, Any] = {"fault": fault_name}
    try:
        deadline = time.monotonic() + 120
        while len(tail.seen) < 20 * args.ranks and time.monotonic() < deadline:
            time.sleep(0.05)
        before = _recoveries(processor)
        ends = _raw_ends(cluster, topics)
        started, started_wall = time.monotonic(), time.time()
        threading.Thread(target=_watch_progress, args=(cluster, topics, processor, ends, started, started_wall, stop,
                                                       progress), daemon=True).start()
        fault = FAULTS[fault_name](cluster, processor, topics.raw)
        result["fault_took_s"] = fault.over_at - started
        if fault.killed is not None:
            result["killed_broker"] = fault.killed
            threading.Thread(target=_watch_leaders, args=(cluster, topics.raw, fault.killed, started, stop, moved),
                             daemon=True).start()
        if fault.processor_restarted:
            before = 0.0
        recovered = fresh = None
        deadline = time.monotonic() + 180
        while fresh is None and time.monotonic() < deadline:
            if recovered is None and _recoveries(processor) > before:
                recovered = time.monotonic() - fault.over_at
            fresh = fresh_again(tail, fault, args.ranks, args.steps - 1)
            time.sleep(0.05)
        deadline = time.monotonic() + 30
        while (fresh_native := fresh_again(native, fault, args.ranks, args.steps - 1)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        result.update(fresh_again_s=fresh, fresh_again_librdkafka_reader_s=fresh_native,
                      processor_recovered_s=recovered, leaders_moved_s=moved.get("leaders_moved_s"),
                      raw_flowing_s=progress.get("raw_flowing_s"), steps_committed_s=progress.get("steps_committed_s"))
        fault.restore()
        result["processor_said"] = [ln for ln in processor.output().splitlines() if "profstream processor" in ln]
        return result
    finally:
        stop.set()
        run.join(300)
        processor.stop()
        for t in (tail, native):
            t.halt.set()
            t.join(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated: " + ", ".join(FAULTS))
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--steps", type=int, default=500, help="steps of each rank (100 ms each)")
    args = p.parse_args(argv)
    faults = chosen(p, args.faults, FAULTS)
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        t = time.monotonic()
        cluster = Broker(Path(tmp) / "cluster", brokers=3)
        note(f"cluster {cluster.bootstrap} up in {time.monotonic() - t:.1f} s")
        try:
            runs = []
            for fault in faults:
                for r in range(args.repeats):
                    if not cluster.all_running():
                        cluster.start()
                    result = one_run(cluster, fault, args, Path(tmp))
                    note(f"{fault} {r + 1}/{args.repeats}: {result}")
                    runs.append(result)
        finally:
            stack_down(state_dir=cluster.state_dir)
    results: dict[str, Any] = {
        "metric": "seconds from the end of a fault until every rank has a committed StepMetrics of a step that "
                  "ended after it (fresh_again_s)",
        "unit": "s",
        "workload": {"ranks": args.ranks, "step_ms": 100, "ops_per_step": 50, "raw_partitions": 6, "brokers": 3,
                     "replication_factor": 3, "min_insync_replicas": 2},
        "target": {"leader-kill-9": {"fresh_again_s": TARGET_LEADER_KILL_S}},
        "runs": runs,
    }
    for fault in faults:
        mine = [r for r in runs if r["fault"] == fault]
        fresh = [r["fresh_again_s"] for r in mine if r["fresh_again_s"] is not None]
        results[fault] = {key: summary(vals) if vals else None for key, vals in (
            ("fresh_again_s", fresh),
            ("fresh_again_librdkafka_reader_s", [r["fresh_again_librdkafka_reader_s"] for r in mine
                                                 if r.get("fresh_again_librdkafka_reader_s") is not None]),
            *((key, [r[key] for r in mine if r.get(key) is not None])
              for key in ("leaders_moved_s", "raw_flowing_s", "steps_committed_s")),
            ("processor_recovered_s", [r["processor_recovered_s"] for r in mine
                                       if r["processor_recovered_s"] is not None]))}
        results[fault]["failed_to_recover"] = len(mine) - len(fresh)
    emit(envelope("cluster_recovery", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
