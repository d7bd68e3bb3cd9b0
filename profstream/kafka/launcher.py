"""Start, find and stop a local single-node Apache Kafka broker (KRaft mode).

The broker runs from the official Kafka jars: either an unpacked distribution named by
``KAFKA_HOME`` or jars fetched once with Maven (``mvn dependency:copy-dependencies`` on the
``pom.xml`` shipped in this package) into a cache directory. Everything the broker writes
(config, data, logs, ``broker.json``) lives in one state directory, so several brokers can
run side by side (e.g. a user's ``profstream stack up`` and a test session).

Errors the user can fix are raised as :class:`StackError`, whose message is one line that
says what to do.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import importlib.resources
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

KAFKA_VERSION = "3.9.1"
"""Kafka release fetched by ``pom.xml`` (property ``kafka.version``); kept equal by a test."""

MIN_JAVA_MAJOR = 17

STATE_FILE = "broker.json"
PID_FILE = "broker.pid"
LOCK_FILE = ".lock"
SERVER_PROPERTIES = "server.properties"
LOG4J_PROPERTIES = "log4j.properties"
DATA_DIR = "data"
LOG_DIR = "logs"
SERVER_LOG = "server.log"
CONSOLE_LOG = "kafka.out"
CLUSTER_ID_FILE = "cluster.id"
COMPLETE_MARKER = ".complete"

HEAP_OPTS = ("-Xms256m", "-Xmx768m")
JVM_OPTS = ("-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true")


class StackError(Exception):
    """A problem the user can fix; ``str()`` is one line that says what to do."""

    def __init__(self, message: str, detail: str = "") -> None:
        message = " ".join(str(message).split())
        super().__init__(message)
        self.detail = detail
        """Optional multi-line context (e.g. the tail of a log), for verbose output."""


@dataclass
class Broker:
    bootstrap: str
    pid: int
    state_dir: Path
    controller_port: int
    log_file: Path

    @property
    def port(self) -> int:
        return int(self.bootstrap.rsplit(":", 1)[1])


# --------------------------------------------------------------------------------------
# Locations


def _cache_home() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "profstream"


def default_state_dir() -> Path:
    """``$XDG_CACHE_HOME/profstream/stack`` (``~/.cache`` when XDG_CACHE_HOME is unset)."""
    return _cache_home() / "stack"


def _resolve_state_dir(state_dir: Path | str | None) -> Path:
    return Path(state_dir).expanduser().resolve() if state_dir else default_state_dir()


# --------------------------------------------------------------------------------------
# Java


_java_checked: dict[str, int] = {}


def _java_major(java: str) -> int:
    if java in _java_checked:
        return _java_checked[java]
    try:
        proc = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StackError(
            f"cannot run {java} -version ({exc}): install a Java {MIN_JAVA_MAJOR}+ runtime "
            "(e.g. apt-get install openjdk-17-jre-headless) or set JAVA_HOME"
        ) from exc
    out = proc.stderr + proc.stdout
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not m:
        raise StackError(
            f"cannot tell the version of {java} (output: {out.strip()[:80]!r}): install a "
            f"Java {MIN_JAVA_MAJOR}+ runtime or set JAVA_HOME to one"
        )
    major = int(m.group(1))
    if major == 1 and m.group(2):  # "1.8.0_x" style
        major = int(m.group(2))
    _java_checked[java] = major
    return major


def find_java() -> str:
    """Path of a Java 17+ executable: ``$JAVA_HOME/bin/java`` or ``java`` on PATH."""
    java_home = os.environ.get("JAVA_HOME", "").strip()
    if java_home:
        java = Path(java_home) / "bin" / "java"
        if not (java.is_file() and os.access(java, os.X_OK)):
            raise StackError(
                f"JAVA_HOME={java_home} has no bin/java: point JAVA_HOME at a Java "
                f"{MIN_JAVA_MAJOR}+ runtime or unset it to use java from PATH"
            )
        found = str(java)
    else:
        which = shutil.which("java")
        if not which:
            raise StackError(
                f"java not found: install a Java {MIN_JAVA_MAJOR}+ runtime "
                "(e.g. apt-get install openjdk-17-jre-headless) or set JAVA_HOME"
            )
        found = which
    major = _java_major(found)
    if major < MIN_JAVA_MAJOR:
        raise StackError(
            f"{found} is Java {major}, Kafka {KAFKA_VERSION} here needs Java "
            f"{MIN_JAVA_MAJOR}+: install openjdk-17-jre-headless (or newer) and set JAVA_HOME"
        )
    return found


# --------------------------------------------------------------------------------------
# Jars


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on ``path`` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _libs_complete(libs: Path) -> bool:
    return (libs / COMPLETE_MARKER).is_file() and any(libs.glob("kafka_2.13-*.jar"))


def cached_kafka_libs(cache_dir: Path | None = None) -> Path | None:
    """The directory of the broker jars fetched earlier into the cache, None if they are not there."""
    libs = (Path(cache_dir).expanduser() if cache_dir else _cache_home()) / f"kafka-{KAFKA_VERSION}" / "libs"
    return libs if _libs_complete(libs) else None


def kafka_libs(cache_dir: Path | None = None) -> Path:
    """Directory holding the broker jars.

    ``$KAFKA_HOME/libs`` when KAFKA_HOME is set; otherwise
    ``<cache_dir>/kafka-<KAFKA_VERSION>/libs``, fetched with Maven when missing or
    incomplete. The fetch goes to a temporary directory that is renamed into place only
    when complete, so an interrupted fetch never leaves a half-filled cache.
    """
    kafka_home = os.environ.get("KAFKA_HOME", "").strip()
    if kafka_home:
        libs = Path(kafka_home).expanduser() / "libs"
        if not any(libs.glob("kafka_*.jar")):
            raise StackError(
                f"KAFKA_HOME={kafka_home} has no libs/kafka_*.jar: point KAFKA_HOME at an "
                f"unpacked Apache Kafka {KAFKA_VERSION} distribution or unset it to fetch "
                "the jars with Maven"
            )
        return libs

    base = (Path(cache_dir).expanduser() if cache_dir else _cache_home()) / f"kafka-{KAFKA_VERSION}"
    libs = base / "libs"
    if _libs_complete(libs):
        return libs

    mvn = shutil.which("mvn")
    if not mvn:
        raise StackError(
            "mvn not found: install Maven (e.g. apt-get install maven) so the Kafka jars can "
            f"be fetched, or set KAFKA_HOME to an unpacked Apache Kafka {KAFKA_VERSION} "
            "distribution"
        )
    base.mkdir(parents=True, exist_ok=True)
    with _locked(base / LOCK_FILE):
        if _libs_complete(libs):  # fetched by someone else while we waited
            return libs
        for stale in base.glob("libs.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix="libs.tmp-", dir=base))
        try:
            _mvn_fetch(mvn, tmp)
            (tmp / COMPLETE_MARKER).write_text(KAFKA_VERSION + "\n")
            if libs.exists():
                shutil.rmtree(libs)
            os.replace(tmp, libs)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return libs


def _mvn_fetch(mvn: str, out_dir: Path) -> None:
    # Run Maven on a private copy of the pom, so nothing is written next to the installed
    # package (which may be read-only) and `target/` never lands in the source tree.
    work = out_dir / ".mvn-work"
    work.mkdir()
    pom_res = importlib.resources.files("profstream.kafka") / "pom.xml"
    pom = work / "pom.xml"
    pom.write_bytes(pom_res.read_bytes())
    cmd = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(pom),
        "dependency:copy-dependencies",
        f"-DoutputDirectory={out_dir}",
        "-DincludeScope=runtime",
    ]
    try:
        proc = subprocess.run(
            cmd, cwd=work, capture_output=True, text=True, timeout=900, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise StackError(
            "fetching the Kafka jars with mvn took over 15 min: check network access to "
            "the Maven repository, or set KAFKA_HOME to an unpacked Kafka distribution"
        ) from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0 or not any(out_dir.glob("kafka_2.13-*.jar")):
        out = (proc.stdout + proc.stderr).strip().splitlines()
        errors = [ln for ln in out if "ERROR" in ln] or out
        last = errors[0] if errors else f"exit code {proc.returncode}"
        raise StackError(
            f"mvn could not fetch the Kafka {KAFKA_VERSION} jars ({last.strip()[:200]}): "
            "check network access to the Maven repository (or ~/.m2/settings.xml), or set "
            "KAFKA_HOME to an unpacked Kafka distribution",
            detail="\n".join(out[-40:]),
        )


# --------------------------------------------------------------------------------------
# Kafka protocol probe (ApiVersions + Metadata over a raw socket, bounded by a deadline)


_API_VERSIONS = 18
_METADATA = 3


class _ProbeError(Exception):
    pass


def _split_bootstrap(bootstrap: str) -> list[tuple[str, int]]:
    out = []
    for item in bootstrap.split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"bad bootstrap address {item!r}: expected HOST:PORT")
        out.append((host.strip("[]") or "127.0.0.1", int(port)))
    if not out:
        raise ValueError(f"bad bootstrap address {bootstrap!r}: expected HOST:PORT")
    return out


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _ProbeError("timed out")
        sock.settimeout(remaining)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise _ProbeError("connection closed by peer")
        buf += chunk
    return bytes(buf)


def _request(
    sock: socket.socket, api_key: int, version: int, corr: int, body: bytes, deadline: float
) -> bytes:
    client_id = b"profstream-probe"
    header = struct.pack(">hhih", api_key, version, corr, len(client_id)) + client_id
    msg = header + body
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _ProbeError("timed out")
    sock.settimeout(remaining)
    sock.sendall(struct.pack(">i", len(msg)) + msg)
    (size,) = struct.unpack(">i", _recv_exact(sock, 4, deadline))
    if size < 4 or size > 64 * 1024 * 1024:
        raise _ProbeError(f"not a Kafka response (frame size {size})")
    payload = _recv_exact(sock, size, deadline)
    (got_corr,) = struct.unpack_from(">i", payload)
    if got_corr != corr:
        raise _ProbeError("not a Kafka response (correlation id mismatch)")
    return payload[4:]


def _probe(host: str, port: int, deadline: float) -> int:
    """One ApiVersions + Metadata round trip; returns the number of live brokers."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _ProbeError("timed out")
    try:
        sock = socket.create_connection((host, port), timeout=remaining)
    except OSError as exc:
        raise _ProbeError(exc.strerror or str(exc)) from exc
    try:
        # ApiVersions v0: error_code, [api_key, min, max]; every broker since 0.10 has it.
        resp = _request(sock, _API_VERSIONS, 0, 1, b"", deadline)
        (err, n) = struct.unpack_from(">hi", resp)
        if err != 0:
            raise _ProbeError(f"ApiVersions error code {err}")
        meta_range = None
        for i in range(n):
            key, lo, hi = struct.unpack_from(">hhh", resp, 6 + 6 * i)
            if key == _METADATA:
                meta_range = (lo, hi)
        if meta_range is None:
            raise _ProbeError("broker does not offer Metadata")
        # Non-flexible Metadata versions 1..7 share the broker-list layout we read.
        candidates = [v for v in range(1, 8) if meta_range[0] <= v <= meta_range[1]]
        if not candidates:
            raise _ProbeError(f"no usable Metadata version in {meta_range}")
        ver = max(candidates)
        body = struct.pack(">i", 0)  # empty topic list: ask for brokers only
        if ver >= 4:
            body += b"\x00"  # allow_auto_topic_creation = false
        resp = _request(sock, _METADATA, ver, 2, body, deadline)
        off = 4 if ver >= 3 else 0  # throttle_time_ms
        (n_brokers,) = struct.unpack_from(">i", resp, off)
        return max(n_brokers, 0)
    except (OSError, struct.error) as exc:
        raise _ProbeError(str(exc) or type(exc).__name__) from exc
    finally:
        sock.close()


