"""Every rank's stacks on demand (`profstream stacks`), through the real broker.

The ranks are real processes, each with a real Monitor: after a few steps every rank but
one waits in ``wait_in_all_reduce`` (an Event, as a collective waits for its peers, in a
C call that released the GIL) and the stuck one sleeps in ``stuck_in_data_loading``. The
command must set that rank apart, on its host, in that function.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
from typer.testing import CliRunner

from profstream.cli import app
from profstream.control.records import (
    FINISHED,
    decode_control,
    encode_status,
    new_stacks_request,
    new_status,
)
from profstream.control.stacks import ask_stacks, group_ranks, stacks_lines, traceback_lines
from profstream.processors.hangs import HANG_ALERT
from profstream.producers.stacks import thread_stacks
from profstream.schema.codec import decode
from tests.helpers import read_full, wait_until
from tests.test_processor import RunningProcessor

WORLD = 3
STUCK = 1

RANK_SCRIPT = textwrap.dedent('''
    import sys, threading, time
    from profstream.producers.monitor import Monitor

    bootstrap, prefix, run_id, rank, world, stuck = sys.argv[1:4] + [int(a) for a in sys.argv[4:7]]
    monitor = Monitor(bootstrap=bootstrap, topic_prefix=prefix, run_id=run_id, rank=rank, world_size=world,
                      host=f"node-{rank}", host_sample_interval_s=0)
    peers = threading.Event()

    def wait_in_all_reduce():
        peers.wait()

    def stuck_in_data_loading():
        time.sleep(600)

    for step in range(3):
        monitor.begin_step()
        monitor.end_step()
    monitor.begin_step()
    print("entering", flush=True)
    if rank == stuck:
        stuck_in_data_loading()
    else:
        wait_in_all_reduce()
''')


class Ranks:
    """WORLD rank processes of one run, each printing "entering" before it blocks; killed on exit."""

    def __init__(self, bootstrap, topics, run_id, tmp_path, script=RANK_SCRIPT, env=None):
        path = tmp_path / "rank.py"
        path.write_text(script)
        self.procs = [subprocess.Popen([sys.executable, str(path), bootstrap, topics.prefix, run_id, str(r),
                                        str(WORLD), str(STUCK)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, env=None if env is None else {**env, "RANK": str(r)})
                      for r in range(WORLD)]
        self.lines: list[list[str]] = [[] for _ in self.procs]
        for proc, lines in zip(self.procs, self.lines):
            threading.Thread(target=lambda p=proc, out=lines: out.extend(p.stdout), daemon=True).start()

    def __enter__(self):
        return self

    def entered(self) -> bool:
        for proc, lines in zip(self.procs, self.lines):
            if proc.poll() is not None:
                raise AssertionError(f"a rank exited {proc.returncode}: {''.join(lines)[-3000:]}")
        return all("entering\n" in lines for lines in self.lines)

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(10)


def _main_frames(group):
    main = next(t for t in group.threads if t["main"])
    return [f["function"] for f in main["frames"]], main


def test_stacks_set_the_stuck_rank_apart_in_its_function(kafka_bootstrap, topics, tmp_path):
    with Ranks(kafka_bootstrap, topics, "hung-run", tmp_path) as ranks:
        wait_until(ranks.entered, 60, "every rank to reach its blocking call")
        answer = ask_stacks(kafka_bootstrap, topics, "hung-run", timeout_s=30)
        assert answer.missing() == [] and sorted(answer.answered) == list(range(WORLD)), stacks_lines(answer)
        odd, rest = answer.groups  # the odd one out first
        assert odd.ranks == [STUCK] and odd.hosts == [f"node-{STUCK}"]
        functions, main = _main_frames(odd)
        assert functions[-1] == "stuck_in_data_loading" and main["frames"][-1]["code"] == "time.sleep(600)"
        others = [r for r in range(WORLD) if r != STUCK]
        assert rest.ranks == others and rest.hosts == [f"node-{r}" for r in others]
        functions, _main = _main_frames(rest)
        assert "wait_in_all_reduce" in functions and "stuck_in_data_loading" not in functions
        assert not any(t["own"] for g in answer.groups for t in g.threads)  # profstream's threads left aside

        result = CliRunner().invoke(app, ["stacks", "--run", "hung-run", "--bootstrap", kafka_bootstrap,
                                          "--topic-prefix", topics.prefix, "--timeout-s", "30"])
        assert result.exit_code == 0, result.output
        text = result.output
        assert f"{WORLD} of {WORLD} ranks answered" in text
        first, second = text.index(f"rank {STUCK} (1 of {WORLD}) on node-{STUCK}"), text.index("ranks 0,2 (2 of 3)")
        assert first < text.index("in stuck_in_data_loading\n      time.sleep(600)") < second
        assert second < text.index("in wait_in_all_reduce")

        result = CliRunner().invoke(app, ["stacks", "--run", "hung-run", "--json", "--bootstrap", kafka_bootstrap,
                                          "--topic-prefix", topics.prefix, "--timeout-s", "30"])
        got = json.loads(result.output)
        assert result.exit_code == 0 and [g["ranks"] for g in got["groups"]] == [[STUCK], others], result.output
        frames = next(t for t in got["answered"][str(STUCK)]["threads"] if t["main"])["frames"]
        assert frames[-1]["function"] == "stuck_in_data_loading" and got["missing"] == []


def test_stacks_of_a_run_no_monitor_serves_say_so_in_one_line(kafka_bootstrap, topics):
    result = CliRunner().invoke(app, ["stacks", "--run", "no-such-run", "--bootstrap", kafka_bootstrap,
                                      "--topic-prefix", topics.prefix, "--timeout-s", "30"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no rank of run no-such-run has been seen: no Monitor of it "
                                                   "answered the stacks request"), lines
    assert "check --run" in lines[0] and "30 s" not in lines[0]  # said within seconds, not after the timeout


def test_a_deep_stack_is_cut_to_its_innermost_frames_and_says_so():
    got = {}
    ready, done = threading.Event(), threading.Event()

    def recurse(n):
        if n:
            return recurse(n - 1)
        ready.set()
        done.wait()

    thread = threading.Thread(target=recurse, args=(500,), name="deep")
    thread.start()
    try:
        ready.wait(10)
        # however many threads earlier tests left in this process: none cut, no size halving
        threads, omitted = thread_stacks(max_threads=100_000, max_frames=20, max_bytes=1 << 30)
        got = next(t for t in threads if t["name"] == "deep")
    finally:
        done.set()
        thread.join()
    assert omitted == 0 and len(got["frames"]) == 20 and got["frames_omitted"] > 480
    functions = [f["function"] for f in got["frames"]]
    assert functions[0] == "recurse" and functions[-1] == "wait"  # the outer ones cut, the innermost kept
    assert traceback_lines(got)[0].strip() == f"... {got['frames_omitted']} outer frames left out (a deep stack)"
    request = new_stacks_request("r")  # and the record that carries it decodes whole
    status = new_status(request, FINISHED, 0, threads=threads, threads_omitted=omitted)
    assert decode_control(encode_status(status)) == ("CaptureStatus", status)


def test_the_latest_answer_is_the_newest_request_s_merged_and_says_who_did_not_answer():
    from profstream.control.stacks import latest_answer

    def answer(request, rank, function, ts_ns):
        threads = [{"name": "MainThread", "ident": 1, "native_id": 1, "daemon": False, "main": True, "own": False,
                    "frames": [{"file": "train.py", "line": 9, "function": function, "code": ""}],
                    "frames_omitted": 0}]
        return new_status(request, FINISHED, rank, threads=threads, world_size=4, host=f"node-{rank}", ts_ns=ts_ns)

    old = {**new_stacks_request("r", reason="by hand"), "requester": "alice"}
    hang = {**new_stacks_request("r", reason="TrainingHang firing (alerts topic)"), "requester": "autocapture"}
    statuses = [answer(old, 0, "step", 100), answer(hang, 2, "load", 2_000_000_000), answer(old, 1, "step", 150),
                answer(hang, 0, "all_reduce", 2_100_000_000), answer(hang, 1, "all_reduce", 2_200_000_000),
                new_status(hang, "refused", 3, reason="expired: late", world_size=5, ts_ns=2_150_000_000)]
    got = latest_answer(statuses)
    assert got.request["request_id"] == hang["request_id"] and sorted(got.answered) == [0, 1, 2]
    assert [g.ranks for g in got.groups] == [[2], [0, 1]] and list(got.refused) == [3] and got.missing() == [4]
    lines = stacks_lines(got)
    assert lines[0].startswith("stacks of run r asked by autocapture (TrainingHang firing (alerts topic)): 3 of 5 "
                               "ranks answered from 1970-01-01 00:00:02 UTC within 0.2 s, 2 distinct stacks"), lines[0]
    assert "rank 3 refused: expired: late" in lines and lines[-1].startswith("rank 4 did not answer: the process")
    assert latest_answer([new_status(old, "armed", 0)]) is None

    # a run that hung before its first step closed: the report has no step to show, but its stacks
    import html
    from pathlib import Path

    from profstream.offline.report import ReportData, render

    page = render(ReportData("r", Path("archive"), stacks=got), Path("report.html"))
    text = html.unescape(page[page.index('<pre id="stacks">'):])
    assert "No step of this run" in page and text.index("rank 2 (1 of 3)") < text.index("ranks 0-1 (2 of 3)")


def test_many_threads_are_bounded_in_count_and_size():
    max_bytes = 4096
    stop = threading.Event()
    workers = [threading.Thread(target=stop.wait, name=f"worker-{i:02d}") for i in range(12)]
    for w in workers:
        w.start()
    try:
        threads, omitted = thread_stacks(max_threads=5, max_bytes=max_bytes)
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert len(threads) == 5 and omitted >= 8 and threads[0]["main"]
    assert len(encode_status(new_status(new_stacks_request("r"), FINISHED, 0, threads=threads))) < 2 * max_bytes
    same = group_ranks({0: {"threads": threads, "host": "a"}, 1: {"threads": threads, "host": "b"}})
    assert [(g.ranks, g.hosts) for g in same] == [([0, 1], ["a", "b"])]


def test_ops_requests_and_statuses_without_threads_stay_readable_by_older_monitors_and_sinks():
    """Only a stacks request and its answer need the new schema versions: a Monitor, sink or
    guard from before them keeps reading every request for ops and every other status."""
    from profstream.control.records import encode_request, new_request
    from profstream.schema.codec import VERSIONS

    ops = new_request("r")
    assert encode_request(ops).startswith(VERSIONS[("CaptureRequest", 1)].header)
    assert decode_control(encode_request(ops))[1]["kind"] == "ops"
    stacks = new_stacks_request("r")
    assert encode_request(stacks).startswith(VERSIONS[("CaptureRequest", 2)].header)
    assert decode_control(encode_request(stacks)) == ("CaptureRequest", stacks)
    armed = new_status(ops, "armed", 0)
    assert encode_status(armed).startswith(VERSIONS[("CaptureStatus", 2)].header)
    assert decode_control(encode_status(armed))[1]["threads"] is None


TORCH_SCRIPT = textwrap.dedent('''
    import sys, time
    import torch
    import torch.distributed as dist
    from profstream.integrations.torch_flight import start_flight_reader
    from profstream.producers.monitor import Monitor

    bootstrap, prefix, run_id = sys.argv[1:4]
    stuck = int(sys.argv[6])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    monitor = Monitor(bootstrap=bootstrap, topic_prefix=prefix, run_id=run_id, rank=rank, world_size=world,
                      host=f"node-{rank}", host_sample_interval_s=0, progress_interval_s=1.0)
    # the torch producer's reader of collectives (instrument() starts it): the call a rank sits in
    monitor.collective_reader = start_flight_reader(monitor, 0.5)
    grads = torch.ones(4)
    dist.all_reduce(grads)  # every rank is in the job

    def stuck_before_all_reduce():
        time.sleep(600)

    monitor.begin_step()
    print("entering", flush=True)
    if rank == stuck:
        stuck_before_all_reduce()
    dist.all_reduce(grads)
''')


@pytest.mark.multiproc
def test_stacks_show_the_ranks_in_a_gloo_all_reduce_and_the_one_that_never_came(kafka_bootstrap, topics, tmp_path):
    """The issue's case: torch.distributed (gloo) ranks wait in all_reduce, inside C++ with
    the GIL released, for a rank that sleeps before it. The hang alert names the call (the
    default group's second) and the rank that has not entered it, with its host."""
    pytest.importorskip("torch")
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1"}
    with RunningProcessor(kafka_bootstrap, topics, hang_after_s=3.0), \
            Ranks(kafka_bootstrap, topics, "gloo-run", tmp_path, TORCH_SCRIPT, env) as ranks:
        wait_until(ranks.entered, 120, "every rank to reach its blocking call")
        [firing] = read_full(kafka_bootstrap, topics.alerts,
                             lambda a: a["run_id"] == "gloo-run" and a["name"] == HANG_ALERT, 1, 60,
                             decode=lambda v: decode("Alert", v), what="TrainingHang alerts")
        others = [r for r in range(WORLD) if r != STUCK]
        summary = firing["summary"]
        assert f"ranks {', '.join(map(str, others))} (hosts {', '.join(f'node-{r}' for r in others)}) in " \
               f"all_reduce of group 0, seq 2 for" in summary, summary
        assert summary.endswith(f"not entered: rank {STUCK} (host node-{STUCK}) in step 0, in no collective"), summary
        answer = ask_stacks(kafka_bootstrap, topics, "gloo-run", timeout_s=30)
        assert answer.missing() == [] and len(answer.groups) == 2, stacks_lines(answer)
        odd, rest = answer.groups
        functions, main = _main_frames(odd)
        assert odd.ranks == [STUCK] and odd.hosts == [f"node-{STUCK}"]
        assert functions[-1] == "stuck_before_all_reduce" and main["frames"][-1]["code"] == "time.sleep(600)"
        functions, _main = _main_frames(rest)
        assert rest.ranks == [r for r in range(WORLD) if r != STUCK] and "all_reduce" in functions, functions


def test_a_stacks_request_read_after_it_expired_is_refused_not_answered_with_stacks_of_now(kafka_bootstrap, topics):
    """A reader cut off from Kafka for a while reads old stacks requests when it is back:
    the stacks of now would answer a question nobody is waiting on any more."""
    import time

    from profstream.control.client import follow, send_request
    from profstream.producers.monitor import Monitor

    monitor = Monitor(bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, run_id="late-run", rank=0,
                      world_size=1, host_sample_interval_s=0)
    try:
        wait_until(lambda: monitor.stats()["control_connected"], 30, "the control reader to connect")
        old = new_stacks_request("late-run", expires_s=1.0, now_ns=time.time_ns() - 5 * 10**9)
        send_request(kafka_bootstrap, topics, old)
        progress = follow(kafka_bootstrap, topics, old, timeout=30)
        status = progress.ranks[0]
        assert status["state"] == "refused" and status["reason"].startswith("expired: ") and status["threads"] is None
        fresh = new_stacks_request("late-run")
        send_request(kafka_bootstrap, topics, fresh)
        assert follow(kafka_bootstrap, topics, fresh, timeout=30).ranks[0]["threads"]
        stats = monitor.stats()
        assert (stats["stacks_refused"], stats["stack_dumps"], stats["capture_requests"]) == (1, 1, 0)
    finally:
        monitor.close(timeout=10)
