"""The training job of the GPU check (device_check.py, gpu_check.py): a small language model.

An embedding, ``--layers`` transformer encoder blocks and a vocabulary head in bf16 on
``--device``, AdamW, token batches from a DataLoader with worker processes (pinned
memory on CUDA). ``--mode plain`` is the loop alone (what ``profstream run`` instruments);
``--mode profiler`` runs it under torch.profiler alone: one cycle per step (the schedule op
capture uses, nothing exported), or with ``--trace-dir`` the Chrome trace of steps
``--trace-steps`` (A:B) exported there. Writes its step times in seconds to ``--out``
(JSON): each from the end of one step to the end of the next, the device synchronised.

Uses nothing but torch and the standard library: it runs as it is on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

SIZES = {  # d_model, layers, heads, batch, sequence, vocabulary
    "gpu": (1024, 8, 16, 32, 512, 32768),
    "tiny": (64, 2, 4, 4, 64, 512),
}


class Tokens(torch.utils.data.Dataset):
    """Deterministic token ids: batch ``i`` is the same in every run."""

    def __init__(self, seq: int, vocab: int) -> None:
        self.seq, self.vocab = seq, vocab

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, self.vocab, (self.seq + 1,), generator=g)


class LanguageModel(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[nn.TransformerEncoderLayer(d, heads, 4 * d, batch_first=True, dropout=0.0)
                                      for _ in range(layers)])
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="gpu", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--mode", default="plain", choices=("plain", "profiler"))
    ap.add_argument("--trace-dir")
    ap.add_argument("--trace-steps", default="20:24", help="A:B, the steps the exported trace covers")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.manual_seed(0)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda:
        dev = torch.device("cuda", dev.index or 0)
        torch.cuda.set_device(dev)
    d, layers, heads, batch, seq, vocab = SIZES[args.size]
    model = LanguageModel(d, layers, heads, vocab).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(Tokens(seq, vocab), batch_size=batch, num_workers=args.workers,
                                         pin_memory=cuda, persistent_workers=args.workers > 0)
    prof = None
    if args.mode == "profiler":
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        if args.trace_dir:
            first, last = (int(x) for x in args.trace_steps.split(":"))
            prof = torch.profiler.profile(
                activities=acts, schedule=torch.profiler.schedule(wait=max(0, first - 2), warmup=min(2, first),
                                                                  active=last - first + 1, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(args.trace_dir, use_gzip=True))
        else:
            prof = torch.profiler.profile(activities=acts, schedule=torch.profiler.schedule(
                wait=0, warmup=0, active=1, repeat=0), on_trace_ready=lambda p: None)
        prof.start()
    times, last = [], None
    loss_fn = nn.CrossEntropyLoss()
    for step, ids in enumerate(loader):
        if step == args.steps:
            break
        ids = ids.to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        loss = loss_fn(logits.float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
        if prof is not None:
            prof.step()
    if prof is not None:
        prof.stop()
    with open(args.out, "w") as f:
        json.dump(times, f)


if __name__ == "__main__":
    main()