def _answers(bootstrap: str, deadline: float) -> str | None:
    """None when some bootstrap address answers Metadata with >= 1 broker, else a reason."""
    reason = "no address"
    for host, port in _split_bootstrap(bootstrap):
        try:
            if _probe(host, port, deadline) > 0:
                return None
            reason = "metadata lists no live broker yet"
        except _ProbeError as exc:
            reason = str(exc)
    return reason


def wait_for_broker(bootstrap: str, timeout: float) -> None:
    """Poll until the broker at ``bootstrap`` answers a Metadata request.

    Uses a raw ApiVersions + Metadata exchange on a socket bounded by the deadline, so
    it never blocks longer than ``timeout``. Raises :class:`StackError` on the deadline.
    """
    _wait(bootstrap, timeout)


def _wait(bootstrap: str, timeout: float, alive=None) -> None:
    try:
        _split_bootstrap(bootstrap)
    except ValueError as exc:
        raise StackError(f"{exc}: pass e.g. 127.0.0.1:9092") from exc
    start = time.monotonic()
    deadline = start + max(timeout, 0.0)
    delay = 0.05
    reason = "not tried"
    while True:
        # Each attempt gets at most 5 s so a half-open peer cannot eat the whole budget.
        attempt_deadline = min(deadline, time.monotonic() + 5.0)
        reason = _answers(bootstrap, attempt_deadline) or ""
        if not reason:
            return
        if alive is not None:
            alive()
        now = time.monotonic()
        if now >= deadline:
            break
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, 0.25)
    raise StackError(
        f"broker at {bootstrap} did not answer within {timeout:g} s ({reason}): "
        "check the address / start one with `profstream stack up`"
    )


