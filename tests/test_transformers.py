"""ProfstreamCallback on a real Hugging Face Trainer (CPU, a tiny GPT-2 built from a config:
no download), through the real broker and processor."""

from __future__ import annotations

import logging
import time

import pytest

from profstream.config import UnknownOptionError
from tests.helpers import step_records, wait_until
from tests.test_processor import RunningProcessor

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from profstream.integrations.transformers import ProfstreamCallback  # noqa: E402
from tests.test_torch import _assert_phases_tile_each_step  # noqa: E402

LOAD_S = 0.015  # every training item takes this long to load
EVAL_S = 0.05  # every evaluation item: evaluation runs between steps
BATCH = 4


class Tokens(torch.utils.data.Dataset):
    """Random token sequences for a language model, each taking ``delay_s`` to load."""

    def __init__(self, n: int, delay_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        time.sleep(self.delay_s)
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class EvaluationTimes(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.ends: list[int] = []

    def on_evaluate(self, args, state, control, **kwargs) -> None:
        self.ends.append(time.time_ns())


def _trainer(tmp_path, steps: int, callbacks: list, **args) -> transformers.Trainer:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    arguments = dict(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=BATCH,
                     learning_rate=1e-3, save_strategy="no", logging_strategy="no", report_to="none",
                     disable_tqdm=True, use_cpu=True, seed=0)
    arguments.update(args)
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config),
                                args=transformers.TrainingArguments(**arguments),
                                train_dataset=Tokens(BATCH * 2 * steps, LOAD_S),
                                eval_dataset=Tokens(BATCH, EVAL_S), callbacks=callbacks)


def test_each_optimizer_step_gets_its_phases_ops_and_memory(kafka_bootstrap, topics, tmp_path):
    steps, evaluations = 6, EvaluationTimes()
    callback = ProfstreamCallback(bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, host_sample_interval_s=0)
    trainer = _trainer(tmp_path, steps, [callback, evaluations], run_name="hf tiny/run",
                       gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=3)
    with RunningProcessor(kafka_bootstrap, topics):
        trainer.train()
        got = step_records(kafka_bootstrap, topics.steps, "hf-tiny-run", steps)  # the run name as a run id
    _assert_phases_tile_each_step(got, steps)
    assert len(evaluations.ends) == 2
    for s in got:
        assert s["rank"] == 0
        # the step's micro-batches are fetched before its first hook: S is the first request
        # (accelerate fetches one batch ahead, so the last step loads one batch, the others two)
        assert s["data_wait_ns"] >= BATCH * LOAD_S * 1e9, s["step"]
        assert not any(s["start_ns"] < t < s["end_ns"] for t in evaluations.ends), s["step"]  # between steps
        assert s["op_count"] > 0 and s["compute_ns"] > 0 and s["memory"]["allocated"] > 0


