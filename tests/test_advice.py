"""Why the data queue starved, and what to do (processors/host.py, advice.py): every rule gets
its signature and no other advice, from the simulator (each fault injected with known host and
data-loader readings) and from real PyTorch DataLoader jobs on CPU (workers busy in a
transform, workers asleep in __getitem__, batches ready and a slow copy to the device)."""

from __future__ import annotations

import statistics
import time

import pytest

from profstream.processors.stream import RawMessage, figures
from profstream.producers.monitor import Monitor
from profstream.producers.sender import Sender
from profstream.schema.codec import VERSIONS, decode
from profstream.simulate import SimConfig, expected, plan_run, record_step
from profstream.simulate_resources import ADVICE, FAULTS
from tests.helpers import IdleSender, simulated_messages


def _outputs(messages) -> tuple[dict, list[dict], list[bytes]]:
    """({(rank, step): StepMetrics}, the alerts, the StepMetrics messages)."""
    steps, alerts, raw = {}, [], []
    for f in figures(messages):
        if f.kind == "steps":
            m = decode("StepMetrics", f.value)
            steps[(m["rank"], m["step"])] = m
            raw.append(f.value)
        elif f.kind == "alerts":
            alerts.append(decode("Alert", f.value))
    return steps, alerts, raw


@pytest.mark.parametrize("fault", [*FAULTS, None])
def test_each_starving_signature_gets_its_advice_and_no_other(fault):
    cfg = SimConfig(run_id=f"advice-{fault}", ranks=2, steps=16, ops_per_step=30, stall=(4, 11), resources=True,
                    loader_fault=fault, comm_tail=(14, 15))
    steps, alerts, raw = _outputs(simulated_messages(cfg))
    truth = expected(cfg)
    assert len(steps) == 2 * 16
    for key, m in steps.items():
        want = truth[key]
        assert [a["rule"] for a in m["advice"]] == want["advice"], key
        got, truth_of = dict(m["resources"]), dict(want["resources"])
        each, truth_each = got.pop("per_worker"), truth_of.pop("per_worker")
        assert got == pytest.approx(truth_of), key
        assert len(each) == len(truth_each) and all(w == pytest.approx(t) for w, t in zip(each, truth_each)), key
        for a in m["advice"]:  # each line names the figures it read and the rule it follows
            assert a["figures"] and a["source"].startswith("MindSpore")
    assert all(r[:10] == VERSIONS[("StepMetrics", 9)].header for r in raw)  # each worker's figures
    firing = [a for a in alerts if a["name"] == "DataQueueStall" and a["state"] == "firing"]
    assert len(firing) == 2  # one per rank, at the 5th starved step
    for a in firing:
        if fault is None:  # the figures do not say why: the alert says what it always said
            assert a["summary"].endswith("(since step 4)")
        else:
            line = steps[(a["rank"], a["step"])]["advice"][0]
            assert line["rule"] == ADVICE[fault] and line["text"][1:] in a["summary"]
            assert all(a["evidence"][f"{line['rule']}.{k}"] == v for k, v in line["figures"].items())


def test_busy_workers_on_a_thrashing_machine_are_told_fewer_threads_not_more_workers():
    """Workers wait for a CPU on a machine that thrashes: runnable, so they look busy, but more
    of them would make it worse. The advice says too many threads and not the opposite."""
    from types import SimpleNamespace

    from profstream.processors.advice import step_advice

    record = {"starved": True, "step_time_ns": 100 * 10**6, "data_wait_ns": 60 * 10**6, "tail_ns": 0,
              "pure_comm_ns": None}
    no_queue = SimpleNamespace(queue_names=[])
    busy = {"workers": 4, "worker_runnable_mean": 0.95, "worker_s_per_batch": 0.2, "cpu_count": 8}
    calm = {**busy, "cpu_system": 0.05, "ctx_switches_per_s": 8 * 1000.0}
    thrashing = {**busy, "cpu_system": 0.45, "ctx_switches_per_s": 8 * 60000.0}
    assert [a["rule"] for a in step_advice(record, no_queue, calm)] == ["more_workers"]
    assert [a["rule"] for a in step_advice(record, no_queue, thrashing)] == ["threads"]


