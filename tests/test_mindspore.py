"""ProfstreamCallback on a real MindSpore Model.train (CPU), through the real broker and
processor. Needs the mindspore wheel (~800 MB): run with `make test-mindspore`."""

from __future__ import annotations

import csv
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspore import dataset as ds  # noqa: E402
from mindspore import nn  # noqa: E402

from profstream.integrations.mindspore_capture import ANALYSE_TYPE  # noqa: E402
from profstream.mindspore import ProfstreamCallback  # noqa: E402
from profstream.processors.figures import FigureOptions  # noqa: E402
from tests.helpers import step_records  # noqa: E402
from tests.test_processor import RunningProcessor  # noqa: E402

pytestmark = pytest.mark.mindspore

LOAD_S = 0.3  # every batch takes this long to load (one worker): several times a CPU step here


class SlowSource:
    """A random-access dataset whose every item takes LOAD_S to load."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((n, 16)).astype(np.float32)
        self.y = rng.standard_normal((n, 4)).astype(np.float32)

    def __getitem__(self, i):
        time.sleep(LOAD_S)
        return self.x[i], self.y[i]

    def __len__(self) -> int:
        return len(self.x)


def test_callback_marks_the_window_of_steps_with_the_data_wait(kafka_bootstrap, topics):
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    ds.config.set_prefetch_size(1)  # past the first few steps, loading is what every step waits for
    data = ds.GeneratorDataset(SlowSource(14), ["x", "y"], shuffle=False, num_parallel_workers=1,
                               python_multiprocessing=False).batch(1)
    net = nn.SequentialCell(nn.Dense(16, 32), nn.ReLU(), nn.Dense(32, 4))
    model = ms.train.Model(net, loss_fn=nn.MSELoss(), optimizer=nn.SGD(net.trainable_params(), 0.01))
    callback = ProfstreamCallback(run_id="ms-cb", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix,
                                  start_step=8, stop_step=12, capture_ops=False)  # the window limits the marks
    with RunningProcessor(kafka_bootstrap, topics):
        model.train(1, data, callbacks=[callback], dataset_sink_mode=False)
        steps = step_records(kafka_bootstrap, topics.steps, "ms-cb", 5)
        extra = step_records(kafka_bootstrap, topics.steps, "ms-cb", 6, timeout=3, full=False)  # nothing beyond
    assert callback.steps_marked == 5
    assert sorted(s["step"] for s in steps) == list(range(8, 13)) and len(extra) == 5
    for s in steps:
        assert s["data_wait_ns"] >= 0.3 * LOAD_S * 1e9  # waiting for the batch, before the forward pass
        assert s["fp_bp_ns"] > 0 and s["tail_ns"] == 0  # the train network is one call
        assert s["data_wait_ns"] + s["fp_bp_ns"] + s["tail_ns"] == s["step_time_ns"]
        assert s["memory"] is not None  # mindspore.runtime memory statistics, sampled per step
    assert all(s["starved"] for s in steps)  # loading dominates every step


def _fast_train(callback, n: int = 6) -> None:
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    rng = np.random.default_rng(0)
    source = [(rng.standard_normal(16).astype(np.float32), rng.standard_normal(4).astype(np.float32)) for _ in range(n)]
    data = ds.GeneratorDataset(source, ["x", "y"], shuffle=False).batch(1)
    net = nn.SequentialCell(nn.Dense(16, 32), nn.ReLU(), nn.Dense(32, 4))
    model = ms.train.Model(net, loss_fn=nn.MSELoss(), optimizer=nn.SGD(net.trainable_params(), 0.01))
    model.train(1, data, callbacks=[callback], dataset_sink_mode=False)


@pytest.fixture
def kept_profiles(monkeypatch):
    """Keep the folders MindSpore's Profiler writes (the capture removes them once read);
    the list fills with the ones the capture read."""
    from profstream.integrations import mindspore_capture

    kept: list[Path] = []
    monkeypatch.setattr(mindspore_capture.shutil, "rmtree", lambda path, **kw: kept.append(Path(path)))
    yield kept
    monkeypatch.undo()
    for path in kept:
        shutil.rmtree(path, ignore_errors=True)


def _mindspore_op_types(folder: Path) -> dict[str, tuple[int, float]]:
    """MindSpore's own per-type table of a window (FRAMEWORK/cpu_op_type_info_<rank>.csv):
    type -> (calls, total ms)."""
    (path,) = folder.glob("*_ascend_ms/FRAMEWORK/cpu_op_type_info_*.csv")
    with path.open() as f:
        return {r["op_type"]: (int(r["type_occurrences"]), float(r["total_compute_time"])) for r in csv.DictReader(f)}


def test_the_mindformers_profile_section_sets_the_capture_window(kafka_bootstrap, topics, kept_profiles):
    kept = kept_profiles
    section = {"profile": True, "profile_start_step": 2, "profile_stop_step": 4, "init_start_profile": False,
               "profile_communication": False, "profile_memory": True}  # as a mindformers config writes it
    callback = ProfstreamCallback(run_id="ms-mf", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, **section)
    with RunningProcessor(kafka_bootstrap, topics, figure_options=FigureOptions(top_k=100)):
        _fast_train(callback)
        steps = sorted(step_records(kafka_bootstrap, topics.steps, "ms-mf", 6), key=lambda s: s["step"])
    assert callback.steps_marked == 6 and [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]  # every step marked
    assert callback.capture.windows == 1 and callback.capture.steps_captured == 3
    types = {s["step"]: {t["op_type"]: t for t in s["op_types"]} for s in steps}
    assert {s for s, t in types.items() if "MatMul" in t} == {2, 3, 4}  # ops of the window only
    assert ANALYSE_TYPE in types[5]  # the step MindSpore's analysis ran in says so
    # the window's ops equal MindSpore's own per-type table of them, call for call
    (folder,) = {p for p in kept if p.name.startswith("window-")}
    own = _mindspore_op_types(folder)
    calls: dict[str, int] = {}
    total_ns: dict[str, int] = {}
    for step in (2, 3, 4):
        for t, cost in types[step].items():
            calls[t] = calls.get(t, 0) + cost["count"]
            total_ns[t] = total_ns.get(t, 0) + cost["total_ns"]
    assert {t: c for t, (c, _) in own.items()} == calls
    for t, (_, total_ms) in own.items():  # MindSpore's table rounds to the ns
        assert total_ns[t] / 1e6 == pytest.approx(total_ms, rel=1e-4, abs=1e-5), t


def test_a_capture_request_gets_the_ops_of_its_steps_into_the_report(kafka_bootstrap, topics, tmp_path):
    from profstream.control.client import follow, send_request
    from profstream.control.records import new_request
    from profstream.offline.report import ReportData, write_report
    from tests.helpers import wait_until

    callback = ProfstreamCallback(run_id="ms-asked", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix)
    request = new_request("ms-asked", start_step=5, steps=2)
    send_request(kafka_bootstrap, topics, request)
    wait_until(lambda: callback.monitor.stats()["capture_requests"] == 1, 30, "the rank to arm the request")
    with RunningProcessor(kafka_bootstrap, topics, figure_options=FigureOptions(top_k=100)):
        _fast_train(callback, n=10)
        steps = sorted(step_records(kafka_bootstrap, topics.steps, "ms-asked", 10), key=lambda s: s["step"])
    progress = follow(kafka_bootstrap, topics, request, timeout=30)
    assert progress.ranks[0]["state"] == "finished"
    captured = [s["step"] for s in steps if any(t["op_type"] == "MatMul" for t in s["op_types"])]
    assert captured == [5, 6] and progress.ranks[0]["ops"] == sum(s["op_count"] for s in steps if s["step"] in (5, 6))
    page = write_report(ReportData("ms-asked", Path("live"), steps=steps), tmp_path / "report.html")
    assert "MatMul" in page.read_text()


def test_a_bad_option_value_logs_one_warning_and_training_goes_on(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="profstream"):
        callback = ProfstreamCallback(run_id="ms-bad", every_n_steps=0)
        _fast_train(callback)
    assert callback.steps_marked == 0
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("profstream")]
    assert len(warnings) == 1 and "argument every_n_steps=0" in warnings[0], warnings


def test_a_disabled_monitor_marks_nothing_and_reads_no_device_memory(monkeypatch):
    asked = []
    monkeypatch.setattr(ms.runtime, "memory_allocated", lambda *a: asked.append(1) or 0, raising=False)
    callback = ProfstreamCallback(run_id="ms-off", enabled=False)
    _fast_train(callback)
    assert callback.steps_marked == 0 and not asked


def test_without_op_capture_a_request_is_refused_with_what_to_do_and_training_goes_on(kafka_bootstrap, topics):
    from profstream.control.client import follow, send_request
    from profstream.control.records import new_request
    from profstream.integrations.mindspore import CAPTURE_UNAVAILABLE

    callback = ProfstreamCallback(run_id="ms-refused", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix,
                                  capture_ops=False)
    request = new_request("ms-refused", steps=2)
    send_request(kafka_bootstrap, topics, request)
    from tests.helpers import wait_until

    wait_until(lambda: callback.monitor.stats()["captures_refused"] == 1, 30, "the rank's answer")
    _fast_train(callback, n=12)
    progress = follow(kafka_bootstrap, topics, request, timeout=30)
    assert callback.steps_marked == 12
    assert progress.ranks[0]["state"] == "refused"
    assert progress.ranks[0]["reason"] == f"unavailable: {CAPTURE_UNAVAILABLE}"
