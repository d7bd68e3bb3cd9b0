"""``profstream doctor``: what a user needs, checked, with what to do about each failure.

Each check gives a ``Finding``: ok, info (nothing to do, or optional), warn (works, but
worse or with a part missing) or fail (something profstream needs is missing or broken;
the command then exits 1). Checks never install, fetch or start anything, except the
compiled walk's build when asked for (``build_walk``).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

OK, INFO, WARN, FAIL = "ok", "info", "warn", "fail"
MIN_PYTHON = (3, 11)
# The ports profstream serves on by default: exporter, processor health, the demo's Prometheus.
PORTS = {9464: "profstream sink prometheus --port", 9465: "profstream process --metrics-port",
         9090: "Prometheus (the demo picks a free port instead)"}
NVML_LIBRARY = "libnvidia-ml.so.1"
BROKER_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # ok | info | warn | fail
    found: str
    fix: str = ""


def run_checks(bootstrap: str | None = None, topic_prefix: str = "profstream", gpu: bool = False,
               build_walk: bool = False, broker_timeout_s: float = BROKER_TIMEOUT_S) -> list[Finding]:
    """Every check, in the order a user sets profstream up. ``bootstrap``: the broker to
    check (else $PROFSTREAM_BOOTSTRAP or the running local stack, if any), waited for
    ``broker_timeout_s``; ``gpu``: NVML must be there; ``build_walk``: build the compiled
    trace walk if it is not built."""
    broker = bootstrap or _known_broker()
    findings = [check_python(), check_options(), check_native_monitor(), check_java(local_broker=broker is None),
                check_kafka_jars(local_broker=broker is None)]
    findings += check_broker(broker, topic_prefix, broker_timeout_s)
    findings += [check_prometheus(), *check_torch(build_walk), check_nvml(gpu), check_ports()]
    return findings


def failed(findings: list[Finding]) -> bool:
    return any(f.status == FAIL for f in findings)


# -- Python, Java, Kafka ------------------------------------------------------------------

def check_python() -> Finding:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] < MIN_PYTHON:
        return Finding("Python", FAIL, f"{version} ({sys.executable})", "profstream needs Python 3.11 or newer")
    return Finding("Python", OK, f"{version} ({sys.executable})")


def check_options() -> Finding:
    """The Monitor options in PROFSTREAM_* variables and PROFSTREAM_OPTIONS are valid."""
    from profstream.config import MONITOR_OPTIONS, ConfigError, resolve

    given = [o.env for o in MONITOR_OPTIONS if o.env in os.environ]
    given += ["PROFSTREAM_OPTIONS"] if "PROFSTREAM_OPTIONS" in os.environ else []
    try:
        resolve(MONITOR_OPTIONS)
    except ConfigError as e:
        return Finding("options", FAIL, "a PROFSTREAM_* option is wrong", str(e))
    return Finding("options", OK, f"{', '.join(given)} valid" if given else "no PROFSTREAM_* options set")


def check_native_monitor() -> Finding:
    """Whether the Monitor's compiled hot path loads (else the pure-Python Monitor runs)."""
    from profstream.producers import native

    module, why = native.load()
    if module is None:
        return Finding("native Monitor", WARN, f"not loaded: {why}; the Monitor runs in Python, its sender thread "
                       "holding the GIL for its per-batch work",
                       "pip install --force-reinstall --no-deps profstream with g++ and python3-dev present")
    return Finding("native Monitor", OK, f"{native.describe()} ({Path(module.__file__).name})")


def check_java(local_broker: bool) -> Finding:
    from profstream.stack import StackError, find_java

    try:
        java = find_java()
    except StackError as e:
        if local_broker:
            return Finding("Java", FAIL, "no usable Java", str(e))
        return Finding("Java", INFO, "no usable Java: needed only for a local broker (stack up, demo)", str(e))
    return Finding("Java", OK, f"{_first_line([java, '-version'])} ({java})")


