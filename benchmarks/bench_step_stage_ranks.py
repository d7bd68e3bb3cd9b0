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
``profstream/processors/runtime.py`` (or its TimelineSink, ``sinks/timeline.py``; loaded
beside this one's, the rest of profstream shared), alternating with this one's in the
same process, so that the two are compared without the differences between processes
that a shared box adds.

``--work``: every step mark carries its work (tokens, samples, counted FLOPs, the peak), so
that each StepMetrics has throughput and MFU (StepMetrics v7). ``--resources``: every step
has a host reading and a data-loader reading (in the rank's own batches, EventBatch v8), and the
stalled second half of the steps advice (StepMetrics v9, each worker's figures). ``--resources-ab``: the ``--resources`` run
with its readings taken out ("off": the same steps, stalls and loader queue) and as it is
("on"), alternating in this process: what the host figures and the advice add to a step,
without the differences between processes.

``--save-messages FILE`` pickles the ``--resources-ab`` messages (off and on) and ends;
``--messages FILE --count SIDE`` then runs the stage once over that side (``none``: only
loads them; ``--passes 2``: twice, so that 2 passes less 1 is a pass without the one-time
costs), with no timing of its own and its StepMetrics counted but not decoded (the
decoding of a v9 record is the reader's cost, not the stage's): for an instruction count
under callgrind, which the load of a shared box does not change (docs/benchmarks.md, "Host
figures, cheaper", which decoded them, and "Host figures within 5 %").

``--stage timeline`` times the timeline sink instead, as its SinkLoop drives it:
``TimelineSink.handle`` of every ``--ready-every`` messages, then ``durable_offsets`` (which
also closes steps by time; its time is the ``ready`` figure); its ``close`` at the end,
which writes the files, is not timed.

Prints one JSON object on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
import sys
import tempfile
import time
from collections import Counter, namedtuple

from _common import emit, envelope, note, summary
from bench_processor_throughput import monitor_messages
from bench_scale_ranks import clone_batch

import profstream
from profstream.kafka.topics import Topics
from profstream.processors.health import StageCounts
from profstream.processors.runtime import StepStage
from profstream.producers.sender import COLLECTIVE_PRODUCER_SUFFIX, DEVICE_PRODUCER_SUFFIX
from profstream.schema.batch import decode_batch, empty_section, encode_batch
from profstream.schema.codec import decode, record_name
from profstream.simulate import SimConfig
from profstream.sinks.timeline import TimelineSink

Record = namedtuple("Record", "topic partition offset key value")


# --work: every step mark carries its work, as the torch producer's with a FLOP count
WORK = {"batch_size": 8, "seq_len": 2048, "flops_per_token": 6 * 7e9, "flops_source": "counted",
        "peak_tflops": 989.5}
# (older Monitors also sent the data loader's readings in batches of their own, ".loader")
SIDE_SUFFIXES = (DEVICE_PRODUCER_SUFFIX, COLLECTIVE_PRODUCER_SUFFIX, ".loader")


def without_readings(messages: list[tuple[bytes, bytes]], at: list) -> tuple[list, list]:
    """The messages with their host and data-loader readings taken out (their rows emptied,
    each batch written again in the version the rest needs, its sequence number kept); the
    rest (the loader's queue) kept."""
    kept, kept_at = [], []
    for (key, value), t in zip(messages, at):
        batch = decode_batch(value)
        if batch.n("host_samples") or batch.n("loader_samples"):
            batch.host_samples = empty_section("host_samples")
            batch.loader_samples = empty_section("loader_samples")
            value = encode_batch(batch)
        kept.append((key, value))
        kept_at.append(t)
    return kept, kept_at


def rank_messages(ranks: int, template_ranks: int, steps: int, ops_per_step: int,
                  work: bool = False, resources: bool = False, readings: bool = True) -> list[tuple[float, Record]]:
    """(send time in s, raw record) of every message of the run, in send order; ``work``:
    with the steps' work figures (``WORK``); ``resources``: a host and a data-loader reading
    in every step, the loader's host queue sampled, and its stalled half starved by busy
    workers (advice on every such step); ``readings`` False: the same run without the host
    and loader readings (``without_readings``: no host figures, no advice)."""
    extra = {**(WORK if work else {}),
             **({"resources": True, "loader_fault": "cpu_bound", "stall": (steps // 2, steps - 1)} if resources
                else {})}
    cfg = SimConfig(run_id="stage", ranks=template_ranks, steps=steps, ops_per_step=ops_per_step,
                    step_time_ms=500.0, seed=5, **extra)
    at: list = []
    messages, _ = monitor_messages(cfg, sent_at=at)
    if not readings:
        messages, at = without_readings(messages, at)
    last = max(t for t in at if t is not None)
    first = min(t for t in at if t is not None)
    out = []
    for (key, value), t in zip(messages, at):
        template = int(key.rpartition(b"/")[2])
        # a side batch (device, collective or loader readings) keeps its producer's suffix: it
        # is a producer of its own, with its own sequence numbers
        pid = decode_batch(value).producer_id
        suffix = next((x for x in SIDE_SUFFIXES if pid.endswith(x)), "")
        for rank in range(template, ranks, template_ranks):
            rec = Record("stage.raw", rank % 16, len(out), f"stage/{rank}".encode(),
                         clone_batch(value, rank, ranks, f"stage-{rank}{suffix}".encode()))
            out.append((((t if t is not None else last) - first) / 1e9, rec))
    return out


def other_class(checkout: str, module_path: str, name: str) -> type:
    """Class ``name`` of the module at ``module_path`` (profstream/...) in another checkout,
    on this one's other modules."""
    path = os.path.join(checkout, module_path)
    spec = importlib.util.spec_from_file_location(f"profstream._compared_{name}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return getattr(module, name)


def run_once(messages: list[tuple[float, Record]], ready_every: int, stage_cls: type = StepStage,
             check: bool = True) -> dict[str, float]:
    """The stage over ``messages``; ``check``: every (rank, step) once, by decoding each
    StepMetrics after the timing (False: only counted, by its header, so that an instruction
    count holds the stage's work alone and not the decoding of its output)."""
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
    if not check:
        steps = sum(record_name(o.value) == "StepMetrics" for o in outputs)
        return {"steps": steps, "steps_twice": 0, "cpu_s": total_s, "ready_cpu_s": ready_s}
    for o in outputs:
        if record_name(o.value) == "StepMetrics":
            m = decode("StepMetrics", o.value)
            keys[(m["rank"], m["step"])] += 1
    return {"steps": len(keys), "steps_twice": sum(1 for n in keys.values() if n > 1),
            "cpu_s": total_s, "ready_cpu_s": ready_s}


def run_timeline_once(messages: list[tuple[float, Record]], ready_every: int,
                      sink_cls: type = TimelineSink) -> dict[str, float]:
    """The timeline sink's handle + durable_offsets per poll of ``ready_every`` messages."""
    now = [0.0]
    with tempfile.TemporaryDirectory() as out:
        sink = sink_cls(out, window_steps=1000, clock=lambda: now[0])
        offsets_s = 0.0
        start = time.thread_time()
        for i in range(0, len(messages), ready_every):
            chunk = messages[i:i + ready_every]
            now[0] = chunk[-1][0]
            sink.handle([rec for _, rec in chunk])
            t = time.thread_time()
            sink.durable_offsets()
            offsets_s += time.thread_time() - t
        now[0] += 1.0  # past the last steps' grace: every marked step closes
        t = time.thread_time()
        sink.durable_offsets()
        offsets_s += time.thread_time() - t
        total_s = time.thread_time() - start
        sink.close()
        return {"steps": sink.steps_written, "steps_twice": 0, "cpu_s": total_s, "ready_cpu_s": offsets_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--template-ranks", type=int, default=16)
    p.add_argument("--steps", type=int, default=8, help="steps of each rank")
    p.add_argument("--ops-per-step", type=int, default=50)
    p.add_argument("--ready-every", default="10,1000", help="messages between ready() calls (comma list)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stage", choices=("steps", "timeline"), default="steps",
                   help="the processors' StepStage, or the timeline sink")
    p.add_argument("--compare-with", metavar="DIR", help="another checkout whose stage to alternate with")
    p.add_argument("--work", action="store_true",
                   help="every step mark carries its work (tokens, samples, counted FLOPs, a peak): throughput and MFU")
    p.add_argument("--resources", action="store_true",
                   help="a host and a data-loader reading every step, its second half starved by busy workers: host "
                        "figures and advice")
    p.add_argument("--resources-ab", action="store_true",
                   help="alternate the --resources run with its readings taken out (off) and as it is (on), in this "
                        "process")
    p.add_argument("--save-messages", metavar="FILE", help="pickle the --resources-ab messages and end")
    p.add_argument("--messages", metavar="FILE", help="the messages --save-messages wrote (with --count)")
    p.add_argument("--count", choices=("off", "on", "none"),
                   help="run the stage once over that side of --messages, untimed (for callgrind)")
    p.add_argument("--passes", type=int, default=1,
                   help="with --count: that many stages one after the other over the messages (2 less 1: a pass "
                        "without the one-time costs, the writers' compiling among them)")
    args = p.parse_args(argv)
    if args.count:
        if not args.messages:
            p.error("--count needs --messages FILE (written by --save-messages)")
        with open(args.messages, "rb") as f:
            sides = pickle.load(f)
        steps = sum(run_once(sides[args.count], 10, check=False)["steps"] for _ in range(args.passes)
                    if args.count != "none")
        emit(envelope("step_stage_ranks_count", args, {"side": args.count, "steps": steps}))
        return 0
    if args.save_messages:
        sides = {"off": rank_messages(args.ranks, args.template_ranks, args.steps, args.ops_per_step, args.work,
                                      True, False),
                 "on": rank_messages(args.ranks, args.template_ranks, args.steps, args.ops_per_step, args.work, True)}
        with open(args.save_messages, "wb") as f:
            pickle.dump(sides, f)
        emit(envelope("step_stage_ranks_messages", args, {k: len(v) for k, v in sides.items()}))
        return 0
    if args.resources_ab and args.compare_with:
        p.error("--resources-ab and --compare-with each alternate two sides: give one")
    module_path, class_name, cls = (("profstream/processors/runtime.py", "StepStage", StepStage)
                                    if args.stage == "steps"
                                    else ("profstream/sinks/timeline.py", "TimelineSink", TimelineSink))
    run = run_once if args.stage == "steps" else run_timeline_once
    def build(resources: bool, readings: bool = True) -> list[tuple[float, Record]]:
        return rank_messages(args.ranks, args.template_ranks, args.steps, args.ops_per_step, args.work, resources,
                             readings)

    if args.resources_ab:  # name -> (stage class, messages)
        stages = {"off": (cls, build(True, readings=False)), "on": (cls, build(True))}
    else:
        messages = build(args.resources)
        stages = {"this": (cls, messages)}
        if args.compare_with:
            stages["other"] = (other_class(args.compare_with, module_path, class_name), messages)
    expected = args.ranks * args.steps
    for name, (_, messages) in stages.items():
        note(f"{name}: {len(messages)} messages of {args.ranks} ranks x {args.steps} steps; code {profstream.__file__}")
    results: dict = {name: {} for name in stages}
    for every in [int(x) for x in args.ready_every.split(",")]:
        runs: dict[str, list] = {name: [] for name in stages}
        for _ in range(args.repeats):
            for name, (cls, messages) in stages.items():  # alternating
                r = run(messages, every, cls)
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
        "metric": (f"{class_name} " + ("fold + ready" if args.stage == "steps" else "handle + durable_offsets")
                   + " CPU per (rank, step), one thread, no Kafka"),
        "code": {"this": profstream.__file__, "other": args.compare_with},
        "messages": ({name: len(messages) for name, (_, messages) in stages.items()} if args.resources_ab
                     else len(stages["this"][1])),
        "steps": expected, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
