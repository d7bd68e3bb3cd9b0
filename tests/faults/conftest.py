"""The fault suite (`make test-faults`): a broker of its own that the tests stop, kill and
start again, and processors run as the operator runs them, in processes of their own.

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
from profstream.stack import stack_down, stack_status, stack_up
from tests.conftest import _prefix_for
from tests.helpers import scrape, wait_until


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "/faults/" in str(item.fspath):
            item.add_marker(pytest.mark.faults)


class Broker:
    """A single-node broker in a state directory of its own, on the same ports across
    restarts (clients reconnect to the address they know)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.bootstrap = stack_up(state_dir=state_dir).bootstrap

    def stop(self) -> None:
        assert stack_down(state_dir=self.state_dir)

    def kill(self) -> None:
        broker = stack_status(self.state_dir)
        assert broker is not None
        os.kill(broker.pid, signal.SIGKILL)
        wait_until(lambda: stack_status(self.state_dir) is None, 30, "the killed broker's process to go")

    def start(self) -> float:
        """Start it again; returns the monotonic time at which it answers."""
        assert stack_up(state_dir=self.state_dir).bootstrap == self.bootstrap
        return time.monotonic()

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


@pytest.fixture
def fault_topics(broker: Broker, request: pytest.FixtureRequest) -> Topics:
    """Fresh topics per test; the broker runs when the test starts (a test that stops it
    starts it again before it ends)."""
    if stack_status(broker.state_dir) is None:
        broker.start()
    t = Topics(prefix=_prefix_for(request.node.name))
    ensure_topics(broker.bootstrap, t, raw_partitions=4, partitions=3)
    return t


class ProcessorProcess:
    """`profstream process` as an operator runs it: its own process, stderr to a log file,
    health metrics on a port of its own."""

    def __init__(self, bootstrap: str, topics: Topics, log: Path, *args: str) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        self.cmd = [sys.executable, "-m", "profstream.cli", "process", "--bootstrap", bootstrap,
                    "--topic-prefix", topics.prefix, "--group-id", f"g-{topics.prefix}", "--instance-id", "p0",
                    "--metrics-port", str(self.port), "--grace-s", "0.5", "--run-grace-s", "5", *args]
        self.proc: subprocess.Popen | None = None

    def start(self) -> ProcessorProcess:
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_until(lambda: self.metrics() is not None, 60, f"the processor's metrics ({self.log})")
        return self

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

    def metrics(self) -> dict[str, float] | None:
        """The health metrics now, as {name{labels}: value}; None when not served."""
        try:
            return scrape(self.port)
        except OSError:
            return None

    def output(self) -> str:
        return self.log.read_text()
