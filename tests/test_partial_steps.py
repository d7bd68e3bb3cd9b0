"""Steps that lost events (issue 37): the producer's buffer was full, so some of a step's ops
or samples were dropped. The step is still emitted, from its mark, marked partial with what
it lost; the rolling figures leave it out; every family of drops is exported."""

from __future__ import annotations

from collections import namedtuple

import pytest

from profstream.kafka.topics import Topics
from profstream.processors.stream import STEPS, figures
from profstream.schema.codec import decode, encode_step_metrics
from profstream.simulate import SimConfig
from profstream.sinks.prometheus import ExporterState
from tests.helpers import simulated_messages

CFG = SimConfig(run_id="overflow", ranks=2, steps=120, ops_per_step=400, step_time_ms=100, seed=3)
Rec = namedtuple("Rec", "topic partition offset timestamp value")


@pytest.fixture(scope="module")
def overflowed():
    """The run's raw messages when each rank's sender gets a turn every 40 steps only (a
    1 MiB buffer holds ~6 steps of ops: the rest of each 40 are dropped), and its StepMetrics."""
    messages = simulated_messages(CFG, send_every=40, buffer_bytes="1MiB")
    steps = [decode("StepMetrics", f.value) for f in figures(messages) if f.kind == STEPS]
    return messages, steps


def test_every_step_is_emitted_and_one_that_lost_events_is_marked_with_what_it_lost(overflowed):
    from profstream.schema.batch import decode_batch

    messages, steps = overflowed
    assert sorted((m["rank"], m["step"]) for m in steps) == [(r, s) for r in range(2) for s in range(CFG.steps)]
    partial = [m for m in steps if m["dropped_ops"] or m["dropped_samples"]]
    assert len(partial) > CFG.steps  # most of them, on both ranks
    for m in steps:  # what arrived and what the mark says was lost make up the step
        assert m["op_count"] + m["dropped_ops"] == CFG.ops_per_step, m
    headers = [decode_batch(x.value) for x in messages]
    for rank in range(CFG.ranks):
        dropped = sum(b.dropped_ops for b in headers if b.rank == rank)
        mine = [m for m in steps if m["rank"] == rank]
        assert sum(m["dropped_ops"] for m in mine) == dropped > 0  # every drop is some step's
        assert sum(m["dropped_samples"] for m in mine) == sum(b.dropped_samples for b in headers if b.rank == rank)


def test_the_rolling_figures_are_over_whole_steps_only(overflowed):
    _messages, steps = overflowed
    for rank in range(CFG.ranks):
        whole = 0
        for m in sorted((m for m in steps if m["rank"] == rank), key=lambda m: m["step"]):
            whole += not (m["dropped_ops"] or m["dropped_samples"])
            assert m["rolling"]["window"] == min(whole, 100), m["step"]
            if m["rolling"]["mean_utilization"] is not None:  # the mean of whole steps' (utilization 0 would pull it down)
                assert m["rolling"]["mean_utilization"] > 0.5


def test_the_exporter_exports_every_drop_and_keeps_the_last_whole_steps_gauges(overflowed):
    _messages, steps = overflowed
    topics = Topics("t")
    state = ExporterState(topics)
    ordered = sorted(steps, key=lambda m: (m["step"], m["rank"]))
    last_whole = {}
    for i, m in enumerate(ordered):
        state.handle([Rec(topics.steps, 0, i, None, encode_step_metrics(m))])
        if not m["dropped_ops"]:
            last_whole[m["rank"]] = m["utilization"]
    text = state.exposition().decode()
    for rank in range(CFG.ranks):
        mine = [m for m in steps if m["rank"] == rank]
        last = max(mine, key=lambda m: m["step"])
        labels = f'run="overflow",rank="{rank}",host="{last["host"]}"'
        partial = sum(bool(m["dropped_ops"] or m["dropped_samples"]) for m in mine)
        assert f"profstream_partial_steps_total{{{labels}}} {partial}\n" in text
        for family in ("ops", "samples"):
            lost = sum(m[f"dropped_{family}"] for m in mine)
            assert f'profstream_step_dropped_events_total{{{labels},family="{family}"}} {lost}\n' in text
        assert f"profstream_lost_steps_total{{{labels}}} 0\n" in text
        assert f"profstream_device_utilization_ratio{{{labels}}} {last_whole[rank]!r}\n" in text
    # steps whose marks never came (dropped, or lost with their batch) are counted lost
    last = max((m for m in steps if m["rank"] == 0), key=lambda m: m["step"])
    state.handle([Rec(topics.steps, 0, len(ordered), None, encode_step_metrics({**last, "step": last["step"] + 5}))])
    labels = f'run="overflow",rank="0",host="{last["host"]}"'
    assert f"profstream_lost_steps_total{{{labels}}} 4\n" in state.exposition().decode()