class VariableTokens(torch.utils.data.Dataset):
    """Token sequences of 6 to 16 tokens: a batch padded to its longest has its own count."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.lengths = torch.randint(6, 17, (n,), generator=g).tolist()
        self.ids = [torch.randint(0, 64, (k,), generator=g) for k in self.lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}


def _pad(items: list[dict]) -> dict:
    longest = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for i, x in enumerate(items):
        ids[i, :len(x["input_ids"])] = x["input_ids"]
        mask[i, :len(x["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class StepInputs(transformers.TrainerCallback):
    """What the model was given in each step: the inputs of each forward (micro-batch)."""

    def __init__(self, profstream: ProfstreamCallback) -> None:
        self.profstream = profstream
        self.steps: dict[int, list[dict]] = {}
        self.step: int | None = None
        self.work = None  # the profstream callback's StepWork

    def on_train_begin(self, args, state, control, model=None, **kwargs) -> None:
        self.work = self.profstream.steps.work
        model.register_forward_pre_hook(self._inputs, with_kwargs=True)

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self.step = state.global_step
        self.steps[self.step] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.step = None

    def _inputs(self, _model, _args, kwargs) -> None:
        if self.step is not None:
            self.steps[self.step].append({k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)})


def test_each_steps_work_is_its_batches_tokens_and_the_flops_flop_counter_mode_counts(kafka_bootstrap, topics,
                                                                                       tmp_path):
    """Tokens per step are those of the step's micro-batches (padded batches of varying
    length: each step its own count); FLOPs per step equal FlopCounterMode's own count of
    the same micro-batches' forward and backward, 6 x dense parameters x tokens plus the
    attention term; MFU against the given peak is FLOPs / (step time x peak); each input
    shape was counted once."""
    from torch.utils.flop_counter import FlopCounterMode

    steps, width, layers = 8, 32, 2
    callback = ProfstreamCallback(bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, run_id="hf-work",
                                  host_sample_interval_s=0, capture_ops=False, peak_tflops=0.5)
    inputs = StepInputs(callback)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=width, n_layer=layers, n_head=2)
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config), data_collator=_pad, callbacks=[callback, inputs],
        train_dataset=VariableTokens(BATCH * 2 * steps),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps,
                                            per_device_train_batch_size=BATCH, gradient_accumulation_steps=2,
                                            save_strategy="no", logging_strategy="no", report_to="none",
                                            disable_tqdm=True, use_cpu=True, seed=0))
    with RunningProcessor(kafka_bootstrap, topics):
        trainer.train()
        got = {s["step"]: s for s in step_records(kafka_bootstrap, topics.steps, "hf-work", steps)}

    fresh = transformers.GPT2LMHeadModel(config)  # FLOPs depend on shapes, not weights

    def flop_counter_mode(batch: dict) -> int:
        with FlopCounterMode(display=False) as counter:
            fresh(**batch).loss.backward()
        return counter.get_total_flops()

    dense = layers * 12 * width * width + 64 * width  # the blocks' matmul weights and the (tied) LM head
    shapes = {tuple(b["input_ids"].shape) for mbs in inputs.steps.values() for b in mbs}
    assert len({sum(b["input_ids"].numel() for b in mbs) for mbs in inputs.steps.values()}) > 1  # tokens vary
    for step, micro_batches in inputs.steps.items():
        w = got[step]["work"]
        assert len(micro_batches) == 2
        assert w["tokens"] == sum(b["input_ids"].numel() for b in micro_batches)
        assert w["samples"] == 2 * BATCH
        assert w["flops_source"] == "counted"
        assert w["flops"] == sum(flop_counter_mode(b) for b in micro_batches)
        attention = sum(12 * b["input_ids"].shape[0] * b["input_ids"].shape[1] ** 2 * width * layers
                        for b in micro_batches)  # QK^T and AV, forward and backward
        assert 0 < w["flops"] - 6 * dense * w["tokens"] <= attention
        assert w["peak_flops"] == 0.5e12
        assert w["mfu"] == w["flops"] / (got[step]["step_time_ns"] / 1e9 * 0.5e12)
        assert w["tokens_per_s"] == w["tokens"] / (got[step]["step_time_ns"] / 1e9)
    assert inputs.work.counted_regions == len(shapes)  # once per input shape, never per step


def test_report_to_profstream_takes_its_options_from_the_environment(kafka_bootstrap, topics, tmp_path,
                                                                     monkeypatch):
    steps = 4
    for name, value in (("BOOTSTRAP", kafka_bootstrap), ("TOPIC_PREFIX", topics.prefix), ("RUN_ID", "hf-env"),
                        ("CAPTURE_OPS", "false"), ("HOST_SAMPLE_INTERVAL_S", "0")):
        monkeypatch.setenv(f"PROFSTREAM_{name}", value)
    trainer = _trainer(tmp_path, steps, [], report_to=["profstream"], run_name="ignored", dataloader_num_workers=2)
    assert any(isinstance(c, ProfstreamCallback) for c in trainer.callback_handler.callbacks)
    with RunningProcessor(kafka_bootstrap, topics):
        trainer.train()
        got = step_records(kafka_bootstrap, topics.steps, "hf-env", steps)
    _assert_phases_tile_each_step(got, steps)
    for s in got:
        assert s["op_count"] == 0  # PROFSTREAM_CAPTURE_OPS=false
        queue = {q["queue"]: q for q in s["queues"]}["dataloader"]  # 2 workers x prefetch 2
        assert queue["at_start"] is not None and 0 <= queue["at_start"] <= 4


def test_an_unknown_option_fails_at_start_up_naming_the_valid_ones():
    with pytest.raises(UnknownOptionError, match="unknown option 'bootstrap_servers'.*bootstrap.*capture_ops"):
        ProfstreamCallback(bootstrap_servers="kafka:9092")


class AfterTheWarning(transformers.TrainerCallback):
    """Starts training once profstream has warned: the run then ends without waiting for the
    broker (a run shorter than the first connection attempt would wait for it at its end)."""

    def __init__(self, caplog) -> None:
        self.caplog = caplog

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        wait_until(lambda: any(r.name.startswith("profstream") for r in self.caplog.records), 30, "the warning")


@pytest.mark.parametrize("options, says", [
    ({"every_n_steps": 0}, "argument every_n_steps=0: expected an integer >= 1"),
    ({"bootstrap": "127.0.0.1:1", "connect_timeout_s": 0.5}, "127.0.0.1:1"),
])
def test_bad_options_or_no_broker_log_one_warning_and_training_goes_on(tmp_path, caplog, options, says):
    with caplog.at_level(logging.WARNING, logger="profstream"):
        callbacks = [ProfstreamCallback(capture_ops=False, **options), AfterTheWarning(caplog)]
        result = _trainer(tmp_path, 2, callbacks).train()
    assert result.global_step == 2
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("profstream")]
    assert len(warnings) == 1 and says in warnings[0], warnings
