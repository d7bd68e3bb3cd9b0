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
