"""librdkafka calls under a deadline of our own.

Some of librdkafka's blocking calls do not honour their timeout: after a broker restart
``send_offsets_to_transaction`` can wait for a coordinator that it never looks up again
(librdkafka issues 5456 and 5511), and the caller's thread is then gone for good. The
processors run such calls through a :class:`DeadlineCaller`: the call runs on a daemon
thread, the caller waits at most its deadline, and a call that outlives it is abandoned
with its client (the caller makes a new one) and reported as :class:`CallTimeout`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_PENDING = object()


class CallTimeout(Exception):
    """A Kafka client call did not return within its deadline; the client that made it
    must not be used again."""


class DeadlineCaller:
    """Runs blocking client calls one at a time on a worker thread, each with a deadline."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue | None = None
        self.abandoned = 0  # worker threads left behind in a call that never returned

    def __call__(self, what: str, timeout: float, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or :class:`CallTimeout` after ``timeout`` s (+1 s of slack for the
        client's own timeout to fire first). Exceptions of ``fn`` are re-raised here."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_work, args=(self._jobs,), name=f"{self._name}-calls", daemon=True).start()
        box: list[Any] = [_PENDING]
        done = threading.Event()
        self._jobs.put((fn, args, box, done))
        if not done.wait(timeout + 1.0):
            self._jobs.put(None)  # the stuck worker ends if its call ever returns
            self._jobs = None
            self.abandoned += 1
            raise CallTimeout(f"{what} did not return within {timeout:g} s")
        result = box[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None


def _work(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, args, box, done = job
        try:
            box[0] = fn(*args)
        except BaseException as e:  # handed to the caller's thread, which re-raises it
            box[0] = e
        done.set()
