"""SIGTERM and the signals launchers send (issue 37): torchrun, Slurm and Kubernetes send
SIGTERM and wait before SIGKILL. A Monitor told to end flushes within bounds and its end mark
says why; `profstream run` passes every catchable signal on to the training process and
never leaves it behind. Real processes, no broker: the Monitors record to a spool."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from profstream.producers.spool import Spool
from profstream.producers.spool_publish import rank_folders
from profstream.schema.batch import END_MARK, decode_batch
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
       "PYTHONUNBUFFERED": "1"}


def spooled_marks(spool_dir: Path) -> dict[int, list[tuple[int, int]]]:
    """Per rank, the (step, end_signal) of every step mark in the spool, in the order sent."""
    out: dict[int, list[tuple[int, int]]] = {}
    for _run, rank, path in rank_folders(spool_dir):
        spool = Spool(path, 1 << 62, write=False)
        try:
            while (record := spool.next_record()) is not None:
                spool.advance(record)
                steps = decode_batch(record.value).steps
                out.setdefault(rank, []).extend(zip(steps["step"].tolist(), steps["end_signal"].tolist()))
        finally:
            spool.close()
    return out


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie waiting for its reaper has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


# A fast loop under a Monitor: it notes each finished step in a file, for the test to know
# what it finished before the signal.
LOOP = '''
import os, signal, sys, time
from profstream import Monitor
spool, handler = sys.argv[1], sys.argv[2]
if handler == "own":  # the program's own handler, there before the Monitor: stop after this step
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
mon = Monitor(run_id="sig", rank=0, spool_dir=spool, record_only=True, host_sample_interval_s=0,
              buffer_bytes="256MiB")
done = os.open(spool + ".done", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
step = 0
while handler != "own" or not stop:
    with mon.step():
        for i in range(50):
            mon.op("matmul", time.time_ns(), 10)
    os.write(done, b"%d\\n" % step)
    step += 1
mon.close()
print("closed after the program's handler", flush=True)
'''


@pytest.mark.parametrize("handler", ["default", "own"])
def test_sigterm_keeps_every_finished_step_and_the_end_mark_says_sigterm(tmp_path, handler):
    """A fast loop killed with SIGTERM lost up to 75 finished steps, counted nowhere. Now the
    Monitor flushes (within 5 s) and closes; every step it finished has its mark, and its end
    mark says SIGTERM. With a handler of the program's own, that handler runs after the
    flush and the program ends as it chooses."""
    spool = tmp_path / "spool"
    proc = subprocess.Popen([sys.executable, "-c", LOOP, str(spool), handler], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    done = Path(f"{spool}.done")
    wait_until(lambda: done.exists() and done.read_text().count("\n") >= 200, 60, "200 steps")
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - started
    finished = [int(x) for x in done.read_text().split()]
    assert took < 10, f"it took {took:.1f} s to end"
    assert proc.returncode == (0 if handler == "own" else -signal.SIGTERM), err[-2000:]  # dead of SIGTERM
    assert "SIGTERM: " in err and ("closing" if handler == "default" else "flushing") in err
    marks = spooled_marks(spool)[0]
    steps = [s for s, _ in marks if s != END_MARK]
    assert steps == list(range(len(steps))) and len(steps) >= len(finished)  # every finished step, no gap
    assert marks[-1] == (END_MARK, signal.SIGTERM)
    if handler == "own":
        assert "closed after the program's handler" in out


def test_a_sigterm_the_program_ignores_stays_ignored(tmp_path):
    script = LOOP.replace('if handler == "own":', 'signal.signal(signal.SIGTERM, signal.SIG_IGN)\nif False:')
    spool = tmp_path / "spool"
    proc = subprocess.Popen([sys.executable, "-c", script, str(spool), "default"], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        done = Path(f"{spool}.done")
        wait_until(lambda: done.exists() and done.read_text().count("\n") >= 50, 60, "50 steps")
        proc.send_signal(signal.SIGTERM)
        before = done.read_text().count("\n")
        wait_until(lambda: done.read_text().count("\n") > before + 50, 30, "the loop going on")
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.communicate(timeout=30)


CATCHER = '''
import os, signal, sys, time
got = sys.argv[1]
def note(signum, frame):
    with open(got, "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT, signal.SIGINT):
    signal.signal(s, note)
open(got + ".pid", "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
'''


def _profstream_run(*command: str, options: tuple[str, ...] = ("--bootstrap", "127.0.0.1:1")) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "profstream.cli", "run", *options, "--", *command], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_profstream_run_passes_every_catchable_signal_on_and_exits_with_the_scripts_status(tmp_path):
    got = tmp_path / "got"
    wrapper = _profstream_run(sys.executable, "-c", CATCHER, str(got))
    try:
        wait_until(lambda: Path(f"{got}.pid").exists(), 60, "the script to start")
        sent = ["SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGINT"]
        for i, name in enumerate(sent):
            wrapper.send_signal(signal.Signals[name])
            wait_until(lambda i=i: got.exists() and got.read_text().count("\n") > i, 10, f"{name} to reach the script")
        assert got.read_text().split() == sent  # each once, in order
        wrapper.send_signal(signal.SIGTERM)  # the script's default: it ends, and so does the wrapper, with its status
        _out, err = wrapper.communicate(timeout=30)
    finally:
        wrapper.kill()
    assert wrapper.returncode == 128 + signal.SIGTERM, err
    assert "passed SIGTERM on to" in err and f"exited with status {128 + signal.SIGTERM}" in err
    assert gone(int(Path(f"{got}.pid").read_text()))


# A training script with DataLoader workers: it says its pid once it has trained a few steps.
TRAINING = '''
import os, sys, time, torch
class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 10**6
    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.ones(8)
loader = torch.utils.data.DataLoader(Slow(), batch_size=4, num_workers=2)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step, x in enumerate(loader):
    optimizer.zero_grad()
    model(x).sum().backward()
    optimizer.step()
    if step == 5:
        open(sys.argv[1], "w").write(str(os.getpid()))
'''


def _training(tmp_path: Path) -> tuple[subprocess.Popen, int, list[int], Path]:
    """`profstream run` of TRAINING recording to a spool: (wrapper, training pid, its workers, spool)."""
    pytest.importorskip("torch")
    ready, spool = tmp_path / "ready", tmp_path / "spool"
    wrapper = _profstream_run(sys.executable, "-c", TRAINING, str(ready),
                              options=("--spool-dir", str(spool), "--record-only", "--no-capture-ops"))
    wait_until(lambda: ready.exists() and ready.read_text() or wrapper.poll() is not None, 120,
               "the training to start")
    assert wrapper.poll() is None, wrapper.communicate()[1][-3000:]
    pid = int(ready.read_text())
    workers = wait_until(lambda: len(children(pid)) >= 2 and children(pid), 30, "its DataLoader workers")
    return wrapper, pid, workers, spool


def test_sigterm_to_profstream_run_ends_the_training_with_its_end_mark_and_leaves_nothing_running(tmp_path):
    wrapper, pid, workers, spool = _training(tmp_path)
    try:
        wrapper.send_signal(signal.SIGTERM)
        _out, err = wrapper.communicate(timeout=60)
    finally:
        wrapper.kill()
    assert wrapper.returncode == 128 + signal.SIGTERM, err[-3000:]
    wait_until(lambda: all(gone(p) for p in [pid, *workers]), 30, f"the training {pid} and its workers {workers}")
    marks = spooled_marks(spool)[0]
    steps = [s for s, _ in marks if s != END_MARK]
    assert steps == list(range(len(steps))) and len(steps) >= 5
    assert marks[-1] == (END_MARK, signal.SIGTERM)


def test_killing_profstream_run_takes_the_training_and_its_workers_with_it(tmp_path):
    wrapper, pid, workers, _spool = _training(tmp_path)
    try:
        wrapper.send_signal(signal.SIGKILL)  # what a launcher does once its grace is over
        wrapper.communicate(timeout=30)
        # the training dies with it; its workers see their parent gone (within 5 s) and exit
        wait_until(lambda: all(gone(p) for p in [pid, *workers]), 60,
                   f"the training {pid} and its workers {workers} to end")
    finally:
        for p in [pid, *workers]:
            if not gone(p):
                os.kill(p, signal.SIGKILL)
    assert np.all([gone(p) for p in [pid, *workers]])


@pytest.mark.parametrize("procs", [1, 2])
def test_sigterm_ends_simulate_with_its_summary_and_each_ranks_end_mark(kafka_bootstrap, topics, procs):
    """`simulate` exited 143 on SIGTERM with no summary and its buffered steps lost; now it
    ends the run as a run ends, says what it sent and dropped, and exits 143."""
    from tests.helpers import raw_batches, topic_size

    proc = subprocess.Popen([sys.executable, "-m", "profstream.cli", "simulate", "--bootstrap", kafka_bootstrap,
                             "--topic-prefix", topics.prefix, "--run-id", "term", "--ranks", "2", "--steps", "100000",
                             "--ops-per-step", "50", "--step-time-ms", "20", "--rate", "realtime", "--procs",
                             str(procs)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: topic_size(kafka_bootstrap, topics.raw) >= 20 or proc.poll() is not None, 120,
                   "the run's first batches")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "ended by SIGTERM" in out and "dropped ops: 0, samples: 0" in out and "all delivered" in out, out
    batches = raw_batches(kafka_bootstrap, topics.raw, "term", topic_size(kafka_bootstrap, topics.raw))
    for rank in (0, 1):
        marks = [(int(s), int(e)) for b in batches if b.rank == rank
                 for s, e in zip(b.steps["step"], b.steps["end_signal"])]
        steps = [s for s, _ in marks if s != END_MARK]
        assert steps == list(range(len(steps))) and steps, rank
        assert marks[-1] == (END_MARK, signal.SIGTERM)
