"""The PyTorch producer with real torch, the real broker and the real processor.

A small CPU training loop (Linear/ReLU layers, a synthetic TensorDataset) is profiled with
``instrument()`` and with ``profstream run -- python script.py``; its StepMetrics must split
every step into data wait, forward/backward and tail, and carry the layers' ops.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from profstream.integrations.torch_ops import (
    HOST_STREAM_BASE,
    RawEvent,
    clock_offset_ns,
    op_kind,
    to_op_columns,
)
from profstream.kafka.clients import read_topic
from profstream.schema.batch import COMMUNICATION, COMPUTE, DATA, HOST, MEMCPY, MEMSET
from profstream.schema.codec import decode
from tests.helpers import step_records
from tests.test_processor import RunningProcessor

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]

# The training loop of the tests, as a script: `profstream run` runs it unchanged and
# test (a) runs the same code in-process through instrument().
LOOP = '''
import time
import torch

class Data(torch.utils.data.Dataset):
    """Synthetic regression data; items of batches in `slow` take `delay_s` to load."""

    def __init__(self, n, slow=(), delay_s=0.0, batch=16):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 32, generator=g)
        self.y = torch.randn(n, 4, generator=g)
        self.slow, self.delay_s, self.batch = set(slow), delay_s, batch

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i // self.batch in self.slow and i % self.batch == 0:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]

def make(steps, slow=(), delay_s=0.0, workers=0, hidden=256):
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(Data(16 * steps, slow, delay_s), batch_size=16, num_workers=workers)
    model = torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                torch.nn.ReLU(), torch.nn.Linear(hidden, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, optimizer, loader

def train(model, optimizer, loader):
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
'''

ns: dict = {}
exec(compile(LOOP, "<test loop>", "exec"), ns)
make, train = ns["make"], ns["train"]


def _options(kafka_bootstrap, topics, run_id):
    return {"bootstrap": kafka_bootstrap, "topic_prefix": topics.prefix, "run_id": run_id,
            "host_sample_interval_s": 0}


def _alerts(bootstrap, topics, run_id, count, timeout=60.0):
    return read_topic(bootstrap, topics.alerts, lambda a: a["run_id"] == run_id, count, timeout,
                      decode=lambda v: decode("Alert", v))


def _assert_phases_tile_each_step(steps: list[dict], n: int) -> None:
    assert sorted(s["step"] for s in steps) == list(range(n))
    for s in steps:
        parts = (s["data_wait_ns"], s["fp_bp_ns"], s["tail_ns"])
        assert all(p > 0 for p in parts), (s["step"], parts)
        assert sum(parts) == s["step_time_ns"] == s["end_ns"] - s["start_ns"]
        assert s["closed_by"] == "watermark"  # the producer said when each step's ops were all sent


def _op_types(step: dict) -> set[str]:
    return {t["op_type"] for t in step["op_types"]}


# -- profiler events -> ops ------------------------------------------------------------

def _ev(name, start, dur, thread=1, device=False, activity="cpu_op", annotation=False):
    return RawEvent(name, start, dur, thread, device, activity, annotation)


def test_outermost_cpu_ops_become_ops_and_annotations_do_not():
    events = [
        _ev("ProfilerStep#3", 0, 1000, annotation=True),
        _ev("aten::select", 10, 5),  # before the forward start: loads the batch
        _ev("aten::linear", 100, 300),
        _ev("aten::addmm", 110, 280),  # inside aten::linear
        _ev("Optimizer.step#SGD.step", 700, 200, annotation=True),
        _ev("aten::add_", 710, 50),  # inside an annotation: still an op
        _ev("autograd::engine::evaluate_function: AddmmBackward0", 450, 200, thread=7),
        _ev("AddmmBackward0", 451, 198, thread=7),
        _ev("aten::mm", 460, 100, thread=7),
        _ev("gloo:all_reduce", 500, 300, thread=9, annotation=True),  # gloo times transfers with these
    ]
    cols = to_op_columns(events, run_has_device=False, offset_ns=1_000, data_until_ns=1_100)
    got = sorted(zip(cols.names, cols.op_types, cols.kinds.tolist(), cols.streams.tolist(),
                     cols.start_ns.tolist(), cols.dur_ns.tolist()), key=lambda r: r[4])
    assert got == [
        ("aten::select", "aten::select", DATA, 0, 1_010, 5),
        ("aten::linear", "aten::linear", COMPUTE, 0, 1_100, 300),
        ("autograd::engine::evaluate_function: AddmmBackward0", "AddmmBackward0", COMPUTE, 1, 1_450, 200),
        ("gloo:all_reduce", "gloo:all_reduce", COMMUNICATION, 2, 1_500, 300),
        ("aten::add_", "aten::add_", COMPUTE, 0, 1_710, 50),
    ]


def test_op_kinds_on_a_device_run_and_on_a_cpu_run():
    cols = to_op_columns([
        _ev("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)", 0, 5,
            thread=7, device=True, activity="kernel"),
        _ev("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", 10, 5, thread=13,
            device=True, activity="kernel"),
        _ev("Memcpy HtoD (Pageable -> Device)", 20, 5, thread=7, device=True, activity="gpu_memcpy"),
        _ev("Memset (Device)", 30, 5, thread=7, device=True, activity="gpu_memset"),
        _ev("aten::linear", 40, 5),
    ], run_has_device=True)
    by_name = dict(zip(cols.op_types, zip(cols.kinds.tolist(), cols.streams.tolist())))
    assert by_name == {
        "at::native::vectorized_elementwise_kernel": (COMPUTE, 7),
        "ncclKernel_AllReduce_RING_LL_Sum_float": (COMMUNICATION, 13),
        "Memcpy HtoD": (MEMCPY, 7),  # the type leaves out the memory kinds
        "Memset": (MEMSET, 7),
        "aten::linear": (HOST, HOST_STREAM_BASE),
    }
    # On a CPU-only run the aten ops are the compute, and gloo collectives communication.
    assert op_kind("aten::addmm", False, "cpu_op", run_has_device=False) == COMPUTE
    assert op_kind("aten::broadcast_tensors", False, "cpu_op", run_has_device=False) == COMPUTE
    assert op_kind("gloo:all_reduce", False, "cpu_op", run_has_device=False) == COMMUNICATION
    assert op_kind("c10d::allreduce_", False, "cpu_op", run_has_device=False) == COMMUNICATION


def test_device_ops_carry_the_start_of_the_runtime_call_that_launched_them():
    """CUPTI gives a kernel and its cudaLaunchKernel one correlation; torch ops number
    theirs apart (the same number on an aten op means nothing)."""
    events = [
        RawEvent("aten::mm", 100, 50, 1, False, "cpu_op", False, correlation=41),  # an op's own number
        RawEvent("cudaLaunchKernel", 120, 10, 1, False, "cuda_runtime", False, correlation=41),
        RawEvent("cudaMemcpyAsync", 160, 10, 1, False, "cuda_runtime", False, correlation=42),
        RawEvent("void gemm<float>(float*)", 900, 300, 7, True, "kernel", False, correlation=41),
        RawEvent("Memcpy HtoD (Pageable -> Device)", 950, 20, 9, True, "gpu_memcpy", False, correlation=42),
        RawEvent("void lost_kernel(int)", 990, 5, 7, True, "kernel", False, correlation=77),  # no launch seen
    ]
    cols = to_op_columns(events, run_has_device=True, offset_ns=1_000)
    launch = dict(zip(cols.names, cols.launch_ns.tolist()))
    assert launch == {"aten::mm": -1, "cudaMemcpyAsync": -1, "void gemm<float>(float*)": 1_120,
                      "Memcpy HtoD (Pageable -> Device)": 1_160, "void lost_kernel(int)": -1}
    assert to_op_columns(events[:1], run_has_device=False).launch_ns is None  # CPU runs send none


class _KinetoEvent211:
    """What torch 2.11's ``_KinetoEvent`` offers (no ``activity_type()``: added in 2.12).
    Its absence switched op capture off on the first captured step of every GPU run under
    torch 2.11 (seen on an H200, docs/benchmarks.md "GPU check")."""

    def __init__(self, name: str, start: int, dur: int, device: bool, stream: int = 7, correlation: int = 0):
        from torch.autograd import DeviceType

        self._v = (name, start, dur, DeviceType.CUDA if device else DeviceType.CPU, stream, correlation)

    def name(self): return self._v[0]  # noqa: E704
    def start_ns(self): return self._v[1]  # noqa: E704
    def duration_ns(self): return self._v[2]  # noqa: E704
    def device_type(self): return self._v[3]  # noqa: E704
    def device_resource_id(self): return self._v[4]  # noqa: E704
    def start_thread_id(self): return 1  # noqa: E704
    def correlation_id(self): return self._v[5]  # noqa: E704
    def is_user_annotation(self): return False  # noqa: E704


def test_kernels_in_an_anonymous_namespace_keep_their_own_type():
    """On an H200, 345 ms of 41 steps' kernels were typed "at::native::" (the name cut at
    the namespace's parenthesis): softmax, layer norm and more lumped into one type."""
    from profstream.integrations.torch_ops import op_type

    assert op_type("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float, float, float, "
                   "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)"
                   ) == "at::native::cunn_SoftMaxForward"
    assert op_type("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>"
                   "(int, float, c10::BFloat16 const*)") == "at::native::vectorized_layer_norm_kernel"
    assert op_type("void gemm<float>(float*)") == "gemm"


