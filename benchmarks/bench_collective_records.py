"""What always-on collective records cost the training process (issue #32, item 1).

Two figures, gloo on CPU, one process (a one-rank group: the call's own cost, no peer to
wait for):

- ``per_call``: ns per ``dist.all_reduce`` of a 1-element tensor on the training thread,
  torch's Flight Recorder on (``TORCH_FR_BUFFER_SIZE`` unset: torch's default, 2000
  entries) against off (``TORCH_FR_BUFFER_SIZE=0``). The recorder's entry is all the
  training thread pays for profstream's always-on records: the reader is another thread.
  Each variant runs in a process of its own (the size is read when the group is made),
  ``--rounds`` rounds alternating the order; per round the fastest of ``--blocks`` blocks
  of ``--calls`` calls (the least disturbed, on a shared machine). cost = on - off, median
  over rounds. Target: <= 2 µs.
- ``reader``: one ``FlightReader.read()`` (the Monitor's thread; it holds the GIL, so the
  training thread's Python waits meanwhile) over a full ring of 2,000 entries of which
  ``--new`` are new: ms per read and µs per entry in the ring, median of ``--reads``; and
  ``other_thread_speed``: how fast a pure-Python loop on another thread (the training
  thread's Python) runs during those reads, against the same loop idle for as long.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

from _common import emit, envelope, note, summary

_CHILD = """
import json, os, statistics, sys, time
import torch, torch.distributed as dist
calls, blocks = int(sys.argv[1]), int(sys.argv[2])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=0, world_size=1)
t = torch.ones(1)
for _ in range(2000):
    dist.all_reduce(t)
out = []
for _ in range(blocks):
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        dist.all_reduce(t)
    out.append((time.perf_counter_ns() - t0) / calls)
dist.destroy_process_group()
print(json.dumps(min(out)))
"""


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def per_call(rounds: int, calls: int, blocks: int) -> dict:
    got: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds):
        for variant in (("on", "off") if r % 2 == 0 else ("off", "on")):
            env = {k: v for k, v in os.environ.items() if k not in ("TORCH_FR_BUFFER_SIZE",
                                                                   "TORCH_NCCL_TRACE_BUFFER_SIZE")}
            if variant == "off":
                env["TORCH_FR_BUFFER_SIZE"] = "0"
            env["OMP_NUM_THREADS"] = "1"
            out = subprocess.run([sys.executable, "-c", _CHILD, str(calls), str(blocks), _free_port()], env=env,
                                 capture_output=True, text=True, check=True)
            got[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
        note(f"round {r + 1}/{rounds}: on {got['on'][-1]:.0f} ns, off {got['off'][-1]:.0f} ns a call")
    costs = [a - b for a, b in zip(got["on"], got["off"])]
    return {"ns_per_call_on": got["on"], "ns_per_call_off": got["off"], "on": summary(got["on"]),
            "off": summary(got["off"]), "cost_ns_per_round": costs, "cost_ns": statistics.median(costs),
            "target_ns": 2000, "met": statistics.median(costs) <= 2000}


class _Sink:
    """What the reader records into: counts the calls (a Monitor's interface, no buffer)."""

    run_id, rank, options = "bench", 0, {}

    def __init__(self) -> None:
        self.n = 0

    def hold_watermark(self, source: str) -> None: ...
    def release_watermark(self, source: str) -> None: ...
    def complete_through(self, step: int, source: str | None = None) -> None: ...
    def complete_before(self, ts_ns: int) -> int | None: return None
    def step_at(self, ts_ns: int) -> int: return 0

    def collective(self, *call: object, step: int | None = None) -> None:
        self.n += 1


def reader(reads: int, new: int) -> dict:
    import torch
    import torch.distributed as dist

    from profstream.integrations.torch_flight import FlightReader

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(1)
    for _ in range(2500):  # the ring full
        dist.all_reduce(t)
    sink = _Sink()
    r = FlightReader(sink, interval_s=3600)
    r.read()  # every entry handed over once
    ms, per_entry = [], []
    count, stop = [0], threading.Event()

    def other_thread() -> None:
        while not stop.is_set():
            count[0] += 1

    spinner = threading.Thread(target=other_thread, daemon=True)
    spinner.start()
    spins_reading = spins_idle = 0
    for _ in range(reads):
        for _ in range(new):
            dist.all_reduce(t)
        c0 = count[0]
        t0 = time.perf_counter_ns()
        r.read()
        dt = time.perf_counter_ns() - t0
        spins_reading += count[0] - c0
        c0 = count[0]
        time.sleep(dt / 1e9)
        spins_idle += count[0] - c0
        ms.append(dt / 1e6)
        per_entry.append(dt / 1e3 / 2000)
    stop.set()
    spinner.join()
    dist.destroy_process_group()
    # the newest call may still be running when read: it is handed over at the next read
    assert new * reads <= sink.n - 2000 + 1, (sink.n, new * reads)
    return {"ring_entries": 2000, "new_per_read": new, "ms_per_read": summary(ms),
            "us_per_ring_entry": statistics.median(per_entry), "calls_recorded": sink.n,
            "other_thread_speed": spins_reading / max(spins_idle, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=20000, help="calls per block")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--reads", type=int, default=20)
    p.add_argument("--new", type=int, default=100, help="new calls between two reads")
    p.add_argument("--only", choices=("per_call", "reader"), help="one of the two figures")
    args = p.parse_args()
    results = {}
    if args.only != "reader":
        results["per_call"] = per_call(args.rounds, args.calls, args.blocks)
    if args.only != "per_call":
        results["reader"] = reader(args.reads, args.new)
    emit(envelope("bench_collective_records", args, results))


if __name__ == "__main__":
    main()
