"""The state directory of a broker: its files, its lock, and the broker recorded there.

Everything the broker writes (config, data, logs, ``broker.json``) lives in one state
directory, so several brokers can run side by side (e.g. a user's ``profstream stack up``
and a test session).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from profstream.stack.process import cmdline, pid_alive

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


def cache_home() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "profstream"


def default_state_dir() -> Path:
    """``$XDG_CACHE_HOME/profstream/stack`` (``~/.cache`` when XDG_CACHE_HOME is unset)."""
    return cache_home() / "stack"


def resolve_state_dir(state_dir: Path | str | None) -> Path:
    return Path(state_dir).expanduser().resolve() if state_dir else default_state_dir()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on ``path`` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def is_our_broker(pid: int, state_dir: Path) -> bool:
    """True when ``pid`` is alive and is a Kafka broker started on this state dir."""
    if not pid_alive(pid):
        return False
    cmd = cmdline(pid)
    if not cmd:  # cannot inspect (other user / platform): trust the pid
        return True
    return "kafka.Kafka" in cmd and str(state_dir / SERVER_PROPERTIES) in cmd


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def broker_from_state(state_dir: Path, data: dict) -> Broker | None:
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


def read_pid_file(state_dir: Path) -> int | None:
    try:
        return int((state_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def clear_state(state_dir: Path) -> None:
    for name in (STATE_FILE, PID_FILE):
        with contextlib.suppress(FileNotFoundError):
            (state_dir / name).unlink()


def single_broker_status(state_dir: Path) -> Broker | None:
    """The broker recorded in ``state_dir`` if its process is alive, else None.

    A state file whose process is gone is removed.
    """
    data = read_json(state_dir / STATE_FILE)
    if data is None:
        if (state_dir / STATE_FILE).exists():
            clear_state(state_dir)
        return None
    broker = broker_from_state(state_dir, data)
    if broker is None or not is_our_broker(broker.pid, state_dir):
        # Only clear files when no stack_up/stack_down holds the lock right now.
        with try_lock(state_dir) as got:
            if got:
                clear_state(state_dir)
        return None
    return broker


@contextlib.contextmanager
def try_lock(state_dir: Path) -> Iterator[bool]:
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
