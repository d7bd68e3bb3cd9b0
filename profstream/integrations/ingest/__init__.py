"""Ingest existing profiler output: ``profstream ingest PATH --run-id R``.

``load_profile`` sniffs the format (or checks the one claimed) and reads it into a
``Profile``; ``ingest`` sends that through a real ``Monitor``, so the processors, the
sinks and every figure work on an old profile as on a live run. One module per format:

- ``layout``: which profiles a path holds (profiler folders as users hand them over);
- ``chrome``: Chrome trace JSON (.json / .json.gz): PyTorch and Kineto traces, MindSpore
  timelines, msprof timelines, with ``ascend``: what Ascend traces' own fields say (task
  types, flows, step marks);
- ``ascend_dirs``: torch_npu / MindSpore 2.x ``*_ascend_pt`` / ``*_ascend_ms`` folders and
  msprof ``PROF_*`` devices (rank, clock and op types from their info files);
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

from profstream.integrations.ingest.layout import Found, find_profiles
from profstream.integrations.ingest.model import IngestError, Profile
from profstream.integrations.ingest.replay import PACES, SendResult, send_profile

FORMATS = ("auto", "chrome", "mindspore", "ascend", "msprof")
_EXPECTED = {
    "chrome": "a Chrome trace JSON file (.json or .json.gz: PyTorch/Kineto, MindSpore or msprof timeline)",
    "mindspore": "a MindSpore profiler output directory (with step_trace_raw_<rank>_detail_time.csv)",
    "ascend": "a torch_npu or MindSpore 2.x profiler folder (*_ascend_pt / *_ascend_ms with ASCEND_PROFILER_OUTPUT)",
    "msprof": "an msprof PROF_* directory (or its device_<N>) with an exported timeline",
}

__all__ = ["FORMATS", "PACES", "IngestError", "IngestResult", "Profile", "ingest", "load_profile", "read_found",
           "sniff"]


def sniff(path: Path) -> str:
    """``chrome`` for a trace file, ``mindspore`` for a directory (see ``layout`` for which
    profiler folder it is); IngestError when it is neither."""
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


def read_found(found: Found, base_ns: int | None = None, step_trace_unit_ns: float | None = None,
               workers: int | None = None) -> Profile:
    """The profile of one rank that ``layout.find_profiles`` found."""
    if found.format == "chrome":
        from profstream.integrations.ingest.chrome import parse_chrome

        if sniff(found.path) != "chrome":
            raise IngestError(f"{found.path}: not {_EXPECTED['chrome']}")
        return parse_chrome(found.path, base_ns=base_ns, workers=workers)
    if found.format == "ascend":
        from profstream.integrations.ingest.ascend_dirs import read_ascend_output

        return read_ascend_output(found.path, base_ns, workers)
    if found.format == "msprof":
        from profstream.integrations.ingest.ascend_dirs import read_msprof

        return read_msprof(found.path, found.files or None, base_ns)
    from profstream.integrations.ingest.mindspore_dir import parse_mindspore_dir

    return parse_mindspore_dir(found.path, found.rank, step_trace_unit_ns, base_ns)


def _one_rank(path: Path, format: str, rank: int | None) -> list[Found]:
    """What to read of ``path`` for one rank, in the claimed format."""
    if format == "chrome":
        if not path.exists():
            raise IngestError(f"{path}: no such file")
        try:
            found = sniff(path)
        except IngestError:
            found = None
        if found != "chrome":
            raise IngestError(f"{path}: not {_EXPECTED['chrome']}")
        return [Found(path, "chrome")]
    if format == "mindspore":
        if not path.is_dir():
            raise IngestError(f"{path}: not {_EXPECTED['mindspore']}")
        return [Found(path, "mindspore", rank)]
    found = find_profiles(path)
    if format != "auto":
        found = [f for f in found if f.format == format]
        if not found:
            raise IngestError(f"{path}: not {_EXPECTED[format]}")
    return found


def load_profile(path: str | Path, format: str = "auto", rank: int | None = None, base_ns: int | None = None,
                 step_trace_unit_ns: float | None = None, workers: int | None = None) -> Profile:
    """Read one rank's profile at ``path``. ``format`` is auto (the layout says), chrome,
    mindspore, ascend or msprof; a path that is not the format claimed raises IngestError
    naming it and what was expected. A folder of several ranks needs ``rank``. A Chrome
    trace of 16 MiB or more is parsed in ``workers`` processes (default: one per CPU, or 1
    where this process has other threads; 1: in this process), with the same result."""
    path = Path(path)
    if format not in FORMATS:
        raise IngestError(f"--format {format!r}: expected one of {', '.join(FORMATS)}")
    candidates = _one_rank(path, format, rank)
    mindspore = [f for f in candidates if f.format == "mindspore"]
    if len(candidates) > 1 and rank is not None and len(mindspore) == len(candidates):
        candidates = [f for f in mindspore if f.rank == rank] or [Found(path, "mindspore", rank)]
    if len(candidates) > 1 and rank is None:
        listed = ", ".join(str(f.path) + (f" rank {f.rank}" if f.rank is not None else "") for f in candidates[:4])
        raise IngestError(f"{path}: {len(candidates)} ranks here ({listed}{'...' if len(candidates) > 4 else ''}): "
                          "choose one with --rank, or give one rank's folder")
    profile = None
    for found in candidates:
        profile = read_found(found, base_ns, step_trace_unit_ns, workers)
        if rank is None or profile.rank in (None, rank) or len(candidates) == 1:
            break
    else:
        raise IngestError(f"{path}: no profile of rank {rank} here")
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
           rank: int | None = None, base_ns: int | None = None, step_trace_unit_ns: float | None = None,
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
    if not options.get("device"):  # the profile's own (npu:N) where it says, else the Monitor's default
        options.pop("device", None)
        if profile.device:
            options["device"] = profile.device
    if profile.host and "host" not in monitor_options and _valid_name(profile.host):
        options["host"] = profile.host
    monitor = Monitor(**options)
    try:
        sent = send_profile(profile, monitor, pace, progress)
    finally:
        monitor.close()
    # after close: what never reached Kafka is counted as dropped too
    return IngestResult(profile, replace(sent, dropped_ops=monitor.stats()["dropped_ops"]))
