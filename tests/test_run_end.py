"""A rank that ends normally says so: the Monitor's close sends an end mark, the processors
answer with a RankEnd after the rank's last StepMetrics, and the exporter's
profstream_run_ended keeps RunSilent quiet for a run whose every rank ended. No Kafka."""

from __future__ import annotations

import time
from collections import namedtuple

import pytest

from profstream.kafka.topics import Topics
from profstream.processors.stream import ENDS, STEPS, figures
from profstream.producers.monitor import Monitor
from profstream.producers.sender import Sender
from profstream.schema.batch import END_MARK, decode_batch
from profstream.schema.codec import decode, encode
from profstream.simulate import SimConfig
from profstream.sinks.prometheus import ExporterState
from tests.helpers import IdleSender, simulated_messages
from tests.test_prometheus_sink import Scrape

CFG = SimConfig(run_id="ends", ranks=3, steps=6, ops_per_step=20, seed=2)
Rec = namedtuple("Rec", "topic partition offset timestamp value")


def _outputs(close: bool) -> list:
    return [(f.kind, decode("RankEnd" if f.kind == ENDS else "StepMetrics", f.value))
            for f in figures(simulated_messages(CFG, close=close)) if f.kind in (STEPS, ENDS)]


def test_a_rank_whose_monitor_closed_ends_after_its_last_step_and_one_killed_does_not():
    out = _outputs(close=True)
    ends = [m for kind, m in out if kind == ENDS]
    assert sorted(e["rank"] for e in ends) == [0, 1, 2]
    for e in ends:
        assert e["last_step"] == CFG.steps - 1 and e["world_size"] == CFG.ranks and e["ended_ns"] > 0
        mine = [i for i, (kind, m) in enumerate(out) if m["rank"] == e["rank"]]
        assert out[mine[-1]] == (ENDS, e)  # after every StepMetrics of its rank
    assert len(out) == CFG.ranks * (CFG.steps + 1)
    assert [m for kind, m in _outputs(close=False) if kind == ENDS] == []  # a killed rank never says so


def _mark_rows(monitor: Monitor) -> list[int]:
    sender = Sender(monitor)
    steps = []
    while sender._build():
        steps += decode_batch(sender._pending.popleft()[0]).steps["step"].tolist()
    return steps


@pytest.mark.parametrize("native", [False, True])
def test_the_monitor_sends_its_end_mark_on_close_and_not_when_the_run_failed(native):
    def monitor() -> Monitor:
        return Monitor(run_id="m", bootstrap="127.0.0.1:1", sender_factory=IdleSender, control=False,
                       host_sample_interval_s=0, native=native)

    if native:
        pytest.importorskip("profstream.producers.native_sender")
    ok = monitor()
    with ok.step():
        pass
    ok.close()
    failed = monitor()
    with pytest.raises(RuntimeError), failed:
        with failed.step():
            raise RuntimeError("the training loop failed")
    if not native:  # the native Monitor's batches are built natively: test_native compares them with these
        assert _mark_rows(ok) == [0, END_MARK]
        assert _mark_rows(failed) == [0]
    else:
        assert ok.buffer.buffered_samples == 2 and failed.buffer.buffered_samples == 1


def test_the_exporter_says_a_run_ended_once_every_rank_did_and_again_not_when_a_rank_steps_on():
    topics = Topics("ends")
    state = ExporterState(topics)
    now_ms = time.time_ns() // 10**6
    recs = [m for _, m in _outputs(close=True)]
    steps = [m for m in recs if "step" in m]
    ends = [m for m in recs if "step" not in m]

    def feed(*records: dict) -> Scrape:
        state.handle([Rec(topics.steps, 0, i, now_ms, encode("RankEnd" if "step" not in m else "StepMetrics", m))
                      for i, m in enumerate(records)])
        return Scrape(state.exposition().decode())

    assert feed(*steps)("profstream_run_ended", run=CFG.run_id) == 0
    assert feed(*ends[:2])("profstream_run_ended", run=CFG.run_id) == 0  # one rank has not said it ended
    assert feed(ends[2])("profstream_run_ended", run=CFG.run_id) == 1
    assert feed({**steps[-1], "step": CFG.steps})("profstream_run_ended", run=CFG.run_id) == 0  # it runs again


def test_a_rank_ended_by_sigterm_says_so_in_its_rank_end_and_on_the_exporter():
    """The end mark of a Monitor told to end by SIGTERM carries the signal: the RankEnd says
    it (v2; a rank that closed normally keeps v1, which older consumers read), and the
    exporter shows the rank ended (RankSilent stays quiet) and on which signal."""
    import signal

    from profstream.schema.codec import VERSIONS

    ends = [f.value for f in figures(simulated_messages(CFG, end_signal=signal.SIGTERM)) if f.kind == ENDS]
    assert [decode("RankEnd", v)["end_signal"] for v in ends] == [signal.SIGTERM] * CFG.ranks
    assert {v[:10] for v in ends} == {VERSIONS[("RankEnd", 2)].header}
    closed = [f.value for f in figures(simulated_messages(CFG)) if f.kind == ENDS]
    assert {v[:10] for v in closed} == {VERSIONS[("RankEnd", 1)].header}
    assert [decode("RankEnd", v)["end_signal"] for v in closed] == [0] * CFG.ranks
    topics = Topics("ends")
    state = ExporterState(topics)
    now_ms = time.time_ns() // 10**6
    state.handle([Rec(topics.steps, 0, i, now_ms, f.value)
                  for i, f in enumerate(figures(simulated_messages(CFG, end_signal=signal.SIGTERM)))
                  if f.kind in (STEPS, ENDS)])
    scrape = Scrape(state.exposition().decode())
    for rank in range(CFG.ranks):
        assert scrape("profstream_rank_ended", run=CFG.run_id, rank=str(rank)) == 1
        assert scrape("profstream_rank_end_signal", run=CFG.run_id, rank=str(rank)) == signal.SIGTERM
    assert scrape("profstream_run_ended", run=CFG.run_id) == 1
