"""``thread_stacks``: every Python thread's stack in this process, bounded for one record.

The control reader (``control.py``) calls it on its own thread when a stacks request
comes (``profstream stacks``): ``sys._current_frames`` gives each thread's innermost frame
whatever that thread is doing, so the training thread is seen too while it waits inside a
C call that released the GIL (a collective, a sleep, a read). A thread that holds the GIL
and never lets it go stops every thread of the process, the reader among them: no answer
comes from that rank, and the command says so.

The answer is bounded (``MAX_THREADS`` threads, ``MAX_FRAMES`` frames each, the innermost
kept, strings cut at ``MAX_TEXT``, and ``MAX_BYTES`` in all): what is left out is counted
in the record (``frames_omitted``, ``threads_omitted``), never silently dropped.
"""

from __future__ import annotations

import linecache
import sys
import threading

MAX_THREADS = 64
MAX_FRAMES = 48  # per thread, the innermost: where the thread is
MAX_TEXT = 200  # characters of a file name, function or source line
MAX_BYTES = 256 * 1024  # about, of all threads' strings: well under a Kafka message's 1 MiB
OWN_PREFIX = "profstream-"  # the names of profstream's own threads (the Monitor's sender and reader...)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


def _frames(frame, limit: int) -> tuple[list[dict], int]:
    """The frames of one thread, outermost first, the ``limit`` innermost; and how many
    outer ones were left out."""
    inner_first = []
    while frame is not None:
        inner_first.append(frame)
        frame = frame.f_back
    kept = inner_first[:limit]
    out = []
    for f in reversed(kept):
        code = f.f_code
        line = f.f_lineno
        source = linecache.getline(code.co_filename, line, f.f_globals).strip() if line is not None else ""
        out.append({"file": _cut(code.co_filename), "line": line, "function": _cut(code.co_name),
                    "code": _cut(source)})
    return out, len(inner_first) - len(kept)


def _size(threads: list[dict]) -> int:
    return sum(len(t["name"]) + sum(len(f["file"]) + len(f["function"]) + len(f["code"]) + 8 for f in t["frames"])
               for t in threads)


def thread_stacks(max_threads: int = MAX_THREADS, max_frames: int = MAX_FRAMES,
                  max_bytes: int = MAX_BYTES) -> tuple[list[dict], int]:
    """(ThreadStack records of this process's threads, the main thread first, then by
    name; threads left out). Called on any thread but the one whose stack matters most."""
    frames = sys._current_frames()
    known = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    order = sorted(frames, key=lambda ident: (ident != main, known[ident].name if ident in known else "~",
                                              ident))
    omitted = max(0, len(order) - max_threads)
    order = order[:max_threads]
    limit = max_frames
    while True:
        threads = []
        for ident in order:
            thread = known.get(ident)
            name = thread.name if thread is not None else f"thread {ident}"
            stack, left_out = _frames(frames[ident], limit)
            threads.append({"name": _cut(name), "ident": ident,
                            "native_id": getattr(thread, "native_id", None), "daemon":
                            thread.daemon if thread is not None else None, "main": ident == main,
                            "own": name.startswith(OWN_PREFIX), "frames": stack, "frames_omitted": left_out})
        if _size(threads) <= max_bytes or limit <= 4:
            break
        limit //= 2  # a few threads with deep stacks: fewer frames of each, the innermost still
    del frames  # frames hold their locals alive: let them go at once
    return threads, omitted
