"""One Kafka node in its state directory: configure, format, launch, wait, record.

A single broker (``broker``) and each node of a cluster (``cluster``) start through these
steps; they differ in how ports are chosen and how many nodes are launched before any is
waited for (a cluster's first node answers only once a majority of its controllers run).
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from profstream.stack.errors import StackError
from profstream.stack.jars import KAFKA_VERSION
from profstream.stack.logs import failure_hint, file_size, log4j_properties, startup_failure
from profstream.stack.probe import wait_for_broker
from profstream.stack.process import pid_alive, terminate
from profstream.stack.properties import NodeConfig, server_properties
from profstream.stack.state import (
    CLUSTER_ID_FILE,
    CONSOLE_LOG,
    DATA_DIR,
    LOG4J_PROPERTIES,
    LOG_DIR,
    PID_FILE,
    SERVER_LOG,
    SERVER_PROPERTIES,
    STATE_FILE,
    Broker,
    broker_from_state,
    clear_state,
    is_our_broker,
    read_json,
    read_pid_file,
    write_atomic,
)

HEAP_OPTS = ("-Xms256m", "-Xmx768m")
JVM_OPTS = ("-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true")

# A broker that was killed leaves its connections half-closed until the clients notice:
# its ports can take a few seconds to bind again. Waiting for them keeps the address the
# clients know and the data of the storage (new ports mean new, empty storage).
PORT_RELEASE_S = 15.0


def new_cluster_id() -> str:
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ports_released(ports: tuple[int, ...], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not all(_port_free(p) for p in ports):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def configured_ports(props: Path) -> tuple[int, ...] | None:
    """(client port, controller port) of a plaintext node's properties; (SASL_SSL port,
    SSL port, controller port) of a secured one."""
    try:
        text = props.read_text()
    except OSError:
        return None
    m = re.search(r"^listeners=PLAINTEXT://[^:]+:(\d+),CONTROLLER://[^:]+:(\d+)\s*$", text, re.M)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = re.search(r"^listeners=SASL_SSL://[^:]+:(\d+),SSL://[^:]+:(\d+),CONTROLLER://[^:]+:(\d+)\s*$", text, re.M)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def running_node(state_dir: Path) -> Broker | None:
    """The broker recorded in ``state_dir`` when its process is alive (no probe)."""
    data = read_json(state_dir / STATE_FILE)
    broker = broker_from_state(state_dir, data) if data else None
    return broker if broker is not None and is_our_broker(broker.pid, state_dir) else None


def stop_orphan(state_dir: Path) -> None:
    """Stop a process of an interrupted start (pid file, no broker.json) and forget both."""
    pid = read_pid_file(state_dir)
    if pid is not None and is_our_broker(pid, state_dir):
        terminate(pid, 15.0)
    clear_state(state_dir)


def check_alive(pid: int, state_dir: Path) -> None:
    if not pid_alive(pid):
        log_file = state_dir / LOG_DIR / SERVER_LOG
        raise StackError(f"kafka broker (pid {pid}) exited; see {log_file}")


class Launch:
    """A node's broker process, started and not yet known to answer."""

    def __init__(self, java: str, libs: Path, state_dir: Path, node: NodeConfig, cluster_id: str,
                 deadline: float, heap: tuple[str, ...] = HEAP_OPTS) -> None:
        """Write the node's configuration, format its storage once, start its process."""
        self.state_dir, self.node, self.libs = state_dir, node, libs
        data_dir = state_dir / DATA_DIR
        log_dir = state_dir / LOG_DIR
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_file = log_dir / SERVER_LOG
        log4j = state_dir / LOG4J_PROPERTIES
        if not (data_dir / "meta.properties").is_file():
            shutil.rmtree(data_dir, ignore_errors=True)
            (state_dir / CLUSTER_ID_FILE).unlink(missing_ok=True)
        if cluster_id and not (state_dir / CLUSTER_ID_FILE).is_file():
            write_atomic(state_dir / CLUSTER_ID_FILE, cluster_id + "\n")
        props = state_dir / SERVER_PROPERTIES
        write_atomic(props, server_properties(state_dir, node))
        write_atomic(log4j, log4j_properties(self.log_file))
        log4j_opt = f"-Dlog4j.configuration={log4j.as_uri()}"
        if not (data_dir / "meta.properties").is_file():
            extra: list[str] = []
            if node.secure:  # the SCRAM users exist from the start
                from profstream.stack.secure import scram_arguments

                extra = scram_arguments(state_dir)
            format_storage(java, libs, state_dir, log4j_opt, deadline, extra)
        cmd = [java, *heap, *JVM_OPTS, f"-Dkafka.logs.dir={log_dir}", log4j_opt, "-cp", str(libs / "*"),
               "kafka.Kafka", str(props)]
        self.offsets = (0, file_size(self.log_file))  # kafka.out is truncated below; server.log appends
        with open(log_dir / CONSOLE_LOG, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=state_dir, start_new_session=True, close_fds=True)
        write_atomic(state_dir / PID_FILE, f"{self.proc.pid}\n")

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.node.port}"

    @property
    def connection(self):
        """How to reach the node: its address, with the admin's credentials when secured."""
        if self.node.secure:
            from profstream.stack.secure import client_connection, write_client_properties

            write_client_properties(self.state_dir, self.bootstrap, f"127.0.0.1:{self.node.ssl_port}")
            return client_connection(self.state_dir)
        return self.bootstrap

    def check_exited(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise startup_failure(self.state_dir, f"kafka broker exited during startup (code {code})", self.offsets)

    def wait(self, deadline: float, timeout: float) -> Broker:
        """Wait until the node answers, record it and return it; stop it on failure."""
        try:
            try:
                wait_for_broker(self.connection, max(0.0, deadline - time.monotonic()), alive=self.check_exited)
            except StackError as exc:
                if self.proc.poll() is not None:
                    raise
                raise startup_failure(self.state_dir, f"kafka broker did not answer on {self.bootstrap} within "
                                      f"{timeout:g} s", self.offsets) from exc
        except BaseException:
            self.abandon()
            raise
        return self.record()

    def abandon(self) -> None:
        """Stop the process (if it runs) and forget it."""
        if self.proc.poll() is None:
            terminate(self.proc.pid, 10.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1)
        (self.state_dir / PID_FILE).unlink(missing_ok=True)

    def record(self) -> Broker:
        node = self.node
        broker = Broker(bootstrap=self.bootstrap, pid=self.proc.pid, state_dir=self.state_dir,
                        controller_port=node.controller_port, log_file=self.log_file)
        state = {"bootstrap": self.bootstrap, "pid": self.proc.pid, "port": node.port,
                 "controller_port": node.controller_port, "node_id": node.node_id, "version": KAFKA_VERSION,
                 "kafka_libs": str(self.libs), "log_file": str(self.log_file), "started_at": time.time(),
                 "python": sys.executable, **({"ssl_port": node.ssl_port} if node.secure else {})}
        write_atomic(self.state_dir / STATE_FILE, json.dumps(state, indent=2) + "\n")
        return broker


def format_storage(java: str, libs: Path, state_dir: Path, log4j_opt: str, deadline: float,
                   extra: list[str] | None = None) -> None:
    """``kafka-storage format`` the data dir once (a restart finds it formatted); ``extra``:
    more arguments (a secured broker's ``--add-scram`` users)."""
    props = state_dir / SERVER_PROPERTIES
    data_dir = state_dir / DATA_DIR
    cluster_id_file = state_dir / CLUSTER_ID_FILE
    classpath = str(libs / "*")
    cluster_id = cluster_id_file.read_text().strip() if cluster_id_file.is_file() else ""
    if not cluster_id:
        cluster_id = new_cluster_id()
        write_atomic(cluster_id_file, cluster_id + "\n")
    fmt = [
        java,
        "-Xmx256m",
        "-XX:TieredStopAtLevel=1",  # short-lived tool: start fast
        log4j_opt,
        "-cp",
        classpath,
        "kafka.tools.StorageTool",
        "format",
        "-t",
        cluster_id,
        "-c",
        str(props),
        "--ignore-formatted",
        *(extra or ()),
    ]
    try:
        proc = subprocess.run(
            fmt,
            capture_output=True,
            text=True,
            check=False,
            timeout=max(5.0, deadline - time.monotonic()),
        )
    except subprocess.TimeoutExpired as exc:
        raise StackError(
            f"formatting Kafka storage in {data_dir} took too long: retry with a larger "
            "timeout or check the machine load"
        ) from exc
    if proc.returncode != 0:
        secret_words = re.findall(r"password=([^\],]+)", " ".join(extra or ()))
        text = proc.stdout + proc.stderr
        for word in secret_words:  # kafka-storage may quote an --add-scram argument back
            text = text.replace(word, "***")
        out = [ln for ln in text.splitlines() if ln.strip()]
        hint = failure_hint(out) if out else f"exit code {proc.returncode}"
        if re.search(
            r"ClassNotFoundException|NoClassDefFoundError|find or load main class",
            proc.stdout + proc.stderr,
        ):
            advice = (
                f"the jars in {libs} are not a complete Kafka {KAFKA_VERSION}: point "
                "KAFKA_HOME at an unpacked Kafka distribution, or unset it and delete that "
                "directory to fetch them again"
            )
        else:
            advice = f"check {props}, or remove {data_dir} and retry"
        raise StackError(
            f"kafka storage format failed ({hint}): {advice}", detail="\n".join(out[-40:])
        )
