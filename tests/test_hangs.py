"""Hangs: RankProgress records through the step stage to the run stage, and its TrainingHang
alerts (processors/hangs.py); the Monitor's side is under test in test_hang_e2e.py."""

from __future__ import annotations

from collections import namedtuple

from profstream.kafka.topics import Topics
from profstream.processors.hangs import HANG_ALERT
from profstream.processors.health import StageCounts
from profstream.processors.runtime import RunStage, StepStage, run_partition
from profstream.processors.stream import StepFigures
from profstream.schema.codec import decode, decode_any, encode, is_rank_progress

Rec = namedtuple("Rec", "topic partition offset key value")
S = 1_000_000_000
T0 = 1_700_000_000 * S  # the producers' clock at the start of step 7
HOSTS = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}


def progress(rank: int, step: int | None, started_ns: int | None, ts_ns: int, last_step: int | None = None,
             run_id: str = "hang-run") -> bytes:
    return encode("RankProgress", {"run_id": run_id, "rank": rank, "world_size": 4, "host": HOSTS[rank],
                                   "step": step, "step_started_ns": started_ns, "last_step": last_step,
                                   "ts_ns": ts_ns, "interval_ms": 5000})


class Run:
    """A RunStage fed RankProgress records, with a clock of its own (seconds)."""

    def __init__(self, hang_after_s: float = 60.0) -> None:
        self.topics = Topics("hangs")
        self.stage = RunStage(self.topics, StageCounts(keep_step_ends=False), hang_after_s=hang_after_s)
        self.offset = 0
        self.alerts: list[dict] = []

    def feed(self, now: float, *values: bytes) -> list[dict]:
        for v in values:
            self.stage.fold(Rec(self.topics.steps, 0, self.offset, None, v), now)
            self.offset += 1
        new = [decode("Alert", o.value) for o in self.stage.ready(now) if o.topic == self.topics.alerts]
        self.alerts += new
        return new

    def tick(self, t: float, where: dict[int, tuple[int | None, int | None]]) -> list[dict]:
        """Every rank in ``where`` reports at t seconds after T0 (processor clock t too)."""
        ts = T0 + int(t * S)
        return self.feed(t, *(progress(r, step, None if step is None else T0 + int(since * S), ts)
                              for r, (step, since) in where.items()))


def test_ranks_blocked_in_a_collective_fire_one_hang_naming_them_and_the_rank_elsewhere():
    run = Run()
    # ranks 0, 1, 3 entered step 7 at T0 and wait in its all_reduce; rank 2 is in step 6 since
    # 5 s after T0 (its step 6 ran late) and sleeps in user code there
    where = {0: (7, 0.0), 1: (7, 0.0), 2: (6, 5.0), 3: (7, 0.0)}
    for t in range(0, 61, 5):  # 60 s in step 7: not past the threshold yet
        assert run.tick(t, where) == []
    fired = run.tick(65, where)
    assert len(fired) == 1
    alert = fired[0]
    assert alert["name"] == HANG_ALERT and alert["state"] == "firing"
    assert alert["run_id"] == "hang-run" and alert["step"] == 7 and alert["rank"] is None
    assert alert["ts_ns"] == T0 + 65 * S  # the producers' clock, not the processor's
    assert "ranks 0, 1, 3 (hosts node-a, node-b) in step 7 for 65 s (past 60 s)" in alert["summary"]
    assert "rank 2 (host node-b) in step 6 for 60 s" in alert["summary"]
    ev = alert["evidence"]
    assert ev["rank.0.in_step_s"] == ev["rank.3.in_step_s"] == 65.0 and ev["rank.2.in_step_s"] == 60.0
    assert ev["rank.2.step"] == 6.0 and ev["ranks_in_step"] == 3.0 and ev["ranks_elsewhere"] == 1.0
    # the hang goes on, rank 2 past the threshold in its step too: nothing more, however many loop turns
    for t in range(70, 200, 5):
        assert run.tick(t, where) == []
    # every rank moves on: one resolved
    moved = {r: (8, 200.0) for r in range(4)}
    resolved = run.tick(200, moved)
    assert [(a["name"], a["state"], a["step"]) for a in resolved] == [(HANG_ALERT, "resolved", 7)]
    assert run.tick(205, moved) == [] and len(run.alerts) == 2


