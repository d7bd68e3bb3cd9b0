"""Collective calls: the EventBatch v6 section, older messages without it, and the
matching across ranks (processors/collectives.py) on calls whose figures are known."""

from pathlib import Path

import numpy as np
import pytest

from profstream.processors import collectives
from profstream.processors.collectives import (
    CollectiveCall,
    bus_factor,
    calls_of,
    pack_calls,
    step_collectives,
)
from profstream.producers.sender import collective_columns
from profstream.schema.batch import EventBatch, decode_batch, encode_batch
from profstream.schema.codec import (
    CURRENT,
    DecodeError,
    decode,
    decode_any,
    encode_run_step_metrics,
)
from profstream.schema.rank_columns import NO_RANK_CLOCKS, expanded
from profstream.sinks.collective_metrics import collective_lines, run_collectives
from tests.test_codec import assert_same_batch, random_batch

DATA = Path(__file__).parent / "data"
MS = 1_000_000


def test_collective_rows_survive_the_round_trip_with_one_dictionary():
    rows = [("all_reduce", "0", "Float", 3, 11, 100, 50, 4000, 4000, 2),
            ("all_gather", "0", "Float", 3, 12, 200, 70, 4000, 8000, 2),
            ("broadcast", "1", "Long", 4, 0, 300, 10, 8, 8, 4)]
    batch = EventBatch(run_id="r", rank=1)
    batch.collective_names, batch.collectives = collective_columns(rows)
    back = decode_batch(encode_batch(batch))
    assert back.collective_names == ["all_reduce", "0", "Float", "all_gather", "broadcast", "1", "Long"]
    got = [(back.collective_names[n], back.collective_names[g], back.collective_names[d], *rest)
           for n, g, d, *rest in zip(*(back.collectives[c].tolist() for c in (
               "name_idx", "group_idx", "dtype_idx", "step", "seq", "start_ns", "dur_ns", "in_bytes", "out_bytes",
               "group_size")))]
    assert got == rows


def test_a_collective_index_outside_its_dictionary_is_malformed():
    batch = EventBatch(run_id="r", rank=1)
    batch.collective_names, batch.collectives = collective_columns([("all_reduce", "0", "Float", 3, 1, 1, 1, 4, 4, 2)])
    batch.collective_names = ["all_reduce"]  # group and dtype now point past it
    with pytest.raises(DecodeError, match="collectives.group_idx outside collective_names") as e:
        decode_batch(encode_batch(batch))
    assert e.value.reason == "malformed"


def test_shipped_v4_message_decodes_with_no_collectives():
    """EventBatch v6 added the collectives section: a v4 message (written by the v4 code,
    random_batch(1234, 20), world_size 8) reads as a batch without collectives."""
    raw = (DATA / "eventbatch-v4.bin").read_bytes()
    assert raw[2:10] != CURRENT["EventBatch"].header[2:10]
    batch = decode_batch(raw)
    assert_same_batch(random_batch(1234, 20, devices=False, collectives=False, losses=False, work=False), batch)
    assert batch.n("collectives") == 0 and batch.collective_names == []
    assert_same_batch(batch, decode_batch(encode_batch(batch)))


def test_only_records_with_collectives_are_written_as_the_new_versions():
    """Batches, steps and cross-rank steps without collectives keep the versions before
    them (older readers read them whole); with collectives they are EventBatch v6 (v8 when
    a mark carries work or losses), StepMetrics v5 (v6 only for steps without ops, v7 for
    partial steps, v8 with work figures, v9 with each loader worker's figures); RunStepMetrics
    are all v5 (the per-rank lists as columns), and v1 to v4 still read."""
    from profstream.schema.codec import VERSIONS, encode_run_step_metrics, encode_step_metrics

    assert (CURRENT["EventBatch"].version, CURRENT["StepMetrics"].version, CURRENT["RunStepMetrics"].version) == (
        8, 9, 5)
    data = encode_batch(random_batch(3, 10, losses=False, work=False))
    assert data[:10] == VERSIONS[("EventBatch", 6)].header and decode_batch(data).n("collectives") == 5
    assert encode_batch(random_batch(3, 10, collectives=False, losses=False, work=False))[:10] == \
        VERSIONS[("EventBatch", 5)].header
    assert encode_batch(random_batch(3, 10, losses=False))[:10] == VERSIONS[("EventBatch", 8)].header  # and work: v8
    step = decode("StepMetrics", (DATA / "stepmetrics-v3.bin").read_bytes())
    assert encode_step_metrics(step)[:10] == VERSIONS[("StepMetrics", 3)].header
    with_calls = {**step, "collectives": pack_calls(calls_of([CollectiveCall("all_reduce", "0", 2, 4, 4000, 2, 5)]))}
    assert encode_step_metrics(with_calls)[:10] == VERSIONS[("StepMetrics", 5)].header
    assert decode("StepMetrics", encode_step_metrics(with_calls)) == with_calls
    run = decode("RunStepMetrics", (DATA / "runstepmetrics-v1.bin").read_bytes())
    assert encode_run_step_metrics(run)[:10] == VERSIONS[("RunStepMetrics", 5)].header
    assert decode("RunStepMetrics", encode_run_step_metrics(run)) == run
    clocked = {**run, "collectives_matched": 1, "clock_offsets": [{"rank": 1, "offset_ns": -5_000_000,
                                                                   "error_ns": 900_000}]}
    assert decode("RunStepMetrics", encode_run_step_metrics(clocked)) == clocked


