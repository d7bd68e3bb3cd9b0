"""The processors' compiled parts, where the compiled Monitor's extension is built.

``producers/_native`` also holds the processors' hottest arithmetic (``csrc/kernels.cpp``:
``kind_overlap``, the interval unions of utilization; ``sums_by_code``, the op-type and
device-kind sums) and the EventBatch body reader (``csrc/reader.cpp``, used by
``schema/sparse.py``). Each figure module keeps its numpy path, which gives the same
figures to the bit: it runs where the extension is not built, where a kernel answers None
(a column of another type), and everywhere with ``PROFSTREAM_PURE_PROCESSORS=1``.
"""

from __future__ import annotations

import os
from types import ModuleType

PURE_ENV = "PROFSTREAM_PURE_PROCESSORS"


def pure() -> bool:
    """Whether PROFSTREAM_PURE_PROCESSORS asks for the numpy / Python paths only."""
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def load() -> ModuleType | None:
    """The extension with the processors' kernels, or None (not built, or ``pure()``)."""
    if pure():
        return None
    try:
        from profstream.producers import _native
    except ImportError:
        return None
    return _native if hasattr(_native, "kind_overlap") else None


NATIVE = load()  # tests set it to None for the numpy path
