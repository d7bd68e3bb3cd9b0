"""What collective matching costs the processors: op events/s through both stages, with
and without collective calls, single thread, no Kafka.

The input is bench_processor_throughput's (8 simulated ranks through real Monitors and
their Senders' batch building, 3 messages per step and rank) at 1,000 ops per step. For
``on``, every 10th op of a batch is also sent as a collective call (10 % communication:
100 calls per step and rank, all_reduce on the default group, each call's seq the same on
every rank, sizes 4 MB), re-encoded as EventBatch v6; ``off`` is the same batches without
them. Timed: ``StepStage.fold`` + ``ready`` over every record, then ``RunStage.fold`` +
``ready`` over the StepMetrics that came out (all folded, then one ready: the simulated
ranks send no world size, so a step is complete once every rank's StepMetrics is in; the
run stage then matches the calls), ``off`` and ``on`` alternating. ops/s = op events /
(both stages' wall time). Every run step must come out once; with calls, every call must
be matched. The same per CPU second of this process (``ops_per_cpu_s``, ``cpu_cost``) is
reported beside it: on a shared machine it is closer to what one dedicated core would do.
``us_per_call_row``: the extra wall time of ``on`` per collective row (one rank's part in
one call), both stages.

``--groups mesh``: the calls as torch's Flight Recorder gives them with capture off
(issue #32): two groups per rank, "TP" pairs (0, 1), (2, 3)... and "DP" groups of every
other rank, named with their members (schema/groups.py), calls alternating between the
two, no end (gloo keeps none): the matching takes the general path (the ranks' calls
differ), as it does for every run with sub-groups.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

from _common import emit, envelope, note, summary
from bench_processor_throughput import as_records, monitor_messages

from profstream.kafka.topics import Topics
from profstream.processors.health import StageCounts
from profstream.processors.runtime import RunStage, StepStage
from profstream.producers.sender import collective_columns
from profstream.schema.batch import decode_batch, encode_batch
from profstream.schema.codec import decode
from profstream.schema.groups import group_label
from profstream.simulate import SimConfig

Record = namedtuple("Record", "topic partition offset key value")
TARGET_COST = 0.15


def _mesh_group(rank: int, ranks: int, call: int) -> tuple[str, int]:
    """(label, size) of a rank's ``call``-th call's group in the mesh: TP pair, then DP."""
    if call % 2 == 0:
        first = rank - rank % 2
        return group_label(str(1 + rank // 2), [first, first + 1], ranks), 2
    members = list(range(rank % 2, ranks, 2))
    return group_label(str(1000 + rank % 2), members, ranks), len(members)


def with_collectives(messages: list[tuple[bytes, bytes]], every: int = 10, mesh: bool = False,
                     ranks: int = 8) -> list[tuple[bytes, bytes]]:
    """The batches with every ``every``-th op of each step also sent as a collective call;
    a call's seq numbers the calls of its step from step x 1,000,000 (the same on every rank)."""
    seen: dict[tuple[bytes, int], int] = {}  # (rank key, step) -> ops of the step so far
    out = []
    for key, value in messages:
        b = decode_batch(value)
        rows = []
        rank = int(key.decode().rpartition("/")[2])
        for i, step in enumerate(b.ops["step"].tolist()):
            k = seen.get((key, step), 0)
            seen[(key, step)] = k + 1
            if k % every == 0 and mesh:
                group, size = _mesh_group(rank, ranks, k // every)
                rows.append(("all_reduce", group, "Float", step, step * 1_000_000 + k // every,
                             int(b.ops["start_ns"][i]), -1, 4 << 20, 4 << 20, size))
            elif k % every == 0:
                rows.append(("all_reduce", "0", "Float", step, step * 1_000_000 + k // every,
                             int(b.ops["start_ns"][i]), int(b.ops["dur_ns"][i]), 4 << 20, 4 << 20, 8))
        if rows:
            b.collective_names, b.collectives = collective_columns(rows)
        out.append((key, encode_batch(b)))
    return out


def both_stages(records: list, topics: Topics) -> dict[str, Any]:
    step_stage = StepStage(topics, 1, StageCounts(keep_step_ends=False))
    run_stage = RunStage(topics, StageCounts(keep_step_ends=False), grace_s=3600.0)
    now = time.monotonic()
    c0 = time.process_time()
    t0 = time.perf_counter()
    steps = []
    for rec in records:
        out = step_stage.fold(rec, now) + step_stage.ready(now)
        steps.extend(o.value for o in out if o.topic == topics.steps)
    t1 = time.perf_counter()
    for i, value in enumerate(steps):  # the simulated ranks send no world size: all ranks, then ready
        run_stage.fold(Record(topics.steps, 0, i, None, value), now)
    run_out = [o.value for o in run_stage.ready(now) if o.topic == topics.run]
    t2 = time.perf_counter()
    return {"elapsed_s": t2 - t0, "cpu_s": time.process_time() - c0, "step_stage_s": t1 - t0, "run_stage_s": t2 - t1, "steps": steps,
            "run_steps": run_out}


def check(label: str, run_steps: list[bytes], expect_calls: int) -> dict[str, int]:
    runs = [decode("RunStepMetrics", v) for v in run_steps]
    matched = sum(x["collectives_matched"] for x in runs)
    unmatched = sum(len(x["unmatched_collectives"]) for x in runs)
    got = {"run_steps": len(runs), "calls_matched": matched, "calls_unmatched": unmatched}
    if matched != expect_calls or unmatched:
        raise SystemExit(f"{label}: collectives wrong: {got}, expected {expect_calls} matched")
    return got


def measure(inputs: dict[str, tuple[list, int]], total_ops: int, repeats: int) -> dict[str, dict[str, Any]]:
    """Each repeat times ``off`` then ``on`` (alternating, so that both see the same load)."""
    topics = Topics("bench-coll")
    runs: dict[str, dict[str, list]] = {k: {"rates": [], "cpu": [], "step": [], "run": [], "wall": []}
                                        for k in inputs}
    checks: dict[str, dict] = {}
    for r in range(repeats):
        for label, (records, expect_calls) in inputs.items():
            res = both_stages(records, topics)
            if label not in checks:
                checks[label] = check(label, res["run_steps"], expect_calls)
            m = runs[label]
            m["rates"].append(total_ops / res["elapsed_s"])
            m["cpu"].append(total_ops / res["cpu_s"])
            m["step"].append(res["step_stage_s"])
            m["run"].append(res["run_stage_s"])
            m["wall"].append(res["elapsed_s"])
            note(f"{label} repeat {r + 1}/{repeats}: {m['rates'][-1] / 1e6:.3f} M ops/s (step stage "
                 f"{res['step_stage_s']:.3f} s, run stage {res['run_stage_s']:.3f} s)")
    return {label: {"ops_per_s": m["rates"], "summary": summary(m["rates"]), "ops_per_cpu_s": m["cpu"],
                    "cpu_summary": summary(m["cpu"]), "median_step_stage_s": statistics.median(m["step"]),
                    "median_run_stage_s": statistics.median(m["run"]), "elapsed_s": m["wall"],
                    "check": checks[label]}
            for label, m in runs.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=50, help="steps per rank")
    p.add_argument("--ops-per-step", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--groups", choices=("default", "mesh"), default="default",
                   help="the calls' groups: the default group, timed; or a TP x DP mesh without ends (always-on)")
    p.add_argument("--input", type=Path, help="the input batches as a pickle: read where the file exists, else "
                   "built and written there (for --count)")
    p.add_argument("--count", choices=("none", "off", "on"), help="one pass of both stages over that input and "
                   "nothing else (none: the input read only), to run under an instruction counter: valgrind "
                   "--tool=callgrind python bench_collectives.py --input F --count on")
    args = p.parse_args(argv)
    if args.input is not None and args.input.exists():
        messages, coll = pickle.loads(args.input.read_bytes())
    else:
        cfg = SimConfig(run_id="bench-coll", ranks=args.ranks, steps=args.steps, ops_per_step=args.ops_per_step,
                        step_time_ms=50.0)
        messages, _ = monitor_messages(cfg)
        coll = with_collectives(messages, mesh=args.groups == "mesh", ranks=args.ranks)
        if args.input is not None:
            args.input.write_bytes(pickle.dumps((messages, coll)))
    if args.count is not None:
        if args.count != "none":
            both_stages(as_records("bench-coll.raw", messages if args.count == "off" else coll), Topics("bench-coll"))
        return 0
    total_ops = args.ranks * args.steps * args.ops_per_step
    calls = sum(decode_batch(v).n("collectives") for _, v in coll)
    distinct = len({(b.collective_names[g], q) for b in (decode_batch(v) for _, v in coll)
                    for g, q in zip(b.collectives["group_idx"].tolist(), b.collectives["seq"].tolist())})
    note(f"{len(messages)} messages, {total_ops} ops, {calls} collective rows ({distinct} calls)")
    got = measure({"off": (as_records("bench-coll.raw", messages), 0),
                   "on": (as_records("bench-coll.raw", coll), distinct)}, total_ops, args.repeats)
    off, on = got["off"], got["on"]
    cost = 1 - on["summary"]["median"] / off["summary"]["median"]
    cpu_cost = 1 - on["cpu_summary"]["median"] / off["cpu_summary"]["median"]
    extra = [a - b for a, b in zip(on["elapsed_s"], off["elapsed_s"])]  # per repeat, both alternating
    us_per_row = statistics.median(extra) / calls * 1e6
    emit(envelope("bench_collectives", args, {
        "metric": "op events/s through StepStage + RunStage (fold + ready), one thread, no Kafka",
        "collective_rows": calls, "off": off, "on": on, "cost": cost, "cpu_cost": cpu_cost,
        "us_per_call_row": us_per_row,
        "target_cost": TARGET_COST, "met": cost <= TARGET_COST, "cpu_met": cpu_cost <= TARGET_COST}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