def test_a_device_capture_converts_with_a_torch_that_has_no_activity_type():
    from profstream.integrations.torch_ops import table_from_kineto

    events = [_KinetoEvent211("cudaLaunchKernel", 100, 10, False, correlation=5),
              _KinetoEvent211("void gemm<float>(float*)", 200, 50, True, correlation=5),
              _KinetoEvent211("Memcpy HtoD (Pinned -> Device)", 300, 20, True, stream=9),
              _KinetoEvent211("Memset (Device)", 330, 5, True)]
    cols = to_op_columns(table_from_kineto(events, run_has_device=True), True)
    assert dict(zip(cols.op_types, cols.kinds.tolist())) == {
        "cudaLaunchKernel": HOST, "gemm": COMPUTE, "Memcpy HtoD": MEMCPY, "Memset": MEMSET}
    assert dict(zip(cols.op_types, cols.launch_ns.tolist()))["gemm"] == 100


def test_clock_offset_keeps_epoch_timestamps_and_moves_monotonic_ones():
    epoch, mono = 1_795_000_000_000_000_000, 3_000_000_000_000
    assert clock_offset_ns(epoch - 5_000_000, epoch, mono) == 0
    assert clock_offset_ns(mono - 5_000_000, epoch, mono) == epoch - mono


def test_profiled_ops_land_on_the_host_epoch_clock():
    from torch.profiler import ProfilerActivity, profile

    from profstream.integrations.torch_ops import table_from_kineto

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        before = time.time_ns()
        torch.mm(a, b)
        after = time.time_ns()
    table = table_from_kineto(prof.profiler.kineto_results.events(), run_has_device=False)
    cols = to_op_columns(table, False, clock_offset_ns(int(table.start_ns[0])))
    i = cols.names.index("aten::mm")
    assert before <= cols.start_ns[i] and cols.start_ns[i] + cols.dur_ns[i] <= after


