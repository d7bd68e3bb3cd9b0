"""What reading the host and the data loader's workers costs (issue 34): the loader
sampler's thread CPU per reading and per second at the default interval (1 s), the Monitor's
host reading (psutil: the machine's CPU shares, the process's CPU and RSS) beside it, and the
training thread's part per batch. Target: both readings together at most 0.1 % of a core at
1 s.

A DataLoader with ``--workers`` persistent worker processes (a dataset that sleeps, so the
workers are idle and the machine quiet), iterated by a loop under a ``LoaderSampler`` reading
every ``--interval-s`` into a Monitor stand-in that keeps the rows. The thread's own CPU time
(thread_time) over ``--readings`` readings gives the cost of one; at 1 s a reading that is
its share of a core. The training thread's part (which worker a batch came from, counted) is
timed alone over a million calls. The host reading (``sender.host_sample``, which the
Monitor's sender thread calls every ``host_sample_interval_s``) is timed alone over
``--host-readings`` calls.

Prints one JSON object on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import time
import timeit

import psutil
import torch
from _common import emit, envelope, note

from profstream.integrations.torch_loader import LoaderSampler, next_worker
from profstream.producers.sender import host_sample

TARGET_CORE_SHARE = 0.001  # 0.1 % of a core at one reading a second


class _Rows:
    def __init__(self) -> None:
        self.rows = 0

    def loader_sample(self, row, ts_ns=None, step=None) -> None:
        self.rows += 1


class _Sleepy(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int):
        time.sleep(0.002)
        return torch.zeros(4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--interval-s", type=float, default=0.05, help="readings this often, to time many quickly")
    p.add_argument("--readings", type=int, default=200)
    p.add_argument("--host-readings", type=int, default=2000)
    args = p.parse_args(argv)
    loader = torch.utils.data.DataLoader(_Sleepy(), batch_size=4, num_workers=args.workers, persistent_workers=True)
    it = iter(loader)
    rows = _Rows()
    sampler = LoaderSampler(rows, args.interval_s)
    deadline = time.monotonic() + args.readings * args.interval_s * 3
    while sampler.readings < args.readings and time.monotonic() < deadline:
        worker = next_worker(it)
        next(it)
        sampler.batch(it, worker)
    sampler.stop()
    per_reading_us = sampler.cpu_s / max(sampler.readings, 1) * 1e6
    n = 1_000_000
    per_batch_ns = min(timeit.repeat(lambda: sampler.batch(it, next_worker(it)), number=n, repeat=3)) / n * 1e9
    process = psutil.Process()
    host_sample(process)  # the first reading of psutil's CPU percentages is its baseline
    t0 = time.thread_time()
    for _ in range(args.host_readings):
        host_sample(process)
    host_us = (time.thread_time() - t0) / args.host_readings * 1e6
    share = (per_reading_us + host_us) / 1e6
    note(f"host reading {host_us:.0f} us CPU; both {share:.4%} of a core at 1 s")
    note(f"{sampler.readings} readings of {args.workers} workers: {per_reading_us:.0f} us CPU each, "
         f"{per_reading_us / 1e4:.4f} % of a core at 1 s; training thread {per_batch_ns:.0f} ns a batch")
    emit(envelope("loader_sampler", args, {
        "readings": sampler.readings, "rows": rows.rows, "workers": args.workers,
        "cpu_us_per_reading": per_reading_us, "core_share_at_1s": per_reading_us / 1e6,
        "training_thread_ns_per_batch": per_batch_ns, "host_cpu_us_per_reading": host_us,
        "both_core_share_at_1s": share, "target": {"max_core_share_at_1s": TARGET_CORE_SHARE},
        "meets_target": share <= TARGET_CORE_SHARE}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
