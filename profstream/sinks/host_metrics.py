"""The exporter's host and data-loader series and the advice (docs/metrics.md, "Host and
data loader"), per run, rank and host.

Each keeps the figures of the rank's latest step that had readings (a step shorter than the
reading interval has none: the series keep their values, as memory does; a rank with none
has no series, never a 0). ``profstream_advice{rule}`` is 1 for each rule of the advice of
the rank's latest step, and absent while that step has none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (metric, help, extra label, [(label value, ResourceFigures field)])
SERIES: tuple[tuple[str, str, str, tuple[tuple[str, str], ...]], ...] = (
    ("host_cpu_ratio", "the machine's CPU time by mode, share of all its CPUs, mean over the latest step with "
     "readings", "mode", (("user", "cpu_user"), ("system", "cpu_system"), ("iowait", "cpu_iowait"),
                          ("idle", "cpu_idle"))),
    ("process_cpu_ratio", "the training process's CPU, of one core, mean over that step", "", (("", "process_cpu"),)),
    ("process_rss_bytes", "the training process's resident memory, highest in that step", "", (("", "rss_bytes"),)),
    ("context_switches_per_second", "the machine's context switches per second, mean over that step", "",
     (("", "ctx_switches_per_s"),)),
    ("loader_workers", "data-loader worker processes read in the latest step with data-loader readings", "",
     (("", "workers"),)),
    ("loader_worker_cpu_ratio", "a data-loader worker's CPU, of one core, over that step's readings", "stat",
     (("mean", "worker_cpu_mean"), ("max", "worker_cpu_max"))),
    ("loader_worker_runnable_ratio", "share of the time a data-loader worker ran or waited to run (wanted a CPU) "
     "over that step's readings: near 1 computing, low waiting for reads", "stat",
     (("mean", "worker_runnable_mean"), ("max", "worker_runnable_max"))),
    ("loader_seconds_per_batch", "seconds a data-loader worker takes to make a batch, over that step's readings",
     "", (("", "worker_s_per_batch"),)),
)
# each worker's: (metric, help, WorkerFigures field), labelled worker
WORKER_SERIES: tuple[tuple[str, str, str], ...] = (
    ("loader_worker_seconds_per_batch", "seconds this data-loader worker takes to make a batch, over the latest "
     "step's readings with a batch of it counted", "s_per_batch"),
)
ADVICE_METRIC = "advice"


def fold_resources(kept: dict | None, figures: dict | None) -> dict | None:
    """The rank's latest resource figures: the step's where it has them."""
    if figures is None:
        return kept
    if kept is None or figures.get("workers") or not kept.get("workers"):
        return figures
    # a step with host readings alone keeps the workers' figures of the latest one with them
    return {**figures, **{k: v for k, v in kept.items() if k.startswith("worker") or k in ("workers", "per_worker")}}


def host_lines(prefix: str, ranks: list[tuple[Any, int, Any]], num: Callable[[float], str]) -> list[str]:
    """The text-format lines of the host series and the advice of ``ranks`` [(run, rank, r)]
    (``r.labels``; ``r.resources``: ResourceFigures or None; ``r.advice``: rule names)."""
    out: list[str] = []
    for metric, doc, label, fields in SERIES:
        full = prefix + metric
        out.append(f"# HELP {full} {doc}\n# TYPE {full} gauge\n")
        for _, _, r in ranks:
            if r.resources is None:
                continue
            for value_label, field in fields:
                value = r.resources.get(field)
                if value is None or (metric == "loader_workers" and not value):
                    continue
                extra = f',{label}="{value_label}"' if label else ""
                out.append(f"{full}{{{r.labels}{extra}}} {num(float(value))}\n")
    for metric, doc, field in WORKER_SERIES:
        full = prefix + metric
        out.append(f"# HELP {full} {doc}\n# TYPE {full} gauge\n")
        for _, _, r in ranks:
            for w in (r.resources or {}).get("per_worker", ()):
                if w[field] is not None:
                    out.append(f'{full}{{{r.labels},worker="{w["worker"]}"}} {num(float(w[field]))}\n')
    full = prefix + ADVICE_METRIC
    out.append(f"# HELP {full} 1 for each rule of the advice of the rank's latest step (rule: threads, transfer, "
               f"more_workers, input_io, tail_allreduce); absent while that step has none\n# TYPE {full} gauge\n")
    out.extend(f'{full}{{{r.labels},rule="{rule}"}} 1\n' for _, _, r in ranks for rule in r.advice)
    return out