def _rows(cols):
    return list(zip(cols.names, cols.op_types, cols.kinds.tolist(), cols.streams.tolist(), cols.start_ns.tolist(),
                    cols.dur_ns.tolist()))


def rich_capture():
    """A real CPU capture with nested and empty annotations, a collective's annotation,
    data loading, forward, backward, and (where torch can) a second thread's ops; and
    whether the second thread was recorded."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile, record_function

    model, optimizer, loader = make(4)
    a = torch.randn(64, 64)

    def other_thread():
        for _ in range(50):
            torch.mm(a, a).relu_()

    try:  # the second thread's ops are recorded too
        config = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except TypeError:  # a torch without it: the main thread's only
        config = {}
    with profile(activities=[ProfilerActivity.CPU], **config) as prof:
        side = threading.Thread(target=other_thread)
        side.start()
        with record_function("outer"):
            with record_function("inner"):
                train(model, optimizer, loader)
            with record_function("empty"):
                pass
            with record_function("gloo:all_reduce"):
                torch.ones(4).add_(1)
        side.join()
    return prof.profiler.kineto_results, bool(config)


def test_the_event_tree_gives_the_same_ops_as_every_event():
    """A CPU-only capture reads its ops off the profiler's event tree (annotations and
    outermost ops only): exactly the ops, kinds, streams and times that converting every
    event gives, with nested and empty annotations, a collective's and a second thread."""
    from profstream.integrations.torch_ops import HostThreads, table_from_kineto, tree_op_columns

    results, two_threads = rich_capture()
    table = table_from_kineto(results.events(), run_has_device=False)
    data_until = int(np.median(table.start_ns)) + 1_000  # some ops before, some after
    by_events = to_op_columns(table, False, 1_000, HostThreads(), data_until)
    by_tree = tree_op_columns(results.experimental_event_tree(), 1_000, HostThreads(), data_until)
    assert _rows(by_tree) == _rows(by_events)
    names = set(by_tree.names)
    assert {"aten::linear", "gloo:all_reduce"} <= names and ("aten::mm" in names) == two_threads
    assert not names & {"aten::addmm", "outer", "inner", "empty"}  # nested ops, annotations
    assert set(by_tree.streams.tolist()) == ({0, 1} if two_threads else {0})
    assert {DATA, COMPUTE, COMMUNICATION} <= set(by_tree.kinds.tolist())


