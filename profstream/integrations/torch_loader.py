"""The data loader's side, read off the training thread: every ``host_sample_interval_s``
(one second by default) a thread of the torch producer reads each worker process of the
multi-worker DataLoader being iterated (its CPU time, and on Linux the time it waited for a
CPU as well, ``/proc/<pid>/schedstat``) and the machine's context switches, and hands the
readings to the Monitor (EventBatch v8 ``loader_samples``, in its own batches). The
training thread only counts which worker each batch came from (a dictionary read).

``cpu`` is a worker's CPU time over the interval (of one core, all its threads); ``runnable``
adds the time it waited to run: near 1 for a worker busy computing even on a crowded
machine, low for one asleep (reading a file, waiting on the network, ``time.sleep``). The
wait is its main thread's (``/proc/<pid>/schedstat``): a worker whose threads do the work
gets at least its CPU share, never less. Readings a process or the machine cannot give are
NaN / -1, never 0.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from profstream.schema.batch import MACHINE

log = logging.getLogger("profstream.torch")

_NAN = float("nan")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def next_worker(it: Any) -> int:
    """The worker whose batch ``next(it)`` returns, of a multi-worker DataLoader iterator
    (-1: none known); read before the call, which pops it."""
    info = getattr(it, "_task_info", None)
    if not info:
        return -1
    got = info.get(getattr(it, "_rcvd_idx", -1))
    return got[0] if got else -1


def _process_times(pid: int) -> tuple[float, float]:
    """(CPU seconds, CPU + run-queue seconds) of a process so far; NaN where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    except (OSError, IndexError, ValueError):
        try:
            import psutil

            times = psutil.Process(pid).cpu_times()
            return times.user + times.system, _NAN
        except Exception:  # noqa: BLE001 - a worker gone, or no psutil: unknown
            return _NAN, _NAN
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
        return cpu, (run_ns + wait_ns) / 1e9
    except (OSError, ValueError):
        return cpu, _NAN


def _context_switches() -> float:
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"ctxt "):
                    return float(line.split()[1])
    except OSError:
        pass
    try:
        import psutil

        return float(psutil.cpu_stats().ctx_switches)
    except Exception:  # noqa: BLE001 - unknown
        return _NAN


class LoaderSampler:
    """The reading thread of one instrumentation (see the module docstring)."""

    def __init__(self, monitor: Any, interval_s: float) -> None:
        self.monitor = monitor
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._workers: list[int] = []  # pid of each worker id, of the iterator read from now
        self._iterator_id = 0
        self._batches: list[int] = []  # per worker id, counted on the training thread
        self._stop = threading.Event()
        self._wake = threading.Event()  # new workers: read them at once (the first reading of a process is its baseline)
        self.readings = 0
        self.cpu_s = 0.0  # this thread's own CPU time
        self._thread = threading.Thread(target=self._run, name="profstream-loader", daemon=True)
        self._thread.start()

    # -- training thread ----------------------------------------------------------------

    def batch(self, it: Any, worker: int) -> None:
        """A batch of ``worker`` (``next_worker``) of iterator ``it`` reached the loop."""
        if id(it) != self._iterator_id:
            self._watch(it)
        if 0 <= worker < len(self._batches):
            self._batches[worker] += 1

    def _watch(self, it: Any) -> None:
        pids = [getattr(p, "pid", None) for p in getattr(it, "_workers", ())]
        with self._lock:
            self._iterator_id = id(it)
            self._workers = [pid if isinstance(pid, int) else -1 for pid in pids]
            self._batches = [0] * len(self._workers)
        self._wake.set()

    # -- its thread ---------------------------------------------------------------------

    def _run(self) -> None:
        last: dict[int, tuple[float, float, float, int]] = {}  # pid -> (time, cpu, runnable, batches)
        ctx_last = (time.monotonic(), _context_switches())
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            start = time.thread_time()
            try:
                ctx_last = self._read(last, ctx_last)
            except Exception:  # noqa: BLE001 - readings are best effort; training is untouched
                log.debug("profstream: a data-loader reading failed", exc_info=True)
            self.cpu_s += time.thread_time() - start

    def _read(self, last: dict, ctx_last: tuple[float, float]) -> tuple[float, float]:
        now_ns = time.time_ns()
        now = time.monotonic()
        with self._lock:
            workers = list(self._workers)
            batches = list(self._batches)
        for worker, pid in enumerate(workers):
            if pid < 0:
                continue
            cpu, runnable = _process_times(pid)
            prev = last.get(pid)
            last[pid] = (now, cpu, runnable, batches[worker])
            if prev is None:
                continue
            dt = now - prev[0]
            share, wanted = (cpu - prev[1]) / dt, (runnable - prev[2]) / dt
            if wanted < share:  # schedstat is the main thread's: a worker busy in threads of its own
                wanted = share  # wanted a CPU at least as long as it had one
            self.monitor.loader_sample((worker, pid, dt, share, wanted, batches[worker] - prev[3], _NAN, -1),
                                       ts_ns=now_ns)
        for pid in [p for p in last if p not in workers]:  # workers of an iterator gone
            del last[pid]
        ctx = _context_switches()
        dt = now - ctx_last[0]
        self.monitor.loader_sample((MACHINE, -1, dt, _NAN, _NAN, -1, (ctx - ctx_last[1]) / dt, os.cpu_count() or -1),
                                   ts_ns=now_ns)
        self.readings += 1
        return now, ctx

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