def test_shipped_step_metrics_v3_and_run_step_metrics_v1_decode_without_collectives():
    m = decode("StepMetrics", (DATA / "stepmetrics-v3.bin").read_bytes())
    assert (m["step"], m["devices"], m["collectives"]["count"]) == (7, [], 0)
    run = decode("RunStepMetrics", (DATA / "runstepmetrics-v1.bin").read_bytes())
    assert (run["straggler_rank"], run["collectives_matched"], run["late_rank"], run["unmatched_collectives"]) == (
        1, 0, None, [])


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert bus_factor("broadcast", 4) == 1.0


def _call(collective, seq, start_ms, end_ms, size=4000, group="0", n=3):
    return CollectiveCall(collective, group, n, seq, size, int(start_ms * MS), int(end_ms * MS))


def test_wait_transfer_and_bandwidth_of_matched_calls():
    # rank 2 arrives 30 ms late at the all_reduce; everyone arrives together at the all_gather
    calls = {0: [_call("all_reduce", 1, 0, 40), _call("all_gather", 2, 50, 55, 12000)],
             1: [_call("all_reduce", 1, 10, 41), _call("all_gather", 2, 50, 56, 12000)],
             2: [_call("all_reduce", 1, 30, 40), _call("all_gather", 2, 50, 55, 12000)]}
    f = step_collectives({r: calls_of(c) for r, c in calls.items()}, [0, 1, 2])
    assert f["collectives_matched"] == 2 and f["unmatched_collectives"] == []
    ranks = {r["rank"]: r for r in f["collective_ranks"]}
    assert [ranks[r]["wait_ns"] for r in (0, 1, 2)] == [30 * MS, 20 * MS, 0]
    assert [ranks[r]["transfer_ns"] for r in (0, 1, 2)] == [15 * MS, 17 * MS, 15 * MS]
    assert ranks[0]["slowest_collective"] == "all_reduce" and ranks[0]["slowest_ns"] == 40 * MS
    assert f["late_rank"] == 2 and f["late_rank_held_ns"] == 30 * MS
    by = {c["collective"]: c for c in f["by_collective"]}
    ar = by["all_reduce"]
    assert ar["calls"] == 1 and ar["bytes"] == 3 * 4000 and ar["transfer_ns"] == 31 * MS
    assert ar["algbw_bytes_per_s"] == pytest.approx(12000 / 0.031)
    assert ar["busbw_bytes_per_s"] == pytest.approx(ar["algbw_bytes_per_s"] * 4 / 3)
    assert by["all_gather"]["busbw_bytes_per_s"] == pytest.approx(by["all_gather"]["algbw_bytes_per_s"] * 2 / 3)


def test_a_call_a_rank_never_reported_is_unmatched_with_the_missing_rank():
    calls = {0: [_call("all_reduce", 1, 0, 10), _call("broadcast", 2, 20, 30)],
             2: [_call("all_reduce", 1, 1, 10)],
             1: [_call("all_reduce", 1, 2, 10)]}
    f = step_collectives({r: calls_of(c) for r, c in calls.items()}, [0, 1, 2])
    assert f["collectives_matched"] == 1
    assert f["unmatched_collectives"] == [{"collective": "broadcast", "group": "0", "seq": 2, "arrived": [0],
                                           "missing": [1, 2], "expected": 3}]


