"""``profstream advise --run R``: what the processors advise for a live run, rank by rank,
read from the steps topic (the run's newest StepMetrics): each rule that spoke in the steps
read, how often, and its latest line with the figures it read and the profilers' rule it
follows; beside it the rank's latest host and data-loader figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from profstream.kafka.connection import Connection
from profstream.kafka.topics import Topics
from profstream.processors.runtime import run_partition
from profstream.schema.codec import DecodeError, decode, record_name

DEFAULT_STEPS = 200  # StepMetrics of each rank looked at, at most


@dataclass
class RankAdvice:
    rank: int
    steps: int = 0  # StepMetrics read
    last_step: int = -1
    starved: int = 0
    rules: dict[str, int] = field(default_factory=dict)  # rule -> steps that had it
    latest: dict[str, dict] = field(default_factory=dict)  # rule -> its latest line (with "step")
    resources: dict | None = None  # of the latest step with readings


def run_advice(conn: Connection | str, topics: Topics, run_id: str, steps: int = DEFAULT_STEPS,
               timeout: float = 10.0) -> dict[int, RankAdvice]:
    """{rank: RankAdvice} over the run's newest records on the steps topic (its ranks'
    StepMetrics share one partition): at most ``steps`` a rank, about. ``conn``: the
    connection (kafka/connection.py) or a bare bootstrap address."""
    from kafka import TopicPartition

    from profstream.kafka.clients import make_consumer

    conn = Connection.of(conn)
    consumer = make_consumer(conn, group_id=None)
    out: dict[int, RankAdvice] = {}
    try:
        parts = consumer.partitions_for_topic(topics.steps)
        if not parts:
            from profstream.kafka.diagnose import topic_denied

            raise RuntimeError(topic_denied(conn, topics.steps, "READ", hint="`profstream acl show --role sink` "
                                            "lists a reader's ACLs")
                               or f"topic {topics.steps} does not exist: start the processors (`profstream process`)")
        tp = TopicPartition(topics.steps, run_partition(run_id, len(parts)))
        consumer.assign([tp])
        end = consumer.end_offsets([tp])[tp]
        begin = consumer.beginning_offsets([tp])[tp]
        window = max(steps * 8, 2000)  # other runs share the partition: read back a few times as far
        consumer.seek(tp, max(begin, end - window))
        deadline = time.monotonic() + timeout
        while consumer.position(tp) < end and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200).values():
                for rec in batch:
                    _fold(out, rec.value, run_id)
    finally:
        consumer.close()
    return out


def _fold(out: dict[int, RankAdvice], value: bytes | None, run_id: str) -> None:
    if record_name(value) != "StepMetrics":
        return
    try:
        m = decode("StepMetrics", value)
    except DecodeError:
        return
    if m["run_id"] != run_id:
        return
    r = out.setdefault(m["rank"], RankAdvice(m["rank"]))
    r.steps += 1
    r.last_step = max(r.last_step, m["step"])
    r.starved += m["starved"]
    if m["resources"] is not None:
        r.resources = m["resources"]
    for a in m["advice"]:
        r.rules[a["rule"]] = r.rules.get(a["rule"], 0) + 1
        r.latest[a["rule"]] = {**a, "step": m["step"]}


def advice_lines(ranks: dict[int, RankAdvice]) -> list[str]:
    """The text the command prints."""
    lines: list[str] = []
    for rank in sorted(ranks):
        r = ranks[rank]
        lines.append(f"rank {rank}: {r.steps} steps read (latest {r.last_step}), {r.starved} starved")
        if not r.rules:
            lines.append("  no advice: no starved step or long tail the figures explain")
        for rule, n in sorted(r.rules.items(), key=lambda kv: -kv[1]):
            a = r.latest[rule]
            figures = ", ".join(f"{k} {v:.3g}" for k, v in sorted(a["figures"].items()))
            lines += [f"  {rule} ({n} steps, latest step {a['step']}): {a['text']}",
                      f"    figures: {figures}", f"    rule: {a['source']}"]
        res = r.resources
        if res is not None:
            lines.append(f"  host: CPU user {_pct(res, 'cpu_user')}, system {_pct(res, 'cpu_system')}, iowait "
                         f"{_pct(res, 'cpu_iowait')}; loader workers {res.get('workers') or 0}, busy "
                         f"{_pct(res, 'worker_runnable_mean')}, CPU {_pct(res, 'worker_cpu_mean')}")
    return lines


def _pct(figures: dict, key: str) -> str:
    value = figures.get(key)
    return "—" if value is None else f"{value:.0%}"