def test_a_tree_with_other_events_than_torch_ops_is_left_to_the_event_conversion():
    from torch.profiler import ProfilerActivity, profile, record_function

    from profstream.integrations.torch_ops import tree_op_columns

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("block"):
            x = torch.ones(1024)
            del x  # a memory event right under the annotation
    assert tree_op_columns(prof.profiler.kineto_results.experimental_event_tree()) is None


# -- never in the way of the training --------------------------------------------------

class FailingMonitor:
    """A Monitor stand-in (no Kafka: it records nothing) whose forward mark fails."""

    options = {"start_step": None, "stop_step": None, "every_n_steps": None}
    enabled = True
    current_step = -1

    def __init__(self):
        self.calls = 0

    def begin_step(self, step=None, ts_ns=None):
        self.calls += 1
        self.current_step += 1
        return self.current_step

    def end_step(self, ts_ns=None):
        self.calls += 1

    def mark_fp_start(self, ts_ns=None):
        self.calls += 1
        raise RuntimeError("injected failure")

    def mark_bp_end(self, ts_ns=None):
        self.calls += 1

    def memory(self, *a, **k):
        self.calls += 1

    def queue(self, *a, **k):
        self.calls += 1

    def work(self, *a, **k):
        self.calls += 1

    def counted_flops(self, *a, **k):
        self.calls += 1


def test_a_failing_hook_never_reaches_the_training_loop(caplog):
    import profstream.torch as pst

    plain = make(6)
    train(*plain)
    model, optimizer, loader = make(6)
    monitor = FailingMonitor()
    with caplog.at_level(logging.ERROR, logger="profstream.torch"):
        handle = pst.instrument(model, optimizer, loader, monitor=monitor, capture_ops=False)
        train(model, optimizer, loader)  # raises nothing
        calls_after_failure = monitor.calls
        train(model, optimizer, loader)  # a second epoch: the hooks are off
        handle.close()
    assert isinstance(handle.error, RuntimeError) and not handle.active
    assert monitor.calls == calls_after_failure
    assert [r.levelno for r in caplog.records] == [logging.ERROR]  # reported once, with its traceback
    assert caplog.records[0].exc_info is not None
    # the training itself is untouched: the first epoch ends with the plain run's weights
    model2, optimizer2, loader2 = make(6)
    with pst.instrument(model2, optimizer2, loader2, monitor=FailingMonitor(), capture_ops=False):
        train(model2, optimizer2, loader2)
    for p, q in zip(plain[0].parameters(), model2.parameters()):
        assert torch.equal(p, q)


@pytest.fixture(params=["training_thread", "worker"])
def conversion_thread(request, monkeypatch):
    """Where captured steps become ops: the training thread (CPU-only runs) or a worker
    thread (device runs; CI has no device, so the CPU loop stands in)."""
    if request.param == "worker":
        from profstream.integrations.torch_capture import OpCapture

        monkeypatch.setattr(OpCapture, "converts_on_worker", staticmethod(lambda run_has_device: True))
    return request.param


