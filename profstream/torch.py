"""PyTorch integration: ``import profstream.torch as pst; pst.instrument(model, optimizer, loader)``.

See docs/torch.md. Needs the ``torch`` extra (``pip install profstream[torch]``).
"""

from profstream.integrations.torch import TORCH_OPTIONS, TorchInstrumentation, instrument

__all__ = ["TORCH_OPTIONS", "TorchInstrumentation", "instrument"]
