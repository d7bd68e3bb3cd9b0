"""What work figures (throughput and MFU, issue 33) cost the training thread, and what the
one-off FLOP count costs.

1. ``per_step``: CPU time of the training thread per step (thread_time) of a loop that
   does only what the PyTorch producer's hooks do at a step's boundaries: ``begin_step``,
   then for each micro-batch ``StepWork.batch`` (tokens, samples, the shape's cached count),
   then ``StepWork.take`` and ``send`` (``Monitor.work`` and ``counted_flops``) and
   ``end_step`` (a mark of 13 columns) — against the same loop with work figures off
   (``begin_step`` and a 5-column ``end_step``). The difference is the cost of work figures
   per step, for a Hugging Face batch (a dict of input_ids, attention_mask, labels) and a
   token-id tuple (ids, targets), one and four micro-batches a step; the compiled Monitor's
   recorder, as in a training process (its sender idle: the recording alone is timed).
2. ``flop_count``: wall time of a training step on CPU under the counter (the one-off
   count of a new input shape) against the same step without it, alternating, for a small
   transformer (compute-bound) and a stack of small layers (dispatch-bound); and how many
   regions ran under the counter over ``--count-steps`` steps of ``--shapes`` shapes (once
   per shape, never per step).

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import emit, envelope, note, summary
from bench_processor_throughput import _NoThread

from profstream.integrations.torch_work import Count, StepWork, send, shape_key
from profstream.producers.monitor import Monitor


def _monitor(native: bool) -> Monitor:
    return Monitor(run_id="bench-work", bootstrap="127.0.0.1:1", host_sample_interval_s=0, control=False,
                   device_interval_ms=0, sender_factory=_NoThread, native=native, peak_tflops=989.5,
                   buffer_bytes=1 << 30)


def _batches(kind: str) -> object:
    ids = torch.zeros(8, 2048, dtype=torch.long)
    if kind == "hf_dict":
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    return ids, ids


def per_step(kind: str, micro: int, steps: int, work_on: bool, native: bool) -> float:
    """CPU microseconds per step of the boundary loop (see the module docstring)."""
    mon = _monitor(native)
    batch = _batches(kind)
    work = StepWork(torch, count_flops=True) if work_on else None
    if work is not None:  # the shape's count is cached, as from the second step of a run on
        work.counts = {shape_key(batch, torch): Count(6e13, (5.8e13, 2e12, 0.0), "bf16", ())}
    start = time.thread_time()
    for _ in range(steps):
        mon.begin_step()
        if work is not None:
            for _ in range(micro):
                work.batch(batch)
            send(mon, *work.take())
        mon.end_step()
    cpu = time.thread_time() - start
    assert mon.dropped_samples == 0, "the recorder was full: fewer --steps"
    mon.close(timeout=0.1, ended=False)
    return cpu / steps * 1e6


def _models() -> dict[str, tuple[torch.nn.Module, int, int]]:
    """(model, vocabulary, sequence) of the counting runs: a transformer whose step is
    compute-bound on CPU, and a stack of small layers whose step is mostly op dispatch (the
    counter's cost per op shows there)."""
    vocab, width = 2048, 128
    blocks = [torch.nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True) for _ in range(4)]
    transformer = torch.nn.Sequential(torch.nn.Embedding(vocab, width), *blocks, torch.nn.Linear(width, vocab))
    small = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(48)]
    dispatch = torch.nn.Sequential(torch.nn.Embedding(512, 64), *small, torch.nn.Linear(64, 512))
    return {"transformer 4 x 128, vocabulary 2048, batch 8 x 128": (transformer, vocab, 128),
            "48 small layers (64 wide), batch 8 x 32": (dispatch, 512, 32)}


def flop_count(steps: int, shapes: int, repeats: int) -> dict:
    """Per model: a training step's wall time with and without the counter around it (the
    one-off count of a new shape), and the regions counted over a run of ``steps`` steps
    cycling through ``shapes`` shapes (once per shape, never per step)."""
    out = {}
    for name, (model, vocab, seq) in _models().items():
        torch.manual_seed(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(ids: torch.Tensor, model=model, optimizer=optimizer) -> None:
            optimizer.zero_grad()
            logits = model(ids)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
            optimizer.step()

        ids = torch.randint(0, vocab, (8, seq))
        step(ids)  # warm-up
        plain, counted = [], []
        for _ in range(repeats):  # alternating
            t = time.perf_counter()
            step(ids)
            plain.append(time.perf_counter() - t)
            work = StepWork(torch, count_flops=True)
            t = time.perf_counter()
            work.batch(ids)
            step(ids)
            flops = work.take()[2]
            counted.append(time.perf_counter() - t)
        work = StepWork(torch, count_flops=True)
        for i in range(steps):
            ids = torch.randint(0, vocab, (8, seq - 4 * (i % shapes)))
            work.batch(ids)
            step(ids)
            work.take()
        out[name] = {"gflops_per_step": flops / 1e9, "plain_step_ms": summary([x * 1e3 for x in plain]),
                     "counted_step_ms": summary([x * 1e3 for x in counted]),
                     "count_ms": (statistics.median(counted) - statistics.median(plain)) * 1e3,
                     "steps": steps, "shapes": shapes, "regions_counted": work.counted_regions}
        note(f"{name}: step {statistics.median(plain) * 1e3:.1f} ms, under the counter "
             f"{statistics.median(counted) * 1e3:.1f} ms; {work.counted_regions} regions counted in {steps} steps "
             f"of {shapes} shapes")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20000, help="steps per timed loop")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--count-steps", type=int, default=40, help="steps of the counting run")
    p.add_argument("--shapes", type=int, default=4, help="input shapes the counting run cycles through")
    p.add_argument("--python", action="store_true", help="the pure-Python Monitor instead of the compiled one")
    args = p.parse_args(argv)
    native = not args.python
    results: dict = {}
    for kind in ("hf_dict", "token_tuple"):
        for micro in (1, 4):
            off, on = [], []
            for _ in range(args.repeats):  # alternating
                off.append(per_step(kind, micro, args.steps, False, native))
                on.append(per_step(kind, micro, args.steps, True, native))
            diff = [b - a for a, b in zip(off, on)]
            results[f"{kind}_x{micro}"] = {"off_us": summary(off), "on_us": summary(on),
                                           "work_us_per_step": statistics.median(diff)}
            note(f"{kind} x{micro}: off {statistics.median(off):.2f} us, on {statistics.median(on):.2f} us, "
                 f"work {statistics.median(diff):.2f} us per step")
    count = flop_count(args.count_steps, args.shapes, args.repeats)
    emit(envelope("work", args, {"metric": "training-thread CPU per step with work figures on minus off; "
                                          "the one-off FLOP count",
                                 "monitor": "native" if native else "python", "per_step": results,
                                 "flop_count": count}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
