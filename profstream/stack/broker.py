"""Start and stop a local single-node Apache Kafka broker (KRaft mode) in a state directory.

The broker runs from the official Kafka jars (``jars``) on Java 17+ (``java``); its files
live in one state directory (``state``). Errors the user can fix are raised as
:class:`StackError`, whose message is one line that says what to do.
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

from profstream.kafka.limits import TOPIC_MAX_MESSAGE_BYTES
from profstream.stack.errors import StackError
from profstream.stack.jars import KAFKA_VERSION, kafka_libs
from profstream.stack.java import find_java
from profstream.stack.logs import failure_hint, file_size, log4j_properties, startup_failure
from profstream.stack.probe import wait_for_broker
from profstream.stack.process import pid_alive, terminate
from profstream.stack.state import (
    CLUSTER_ID_FILE,
    CONSOLE_LOG,
    DATA_DIR,
    LOCK_FILE,
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
    locked,
    read_json,
    read_pid_file,
    resolve_state_dir,
    write_atomic,
)

HEAP_OPTS = ("-Xms256m", "-Xmx768m")
JVM_OPTS = ("-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true")


# --------------------------------------------------------------------------------------
# Config


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# A broker that was killed leaves its connections half-closed until the clients notice:
# its ports can take a few seconds to bind again. Waiting for them keeps the address the
# clients know and the data of the storage (new ports mean new, empty storage).
PORT_RELEASE_S = 15.0


def _ports_released(ports: tuple[int, int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not all(_port_free(p) for p in ports):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def _configured_ports(props: Path) -> tuple[int, int] | None:
    try:
        text = props.read_text()
    except OSError:
        return None
    m = re.search(r"^listeners=PLAINTEXT://[^:]+:(\d+),CONTROLLER://[^:]+:(\d+)\s*$", text, re.M)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _new_cluster_id() -> str:
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def _server_properties(state_dir: Path, port: int, cport: int) -> str:
    data = state_dir / DATA_DIR
    return f"""\
# Written by profstream (profstream.stack.broker); rewritten on every start.
# Single-node KRaft broker in combined mode, loopback only.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{cport}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={data}

num.network.threads=3
num.io.threads=4
num.recovery.threads.per.data.dir=1
num.partitions=1
default.replication.factor=1
auto.create.topics.enable=false
delete.topic.enable=true
min.insync.replicas=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
group.initial.rebalance.delay.ms=0