def check_kafka_jars(local_broker: bool) -> Finding:
    from profstream.stack import KAFKA_VERSION, StackError, kafka_libs
    from profstream.stack.jars import cached_kafka_libs

    if os.environ.get("KAFKA_HOME", "").strip():
        try:
            return Finding("Kafka jars", OK, f"KAFKA_HOME: {kafka_libs()}")
        except StackError as e:
            return Finding("Kafka jars", FAIL, "KAFKA_HOME has no Kafka jars", str(e))
    cached = cached_kafka_libs()
    if cached is not None:
        return Finding("Kafka jars", OK, f"Kafka {KAFKA_VERSION} in {cached}")
    mvn = shutil.which("mvn")
    if mvn:
        return Finding("Kafka jars", OK, f"not fetched yet; Maven ({mvn}) fetches them at the first stack up")
    fix = "apt-get install maven, or set KAFKA_HOME to an unpacked Kafka distribution"
    return Finding("Kafka jars", FAIL if local_broker else INFO, "not fetched and no Maven to fetch them", fix)


def _known_broker() -> str | None:
    """$PROFSTREAM_BOOTSTRAP (or in PROFSTREAM_OPTIONS), else the local stack's broker if it runs."""
    from profstream.config import MONITOR_OPTIONS, ConfigError, option_given, resolve

    try:
        if option_given("bootstrap", {}, os.environ):
            return resolve(MONITOR_OPTIONS)["bootstrap"]
    except ConfigError:  # check_options reports it; $PROFSTREAM_BOOTSTRAP may still be good
        given = os.environ.get("PROFSTREAM_BOOTSTRAP", "")
        option = next(o for o in MONITOR_OPTIONS if o.name == "bootstrap")
        return given if given and option.check(given) else None
    from profstream.stack import stack_status

    broker = stack_status()
    return broker.bootstrap if broker is not None else None


def check_broker(bootstrap: str | None, topic_prefix: str, timeout_s: float = BROKER_TIMEOUT_S) -> list[Finding]:
    """The broker answers, and has the topics of ``topic_prefix``."""
    from kafka.errors import KafkaError

    from profstream.kafka.topics import Topics, missing_topics, validate_prefix
    from profstream.stack import StackError, wait_for_broker

    if bootstrap is None:
        return [Finding("broker", INFO, "none given and no local broker running",
                        "profstream stack up starts one; or check yours with --bootstrap host:port")]
    try:
        wait_for_broker(bootstrap, timeout_s)
    except StackError as e:
        return [Finding("broker", FAIL, f"{bootstrap} does not answer", f"{e}; start it (profstream stack up) "
                        "or give the right --bootstrap")]
    found = [Finding("broker", OK, f"{bootstrap} answers")]
    try:
        missing = missing_topics(bootstrap, Topics(validate_prefix(topic_prefix)), timeout_s)
    except ValueError as e:
        return found + [Finding("topics", FAIL, f"bad --topic-prefix {topic_prefix!r}", str(e))]
    except (KafkaError, OSError) as e:
        return found + [Finding("topics", FAIL, f"cannot list the topics ({type(e).__name__}: {e})",
                                "check the broker log")]
    if missing:
        return found + [Finding("topics", WARN, f"missing: {', '.join(missing)}",
                                "created by the first profstream process (or producer) with this --topic-prefix")]
    return found + [Finding("topics", OK, f"all {len(Topics(topic_prefix).all())} of {topic_prefix}.*")]


# -- tools and frameworks ------------------------------------------------------------------

def check_prometheus() -> Finding:
    missing = [tool for tool in ("prometheus", "promtool") if shutil.which(tool) is None]
    if missing:
        return Finding("Prometheus", WARN, f"{' and '.join(missing)} not installed",
                       "apt-get install prometheus: the demo starts it with the alert rules, and the tests need it "
                       "(or PROFSTREAM_SKIP_PROMETHEUS=1)")
    return Finding("Prometheus", OK, f"{_first_line(['prometheus', '--version']).split(' (')[0]} ({shutil.which('prometheus')})")


