"""What TLS and SASL cost: the same benchmarks over PLAINTEXT and over SASL_SSL (SCRAM-SHA-512),
alternated round by round on the same machine.

The secured broker is `profstream stack up --secure` (``--secure-dir``, kept for the next
run), the plaintext one `profstream stack up` (or ``--bootstrap``); the secured runs use
its admin's client properties (the encryption and the SCRAM exchange are those of any
user; the ACL checks are the broker's). Each round runs, each way, in a process of its own:

- ``bench_monitor_op.py``: ``op_real_broker``, the ns per ``Monitor.op()`` call on the
  training thread while the sender streams to the broker (TLS runs on librdkafka's
  threads: the training thread should not see it);
- ``bench_producer.py --variants bulk``: op events/s one process records and delivers;
- ``bench_processor_throughput.py``: the real Processor end to end on the broker, op
  events per second and per CPU second of its process (target: TLS costs at most 15 %
  per CPU second).

The figure of each is the median over the rounds of each round's own median; the cost is
secured / plaintext - 1 (for op(), + is slower; for the rates, - is slower). Prints one
JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import emit, envelope, note

HERE = Path(__file__).resolve().parent
TARGET_PROCESSOR_COST = 0.15  # at most 15 % fewer op events per CPU second


def _run(script: str, args: list[str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{script} {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def _figures(kind: str, out: dict[str, Any]) -> dict[str, float]:
    if kind == "monitor_op":
        f = out["figures"]["op_real_broker"]
        return {"op_ns": out["median"], "op_pooled_p99_ns": f["pooled_p99_ns"],
                "op_dropped": float(sum(f["dropped_ops"]))}
    if kind == "producer":
        return {"bulk_ops_per_s": out["median"]}
    e2e = out["figures"]["end_to_end"]
    return {"e2e_ops_per_s": e2e["summary"]["median"], "e2e_ops_per_cpu_s": e2e["ops_per_cpu_s_summary"]["median"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running every benchmark both ways")
    p.add_argument("--bootstrap", help="the plaintext broker (default: start/reuse `profstream stack up`)")
    p.add_argument("--secure-dir", default=str(Path.home() / ".cache" / "profstream" / "stack-secure"),
                   help="state directory of the secured broker (`stack up --secure --dir`)")
    p.add_argument("--op-args", default="--repeats 3 --chunks 20", help="arguments of bench_monitor_op.py")
    p.add_argument("--producer-args", default="--repeats 3 --duration 5 --variants bulk",
                   help="arguments of bench_producer.py")
    p.add_argument("--processor-args", default="--repeats 1 --e2e-repeats 3 --no-diagnostics",
                   help="arguments of bench_processor_throughput.py")
    args = p.parse_args(argv)

    from profstream.stack import stack_up
    from profstream.stack.secure import secure_dir

    plain = args.bootstrap or stack_up().bootstrap
    stack_up(Path(args.secure_dir), secure=True)
    admin = str(secure_dir(Path(args.secure_dir)) / "admin.properties")
    ways = {"plaintext": ["--bootstrap", plain], "sasl_ssl": ["--kafka-config", admin]}
    benches = {"monitor_op": ("bench_monitor_op.py", args.op_args.split()),
               "producer": ("bench_producer.py", args.producer_args.split()),
               "processor": ("bench_processor_throughput.py", args.processor_args.split())}
    rounds: list[dict[str, dict[str, float]]] = []
    for i in range(args.rounds):
        got: dict[str, dict[str, float]] = {way: {} for way in ways}
        for kind, (script, extra) in benches.items():
            order = list(ways) if i % 2 == 0 else list(reversed(ways))  # neither way always first
            for way in order:
                started = time.monotonic()
                got[way].update(_figures(kind, _run(script, [*ways[way], *extra])))
                note(f"round {i + 1}/{args.rounds} {kind} {way}: {got[way]} ({time.monotonic() - started:.0f} s)")
        rounds.append(got)
    medians = {way: {k: statistics.median(r[way][k] for r in rounds) for k in rounds[0][way]} for way in ways}
    cost = {k: medians["sasl_ssl"][k] / medians["plaintext"][k] - 1 for k in medians["plaintext"]
            if medians["plaintext"][k] and k != "op_dropped"}
    results = {
        "metric": "medians over rounds of each benchmark's own median, plaintext vs SASL_SSL (SCRAM-SHA-512)",
        "plaintext": plain, "secured": "SASL_SSL (SCRAM-SHA-512) of `profstream stack up --secure`",
        "rounds": rounds, "medians": medians, "cost": cost,
        "target": {"max_processor_cost_per_cpu_s": TARGET_PROCESSOR_COST},
        "meets_target": -cost["e2e_ops_per_cpu_s"] <= TARGET_PROCESSOR_COST,
    }
    emit(envelope("security", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
