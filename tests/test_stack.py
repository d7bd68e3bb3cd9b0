"""The local Kafka stack against a real broker: start, reuse, status, stop, topics."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from importlib.resources import files
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition

from profstream.kafka.topics import Topics, ensure_topics
from profstream.stack import (
    KAFKA_VERSION,
    StackError,
    default_state_dir,
    find_java,
    kafka_libs,
    stack_down,
    stack_status,
    stack_up,
    wait_for_broker,
)

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _partition_counts(bootstrap: str, names: list[str]) -> dict[str, int]:
    with KafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=10000, bootstrap_timeout_ms=10000
    ) as admin:
        return {t["name"]: len(t["partitions"]) for t in admin.describe_topics(names)}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg, repr(msg)
    return msg


# --------------------------------------------------------------------------------------
# No broker needed


def test_kafka_version_matches_pom() -> None:
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    for pom in (files("profstream.stack") / "pom.xml", REPO / "deploy" / "kafka" / "pom.xml"):
        root = ET.fromstring(pom.read_bytes())
        assert root.findtext("m:properties/m:kafka.version", namespaces=ns) == KAFKA_VERSION


def test_missing_java_is_a_one_line_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv("JAVA_HOME", "")
    with pytest.raises(StackError) as err:
        find_java()
    msg = _one_line(err.value)
    assert "java not found" in msg and "JAVA_HOME" in msg

    state = tmp_path / "stack"
    with pytest.raises(StackError, match="java not found"):
        stack_up(state_dir=state)
    assert not state.exists(), "stack_up must check java before touching anything"


def test_java_home_without_java_is_reported(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    with pytest.raises(StackError) as err:
        find_java()
    assert f"JAVA_HOME={tmp_path}" in _one_line(err.value)


def test_kafka_home_without_jars_is_reported(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KAFKA_HOME", str(tmp_path))
    with pytest.raises(StackError) as err:
        kafka_libs()
    assert "KAFKA_HOME" in _one_line(err.value)


def test_no_maven_and_no_kafka_home_names_what_to_install(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("KAFKA_HOME", raising=False)
    monkeypatch.setenv("PATH", "")
    with pytest.raises(StackError) as err:
        kafka_libs(cache_dir=tmp_path)
    msg = _one_line(err.value)
    assert "mvn not found" in msg and "Maven" in msg and "KAFKA_HOME" in msg
    assert not (tmp_path / f"kafka-{KAFKA_VERSION}" / "libs").exists()


def test_default_state_dir_follows_xdg_cache_home(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_state_dir() == tmp_path / "profstream" / "stack"


def test_wait_for_broker_on_closed_port_fails_within_timeout() -> None:
    bootstrap = f"127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(StackError) as err:
        wait_for_broker(bootstrap, timeout=1.5)
    elapsed = time.monotonic() - start
    assert elapsed < 1.5 + 0.5
    msg = _one_line(err.value)
    assert f"broker at {bootstrap} did not answer within 1.5 s" in msg
    assert "profstream stack up" in msg


def test_wait_for_broker_needs_a_kafka_answer_not_just_tcp() -> None:
    # Something listens but never speaks Kafka: a TCP connect alone must not pass.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        bootstrap = f"127.0.0.1:{server.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(StackError, match="did not answer within"):
            wait_for_broker(bootstrap, timeout=1.0)
        assert time.monotonic() - start < 1.0 + 0.5


def test_stale_state_file_is_cleaned_up(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    state = tmp_path / "stack"
    state.mkdir()
    (state / "broker.json").write_text(
        json.dumps(
            {
                "bootstrap": "127.0.0.1:1",
                "pid": dead.pid,
                "controller_port": 2,
                "version": KAFKA_VERSION,
            }
        )
    )
    assert stack_status(state) is None
    assert not (state / "broker.json").exists()
    assert stack_down(state) is False


@pytest.mark.parametrize("prefix", ["", "has space", "a/b", "ü", "x" * 101])
def test_ensure_topics_rejects_bad_prefix(prefix: str) -> None:
    # Validation happens before any network access (nothing listens on port 1).
    with pytest.raises(ValueError) as err:
        ensure_topics("127.0.0.1:1", Topics(prefix=prefix), timeout=1.0)
    _one_line(err.value)


def test_topic_names() -> None:
    t = Topics()
    assert t.prefix == "profstream"
    assert t.all() == [
        "profstream.raw",
        "profstream.steps",
        "profstream.run",
        "profstream.alerts",
        "profstream.dlq",
        "profstream.state",
        "profstream.run-state",
        "profstream.control",
        "profstream.partials",
    ]
    assert (t.raw, t.steps, t.run, t.alerts, t.dlq, t.state, t.run_state, t.control, t.partials) == tuple(t.all())
    assert Topics("a").raw == "a.raw"


# --------------------------------------------------------------------------------------
# Session broker (tests/conftest.py)


def test_produced_message_is_consumed_back(kafka_bootstrap: str, topics: Topics) -> None:
    payload = f"hello-{uuid.uuid4().hex}".encode()
    producer = KafkaProducer(
        bootstrap_servers=kafka_bootstrap, request_timeout_ms=10000, bootstrap_timeout_ms=10000
    )
    try:
        meta = producer.send(topics.steps, key=b"run-1", value=payload).get(timeout=10)
    finally:
        producer.close(timeout=5)
    tp = TopicPartition(topics.steps, meta.partition)

    consumer = KafkaConsumer(
        bootstrap_servers=kafka_bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        request_timeout_ms=10000,
        bootstrap_timeout_ms=10000,
    )
    try:
        consumer.assign([tp])
        consumer.seek(tp, meta.offset)
        got = []
        deadline = time.monotonic() + 15
        while not got and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                got.extend(records)
    finally:
        consumer.close()
    assert got, "message not consumed back within 15 s"
    assert (got[0].key, got[0].value) == (b"run-1", payload)


def test_topics_fixture_creates_every_topic(kafka_bootstrap: str, topics: Topics) -> None:
    counts = _partition_counts(kafka_bootstrap, topics.all())
    assert counts == {
        topics.raw: 4,
        topics.steps: 3,
        topics.run: 3,
        topics.alerts: 3,
        topics.dlq: 3,
        topics.state: 4,  # a changelog is partitioned like the topic whose state it holds
        topics.run_state: 3,  # like partials, the run stage's input
        topics.control: 3,
        topics.partials: 3,
    }


def test_ensure_topics_is_idempotent_and_race_safe(kafka_bootstrap: str) -> None:
    t = Topics(prefix=f"t-ensure-{uuid.uuid4().hex[:8]}")
    # without authentication every requester is ANONYMOUS: its request topic comes with the others
    assert ensure_topics(kafka_bootstrap, t, raw_partitions=6, partitions=2) == t.all() + [t.requests("ANONYMOUS")]
    assert _partition_counts(kafka_bootstrap, t.all()) == {
        t.raw: 6,
        t.steps: 2,
        t.run: 2,
        t.alerts: 2,
        t.dlq: 2,
        t.state: 6,
        t.run_state: 2,
        t.control: 2,
        t.partials: 2,
    }
    # Existing topics are left alone, whatever partition counts are asked for.
    assert ensure_topics(kafka_bootstrap, t, raw_partitions=9, partitions=5) == []
    assert _partition_counts(kafka_bootstrap, [t.raw])[t.raw] == 6

    # Two processes starting at once both succeed and create each topic exactly once.
    t2 = Topics(prefix=f"t-race-{uuid.uuid4().hex[:8]}")
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(ensure_topics(kafka_bootstrap, t2, raw_partitions=4))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    assert sorted(results[0] + results[1]) == sorted(t2.all() + [t2.requests("ANONYMOUS")])


# --------------------------------------------------------------------------------------
# A broker of its own: up, reuse, status, down, restart, failed start


@pytest.mark.kafka
def test_stack_up_reuse_status_down_restart(tmp_path: Path) -> None:
    state = tmp_path / "stack"
    try:
        start = time.monotonic()
        broker = stack_up(state_dir=state, timeout=120)
        first_up = time.monotonic() - start
        assert broker.bootstrap.startswith("127.0.0.1:")
        assert broker.state_dir == state.resolve()
        assert broker.log_file.is_file()
        wait_for_broker(broker.bootstrap, timeout=5)

        props = (state / "server.properties").read_text()
        assert "process.roles=broker,controller" in props
        assert f"controller.quorum.voters=1@127.0.0.1:{broker.controller_port}" in props
        assert "auto.create.topics.enable=false" in props
        recorded = json.loads((state / "broker.json").read_text())
        assert recorded["pid"] == broker.pid and recorded["version"] == KAFKA_VERSION

        # A second `stack up` on the same dir reuses the running broker.
        start = time.monotonic()
        again = stack_up(state_dir=state)
        assert again == broker
        assert time.monotonic() - start < max(2.0, first_up / 2)
        assert stack_status(state) == broker

        t = Topics(prefix="keep")
        assert ensure_topics(broker.bootstrap, t, raw_partitions=2) == t.all() + [t.requests("ANONYMOUS")]

        assert stack_down(state) is True
        assert not _pid_alive(broker.pid)
        assert stack_status(state) is None
        assert not (state / "broker.json").exists()
        assert stack_down(state) is False
        with pytest.raises(StackError):
            wait_for_broker(broker.bootstrap, timeout=1)

        # `stack up` after `stack down` keeps the address and the topics.
        restarted = stack_up(state_dir=state)
        assert restarted.bootstrap == broker.bootstrap
        assert restarted.pid != broker.pid
        assert ensure_topics(restarted.bootstrap, t, raw_partitions=2) == []
        assert stack_down(state) is True

        # Another process holds the data-dir lock (as a second Kafka would): the broker
        # exits at startup and `stack up` says why in one line, naming the log file.
        with open(state / "data" / ".lock", "a+") as fh:
            fcntl.lockf(fh.fileno(), fcntl.LOCK_EX)
            try:
                with pytest.raises(StackError) as err:
                    stack_up(state_dir=state, timeout=60)
            finally:
                fcntl.lockf(fh.fileno(), fcntl.LOCK_UN)
        msg = _one_line(err.value)
        assert "exited during startup" in msg and "Failed to acquire lock" in msg
        assert str(state.resolve() / "logs" / "server.log") in msg
        assert stack_status(state) is None
    finally:
        stack_down(state)


@pytest.mark.kafka
def test_incomplete_kafka_home_fails_with_advice(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "kafka" / "libs").mkdir(parents=True)
    (tmp_path / "kafka" / "libs" / "kafka_2.13-0.jar").write_bytes(b"")
    monkeypatch.setenv("KAFKA_HOME", str(tmp_path / "kafka"))
    with pytest.raises(StackError) as err:
        stack_up(state_dir=tmp_path / "stack", timeout=30)
    msg = _one_line(err.value)
    assert "not a complete Kafka" in msg and "KAFKA_HOME" in msg
    assert stack_status(tmp_path / "stack") is None


def _stack_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profstream.cli", "stack", *args], capture_output=True, text=True,
                          timeout=60)


def test_cluster_commands_refuse_what_cannot_be_with_one_line_each(tmp_path: Path) -> None:
    single, cluster = tmp_path / "single", tmp_path / "cluster"
    cases = [
        (("kill-broker", "2", "--dir", str(single)), "holds a single broker, broker 1"),
    ]
    for args, says in cases:
        done = _stack_cli(*args)
        assert done.returncode != 0 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done
    assert not (cluster / "cluster.json").exists(), "a refused cluster must leave nothing behind"
    # a cluster of 3 recorded (ports, id) but not started: nothing runs, nothing to kill
    from profstream.stack.cluster import _create

    cluster.mkdir()
    _create(cluster, 3)
    for args, says in [(("kill-broker", "5", "--dir", str(cluster)), "no broker 5 in the cluster"),
                       (("kill-broker", "2", "--dir", str(cluster)), "broker 2 of"),
                       (("up", "--brokers", "2", "--dir", str(cluster)), "holds a cluster of 3 brokers, not 2")]:
        done = _stack_cli(*args)
        assert done.returncode != 0 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done
    done = _stack_cli("status", "--dir", str(cluster))
    assert done.returncode == 1 and "broker 1  down" in done.stdout and "not running" in done.stdout, done