def test_a_rank_hung_in_the_step_before_is_named_with_the_ranks_waiting_for_it():
    run = Run()
    # rank 2 hangs in step 6's tail, begun 1 s before the others entered step 7 and waited
    where = {0: (7, 0.0), 1: (7, 0.0), 2: (6, -1.0), 3: (7, 0.0)}
    for t in range(0, 56, 5):
        assert run.tick(t, where) == []
    fired = run.tick(60, where)  # rank 2: 61 s in step 6; the others 60 s in step 7
    assert [(a["state"], a["step"]) for a in fired] == [("firing", 6)]
    summary = fired[0]["summary"]
    assert "rank 2 (host node-b) in step 6 for 61 s" in summary
    assert "ranks 0, 1, 3 (hosts node-a, node-b) in step 7 for 60 s" in summary
    # ranks of one step that entered it at different times: one group, their span
    run = Run(hang_after_s=10.0)
    fired = run.tick(12, {0: (4, 0.0), 1: (4, 1.5), 2: (4, 3.0), 3: (3, 0.0)})
    assert "ranks 0, 1, 2 (hosts node-a, node-b) in step 4 for 9-12 s (past 10 s)" in fired[0]["summary"]
    # a rank between steps (its loop outside any step) is named with the step it left
    run = Run(hang_after_s=10.0)
    run.feed(0, progress(3, None, None, T0, last_step=3))
    fired = run.tick(12, {0: (4, 0.0), 1: (4, 0.0)})
    assert "rank 3 (host node-b) between steps after step 3" in fired[0]["summary"]
    assert fired[0]["evidence"]["rank.3.step"] == -1.0 and fired[0]["evidence"]["rank.3.last_step"] == 3.0
    # the others pass the threshold in step 7 too: the same hang, no second alert
    assert run.tick(65, where) == [] and run.tick(70, where) == []


