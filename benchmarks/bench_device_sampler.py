"""CPU cost of the device counter sampler, against the NVML double (no GPU here).

The sampler's thread reads one device through the real nvidia-ml-py (``pynvml``: its ctypes
wrappers, structures and error handling) from tests/nvml_double.c, a C library with
NVML's calls that answers at once, and hands each reading to the Monitor's real
EventBuffer (``add_device_sample``). Measured:

- ``reading_cpu_us``: the thread's CPU time (``time.thread_time``) per reading, as the
  sampler counts it (``stats()["device_sampler_cpu_s"] / device_readings``), sampling
  every ``--interval-ms`` for ``--readings`` readings;
- ``encode_us_per_sample``: the Sender's share, on its own thread: the rows of one
  drain (``--batch`` readings, 1 by default) turned into columns and encoded as an EventBatch v5,
  per sample;
- ``core_share_at_500ms``: (reading + encode) / 500 ms, the issue's target being 0.5 % of
  one core. The training thread does none of this work (the sampler thread calls nothing
  on it).

A real driver's NVML calls cost more than the double's (each is an ioctl into the driver:
tens of microseconds); ``make gpu-check`` measures the sampler on a GPU. Prints one JSON
object on stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import emit, envelope, note, summary

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET_CORE_SHARE = 0.005


def load_double(directory: Path) -> None:
    """Build the NVML double and make pynvml use it (as tests/nvml.py's install does)."""
    import ctypes

    import pynvml

    from tests.nvml import build

    pynvml.nvmlLib = ctypes.CDLL(str(build(directory)))
    pynvml._nvmlGetFunctionPointer_cache = {}
    pynvml._nvmlLib_refcount = 0


def sampler_cpu_per_reading(interval_ms: float, readings: int) -> float:
    from profstream.devices.nvml import open_nvml
    from profstream.devices.sampler import DeviceSampler
    from profstream.producers.buffer import EventBuffer

    buf = EventBuffer(64 * 2**20, 8192)
    sampler = DeviceSampler(open_nvml([0], {}), lambda s: buf.add_device_sample((time.time_ns(), 0, *s)),
                            interval_ms / 1000)
    sampler.start()
    deadline = time.monotonic() + 120
    while sampler.readings < readings and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    if sampler.readings < readings:
        raise SystemExit(f"only {sampler.readings} readings in 120 s")
    return sampler.cpu_s / sampler.readings * 1e6


def encode_per_sample(batch: int, repeats: int = 200) -> float:
    from profstream.devices import DeviceSample
    from profstream.producers.sender import sample_columns
    from profstream.schema.batch import SECTIONS, EventBatch, encode_batch

    rows = [(time.time_ns() + i, i, 0, *DeviceSample(0, 0.9, 0.3, 10**10, 8 * 10**10, 300.0, 700.0, 60.0, 1980.0,
                                                     0, 1e9, 2e8, 3e10, 3e10)[1:]) for i in range(batch)]
    t0 = time.thread_time()
    for seq in range(repeats):
        b = EventBatch(run_id="r", rank=0, host="h", device="cuda:0", producer_id="p.devices", seq=seq)
        b.device_samples = sample_columns(rows, SECTIONS["device_samples"])
        encode_batch(b)
    return (time.thread_time() - t0) / (repeats * batch) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval-ms", type=float, default=5.0, help="sampling interval while measuring")
    ap.add_argument("--readings", type=int, default=400, help="readings per repeat")
    ap.add_argument("--batch", type=int, default=1,
                    help="readings per device batch (at 500 ms each reading usually has a batch of its own)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        load_double(Path(tmp))
        reading, encode = [], []
        for r in range(args.repeats):
            reading.append(sampler_cpu_per_reading(args.interval_ms, args.readings))
            encode.append(encode_per_sample(args.batch))
            note(f"repeat {r}: {reading[-1]:.1f} us CPU per reading, {encode[-1]:.1f} us encode per sample")
    per_sample = statistics.median(reading) + statistics.median(encode)
    share = per_sample / 500_000
    emit(envelope("device_sampler", args, {
        "metric": "CPU time per device reading (1 device, NVML double) and its share of one core at 500 ms",
        "reading_cpu_us": summary(reading), "encode_us_per_sample": summary(encode),
        "core_share_at_500ms": share, "target": {"max_core_share_at_500ms": TARGET_CORE_SHARE},
        "meets_target": share <= TARGET_CORE_SHARE,
        "training_thread_work": "none: readings are taken and recorded on the sampler's own thread",
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
