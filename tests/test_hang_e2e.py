"""A hang told while no step ends, through the real broker: rank processes with real
Monitors send RankProgress from their control threads, a Processor (both stages, in this
process) commits one TrainingHang alert naming the ranks and resolves it when they stop
reporting; a healthy run beside it gets no alert. Progress every 1 s (silent after 3 s):
a rank's thread held up a second on a loaded machine is no silent rank."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from profstream.kafka.clients import read_topic
from profstream.processors.hangs import HANG_ALERT
from profstream.schema.codec import decode
from tests.helpers import read_full, wait_until
from tests.test_processor import RunningProcessor

WORLD = 3
STUCK = 1

# Every rank but STUCK: 3 steps, then step 3 begun and a wait (as in a collective whose peer
# never comes). STUCK: 1 step, a second between steps, then step 1 begun and a sleep.
# "healthy": steps of 20 ms until killed.
RANK_SCRIPT = textwrap.dedent('''
    import sys, threading, time
    from profstream.producers.monitor import Monitor

    bootstrap, prefix, run_id, mode = sys.argv[1:5]
    rank, world, stuck = (int(a) for a in sys.argv[5:8])
    monitor = Monitor(bootstrap=bootstrap, topic_prefix=prefix, run_id=run_id, rank=rank, world_size=world,
                      host=f"node-{rank}", host_sample_interval_s=0, progress_interval_s=1.0)
    print("started", flush=True)
    if mode == "healthy":
        while True:
            with monitor.step():
                time.sleep(0.02)

    def wait_in_all_reduce():
        threading.Event().wait()

    if rank == stuck:
        with monitor.step():
            pass
        time.sleep(1.0)
        monitor.begin_step()
        print("entering", time.time_ns(), flush=True)
        time.sleep(600)
    for step in range(3):
        monitor.begin_step()
        monitor.end_step()
    monitor.begin_step()
    print("entering", time.time_ns(), flush=True)
    wait_in_all_reduce()
''')


class Ranks:
    """Rank processes of one run; killed on exit (or by kill())."""

    def __init__(self, bootstrap, topics, run_id, mode, world, tmp_path):
        path = tmp_path / f"rank-{run_id}.py"
        path.write_text(RANK_SCRIPT)
        self.procs = [subprocess.Popen([sys.executable, str(path), bootstrap, topics.prefix, run_id, mode, str(r),
                                        str(world), str(STUCK)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True) for r in range(world)]
        self.lines: list[list[str]] = [[] for _ in self.procs]
        for proc, lines in zip(self.procs, self.lines):
            threading.Thread(target=lambda p=proc, out=lines: out.extend(p.stdout), daemon=True).start()

    def __enter__(self):
        return self

    def said(self, word: str) -> bool:
        for proc, lines in zip(self.procs, self.lines):
            if proc.poll() is not None and proc.returncode != -9:
                raise AssertionError(f"a rank exited {proc.returncode}: {''.join(lines)[-3000:]}")
        return all(any(line.startswith(word) for line in lines) for lines in self.lines)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(10)

    def __exit__(self, *exc):
        self.kill()


def _hang_alerts(bootstrap, topics, run_id, count, timeout, full=True):
    return (read_full if full else read_topic)(
        bootstrap, topics.alerts, lambda a: a["run_id"] == run_id and a["name"] == HANG_ALERT, count, timeout,
        decode=lambda v: decode("Alert", v))


def test_a_hang_is_alerted_while_no_step_ends_naming_the_ranks_and_their_hosts(kafka_bootstrap, topics, tmp_path):
    with RunningProcessor(kafka_bootstrap, topics, hang_after_s=3.0) as processor, \
            Ranks(kafka_bootstrap, topics, "healthy-run", "healthy", 2, tmp_path) as healthy, \
            Ranks(kafka_bootstrap, topics, "hung-run", "hang", WORLD, tmp_path) as hung:
        wait_until(lambda: hung.said("entering") and healthy.said("started"), 60, "every rank to block")
        [firing] = _hang_alerts(kafka_bootstrap, topics, "hung-run", 1, 60)
        assert firing["state"] == "firing" and firing["step"] == 3 and firing["rank"] is None
        summary = firing["summary"]
        others = [r for r in range(WORLD) if r != STUCK]
        assert f"ranks {', '.join(map(str, others))} (hosts {', '.join(f'node-{r}' for r in others)}) in step 3" \
            in summary, summary
        assert f"rank {STUCK} (host node-{STUCK}) in step 1" in summary, summary
        ev = firing["evidence"]
        assert ev["ranks_in_step"] == WORLD - 1 and ev[f"rank.{STUCK}.step"] == 1.0
        assert max(ev[f"rank.{r}.in_step_s"] for r in others) > 3.0  # the first past the threshold fired it

        # the healthy run reports all along and gets nothing
        stage = processor.run_stage
        wait_until(lambda: (run := stage.runs.get("healthy-run")) is not None and run.hangs is not None
                   and len(run.hangs.places) == 2, 30, "the healthy run's ranks to report")
        assert _hang_alerts(kafka_bootstrap, topics, "healthy-run", 1, 2, full=False) == []

        # the hung job is killed: its ranks go silent (3 intervals) and the hang resolves, once
        hung.kill()
        alerts = _hang_alerts(kafka_bootstrap, topics, "hung-run", 2, 60)
        assert [a["state"] for a in alerts] == ["firing", "resolved"] and alerts[1]["step"] == 3
        assert _hang_alerts(kafka_bootstrap, topics, "healthy-run", 1, 1, full=False) == []
