"""What the fault tests share: a simulated run streaming through a processor while two
independent read_committed readers (``Tail``) record what the processor committed, and the
checks every fault must pass afterwards (every step once, values of an uninterrupted
processor, every run step once)."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter

from kafka import KafkaConsumer, TopicPartition

from profstream.kafka.topics import Topics
from profstream.schema.codec import decode, record_name
from profstream.simulate import SimConfig, SimResult, run_simulation
from tests.faults.conftest import ProcessorProcess
from tests.test_processor import _uninterrupted


class Tail(threading.Thread):
    """Every record of a topic (read_committed, from the start) with the moment it was
    seen: an independent reader of what the processors committed."""

    def __init__(self, bootstrap: str, topic: str, record: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.record = bootstrap, topic, record
        self.seen: list[tuple[float, dict]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, isolation_level="read_committed",
                                 enable_auto_commit=False, reconnect_backoff_max_ms=1000)
        tps = [TopicPartition(self.topic, p) for p in sorted(consumer.partitions_for_topic(self.topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        while not self.halt.is_set():
            for batch in consumer.poll(timeout_ms=100).values():
                now = time.monotonic()
                self.seen.extend((now, decode(self.record, r.value)) for r in batch
                                 if record_name(r.value) == self.record)  # a RankEnd beside the StepMetrics
        consumer.close()


class StreamingRun:
    """A simulated run of ``cfg`` on a thread, and Tails of the steps and run topics; a
    context manager that stops the readers on exit (the processor is the test's)."""

    def __init__(self, bootstrap: str, topics: Topics, cfg: SimConfig, **monitor_options) -> None:
        self.bootstrap, self.topics, self.cfg = bootstrap, topics, cfg
        self.steps = Tail(bootstrap, topics.steps, "StepMetrics")
        self.run_steps = Tail(bootstrap, topics.run, "RunStepMetrics")
        self._sim: dict = {}
        self._thread = threading.Thread(target=lambda: self._sim.update(result=run_simulation(
            cfg, {"bootstrap": bootstrap, "topic_prefix": topics.prefix, **monitor_options})), daemon=True)

    def __enter__(self) -> StreamingRun:
        self.steps.start()
        self.run_steps.start()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for tail in (self.steps, self.run_steps):
            tail.halt.set()
        for tail in (self.steps, self.run_steps):
            tail.join(10)

    def end(self, timeout_s: float) -> SimResult:
        """Wait for the simulated run to end; its result."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the simulated run did not end"
        return self._sim["result"]

    @property
    def raw_sent(self) -> int:
        """Raw batches the run's Monitors sent (after ``end``)."""
        return sum(s["seq"] for s in self._sim["result"].stats)

    def missing_steps(self) -> set[tuple[int, int]]:
        cfg = self.cfg
        return {(r, s) for r in range(cfg.ranks) for s in range(cfg.steps)} - {
            (m["rank"], m["step"]) for _, m in self.steps.seen}

    def missing_run_steps(self) -> set[int]:
        return set(range(self.cfg.steps)) - {m["step"] for _, m in self.run_steps.seen}

    def wait_committed(self, processor: ProcessorProcess, steps_s: float, run_steps_s: float) -> None:
        """Every step, then every run step committed (the run stage commits a step once every
        rank's StepMetrics reached it, in its own consumer group: waited for, not raced)."""
        wait_committed("steps", self.missing_steps, steps_s, processor)
        wait_committed("run steps", self.missing_run_steps, run_steps_s, processor)

    def check_once_and_clean(self) -> dict[tuple[int, int], dict]:
        """Every (rank, step) committed once with the values of an uninterrupted processor
        (all but closed_ns), every run step once; returns the committed steps by (rank, step)."""
        cfg = self.cfg
        seen = Counter((s["rank"], s["step"]) for _, s in self.steps.seen)
        assert len(seen) == cfg.ranks * cfg.steps and max(seen.values()) == 1, "steps missing or committed twice"
        reference = _uninterrupted(self.bootstrap, self.topics, cfg.run_id, self.raw_sent)
        live, clean = by_step(s for _, s in self.steps.seen), by_step(reference.values())
        differ = {k: {f: (v, clean.get(k, {}).get(f)) for f, v in live[k].items() if v != clean.get(k, {}).get(f)}
                  for k in live if live[k] != clean.get(k)}
        assert not differ, f"{len(differ)} steps differ from an uninterrupted processor's (field: live, clean): " + str(
            dict(list(differ.items())[:3]))[:3000]
        run_steps = Counter(r["step"] for _, r in self.run_steps.seen)
        assert set(run_steps) == set(range(cfg.steps)), "run steps other than the run's"
        assert max(run_steps.values()) == 1, f"run steps committed twice: {[s for s, n in run_steps.items() if n > 1]}"
        return live


def by_step(records) -> dict[tuple[int, int], dict]:
    """StepMetrics by (rank, step), without closed_ns (processing metadata)."""
    return {(r["rank"], r["step"]): {k: v for k, v in r.items() if k != "closed_ns"} for r in records}


def wait_committed(what: str, missing, timeout_s: float, processor: ProcessorProcess) -> None:
    """Wait until ``missing()`` is empty; else fail with the processor's metrics, threads and log."""
    deadline = time.monotonic() + timeout_s
    while (left := missing()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        processor.proc.send_signal(signal.SIGUSR1)  # its threads' stacks, into its log
        time.sleep(1)
    assert not left, (f"{len(left)} {what} never committed, e.g. {sorted(left)[:10]}; "
                      f"processor: {processor.metrics()}\n{processor.output()[-6000:]}")