class FailingOpsMonitor(FailingMonitor):
    """A Monitor stand-in that takes marks but fails when the captured ops arrive."""

    _closed = False

    def defer_ops(self):
        pass

    def mark_fp_start(self, ts_ns=None):
        self.calls += 1

    def ops(self, *a, **k):
        raise RuntimeError("injected failure in ops")

    def complete_through(self, step):
        pass


def test_a_failing_op_capture_switches_profiling_off_and_stops_the_profiler(caplog, conversion_thread):
    import profstream.torch as pst

    model, optimizer, loader = make(8)
    with caplog.at_level(logging.ERROR, logger="profstream.torch"):
        handle = pst.instrument(model, optimizer, loader, monitor=FailingOpsMonitor())
        assert (handle.capture.worker is None) == (conversion_thread == "training_thread")
        train(model, optimizer, loader)  # raises nothing
        handle.capture.drain(10)
        train(model, optimizer, loader)  # the hooks notice and stop the profiler
        running = handle.capture.running
        handle.close()
    assert isinstance(handle.error, RuntimeError) and "injected failure in ops" in str(handle.error)
    assert not handle.active and not running
    assert len(caplog.records) == 1


def test_a_gpu_steps_memory_sample_is_the_allocators_current_reserved_and_peak(monkeypatch):
    """On a GPU the memory sample at a step's end is the caching allocator's allocated and
    reserved bytes and its peak since the step before (then reset), read in one call."""
    import torch

    from profstream.integrations.torch import TorchInstrumentation

    class Recorder(FailingMonitor):
        def __init__(self):
            super().__init__()
            self.samples = []

        def memory(self, allocated, reserved=-1, peak=-1, ts_ns=None, step=None):
            self.samples.append((allocated, reserved, peak, ts_ns))

    reads, resets = [], []
    stats = {"allocated_bytes": {"all": {"current": 300, "peak": 900, "allocated": 5000, "freed": 4700}},
             "reserved_bytes": {"all": {"current": 2048, "peak": 4096}}, "num_alloc_retries": 0}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: reads.append(1) or stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(1))
    monitor = Recorder()
    inst = TorchInstrumentation(monitor, {}, capture_ops=False, mark_steps=True)
    inst.cuda = True
    inst._sample_memory(1234)
    assert monitor.samples == [(300, 2048, 900, 1234)]
    assert len(reads) == 1 and len(resets) == 1


def test_errors_of_the_loader_reach_the_loop_unchanged():
    import profstream.torch as pst

    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise KeyError(f"sample {i} is missing")

    loader = torch.utils.data.DataLoader(Broken(), batch_size=2)
    with pst.instrument(torch.nn.Linear(2, 2), None, loader, monitor=FailingMonitor(), capture_ops=False) as handle:
        with pytest.raises(KeyError, match="sample 0 is missing"):
            next(iter(loader))
    assert handle.error is None


def test_bad_arguments_get_one_line_errors():
    import profstream.torch as pst
    from profstream.config import ConfigError

    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        pst.instrument("model")
    with pytest.raises(ConfigError, match="run_id configure a new Monitor"):
        pst.instrument(monitor=FailingMonitor(), run_id="r")
    with pytest.raises(ConfigError, match="argument every_n_steps=0: expected an integer >= 1"):
        pst.instrument(every_n_steps=0, enabled=False)


