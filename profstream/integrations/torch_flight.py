"""Always-on collective records of the torch producer, from torch's Flight Recorder.

torch (2.15) records every collective of every process group in a ring buffer of its own,
the Flight Recorder: gloo records into it itself, NCCL too, and c10d's FlightRecorderHook
covers the other backends (``TORCH_FR_BUFFER_SIZE`` entries, 2000 by default, 0 turns it
off). An entry is written in C++ on the thread that issues the call, before it is queued:
the default group's and every sub-group's calls, DDP's reducer buckets and FSDP's gathers
and reduce-scatters (both go through the process group), user calls. Each entry names the
group, the call's sequence number in it, the op, input and output sizes and dtypes, and
when the call was issued; NCCL with ``TORCH_NCCL_ENABLE_TIMING=1`` also when its watchdog
saw it complete; gloo records no end (docs/torch.md).

``FlightReader``, a thread of the torch producer, reads the recorder every
``collective_interval_s`` (the training thread pays nothing beyond torch's own entry) and
hands each completed call to ``Monitor.collective``, in the step that was open when it was
issued, its group named with its members (``schema/groups.py``). Calls still running are held
until they complete; the oldest of them is the rank's open collective (``open_call``),
which RankProgress carries. The reader holds the Monitor's watermark (``hold_watermark``):
a step is complete once the next one began before the reader's last read and no call
issued before that is still running, so that no call arrives after its step closed.
"""

from __future__ import annotations

import logging
import math
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from profstream.integrations.torch_collectives import ITEM_BYTES
from profstream.integrations.torch_collectives import CollectiveRow as Call  # one completed call
from profstream.schema.groups import group_label

log = logging.getLogger("profstream.torch")

SOURCE = "collectives"  # the watermark this reader holds (Monitor.hold_watermark)
FINAL_TRIES, FINAL_WAIT_S = 10, 0.05  # at stop: reads while a call is still open (0.5 s at most)


class OpenCall(NamedTuple):
    """The collective this rank sits in: the oldest issued and not completed."""

    collective: str
    group: str
    seq: int
    since_ns: int