def test_silent_and_never_heard_ranks_are_named_and_a_healthy_run_fires_nothing():
    run = Run(hang_after_s=60.0)
    healthy = 0
    for t in range(0, 300, 5):  # 5 s steps on every rank: no alert
        healthy += len(run.tick(t, {r: (t // 5, float(t)) for r in range(4)}))
    assert healthy == 0
    run = Run(hang_after_s=60.0)
    run.tick(0, {0: (7, 0.0), 1: (7, 0.0), 2: (None, None)})  # rank 3 never reports
    # rank 2 goes silent (3 intervals: 15 s), 0 and 1 wait in step 7
    for t in range(5, 61, 5):
        run.tick(t, {0: (7, 0.0), 1: (7, 0.0)})
    fired = run.tick(61, {0: (7, 0.0), 1: (7, 0.0)})
    assert len(fired) == 1
    summary = fired[0]["summary"]
    assert "ranks 0, 1 (host node-a) in step 7 for 61 s" in summary
    assert "rank 2 (host node-b) silent for 61 s" in summary and "rank 3 never reported" in summary
    assert fired[0]["evidence"]["rank.2.silent_s"] == 61.0 and fired[0]["evidence"]["ranks_unheard"] == 1.0


def test_hung_ranks_that_go_silent_resolve_and_a_rank_that_ended_is_forgotten():
    run = Run(hang_after_s=10.0)
    run.tick(0, {0: (3, 0.0), 1: (3, 0.0)})
    assert [a["state"] for a in run.tick(11, {0: (3, 0.0), 1: (3, 0.0)})] == ["firing"]
    # the job is killed: no more records; after 3 intervals (15 s) no rank reports, so no hang
    assert [a["state"] for a in run.feed(11 + 16)] == ["resolved"]
    # nothing reports any more and no step is pending: the run is let go after the idle timeout
    run.feed(11 + 61)
    assert "hang-run" not in run.stage.runs
    # a rank that ended (RankEnd) is nowhere: a record of it read later is not a hang
    run = Run(hang_after_s=10.0)
    run.tick(0, {0: (3, 0.0), 1: (3, 0.0)})
    end = {"run_id": "hang-run", "rank": 0, "world_size": 4, "host": "node-a", "last_step": 2,
           "ended_ns": T0, "end_signal": 0}
    run.feed(1, encode("RankEnd", end))
    assert run.tick(20, {0: (3, 0.0)}) == [] and 0 not in run.stage.runs["hang-run"].hangs.places


def test_step_stage_passes_progress_on_to_the_run_partition_and_replays_leave_it_out():
    topics = Topics("hangs")
    counts = StageCounts()
    stage = StepStage(topics, 12, counts)
    value = progress(2, 7, T0, T0 + 3 * S)
    out = stage.fold(Rec(topics.raw, 5, 0, b"hang-run/2", value), 0.0)
    # to the steps topic (the exporter's) and the partials topic (the run stage's), in the run's partition
    assert [(o.topic, o.key, o.value, o.partition) for o in out] == [
        (topics.steps, b"hang-run/2", value, run_partition("hang-run", 12)),
        (topics.partials, b"hang-run/2", value, run_partition("hang-run", 12))]
    assert counts.progress == 1 and not counts.decode_errors and is_rank_progress(out[0].value)
    # garbage after a RankProgress header: a dead letter with its reason
    bad = stage.fold(Rec(topics.raw, 5, 1, b"hang-run/2", value[:12]), 0.0)
    assert [o.topic for o in bad] == [topics.dlq] and counts.decode_errors
    # offline (replay, report): no figure of it
    from profstream.processors.stream import RawMessage

    assert StepFigures(raw_topic="offline.raw").feed(RawMessage(1.0, 0, 0, b"hang-run/2", value)) == []
    name, record = decode_any(value)
    assert name == "RankProgress" and record["step"] == 7 and record["step_started_ns"] == T0


def test_the_exporter_shows_a_firing_hang_per_run_skips_progress_and_a_restart_keeps_it():
    import time

    from tests.helpers import connected_exporter

    topics = Topics("hangs")
    Msg = namedtuple("Msg", "topic partition offset timestamp value")
    run = Run()
    where = {0: (7, 0.0), 1: (7, 0.0), 2: (6, 5.0), 3: (7, 0.0)}
    run.tick(0, where)
    [firing] = run.tick(65, where)
    now_ms = int(time.time() * 1000)
    state = connected_exporter(topics)
    state.handle([Msg(topics.steps, 0, 0, now_ms, progress(0, 7, T0, T0 + S)),
                  Msg(topics.alerts, 0, 0, now_ms, encode("Alert", firing))])
    text = state.exposition().decode()
    assert 'profstream_training_hang{run="hang-run"} 1' in text and 'profstream_hang_step{run="hang-run"} 7' in text
    assert not any(state.decode_errors.values())  # a RankProgress on the steps topic is no error
    restarted = connected_exporter(topics)  # reads the alerts topic at start
    restarted.seed_stalls([firing])
    restarted.handle([Msg(topics.steps, 0, 1, now_ms, progress(0, 7, T0, T0 + 70 * S))])
    assert 'profstream_training_hang{run="hang-run"} 1' in restarted.exposition().decode()
    [resolved] = run.tick(200, {r: (8, 200.0) for r in range(4)})
    state.handle([Msg(topics.alerts, 0, 1, now_ms, encode("Alert", resolved))])
    text = state.exposition().decode()
    assert 'profstream_training_hang{run="hang-run"} 0' in text and "profstream_hang_step{" not in text


def _in_call(rank: int, step: int, ts_ns: int, call: tuple | None) -> bytes:
    """A RankProgress v2: in ``step`` since T0, in collective ``call`` (op, group, seq, since s) or none."""
    collective = None if call is None else {"collective": call[0], "group": call[1], "seq": call[2],
                                            "since_ns": T0 + int(call[3] * S)}
    return encode("RankProgress", {"run_id": "hang-run", "rank": rank, "world_size": 4, "host": HOSTS[rank],
                                   "step": step, "step_started_ns": T0, "last_step": step - 1, "ts_ns": ts_ns,
                                   "interval_ms": 5000, "collective": collective})


def test_the_hang_names_the_collective_and_the_rank_that_has_not_entered_it():
    """Ranks 0, 1, 3 sit in step 7's all_reduce (default group, call 12) since 1 s into the
    step; rank 2 sleeps in step 7 before it: the alert names the call, its ranks, and rank 2
    as not entered, with its host and where it is."""
    run = Run()
    fired = []
    for t in range(0, 70, 5):
        ts = T0 + t * S
        fired += run.feed(t, *(_in_call(r, 7, ts, None if r == 2 else ("all_reduce", "0", 12, 1.0))
                               for r in range(4)))
    (alert,) = fired
    assert alert["step"] == 7
    summary = alert["summary"]
    assert "ranks 0, 1, 3 (hosts node-a, node-b) in all_reduce of group 0, seq 12 for 64 s" in summary, summary
    assert summary.endswith("not entered: rank 2 (host node-b) in step 7, in no collective"), summary
    ev = alert["evidence"]
    assert ev["collective_seq"] == 12 and ev["ranks_not_entered"] == 1 and ev["rank.2.not_entered"] == 1


def test_a_subgroup_call_names_only_its_members_not_entered():
    """Group "5@0-2" (ranks 0, 1, 2): ranks 0 and 1 sit in its call 3, rank 2 is in no
    collective; rank 3, no member, sits in a call of its own group and is not named."""
    run = Run()
    fired = []
    calls = {0: ("all_gather", "5@0-2", 3, 0.0), 1: ("all_gather", "5@0-2", 3, 0.0), 2: None,
             3: ("all_reduce", "6@3", 2, 0.0)}
    for t in range(0, 70, 5):
        fired += run.feed(t, *(_in_call(r, 7, T0 + t * S, calls[r]) for r in range(4)))
    (alert,) = fired
    summary = alert["summary"]
    assert "ranks 0, 1 (host node-a) in all_gather of group 5@0-2, seq 3 for 65 s; not entered: rank 2 (host " \
           "node-b) in step 7, in no collective" in summary, summary
    assert alert["evidence"]["ranks_not_entered"] == 1 and "rank.3.not_entered" not in alert["evidence"]


def test_a_version_1_progress_record_reads_without_a_collective():
    from profstream.schema.codec import VERSIONS

    old = {"run_id": "r", "rank": 1, "world_size": 2, "host": "h", "step": 3, "step_started_ns": T0, "last_step": 2,
           "ts_ns": T0 + S, "interval_ms": 5000}
    name, record = decode_any(encode("RankProgress", old, version=1))
    assert name == "RankProgress" and record["collective"] is None and record["step"] == 3
    assert VERSIONS[("RankProgress", 2)].fingerprint != VERSIONS[("RankProgress", 1)].fingerprint
