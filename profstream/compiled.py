"""The compiled Monitor's extension (``producers/_native``, built by pip with the package)
for what runs outside the Monitor: the processors' reading, arithmetic and writing.

Beside the Monitor's hot path the extension holds the EventBatch body reader
(``csrc/reader.cpp``: ``BodyReader``, used by ``schema/sparse.py``; ``zigzag_varint``, the
longs of ``schema/writer.py``'s generated writers) and the figures' hottest arithmetic
(``csrc/kernels.cpp``: interval unions, sums by op type and kind, queue, memory and host
figures, the checks and splits of a batch's columns, and ``write_record``, the generated
writers' records written by a plan of their fields). Each caller keeps its Python or numpy
path, which gives the same values and bytes: it runs where the extension is not built,
where a kernel answers None (a column of another type), and everywhere with
``PROFSTREAM_PURE_PROCESSORS=1``.
"""

from __future__ import annotations

import os
from types import ModuleType

PURE_ENV = "PROFSTREAM_PURE_PROCESSORS"


def pure() -> bool:
    """Whether PROFSTREAM_PURE_PROCESSORS asks for the Python and numpy paths only."""
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def load() -> ModuleType | None:
    """The extension with the processors' parts, or None (not built, or ``pure()``)."""
    if pure():
        return None
    try:
        from profstream.producers import _native
    except ImportError:
        return None
    return _native if hasattr(_native, "kind_overlap") else None


NATIVE = load()  # tests set it to None for the Python and numpy paths
