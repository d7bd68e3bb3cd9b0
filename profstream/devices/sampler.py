"""The sampler thread: reads a backend every interval and hands each reading to a
``record`` function (``Monitor.device_sample``), never on the training thread.

It stops for good, with one warning, when a device is lost; training goes on. Its own
CPU time is measured (``stats()``: the cost target is 0.5 % of one core at 500 ms).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from profstream.devices.backend import (
    NO_BACKEND_YET,
    NVIDIA_KINDS,
    DeviceBackend,
    DeviceLost,
    DeviceSample,
    DeviceUnavailable,
    device_ordinals,
)
from profstream.devices.nvml import open_nvml

log = logging.getLogger("profstream.devices")


def open_backend(kind: str, ordinals: list[int]) -> DeviceBackend:
    """The backend for ``kind`` devices ``ordinals``; DeviceUnavailable when none can read them."""
    if kind in NVIDIA_KINDS:
        return open_nvml(ordinals)
    raise DeviceUnavailable(NO_BACKEND_YET.get(kind, f"no counter backend for {kind} devices"))


class DeviceSampler(threading.Thread):
    """Reads ``backend`` every ``interval_s`` until ``stop()`` or a lost device."""

    def __init__(self, backend: DeviceBackend, record: Callable[[DeviceSample], None], interval_s: float,
                 name: str = "profstream-devices") -> None:
        super().__init__(name=name, daemon=True)
        self.backend = backend
        self.record = record
        self.interval_s = interval_s
        self.readings = 0
        self.cpu_s = 0.0
        self.lost: str | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        next_at = time.monotonic()
        try:
            while not self._stop_event.wait(max(0.0, next_at - time.monotonic())):
                cpu = time.thread_time()
                try:
                    samples = self.backend.read()
                except DeviceLost as e:
                    self.lost = str(e)
                    log.warning("profstream: %s; device counters stop here, training goes on", e)
                    return
                for sample in samples:
                    self.record(sample)
                self.readings += 1
                self.cpu_s += time.thread_time() - cpu
                next_at += self.interval_s
                now = time.monotonic()
                if next_at < now:  # fell behind (a slow read, a suspended process): no burst
                    next_at = now + self.interval_s
        except Exception:  # a bug here must not pass silently, nor reach the training loop
            log.exception("profstream: the device sampler failed; device counters stop, training goes on")
        finally:
            self._close_backend()

    def _close_backend(self) -> None:
        try:
            self.backend.close()
        except Exception as e:  # closing a backend whose device is gone may fail too
            log.debug("closing the device counter backend failed: %s", e)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop reading; returns once the thread has ended (or after ``timeout``)."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout)

    def stats(self) -> dict[str, Any]:
        return {"device_readings": self.readings, "device_sampler_cpu_s": self.cpu_s,
                "device_fields_unsupported": sorted(self.backend.unsupported),
                "device_read_errors": self.backend.read_errors, "device_lost": self.lost}


def start_sampler(options: dict[str, Any], record: Callable[[DeviceSample], None]) -> DeviceSampler | None:
    """A started sampler for the Monitor ``options`` (device, counter_devices,
    device_interval_ms), or None: interval 0, a CPU producer, or no backend for its
    devices here (one information line says why). Never raises."""
    interval_ms = options["device_interval_ms"]
    if not interval_ms:
        return None
    try:
        kind, ordinals = device_ordinals(options["device"], options["counter_devices"])
        if kind not in NVIDIA_KINDS and kind not in NO_BACKEND_YET:
            log.debug("no device counters for a producer on %s", options["device"])
            return None
        backend = open_backend(kind, ordinals)
    except DeviceUnavailable as e:
        log.info("profstream: device counters are off: %s", e)
        return None
    except Exception:  # a bug: say so, and go on without device counters
        log.exception("profstream: device counters are off after an unexpected error")
        return None
    sampler = DeviceSampler(backend, record, interval_ms / 1000.0,
                            name=f"profstream-devices-{options['run_id']}-{options['rank']}")
    sampler.start()
    return sampler
