"""PyTorch Lightning (extra ``lightning``): ``ProfstreamCallback``, a
``lightning.pytorch.Callback`` that streams the Trainer's training steps to profstream.

    from profstream.integrations.lightning import ProfstreamCallback
    trainer = lightning.pytorch.Trainer(callbacks=[ProfstreamCallback(bootstrap="kafka:9092")])

Marks (see ``trainer_steps``): S at the first batch request of the training DataLoader
after the previous step (requests made while Lightning validates do not count), F at the
step's first ``on_train_batch_start``, B at ``on_before_optimizer_step`` (after the closure
ran forward and backward), E at the ``on_train_batch_end`` after the optimizer stepped;
one step per optimizer step (``accumulate_grad_batches`` included), numbered by
``trainer.global_step``. The rank defaults to ``trainer.global_rank``. See
docs/integrations.md.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("profstream.integrations.lightning needs Lightning: pip install 'profstream[lightning]'") from e

from profstream.integrations.trainer_steps import StepsCallback


class ProfstreamCallback(StepsCallback, Callback):
    """Streams every training step of a ``lightning.pytorch.Trainer``; options as for ``StepsCallback``."""

    log = logging.getLogger("profstream.lightning")

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._step_opened_at = -1  # trainer.global_step when the open step began

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # before Lightning makes the training DataLoader's first iterator
        steps = self.start_steps(trainer.global_rank, trainer.world_size, None, trainer.global_step)
        if steps is not None:
            # Lightning may rebuild the user's DataLoader (a distributed sampler): every
            # DataLoader's requests are timed, those made while validating are not counted
            steps.attach_loader(None)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.steps is not None:
            self.steps.listening = False

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.steps is not None:
            self.steps.listening = True

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        steps = self.steps
        if steps is not None and not steps.in_step:
            self._step_opened_at = trainer.global_step
            steps.begin(trainer.global_step)
        if steps is not None:
            steps.work_batch(batch)  # a micro-batch: its tokens, samples and FLOP count

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.steps is not None:
            self.steps.backward_end()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.steps is not None and trainer.global_step > self._step_opened_at:  # the optimizer stepped
            self.steps.end()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.steps is not None:
            self.steps.end()  # batches of an epoch's end that never reached an optimizer step

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.close_steps()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.close_steps(ended=False)  # the run failed: RunSilent may fire for it


__all__ = ["ProfstreamCallback"]
