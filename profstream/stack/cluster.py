"""A Kafka cluster of several brokers on loopback, for trying out and testing replication
and broker failures: ``profstream stack up --brokers N``.

The cluster's directory holds ``cluster.json`` (its id, and every node's ports, fixed for
its life so that clients keep their addresses across restarts) and one state directory
per node, ``broker-<id>``, laid out as a single broker's. Nodes 1 to 3 are combined
broker + controller, the quorum: a majority of them must run for the cluster to work.
All nodes are launched before any is waited for, since none answers before the quorum
has formed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from profstream.stack.errors import StackError
from profstream.stack.jars import KAFKA_VERSION, kafka_libs
from profstream.stack.node import (
    PORT_RELEASE_S,
    Launch,
    free_ports,
    new_cluster_id,
    ports_released,
    running_node,
    stop_orphan,
)
from profstream.stack.probe import wait_for_broker
from profstream.stack.process import pid_alive, terminate
from profstream.stack.properties import MAX_CONTROLLERS, NodeConfig, quorum_voters
from profstream.stack.state import (
    DATA_DIR,
    LOCK_FILE,
    STATE_FILE,
    Broker,
    clear_state,
    locked,
    read_json,
    resolve_state_dir,
    try_lock,
    write_atomic,
)

CLUSTER_FILE = "cluster.json"
# Several JVMs share the machine: each gets less heap than a single broker (HEAP_OPTS).
CLUSTER_HEAP_OPTS = ("-Xms128m", "-Xmx512m")
MAX_BROKERS = 9
NEW_CLUSTER_ATTEMPTS = 3  # a new cluster whose ports were taken meanwhile tries others


@dataclass
class ClusterNode:
    node_id: int
    port: int
    controller_port: int
    state_dir: Path
    pid: int | None = None  # None: not running

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def controller(self) -> bool:
        return self.node_id <= MAX_CONTROLLERS

    @property
    def running(self) -> bool:
        return self.pid is not None


@dataclass
class Cluster:
    """The nodes of a local cluster and which of them run (as of when it was read)."""

    state_dir: Path
    cluster_id: str
    nodes: list[ClusterNode]

    @property
    def bootstrap(self) -> str:
        """Every node's address: clients find the cluster through whichever answers."""
        return ",".join(n.bootstrap for n in self.nodes)

    @property
    def running(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.running]

    @property
    def controllers(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.controller]

    @property
    def quorum(self) -> bool:
        """Whether a majority of the controllers runs (the cluster can elect a leader)."""
        return sum(n.running for n in self.controllers) > len(self.controllers) // 2

    def node(self, node_id: int) -> ClusterNode:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise StackError(f"no broker {node_id} in the cluster of {self.state_dir}: its brokers are "
                         f"{', '.join(str(n.node_id) for n in self.nodes)}")

    def config(self, node: ClusterNode) -> NodeConfig:
        voters = quorum_voters({n.node_id: n.controller_port for n in self.nodes})
        return NodeConfig(node.node_id, node.port, node.controller_port, voters, brokers=len(self.nodes))


def holds_cluster(state_dir: Path) -> bool:
    return (state_dir / CLUSTER_FILE).is_file()


def node_dir(state_dir: Path, node_id: int) -> Path:
    return state_dir / f"broker-{node_id}"


def _read(state_dir: Path) -> Cluster | None:
    data = read_json(state_dir / CLUSTER_FILE)
    try:
        nodes = [ClusterNode(int(n["node_id"]), int(n["port"]), int(n["controller_port"]),
                             node_dir(state_dir, int(n["node_id"]))) for n in data["nodes"]]
        cluster = Cluster(state_dir, str(data["cluster_id"]), nodes)
    except (KeyError, TypeError, ValueError):
        return None
    for n in cluster.nodes:
        broker = running_node(n.state_dir)
        n.pid = broker.pid if broker is not None else None
    return cluster


def _create(state_dir: Path, brokers: int) -> Cluster:
    if brokers > MAX_BROKERS:
        raise StackError(f"--brokers {brokers}: a local cluster has at most {MAX_BROKERS} brokers")
    if (state_dir / STATE_FILE).exists() or (state_dir / DATA_DIR).exists():
        raise StackError(f"{state_dir} holds a single broker: give the cluster another --dir, or stop that "
                         f"broker (`profstream stack down --dir {state_dir}`) and remove the directory")
    ports = free_ports(2 * brokers)
    nodes = [{"node_id": i + 1, "port": ports[2 * i], "controller_port": ports[2 * i + 1]} for i in range(brokers)]
    data = {"brokers": brokers, "cluster_id": new_cluster_id(), "version": KAFKA_VERSION, "nodes": nodes}
    write_atomic(state_dir / CLUSTER_FILE, json.dumps(data, indent=2) + "\n")
    cluster = _read(state_dir)
    assert cluster is not None
    return cluster


def _forget(cluster: Cluster) -> None:
    """Remove a cluster that never started (its nodes were stopped): its file and node directories."""
    for n in cluster.nodes:
        if n.state_dir.exists():
            shutil.rmtree(n.state_dir)
    (cluster.state_dir / CLUSTER_FILE).unlink(missing_ok=True)


def _load(state_dir: Path) -> Cluster:
    cluster = _read(state_dir)
    if cluster is None:
        raise StackError(f"{state_dir / CLUSTER_FILE} is damaged: stop what runs there (`profstream stack down "
                         f"--dir {state_dir}`) and remove the directory")
    return cluster