# Modest disk use: a dev/test broker, not a store of record.
log.segment.bytes=67108864
log.retention.hours=24
log.retention.bytes=536870912
log.retention.check.interval.ms=60000
log.cleaner.dedupe.buffer.size=16777216
# profstream.kafka.limits: what profstream's topics take
message.max.bytes={TOPIC_MAX_MESSAGE_BYTES}
replica.fetch.max.bytes={TOPIC_MAX_MESSAGE_BYTES}
"""


# --------------------------------------------------------------------------------------
# Up / down


def stack_up(state_dir: Path | None = None, timeout: float = 120.0) -> Broker:
    """Start a single-node KRaft broker in ``state_dir``, or return the one running there.

    Raises :class:`StackError` (one line, says what to do) when Java or the jars are
    missing or the broker does not come up within ``timeout`` seconds.
    """
    java = find_java()  # before anything else: no files, no fetch without Java
    state_dir = resolve_state_dir(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)

    with locked(state_dir / LOCK_FILE):
        running = _running_broker(state_dir, time.monotonic() + timeout)
        if running is not None:
            return running
        libs = kafka_libs()  # a first-time fetch does not count against `timeout`
        return _start(java, libs, state_dir, time.monotonic() + timeout, timeout)


def _running_broker(state_dir: Path, deadline: float) -> Broker | None:
    """Reuse a recorded live broker; stop and forget a recorded one that does not answer."""
    data = read_json(state_dir / STATE_FILE)
    broker = broker_from_state(state_dir, data) if data else None
    if broker is not None and is_our_broker(broker.pid, state_dir):
        try:
            wait_for_broker(
                broker.bootstrap,
                max(0.0, min(10.0, deadline - time.monotonic())),
                alive=lambda: _check_alive(broker.pid, state_dir),
            )
            return broker
        except StackError:
            terminate(broker.pid, 15.0)
    # An orphan from an interrupted start (pid file, no broker.json) holds the data dir.
    pid = read_pid_file(state_dir)
    if pid is not None and is_our_broker(pid, state_dir):
        terminate(pid, 15.0)
    clear_state(state_dir)
    return None


def _check_alive(pid: int, state_dir: Path) -> None:
    if not pid_alive(pid):
        log_file = state_dir / LOG_DIR / SERVER_LOG
        raise StackError(f"kafka broker (pid {pid}) exited; see {log_file}")


def _start(java: str, libs: Path, state_dir: Path, deadline: float, timeout: float) -> Broker:
    props = state_dir / SERVER_PROPERTIES
    data_dir = state_dir / DATA_DIR
    log_dir = state_dir / LOG_DIR
    log_dir.mkdir(exist_ok=True)
    log_file = log_dir / SERVER_LOG
    console = log_dir / CONSOLE_LOG
    log4j = state_dir / LOG4J_PROPERTIES
    cluster_id_file = state_dir / CLUSTER_ID_FILE

    # Keep the ports the storage was formatted with when they are still free; otherwise
    # take new ones and start from empty storage (a dev broker; data is disposable).
    old = _configured_ports(props)
    if old and old[0] != old[1] and _ports_released(old, min(PORT_RELEASE_S, deadline - time.monotonic())):
        port, cport = old
    else:
        port, cport = _free_port(), _free_port()
        while cport == port:
            cport = _free_port()
        shutil.rmtree(data_dir, ignore_errors=True)
    if not (data_dir / "meta.properties").is_file():
        shutil.rmtree(data_dir, ignore_errors=True)
        cluster_id_file.unlink(missing_ok=True)

    write_atomic(props, _server_properties(state_dir, port, cport))
    write_atomic(log4j, log4j_properties(log_file))
    log4j_opt = f"-Dlog4j.configuration={log4j.as_uri()}"
    classpath = str(libs / "*")

    if not (data_dir / "meta.properties").is_file():
        _format_storage(java, libs, state_dir, log4j_opt, deadline)

    cmd = [
        java,
        *HEAP_OPTS,
        *JVM_OPTS,
        f"-Dkafka.logs.dir={log_dir}",
        log4j_opt,
        "-cp",
        classpath,
        "kafka.Kafka",
        str(props),
    ]
    offsets = (0, file_size(log_file))  # kafka.out is truncated below; server.log appends
    with open(console, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=state_dir,
            start_new_session=True,
            close_fds=True,
        )
    pid = proc.pid
    write_atomic(state_dir / PID_FILE, f"{pid}\n")
    bootstrap = f"127.0.0.1:{port}"
    try:
        try:
            wait_for_broker(
                bootstrap,
                max(0.0, deadline - time.monotonic()),
                alive=lambda: _check_exited(proc, state_dir, offsets),
            )
        except StackError as exc:
            if proc.poll() is not None:
                raise
            raise startup_failure(
                state_dir,
                f"kafka broker did not answer on {bootstrap} within {timeout:g} s",
                offsets,
            ) from exc
    except BaseException:
        if proc.poll() is None:
            terminate(pid, 10.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1)
        (state_dir / PID_FILE).unlink(missing_ok=True)
        raise

    broker = Broker(
        bootstrap=bootstrap, pid=pid, state_dir=state_dir, controller_port=cport, log_file=log_file
    )
    state = {
        "bootstrap": bootstrap,
        "pid": pid,
        "port": port,
        "controller_port": cport,
        "version": KAFKA_VERSION,
        "kafka_libs": str(libs),
        "log_file": str(log_file),
        "started_at": time.time(),
        "python": sys.executable,
    }
    write_atomic(state_dir / STATE_FILE, json.dumps(state, indent=2) + "\n")
    return broker


def _format_storage(
    java: str, libs: Path, state_dir: Path, log4j_opt: str, deadline: float
) -> None:
    """``kafka-storage format`` the data dir once (a restart finds it formatted)."""
    props = state_dir / SERVER_PROPERTIES
    data_dir = state_dir / DATA_DIR
    cluster_id_file = state_dir / CLUSTER_ID_FILE
    classpath = str(libs / "*")
    cluster_id = cluster_id_file.read_text().strip() if cluster_id_file.is_file() else ""
    if not cluster_id:
        cluster_id = _new_cluster_id()
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
        out = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
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


def _check_exited(proc: subprocess.Popen, state_dir: Path, offsets: tuple[int, int]) -> None:
    code = proc.poll()
    if code is not None:
        raise startup_failure(
            state_dir, f"kafka broker exited during startup (code {code})", offsets
        )


def stack_down(state_dir: Path | None = None, timeout: float = 30.0) -> bool:
    """Stop the broker of ``state_dir`` (SIGTERM, SIGKILL after ``timeout`` s).

    Returns True when a broker was stopped, False when none was running there.
    """
    state_dir = resolve_state_dir(state_dir)
    if not state_dir.is_dir():
        return False
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
