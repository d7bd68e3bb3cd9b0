"""The disk spool through a long broker outage (docs/monitor.md, "Disk spool").

``--ranks`` Monitors in this process (one sender thread each, as one per training process)
record a simulated run in real time, ``--steps-per-s`` steps a second of ``--ops-per-step``
ops each, to a broker of this benchmark's own (``profstream stack up --dir``). After
``--before-s`` the broker stops for ``--outage-s``, then comes back; the run goes on for
``--after-s`` more. Figures:

- ``dropped_ops``, ``dropped_samples``: what the Monitors lost (target: 0 with a spool
  cap of ``--spool-max-bytes``);
- ``steps``: StepMetrics per (run, rank, step) computed by the processors' code from the
  raw topic at the end (target: every step exactly once);
- ``drain``: from the broker's return until every Monitor sends straight to Kafka again,
  and the rate at which the spool emptied against the rate the ranks record (target: >= 5x);
- ``sender_cpu_share_spooling``: the sender threads' CPU while spooling, per rank, as a
  share of one core; ``spool_bytes_per_op``: disk per recorded op.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import emit, envelope, note, schedstat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Recorder(threading.Thread):
    """Records the simulated run into the Monitors in real time until ``stop``."""

    def __init__(self, cfg, monitors: dict) -> None:
        super().__init__(name="bench-recorder", daemon=True)
        self.cfg, self.monitors = cfg, monitors
        self.steps = self.ops = 0
        self.late_s = 0.0  # how far the recorder fell behind real time at worst

    def run(self) -> None:
        from profstream.simulate import PHASES, phase_time, plan_run, record_phase

        origin = time.time_ns()
        wall0 = time.monotonic()
        plans = []
        for plan in plan_run(self.cfg, origin):
            plans.append(plan)
            if len(plans) < self.cfg.ranks:
                continue
            for phase in PHASES:
                delay = (phase_time(plans[0], phase) - origin) / 1e9 - (time.monotonic() - wall0)
                if delay > 0:
                    time.sleep(delay)
                else:
                    self.late_s = max(self.late_s, -delay)
                for p in plans:
                    record_phase(self.monitors[p.rank], p, phase)
            self.steps += len(plans)
            self.ops += sum(len(p.names) for p in plans)
            plans = []


def seq_order(bootstrap: str, topic: str) -> dict:
    """The raw topic's batches per producer id, in partition order: copies, gaps in seq, and
    batches that came after a later one of their producer (out of order)."""
    from profstream.schema.batch import decode_batch
    from tests.test_spool import raw_messages

    last: dict[str, int] = {}
    seen: dict[str, set] = {}
    out = {"batches": 0, "copies": 0, "gaps": 0, "out_of_order": [], "producers": 0}
    for msg in raw_messages(bootstrap, topic):
        b = decode_batch(msg.value)
        out["batches"] += 1
        got = seen.setdefault(b.producer_id, set())
        if b.seq in got:
            out["copies"] += 1
            continue
        got.add(b.seq)
        prev = last.get(b.producer_id, -1)
        if b.seq < prev and len(out["out_of_order"]) < 20:
            out["out_of_order"].append((b.producer_id[-8:], prev, b.seq))
        last[b.producer_id] = max(prev, b.seq)
    out["producers"] = len(seen)
    out["gaps"] = sum(max(s) + 1 - len(s) for s in seen.values())
    return out


def sender_cpu_s(monitors: dict) -> float:
    return sum(schedstat(m._sender.native_id)[0] for m in monitors.values()) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps-per-s", type=float, default=20.0)
    ap.add_argument("--ops-per-step", type=int, default=200)
    ap.add_argument("--before-s", type=float, default=10.0)
    ap.add_argument("--outage-s", type=float, default=600.0)
    ap.add_argument("--after-s", type=float, default=60.0, help="recording after the broker's return (the drain "
                    "must end within it)")
    ap.add_argument("--spool-max-bytes", default="2GiB")
    ap.add_argument("--buffer-bytes", default="64MiB")
    ap.add_argument("--spool-dir", help="default: a temporary folder")
    args = ap.parse_args()

    from profstream.producers.monitor import Monitor
    from profstream.simulate import SimConfig
    from profstream.stack import stack_down, stack_up

    work = Path(tempfile.mkdtemp(prefix="bench-spool-"))
    spool_dir = Path(args.spool_dir) if args.spool_dir else work / "spool"
    total_s = args.before_s + args.outage_s + args.after_s
    cfg = SimConfig(run_id=f"bench-spool-{int(time.time())}", ranks=args.ranks, steps=int(total_s * args.steps_per_s),
                    ops_per_step=args.ops_per_step, step_time_ms=1000 / args.steps_per_s, rate="realtime")
    state = work / "stack"
    bootstrap = stack_up(state_dir=state).bootstrap
    prefix = f"bench-spool-{int(time.time())}"
    monitors = {r: Monitor(run_id=cfg.run_id, rank=r, world_size=cfg.ranks, bootstrap=bootstrap, topic_prefix=prefix,
                           spool_dir=str(spool_dir), spool_max_bytes=args.spool_max_bytes,
                           buffer_bytes=args.buffer_bytes, host_sample_interval_s=0, device_interval_ms=0,
                           connect_timeout_s=2.0) for r in range(cfg.ranks)}
    deadline = time.monotonic() + 60  # (with a spool a flush is done once all is on disk)
    while not all(m.stats()["connected"] for m in monitors.values()):
        if time.monotonic() > deadline:
            raise SystemExit("the Monitors did not reach the benchmark's broker within 60 s")
        time.sleep(0.1)
    recorder = Recorder(cfg, monitors)
    recorder.start()
    try:
        time.sleep(args.before_s)
        note(f"broker stops for {args.outage_s:.0f} s")
        cpu0, t0, ops0 = sender_cpu_s(monitors), time.monotonic(), recorder.ops
        stack_down(state_dir=state)
        time.sleep(args.outage_s)
        cpu1, t1, ops1 = sender_cpu_s(monitors), time.monotonic(), recorder.ops
        spooled = {r: m.stats() for r, m in monitors.items()}
        stack_up(state_dir=state)
        back = time.monotonic()
        note("broker is back; waiting for the spools to drain")
        drained_at = None
        timeline = []  # (s since the return, MiB the spools hold)
        while drained_at is None and time.monotonic() < back + args.after_s:
            now = [m.stats() for m in monitors.values()]
            timeline.append((round(time.monotonic() - back, 1), round(sum(s["spool_bytes"] for s in now) / 2**20, 1)))
            if not any(s["spooling"] for s in now):
                drained_at = time.monotonic()
            time.sleep(0.5)
        recorder.join()
    finally:
        flushed = all(m.flush(120) for m in monitors.values())
        for m in monitors.values():
            m.close(30)
    stats = {r: m.stats() for r, m in monitors.items()}
    note("reading the raw topic back through the processors' code")
    # the tests' reader: the raw topic through processors.stream
    from tests.test_spool import step_counts

    counts, _ = step_counts(bootstrap, f"{prefix}.raw")
    seqs = seq_order(bootstrap, f"{prefix}.raw")
    stack_down(state_dir=state)
    want = cfg.ranks * cfg.steps
    outage_bytes = sum(s["spool_bytes"] for s in spooled.values())
    produced_per_s = (ops1 - ops0) / (t1 - t0)
    drain_s = None if drained_at is None else drained_at - back
    result = {
        "recorded": {"steps": recorder.steps, "ops": recorder.ops, "recorder_late_s_max": recorder.late_s},
        "dropped_ops": sum(s["dropped_ops"] for s in stats.values()),
        "dropped_samples": sum(s["dropped_samples"] for s in stats.values()),
        "flushed": flushed,
        "steps": {"expected": want, "distinct": len(counts), "exactly_once": len(counts) == want
                  and set(counts.values()) == {1}, "more_than_once": sum(1 for n in counts.values() if n > 1),
                  "missing": sorted({(cfg.run_id, r, st) for r in range(cfg.ranks) for st in range(cfg.steps)}
                                    - set(counts))[:20]},
        "raw_seq": seqs,
        "spool_corrupt_regions": sum(s.get("spool_corrupt_regions", 0) for s in stats.values()),
        "outage": {"s": t1 - t0, "ops_recorded": ops1 - ops0, "spool_bytes_at_return": outage_bytes,
                   "spool_bytes_per_op": outage_bytes / max(1, ops1 - ops0),
                   "spool_records": sum(s["spool_records_written"] for s in spooled.values())},
        "sender_cpu_share_spooling": (cpu1 - cpu0) / (t1 - t0) / cfg.ranks,
        "drain": {"s": drain_s, "ops_per_s_recorded": produced_per_s, "spool_mib_after_return": timeline,
                  "drain_over_production": None if not drain_s else
                  ((ops1 - ops0) / drain_s + produced_per_s) / produced_per_s},
    }
    emit(envelope("bench_spool", args, result))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