def cluster_up(java: str, state_dir: Path, brokers: int | None, timeout: float) -> Cluster:
    """Start the brokers of the cluster in ``state_dir`` that do not run (creating a cluster
    of ``brokers`` when there is none) and wait until every one answers and lists them
    all. Raises :class:`StackError` (one line) on failure."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with locked(state_dir / LOCK_FILE):
        if holds_cluster(state_dir):
            cluster = _load(state_dir)
            if brokers is not None and brokers != len(cluster.nodes):
                raise StackError(f"{state_dir} holds a cluster of {len(cluster.nodes)} brokers, not {brokers}: "
                                 f"use --brokers {len(cluster.nodes)}, or another --dir")
            created = False
        else:
            cluster, created = _create(state_dir, brokers or 1), True
        libs = kafka_libs()  # a first-time fetch does not count against `timeout`
        deadline = time.monotonic() + timeout
        for attempt in range(1, NEW_CLUSTER_ATTEMPTS + 1):
            try:
                _start_nodes(java, libs, cluster, [n for n in cluster.nodes if not n.running], deadline, timeout)
                break
            except StackError as e:
                # A free port can be taken by another process's connection before the new
                # cluster binds it; no client knows a new cluster's ports yet: take others.
                if not created or attempt == NEW_CLUSTER_ATTEMPTS or "Address already in use" not in str(e):
                    raise
                _forget(cluster)
                cluster = _create(state_dir, len(cluster.nodes))
        for n in cluster.nodes:  # every node: a client may take its metadata from any of them
            wait_for_broker(n.bootstrap, max(0.0, deadline - time.monotonic()), brokers=len(cluster.nodes))
        return _load(state_dir)


def _start_nodes(java: str, libs: Path, cluster: Cluster, nodes: list[ClusterNode], deadline: float,
                 timeout: float) -> None:
    """Launch ``nodes`` together (formatting their storage on first start), then wait for each."""
    if not nodes:
        return
    for n in nodes:
        stop_orphan(n.state_dir)
        ports = (n.port, n.controller_port) if n.controller else (n.port,)
        if not ports_released(ports, min(PORT_RELEASE_S, max(0.0, deadline - time.monotonic()))):
            raise StackError(f"ports {', '.join(map(str, ports))} of broker {n.node_id} are still taken: wait a "
                             "few seconds and retry, or stop what holds them")
    launches: list[Launch] = []
    try:
        with ThreadPoolExecutor(len(nodes)) as pool:  # the storage formats are JVM starts: in parallel
            futures = [pool.submit(Launch, java, libs, n.state_dir, cluster.config(n), cluster.cluster_id,
                                   deadline, CLUSTER_HEAP_OPTS) for n in nodes]
            errors = []
            for f in futures:
                try:
                    launches.append(f.result())
                except StackError as e:
                    errors.append(e)
            if errors:
                raise errors[0]
        for launch in launches:
            try:
                launch.wait(deadline, timeout)
            except StackError as e:
                alive = {n.node_id for n in cluster.running} | {la.node.node_id for la in launches}
                if sum(c.node_id in alive for c in cluster.controllers) > len(cluster.controllers) // 2:
                    raise
                raise StackError(f"{e}; the quorum needs {len(cluster.controllers) // 2 + 1} of "
                                 f"{len(cluster.controllers)} controllers (brokers "
                                 f"{', '.join(str(n.node_id) for n in cluster.controllers)}): start the others "
                                 "too, or all with `profstream stack up`", e.detail) from None
    except BaseException:
        for launch in launches:
            launch.abandon()
        raise


def cluster_status(state_dir: Path | str | None = None) -> Cluster:
    """The cluster of ``state_dir`` and which of its brokers run; forgets the state files
    of brokers whose process is gone."""
    state_dir = resolve_state_dir(state_dir)
    cluster = _load(state_dir)
    for n in cluster.nodes:
        if not n.running and (n.state_dir / STATE_FILE).exists():
            with try_lock(state_dir) as got:
                if got:
                    clear_state(n.state_dir)
    return cluster


def cluster_down(state_dir: Path, timeout: float = 30.0) -> bool:
    """Stop every broker of the cluster at once (a broker stopped after the quorum is gone
    would wait for it); True when any was running."""
    with locked(state_dir / LOCK_FILE):
        cluster = _load(state_dir)
        running = cluster.running
        threads = [threading.Thread(target=terminate, args=(n.pid, timeout)) for n in running]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for n in cluster.nodes:
            stop_orphan(n.state_dir)
    return bool(running)


def kill_cluster_node(state_dir: Path, node_id: int) -> int:
    """SIGKILL broker ``node_id`` of the cluster (see ``broker.kill_broker``); its pid."""
    with locked(state_dir / LOCK_FILE):
        target = _load(state_dir).node(node_id)
        if target.pid is None:
            raise StackError(f"broker {node_id} of {state_dir} is not running")
        kill_now(target.pid, node_id)
        clear_state(target.state_dir)
        return target.pid


def kill_now(pid: int, node_id: int) -> None:
    """SIGKILL ``pid`` and wait until it is gone."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30.0
    while pid_alive(pid):
        if time.monotonic() > deadline:
            raise StackError(f"broker {node_id} (pid {pid}) did not exit after SIGKILL")
        time.sleep(0.05)


def start_cluster_node(java: str, state_dir: Path, node_id: int, timeout: float) -> Broker:
    """Start broker ``node_id`` of the cluster again (it keeps its ports and data) and wait
    until it answers; a running one is returned as it is."""
    with locked(state_dir / LOCK_FILE):
        cluster = _load(state_dir)
        target = cluster.node(node_id)
        if not target.running:
            deadline = time.monotonic() + timeout
            _start_nodes(java, kafka_libs(), cluster, [target], deadline, timeout)
        broker = running_node(target.state_dir)
        if broker is None:
            raise StackError(f"broker {node_id} exited right after it started; see {target.state_dir / 'logs'}")
        return broker
