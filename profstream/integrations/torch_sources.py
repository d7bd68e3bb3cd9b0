"""Where the torch producer's samples come from: DataLoader iterators (the step start and
the prefetch queue) and the process's memory on CPU runs."""

from __future__ import annotations

import os
from typing import Any

from profstream.integrations.torch_loader import next_worker


class TimedIterator:
    """A DataLoader iterator that tells the instrumentation when a batch is asked for and
    how many batches were waiting; everything else goes to the wrapped iterator."""

    __slots__ = ("_it", "_inst")

    def __init__(self, it: Any, inst: Any) -> None:
        self._it = it
        self._inst = inst

    def __iter__(self) -> TimedIterator:
        return self

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)

    def __next__(self) -> Any:
        inst = self._inst
        s_ns = inst.before_batch(self._it)
        if s_ns is None:
            return next(self._it)
        queued, capacity = waiting_batches(self._it)
        worker = next_worker(self._it) if capacity > 0 else -1
        batch = next(self._it)  # StopIteration and the loader's own errors go to the loop as they are
        inst.after_batch(s_ns, queued, capacity, batch, self._it, worker)
        return batch


def waiting_batches(it: Any) -> tuple[int, int]:
    """(batches fetched by the workers and waiting, prefetch capacity) of a multi-worker
    DataLoader iterator; (-1, -1) for a single-process one, which has no queue."""
    workers = getattr(it, "_num_workers", 0)
    data_queue = getattr(it, "_data_queue", None)
    if not workers or data_queue is None:
        return -1, -1
    try:
        waiting = data_queue.qsize()
    except (NotImplementedError, OSError):  # macOS multiprocessing queues have no qsize
        return -1, -1
    waiting += sum(1 for info in getattr(it, "_task_info", {}).values() if len(info) == 2)  # out of order
    return waiting, workers * (getattr(it, "_prefetch_factor", None) or 2)


class RssReader:
    """This process's resident set size in bytes: /proc/self/statm read through a kept
    descriptor on Linux (a few microseconds), else psutil."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            import psutil

            self._fd = None
            self._process = psutil.Process()

    def __call__(self) -> int:
        if self._fd is None:
            return self._process.memory_info().rss
        return int(os.pread(self._fd, 256, 0).split()[1]) * self._page

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            import psutil

            self._process = psutil.Process()