def test_a_step_without_readings_of_its_own_uses_the_ranks_latest_for_ten_seconds():
    """Readings come every second: a short step often has none of its own. Its advice reads
    the rank's latest (its resources stay null: not measured in it), for 10 s at most."""
    cfg = SimConfig(run_id="sparse", ranks=1, steps=14, ops_per_step=20, step_time_ms=1500.0, stall=(2, 13),
                    resources=True, loader_fault="cpu_bound")
    mon = Monitor(run_id=cfg.run_id, rank=0, world_size=1, bootstrap="127.0.0.1:1", host_sample_interval_s=0,
                  control=False, native=False, device_interval_ms=0, sender_factory=IdleSender)
    sender = Sender(mon)
    messages = []
    for plan in plan_run(cfg, 1_790_000_000 * 10**9):
        if plan.step not in (0, 2):
            plan.readings = None  # readings of steps 0 and 2 only
        record_step(mon, plan)
        while sender._pending or sender._build():
            messages.append(RawMessage(0.0, 0, len(messages), mon.key, sender._pending.popleft()[0]))
    steps, _alerts, _raw = _outputs(messages)
    read_at = steps[(0, 2)]["end_ns"]  # the latest figures, of step 2 (starved steps take 2.4 s here)
    assert 4 <= sum(1 for m in steps.values() if 0 < m["end_ns"] - read_at <= 10e9) < 11
    for (_, step), m in steps.items():
        assert (m["resources"] is not None) == (step in (0, 2))
        within = step >= 2 and m["end_ns"] - read_at <= 10e9
        assert [a["rule"] for a in m["advice"]] == (["more_workers"] if within else []), step


def test_a_run_without_readings_or_stalls_gets_no_advice_and_keeps_its_older_versions():
    steps, alerts, raw = _outputs(simulated_messages(SimConfig(run_id="calm", ranks=1, steps=6, ops_per_step=20)))
    assert all(m["advice"] == [] and m["resources"] is None for m in steps.values())
    assert not any(r[:10] == VERSIONS[("StepMetrics", 8)].header for r in raw) and not alerts


def test_the_exporter_shows_the_latest_host_and_loader_figures_and_the_advice_while_it_lasts():
    from collections import namedtuple

    from profstream.kafka.topics import Topics
    from profstream.sinks.prometheus import ExporterState
    from tests.test_prometheus_sink import Scrape

    Rec = namedtuple("Rec", "topic partition offset timestamp value")
    cfg = SimConfig(run_id="exp", ranks=2, steps=12, ops_per_step=20, stall=(3, 11), resources=True,
                    loader_fault="cpu_bound")
    topics = Topics("adv")
    state = ExporterState(topics)
    now_ms = time.time_ns() // 10**6
    values = [f.value for f in figures(simulated_messages(cfg)) if f.kind == "steps"]
    state.handle([Rec(topics.steps, 0, i, now_ms, v) for i, v in enumerate(values)])
    s = Scrape(state.exposition().decode())
    truth = expected(cfg)[(0, 11)]["resources"]
    rank = {"run": "exp", "rank": "0"}
    assert s("profstream_host_cpu_ratio", mode="user", **rank) == truth["cpu_user"]
    assert s("profstream_host_cpu_ratio", mode="iowait", **rank) == truth["cpu_iowait"]
    assert s("profstream_loader_workers", **rank) == 2
    assert s("profstream_loader_worker_runnable_ratio", stat="mean", **rank) == truth["worker_runnable_mean"]
    assert s("profstream_loader_seconds_per_batch", **rank) == truth["worker_s_per_batch"]
    assert [(x.labels["worker"], x.value) for x in s.all("profstream_loader_worker_seconds_per_batch", **rank)] == [
        (str(w["worker"]), w["s_per_batch"]) for w in truth["per_worker"]]
    assert s("profstream_context_switches_per_second", **rank) == truth["ctx_switches_per_s"]
    assert [x.labels["rule"] for x in s.all("profstream_advice", **rank)] == ["more_workers"]
    # a healthy step after it: the advice goes, the figures stay those of the latest readings
    healthy = SimConfig(run_id="exp", ranks=2, steps=1, first_step=12, ops_per_step=20, resources=True)
    later = [f.value for f in figures(simulated_messages(healthy)) if f.kind == "steps"]
    state.handle([Rec(topics.steps, 0, 100 + i, now_ms, v) for i, v in enumerate(later)])
    s = Scrape(state.exposition().decode())
    assert s.all("profstream_advice", **rank) == [] and s("profstream_loader_workers", **rank) == 2


