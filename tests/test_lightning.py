"""ProfstreamCallback on a real Lightning Trainer (CPU, a tiny LightningModule), through the
real broker and processor."""

from __future__ import annotations

import logging
import time

import pytest

from profstream.config import UnknownOptionError
from tests.helpers import step_records, wait_until
from tests.test_processor import RunningProcessor

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

from profstream.integrations.lightning import ProfstreamCallback  # noqa: E402
from tests.test_torch import _assert_phases_tile_each_step  # noqa: E402

LOAD_S = 0.015  # every training item takes this long to load
EVAL_S = 0.05  # every validation item: validation runs between steps
BATCH = 4


class Slow(torch.utils.data.Dataset):
    """Synthetic regression data, each item taking ``delay_s`` to load."""

    def __init__(self, n: int, delay_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        time.sleep(self.delay_s)
        return self.x[i], self.y[i]


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        self.validation_ends: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_validation_end(self) -> None:
        self.validation_ends.append(time.time_ns())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(steps: int, callback: ProfstreamCallback, **trainer_args) -> tuple[pl.Trainer, Regression]:
    torch.manual_seed(0)
    module = Regression()
    args = dict(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    args.update(trainer_args)
    trainer = pl.Trainer(**args)
    accumulate = args.get("accumulate_grad_batches", 1)
    train = torch.utils.data.DataLoader(Slow(BATCH * accumulate * steps, LOAD_S), batch_size=BATCH)
    val = torch.utils.data.DataLoader(Slow(BATCH, EVAL_S), batch_size=BATCH)
    trainer.fit(module, train, val)
    return trainer, module


def test_each_optimizer_step_gets_its_phases_ops_and_memory(kafka_bootstrap, topics):
    steps = 6
    callback = ProfstreamCallback(bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, run_id="pl-tiny",
                                  host_sample_interval_s=0)
    with RunningProcessor(kafka_bootstrap, topics):
        _, module = _fit(steps, callback, accumulate_grad_batches=2, val_check_interval=4, num_sanity_val_steps=1)
        got = step_records(kafka_bootstrap, topics.steps, "pl-tiny", steps)
    _assert_phases_tile_each_step(got, steps)
    assert len(module.validation_ends) == 4  # the sanity check, then after every other step
    for s in got:
        # the step's first micro-batch is loaded before its first forward (Lightning fetches the
        # second one between the two forwards: inside fp_bp)
        assert s["data_wait_ns"] >= BATCH * LOAD_S * 1e9, s["step"]
        assert not any(s["start_ns"] < t < s["end_ns"] for t in module.validation_ends), s["step"]
        assert s["op_count"] > 0 and s["compute_ns"] > 0 and s["memory"]["allocated"] > 0


def test_an_unknown_option_fails_at_start_up_naming_the_valid_ones():
    with pytest.raises(UnknownOptionError, match="unknown option 'every_n_step'.*every_n_steps"):
        ProfstreamCallback(every_n_step=5)


class AfterTheWarning(pl.Callback):
    """Starts training once profstream has warned: the run then ends without waiting for the
    broker (a run shorter than the first connection attempt would wait for it at its end)."""

    def __init__(self, caplog) -> None:
        self.caplog = caplog

    def on_train_start(self, trainer, pl_module) -> None:
        wait_until(lambda: any(r.name.startswith("profstream") for r in self.caplog.records), 30, "the warning")


def test_no_broker_logs_one_warning_and_training_goes_on(caplog):
    callback = ProfstreamCallback(bootstrap="127.0.0.1:1", connect_timeout_s=0.5, capture_ops=False)
    with caplog.at_level(logging.WARNING, logger="profstream"):
        trainer, _ = _fit(2, callback, limit_val_batches=0, callbacks=[callback, AfterTheWarning(caplog)])
    assert trainer.global_step == 2
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("profstream")]
    assert len(warnings) == 1 and "127.0.0.1:1" in warnings[0], warnings


def test_each_steps_work_is_its_micro_batches_samples_and_the_flops_flop_counter_mode_counts(kafka_bootstrap, topics):
    """The regression module's batches are (x, y) of floats: samples per step are its
    micro-batches' rows (no tokens); FLOPs equal FlopCounterMode's own count of one
    micro-batch's forward and backward times the micro-batches (the same shape every step)."""
    from torch.utils.flop_counter import FlopCounterMode

    steps = 4
    callback = ProfstreamCallback(bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, run_id="pl-work",
                                  host_sample_interval_s=0, capture_ops=False, peak_tflops=0.1)
    with RunningProcessor(kafka_bootstrap, topics):
        _fit(steps, callback, accumulate_grad_batches=2, limit_val_batches=0)
        got = step_records(kafka_bootstrap, topics.steps, "pl-work", steps)
    module = Regression()
    x, y = torch.randn(BATCH, 16), torch.randn(BATCH, 4)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.mse_loss(module.net(x), y).backward()
    for s in got:
        w = s["work"]
        assert w["tokens"] is None and w["tokens_per_s"] is None  # floats: no token ids
        assert w["samples"] == 2 * BATCH and w["samples_per_s"] == 2 * BATCH / (s["step_time_ns"] / 1e9)
        assert w["flops"] == 2 * counter.get_total_flops() and w["flops_source"] == "counted"
        assert w["mfu"] == w["flops"] / (s["step_time_ns"] / 1e9 * 0.1e12)