def test_a_disabled_monitor_leaves_the_loop_unhooked(monkeypatch):
    """PROFSTREAM_ENABLED=0 is the switch a user flips to take profstream out of a job: no
    hook on the model, optimizer or loader, and nothing read at a step's end."""
    import profstream.torch as pst
    from profstream.integrations import torch as pst_torch
    from profstream.producers.monitor import Monitor

    monkeypatch.setattr(pst_torch.RssReader, "__call__", lambda self: pytest.fail("memory read with profiling off"))
    model, optimizer, loader = make(3)
    for monitor in (Monitor(enabled=False), None):
        if monitor is None:
            monkeypatch.setenv("PROFSTREAM_ENABLED", "0")
        with pst.instrument(model, optimizer, loader, monitor=monitor, capture_ops=False) as handle:
            assert not model._forward_pre_hooks and not optimizer._optimizer_step_pre_hooks
            assert "_get_iterator" not in vars(loader)
            train(model, optimizer, loader)
        assert handle.error is None and not handle.active

    # the launcher's set-up (profstream run) hooks globally before the Monitor exists: the
    # hooks stand aside once it turns out disabled
    handle = pst_torch.TorchInstrumentation(None, {}, capture_ops=False, mark_steps=True, lazy=True)
    handle.attach(None, None, None)
    try:
        train(model, optimizer, loader)
        assert handle.monitor is not None and not handle.monitor.enabled and not handle.active
    finally:
        handle.close()
    assert handle.error is None


# -- end to end: broker, processor, figures --------------------------------------------

def test_instrument_gives_each_step_its_phases_and_the_layers_ops(kafka_bootstrap, topics):
    import profstream.torch as pst

    steps = 12
    model, optimizer, loader = make(steps)
    with RunningProcessor(kafka_bootstrap, topics):
        with pst.instrument(model, optimizer, loader, **_options(kafka_bootstrap, topics, "torch-api")) as handle:
            train(model, optimizer, loader)
        got = step_records(kafka_bootstrap, topics.steps, "torch-api", steps)
    assert handle.error is None
    _assert_phases_tile_each_step(got, steps)
    for s in got:
        assert {"aten::linear", "AddmmBackward0"} <= _op_types(s), s["step"]  # the top op types
        assert s["compute_ns"] > 0 and s["memory"]["allocated"] > 0  # process RSS on a CPU run


def test_only_the_steps_of_the_window_carry_ops(kafka_bootstrap, topics, conversion_thread):
    import profstream.torch as pst

    steps = 10
    model, optimizer, loader = make(steps)
    run_id = f"torch-window-{conversion_thread}"
    options = _options(kafka_bootstrap, topics, run_id)
    with RunningProcessor(kafka_bootstrap, topics):
        with pst.instrument(model, optimizer, loader, start_step=2, stop_step=8, every_n_steps=3, **options):
            train(model, optimizer, loader)
        got = step_records(kafka_bootstrap, topics.steps, run_id, steps)
    _assert_phases_tile_each_step(got, steps)
    assert sorted(s["step"] for s in got if s["op_count"]) == [2, 5, 8]


def test_a_batch_fetched_and_not_trained_on_is_no_step(kafka_bootstrap, topics):
    """A loop that fetches one batch more than it trains on and breaks: the last batch is
    no step (it was step N+1, 0.0002 utilization, the latest figures on /metrics), and the
    rank's end comes after its last real step."""
    import profstream.torch as pst

    steps = 6
    model, optimizer, loader = make(steps + 2)
    with RunningProcessor(kafka_bootstrap, topics):
        with pst.instrument(model, optimizer, loader, **_options(kafka_bootstrap, topics, "torch-break")) as handle:
            for i, (x, y) in enumerate(loader):
                if i == steps:
                    break
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
        (end,) = step_records(kafka_bootstrap, topics.steps, "torch-break", 1, name="RankEnd")
        got = step_records(kafka_bootstrap, topics.steps, "torch-break", steps + 1, timeout=1, full=False)
    assert handle.error is None
    assert end["last_step"] == steps - 1
    _assert_phases_tile_each_step(got, steps)  # steps 0..5, each trained on, and no seventh


def test_without_a_dataloader_each_optimizer_step_ends_a_step(kafka_bootstrap, topics):
    import profstream.torch as pst

    steps = 8
    model, optimizer, loader = make(steps)
    batches = list(loader)  # the loop below slices its own tensors: no DataLoader iterator
    with RunningProcessor(kafka_bootstrap, topics):
        with pst.instrument(model, optimizer, **_options(kafka_bootstrap, topics, "torch-noloader")) as handle:
            for x, y in batches:
                x = x * 1.0  # some work between steps: it is the next step's data wait
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
        got = step_records(kafka_bootstrap, topics.steps, "torch-noloader", steps)
    assert handle.error is None
    got.sort(key=lambda s: s["step"])
    assert [s["step"] for s in got] == list(range(steps))
    for prev, s in zip(got, got[1:]):
        assert s["start_ns"] == prev["end_ns"]  # a step starts where the previous one ended
        assert s["data_wait_ns"] > 0
    for s in got:
        assert s["fp_bp_ns"] > 0 and s["tail_ns"] > 0
        assert s["data_wait_ns"] + s["fp_bp_ns"] + s["tail_ns"] == s["step_time_ns"]
        assert {"aten::linear", "AddmmBackward0"} <= _op_types(s)