def test_each_loader_worker_has_its_own_seconds_per_batch_absent_where_none_was_counted():
    """A slow worker among fast ones is told apart (StepMetrics v9 per_worker, the exporter's
    loader_worker_seconds_per_batch{worker}); a worker that counted no batch, or none it
    finished, has no seconds per batch, never 0; the pooled figure stays as it was."""
    from collections import namedtuple

    from profstream.kafka.topics import Topics
    from profstream.schema.batch import MACHINE
    from profstream.sinks.prometheus import ExporterState
    from tests.test_prometheus_sink import Scrape

    cfg = SimConfig(run_id="workers", ranks=1, steps=3, ops_per_step=20, resources=True)
    mon = Monitor(run_id=cfg.run_id, rank=0, world_size=1, bootstrap="127.0.0.1:1", host_sample_interval_s=0,
                  control=False, native=False, device_interval_ms=0, sender_factory=IdleSender)
    sender = Sender(mon)
    nan = float("nan")
    # (worker, pid, interval_s, cpu, runnable, batches, ctx_switches_per_s, cpu_count)
    rows = [(0, 100, 1.0, 0.9, 1.0, 4, nan, -1), (0, 100, 0.5, 0.8, 1.0, 1, nan, -1),  # 1.5 s, 5 batches
            (1, 101, 1.0, 0.95, 1.0, 1, nan, -1),  # the slow one: 1 s a batch
            (2, 102, 1.0, nan, nan, -1, nan, -1),  # its batches not counted
            (3, 103, 1.0, 0.1, 0.1, 0, nan, -1),  # counted, none finished
            (MACHINE, -1, 1.0, nan, nan, -1, 4000.0, 8)]
    messages = []
    for plan in plan_run(cfg, 1_790_000_000 * 10**9):
        plan.readings = None
        record_step(mon, plan)
        if plan.step == 1:
            for row in rows:
                mon.loader_sample(row, ts_ns=(plan.start_ns + plan.end_ns) // 2, step=plan.step)
        while sender._pending or sender._build():
            messages.append(RawMessage(0.0, 0, len(messages), mon.key, sender._pending.popleft()[0]))
    steps, _alerts, raw = _outputs(messages)
    r = steps[(0, 1)]["resources"]
    assert r["per_worker"] == [
        {"worker": 0, "readings": 2, "batches": 5, "s_per_batch": pytest.approx(0.3),
         "cpu_s_per_batch": pytest.approx((0.9 + 0.4) / 5)},
        {"worker": 1, "readings": 1, "batches": 1, "s_per_batch": 1.0, "cpu_s_per_batch": 0.95},
        {"worker": 2, "readings": 1, "batches": None, "s_per_batch": None, "cpu_s_per_batch": None},
        {"worker": 3, "readings": 1, "batches": 0, "s_per_batch": None, "cpu_s_per_batch": None}]
    assert r["workers"] == 4 and r["worker_s_per_batch"] == pytest.approx((1.5 + 1.0 + 1.0) / 6)  # pooled
    assert [m["resources"] for (_, step), m in steps.items() if step != 1] == [None, None]
    assert sum(x[:10] == VERSIONS[("StepMetrics", 9)].header for x in raw) == 1  # the others as before

    Rec = namedtuple("Rec", "topic partition offset timestamp value")
    topics = Topics("workers")
    state = ExporterState(topics)
    now_ms = time.time_ns() // 10**6
    state.handle([Rec(topics.steps, 0, i, now_ms, v) for i, v in enumerate(raw)])
    s = Scrape(state.exposition().decode())
    series = {x.labels["worker"]: x.value for x in s.all("profstream_loader_worker_seconds_per_batch",
                                                            run="workers", rank="0")}
    assert series == {"0": pytest.approx(0.3), "1": 1.0}  # workers 2 and 3: no series, not 0


def test_the_grafana_annotation_of_a_firing_stall_says_what_to_do_and_the_figures_read():
    from profstream.sinks.grafana import Grafana, GrafanaAnnotationSink
    from tests.helpers import wait_until
    from tests.test_grafana_client import TOKEN, Feed, GrafanaDouble

    cfg = SimConfig(run_id="annotated", ranks=1, steps=10, ops_per_step=20, stall=(2, 9), resources=True,
                    loader_fault="transfer")
    alerts = [decode("Alert", f.value) for f in figures(simulated_messages(cfg)) if f.kind == "alerts"]
    firing = [a for a in alerts if a["state"] == "firing"]
    assert len(firing) == 1
    feed = Feed()
    with GrafanaDouble() as grafana:
        sink = GrafanaAnnotationSink(Grafana(grafana.url, TOKEN, timeout=2.0), backoff_s=(0.05, 0.2),
                                     close_timeout_s=0.5)
        try:
            sink.handle([feed("p.alerts", "Alert", firing[0])])
            bodies = wait_until(lambda: grafana.annotation_bodies() or None, 10, "the alert's annotation")
        finally:
            sink.close()
    [body] = bodies
    assert body["tags"][:4] == ["profstream", "alert", "DataQueueStall", "firing"]
    assert "moving the batch to the device is the limit: pin_memory=True" in body["text"]
    assert "transfer.queue_at_start=8" in body["text"] and "transfer.queue_capacity=8" in body["text"]
    assert "num_workers" not in body["text"]  # that advice and no other


def test_the_timeline_files_have_a_counter_track_per_reading_with_its_values(tmp_path):
    from profstream.simulate_resources import readings
    from profstream.sinks.timeline import TimelineSink
    from tests.test_timeline import Rec, check_trace_format, feed, files, ns, read_trace

    cfg = SimConfig(run_id="tl-host", ranks=1, steps=6, ops_per_step=20, stall=(2, 5), resources=True,
                    loader_fault="input_io")
    sink = TimelineSink(tmp_path)
    feed(sink, [Rec("t.raw", m.partition, m.offset, m.key, m.value) for m in simulated_messages(cfg)])
    sink.close()
    got: dict = {}
    for p in files(tmp_path):
        doc = read_trace(p)
        check_trace_format(doc)
        for e in doc["traceEvents"]:
            if e["ph"] == "C":
                got.setdefault(e["name"], []).append((doc["otherData"]["base_time_ns"] + ns(e["ts"]), e["args"]))
    truth = expected(cfg)
    assert len(got["host CPU"]) == len(got["process"]) == len(got["context switches"]) == cfg.steps
    assert len(got["loader worker 0"]) == len(got["loader worker 1"]) == cfg.steps
    for (_, step), t in sorted(truth.items()):
        r = readings("input_io", cfg.is_stalled(step))
        worker = [args for _, args in sorted(got["loader worker 1"])][step]
        assert worker == {"CPU %": pytest.approx(r.worker_cpu * 100), "busy %": pytest.approx(r.worker_runnable * 100)}
        host = [args for _, args in sorted(got["host CPU"])][step]
        assert host["iowait %"] == pytest.approx(t["resources"]["cpu_iowait"] * 100)


def test_profstream_advise_prints_each_ranks_advice_with_its_figures(kafka_bootstrap, topics):
    from typer.testing import CliRunner

    from profstream.cli import app
    from profstream.simulate import run_simulation
    from tests.helpers import step_records
    from tests.test_processor import RunningProcessor

    cfg = SimConfig(run_id="advised", ranks=2, steps=14, ops_per_step=20, stall=(4, 13), resources=True,
                    loader_fault="input_io")
    with RunningProcessor(kafka_bootstrap, topics):
        run_simulation(cfg, {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix})
        step_records(kafka_bootstrap, topics.steps, "advised", cfg.ranks * cfg.steps)
    result = CliRunner().invoke(app, ["advise", "--run", "advised", "--bootstrap", kafka_bootstrap,
                                      "--topic-prefix", topics.prefix])
    assert result.exit_code == 0, result.output
    text = result.output
    for rank in range(2):
        assert f"rank {rank}: 14 steps read (latest 13), 10 starved" in text
    assert text.count("input_io (10 steps, latest step 13): the loader's workers mostly wait") == 2
    assert "figures: " in text and "workers_busy 0.07" in text and "rule: MindSpore data preparation" in text
    assert "more_workers" not in text and "transfer" not in text
    missing = CliRunner().invoke(app, ["advise", "--run", "nope", "--bootstrap", kafka_bootstrap,
                                       "--topic-prefix", topics.prefix])
    assert missing.exit_code == 2 and "no step of run nope" in missing.output


# -- real DataLoader jobs on CPU ------------------------------------------------------------

torch = pytest.importorskip("torch")

from profstream.integrations.torch import instrument  # noqa: E402


class Items(torch.utils.data.Dataset):
    """Items whose loading costs ``cpu_s`` of computation or ``sleep_s`` of waiting."""

    def __init__(self, n: int, cpu_s: float = 0.0, sleep_s: float = 0.0) -> None:
        self.n, self.cpu_s, self.sleep_s = n, cpu_s, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)  # a slow read: the worker waits
        deadline = time.thread_time() + self.cpu_s
        x = 0
        while time.thread_time() < deadline:  # a CPU-heavy transform: the worker computes
            x += 1
        return torch.full((16,), float(i % 7)), torch.tensor(float(x % 3))


