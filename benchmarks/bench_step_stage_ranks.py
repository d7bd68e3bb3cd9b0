"""The step stage's CPU per step with many ranks in one process, in memory (no Kafka): what
a processor's poll loop costs besides the steps themselves.

The messages are those of ``--ranks`` ranks of one run, 3 per step and rank, built as
bench_scale_ranks.py builds them: ``--template-ranks`` ranks recorded by real Monitors and
Senders (``bench_processor_throughput.monitor_messages``), rank r sending rank r % T's
bytes with its own rank, world size and producer id (``bench_scale_ranks.clone_batch``),
in the order the ranks send them. Timed (CPU time of this thread): ``StepStage.fold`` of
each message at its send time, and ``StepStage.ready`` after every ``--ready-every``
messages (a processor calls it after every poll; a processor that keeps up polls a few
messages at a time), then one last ``ready`` that closes what is left. Every (rank, step)
must come out exactly once (checked).

``--compare-with DIR`` also times the StepStage of another checkout's
``profstream/processors/runtime.py`` (loaded beside this one's, the rest of profstream
shared), alternating with this one's in the same process, so that the two are compared
without the differences between processes that a shared box adds.

Prints one JSON object on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections import Counter, namedtuple

from _common import emit, envelope, note, summary
from bench_processor_throughput import monitor_messages
from bench_scale_ranks import clone_batch

import profstream
from profstream.kafka.topics import Topics
from profstream.processors.health import StageCounts
from profstream.processors.runtime import StepStage
from profstream.schema.codec import decode
from profstream.simulate import SimConfig

Record = namedtuple("Record", "topic partition offset key value")


def rank_messages(ranks: int, template_ranks: int, steps: int, ops_per_step: int) -> list[tuple[float, Record]]:
    """(send time in s, raw record) of every message of the run, in send order."""
    cfg = SimConfig(run_id="stage", ranks=template_ranks, steps=steps, ops_per_step=ops_per_step,
                    step_time_ms=500.0, seed=5)
    at: list = []
    messages, _ = monitor_messages(cfg, sent_at=at)
    last = max(t for t in at if t is not None)
    first = min(t for t in at if t is not None)
    out = []
    for (key, value), t in zip(messages, at):
        template = int(key.rpartition(b"/")[2])
        for rank in range(template, ranks, template_ranks):
            rec = Record("stage.raw", rank % 16, len(out), f"stage/{rank}".encode(),
                         clone_batch(value, rank, ranks, f"stage-{rank}".encode()))
            out.append((((t if t is not None else last) - first) / 1e9, rec))
    return out


def other_step_stage(checkout: str) -> type:
    """StepStage of the runtime.py in another checkout, on this one's other modules."""
    path = os.path.join(checkout, "profstream", "processors", "runtime.py")
    spec = importlib.util.spec_from_file_location("profstream.processors._compared_runtime", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module.StepStage


def run_once(messages: list[tuple[float, Record]], ready_every: int, stage_cls: type = StepStage) -> dict[str, float]:
    topics = Topics("stage")
    stage = stage_cls(topics, 1, StageCounts(keep_step_ends=False))
    outputs = []
    ready_s = 0.0
    now = 0.0
    start = time.thread_time()
    for i, (now, rec) in enumerate(messages, 1):
        outputs += stage.fold(rec, now)
        if i % ready_every == 0:
            t = time.thread_time()
            outputs += stage.ready(now)
            ready_s += time.thread_time() - t
    t = time.thread_time()
    outputs += stage.ready(now + 1.0)
    ready_s += time.thread_time() - t
    total_s = time.thread_time() - start
    keys = Counter()
    for o in outputs:
        if o.topic == topics.steps:
            m = decode("StepMetrics", o.value)
            keys[(m["rank"], m["step"])] += 1
    return {"steps": len(keys), "steps_twice": sum(1 for n in keys.values() if n > 1),
            "cpu_s": total_s, "ready_cpu_s": ready_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--template-ranks", type=int, default=16)
    p.add_argument("--steps", type=int, default=8, help="steps of each rank")
    p.add_argument("--ops-per-step", type=int, default=50)
    p.add_argument("--ready-every", default="10,1000", help="messages between ready() calls (comma list)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compare-with", metavar="DIR", help="another checkout whose StepStage to alternate with")
    args = p.parse_args(argv)
    stages = {"this": StepStage}
    if args.compare_with:
        stages["other"] = other_step_stage(args.compare_with)
    messages = rank_messages(args.ranks, args.template_ranks, args.steps, args.ops_per_step)
    expected = args.ranks * args.steps
    note(f"{len(messages)} messages of {args.ranks} ranks x {args.steps} steps; code {profstream.__file__}")
    results: dict = {name: {} for name in stages}
    for every in [int(x) for x in args.ready_every.split(",")]:
        runs: dict[str, list] = {name: [] for name in stages}
        for _ in range(args.repeats):
            for name, cls in stages.items():  # alternating
                r = run_once(messages, every, cls)
                if r["steps"] != expected or r["steps_twice"]:
                    raise SystemExit(f"{name}, ready every {every}: {r['steps']} of {expected} steps, "
                                     f"{r['steps_twice']} twice")
                runs[name].append(r)
                note(f"{name}, ready every {every}: {r['cpu_s'] / expected * 1e3:.3f} ms CPU per step, "
                     f"ready {r['ready_cpu_s'] / expected * 1e3:.3f}")
        for name, rs in runs.items():
            results[name][f"ready_every_{every}"] = {
                "cpu_ms_per_step": summary([r["cpu_s"] / expected * 1e3 for r in rs]),
                "ready_cpu_ms_per_step": summary([r["ready_cpu_s"] / expected * 1e3 for r in rs]),
            }
    emit(envelope("step_stage_ranks", args, {
        "metric": "StepStage fold + ready CPU per (rank, step), one thread, no Kafka",
        "code": {"this": profstream.__file__, "other": args.compare_with}, "messages": len(messages),
        "steps": expected, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
