"""What ends a processor process: Ctrl-C (SIGINT) and a supervisor's SIGTERM.

Either one asks its loops to stop: each commits the transaction it has open, closes its
clients within their deadlines (``checkpoint.TransactionalLoop.run``) and the process exits
0; what it had not committed is redone by the processor that takes its partitions over. A
second signal while it stops ends the process at once (its open transaction is aborted
by the next owner's ``init_transactions``: exactly once all the same).

SIGINT is handled even where the process was started with it ignored, as a background
job of a script is (``profstream process &``): ``kill -INT`` then stopped nothing, and a
benchmark's Ctrl-C waited 15 s and killed every processor at 16,384 ranks (docs/benchmarks.md).
SIGTERM had Python's default and ended the process at once, without its last commit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[], None], say: Callable[[str], None]) -> Iterator[None]:
    """For the block, the first SIGINT or SIGTERM calls ``say`` (one line) and ``stop``; a
    second one exits at once (status 128 + its number). Nothing off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    told: list[int] = []

    def handle(signum: int, frame: object) -> None:
        if told:
            os._exit(128 + signum)  # asked twice: no more waiting on Kafka
        told.append(signum)
        say(f"{signal.Signals(signum).name}: stopping (committing what is open; a second one ends at once)")
        stop()

    previous = {s: signal.signal(s, handle) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
