"""MindSpore integration (extra ``mindspore``): ``ProfstreamCallback`` for ``Model.train``.

    from profstream.mindspore import ProfstreamCallback
    model.train(epochs, dataset, callbacks=[ProfstreamCallback(run_id="my-run")])

See docs/mindspore.md. Importing ``profstream`` itself never needs MindSpore.
"""

from profstream.integrations.mindspore import DEVICE_QUEUE, ProfstreamCallback

__all__ = ["DEVICE_QUEUE", "ProfstreamCallback"]
