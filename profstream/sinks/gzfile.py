"""Gzip files written atomically and durably, for the timeline sink's window and stacks files.

A reader (Perfetto, ``profstream report``, a copy job) sees either the previous file or the
whole new one: the data goes to a temporary name in the same directory, is flushed and
fsynced, renamed over the final name, and the directory is fsynced so that the rename
survives a crash too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

try:  # ISA-L deflate: same gzip format, ~3x the speed of zlib at level 1
    from isal import isal_zlib as _deflate
except ImportError:  # pragma: no cover - platforms without isal wheels
    import zlib as _deflate


def write_gzip_atomic(final: Path, chunks: Iterable[bytes], compresslevel: int = 1) -> Path:
    """Compress ``chunks`` into ``final`` (gzip, mode 0644), atomically; its directory must exist."""
    directory = final.parent
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            gz = _deflate.compressobj(compresslevel, _deflate.DEFLATED, 31)  # wbits 31: a gzip stream
            for chunk in chunks:
                f.write(gz.compress(chunk))
            f.write(gz.flush())
            f.flush()
            os.fchmod(f.fileno(), 0o644)
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final
