"""Hugging Face Transformers (extra ``transformers``): ``ProfstreamCallback``, a
``TrainerCallback`` that streams the Trainer's steps to profstream.

    from profstream.integrations.transformers import ProfstreamCallback
    trainer = Trainer(model, args, train_dataset=data, callbacks=[ProfstreamCallback(bootstrap="kafka:9092")])

Importing this module also registers ``"profstream"`` as a ``report_to`` name, so
``TrainingArguments(report_to=["profstream"])`` adds the callback with its options from
``PROFSTREAM_*`` variables. Marks (see ``trainer_steps``): S at the first batch request of
the training DataLoader after the previous step, F at ``on_step_begin``, B at
``on_pre_optimizer_step``, E at ``on_step_end``; one step per optimizer step (gradient
accumulation included), numbered by ``state.global_step``. The run id defaults to
``TrainingArguments.run_name``, the rank to the Trainer's process index. See
docs/integrations.md.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from torch.utils.data import DataLoader
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("profstream.integrations.transformers needs transformers: "
                      "pip install 'profstream[transformers]'") from e

from profstream.integrations.trainer_steps import StepsCallback

REPORT_TO = "profstream"


class ProfstreamCallback(StepsCallback, TrainerCallback):
    """Streams every training step of a ``transformers.Trainer``; options as for ``StepsCallback``."""

    log = logging.getLogger("profstream.transformers")

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._inputs_hook: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None,
                       model: Any = None, **kwargs: Any) -> None:
        steps = self.start_steps(args.process_index, args.world_size, args.run_name, state.global_step)
        loader = getattr(train_dataloader, "base_dataloader", train_dataloader)  # accelerate wraps it
        if steps is not None and isinstance(loader, DataLoader):
            steps.attach_loader(loader)
        if steps is not None and steps.work is not None and model is not None:
            # the inputs of each forward of a step: a micro-batch (accelerate's loader fetches
            # one batch ahead, so the batches the loader returns are not the step's)
            self._inputs_hook = model.register_forward_pre_hook(self._forward_inputs, with_kwargs=True)

    def _forward_inputs(self, _model: Any, args: tuple, kwargs: dict) -> None:
        steps = self.steps
        if steps is not None and steps.in_step:
            steps.work_batch(kwargs if kwargs else args)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.steps is not None:
            self.steps.begin(state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.steps is not None:
            self.steps.backward_end()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.steps is not None:
            self.steps.end()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        hook, self._inputs_hook = self._inputs_hook, None
        if hook is not None:
            hook.remove()
        self.close_steps()


def _register_report_to() -> None:
    """``report_to=["profstream"]``: the Trainer looks its report_to names up in this table."""
    try:
        from transformers.integrations import integration_utils
    except ImportError:  # a transformers without the table: callbacks=[...] still works
        return
    table = getattr(integration_utils, "INTEGRATION_TO_CALLBACK", None)
    if isinstance(table, dict):
        table.setdefault(REPORT_TO, ProfstreamCallback)


_register_report_to()

__all__ = ["REPORT_TO", "ProfstreamCallback"]
