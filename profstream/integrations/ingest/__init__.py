"""Ingest existing profiler output: ``profstream ingest PATH --run-id R``.

``load_profile`` sniffs the format (or checks the one claimed) and reads it into a
``Profile``; ``ingest`` sends that through a real ``Monitor``, so the processors, the
sinks and every figure work on an old profile as on a live run. One module per format:

- ``chrome``: Chrome trace JSON (.json / .json.gz): PyTorch and Kineto traces, MindSpore
  timelines, msprof timelines;
- ``mindspore_dir``: MindSpore profiler output directories (step trace CSV, operator
  statistics, data-queue files), with ``hccl``: the HCCL ops of their communication
  analysis (``communication_<rank>.json``) as collective calls.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from profstream.integrations.ingest.model import IngestError, Profile
from profstream.integrations.ingest.replay import PACES, SendResult, send_profile

FORMATS = ("auto", "chrome", "mindspore")
_EXPECTED = {
    "chrome": "a Chrome trace JSON file (.json or .json.gz: PyTorch/Kineto, MindSpore or msprof timeline)",
    "mindspore": "a MindSpore profiler output directory (with step_trace_raw_<rank>_detail_time.csv)",
}

__all__ = ["FORMATS", "PACES", "IngestError", "IngestResult", "Profile", "ingest", "load_profile", "sniff"]


def sniff(path: Path) -> str:
    """``chrome`` or ``mindspore`` from what the path holds; IngestError when neither."""
    if path.is_dir():
        return "mindspore"
    if not path.exists():
        raise IngestError(f"{path}: no such file or directory")
    try:
        with path.open("rb") as f:
            head = f.read(2)
            f.seek(0)
            if head == b"\x1f\x8b":
                head = gzip.GzipFile(fileobj=f).read(256)
            else:
                head = f.read(256)
    except (OSError, EOFError, zlib.error) as e:
        raise IngestError(f"{path}: unreadable ({e}): expected {_EXPECTED['chrome']} or "
                          f"{_EXPECTED['mindspore']}") from None
    if head.lstrip()[:1] in (b"{", b"["):
        return "chrome"
    raise IngestError(f"{path}: not a profile profstream can read: expected {_EXPECTED['chrome']} "
                      f"or {_EXPECTED['mindspore']}")


def load_profile(path: str | Path, format: str = "auto", rank: int | None = None, base_ns: int | None = None,
                 step_trace_unit_ns: float = 1.0, workers: int | None = None) -> Profile:
    """Read ``path`` into a Profile. ``format`` is auto (sniffed), chrome or mindspore; a
    path that is not the format claimed raises IngestError naming it and what was expected.
    A Chrome trace of 16 MiB or more is parsed in ``workers`` processes (default: one per
    CPU, or 1 where this process has other threads; 1: in this process), with the same result."""
    path = Path(path)
    if format not in FORMATS:
        raise IngestError(f"--format {format!r}: expected one of {', '.join(FORMATS)}")
    if format == "auto":
        format = sniff(path)
    if format == "chrome":
        from profstream.integrations.ingest.chrome import parse_chrome

        if not path.exists():
            raise IngestError(f"{path}: no such file")
        try:
            found = sniff(path)
        except IngestError:
            found = None
        if found != "chrome":
            raise IngestError(f"{path}: not {_EXPECTED['chrome']}")
        profile = parse_chrome(path, base_ns=base_ns, workers=workers)
    else:
        from profstream.integrations.ingest.mindspore_dir import parse_mindspore_dir

        if not path.is_dir():
            raise IngestError(f"{path}: not {_EXPECTED['mindspore']}")
        profile = parse_mindspore_dir(path, rank, step_trace_unit_ns, base_ns)
    if rank is not None:
        profile.rank = rank
    clocks = profile.check_clocks()
    if clocks is not None:  # once per file, with its name and rank: ingest and analyze print notes
        profile.notes.append(clocks)
    return profile


def _valid_name(value: str) -> bool:
    from profstream.config import ConfigError, check_name

    try:
        check_name(value)
        return True
    except ConfigError:
        return False


@dataclass
class IngestResult:
    profile: Profile
    sent: SendResult


def ingest(path: str | Path, monitor_options: dict[str, Any], format: str = "auto", pace: str = "max",
           rank: int | None = None, base_ns: int | None = None, step_trace_unit_ns: float = 1.0,
           progress: Callable[[int], None] | None = None, workers: int | None = None) -> IngestResult:
    """Read ``path`` and send it to Kafka as run ``monitor_options['run_id']``.

    ``monitor_options`` are Monitor options (bootstrap, run_id, topic_prefix, ...); the
    rank is ``rank``, else the one the profile names, else 0."""
    from profstream.producers.monitor import Monitor

    if pace not in PACES:
        raise IngestError(f"--pace {pace!r}: expected realtime or max")
    profile = load_profile(path, format, rank, base_ns, step_trace_unit_ns, workers)
    options = {"host_sample_interval_s": 0.0, "auto_watermark": True, **monitor_options}
    options["rank"] = profile.rank if profile.rank is not None else 0
    if profile.host and "host" not in monitor_options and _valid_name(profile.host):
        options["host"] = profile.host
    monitor = Monitor(**options)
    try:
        sent = send_profile(profile, monitor, pace, progress)
    finally:
        monitor.close()
    # after close: what never reached Kafka is counted as dropped too
    return IngestResult(profile, replace(sent, dropped_ops=monitor.stats()["dropped_ops"]))