def _job(loader, copy_s: float = 0.0) -> tuple[dict, list[dict]]:
    """Train a tiny model on ``loader`` under instrument(), reading the loader's workers
    every 0.1 s; ``copy_s``: the loop waits this long before the forward (a slow copy to the
    device). The processors' StepMetrics and alerts, computed from what the Monitor sent."""
    mon = Monitor(run_id="loader-job", rank=0, bootstrap="127.0.0.1:1", host_sample_interval_s=0.1, control=False,
                  native=False, device_interval_ms=0, sender_factory=IdleSender)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = instrument(model, optimizer, loader, monitor=mon, capture_ops=False)
    for x, y in loader:
        if copy_s:
            time.sleep(copy_s)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
        optimizer.step()
    prof.close()
    sender = Sender(mon)
    messages = []
    while sender._pending or sender._build():
        messages.append(RawMessage(0.0, 0, len(messages), mon.key, sender._pending.popleft()[0]))
    steps, alerts, _raw = _outputs(messages)
    return {step: m for (_, step), m in steps.items()}, alerts


def _advised(steps: dict) -> set[str]:
    return {a["rule"] for m in steps.values() for a in m["advice"]}


def test_a_loader_whose_one_worker_computes_gets_raise_num_workers_and_nothing_else():
    loader = torch.utils.data.DataLoader(Items(48, cpu_s=0.04), batch_size=2, num_workers=1)
    steps, alerts = _job(loader)
    assert _advised(steps) == {"more_workers"}
    busy = [m["resources"]["worker_runnable_mean"] for m in steps.values() if m["resources"] and m["resources"]["workers"]]
    assert busy and max(busy) >= 0.8  # wanted a CPU nearly all the time, however loaded the machine
    _assert_stall_alert_says(steps, alerts, "num_workers")


