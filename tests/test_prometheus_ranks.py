"""The exporter's bounded mode (--top-ranks) against the real broker: a run with more ranks
than K keeps per-rank series for exactly its K slowest ranks (mean of their last steps),
its quantiles over ranks equal those of the input, a rank that stops being slow loses its
series, and a bad --top-ranks is a one-line error."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections import namedtuple

import pytest

from profstream.kafka.clients import make_producer
from profstream.kafka.topics import Topics
from profstream.schema.codec import encode
from profstream.sinks.prometheus import STEP_BUCKETS, ExporterState
from profstream.sinks.rank_summary import SLOW_WINDOW_STEPS
from tests.helpers import wait_until
from tests.test_alert_rules import prometheus_tool
from tests.test_prometheus_sink import Scrape, exporter, scrape

RANKS, K = 40, 8


def step_record(run_id: str, rank: int, step: int, step_ns: int) -> dict:
    now = time.time_ns()
    wait = 1_000_000 + 50_000 * rank
    return {"run_id": run_id, "rank": rank, "world_size": RANKS, "host": f"node{rank // 8}", "device": "cuda:0",
            "step": step, "start_ns": now - step_ns, "end_ns": now, "step_time_ns": step_ns,
            "host_step_time_ns": step_ns, "data_wait_ns": wait, "fp_bp_ns": step_ns // 2,
            "tail_ns": step_ns - step_ns // 2 - wait, "compute_ns": step_ns // 2, "comm_ns": step_ns // 4,
            "overlap_ns": step_ns // 8, "pure_comm_ns": step_ns // 8, "idle_ns": step_ns // 4,
            "utilization": 0.5, "overlap_ratio": 0.5, "op_count": 10,
            "op_types": [{"op_type": "MatMul", "total_ns": step_ns // 4, "count": 10}],
            "memory": {"peak": 10**9 + rank, "allocated": 10**9, "reserved": 2 * 10**9},
            "queues": [{"queue": "q", "min": 1, "mean": 2.0, "last": 2, "at_start": 2, "empty_ratio": 0.0}],
            "starved": False, "rolling": None, "closed_by": "watermark", "late_events": 0, "closed_ns": now}


def send(bootstrap: str, topic: str, run_id: str, times_ns: dict[tuple[int, int], int]) -> None:
    producer = make_producer(bootstrap)
    for (rank, step), step_ns in sorted(times_ns.items(), key=lambda kv: kv[0][::-1]):
        producer.send(topic, key=f"{run_id}/{rank}".encode(),
                      value=encode("StepMetrics", step_record(run_id, rank, step, step_ns)))
    producer.flush()
    producer.close()


def slowest(times_ns: dict[tuple[int, int], int], k: int) -> set[int]:
    """The k ranks with the largest mean step time over their last SLOW_WINDOW_STEPS steps."""
    last = max(step for _, step in times_ns)
    window = range(last - SLOW_WINDOW_STEPS + 1, last + 1)
    mean = {rank: statistics.fmean(times_ns[(rank, s)] for s in window) for rank in range(RANKS)}
    return set(sorted(mean, key=lambda r: (-mean[r], r))[:k])


def ranks_in_series(s, run_id: str) -> dict[str, set[int]]:
    """Metric name -> the ranks it has series for in ``run_id``."""
    out: dict[str, set[int]] = {}
    for x in s.samples:
        if x.labels.get("run") == run_id and "rank" in x.labels:
            out.setdefault(x.name, set()).add(int(x.labels["rank"]))
    return out


def all_steps_in(url: str, run_id: str, last: int):
    def ready():
        s = scrape(url)
        q = s.all("profstream_ranks_last_step", run=run_id, stat="min")
        return s if q and q[0].value == last and s("profstream_ranks_held", run=run_id) == RANKS else None
    return ready


def test_a_run_past_top_ranks_keeps_exactly_its_slowest_ranks_and_quantiles_over_all(kafka_bootstrap, topics):
    # step times grow with the rank; rank 3's latest step alone spikes (slowest by its latest
    # step, not by its last 5), and rank 39's latest alone dips
    times = {(rank, step): 100_000_000 + 1_000_000 * rank for rank in range(RANKS) for step in range(6)}
    times[(3, 5)] = 180_000_000
    times[(39, 5)] = 10_000_000
    expected = slowest(times, K)
    by_latest = set(sorted(range(RANKS), key=lambda r: -times[(r, 5)])[:K])
    assert expected != by_latest, "the input should tell the window from the latest step"
    with exporter(kafka_bootstrap, topics, top_ranks=K) as url:
        send(kafka_bootstrap, topics.steps, "big", times)
        s = wait_until(all_steps_in(url, "big", 5), 60, "every rank's step 5 in the scrape")

        per_metric = ranks_in_series(s, "big")
        assert per_metric["profstream_step_duration_seconds"] == expected
        for name, ranks in per_metric.items():  # every per-rank family, the same K ranks
            assert ranks == expected, name
        assert s("profstream_ranks_with_series", run="big") == K
        assert s("profstream_sink_ranks") == RANKS

        latest = sorted(times[(rank, 5)] / 1e9 for rank in range(RANKS))
        waits = sorted((1_000_000 + 50_000 * rank) / 1e9 for rank in range(RANKS))
        for values, name, labels in ((latest, "profstream_ranks_step_duration_seconds", {}),
                                     (waits, "profstream_ranks_step_phase_seconds", {"phase": "data_wait"})):
            want = {"min": min(values), "p50": statistics.median(values),
                    "p95": statistics.quantiles(values, n=20, method="inclusive")[18], "max": max(values)}
            for stat, value in want.items():
                assert s(name, run="big", stat=stat, **labels) == pytest.approx(value, rel=1e-12), (name, stat)
        assert s("profstream_ranks_memory_bytes", run="big", kind="peak", stat="max") == 10**9 + RANKS - 1
        hist = "profstream_ranks_step_duration_seconds_hist"
        for le in STEP_BUCKETS:
            assert s(hist + "_bucket", run="big", le=str(le)) == sum(x <= le for x in latest)
        assert s(hist + "_count", run="big") == RANKS
        assert s(hist + "_sum", run="big") == pytest.approx(sum(latest), rel=1e-12)

        # ranks 0..7 turn slow for the next 5 steps: the former slowest lose every series
        later = {(rank, step): (500_000_000 if rank < K else 100_000_000) for rank in range(RANKS)
                 for step in range(6, 6 + SLOW_WINDOW_STEPS)}
        send(kafka_bootstrap, topics.steps, "big", later)
        s = wait_until(all_steps_in(url, "big", 5 + SLOW_WINDOW_STEPS), 60, "every rank's last step")
    now_slow = slowest({**times, **later}, K)
    assert now_slow == set(range(K)) and not now_slow & expected
    for name, ranks in ranks_in_series(s, "big").items():
        assert ranks == now_slow, f"{name} kept series of ranks {ranks - now_slow}"
    assert s("profstream_ranks_step_duration_seconds", run="big", stat="max") == 0.5
    res = subprocess.run([prometheus_tool("promtool"), "check", "metrics"], input=s.text, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0 and res.stdout + res.stderr == "", res.stdout + res.stderr


def test_a_fast_ranks_firing_stall_keeps_its_stall_series_and_collectives_keep_the_longest_waits():
    """Outside the K slowest, a rank whose DataQueueStall fires still has profstream_data_stall
    (the alert keeps working) until it resolves; collective waits keep the K longest waiters."""
    Rec = namedtuple("Rec", "topic partition offset timestamp value")
    topics, now_ms = Topics("stall"), time.time_ns() // 10**6
    state = ExporterState(topics, top_ranks=K)

    def fold(topic: str, schema: str, *values: dict) -> Scrape:
        state.handle([Rec(topic, 0, 0, now_ms, encode(schema, v)) for v in values])
        return Scrape(state.exposition().decode())

    fold(topics.steps, "StepMetrics", *(step_record("c", rank, 0, 100_000_000 + 1_000_000 * rank)
                                        for rank in range(RANKS)))
    waits = {rank: (RANKS - rank) * 1_000 for rank in range(RANKS)}  # the fast ranks wait longest
    run = {"run_id": "c", "step": 0, "ranks_reported": RANKS, "min_step_time_ns": 10**8,
           "median_step_time_ns": 10**8, "max_step_time_ns": 10**8, "skew": 0.0, "straggler_rank": RANKS - 1,
           "step_times_ns": {}, "collectives_matched": 1, "late_rank": RANKS - 1, "late_rank_held_ns": 10,
           "collective_ranks": [{"rank": r, "wait_ns": w, "transfer_ns": 5, "slowest_collective": "all_reduce",
                                 "slowest_ns": 5} for r, w in waits.items()],
           "by_collective": [], "unmatched_collectives": [{"collective": "all_reduce", "group": "0", "seq": 1,
                                                           "arrived": [], "missing": [0, 1, 2, 20, 39],
                                                           "expected": RANKS}]}
    alert = {"name": "DataQueueStall", "state": "firing", "run_id": "c", "rank": 0, "step": 0,
             "ts_ns": time.time_ns(), "summary": "s", "evidence": {}}
    fold(topics.run, "RunStepMetrics", run)
    s = fold(topics.alerts, "Alert", alert)
    slow = set(range(RANKS - K, RANKS))
    assert ranks_in_series(s, "c")["profstream_step_duration_seconds"] == slow
    assert {int(x.labels["rank"]): x.value for x in s.all("profstream_data_stall", run="c")} == \
        {**dict.fromkeys(slow, 0), 0: 1}
    longest = set(sorted(waits, key=lambda r: -waits[r])[:K])
    assert {int(x.labels["rank"]) for x in s.all("profstream_collective_wait_seconds", run="c")} == longest
    assert {int(x.labels["rank"]) for x in s.all("profstream_collective_transfer_seconds", run="c")} == longest
    assert {int(x.labels["rank"]) for x in s.all("profstream_collective_missing", run="c")} == {0, 1, 2, 20, 39}
    s = fold(topics.alerts, "Alert", {**alert, "state": "resolved"})
    assert ranks_in_series(s, "c")["profstream_data_stall"] == slow


def test_a_fast_rank_that_stopped_keeps_the_series_rank_silent_reads():
    """Outside the K slowest, a rank that stopped while its run goes on (killed) still has its
    step time, its last step's end and whether it ended: RankSilent can name it. It has them
    while it is silent, not before."""
    Rec = namedtuple("Rec", "topic partition offset timestamp value")
    topics, now_ms = Topics("silent"), time.time_ns() // 10**6
    state = ExporterState(topics, top_ranks=K)

    def fold(at_ms: int, *values: dict) -> Scrape:
        state.handle([Rec(topics.steps, 0, 0, at_ms, encode("StepMetrics", v)) for v in values])
        return Scrape(state.exposition().decode())

    fold(now_ms - 30_000, *(step_record("k", rank, 0, 100_000_000 + 1_000_000 * rank) for rank in range(RANKS)))
    slow = set(range(RANKS - K, RANKS))
    for name in ("profstream_last_step_timestamp_seconds", "profstream_rank_ended"):
        assert ranks_in_series(Scrape(state.exposition().decode()), "k")[name] == slow
    # 20 s on, every rank but the fast rank 3 finished another step: 3 was killed
    s = fold(now_ms - 10_000, *(step_record("k", rank, 1, 100_000_000 + 1_000_000 * rank)
                               for rank in range(RANKS) if rank != 3))
    series = ranks_in_series(s, "k")
    for name in ("profstream_last_step_timestamp_seconds", "profstream_step_duration_seconds",
                 "profstream_rank_ended"):
        assert series[name] == slow | {3}, name
    assert s("profstream_rank_ended", run="k", rank="3") == 0
    assert series["profstream_device_utilization_ratio"] == slow  # nothing else of it


@pytest.mark.parametrize("value", ["0", "-3", "lots"])
def test_a_bad_top_ranks_is_a_one_line_error_saying_what_to_give(kafka_bootstrap, value):
    res = subprocess.run([sys.executable, "-m", "profstream.cli", "sink", "prometheus", "--bootstrap",
                          kafka_bootstrap, "--port", "0", "--top-ranks", value],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--top-ranks" in lines[0] and "'all'" in lines[0] and value in lines[0], res.stderr
