"""What the Monitors of a process do when it is told to end: SIGTERM.

torchrun, Slurm and Kubernetes send SIGTERM and wait (30 s by default) before SIGKILL;
Python's default is to die at once, without ``atexit``, and the Monitors' last steps went
with it, counted nowhere. The first Monitor made on the main thread puts a handler in front
of the program's own, chained to it, never replacing it (a handler the program installs
later replaces ours, as it would replace the default; an ignored SIGTERM stays ignored):

- every live Monitor notes the signal, so that its end mark says the rank ended on it
  (EventBatch v7 ``steps.end_signal``; the processors' RankEnd says why);
- if the program's handler is the default one (die), the integrations' exit hooks run
  (``at_signal``) and every Monitor is closed, its end mark sent, within
  ``SIGNAL_FLUSH_S`` in all; then the process dies of the signal as it would have (status
  128 + 15);
- if the program has a handler of its own, every Monitor flushes (within ``SIGNAL_FLUSH_S``)
  and that handler runs: the program decides whether and when it ends, and the Monitors
  close at its exit as usual.

A second SIGTERM while the first is handled goes straight to the program's handler.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("profstream.monitor")

SIGNAL_FLUSH_S = 5.0  # the most a SIGTERM waits for the Monitors before the program's handler
WATCHED = (signal.SIGTERM,)

_previous: dict[int, Any] = {}  # signal -> the handler ours stands in front of
_exit_hooks: list[Callable[[float], None]] = []
_live: Callable[[], list] = list  # the Monitors not closed yet (monitor.live_monitors)
_pid = 0  # the process whose Monitors these are (a forked child, a DataLoader worker, has copies)
_busy = False


def watch(live: Callable[[], list]) -> None:
    """Put the handler in front of the program's for each watched signal, where it is not
    there already, for the Monitors ``live()`` returns; nothing off the main thread (Python
    runs handlers there only) or for a signal the program ignores."""
    global _live, _pid
    _live, _pid = live, os.getpid()
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in WATCHED:
        current = signal.getsignal(signum)
        if current is _on_signal or current in (signal.SIG_IGN, None):  # None: a handler not set from Python
            continue
        _previous[signum] = current
        signal.signal(signum, _on_signal)


def at_signal(hook: Callable[[float], None]) -> None:
    """``hook(timeout)`` runs before the Monitors close when a watched signal ends the process
    (an integration's exit hook: its last step and captured ops first)."""
    _exit_hooks.append(hook)


def _on_signal(signum: int, frame: Any) -> None:
    global _busy
    previous = _previous.get(signum, signal.SIG_DFL)
    dying = not callable(previous)
    if not _busy and os.getpid() == _pid:  # in a forked child the copies send nothing: just chain
        _busy = True
        try:
            _wind_down(signum, dying)
        except Exception:  # profiling must not stand between the program and its signal
            log.exception("profstream: handling %s failed", signal.Signals(signum).name)
        finally:
            _busy = False
    if not dying:
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # die of it, as the program would have
    os.kill(os.getpid(), signum)


def _wind_down(signum: int, dying: bool) -> None:
    deadline = time.monotonic() + SIGNAL_FLUSH_S

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    monitors = _live()
    for m in monitors:
        m.ending_on(signum)
    if not monitors and not (dying and _exit_hooks):
        return
    log.warning("profstream: %s: %s %d Monitor(s) (at most %g s), then %s", signal.Signals(signum).name,
                "closing" if dying else "flushing", len(monitors), SIGNAL_FLUSH_S,
                "ending as the program would" if dying else "the program's own handler")
    if dying:
        for hook in list(_exit_hooks):
            hook(left())
        for m in _live():
            m.close(timeout=left())
    else:
        for m in monitors:
            m.flush(left())
