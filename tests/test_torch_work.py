"""The PyTorch producer's work figures (integrations/torch_work.py): tokens and samples of
each step's batches, model FLOPs counted once per input shape by torch's FlopCounterMode (or
taken from torch.profiler's count on captured steps), ops torch cannot count named, and the
device's peak; through a real Monitor and the processors' own code (no broker)."""

from __future__ import annotations

import logging
import math

import pytest

from profstream.processors.stream import RawMessage, figures
from profstream.producers.monitor import Monitor
from profstream.producers.sender import Sender
from profstream.schema.codec import decode
from tests.helpers import IdleSender

torch = pytest.importorskip("torch")

from profstream.integrations.torch import instrument  # noqa: E402
from profstream.integrations.torch_work import MAX_COUNTED_SHAPES, batch_work  # noqa: E402

VOCAB, WIDTH = 50, 16


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.hidden = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.head = torch.nn.Linear(4 * WIDTH, VOCAB)

    def forward(self, ids):
        return self.head(torch.relu(self.hidden(self.embed(ids))))


class TokenBatches(torch.utils.data.Dataset):
    """Batches of token ids whose length changes from batch to batch (a loader with
    batch_size=None): (ids, targets), as a language-model DataLoader gives them."""

    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        g = torch.Generator().manual_seed(0)
        self.batches = [torch.randint(0, VOCAB, shape, generator=g) for shape in shapes]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int):
        ids = self.batches[i]
        return ids, ids.roll(1, dims=1)


def _monitor(**options) -> Monitor:
    return Monitor(run_id="work", rank=0, bootstrap="127.0.0.1:1", host_sample_interval_s=0, control=False,
                   native=False, device_interval_ms=0, sender_factory=IdleSender, **options)


def _step_metrics(monitor: Monitor) -> dict[int, dict]:
    """The StepMetrics the processors compute from what ``monitor`` recorded."""
    sender = Sender(monitor)
    messages = []
    while sender._pending or sender._build():
        messages.append(RawMessage(0.0, 0, len(messages), monitor.key, sender._pending.popleft()[0]))
    out = {}
    for f in figures(messages):
        if f.kind == "steps":
            m = decode("StepMetrics", f.value)
            out[m["step"]] = m
    return out


def _train(model, loader, monitor, epochs: int = 1, **options):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = instrument(model, optimizer, loader, monitor=monitor, **options)
    for _ in range(epochs):
        for ids, targets in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
            loss.backward()
            optimizer.step()
    prof.close()
    return prof


def _counted(model, ids, targets) -> int:
    """FlopCounterMode's own count of one step: forward, backward and the optimizer."""
    from torch.utils.flop_counter import FlopCounterMode

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with FlopCounterMode(display=False) as counter:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
    return counter.get_total_flops()


def test_a_loader_of_token_ids_gives_each_steps_tokens_samples_and_the_flops_flop_counter_mode_counts():
    shapes = [(4, 12), (4, 20), (4, 12), (2, 7), (4, 20), (4, 12)]
    data = TokenBatches(shapes)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    torch.manual_seed(0)
    model = TinyLM()
    mon = _monitor(peak_tflops=0.25)
    prof = _train(model, loader, mon, capture_ops=False)
    got = _step_metrics(mon)
    assert sorted(got) == list(range(len(shapes)))
    for step, (b, t) in enumerate(shapes):
        w = got[step]["work"]
        assert (w["tokens"], w["samples"]) == (b * t, b)
        assert w["flops"] == _counted(TinyLM(), *data[step]) and w["flops_source"] == "counted"
        assert w["mfu"] == w["flops"] / (got[step]["step_time_ns"] / 1e9 * 0.25e12)
        cats = {c["category"]: c["flops"] for c in w["op_categories"]}
        assert cats == {} or cats["matmul"] == w["flops"]  # every FLOP of this model is a matmul's
    assert prof.work.counted_regions == len(set(shapes))  # once per input shape, not per step


def test_an_op_torch_cannot_count_is_left_out_and_named_and_the_rest_counted(caplog):
    @torch.library.custom_op("profstream_test::scaled", mutates_args=())
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    @scaled.register_fake
    def _(x):
        return torch.empty_like(x)

    scaled.register_autograd(lambda ctx, grad: grad * 2.0)

    class WithCustomOp(TinyLM):
        def forward(self, ids):
            return self.head(scaled(torch.relu(self.hidden(self.embed(ids)))))

    data = TokenBatches([(4, 8)] * 3)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    torch.manual_seed(0)
    mon = _monitor(peak_tflops=1.0)
    with caplog.at_level(logging.WARNING, logger="profstream.torch"):
        _train(WithCustomOp(), loader, mon, capture_ops=False)
    got = _step_metrics(mon)
    # the custom op (a kernel torch has no formula for) counts nothing; the linears count
    assert all(m["work"]["flops"] == _counted(TinyLM(), *data[0]) for m in got.values())
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(said) == 1 and "profstream_test.scaled" in said[0]