# --------------------------------------------------------------------------------------
# Processes


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)  # reap it if it is our own exited child
        if done == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        pass
    return True


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        pass
    try:
        return subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _is_our_broker(pid: int, state_dir: Path) -> bool:
    """True when ``pid`` is alive and is a Kafka broker started on this state dir."""
    if not _pid_alive(pid):
        return False
    cmd = _cmdline(pid)
    if not cmd:  # cannot inspect (other user / platform): trust the pid
        return True
    return "kafka.Kafka" in cmd and str(state_dir / SERVER_PROPERTIES) in cmd


def _terminate(pid: int, timeout: float) -> None:
    """SIGTERM the process group of ``pid``, wait up to ``timeout``, then SIGKILL."""

    def signal_group(sig: int) -> None:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    signal_group(signal.SIGTERM)
    deadline = time.monotonic() + max(timeout, 0.0)
    while _pid_alive(pid):
        if time.monotonic() >= deadline:
            signal_group(signal.SIGKILL)
            kill_deadline = time.monotonic() + 10.0
            while _pid_alive(pid) and time.monotonic() < kill_deadline:
                time.sleep(0.05)
            break
        time.sleep(0.1)


# --------------------------------------------------------------------------------------
# State files


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _broker_from_state(state_dir: Path, data: dict) -> Broker | None:
    try:
        return Broker(
            bootstrap=str(data["bootstrap"]),
            pid=int(data["pid"]),
            state_dir=state_dir,
            controller_port=int(data["controller_port"]),
            log_file=Path(data.get("log_file") or state_dir / LOG_DIR / SERVER_LOG),
        )
    except (KeyError, TypeError, ValueError):
        return None


