"""Capture requests to real torch CPU training loops, through the real broker.

Two ranks run the loop of test_torch.py as separate processes (torch.profiler is one per
process), instrumented with op capture on request only; a request for one rank mid-run
must give torch ops for exactly its steps on exactly that rank, and the asked rank's trained
weights must equal those of the rank that was not asked (test_torch.py compares an
instrumented loop with a plain one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from profstream.control.client import follow, send_request
from profstream.control.records import new_request, parse_ranks
from tests.helpers import raw_batches, wait_until
from tests.test_capture import steps_with_ops
from tests.test_torch import LOOP, ROOT, make

torch = pytest.importorskip("torch")

SCRIPT = LOOP + textwrap.dedent('''
    import json, os, sys, time
    torch.set_num_threads(1)
    steps = int(sys.argv[1])
    model, optimizer, loader = make(steps, slow=range(steps), delay_s=0.03)
    hold_at, go = int(os.environ.get("HOLD_AT", "-1")), os.environ.get("GO_FILE", "")
    forwards = [0]

    def hold(module, args):  # the step before HOLD_AT waits (60 s at most) for the test's go
        if forwards[0] == hold_at - 1:
            deadline = time.monotonic() + 60
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.01)
        forwards[0] += 1

    model.register_forward_pre_hook(hold)
    import profstream.torch as pst
    with pst.instrument(model, optimizer, loader, **json.loads(os.environ["OPTIONS"])) as handle:
        train(model, optimizer, loader)
    error = None if handle.error is None else repr(handle.error)
    print(json.dumps({"digest": [float(p.double().sum()) for p in model.parameters()], "error": error}))
''')


def _rank(tmp_path, steps, rank, options, hold_at=-1):
    """A rank's process; ``hold_at``: its step before that one waits for ``tmp_path/go``."""
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", OPTIONS=json.dumps(options),
               PYTHONPATH=str(ROOT), HOLD_AT=str(hold_at), GO_FILE=str(tmp_path / "go"))
    return subprocess.Popen([sys.executable, str(script), str(steps)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_request_for_one_rank_gives_its_torch_ops_for_exactly_the_asked_steps(kafka_bootstrap, topics, tmp_path):
    steps, first, count = 80, 40, 4
    options = {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix, "run_id": "torch-asked",
               "scheduled_capture": False, "host_sample_interval_s": 0}
    # both ranks wait before step `first` until rank 1 answered the request, so that a loaded
    # machine's slow start or request delivery cannot let that step pass before it arrives
    procs = [_rank(tmp_path, steps, r, options, hold_at=first) for r in (0, 1)]

    def go(progress):
        if 1 in progress.times:
            (tmp_path / "go").touch()

    try:
        # both Monitors exist once both ranks have sent a batch: a request from now on reaches them
        wait_until(lambda: {b.rank for b in raw_batches(kafka_bootstrap, topics.raw, "torch-asked", 2, timeout=1, full=False)}
                   == {0, 1}, 120, "a batch of each rank")
        request = new_request("torch-asked", ranks=parse_ranks("1"), start_step=first, steps=count)
        send_request(kafka_bootstrap, topics, request)
        progress = follow(kafka_bootstrap, topics, request, timeout=120, on_change=go)
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = []
    for (stdout, stderr), p in zip(outputs, procs):
        assert p.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    assert [r["error"] for r in results[:2]] == [None, None]
    assert results[0]["digest"] == results[1]["digest"]  # training untouched by the capture
    assert progress.done() and list(progress.ranks) == [1]
    status = progress.ranks[1]
    assert (status["state"], status["first_step"], status["last_step"]) == ("finished", first, first + count - 1)
    sent = steps_with_ops(raw_batches(kafka_bootstrap, topics.raw, "torch-asked", 10**6, timeout=5, full=False))
    assert list(sent) == [1] and sorted(sent[1]) == list(range(first, first + count))
    assert status["ops"] == sum(sent[1].values()) > 0


def test_a_request_beside_the_schedule_adds_its_steps_with_its_own_profiler_settings(kafka_bootstrap, topics):
    import profstream.torch as pst
    from profstream.integrations import torch_capture

    steps = 40
    model, optimizer, loader = make(steps, slow=range(steps), delay_s=0.02)
    handle = pst.instrument(model, optimizer, loader, bootstrap=kafka_bootstrap, topic_prefix=topics.prefix,
                            run_id="torch-both", every_n_steps=10, host_sample_interval_s=0)
    started = []
    real_start = torch_capture.OpCapture._start_profiler

    def start_profiler(capture, settings):  # which settings each profiler started with
        started.append((capture._upcoming, settings["record_shapes"]))
        real_start(capture, settings)

    result = {}
    armed = threading.Event()  # the rank took the request: step 12 is still ahead of it

    def note(progress):
        if 0 in progress.times:
            armed.set()

    def ask():
        wait_until(lambda: handle.monitor is not None and handle.monitor.current_step >= 2, 60, "step 2")
        request = new_request("torch-both", start_step=12, steps=3, record_shapes=True)
        send_request(kafka_bootstrap, topics, request)
        result["progress"] = follow(kafka_bootstrap, topics, request, timeout=60, on_change=note)

    asker = threading.Thread(target=ask)
    try:
        torch_capture.OpCapture._start_profiler = start_profiler
        asker.start()
        # train()'s loop, held before step 11 until the rank has answered, so that a loaded
        # machine's slow request delivery cannot let step 12 pass before the request arrives
        for step, (x, y) in enumerate(loader):
            if step == 11:
                armed.wait(60)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        asker.join(90)
    finally:
        torch_capture.OpCapture._start_profiler = real_start
        handle.close()
    assert handle.error is None
    status = result["progress"].ranks[0]
    assert (status["state"], status["first_step"], status["last_step"]) == ("finished", 12, 14)
    sent = steps_with_ops(raw_batches(kafka_bootstrap, topics.raw, "torch-both", 10**6, timeout=5, full=False))
    assert sorted(sent[0]) == [0, 10, 12, 13, 14, 20, 30]  # the schedule's steps and the request's, once each
    assert status["ops"] == sum(sent[0][s] for s in (12, 13, 14))
    # the request's steps had a profiler of their own (record_shapes), the schedule went on after
    assert (12, True) in started and any(step > 14 and not shapes for step, shapes in started)
    assert np.all([not shapes for step, shapes in started if step < 12])
