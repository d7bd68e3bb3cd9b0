"""The timeline sink's stacks file: ``<out>/<run_id>/stacks.json.gz``, the run's latest
stacks (``profstream stacks``, or autocapture when TrainingHang fired) as a Chrome trace.

The ranks' answers (finished CaptureStatus records with their threads, on the control
topic) are merged as ``profstream stacks`` merges them: ranks with the same stacks form
a group, the odd one out first. Each rank is a process (pid rank + 1, as in its window
files) with one instant event per Python thread at the time it answered, named by the
thread and its innermost function; its arguments hold the group ("1 of 4 ranks: the odd
one out") and the traceback. A newer stacks request of the run replaces the file. Only
one thread list per distinct stack is kept, and at most ``MAX_RUNS`` runs.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from pathlib import Path

from profstream.config import ConfigError, check_name
from profstream.control.stacks import StackGrouper, ranks_phrase, traceback_lines
from profstream.sinks.gzfile import write_gzip_atomic

log = logging.getLogger("profstream.sink.timeline")

MAX_RUNS = 256
FILE_NAME = "stacks.json.gz"


class _RunStacks:
    """The answers to one stacks request of a run, grouped."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.grouper = StackGrouper()
        self.answered: dict[int, int] = {}  # rank -> when it answered (ts_ns)
        self.hosts: dict[int, str] = {}
        self.reason = ""
        self.requester = ""

    def add(self, status: dict) -> None:
        rank = status["rank"]
        if rank in self.answered:
            return
        self.grouper.add(rank, status)
        self.answered[rank] = status["ts_ns"]
        self.hosts[rank] = status["host"]
        self.reason, self.requester = status["request_reason"], status["requester"]


def stacks_trace(run_id: str, stacks: _RunStacks) -> dict:
    """The Chrome trace of one run's latest stacks."""
    base_ns = min(stacks.answered.values())
    total = len(stacks.answered)
    groups = stacks.grouper.groups()
    events: list[dict] = []
    for index, group in enumerate(groups):
        label = f"{len(group.ranks)} of {total} ranks" + (": the odd one out" if index == 0 and len(
            groups) > 1 else "") + f" ({ranks_phrase(group.ranks)})"
        for rank in group.ranks:
            pid = rank + 1  # as the rank's window files (timeline.pid_of)
            host = stacks.hosts.get(rank, "")
            events.append({"ph": "M", "name": "process_name", "pid": pid,
                           "args": {"name": f"{run_id} rank {rank}" + (f" ({host})" if host else "")}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": index}})
            ts_us = (stacks.answered[rank] - base_ns) / 1e3
            for tid, thread in enumerate(group.threads, start=1):
                inner = thread["frames"][-1]["function"] if thread["frames"] else "?"
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": f"thread {thread['name']}"}})
                events.append({"ph": "i", "s": "t", "name": f"{thread['name']}: in {inner}", "pid": pid, "tid": tid,
                               "ts": ts_us, "args": {"group": label,
                                                     "traceback": "\n".join(traceback_lines(thread, ""))}})
    return {"displayTimeUnit": "ms", "traceEvents": events,
            "otherData": {"run_id": run_id, "request_id": stacks.request_id, "reason": stacks.reason,
                          "requester": stacks.requester, "base_time_ns": base_ns, "ranks": total,
                          "groups": [g.ranks for g in groups]}}


class StacksFiles:
    """Folds stacks answers by run; ``flush`` writes the runs that changed."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = Path(out_dir)
        self.runs: OrderedDict[str, _RunStacks] = OrderedDict()
        self._dirty: set[str] = set()
        self.files_written = 0

    def add(self, status: dict) -> None:
        """A CaptureStatus; only a rank's answer to a stacks request counts."""
        if status["rank"] is None or status["threads"] is None:
            return
        run_id = status["run_id"]
        current = self.runs.get(run_id)
        if current is None or current.request_id != status["request_id"]:
            if current is not None and status["ts_ns"] < max(current.answered.values()):
                return  # an older request's answer, read late
            current = self.runs[run_id] = _RunStacks(status["request_id"])
        self.runs.move_to_end(run_id)
        current.add(status)
        self._dirty.add(run_id)
        while len(self.runs) > MAX_RUNS:
            old, _ = self.runs.popitem(last=False)
            self._dirty.discard(old)

    def flush(self) -> list[Path]:
        """Write the file of each run whose stacks changed since the last flush."""
        written = []
        for run_id in sorted(self._dirty):
            try:
                written.append(self._write(run_id, stacks_trace(run_id, self.runs[run_id])))
            except ConfigError as e:  # a run id no Monitor would send: nothing to write
                log.warning("stacks of run %r not written: %s", run_id, e)
        self._dirty.clear()
        return written

    def _write(self, run_id: str, trace: dict) -> Path:
        check_name(run_id, "run id")
        root = self.out_dir.resolve()
        directory = (root / run_id).resolve()
        if not directory.is_relative_to(root) or directory == root:
            raise ConfigError(f"{directory} is outside the output directory {root}")
        directory.mkdir(parents=True, exist_ok=True)
        write_gzip_atomic(directory / FILE_NAME, (json.dumps(trace).encode(),))
        self.files_written += 1
        return directory / FILE_NAME