def _bytes(sizes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> tuple[int, str]:
    total, first = 0, ""
    for shape, dt in zip(sizes, dtypes):
        item = ITEM_BYTES.get(dt.lower())
        if item is None:
            return -1, dt
        total += item * math.prod(shape)
        first = first or dt
    return (total, first) if first else (-1, "")


def entry_call(entry: dict, label: str, group_size: int) -> Call:
    """A Flight Recorder entry (completed) as a Call."""
    in_bytes, dtype = _bytes(entry["input_sizes"], entry["input_dtypes"])
    out_bytes, _ = _bytes(entry["output_sizes"], entry["output_dtypes"])
    start = int(entry["time_created_ns"])
    end = int(entry.get("time_discovered_completed_ns") or 0)
    return Call(entry["profiling_name"].rpartition(":")[2], label, int(entry["collective_seq_id"]), start,
                end - start if end > start else -1, group_size, in_bytes, out_bytes, dtype)


class Groups:
    """Process group name -> (label, size), from torch.distributed's own tables: learnt at
    each read while torch.distributed is initialized (and before it forgets its groups:
    ``destroy_process_group`` makes the reader read first), kept after."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[str, int]] = {}

    def learn(self) -> None:
        """Every group torch.distributed knows now."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        world = dist.get_world_size()  # the default group's: every rank of the run
        for pg, pg_name in list(dist.distributed_c10d._world.pg_names.items()):
            name = str(pg_name)
            if name not in self._known:
                ranks = dist.get_process_group_ranks(pg)
                self._known[name] = (group_label(name, ranks, world), len(ranks))

    def of(self, name: str) -> tuple[str, int]:
        found = self._known.get(name)
        if found is None:
            self.learn()
            found = self._known.get(name, (name, 0))  # unknown (made and gone between two reads): unmatched
        return found


class FlightReader(threading.Thread):
    """Reads torch's Flight Recorder every ``interval_s`` and records each completed call
    with ``monitor.collective``; holds the Monitor's watermark until a step's calls are in."""

    def __init__(self, monitor: Any, interval_s: float = 1.0,
                 dump: Callable[[], bytes] | None = None) -> None:
        super().__init__(name=f"profstream-collectives-{monitor.run_id}-{monitor.rank}", daemon=True)
        self.monitor = monitor
        self.interval_s = interval_s
        self._dump = dump
        self._stopping = threading.Event()
        self._done: set[int] = set()  # record ids handed over, above _floor
        self._floor = -1  # every record id <= it handed over (or lost)
        self._groups = Groups()
        self.open_call: OpenCall | None = None  # read by the control thread (RankProgress)
        self.calls = 0
        self.lost = 0  # calls overwritten in the ring before they were read
        self.reads = 0
        self.read_ns = 0  # time spent reading and converting, all reads
        self.failed: str | None = None
        monitor.hold_watermark(SOURCE)

    def run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            self._read_safely()
        # the last calls: torch marks a call completed a moment after it returned, so a call
        # still open is read again a few times before the last read lets the watermark go
        for _ in range(FINAL_TRIES):
            self._read_safely()
            if self.open_call is None or self.failed is not None:
                break
            time.sleep(FINAL_WAIT_S)
        self._read_safely(final=True)

    def stop(self, timeout: float) -> None:
        """Read once more (the last calls) and end; the watermark is let go."""
        self._stopping.set()
        self.join(timeout)

    def _read_safely(self, final: bool = False) -> None:
        if self.failed is not None:
            return
        try:
            self.read(final)
        except Exception as e:  # an internal error ends the always-on records, not the run
            self.failed = repr(e)
            log.exception("profstream: reading torch's Flight Recorder failed; collectives are no longer recorded "
                          "outside op capture")
            self.monitor.release_watermark(SOURCE)
        if final:
            self.monitor.release_watermark(SOURCE)

    def read(self, final: bool = False) -> int:
        """One read: the completed calls not handed over yet go to the Monitor; returns how many."""
        t0 = time.perf_counter_ns()
        now_ns = time.time_ns()
        self._groups.learn()
        entries, status = self._entries()
        first_open: int | None = None  # when the oldest call still running was issued
        open_call = None
        handed = 0
        mon = self.monitor
        ready = []  # the completed calls not handed over yet
        for e in entries:
            rid = e["record_id"]
            if rid <= self._floor or rid in self._done or e.get("is_p2p"):
                continue
            label, size = self._groups.of(str(e["process_group"][0]))
            if not _completed(e, status):
                if first_open is None or e["time_created_ns"] < first_open:
                    first_open = e["time_created_ns"]
                    open_call = OpenCall(e["profiling_name"].rpartition(":")[2], label, int(e["collective_seq_id"]),
                                         int(e["time_created_ns"]))
                continue
            ready.append(entry_call(e, label, size))
            self._done.add(rid)
        for call, step in zip(ready, mon.steps_at([c.start_ns for c in ready])):
            if step is not None:  # issued before the first step: in no step
                mon.collective(*call, step=step)
                handed += 1
        if entries:
            oldest = entries[0]["record_id"]
            if oldest > self._floor + 1 and self.reads:
                self.lost += oldest - self._floor - 1 - sum(1 for r in self._done if r < oldest)
            self._floor = max(self._floor, oldest - 1)
            while self._floor + 1 in self._done:  # keep the set small: record ids are handed in order mostly
                self._floor += 1
                self._done.discard(self._floor)
            self._done = {r for r in self._done if r > self._floor}
        self.open_call = open_call
        self.calls += handed
        self.reads += 1
        cutoff = now_ns if first_open is None else min(now_ns, first_open)
        through = mon.complete_before(cutoff) if not final else None
        if final:
            mon.release_watermark(SOURCE)
        elif through is not None:
            mon.complete_through(through, source=SOURCE)
        self.read_ns += time.perf_counter_ns() - t0
        return handed

    def _entries(self) -> tuple[list[dict], dict]:
        dump = self._dump
        if dump is None:
            from torch._C._distributed_c10d import _dump_fr_trace

            dump = self._dump = lambda: _dump_fr_trace(includeStackTraces=False)
        trace = pickle.loads(dump())
        entries = trace.get("entries", [])
        entries.sort(key=lambda e: e["record_id"])
        return entries, trace.get("pg_status", {})

    def learn_groups(self) -> None:
        """Learn the groups torch.distributed knows now (on the caller's thread)."""
        try:
            self._groups.learn()
        except Exception:  # noqa: BLE001 - on the training thread: never raise
            log.debug("profstream: reading the process groups failed", exc_info=True)

    def stats(self) -> dict[str, Any]:
        return {"collectives_recorded": self.calls, "collectives_lost": self.lost,
                "collective_reads": self.reads, "collective_read_ms": self.read_ns / 1e6}


def _completed(entry: dict, status: dict) -> bool:
    """Whether a call has completed: retired, or at or below its group's last completed one."""
    if entry.get("retired") or entry.get("state") == "completed":
        return True
    done = status.get(str(entry.get("pg_id")), {}).get("last_completed_collective", -1)
    return int(done) >= int(entry["collective_seq_id"])


def start_flight_reader(monitor: Any, interval_s: float) -> FlightReader | None:
    """The reader of ``monitor``'s process, started; None where torch.distributed is absent."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available():
        return None
    reader = FlightReader(monitor, interval_s)
    reader.start()
    _read_before_destroy(dist)
    return reader


def _read_before_destroy(dist: Any) -> None:
    """``destroy_process_group`` first lets the live readers learn the groups it ends (their
    members are asked of torch.distributed, which forgets them); never raises into the caller."""
    destroy = dist.destroy_process_group
    if getattr(destroy, "_profstream", False):
        return

    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            from profstream.producers.monitor import live_monitors

            for mon in live_monitors():
                reader = getattr(mon, "collective_reader", None)
                if reader is not None:
                    reader.learn_groups()
        except Exception:  # noqa: BLE001 - the user's call goes on whatever happens here
            log.debug("profstream: learning the process groups before they are destroyed failed", exc_info=True)
        return destroy(*args, **kwargs)

    destroy_process_group._profstream = True  # type: ignore[attr-defined]
    destroy_process_group.__wrapped__ = destroy  # type: ignore[attr-defined]
    destroy_process_group.__doc__ = destroy.__doc__
    dist.destroy_process_group = destroy_process_group


__all__ = ["Call", "FlightReader", "OpenCall", "entry_call", "start_flight_reader"]
