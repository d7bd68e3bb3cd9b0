"""Helpers shared by the benchmark scripts: machine info, statistics, the JSON envelope, the broker."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import uuid
from datetime import UTC, datetime
from typing import Any


def machine() -> dict[str, Any]:
    """Python version, CPU count, platform and load: enough to compare runs on a shared box."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": _cpu_model(),
    }
    info["libraries"] = _libraries()
    try:
        info["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info


def _libraries() -> dict[str, str | None]:
    """Versions that move these figures, and whether kafka-python checksums in C or Python."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for dist in ("profstream", "kafka-python", "fastavro", "numpy", "lz4", "crc32c"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    try:
        from kafka.record import util

        out["kafka_crc32c"] = "native" if getattr(util, "crc32c_c", None) else "pure-python"
    except ImportError:
        out["kafka_crc32c"] = None
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def summary(values: list[float]) -> dict[str, float]:
    """Median, min, max and relative spread ((max - min) / median) of per-repeat values."""
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / med if med else 0.0}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def envelope(benchmark: str, args: Any, results: dict[str, Any]) -> dict[str, Any]:
    """The JSON object every benchmark prints: what ran, where, when, and its results."""
    return {
        "benchmark": benchmark,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join([os.path.basename(sys.executable)] + sys.argv),
        "args": vars(args),
        "machine": machine(),
        **results,
    }


def emit(obj: dict[str, Any]) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


def note(msg: str) -> None:
    """Progress on stderr, so stdout stays one JSON object."""
    print(msg, file=sys.stderr, flush=True)


def broker_bootstrap(bootstrap: str | None, kafka_config: str | None = None) -> Any:
    """The connection (``profstream.kafka.connection.Connection``; ``str()``: its address) to
    ``bootstrap`` if given, else to the ``bootstrap.servers`` of ``kafka_config``, else to the
    local broker of `profstream stack up`, with the client properties of ``kafka_config``
    (TLS, SASL: bench_security.py runs the benchmarks both ways); checked to answer."""
    from profstream.kafka.connection import Connection
    from profstream.stack import stack_up, wait_for_broker

    conn = Connection.from_options({"bootstrap": bootstrap, "kafka_config": kafka_config},
                                   bootstrap_given=bool(bootstrap))
    if not conn.bootstrap:
        conn = conn.with_bootstrap(stack_up().bootstrap)
    wait_for_broker(conn, timeout=30.0)
    return conn


def add_kafka_config(parser: Any) -> None:
    """The --kafka-config option of the benchmarks that talk to a broker."""
    parser.add_argument("--kafka-config", help="Kafka client properties file (TLS, SASL: docs/security.md)")


def wait_connected(monitor: Any, bootstrap: str, timeout_s: float = 60.0) -> None:
    """Return once ``monitor`` reached the broker (its first flush went through); else exit
    with one line, before anything is timed."""
    if not monitor.flush(timeout_s):
        raise SystemExit(f"the Monitor did not connect to {bootstrap} within {timeout_s:g} s: check the broker")


def run_monitored(monitor: Any, bootstrap: str, scenario: Any) -> dict[str, Any]:
    """``scenario()`` (a dict of figures) run once ``monitor`` is connected, with what the
    Monitor then sent, dropped and ran as added; the Monitor is closed in any case."""
    try:
        wait_connected(monitor, bootstrap)
        got = scenario()
        monitor.flush(30.0)
        stats = monitor.stats()
        got.update(batches_sent=stats["batches_sent"], dropped_ops=stats["dropped_ops"],
                   recording=getattr(monitor, "recording", "python"))
        return got
    finally:
        monitor.close(timeout=30.0)


def schedstat(tid: int) -> tuple[int, int]:
    """(CPU ns, run-queue wait ns) of one thread of this process (Linux). The CPU figure lags
    by up to a scheduler tick for a running thread: read the calling thread's own CPU with
    ``time.thread_time_ns()``."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        cpu, wait, _ = f.read().split()
    return int(cpu), int(wait)


def threads() -> dict[int, str]:
    """This process's threads (Linux): native id -> the kernel's name (``comm``)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except OSError:
            pass
    return out


def thread_cpu() -> dict[int, tuple[str, int]]:
    """Each thread's name and CPU ns so far."""
    out = {}
    for tid, name in threads().items():
        try:
            out[tid] = (name, schedstat(tid)[0])
        except OSError:
            pass
    return out


def thread_switches(tid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of one thread so far: a voluntary one is a
    wait (a sleep, a lock, the GIL), so each wake-up of a waiting thread counts one."""
    with open(f"/proc/self/task/{tid}/status") as f:
        counts = {k: int(v) for k, _, v in (line.partition(":") for line in f) if k.endswith("ctxt_switches")}
    return counts["voluntary_ctxt_switches"], counts["nonvoluntary_ctxt_switches"]


def unique_prefix() -> str:
    return f"bench-{uuid.uuid4().hex[:8]}"


def drop_topics(bootstrap: str, prefix: str) -> None:
    """Delete the topics a benchmark created, so runs do not pile up on a shared broker."""
    from profstream.kafka.topics import Topics, delete_topics

    try:
        delete_topics(bootstrap, Topics(prefix), timeout=30.0)
    except Exception as e:  # cleanup only: report it, keep the results
        note(f"could not delete topics of {prefix}: {type(e).__name__}: {e}")


class cpu_hog:  # noqa: N801 (a context manager used like a function)
    """``with cpu_hog(on):`` a second, CPU-bound process (a Python busy loop at normal
    priority) runs for the duration of the block when ``on``: the second-core-taken
    condition of the overhead benchmarks. Stopped (and waited for) at the end."""

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self.proc: Any = None

    def __enter__(self) -> cpu_hog:
        if self.on:
            import subprocess

            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            note(f"CPU hog running: pid {self.proc.pid}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def chosen(parser: Any, value: str, known: Any, what: str = "fault") -> list[str]:
    """The comma-separated names of ``value``, each one of ``known`` (else a usage error)."""
    names = [f.strip() for f in value.split(",") if f.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        parser.error(f"unknown {what}(s) {unknown}: choose from {sorted(known)}")
    return names



def rank_role(parser: Any) -> None:
    """The hidden options of a benchmark that starts itself as rank processes (--role rank)."""
    import argparse

    for name, kind in (("--prefix", str), ("--run-id", str), ("--rank", int)):
        parser.add_argument(name, type=kind, help=argparse.SUPPRESS)
    parser.add_argument("--role", default="bench", help=argparse.SUPPRESS)
