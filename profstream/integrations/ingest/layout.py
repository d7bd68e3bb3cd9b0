"""Where the profiles are in a path a user hands over: one per rank, with the format to read
each with.

- a file: a Chrome trace (PyTorch/Kineto, MindSpore or msprof timeline); msprof's
  per-iteration files of one device (``msprof_<N>_<model>_<iteration>.json``) given
  together are one rank; a ``trace_view.json`` in ``ASCEND_PROFILER_OUTPUT`` is its folder;
- ``*_ascend_pt`` / ``*_ascend_ms`` (or their ``ASCEND_PROFILER_OUTPUT``): one rank
  (``ascend``);
- msprof ``PROF_*``: one rank per ``device_<N>`` with an exported timeline; ``device_<N>``,
  its ``timeline/`` or ``mindstudio_profiler_output/``: that device (``msprof``);
- a MindSpore profiler directory (``step_trace_raw_<rank>_detail_time.csv`` here or in
  ``profiler/``): one per rank in it (``mindspore``);
- any other directory: the above found in it (three levels down at most), else its trace
  files (``*.json``, ``*.json.gz``), each a rank. Ascend folders found there win over
  MindSpore statistics beside them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from profstream.integrations.ingest.ascend_dirs import (
    PROFILER_OUTPUT,
    device_id,
    is_ascend_output,
    msprof_files,
)
from profstream.integrations.ingest.model import IngestError

TRACE_SUFFIXES = (".json", ".json.gz")
_ITERATION_FILE = re.compile(r"^msprof_(\d+)_\d+_\d+\.json(\.gz)?$")
_DEPTH = 3
# files of a profiler's folder that are not traces: never read as one
_NOT_TRACES = re.compile(r"^(profiler_info.*|profiler_metadata|communication(_matrix)?(_\d+)?|info\.json.*|"
                         r"start_info.*|end_info.*|.*_summary_\d+|pipeline_profiling_\d+|flops_.*|"
                         r"dynamic_shape_info_\d+|minddata_.*)\.json(\.gz)?$")


@dataclass
class Found:
    path: Path
    format: str  # chrome | ascend_output | msprof | mindspore
    rank: int | None = None  # mindspore: the rank's step trace in the directory
    files: list[Path] = field(default_factory=list)  # msprof: the files given (else every one of the device)


def find_profiles(path: Path) -> list[Found]:
    """Every rank's profile in ``path`` (module docstring); IngestError naming the path when
    there is none."""
    if not path.exists():
        raise IngestError(f"{path}: no such file or directory")
    if path.is_file():
        return [_file(path)]
    found = _ascend_folder(path)
    if found is None:
        found = [f for sub in _subfolders(path) for f in _ascend_folder(sub) or []] or _mindspore(path)
    if not found:
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES)
                       and not _NOT_TRACES.match(p.name))
        found = group_files(files)
    if not found:
        raise IngestError(f"{path}: no trace files (*.json, *.json.gz) and no profiler folder here: expected a "
                          f"MindSpore profiler directory, a torch_npu / MindSpore *_ascend_pt / *_ascend_ms folder "
                          f"or an msprof PROF_* directory with an exported timeline (msprof --export=on)")
    return found


def group_files(files: list[Path]) -> list[Found]:
    """Trace files given one by one: each a rank, but msprof's per-iteration files of one
    device together."""
    out: list[Found] = []
    devices: dict[tuple[Path, int], Found] = {}
    for f in files:
        found = _file(f)
        m = _ITERATION_FILE.match(f.name)
        if found.format == "msprof" and m is not None:
            key = (found.path, int(m.group(1)))
            if key in devices:
                devices[key].files.append(f)
                continue
            devices[key] = found
        out.append(found)
    return out


def _file(path: Path) -> Found:
    parent = path.parent
    if path.name.startswith("trace_view.json") and parent.name == PROFILER_OUTPUT:
        return Found(parent.parent, "ascend")
    if _ITERATION_FILE.match(path.name) and parent.name == "timeline" and device_id(parent.parent) is not None:
        return Found(parent.parent, "msprof", files=[path])
    return Found(path, "chrome")


def _ascend_folder(path: Path) -> list[Found] | None:
    """The ranks of the Ascend folder ``path`` is ([] where it holds no exported timeline),
    or None when it is none."""
    if is_ascend_output(path):
        return [Found(path.parent if path.name == PROFILER_OUTPUT else path, "ascend")]
    if path.name in ("timeline", "mindstudio_profiler_output"):
        device = path.parent if path.name == "timeline" else _first_device(path.parent)
        return [Found(device, "msprof")] if device is not None and msprof_files(device) else []
    if device_id(path) is not None and path.parent.name.startswith("PROF_"):
        return [Found(path, "msprof")] if msprof_files(path) else []
    if path.name.startswith("PROF_"):
        return [Found(d, "msprof") for d in _devices(path) if msprof_files(d)]
    return None


def _mindspore(path: Path) -> list[Found]:
    from profstream.integrations.ingest.mindspore_dir import find_profiler_dir, rank_of

    try:
        _, steps = find_profiler_dir(path)
    except IngestError:
        return []
    return [Found(path, "mindspore", rank_of(f)) for f in steps]


def _devices(prof: Path) -> list[Path]:
    return sorted((d for d in prof.iterdir() if d.is_dir() and device_id(d) is not None), key=device_id)


def _first_device(prof: Path) -> Path | None:
    devices = _devices(prof)
    return devices[0] if devices else None


def _subfolders(path: Path) -> list[Path]:
    """Known profiler folders under ``path`` (not inside one another), in name order."""
    out, level = [], [path]
    for _ in range(_DEPTH):
        nxt = []
        for folder in level:
            for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
                if is_ascend_output(sub) or sub.name.startswith("PROF_"):
                    out.append(sub)
                else:
                    nxt.append(sub)
        level = nxt
    return out