def _assert_stall_alert_says(steps: dict, alerts: list[dict], advice_words: str) -> None:
    """The DataQueueStall fired, and carries the advice of the step it fired at. A step that
    ended before the rank's first host reading has none (the alert can fire at step 4 of a
    run: under load the sampler's first reading may come later), so the alert has none to give."""
    fired = [a for a in alerts if a["name"] == "DataQueueStall" and a["state"] == "firing"]
    assert fired
    for alert in fired:
        if steps[alert["step"]]["advice"]:
            assert advice_words in alert["summary"], alert["summary"]
        else:
            assert "data queue starved" in alert["summary"] and not steps[alert["step"]]["resources"]


def test_a_loader_whose_workers_sleep_in_getitem_gets_the_input_reads_and_nothing_else():
    loader = torch.utils.data.DataLoader(Items(48, sleep_s=0.06), batch_size=2, num_workers=2)
    steps, alerts = _job(loader)
    assert _advised(steps) == {"input_io"}
    waiting = [m["resources"]["worker_runnable_mean"] for m in steps.values()
               if m["resources"] and m["resources"]["workers"]]
    assert waiting and min(waiting) < 0.5
    _assert_stall_alert_says(steps, alerts, "reading the data")


def test_batches_ready_and_a_slow_copy_to_the_device_get_the_transfer_and_nothing_else():
    loader = torch.utils.data.DataLoader(Items(40), batch_size=2, num_workers=2, prefetch_factor=2)
    steps, alerts = _job(loader, copy_s=0.05)
    assert _advised(steps) == {"transfer"}
    starved = [m for m in steps.values() if m["starved"]]
    assert len(starved) >= len(steps) // 2
    _assert_stall_alert_says(steps, alerts, "to the device")


