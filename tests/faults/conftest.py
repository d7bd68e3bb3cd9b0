"""The fault suite (`make test-faults`): a broker of its own that the tests stop, kill and
start again, and processors run as the operator runs them, in processes of their own.
The same faults happen to a cluster of 3 brokers (``cluster`` fixture): the broker that
leads most partitions is killed (in `make test-faults`); a processor killed, both, the
whole cluster away for 30 s and a Monitor's buffer overflowing meanwhile take longer and
are marked ``cluster`` (`make test-cluster`).

Every test here is marked ``faults``; `make test` deselects them, `.ci/run` runs them
after it. Waits are deadlines on conditions, never fixed sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from profstream.kafka.topics import Topics, ensure_topics
from profstream.stack import kill_broker, stack_down, stack_status, stack_up, start_broker
from tests.conftest import _prefix_for
from tests.helpers import scrape, wait_until


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "/faults/" in str(item.fspath):
            item.add_marker(pytest.mark.faults)


class Broker:
    """A single-node broker, or a cluster of ``brokers``, in a state directory of its own,
    on the same ports across restarts (clients reconnect to the addresses they know)."""

    def __init__(self, state_dir: Path, brokers: int = 1) -> None:
        self.state_dir = state_dir
        self.brokers = brokers
        self.bootstrap = stack_up(state_dir=state_dir, brokers=brokers).bootstrap

    def stop(self) -> None:
        """Stop every broker."""
        assert stack_down(state_dir=self.state_dir)

    def kill(self, node_id: int = 1) -> None:
        """kill -9 one broker."""
        kill_broker(self.state_dir, node_id)

    def start(self) -> float:
        """Start every broker that is down; returns the monotonic time at which all answer."""
        assert stack_up(state_dir=self.state_dir).bootstrap == self.bootstrap
        return time.monotonic()

    def start_broker(self, node_id: int) -> float:
        """Start one broker again; returns the monotonic time at which it answers."""
        start_broker(self.state_dir, node_id)
        return time.monotonic()

    def all_running(self) -> bool:
        stack = stack_status(self.state_dir)
        return stack is not None and (self.brokers == 1 or len(stack.running) == self.brokers)

    def leaders(self, topic: str) -> dict[int, int]:
        """Partition -> id of the broker that leads it, now."""
        from kafka import KafkaAdminClient

        with KafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=10000) as admin:
            (described,) = admin.describe_topics([topic])
        return {p["partition_index"]: p["leader_id"] for p in described["partitions"]}

    def start_in(self, delay_s: float) -> threading.Thread:
        """Start it again ``delay_s`` s from now, on a thread (joined by the caller)."""
        timer = threading.Timer(delay_s, self.start)
        timer.start()
        return timer


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    b = Broker(tmp_path_factory.mktemp("fault-broker"))
    try:
        yield b
    finally:
        stack_down(state_dir=b.state_dir)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A cluster of 3 brokers (combined broker and controller each): topics have 3
    replicas and take a write once 2 have it."""
    b = Broker(tmp_path_factory.mktemp("fault-cluster"), brokers=3)
    try:
        yield b
    finally:
        stack_down(state_dir=b.state_dir)


def _fresh_topics(kafka: Broker, request: pytest.FixtureRequest, raw_partitions: int) -> Topics:
    if not kafka.all_running():
        kafka.start()
    t = Topics(prefix=_prefix_for(request.node.name))
    ensure_topics(kafka.bootstrap, t, raw_partitions=raw_partitions, partitions=3)
    return t


@pytest.fixture
def fault_topics(broker: Broker, request: pytest.FixtureRequest) -> Topics:
    """Fresh topics per test; the broker runs when the test starts (a test that stops it
    starts it again before it ends)."""
    return _fresh_topics(broker, request, 4)


@pytest.fixture
def cluster_topics(cluster: Broker, request: pytest.FixtureRequest) -> Topics:
    """Fresh topics per test on the cluster (raw: 6 partitions, 2 led by each broker),
    every broker running when the test starts."""
    return _fresh_topics(cluster, request, 6)


class Service:
    """A profstream command as an operator runs it: its own process, its output to a log file."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.cmd, self.log = cmd, log
        self.proc: subprocess.Popen | None = None

    def start(self):
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_until(self.ready, 60, f"{self.cmd[3]} to start ({self.log})")
        return self

    def ready(self) -> bool:
        raise NotImplementedError

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def output(self) -> str:
        return self.log.read_text()

    def state(self, lines: int = 30) -> str:
        """Whether it still runs, and the end of its log: what a failed wait on it shows."""
        rc = None if self.proc is None else self.proc.poll()
        tail = "\n".join(self.output().splitlines()[-lines:])
        return f"{'running' if rc is None else f'exited with {rc}'}; the end of {self.log}:\n{tail}"


class ProcessorProcess(Service):
    """`profstream process`, its health metrics on a port of its own."""

    def __init__(self, bootstrap: str, topics: Topics, log: Path, *args: str) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        super().__init__([sys.executable, "-m", "profstream.cli", "process", "--bootstrap", bootstrap,
                          "--topic-prefix", topics.prefix, "--group-id", f"g-{topics.prefix}", "--instance-id", "p0",
                          "--metrics-port", str(self.port), "--grace-s", "0.5", "--run-grace-s", "5", *args], log)

    def ready(self) -> bool:
        return self.metrics() is not None

    def metrics(self) -> dict[str, float] | None:
        """The health metrics now, as {name{labels}: value}; None when not served."""
        try:
            return scrape(self.port)
        except OSError:
            return None


class ArchiveProcess(Service):
    """`profstream sink archive` of the raw topic into ``out``, finishing a file every second."""

    def __init__(self, bootstrap: str, topics: Topics, out: Path, log: Path) -> None:
        self.out = out
        super().__init__([sys.executable, "-m", "profstream.cli", "sink", "archive", str(out), "--bootstrap",
                          bootstrap, "--topic-prefix", topics.prefix, "--topics", "raw", "--group-id",
                          f"a-{topics.prefix}", "--max-age-s", "1", "--no-progress"], log)

    def ready(self) -> bool:
        return "archiving" in self.output()