def check_torch(build_walk: bool) -> list[Finding]:
    """torch's version, and whether op capture's compiled trace walk is built (or can be)."""
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return [Finding("torch", INFO, "not installed: the PyTorch producer and the trainer callbacks need it",
                        "pip install 'profstream[torch]'")]
    from profstream.integrations import torch_native

    torch_finding = Finding("torch", OK, version)
    try:
        args = torch_native.build_arguments()
    except RuntimeError as e:
        return [torch_finding, Finding("compiled walk", WARN, f"cannot be built for torch {version}: {e}",
                                       "op capture reads traces in Python (about 0.5 ms more per captured step)")]
    path = torch_native.built_path(args)
    if path.exists():
        return [torch_finding, Finding("compiled walk", OK, f"built for torch {version} ({path})")]
    lacking = _walk_build_tools()
    if lacking:
        return [torch_finding, Finding("compiled walk", WARN, f"not built and cannot be: no {', '.join(lacking)}",
                                       "apt-get install g++ python3-dev; pip install ninja (else op capture reads "
                                       "traces in Python, about 0.5 ms more per captured step)")]
    if not build_walk:
        return [torch_finding, Finding("compiled walk", INFO, f"not built yet for torch {version}: the first captured "
                                       "step builds it in the background (about 25 s of one core)",
                                       "profstream doctor --build-walk builds it now")]
    try:
        built = torch_native.compile_module(args, nice=0)
    except RuntimeError as e:
        return [torch_finding, Finding("compiled walk", FAIL, f"the build failed: {e}",
                                       "python -m profstream.integrations.torch_native shows the compiler's output")]
    return [torch_finding, Finding("compiled walk", OK, f"built for torch {version} ({built})")]


def _walk_build_tools() -> list[str]:
    lacking = []
    if shutil.which("g++") is None and shutil.which("c++") is None:
        lacking.append("C++ compiler")
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        lacking.append("Python.h")
    if importlib.util.find_spec("ninja") is None:
        lacking.append("ninja")
    return lacking


def check_nvml(gpu: bool) -> Finding:
    """NVIDIA's management library (GPU counters): information on a machine without it,
    a failure when GPU checks are asked for (``gpu``)."""
    try:
        nvml = ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        if gpu:
            return Finding("NVML", FAIL, f"{NVML_LIBRARY} not found",
                           "install the NVIDIA driver (it brings NVML) on the GPU machine")
        return Finding("NVML", INFO, "not present: no NVIDIA GPU counters (expected without a GPU)",
                       "profstream doctor --gpu makes this a failure on GPU machines")
    count = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() != 0:
        return Finding("NVML", FAIL if gpu else WARN, f"{NVML_LIBRARY} is there but does not initialise",
                       "check the NVIDIA driver (nvidia-smi)")
    try:
        status = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count))
    finally:
        nvml.nvmlShutdown()
    if status != 0 or count.value == 0:
        return Finding("NVML", FAIL if gpu else INFO, "present, no GPU visible", "check CUDA_VISIBLE_DEVICES and nvidia-smi")
    return Finding("NVML", OK, f"{count.value} GPU{'s' if count.value > 1 else ''} visible")


def check_ports(ports: dict[int, str] = PORTS) -> Finding:
    """The default ports of profstream's servers are free (each with what serves on it)."""
    busy = []
    for port, who in ports.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                busy.append(f"{port} ({who})")
    if busy:
        return Finding("ports", WARN, f"in use: {', '.join(busy)}",
                       "stop what holds them, or give those commands another port")
    return Finding("ports", OK, f"{', '.join(map(str, ports))} free")


def _first_line(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({e})"
    return ((done.stdout or done.stderr).strip().splitlines() or ["?"])[0]