def test_no_late_rank_without_waiting():
    calls = {r: [_call("all_reduce", 1, 0, 10)] for r in range(3)}
    f = step_collectives({r: calls_of(c) for r, c in calls.items()}, range(3))
    assert f["late_rank"] is None and f["late_rank_held_ns"] == 0
    assert all(r["wait_ns"] == 0 for r in f["collective_ranks"])


def test_calls_of_a_subgroup_match_on_their_group_size():
    calls = {0: [_call("all_reduce", 7, 0, 10, group="tp", n=2)], 1: [_call("all_reduce", 7, 4, 10, group="tp", n=2)],
             2: [], 3: []}
    f = step_collectives({r: calls_of(c) for r, c in calls.items()}, range(4))
    assert f["collectives_matched"] == 1 and f["late_rank"] == 1
    assert np.isclose(f["late_rank_held_ns"], 4 * MS)


@pytest.mark.parametrize("seed", range(12))
def test_ranks_with_the_same_calls_get_the_figures_of_the_general_matching(seed, monkeypatch):
    # step_collectives takes rank x call matrices when every rank reported the same calls
    # in order: the figures must be those of the row-sorting path, ties and a call short
    # of its group included
    rng = np.random.default_rng(seed)
    nr, k = int(rng.integers(2, 6)), int(rng.integers(1, 30))
    groups = rng.choice(["0", "tp"], k)
    seqs = np.arange(k)
    order = np.lexsort((seqs, groups))  # calls in (group, seq) order, as a rank reports them when aligned
    kinds = rng.choice(["all_reduce", "all_gather", "broadcast"], k)
    sizes = np.where(rng.random(k) < 0.1, nr + 1, nr)  # some calls expect a rank that never comes
    calls = {}
    for r in range(nr):
        start = rng.integers(0, 5, k) * MS  # few distinct values: ties in arrival and duration
        end = start + rng.integers(0, 4, k) * MS
        calls[r] = calls_of([CollectiveCall(str(kinds[j]), str(groups[j]), int(sizes[j]), int(seqs[j]),
                                            int(rng.integers(1, 10)) * 1000, int(start[j]), int(end[j]))
                             for j in order.tolist()])
    everyone, reporting = list(range(nr + 1)), list(range(nr))
    general = collectives._with_rank_rows(collectives._any_calls(calls, reporting, everyone), False)
    packed = {r: pack_calls(c) for r, c in calls.items()}
    with monkeypatch.context() as m:  # both entry points take the matrices here
        m.setattr(collectives, "_any_calls", lambda *a: pytest.fail("rows sorted where every rank had the same calls"))
        assert step_collectives(calls, everyone) == general
        assert collectives.packed_step_collectives(packed, everyone) == general
    # as RunStepMetrics v5's columns (the run stage's), the same figures per rank
    columns = collectives.packed_step_collectives(packed, everyone, packed=True)
    assert "collective_ranks" not in columns
    run_step = expanded({**columns, "step_times": {"ranks": b"", "step_time_ns": b""}, "rank_clocks": NO_RANK_CLOCKS})
    assert run_step["collective_ranks"] == general["collective_ranks"]
    perm = rng.permutation(k)  # a rank with its calls in another order: sorted rows, the same figures
    packed[0] = pack_calls(collectives.Calls(calls[0].names, {c: a[perm] for c, a in calls[0].cols.items()}))
    assert collectives.packed_step_collectives(packed, everyone) == general


# -- through the processors: raw batches -> StepMetrics -> RunStepMetrics --------------

def _rank_batch(rank: int, steps: list[int], calls: list[tuple], world: int = 3, run_id: str = "hang",
                shift_ms: float = 0.0) -> bytes:
    """One rank's batch: marks of ``steps`` (100 ms each from 0) and its collective rows
    (collective, step, seq, start_ms, dur_ms), every time read on a clock ``shift_ms`` off."""
    batch = EventBatch(run_id=run_id, rank=rank, world_size=world, producer_id=f"p{rank}", seq=0,
                       complete_through_step=max(steps))
    batch.steps = {"step": np.array(steps), "start_ns": np.array([int((s * 100 + shift_ms) * MS) for s in steps]),
                   "end_ns": np.array([int(((s + 1) * 100 + shift_ms) * MS) for s in steps]),
                   "fp_start_ns": np.full(len(steps), -1), "bp_end_ns": np.full(len(steps), -1)}
    batch.collective_names, batch.collectives = collective_columns(
        [(c, "0", "Float", step, seq, int((start + shift_ms) * MS), int(dur * MS), 4000, 4000, world)
         for c, step, seq, start, dur in calls])
    return encode_batch(batch)


