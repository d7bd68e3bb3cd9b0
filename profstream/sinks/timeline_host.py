"""The host and data-loader counter tracks of a step in the timeline files, at each reading:
``host CPU`` (``user %``, ``system %``, ``iowait %``), ``process`` (``CPU %`` of one core,
``RSS bytes``), ``loader worker N`` (``CPU %``, ``busy %``: the time it ran or waited to run)
and ``context switches`` (``per s``). A value the reading did not have is left out."""

from __future__ import annotations

import math

from profstream.processors.model import StepEvents
from profstream.schema.batch import MACHINE


def _known(args: dict) -> dict:
    return {k: v for k, v in args.items() if not (isinstance(v, float) and math.isnan(v))}


def host_counter_events(ev: StepEvents, pid: int) -> list[tuple[dict, int]]:
    """(counter event without ts, ts_ns) of every host and data-loader reading of ``ev``."""
    out: list[tuple[dict, int]] = []
    h = {c: v.tolist() for c, v in ev.host_samples.items()}
    for i, ts in enumerate(h["ts_ns"]):
        out.append(({"ph": "C", "name": "host CPU", "pid": pid, "args": _known(
            {"user %": h["cpu_user"][i] * 100, "system %": h["cpu_system"][i] * 100,
             "iowait %": h["cpu_iowait"][i] * 100})}, ts))
        args = _known({"CPU %": h["process_cpu"][i] * 100})
        if h["rss_bytes"][i] > 0:
            args["RSS bytes"] = h["rss_bytes"][i]
        out.append(({"ph": "C", "name": "process", "pid": pid, "args": args}, ts))
    lo = {c: v.tolist() for c, v in ev.loader_samples.items()}
    for i, ts in enumerate(lo["ts_ns"]):
        worker = lo["worker"][i]
        if worker == MACHINE:
            args = _known({"per s": lo["ctx_switches_per_s"][i]})
            name = "context switches"
        else:
            args = _known({"CPU %": lo["cpu"][i] * 100, "busy %": lo["runnable"][i] * 100})
            name = f"loader worker {worker}"
        if args:
            out.append(({"ph": "C", "name": name, "pid": pid, "args": args}, ts))
    return out
