"""Recovery after a broker fault: how long from the broker answering again to fresh figures.

For each fault, ``--repeats`` times: a broker of its own (KRaft, in a temporary state
directory), a processor as ``profstream process`` in a subprocess, a simulated run at its
real pace (``--ranks`` ranks, 100 ms steps, 100 ops each), and an independent
read_committed reader of the steps topic. Once ``--before`` steps are committed the fault
happens:

- ``broker-down-15s``: the broker is stopped (SIGTERM) and started again 15 s later;
- ``broker-kill-9``: the broker is killed and started again at once;
- ``broker-and-processor-kill-9``: both are killed, then the broker and the processor
  are started again.

``recovery_s``: from the moment the broker answers again to the moment the reader sees the
first StepMetrics of a step that *ended* after that moment (figures are fresh again).
``caught_up_s``: to the moment the processor's lag (from the broker's end offsets) is 0. The
fault suite (``make test-faults``) checks on the same scenarios that nothing is lost or
counted twice; this measures only time.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import chosen, emit, envelope, note, summary, unique_prefix

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the fault suite's fixtures

from profstream.kafka.topics import Topics, ensure_topics  # noqa: E402
from profstream.simulate import SimConfig, run_simulation  # noqa: E402
from profstream.stack import stack_down  # noqa: E402
from tests.faults.conftest import Broker, ProcessorProcess  # noqa: E402
from tests.faults.streaming import Tail  # noqa: E402
from tests.faults.test_broker_faults import FAULTS  # noqa: E402


def one_run(broker: Broker, fault_name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    topics = Topics(unique_prefix())
    ensure_topics(broker.bootstrap, topics, raw_partitions=4, partitions=3)
    cfg = SimConfig(run_id="recovery", ranks=args.ranks, steps=args.steps, ops_per_step=100, step_time_ms=100,
                    seed=1, rate="realtime")
    processor = ProcessorProcess(broker.bootstrap, topics, workdir / f"{topics.prefix}.log").start()
    tail = Tail(broker.bootstrap, topics.steps, "StepMetrics")
    tail.start()
    run = threading.Thread(target=run_simulation, args=(cfg, {"bootstrap": broker.bootstrap,
                                                              "topic_prefix": topics.prefix}), daemon=True)
    run.start()
    try:
        deadline = time.monotonic() + 120
        while len(tail.seen) < args.before and time.monotonic() < deadline:
            time.sleep(0.05)
        FAULTS[fault_name](broker, processor)
        up_at, up_wall_ns = time.monotonic(), time.time_ns()
        fresh = caught_up = None
        deadline = time.monotonic() + 180
        while (fresh is None or caught_up is None) and time.monotonic() < deadline:
            if fresh is None and any(s["end_ns"] >= up_wall_ns for _, s in list(tail.seen)):
                fresh = min(t for t, s in list(tail.seen) if s["end_ns"] >= up_wall_ns)
            if fresh is not None and (processor.metrics() or {}).get("profstream_consumer_lag_messages") == 0:
                caught_up = time.monotonic()
            time.sleep(0.05)
        return {"fault": fault_name, "recovery_s": None if fresh is None else fresh - up_at,
                "caught_up_s": None if caught_up is None else caught_up - up_at}
    finally:
        run.join(300)
        processor.stop()
        tail.halt.set()
        tail.join(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated: " + ", ".join(FAULTS))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=400, help="steps of each rank (100 ms each)")
    p.add_argument("--before", type=int, default=80, help="steps committed before the fault")
    args = p.parse_args(argv)
    faults = chosen(p, args.faults, FAULTS)
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        broker = Broker(Path(tmp) / "broker")
        try:
            runs = []
            for fault in faults:
                for r in range(args.repeats):
                    result = one_run(broker, fault, args, Path(tmp))
                    note(f"{fault} {r + 1}/{args.repeats}: fresh figures {result['recovery_s']} s, "
                         f"caught up {result['caught_up_s']} s after the broker answered")
                    runs.append(result)
        finally:
            stack_down(state_dir=broker.state_dir)
    results: dict[str, Any] = {"metric": "seconds from the broker answering again to the first committed step "
                                         "that ended after it (recovery_s), and to the run caught up (caught_up_s)",
                               "unit": "s", "workload": {"ranks": args.ranks, "step_ms": 100, "ops_per_step": 100},
                               "runs": runs}
    for fault in faults:
        rec = [r["recovery_s"] for r in runs if r["fault"] == fault and r["recovery_s"] is not None]
        cau = [r["caught_up_s"] for r in runs if r["fault"] == fault and r["caught_up_s"] is not None]
        results[fault] = {"recovery_s": summary(rec) if rec else None, "caught_up_s": summary(cau) if cau else None,
                          "failed_to_recover": sum(r["recovery_s"] is None for r in runs if r["fault"] == fault)}
        if rec:
            note(f"{fault}: recovery median {statistics.median(rec):.1f} s")
    emit(envelope("recovery", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