def test_processors_match_calls_and_report_a_call_a_rank_never_made():
    """Rank 2 stops after step 0 (a hang in step 1): its step never comes, and after the
    run stage's grace the calls ranks 0 and 1 made in step 1 are reported unmatched,
    naming rank 2 as missing; step 0 is matched, with rank 2 the late one."""
    steps, run = _hang_run()
    assert {(s["rank"], s["step"]): s["collectives"]["count"] for s in steps} == {(0, 0): 1, (0, 1): 1, (1, 0): 1,
                                                                              (1, 1): 1, (2, 0): 1}
    run = {r["step"]: r for r in run}
    assert run[0]["collectives_matched"] == 1 and run[0]["late_rank"] == 2
    assert run[0]["late_rank_held_ns"] == 30 * MS  # rank 0 arrived at 10 ms, rank 2 at 40 ms
    assert run[1]["ranks_reported"] == 2 and run[1]["collectives_matched"] == 0
    assert run[1]["unmatched_collectives"] == [{"collective": "broadcast", "group": "0", "seq": 2, "arrived": [0, 1],
                                                "missing": [2], "expected": 3}]


def _hang_run() -> tuple[list[dict], list[dict]]:
    """StepMetrics and RunStepMetrics of three ranks of which rank 2 stops after step 0."""
    from profstream.processors.stream import RUN, STEPS, RawMessage, StreamOptions, figures

    batches = [_rank_batch(0, [0, 1], [("all_reduce", 0, 1, 10, 50), ("broadcast", 1, 2, 110, 5)]),
               _rank_batch(1, [0, 1], [("all_reduce", 0, 1, 20, 40), ("broadcast", 1, 2, 111, 5)]),
               _rank_batch(2, [0], [("all_reduce", 0, 1, 40, 20)])]
    messages = [RawMessage(1.0, rank, 0, f"hang/{rank}".encode(), b) for rank, b in enumerate(batches)]
    out = list(figures(messages, StreamOptions(grace_s=0.1, run_grace_s=1.0)))
    return ([decode("StepMetrics", f.value) for f in out if f.kind == STEPS],
            [decode("RunStepMetrics", f.value) for f in out if f.kind == RUN])


