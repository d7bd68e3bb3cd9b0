"""Start and stop the local Kafka (KRaft mode) of a state directory: a single broker, or a
cluster of several (``cluster``) when asked for one or when the directory holds one.

The broker runs from the official Kafka jars (``jars``) on Java 17+ (``java``); its files
live in one state directory (``state``). Errors the user can fix are raised as
:class:`StackError`, whose message is one line that says what to do.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from profstream.stack.cluster import (
    Cluster,
    cluster_down,
    cluster_status,
    cluster_up,
    holds_cluster,
    kill_cluster_node,
    kill_now,
    start_cluster_node,
)
from profstream.stack.errors import StackError
from profstream.stack.jars import kafka_libs
from profstream.stack.java import find_java
from profstream.stack.node import (
    PORT_RELEASE_S,
    Launch,
    check_alive,
    configured_ports,
    free_ports,
    ports_released,
    running_node,
    stop_orphan,
)
from profstream.stack.probe import wait_for_broker
from profstream.stack.process import terminate
from profstream.stack.properties import NodeConfig, quorum_voters
from profstream.stack.secure import client_connection, is_secure
from profstream.stack.state import (
    DATA_DIR,
    LOCK_FILE,
    SERVER_PROPERTIES,
    STATE_FILE,
    Broker,
    broker_from_state,
    clear_state,
    is_our_broker,
    locked,
    read_json,
    read_pid_file,
    resolve_state_dir,
    single_broker_status,
)


def stack_up(state_dir: Path | None = None, timeout: float = 120.0, brokers: int | None = None,
             secure: bool = False) -> Broker | Cluster:
    """Start the local Kafka of ``state_dir``, or return the one running there.

    ``brokers``: 1 for a single broker (the default for a new directory), N > 1 for a
    cluster of N (``cluster.cluster_up``); None takes what the directory holds. ``secure``:
    a single broker with SASL_SSL (SCRAM), mutual TLS and ACLs (``stack/secure.py``); a
    directory that holds one keeps it secured. Raises :class:`StackError` (one line, says
    what to do) when Java or the jars are missing or the broker does not come up within
    ``timeout`` seconds.
    """
    java = find_java()  # before anything else: no files, no fetch without Java
    if brokers is not None and brokers < 1:
        raise StackError(f"--brokers {brokers}: a cluster needs at least 1 broker")
    state_dir = resolve_state_dir(state_dir)
    if secure and ((brokers or 1) > 1 or holds_cluster(state_dir)):
        raise StackError("--secure runs a single broker: leave out --brokers, or give another --dir")
    if (brokers or 1) > 1 or holds_cluster(state_dir):
        return cluster_up(java, state_dir, brokers, timeout)
    state_dir.mkdir(parents=True, exist_ok=True)

    with locked(state_dir / LOCK_FILE):
        running = _running_broker(state_dir, time.monotonic() + timeout)
        if running is not None and secure and not is_secure(state_dir):
            raise StackError(f"the broker of {state_dir} runs without security: stop it (`profstream stack down`) "
                             "to start it secured, or give --secure another --dir")
        if running is None:
            libs = kafka_libs()  # a first-time fetch does not count against `timeout`
            running = _start(java, libs, state_dir, time.monotonic() + timeout, timeout,
                             secure or _was_secure(state_dir))
    if is_secure(state_dir) and secure:
        from profstream.kafka.acls import setup_stack

        setup_stack(state_dir)  # the default prefix's topics and every role's ACLs, as admin
    return running


def _was_secure(state_dir: Path) -> bool:
    """Whether the stopped broker of ``state_dir`` was secured (it starts so again)."""
    ports = configured_ports(state_dir / SERVER_PROPERTIES)
    return ports is not None and len(ports) == 3


def _running_broker(state_dir: Path, deadline: float) -> Broker | None:
    """Reuse a recorded live broker; stop and forget a recorded one that does not answer."""
    broker = running_node(state_dir)
    if broker is not None:
        try:
            wait_for_broker(
                client_connection(state_dir) if is_secure(state_dir) else broker.bootstrap,
                max(0.0, min(10.0, deadline - time.monotonic())),
                alive=lambda: check_alive(broker.pid, state_dir),
            )
            return broker
        except StackError:
            terminate(broker.pid, 15.0)
    stop_orphan(state_dir)  # an interrupted start (pid file, no broker.json) holds the data dir
    return None


def _start(java: str, libs: Path, state_dir: Path, deadline: float, timeout: float, secure: bool = False) -> Broker:
    # Keep the ports the storage was formatted with when they are still free; otherwise
    # take new ones and start from empty storage (a dev broker; data is disposable).
    old = configured_ports(state_dir / SERVER_PROPERTIES)
    wanted = 3 if secure else 2
    if old and len(old) == wanted and len(set(old)) == wanted and ports_released(
            old, min(PORT_RELEASE_S, deadline - time.monotonic())):
        ports = list(old)
    else:
        ports = free_ports(wanted)
        shutil.rmtree(state_dir / DATA_DIR, ignore_errors=True)
    if secure:
        from profstream.stack.secure import ensure_material

        ensure_material(state_dir)
        port, ssl_port, cport = ports
    else:
        (port, cport), ssl_port = ports, 0
    node = NodeConfig(node_id=1, port=port, controller_port=cport, voters=quorum_voters({1: cport}),
                      ssl_port=ssl_port)
    return Launch(java, libs, state_dir, node, "", deadline).wait(deadline, timeout)


def stack_down(state_dir: Path | None = None, timeout: float = 30.0) -> bool:
    """Stop the broker (or every broker of the cluster) of ``state_dir`` (SIGTERM, SIGKILL
    after ``timeout`` s).

    Returns True when a broker was stopped, False when none was running there.
    """
    state_dir = resolve_state_dir(state_dir)
    if not state_dir.is_dir():
        return False
    if holds_cluster(state_dir):
        return cluster_down(state_dir, timeout)
    stopped = False
    with locked(state_dir / LOCK_FILE):
        pids = []
        data = read_json(state_dir / STATE_FILE)
        broker = broker_from_state(state_dir, data) if data else None
        if broker is not None:
            pids.append(broker.pid)
        pid = read_pid_file(state_dir)
        if pid is not None and pid not in pids:
            pids.append(pid)
        for pid in pids:
            if is_our_broker(pid, state_dir):
                terminate(pid, timeout)
                stopped = True
        clear_state(state_dir)
    return stopped


def stack_status(state_dir: Path | None = None) -> Broker | Cluster | None:
    """The broker recorded in ``state_dir`` if its process is alive, else None; for a
    cluster, the :class:`Cluster` when any of its brokers runs.

    A state file whose process is gone is removed.
    """
    state_dir = resolve_state_dir(state_dir)
    if holds_cluster(state_dir):
        cluster = cluster_status(state_dir)
        return cluster if cluster.running else None
    return single_broker_status(state_dir)


def kill_broker(state_dir: Path | str | None, node_id: int) -> int:
    """SIGKILL broker ``node_id`` of ``state_dir`` (a fault: no controlled shutdown) and
    wait until its process is gone; returns its pid. A single broker is broker 1."""
    state_dir = resolve_state_dir(state_dir)
    if holds_cluster(state_dir):
        return kill_cluster_node(state_dir, node_id)
    if node_id != 1:
        raise StackError(f"no broker {node_id}: {state_dir} holds a single broker, broker 1")
    with locked(state_dir / LOCK_FILE):
        broker = single_broker_status(state_dir)
        if broker is None:
            raise StackError(f"the broker of {state_dir} is not running")
        kill_now(broker.pid, node_id)
        clear_state(state_dir)
        return broker.pid


def start_broker(state_dir: Path | str | None, node_id: int, timeout: float = 120.0) -> Broker:
    """Start broker ``node_id`` of ``state_dir`` again, with its ports and data, and wait
    until it answers; a running one is returned as it is. A single broker is broker 1."""
    java = find_java()
    state_dir = resolve_state_dir(state_dir)
    if holds_cluster(state_dir):
        return start_cluster_node(java, state_dir, node_id, timeout)
    if node_id != 1:
        raise StackError(f"no broker {node_id}: {state_dir} holds a single broker, broker 1")
    broker = stack_up(state_dir, timeout)
    assert isinstance(broker, Broker)
    return broker