def test_without_the_count_a_captured_steps_flops_are_those_torch_profiler_counted():
    data = TokenBatches([(4, 10)] * 4)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    torch.manual_seed(0)
    mon = _monitor(peak_tflops=1.0, every_n_steps=2)
    _train(TinyLM(), loader, mon, count_flops=False, compiled_walk=False)
    got = _step_metrics(mon)
    flops = _counted(TinyLM(), *data[0])
    for step, m in got.items():
        w = m["work"]
        assert w["tokens"] == 40 and w["samples"] == 4
        if step % 2 == 0:  # captured: the profiler's FLOPs of its matmuls, all of them
            assert w["flops"] == flops and w["flops_source"] == "ops" and w["mfu"] is not None
            assert {c["category"] for c in w["op_categories"]} == {"matmul"}
        else:  # not captured, not counted: no FLOPs, never 0
            assert w["flops"] is None and w["flops_source"] is None and w["mfu"] is None


def test_shapes_past_the_counting_budget_have_no_flops_and_one_line_says_what_to_do(caplog):
    shapes = [(2, 3 + i) for i in range(MAX_COUNTED_SHAPES + 2)]
    data = TokenBatches(shapes)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    mon = _monitor(peak_tflops=1.0)
    with caplog.at_level(logging.WARNING, logger="profstream.torch"):
        prof = _train(TinyLM(), loader, mon, capture_ops=False)
    got = _step_metrics(mon)
    assert prof.work.counted_regions == MAX_COUNTED_SHAPES
    assert all(got[s]["work"]["flops"] is not None for s in range(MAX_COUNTED_SHAPES))
    assert all(got[s]["work"]["flops"] is None and got[s]["work"]["tokens"] == shapes[s][0] * shapes[s][1]
               for s in range(MAX_COUNTED_SHAPES, len(shapes)))
    assert sum("PROFSTREAM_FLOPS_PER_TOKEN" in r.getMessage() for r in caplog.records) == 1


def test_work_figures_off_sends_no_work():
    loader = torch.utils.data.DataLoader(TokenBatches([(2, 5)] * 2), batch_size=None)
    mon = _monitor(peak_tflops=1.0)
    prof = _train(TinyLM(), loader, mon, capture_ops=False, work_figures=False)
    assert prof.work is None and all(m["work"] is None for m in _step_metrics(mon).values())


@pytest.mark.parametrize("batch, want", [
    ({"input_ids": torch.zeros(8, 128, dtype=torch.long), "labels": torch.zeros(8, 128, dtype=torch.long)}, (1024, 8)),
    ({"attention_mask": torch.ones(2, 5, dtype=torch.long), "pixel_values": torch.zeros(2, 3)}, (10, 2)),
    ({"pixel_values": torch.zeros(6, 3, 8, 8), "labels": torch.zeros(6, dtype=torch.long)}, (None, 6)),
    ((torch.zeros(32, 512, dtype=torch.long), torch.zeros(32, 512, dtype=torch.long)), (16384, 32)),
    (torch.zeros(32, 513, dtype=torch.int32), (16416, 32)),
    ([torch.zeros(16, 3, 32, 32), torch.zeros(16, dtype=torch.long)], (None, 16)),
    (torch.zeros(10), (None, 10)),
    ("not a batch", (None, None)),
    ({}, (None, None)),
])
def test_tokens_and_samples_are_found_in_the_usual_batches(batch, want):
    assert batch_work(batch, torch) == want


def test_the_peak_comes_from_the_table_for_a_known_device_and_is_absent_with_one_line_otherwise(caplog):
    mon = _monitor()
    assert mon.set_device_peak("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12
    assert mon.set_device_peak("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    assert mon.set_device_peak("NVIDIA H200", "tf32") == 494.5e12
    assert math.isnan(mon.set_device_peak("Ascend910B3", "bf16"))
    mon.begin_step(0)
    mon.work(tokens=10, flops=1e9)
    with caplog.at_level(logging.WARNING, logger="profstream.monitor"):
        mon.end_step()
        mon.begin_step(1)
        mon.work(flops=1e9)
        mon.end_step()
    said = [r.getMessage() for r in caplog.records if "MFU is not computed" in r.getMessage()]
    assert len(said) == 1 and "Ascend910B3 in bf16" in said[0] and "PROFSTREAM_PEAK_TFLOPS" in said[0]
    given = _monitor(peak_tflops=312.0)
    assert given.set_device_peak("NVIDIA H100 80GB HBM3", "bf16") == 312e12  # the option wins
