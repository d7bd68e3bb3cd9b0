"""The data loader's sampler (integrations/torch_loader.py) reading a real worker process."""

from __future__ import annotations

import multiprocessing
import threading
import time

from profstream.integrations.torch_loader import LoaderSampler


def _compute_in_a_thread(seconds: float) -> None:
    """A worker whose work runs in another thread while its main thread waits on it (a
    transform's thread pool)."""
    def spin() -> None:
        deadline = time.thread_time() + seconds
        while time.thread_time() < deadline:
            pass

    thread = threading.Thread(target=spin)
    thread.start()
    thread.join()


class _Readings:
    """The Monitor's side of the sampler: the rows it hands over."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def loader_sample(self, row: tuple, ts_ns: int | None = None) -> None:
        self.rows.append(row)


class _Iterator:
    """What the sampler reads of a DataLoader iterator: its worker processes."""

    def __init__(self, workers: list) -> None:
        self._workers = workers


def test_a_worker_busy_in_a_thread_of_its_own_wants_a_cpu_at_least_as_long_as_it_had_one():
    """/proc/<pid>/schedstat is the main thread's: read alone, a worker computing in another
    thread looked as if it mostly waited (runnable ~0 while its CPU share was high), and its
    stalls were advised as slow reads (input_io) instead of more workers."""
    worker = multiprocessing.get_context("fork").Process(target=_compute_in_a_thread, args=(30.0,))
    worker.start()
    readings = _Readings()
    sampler = LoaderSampler(readings, 0.2)
    try:
        sampler.batch(_Iterator([worker]), -1)
        deadline = time.monotonic() + 20
        while len([r for r in readings.rows if r[0] == 0]) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sampler.stop()
        worker.terminate()
        worker.join()
    rows = [r for r in readings.rows if r[0] == 0]  # (worker, pid, interval_s, cpu, runnable, ...)
    assert len(rows) >= 4, f"4 readings of the worker within 20 s, got {readings.rows}"
    assert any(cpu > 0.05 for _, _, _, cpu, _, *_ in rows), rows  # it computed
    assert all(runnable >= cpu for _, _, _, cpu, runnable, *_ in rows), rows