class BusyWorker(torch.utils.data.Dataset):
    """Items that worker 1 transforms in ``cpu_s`` of computation each and worker 0 at once (a
    skewed shard: one worker's samples are the heavy ones)."""

    def __init__(self, n: int, cpu_s: float) -> None:
        self.n, self.cpu_s = n, cpu_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        worker = torch.utils.data.get_worker_info().id
        deadline = time.thread_time() + (self.cpu_s if worker == 1 else 0.0)
        x = 0
        while time.thread_time() < deadline:
            x += 1
        return torch.full((16,), float(i % 7)), torch.tensor(float(x % 3))


def test_a_real_loaders_busy_worker_is_told_apart_by_its_own_figures():
    """In order (the default), the workers hand over their batches in turn, so each has about
    the same seconds per batch; the one holding the others up spends them computing: its CPU
    seconds per batch, per worker, are its batches' cost, the idle one's near 0. The pooled
    figure is one mean of both."""
    loader = torch.utils.data.DataLoader(BusyWorker(80, cpu_s=0.03), batch_size=2, num_workers=2)
    steps, _alerts = _job(loader)
    per: dict[int, list] = {0: [], 1: []}
    for m in steps.values():
        for w in (m["resources"] or {}).get("per_worker", []):
            if w["s_per_batch"] is not None and w["cpu_s_per_batch"] is not None:
                per[w["worker"]].append((w["s_per_batch"], w["cpu_s_per_batch"]))
    assert len(per[0]) >= 3 and len(per[1]) >= 3, per
    idle_cpu = statistics.median(c for _, c in per[0])
    busy_cpu = statistics.median(c for _, c in per[1])
    assert busy_cpu >= 0.03 and idle_cpu < busy_cpu / 3, (idle_cpu, busy_cpu)  # 2 items of 0.03 s CPU a batch