def test_steps_marked_by_the_loop_get_forward_backward_marks_and_ops(kafka_bootstrap, topics):
    import profstream.torch as pst
    from profstream.producers.monitor import Monitor

    steps = 8
    model, optimizer, loader = make(steps)
    with RunningProcessor(kafka_bootstrap, topics):
        monitor = Monitor(**_options(kafka_bootstrap, topics, "torch-manual"))
        with pst.instrument(model, optimizer, loader, monitor=monitor, mark_steps=False):
            for x, y in loader:
                with monitor.step():
                    optimizer.zero_grad()
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    optimizer.step()
        monitor.close()
        got = step_records(kafka_bootstrap, topics.steps, "torch-manual", steps)
    _assert_phases_tile_each_step(got, steps)
    for s in got:
        assert {"aten::linear", "AddmmBackward0"} <= _op_types(s)


def test_profstream_run_profiles_an_unchanged_script(kafka_bootstrap, topics, tmp_path):
    steps = 10
    script = tmp_path / "train.py"
    script.write_text(LOOP + textwrap.dedent(f"""
        train(*make({steps}))
        raise SystemExit(7)
    """))
    proc = subprocess.run(
        [sys.executable, "-m", "profstream.cli", "run", "--bootstrap", kafka_bootstrap, "--run-id", "torch-run",
         "--topic-prefix", topics.prefix, "--", sys.executable, str(script)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 7, proc.stderr[-3000:]  # the script's own exit code
    with RunningProcessor(kafka_bootstrap, topics):
        got = step_records(kafka_bootstrap, topics.steps, "torch-run", steps)
    _assert_phases_tile_each_step(got, steps)
    for s in got:
        assert {"aten::linear", "AddmmBackward0"} <= _op_types(s)


def _profstream_run(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profstream.cli", "run", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


def test_profstream_run_passes_options_and_keeps_an_existing_sitecustomize(tmp_path):
    import json
    import os

    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import builtins\nbuiltins.OWN_SITECUSTOMIZE_RAN = True\n")
    child = textwrap.dedent("""
        import builtins, json, os, sys
        hooked = any(type(f).__name__ == "_TorchImportHook" for f in sys.meta_path)
        print(json.dumps({"own": getattr(builtins, "OWN_SITECUSTOMIZE_RAN", False), "hooked": hooked,
                          "options": json.loads(os.environ["PROFSTREAM_OPTIONS"]),
                          "capture": os.environ.get("PROFSTREAM_CAPTURE_OPS")}))
    """)
    env = {**os.environ, "PYTHONPATH": str(own), "PROFSTREAM_OPTIONS": json.dumps({"device": "cpu"})}
    proc = _profstream_run("--bootstrap", "127.0.0.1:1", "--every-n-steps", "5", "--no-capture-ops", "--",
                           sys.executable, "-c", child, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["own"] and seen["hooked"]
    assert seen["options"]["every_n_steps"] == 5 and seen["options"]["device"] == "cpu"
    assert seen["options"]["run_id"].startswith("run-")  # one run id for every process of the launch
    assert seen["capture"] == "false"


def test_a_helper_of_a_profiled_process_is_not_profiled_but_keeps_its_own_sitecustomize(tmp_path):
    """What the compiled walk's build child gets: the start-up hook off its path."""
    import json
    import os

    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import builtins\nbuiltins.OWN_SITECUSTOMIZE_RAN = True\n")
    report = ("import builtins, json, sys; print(json.dumps({'own': getattr(builtins, 'OWN_SITECUSTOMIZE_RAN', False), "
              "'hooked': any(type(f).__name__ == '_TorchImportHook' for f in sys.meta_path)}))")
    child = textwrap.dedent(f"""
        import os, subprocess, sys
        from profstream.integrations.startup_hook import without_profiling
        print(subprocess.run([sys.executable, "-c", {report!r}], env=os.environ, capture_output=True, text=True).stdout)
        print(subprocess.run([sys.executable, "-c", {report!r}], env=without_profiling(os.environ),
                             capture_output=True, text=True).stdout)
    """)
    proc = _profstream_run("--bootstrap", "127.0.0.1:1", "--", sys.executable, "-c", child,
                           env={**os.environ, "PYTHONPATH": str(own)}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    profiled, helper = (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))
    assert profiled == {"own": True, "hooked": True}
    assert helper == {"own": True, "hooked": False}


def test_profstream_run_bad_input_gets_one_line_errors():
    proc = _profstream_run("--every-n-steps", "0", "--", sys.executable, "-c", "pass")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: option --every-n-steps=0: expected an integer >= 1"
    proc = _profstream_run("--", "no-such-command-xyz")
    assert proc.returncode == 2 and "command not found: 'no-such-command-xyz'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_slow_dataset_raises_data_queue_stall(kafka_bootstrap, topics):
    import profstream.torch as pst

    steps, slow = 30, range(8, 18)
    # batches 8..17 take 0.3 s to load; the rest load in well under a millisecond
    model, optimizer, loader = make(steps, slow=slow, delay_s=0.3, hidden=1024)
    options = _options(kafka_bootstrap, topics, "torch-stall")
    with RunningProcessor(kafka_bootstrap, topics):
        with pst.instrument(model, optimizer, loader, every_n_steps=5, **options):
            train(model, optimizer, loader)
        got = step_records(kafka_bootstrap, topics.steps, "torch-stall", steps)
        alerts = _alerts(kafka_bootstrap, topics, "torch-stall", 1)
    seen = [(s["step"], s["starved"], round(s["data_wait_ns"] / s["step_time_ns"], 2))
            for s in sorted(got, key=lambda s: s["step"])]
    assert alerts, f"no alert; steps (step, starved, data wait share): {seen}"
    firing = alerts[0]
    assert firing["name"] == "DataQueueStall" and firing["state"] == "firing", seen
    starved = {s["step"] for s in got if s["starved"]}
    assert set(slow) <= starved, seen
    # fired inside the slow batches, on the 5th starved step in a row (FigureOptions.stall_steps):
    # normally step 12; a fast step just before them can count as starved on a loaded box
    # (its ~0.2 ms load against ~3 ms of compute, preempted once), and then it fires earlier
    assert slow.start <= firing["step"] < slow.stop and "since step" in firing["summary"], seen
    assert set(range(firing["step"] - 4, firing["step"] + 1)) <= starved, seen
    assert firing["step"] - 5 not in starved, seen  # the first step of the run of five


def test_the_prefetch_queue_of_a_multi_worker_loader_is_sampled_at_each_step(kafka_bootstrap, topics):
    import profstream.torch as pst

    steps, slow = 24, range(6, 14)
    # 0.8 s a slow batch: two workers cannot keep up even when a loaded box slows the steps
    model, optimizer, loader = make(steps, slow=slow, delay_s=0.8, workers=2, hidden=1024)
    options = _options(kafka_bootstrap, topics, "torch-queue")
    with RunningProcessor(kafka_bootstrap, topics):
        with pst.instrument(model, optimizer, loader, capture_ops=False, **options):
            train(model, optimizer, loader)
        got = step_records(kafka_bootstrap, topics.steps, "torch-queue", steps)
    at_start = {s["step"]: q["at_start"] for s in got for q in s["queues"] if q["queue"] == "dataloader"}
    assert sorted(at_start) == list(range(steps))
    assert all(0 <= n <= 4 for n in at_start.values())  # 2 workers x prefetch factor 2
    # drained while the workers are slow, fuller before
    stalled = [at_start[i] for i in range(slow.start + 3, slow.stop)]
    before = [at_start[i] for i in range(1, slow.start)]
    assert min(stalled) == 0 and np.mean(stalled) < np.mean(before), at_start