def test_the_exporter_shows_waits_the_late_rank_bandwidth_and_the_missing_rank():
    import subprocess
    import time
    from collections import namedtuple

    from profstream.kafka.topics import Topics
    from profstream.schema.codec import encode
    from profstream.sinks.prometheus import ExporterState
    from tests.test_alert_rules import prometheus_tool
    from tests.test_prometheus_sink import Scrape

    Rec = namedtuple("Rec", "topic partition offset timestamp value")
    _steps, run = _hang_run()
    topics = Topics("coll")
    state = ExporterState(topics)
    now_ms = time.time_ns() // 10**6
    state.handle([Rec(topics.run, 0, 0, now_ms, encode("RunStepMetrics", run[0]))])
    s = Scrape(state.exposition().decode())
    assert s("profstream_collective_late_rank", run="hang") == 2
    assert s("profstream_collective_late_rank_held_seconds", run="hang") == pytest.approx(0.03)
    assert s("profstream_collective_late_rank_held_ratio", run="hang") == pytest.approx(0.3)  # of 100 ms steps
    assert s("profstream_collective_wait_seconds", run="hang", rank="0") == pytest.approx(0.03)
    assert s("profstream_collective_transfer_seconds", run="hang", rank="2") == pytest.approx(0.02)
    # 3 x 4000 bytes over 50 + 40 + 20 ms of transfer after rank 2's arrival (ends 60, 60, 60 ms)
    assert s("profstream_collective_algbw_bytes_per_second", run="hang", collective="all_reduce") == pytest.approx(
        12000 / 0.06)
    assert s("profstream_collective_unmatched", run="hang") == 0 and not s.all("profstream_collective_missing")
    state.handle([Rec(topics.run, 0, 1, now_ms, encode("RunStepMetrics", run[1]))])
    s = Scrape(state.exposition().decode())
    assert s("profstream_collective_unmatched", run="hang") == 1
    assert [(x.labels["rank"], x.value) for x in s.all("profstream_collective_missing", run="hang")] == [("2", 1)]
    res = subprocess.run([prometheus_tool("promtool"), "check", "metrics"], input=s.text, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_report_section_names_the_late_rank_bandwidth_and_the_missing_rank():
    from profstream.offline.report_collectives import communication_section

    _steps, run = _hang_run()
    html = communication_section(run)
    assert 'data-late="2"' in html and "<td>30.0</td>" in html  # rank 2 held the others 30 ms, in step 0
    assert 'data-collective="all_reduce"' in html
    assert "<td>broadcast</td>" in html and "<td>[0, 1]</td><td>[2]</td>" in html
    assert "No collective calls" in communication_section([{**r, "collectives_matched": 0,
                                                            "unmatched_collectives": []} for r in run])


def _monitor_without_sender_thread():
    """A Monitor and a Sender whose batches the test builds itself (no thread, no broker)."""
    from types import SimpleNamespace

    from profstream.producers.monitor import Monitor
    from profstream.producers.sender import Sender

    idle = SimpleNamespace(start=lambda: None, stop=lambda timeout: True, flush=lambda timeout: True,
                           stats=lambda: {})
    mon = Monitor(run_id="coll", rank=1, world_size=2, bootstrap="127.0.0.1:1", sender_factory=lambda m: idle,
                  host_sample_interval_s=0, native=False)  # the native Monitor's: tests/test_native.py
    return mon, Sender(mon)


def test_monitor_collective_rows_reach_the_batch_in_the_step_they_belong_to():
    mon, sender = _monitor_without_sender_thread()
    with mon.step():
        mon.collective("all_reduce", "0", 7, 1000, 50, 2, in_bytes=4096, out_bytes=4096, dtype="Float")
        mon.collective("all_gather", "0", 8, 2000, 20, 2, in_bytes=64, out_bytes=128, dtype="Float")
    assert sender._build()
    batch = decode_batch(sender._pending.popleft()[0])
    mon.close()
    names = batch.collective_names
    c = batch.collectives
    assert [names[i] for i in c["name_idx"]] == ["all_reduce", "all_gather"]
    assert c["seq"].tolist() == [7, 8] and c["step"].tolist() == [0, 0] and c["out_bytes"].tolist() == [4096, 128]
    assert batch.n("steps") == 1  # the step mark came with them


def test_a_collective_value_its_column_cannot_hold_drops_the_samples_counted_and_keeps_the_ops(caplog):
    from profstream import COMPUTE

    mon, sender = _monitor_without_sender_thread()
    with mon.step():
        mon.op("matmul", COMPUTE, 100, 50)
        mon.collective("all_reduce", "0", 7, 1000, 50, 2 ** 31)  # a group size past int32
    with caplog.at_level("WARNING", logger="profstream"):
        assert sender._build()  # did not raise out of the sender thread's build
    batch = decode_batch(sender._pending.popleft()[0])
    mon.close()
    assert batch.n("ops") == 1 and batch.n("collectives") == 0
    assert batch.dropped_samples == 1  # the call, counted
    assert batch.n("steps") == 1  # the step's mark goes out: the step is still a step
    assert any("dropped 1 samples with invalid values" in r.getMessage() for r in caplog.records)


def test_the_exporter_shows_each_ranks_clock_offset_and_its_error_bound():
    """profstream_clock_offset_seconds{run, rank} from the newest step with collectives; a
    rank without an offset has no series (not 0); with more ranks than --top-ranks, the
    farthest off keep theirs."""
    import time
    from collections import namedtuple

    from profstream.kafka.topics import Topics
    from profstream.schema.codec import encode_run_step_metrics
    from profstream.sinks.prometheus import ExporterState
    from tests.test_prometheus_sink import Scrape

    Rec = namedtuple("Rec", "topic partition offset timestamp value")
    _steps, run = _hang_run()
    clocked = {**run[0], "clock_offsets": [{"rank": 0, "offset_ns": 0, "error_ns": 0},
                                           {"rank": 2, "offset_ns": -5_000_000, "error_ns": 800_000}]}
    topics = Topics("clk")
    state = ExporterState(topics, top_ranks=1)
    state.handle([Rec(topics.run, 0, 0, time.time_ns() // 10**6, encode_run_step_metrics(clocked))])
    s = Scrape(state.exposition().decode())
    assert [(x.labels["rank"], x.value) for x in s.all("profstream_clock_offset_seconds", run="hang")] == [
        ("2", pytest.approx(-0.005))]
    assert s("profstream_clock_offset_error_seconds", run="hang", rank="2") == pytest.approx(0.0008)
    state = ExporterState(topics)
    state.handle([Rec(topics.run, 0, 0, time.time_ns() // 10**6, encode_run_step_metrics(clocked))])
    s = Scrape(state.exposition().decode())
    assert {x.labels["rank"] for x in s.all("profstream_clock_offset_seconds", run="hang")} == {"0", "2"}  # not 1


def test_the_report_lists_each_ranks_clock_offset_and_its_drift():
    from profstream.offline.report_collectives import communication_section

    _steps, run = _hang_run()
    first = {**run[0], "clock_offsets": [{"rank": 1, "offset_ns": 5_000_000, "error_ns": 900_000}]}
    later = {**run[0], "step": 9, "clock_offsets": [{"rank": 1, "offset_ns": 5_250_000, "error_ns": 700_000}]}
    html = communication_section([first, later])
    assert '<tr data-rank="1"><td>rank 1</td><td>+5.250</td><td>0.700</td><td>+0.250</td></tr>' in html
    assert "No clock offsets" in communication_section([{**r, "clock_offsets": []} for r in run])  # before v4


# -- always-on records (torch's Flight Recorder): groups with members, calls without an end --


def test_a_call_missing_from_a_member_of_a_subgroup_names_that_rank():
    # two "TP" groups of two ranks, named with their members (schema/groups.py): rank 3 never
    # made the second call of its group, rank 2 did
    calls = {0: [_call("all_reduce", 1, 0, 10, group="1@0,1", n=2)],
             1: [_call("all_reduce", 1, 2, 10, group="1@0,1", n=2)],
             2: [_call("all_reduce", 1, 0, 10, group="2@2,3", n=2), _call("all_reduce", 2, 20, 30, group="2@2,3", n=2)],
             3: [_call("all_reduce", 1, 1, 10, group="2@2,3", n=2)]}
    f = step_collectives({r: calls_of(c) for r, c in calls.items()}, range(4))
    assert f["collectives_matched"] == 2
    assert f["unmatched_collectives"] == [{"collective": "all_reduce", "group": "2@2,3", "seq": 2, "arrived": [2],
                                           "missing": [3], "expected": 2}]


def test_group_labels_name_their_members_and_read_back():
    from profstream.schema.groups import group_label, group_members

    assert group_label("0", range(8), 8) == "0"  # the default group: every rank, its plain name
    assert group_label("3", [1, 3, 5, 7], 8) == "3@1-7/2" and group_members("3@1-7/2") == [1, 3, 5, 7]
    assert group_label("4", [4, 5, 6, 7], 8) == "4@4-7" and group_members("4@4-7") == [4, 5, 6, 7]
    assert group_label("5", [0, 2, 7], 8) == "5@0,2,7" and group_members("5@0,2,7") == [0, 2, 7]
    assert group_label("6", [0, 4], 8) == "6@0,4" and group_members("6@0,4") == [0, 4]
    assert group_members("0") is None and group_members("x@y") is None


def test_calls_without_an_end_give_waits_and_the_late_rank_and_no_transfer():
    # gloo's Flight Recorder keeps no end: end before start. Waits and the late rank come
    # from the starts; transfer, slowest call and bandwidth are absent (None), not 0, and
    # travel as such (RunStepMetrics v4) to the exporter, which writes no series for them
    untimed = {r: [CollectiveCall("all_reduce", "0", 3, 1, 4000, start * MS, start * MS - 1)]
               for r, start in ((0, 0), (1, 10), (2, 30))}
    for reorder in (False, True):  # the aligned path and the row path
        calls = {r: calls_of(c) for r, c in untimed.items()}
        if reorder:
            calls[1] = calls_of(untimed[1] + [CollectiveCall("all_gather", "0", 3, 2, 4000, 60 * MS, 60 * MS - 1)])
        f = step_collectives(calls, range(3))
        ranks = {r["rank"]: r for r in f["collective_ranks"]}
        assert [ranks[r]["wait_ns"] for r in range(3)] == [30 * MS, 20 * MS, 0]
        assert f["late_rank"] == 2 and f["late_rank_held_ns"] == 30 * MS
        assert all(r["transfer_ns"] is None and r["slowest_ns"] is None and r["slowest_collective"] is None
                   for r in ranks.values())
        ar = {c["collective"]: c for c in f["by_collective"]}["all_reduce"]
        assert ar["calls"] == 1 and ar["transfer_ns"] is None and ar["algbw_bytes_per_s"] is None
    record = {"run_id": "r", "step": 7, "ranks_reported": 3, "min_step_time_ns": 10, "median_step_time_ns": 12.0,
              "max_step_time_ns": 14, "skew": 0.1, "straggler_rank": 1, "step_times_ns": {"0": 10, "1": 14, "2": 12},
              "work": None, "clock_offsets": [],
              **step_collectives({r: calls_of(c) for r, c in untimed.items()}, range(3))}
    kind, back = decode_any(encode_run_step_metrics(record))
    assert kind == "RunStepMetrics"
    assert back["collective_ranks"] == record["collective_ranks"] and back["by_collective"] == record["by_collective"]
    c = run_collectives(back)
    text = "".join(collective_lines("profstream_", [("r", c)], str, repr))
    assert 'collective_wait_seconds{run="r",rank="2"}' in text and "collective_transfer_seconds{" not in text
    assert "algbw_bytes_per_second{" not in text
    # one timed call beside an untimed one: the bandwidth is the timed call's bytes over its transfer
    mixed = {r: calls_of([_call("all_reduce", 1, 0, 40), CollectiveCall("all_reduce", "0", 3, 2, 4000, 50 * MS,
                                                                           50 * MS - 1)]) for r in range(3)}
    (ar,) = step_collectives(mixed, range(3))["by_collective"]
    assert ar["calls"] == 2 and ar["bytes"] == 2 * 3 * 4000
    assert ar["algbw_bytes_per_s"] == pytest.approx(3 * 4000 / 0.120)


def test_a_call_recorded_by_capture_and_by_the_flight_recorder_counts_once_with_its_end():
    """A captured step on a rank whose Flight Recorder is read too: the same (group, seq)
    twice in its batch; the step's StepMetrics hold it once, op capture's timed row."""
    from profstream.processors.stream import RUN, STEPS, RawMessage, StreamOptions, figures

    batches = [_rank_batch(r, [0], [("all_reduce", 0, 1, 10 * (r + 1), 50 - 10 * r),  # capture: timed
                                     ("all_reduce", 0, 1, 10 * (r + 1), -1e-6)])  # the recorder's: no end
               for r in range(3)]
    messages = [RawMessage(1.0, r, 0, f"hang/{r}".encode(), b) for r, b in enumerate(batches)]
    out = list(figures(messages, StreamOptions(grace_s=0.1, run_grace_s=1.0)))
    steps = [decode("StepMetrics", f.value) for f in out if f.kind == STEPS]
    assert [s["collectives"]["count"] for s in steps] == [1, 1, 1]
    (run,) = [decode("RunStepMetrics", f.value) for f in out if f.kind == RUN]
    (ar,) = run["by_collective"]
    assert run["collectives_matched"] == 1 and ar["calls"] == 1
    assert ar["transfer_ns"] == 3 * 30 * MS  # each rank ends at 60 ms, the last arrived at 30 ms


def test_a_rank_that_records_collectives_without_capture_is_missing_from_a_call_it_did_not_make():
    """Ranks whose collectives come without ops (always on): rank 2 reported step 1 without
    its broadcast. It is not 'not measured' (before, a step without ops left the call out):
    the broadcast is unmatched with rank 2 missing."""
    from profstream.processors.stream import RUN, RawMessage, StreamOptions, figures

    batches = [_rank_batch(0, [0, 1], [("all_reduce", 0, 1, 10, 50), ("broadcast", 1, 2, 110, 5)]),
               _rank_batch(1, [0, 1], [("all_reduce", 0, 1, 20, 40), ("broadcast", 1, 2, 111, 5)]),
               _rank_batch(2, [0, 1], [("all_reduce", 0, 1, 40, 20)])]
    messages = [RawMessage(1.0, rank, 0, f"hang/{rank}".encode(), b) for rank, b in enumerate(batches)]
    run = {r["step"]: r for r in (decode("RunStepMetrics", f.value) for f in figures(
        messages, StreamOptions(grace_s=0.1, run_grace_s=1.0)) if f.kind == RUN)}
    assert run[1]["ranks_reported"] == 3
    assert run[1]["unmatched_collectives"] == [{"collective": "broadcast", "group": "0", "seq": 2, "arrived": [0, 1],
                                                "missing": [2], "expected": 3}]