def _read_pid_file(state_dir: Path) -> int | None:
    try:
        return int((state_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _clear_state(state_dir: Path) -> None:
    for name in (STATE_FILE, PID_FILE):
        with contextlib.suppress(FileNotFoundError):
            (state_dir / name).unlink()


def stack_status(state_dir: Path | None = None) -> Broker | None:
    """The broker recorded in ``state_dir`` if its process is alive, else None.

    A state file whose process is gone is removed.
    """
    state_dir = _resolve_state_dir(state_dir)
    data = _read_json(state_dir / STATE_FILE)
    if data is None:
        if (state_dir / STATE_FILE).exists():
            _clear_state(state_dir)
        return None
    broker = _broker_from_state(state_dir, data)
    if broker is None or not _is_our_broker(broker.pid, state_dir):
        # Only clear files when no stack_up/stack_down holds the lock right now.
        with _try_lock(state_dir) as got:
            if got:
                _clear_state(state_dir)
        return None
    return broker


@contextlib.contextmanager
def _try_lock(state_dir: Path) -> Iterator[bool]:
    path = state_dir / LOCK_FILE
    try:
        fh = open(path, "a+")
    except OSError:
        yield False
        return
    with fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


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
# Written by profstream (profstream.kafka.launcher); rewritten on every start.
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
message.max.bytes=8388608
replica.fetch.max.bytes=8388608
"""


def _log4j_properties(log_file: Path) -> str:
    noisy = [
        "kafka.request.logger",
        "kafka.network.RequestChannel$",
        "kafka.network.Processor",
        "kafka.controller",
        "kafka.log.LogCleaner",
        "state.change.logger",
        "kafka.authorizer.logger",
        "kafka.coordinator",
        "kafka.log",
        "kafka.cluster",
        "kafka.server.ReplicaFetcherManager",
        "kafka.server.ReplicaAlterLogDirsManager",
        "kafka.server.metadata",
        "kafka.utils.Log4jControllerRegistration$",
        "org.apache.kafka.storage",
        "org.apache.kafka.raft",
        "org.apache.kafka.controller",
        "org.apache.kafka.image",
        "org.apache.kafka.metadata",
        "org.apache.kafka.clients",
        "org.apache.kafka.common.utils.AppInfoParser",
        "org.apache.kafka.coordinator",
        "org.apache.kafka.common.metrics",
        "org.apache.kafka.queue",
        "kafka.server.DelayedOperationPurgatory$ExpiredOperationReaper",
        "kafka.server.ClientQuotaManager$ThrottledChannelReaper",
        "kafka.server.NodeToControllerRequestThread",
        "kafka.raft",
        "org.apache.kafka.server.util.timer",
        "org.apache.zookeeper",
        # KafkaConfig dumps ~400 lines of settings at each start; server.properties has them.
        "kafka.server.KafkaConfig",
        "org.apache.kafka.common.config",
    ]
    lines = [
        "# Written by profstream on every start.",
        "log4j.rootLogger=INFO, file",
        "log4j.appender.file=org.apache.log4j.RollingFileAppender",
        f"log4j.appender.file.File={log_file}",
        "log4j.appender.file.MaxFileSize=20MB",
        "log4j.appender.file.MaxBackupIndex=3",
        "log4j.appender.file.layout=org.apache.log4j.PatternLayout",
        "log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n",
    ]
    lines += [f"log4j.logger.{name}=WARN" for name in noisy]
    return "\n".join(lines) + "\n"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _lines_since(path: Path, offset: int, limit: int = 256 * 1024) -> list[str]:
    """Non-empty lines of ``path`` written after byte ``offset`` (at most ``limit`` bytes)."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size < offset:  # rotated or truncated: take what is there
                offset = 0
            fh.seek(max(offset, size - limit))
            text = fh.read().decode(errors="replace")
    except OSError:
        return []
    return [ln for ln in text.splitlines() if ln.strip()]


_EXC_LINE = re.compile(r"^(?:Caused by: )?[\w$.]+(?:Exception|Error)(?::\s|$)")


def _failure_hint(lines: list[str]) -> str:
    """The most telling line of a failed start: the first Java exception, else an ERROR."""
    stripped = [ln.strip() for ln in lines]
    for pick in (
        [ln for ln in stripped if _EXC_LINE.match(ln)],
        [ln for ln in stripped if re.search(r"\b(ERROR|FATAL)\b|^Error:", ln)],
        stripped[-1:],
    ):
        if pick:
            hint = pick[0]
            return hint if len(hint) <= 240 else hint[:237] + "..."
    return "no log output"


def _startup_failure(state_dir: Path, what: str, offsets: tuple[int, int]) -> StackError:
    log_file = state_dir / LOG_DIR / SERVER_LOG
    console = state_dir / LOG_DIR / CONSOLE_LOG
    con_lines = _lines_since(console, offsets[0])
    log_lines = _lines_since(log_file, offsets[1])
    hint = _failure_hint(con_lines + log_lines)
    detail = "\n".join(
        [f"==> {console} <=="] + con_lines[-40:] + [f"==> {log_file} <=="] + log_lines[-60:]
    )
    return StackError(f"{what}: {hint}; see {log_file} and {console}", detail=detail)


# --------------------------------------------------------------------------------------
# Up / down


def stack_up(state_dir: Path | None = None, timeout: float = 120.0) -> Broker:
    """Start a single-node KRaft broker in ``state_dir``, or return the one running there.

    Raises :class:`StackError` (one line, says what to do) when Java or the jars are
    missing or the broker does not come up within ``timeout`` seconds.
    """
    java = find_java()  # before anything else: no files, no fetch without Java
    state_dir = _resolve_state_dir(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)

    with _locked(state_dir / LOCK_FILE):
        running = _running_broker(state_dir, time.monotonic() + timeout)
        if running is not None:
            return running
        libs = kafka_libs()  # a first-time fetch does not count against `timeout`
        return _start(java, libs, state_dir, time.monotonic() + timeout, timeout)


def _running_broker(state_dir: Path, deadline: float) -> Broker | None:
    """Reuse a recorded live broker; stop and forget a recorded one that does not answer."""
    data = _read_json(state_dir / STATE_FILE)
    broker = _broker_from_state(state_dir, data) if data else None
    if broker is not None and _is_our_broker(broker.pid, state_dir):
        try:
            _wait(
                broker.bootstrap,
                max(0.0, min(10.0, deadline - time.monotonic())),
                alive=lambda: _check_alive(broker.pid, state_dir),
            )
            return broker
        except StackError:
            _terminate(broker.pid, 15.0)
    # An orphan from an interrupted start (pid file, no broker.json) holds the data dir.
    pid = _read_pid_file(state_dir)
    if pid is not None and _is_our_broker(pid, state_dir):
        _terminate(pid, 15.0)
    _clear_state(state_dir)
    return None


def _check_alive(pid: int, state_dir: Path) -> None:
    if not _pid_alive(pid):
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
    if old and old[0] != old[1] and all(_port_free(p) for p in old):
        port, cport = old
    else:
        port, cport = _free_port(), _free_port()
        while cport == port:
            cport = _free_port()
        shutil.rmtree(data_dir, ignore_errors=True)
    if not (data_dir / "meta.properties").is_file():
        shutil.rmtree(data_dir, ignore_errors=True)
        cluster_id_file.unlink(missing_ok=True)

    _write_atomic(props, _server_properties(state_dir, port, cport))
    _write_atomic(log4j, _log4j_properties(log_file))
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
    offsets = (0, _size(log_file))  # kafka.out is truncated below; server.log appends
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
    _write_atomic(state_dir / PID_FILE, f"{pid}\n")
    bootstrap = f"127.0.0.1:{port}"
    try:
        try:
            _wait(
                bootstrap,
                max(0.0, deadline - time.monotonic()),
                alive=lambda: _check_exited(proc, state_dir, offsets),
            )
        except StackError as exc:
            if proc.poll() is not None:
                raise
            raise _startup_failure(
                state_dir,
                f"kafka broker did not answer on {bootstrap} within {timeout:g} s",
                offsets,
            ) from exc
    except BaseException:
        if proc.poll() is None:
            _terminate(pid, 10.0)
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
    _write_atomic(state_dir / STATE_FILE, json.dumps(state, indent=2) + "\n")
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
        _write_atomic(cluster_id_file, cluster_id + "\n")
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
        hint = _failure_hint(out) if out else f"exit code {proc.returncode}"
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
        raise _startup_failure(
            state_dir, f"kafka broker exited during startup (code {code})", offsets
        )


def stack_down(state_dir: Path | None = None, timeout: float = 30.0) -> bool:
    """Stop the broker of ``state_dir`` (SIGTERM, SIGKILL after ``timeout`` s).

    Returns True when a broker was stopped, False when none was running there.
    """
    state_dir = _resolve_state_dir(state_dir)
    if not state_dir.is_dir():
        return False
    stopped = False
    with _locked(state_dir / LOCK_FILE):
        pids = []
        data = _read_json(state_dir / STATE_FILE)
        broker = _broker_from_state(state_dir, data) if data else None
        if broker is not None:
            pids.append(broker.pid)
        pid = _read_pid_file(state_dir)
        if pid is not None and pid not in pids:
            pids.append(pid)
        for pid in pids:
            if _is_our_broker(pid, state_dir):
                _terminate(pid, timeout)
                stopped = True
        _clear_state(state_dir)
    return stopped
