"""The processors' compiled parts (producers/csrc/reader.cpp and kernels.cpp, built with the
compiled Monitor) give the figures of their Python and numpy paths to the bit; those paths
still run where the extension is not built (profstream/compiled.py, schema/sparse.py)."""

from __future__ import annotations

import dataclasses
import functools
import io

import fastavro
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from profstream import compiled
from profstream.processors.collectives import NO_CALLS
from profstream.processors.host import host_figures
from profstream.processors.memory import memory_figures
from profstream.processors.model import StepEvents
from profstream.processors.optypes import device_kind_costs, op_type_costs
from profstream.processors.queues import queue_figures
from profstream.processors.rolling import RollingWindow
from profstream.processors.utilization import utilization
from profstream.processors.window import Window, carry_past_end, step_window
from profstream.schema import codec, sparse, writer
from profstream.schema.batch import (
    HOST_COLUMNS,
    LOADER_COLUMNS,
    MACHINE,
    EventBatch,
    decode_batch,
    encode_batch,
)

# Off by choice (PROFSTREAM_PURE_PROCESSORS=1): the other tests then run the Python paths
pytestmark = pytest.mark.skipif(compiled.pure(), reason="PROFSTREAM_PURE_PROCESSORS=1: the compiled parts are off")
S, E = 1_000, 2_000
TYPES = ["AllReduce", "Conv2D", "MatMul", "Softmax", "b", "a"]


def test_the_kernels_are_built_with_the_compiled_monitor():
    assert compiled.NATIVE is not None, "the compiled Monitor's extension is not built (or PROFSTREAM_PURE_PROCESSORS)"


def _intervals(draw, n: int, lo: int = 500, hi: int = 2_500) -> tuple[np.ndarray, np.ndarray]:
    start = np.array(draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), np.int64)
    length = np.array(draw(st.lists(st.integers(-20, 400), min_size=n, max_size=n)), np.int64)
    return start, start + length


@st.composite
def steps(draw) -> tuple[StepEvents, Window]:
    """A step of up to 60 ops of every kind, unsorted, overlapping, empty and outside [S, E]
    too, with carried intervals (a host window) or ahead ops (a device window)."""
    n = draw(st.integers(0, 60))
    start, end = _intervals(draw, n)
    kinds = np.array(draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), np.uint8)
    types = np.array(draw(st.lists(st.integers(0, len(TYPES) - 1), min_size=n, max_size=n)), np.int32)
    carried = [_intervals(draw, draw(st.integers(0, 4))) for _ in range(2)]
    ahead_n = draw(st.integers(0, 6))
    ahead_start, ahead_end = _intervals(draw, ahead_n)
    samples = draw(st.integers(0, 12))  # queue and memory samples, unsorted, with equal times
    sample_ts = np.array(draw(st.lists(st.sampled_from([500, 999, S, 1_500, 1_500, E, 2_001]), min_size=samples,
                                       max_size=samples)), np.int64)
    sizes = np.array(draw(st.lists(st.integers(-1, 4), min_size=samples, max_size=samples)), np.int64)
    codes = np.array(draw(st.lists(st.integers(0, 2), min_size=samples, max_size=samples)), np.int32)
    ev = StepEvents(run_id="r", rank=0, step=1, start_ns=S, end_ns=E, op_kind=kinds, op_type=types,
                    op_stream=np.zeros(n, np.int32), op_start_ns=start, op_dur_ns=end - start,
                    type_names=TYPES, carried_compute=carried[0], carried_comm=carried[1],
                    ahead_kind=np.array(draw(st.lists(st.integers(0, 5), min_size=ahead_n, max_size=ahead_n)),
                                        np.uint8),
                    ahead_start_ns=ahead_start, ahead_end_ns=ahead_end,
                    queue=codes, queue_ts_ns=sample_ts, queue_size=sizes, queue_names=["q2", "q0", "q1"],
                    queue_capacity=np.full(samples, -1, np.int64), mem_ts_ns=sample_ts[::-1].copy(),
                    mem_peak=np.where(sizes > 2, -1, sizes * 100), mem_allocated=(codes * 7 + sizes) * 10,
                    mem_reserved=sizes * 1000)
    if draw(st.booleans()):  # a device window: the numpy path takes its ops whole, with the ahead ones
        ev.op_launch_ns = np.array(draw(st.lists(st.sampled_from([-1, -1, 900, 1_200]), min_size=n, max_size=n)),
                                   np.int64)
        lo = draw(st.integers(500, 1_500))
        return ev, Window(True, lo, lo + draw(st.integers(0, 1_000)))
    return ev, Window(False, S, E)


@settings(max_examples=300, deadline=None)
@given(steps(), st.integers(0, 8))
def test_compiled_figures_equal_the_numpy_path(step, top_k):
    ev, window = step
    native = compiled.NATIVE
    assert native is not None

    def figures() -> tuple:
        carried = carry_past_end(ev)  # what the step carries into the next (arrays: compared as lists)
        assert all(a.dtype == np.int64 for kind in carried for a in kind)
        return (utilization(ev, window), op_type_costs(ev, top_k, window), device_kind_costs(ev, window),
                [[a.tolist() for a in kind] for kind in carried], queue_figures(ev), memory_figures(ev),
                step_window(ev), ev.any_launched())

    with_kernels = figures()
    compiled.NATIVE = None
    try:
        numpy_path = figures()
    finally:
        compiled.NATIVE = native
    assert with_kernels == numpy_path


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12), st.lists(st.tuples(st.integers(0, 10**12), st.integers(-5, 10**9),
                                              st.one_of(st.none(), st.floats(0, 1))), min_size=1, max_size=30))
def test_compiled_rolling_figures_equal_the_numpy_path(n, steps):
    """The rolling window's step-time mean, percentiles and data-wait share, as the window
    fills and wraps: the same floats on both paths."""
    window = RollingWindow(n)
    native = compiled.NATIVE
    for step_time, data_wait, util in steps:
        window.add(step_time, data_wait, util)
        with_kernels = window.figures()
        compiled.NATIVE = None
        try:
            assert window.figures() == with_kernels
        finally:
            compiled.NATIVE = native


_SHARE = st.one_of(st.just(float("nan")), st.just(-0.0), st.floats(0, 1), st.floats(-1e6, 1e6))


@st.composite
def readings(draw) -> tuple[dict, dict]:
    """A step's host readings and data-loader readings: workers in any order, the machine's
    rows among them, NaN where a value is unknown, batches -1 (not counted), 0 or more."""
    n_host, n_loader = draw(st.integers(0, 4)), draw(st.integers(0, 12))
    host = {c: np.array(draw(st.lists(_SHARE if dtype == "<f8" else st.integers(-2, 10**12), min_size=n_host,
                                      max_size=n_host)), dtype) for c, dtype in HOST_COLUMNS}
    values = {"worker": st.sampled_from([MACHINE, 0, 1, 2, 7]), "batches": st.integers(-1, 40),
              "cpu_count": st.integers(-1, 256), "pid": st.integers(0, 9)}
    loader = {c: np.array(draw(st.lists(values.get(c, _SHARE if dtype == "<f8" else st.integers(0, 10**12)),
                                        min_size=n_loader, max_size=n_loader)), dtype) for c, dtype in LOADER_COLUMNS}
    return host, loader


@settings(max_examples=400, deadline=None)
@given(readings())
def test_compiled_host_figures_equal_the_python_path(step_readings):
    """The step's resources (means, maxima, each worker's seconds per batch) are the same
    floats, None where unmeasured, from the kernel as from the Python loop."""
    host, loader = step_readings
    ev = StepEvents(run_id="r", rank=0, step=1, start_ns=S, end_ns=E, host_samples=host, loader_samples=loader)
    native = compiled.NATIVE
    with_kernel = host_figures(ev)
    compiled.NATIVE = None
    try:
        python_path = host_figures(ev)
    finally:
        compiled.NATIVE = native
    # repr: NaN never comes out, and -0.0 against 0.0 or a float against an int would show
    assert repr(with_kernel) == repr(python_path)
    assert native.host_figures(*(host[c] for c in ("cpu_user", "cpu_system", "cpu_iowait", "cpu_idle",
                                                     "process_cpu", "rss_bytes")),
                               *(loader[c] for c in ("worker", "cpu", "runnable", "interval_s", "batches",
                                                     "ctx_switches_per_s", "cpu_count"))) is not None


@settings(max_examples=300, deadline=None)
@given(readings())
def test_host_figures_of_decoded_readings_read_the_wire_bytes_as_the_python_path(step_readings):
    """A decoded batch's readings reach the kernel as the wire's bytes (WireColumns,
    ``wire=True``): the same resources as the Python loop over the arrays sent."""
    host, loader = step_readings
    sent = EventBatch(run_id="r", rank=0, host_samples=host, loader_samples=loader)
    got = decode_batch(encode_batch(sent))
    decoded = StepEvents(run_id="r", rank=0, step=1, start_ns=S, end_ns=E, host_samples=got.host_samples,
                         loader_samples=got.loader_samples)
    native = compiled.NATIVE
    with_kernel = host_figures(decoded)
    compiled.NATIVE = None
    try:
        python_path = host_figures(StepEvents(run_id="r", rank=0, step=1, start_ns=S, end_ns=E, host_samples=host,
                                              loader_samples=loader))
    finally:
        compiled.NATIVE = native
    assert repr(with_kernel) == repr(python_path)
    if len(host["ts_ns"]) and len(loader["ts_ns"]):  # both sections as the wire's bytes: the kernel takes them
        assert native.host_figures(*(got.host_samples.raw[i] for i in (1, 2, 4, 3, 5, 6)),
                                   *(got.loader_samples.raw[i] for i in (2, 5, 6, 4, 7, 8, 9)), True) is not None


def test_the_host_kernel_refuses_wire_bytes_of_a_partial_item():
    """``wire=True`` with a column whose bytes are not whole items: None, not a misread."""
    host = [b"\0" * 8] * 5 + [b"\0" * 8]
    loader = [b"\0" * 4, b"\0" * 8, b"\0" * 8, b"\0" * 8, b"\0" * 4, b"\0" * 8, b"\0" * 3]
    assert compiled.NATIVE.host_figures(*host, *loader, True) is None
    assert compiled.NATIVE.host_figures(*host, *loader[:-1], b"\0" * 4, True) is not None


def test_host_columns_the_kernel_does_not_take_fall_back_to_python():
    """Readings in columns of another type (float32 CPU shares, int64 workers) get None from
    the kernel and their figures from the Python loop."""
    host = {c: np.array([0.25, 0.5], "<f4") for c, _ in HOST_COLUMNS[1:-1]}
    host |= {"ts_ns": np.array([S, E], np.int64), "rss_bytes": np.array([0, -1], np.int64)}
    loader = {c: np.array([0, MACHINE], np.int64 if c == "worker" else dtype) for c, dtype in LOADER_COLUMNS}
    ev = StepEvents(run_id="r", rank=0, step=1, start_ns=S, end_ns=E, host_samples=host, loader_samples=loader)
    assert compiled.NATIVE.host_figures(host["cpu_user"], host["cpu_system"], host["cpu_iowait"], host["cpu_idle"],
                                        host["process_cpu"], host["rss_bytes"], loader["worker"], loader["cpu"],
                                        loader["runnable"], loader["interval_s"], loader["batches"],
                                        loader["ctx_switches_per_s"], loader["cpu_count"]) is None
    figures = host_figures(ev)
    assert figures["cpu_user"] == 0.375 and figures["workers"] == 1 and figures["rss_bytes"] is None


_NULLABLE_FLOAT = st.one_of(st.none(), st.floats(allow_nan=False), st.integers(-(2**53), 2**53))
_WORKER = st.fixed_dictionaries({"worker": st.integers(-(2**31), 2**31 - 1), "readings": st.integers(0, 2**31 - 1),
                                 "batches": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
                                 "s_per_batch": _NULLABLE_FLOAT, "cpu_s_per_batch": _NULLABLE_FLOAT})
# a value the generated function refuses (a numpy number, a bool for an int, a long for an
# int, a float for a long, a dict for the list) or a field missing
_ODD = st.sampled_from([("readings", np.int64(3)), ("readings", True), ("readings", 2**31), ("cpu_user", np.float64(1)),
                        ("rss_bytes", 1.5), ("rss_bytes", 2**63), ("per_worker", {}), ("cpu_count", None), ("workers", None)])


@st.composite
def resources(draw) -> dict:
    r = {"readings": draw(st.integers(0, 2**31 - 1))}
    for name in ("cpu_user", "cpu_system", "cpu_iowait", "cpu_idle", "process_cpu"):
        r[name] = draw(_NULLABLE_FLOAT)
    r["rss_bytes"] = draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)))
    r["loader_readings"], r["workers"] = draw(st.integers(0, 2**31 - 1)), draw(st.integers(-(2**31), 2**31 - 1))
    for name in ("worker_cpu_mean", "worker_cpu_max", "worker_runnable_mean", "worker_runnable_max"):
        r[name] = draw(_NULLABLE_FLOAT)
    r["worker_batches"] = draw(st.one_of(st.none(), st.integers(0, 2**40)))
    r["worker_s_per_batch"], r["worker_cpu_s_per_batch"] = draw(_NULLABLE_FLOAT), draw(_NULLABLE_FLOAT)
    r["per_worker"] = draw(st.lists(_WORKER, max_size=4).map(lambda x: x if len(x) % 2 else tuple(x)))
    r["ctx_switches_per_s"] = draw(_NULLABLE_FLOAT)
    r["cpu_count"] = draw(st.one_of(st.none(), st.integers(1, 2**31 - 1)))
    odd = draw(st.one_of(st.none(), _ODD, st.sampled_from(list(r))))
    if isinstance(odd, tuple):
        r[odd[0]] = odd[1]
    elif odd is not None:
        del r[odd]
    return r


_STEP = {"run_id": "r", "rank": 0, "world_size": 1, "host": "h", "device": "cpu", "step": 1, "start_ns": S,
         "end_ns": E, "step_time_ns": E - S, "data_wait_ns": 0, "fp_bp_ns": 0, "tail_ns": 0, "host_step_time_ns": E - S,
         "device_start_ns": None, "device_end_ns": None, "compute_ns": 0, "comm_ns": 0, "overlap_ns": 0,
         "pure_comm_ns": 0, "idle_ns": 0, "utilization": None, "overlap_ratio": None, "op_count": 0, "op_types": [],
         "kernel_types": [], "device_kinds": [], "uncorrelated_ops": 0, "memory": None, "queues": [], "starved": False,
         "rolling": None, "closed_by": "watermark", "late_events": 0, "closed_ns": E, "devices": [],
         "collectives": NO_CALLS, "dropped_ops": 0,
         "dropped_samples": 0, "work": None, "advice": []}


_FIGURE = st.one_of(st.floats(allow_nan=False), st.integers(-(2**53), 2**53), st.sampled_from([np.float64(1), "1", None]))
_ADVICE = st.fixed_dictionaries({"rule": st.text(max_size=12), "text": st.text(max_size=300),
                                 "source": st.one_of(st.text(max_size=40), st.sampled_from([b"x", None, "\udc80"])),
                                 "figures": st.one_of(st.dictionaries(st.text(max_size=20), _FIGURE, max_size=6),
                                                      st.sampled_from([[], {1: 1.0}]))})


def _written_alike(schema, record: dict) -> None:
    """``record`` written by ``schema``'s writer with the compiled plans is the bytes of the
    generated Python functions alone; a record those refuse (an odd type, a value out of
    range, a field missing) the compiled one refuses too, so that fastavro writes it (or says
    what is wrong)."""
    compiled_writer = writer.compile_writer(schema)
    python_writer = writer.compile_writer(schema, write_record=None)
    try:
        want = python_writer(record)
    except (writer.Unsupported, KeyError, OverflowError, UnicodeEncodeError):
        with pytest.raises((writer.Unsupported, TypeError, ValueError, KeyError, OverflowError, UnicodeEncodeError)):
            compiled_writer(record)
        return
    assert compiled_writer(record) == want


@settings(max_examples=400, deadline=None)
@given(resources(), st.lists(_ADVICE, max_size=2))
def test_the_compiled_resources_writer_writes_the_generated_writers_bytes(figures, advice):
    """A StepMetrics' host figures and advice lines written by the compiled plan
    (writer.NATIVE_RECORDS) are the bytes of the generated Python functions; a record those
    refuse (an odd type, a value out of range, a field missing), the compiled one refuses too,
    so that fastavro writes it (or says what is wrong)."""
    _written_alike(codec.CURRENT["StepMetrics"].parsed, {**_STEP, "resources": figures, "advice": advice})


_PACKED = st.one_of(st.binary(max_size=24), st.sampled_from(["", bytearray(b"x"), None, 3]))
_CALLS = st.fixed_dictionaries({"names": st.one_of(st.lists(st.text(max_size=8), max_size=3).map(
                                    lambda x: x if len(x) % 2 else tuple(x)), st.sampled_from([["\udc80"], [b"x"], None])),
                                "count": st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([2**31, True, 1.0])),
                                **{c: _PACKED for c in ("name_idx", "group_idx", "group_size", "seq", "bytes",
                                                        "start_ns", "end_ns")}})


@functools.cache
def _step_writers():
    """The StepMetrics writer with the compiled plans and the one of generated functions alone."""
    schema = codec.CURRENT["StepMetrics"].parsed
    return writer.compile_writer(schema), writer.compile_writer(schema, write_record=None)


@settings(max_examples=300, deadline=None)
@given(_CALLS, st.sampled_from([None, "count", "end_ns"]))
def test_the_compiled_collectives_writer_writes_the_generated_writers_bytes(calls, missing):
    """A StepMetrics' collective calls (names and packed columns) by the compiled plan: the
    generated function's bytes, and refused where it refuses (a str for bytes, a bytearray, a
    name not UTF-8, an int out of range, a field missing)."""
    if missing:
        del calls[missing]
    compiled_writer, python_writer = _step_writers()
    record = {**_STEP, "collectives": calls, "resources": None}
    try:
        want = python_writer(record)
    except (writer.Unsupported, KeyError, OverflowError, UnicodeEncodeError):
        with pytest.raises((writer.Unsupported, TypeError, KeyError, OverflowError, UnicodeEncodeError)):
            compiled_writer(record)
        return
    assert compiled_writer(record) == want
    assert codec.decode("StepMetrics", codec.CURRENT["StepMetrics"].header + want)["collectives"] == \
        {**calls, "names": list(calls["names"])}


def test_the_step_metrics_writer_writes_host_figures_by_the_compiled_plan():
    """The StepMetrics writer writes the whole record, its collective calls, host figures and
    advice lines among it, by one compiled plan, whose bytes read back as the record written."""
    calls = []

    def spy(record: dict, plan: tuple) -> bytes:
        calls.append(plan[0][0])
        return writer.WRITE_RECORD(record, plan)

    figures = {"readings": 2, "cpu_user": 0.5, "cpu_system": None, "cpu_iowait": 0.25, "cpu_idle": None,
               "process_cpu": 1.5, "rss_bytes": 2**40, "loader_readings": 3, "workers": 2, "worker_cpu_mean": 0.9,
               "worker_cpu_max": 1.0, "worker_runnable_mean": None, "worker_runnable_max": None, "worker_batches": 7,
               "worker_s_per_batch": 0.125, "worker_cpu_s_per_batch": None,
               "per_worker": [{"worker": 0, "readings": 2, "batches": 7, "s_per_batch": 0.125, "cpu_s_per_batch": None},
                              {"worker": 1, "readings": 1, "batches": None, "s_per_batch": None,
                               "cpu_s_per_batch": None}], "ctx_switches_per_s": 1e4, "cpu_count": 64}
    schema = codec.CURRENT["StepMetrics"].parsed
    advice = [{"rule": "more_workers", "text": "raise num_workers … ü", "source": "MindSpore",
               "figures": {"workers": 2.0, "data_wait_ms": 12.5}}, {"rule": "x", "text": "", "source": "", "figures": {}}]
    record = {**_STEP, "resources": figures, "advice": advice}
    data = writer.compile_writer(schema, write_record=spy)(record)
    assert calls == ["run_id"]  # one plan: the StepMetrics whole
    assert data == writer.compile_writer(schema, write_record=None)(record)
    back = codec.decode("StepMetrics", codec.CURRENT["StepMetrics"].header + data)
    assert back["resources"] == figures and back["advice"] == advice


def test_the_compiled_varint_writes_the_python_writers_bytes():
    """The generated Avro writers call the compiled zigzag varint: every long the same bytes."""
    assert writer.VARINT is not writer._varint
    values = [*range(-300, 300), *(s * 2**k + d for k in range(6, 63) for s in (1, -1) for d in (-1, 0, 1)),
              2**63 - 1, -(2**63)]
    assert [writer.VARINT(v) for v in values] == [writer._varint(v) for v in values]


def test_a_column_the_kernels_do_not_take_falls_back_to_numpy():
    """A column of another type (int16 kinds, float starts) or a queue size whose sums a
    double might not hold exactly gets None from the kernel, and the figure comes from the
    numpy path."""
    kinds, start, dur = np.array([0, 1], np.int16), np.array([10.0, 20.0]), np.array([5, 5], np.int64)
    empty = np.empty(0, np.int64)
    assert compiled.NATIVE.kind_overlap(kinds, start.astype(np.int64), dur, 0, 100, 0, 1, empty, empty, empty,
                                       empty) is None
    assert compiled.NATIVE.sums_by_code(np.array([0, 1], np.int32), start, dur, 0, 100) is None
    big = np.array([2**40, 3], np.int64)
    assert compiled.NATIVE.queue_sizes(np.zeros(2, np.int32), np.array([1, 2], np.int64), big, 0, 10) is None
    ev = StepEvents(run_id="r", rank=0, step=1, start_ns=0, end_ns=100, op_kind=np.array([0, 1], np.uint8),
                    op_type=np.array([0, 1], np.int16), op_start_ns=np.array([10, 20], np.int64), op_dur_ns=dur,
                    type_names=["x", "y"], queue=np.zeros(2, np.int32), queue_ts_ns=np.array([1, 2], np.int64),
                    queue_size=big, queue_names=["q"])
    assert queue_figures(ev) == [{"queue": "q", "min": 3, "mean": float(np.mean(big)), "last": 3, "at_start": None,
                                  "empty_ratio": 0.0}]
    assert op_type_costs(ev) == [{"op_type": "x", "total_ns": 5, "count": 1}, {"op_type": "y", "total_ns": 5,
                                                                                "count": 1}]


@pytest.mark.parametrize("options", [
    {"resources": True, "loader_fault": "cpu_bound", "stall": (3, 6), "device_counters": True},
    {"batch_size": 8, "seq_len": 128, "flops_per_token": 6e9, "capture_every_n_steps": 3, "comm_tail": (2, 5)},
    {"straggler_rank": 1, "slowdown": (4, 5)},
])
def test_compiled_and_python_processors_write_the_same_bytes(monkeypatch, options):
    """Every record the processors write from a simulated run (StepMetrics, alerts, run steps,
    rank ends) is the same bytes with the compiled reader and kernels as with neither."""
    from profstream.processors.stream import figures
    from profstream.simulate import SimConfig
    from tests.helpers import simulated_messages

    cfg = SimConfig(run_id="compiled", ranks=3, steps=10, ops_per_step=50, step_time_ms=50.0, seed=11, **options)
    messages = simulated_messages(cfg)
    monkeypatch.setattr("profstream.processors.figures.time.time_ns", lambda: 1_800_000_000_000_000_000)  # closed_ns
    batches = [sv for sv in codec.SCHEMAS.values() if sv.name == "EventBatch"]
    native = compiled.NATIVE
    outputs = {}
    for on in (True, False):
        for sv in batches:
            reader = sparse.sparse_reader(sv.parsed, compiled=on)
            assert (type(reader).__name__ == "builtin_function_or_method") == on
            monkeypatch.setitem(codec.SCHEMAS, sv.fingerprint, dataclasses.replace(sv, sparse=reader))
        monkeypatch.setattr(compiled, "NATIVE", native if on else None)
        outputs[on] = [(f.kind, f.value) for f in figures(messages)]
    assert sum(kind == "steps" for kind, _ in outputs[True]) >= 3 * 10
    assert outputs[True] == outputs[False]


_OP_TYPE = st.fixed_dictionaries({"op_type": st.text(max_size=12), "total_ns": st.integers(0, 2**62),
                                  "count": st.integers(0, 2**31 - 1)})
# a value the generated functions refuse where the StepMetrics is written by one plan: a
# symbol not of the enum, a str for the enum given as bytes, a numpy int, a float for a
# long, a dict for a nullable record's list, a list for a record, a missing nested field
_ODD_STEP = st.sampled_from([("closed_by", "later"), ("closed_by", b"grace"), ("closed_by", None),
                             ("step", np.int64(3)), ("op_count", 1.0), ("memory", [1]), ("rolling", {"window": 1}),
                             ("op_types", {}), ("starved", 1), ("host", b"h"), ("world_size", True)])


@st.composite
def step_records(draw) -> dict:
    r = {**_STEP, "resources": None}
    r["closed_by"] = draw(st.sampled_from(["watermark", "grace", "idle"]))
    r["world_size"] = draw(st.one_of(st.none(), st.integers(1, 2**31 - 1)))
    r["utilization"] = draw(st.one_of(st.none(), st.floats(allow_nan=False)))
    r["op_types"] = draw(st.lists(_OP_TYPE, max_size=12))
    r["kernel_types"] = draw(st.lists(_OP_TYPE, max_size=3).map(tuple))
    r["memory"] = draw(st.one_of(st.none(), st.fixed_dictionaries(
        {k: st.integers(-(2**63), 2**63 - 1) for k in ("peak", "allocated", "reserved")})))
    r["queues"] = draw(st.lists(st.fixed_dictionaries(
        {"queue": st.text(max_size=8), "min": st.integers(0, 99), "mean": st.floats(allow_nan=False),
         "last": st.integers(0, 99), "at_start": st.one_of(st.none(), st.integers(0, 99)),
         "empty_ratio": st.floats(0, 1)}), max_size=2))
    r["rolling"] = draw(st.one_of(st.none(), st.fixed_dictionaries(
        {"window": st.integers(0, 100), "mean_step_time_ns": st.floats(allow_nan=False),
         "p50_step_time_ns": st.floats(allow_nan=False), "p95_step_time_ns": st.floats(allow_nan=False),
         "data_wait_share": st.floats(allow_nan=False), "mean_utilization": st.floats(allow_nan=False),
         **{k: st.one_of(st.none(), st.floats(allow_nan=False)) for k in (
             "mean_tokens_per_s", "mean_samples_per_s", "mean_mfu")}})))
    r["late_events"] = draw(st.integers(-(2**63), 2**63 - 1))
    odd = draw(st.one_of(st.none(), st.none(), _ODD_STEP, st.sampled_from(list(r))))
    if isinstance(odd, tuple):
        r[odd[0]] = odd[1]
    elif odd is not None:
        del r[odd]
    return r


@settings(max_examples=300, deadline=None)
@given(step_records(), st.sampled_from([3, 5, 9]))
def test_a_step_metrics_written_whole_by_the_compiled_plan_is_the_generated_writers_bytes(record, version):
    """A StepMetrics written whole by the compiled plan (writer.NATIVE_RECORDS: its enum,
    nested records, op types' records) is the bytes of the generated Python functions, for
    each version the step stage writes; a record those refuse the plan refuses too, so that
    fastavro writes it (or says what is wrong)."""
    schema = codec.VERSIONS[("StepMetrics", version)].parsed
    if version == 3:  # v3's rolling figures have no work figures
        record = {**record, "rolling": None if not isinstance(record.get("rolling"), dict) else {
            k: v for k, v in record["rolling"].items() if not k.startswith("mean_") or k in (
                "mean_step_time_ns", "mean_utilization")}} if "rolling" in record else record
    _written_alike(schema, record)


def _rekeyed(value, reverse: bool):
    """``value`` with every dict's keys new, equal str objects (not the interned names), in
    reverse order where ``reverse``."""
    if isinstance(value, dict):
        items = [("".join(list(k)) if isinstance(k, str) else k, _rekeyed(v, reverse)) for k, v in value.items()]
        return dict(reversed(items) if reverse else items)
    if isinstance(value, list):
        return [_rekeyed(v, reverse) for v in value]
    return value


@settings(max_examples=150, deadline=None)
@given(step_records(), st.sampled_from([3, 9]), st.booleans(), st.one_of(st.none(), resources()),
       st.lists(_ADVICE, max_size=2))
def test_the_compiled_plan_writes_the_same_bytes_whatever_order_and_key_objects_the_record_has(record, version,
                                                                                             reverse, host, advice):
    """The compiled plan takes a field from the record's entry at hand where it is the
    field's interned name and looks it up otherwise: a record with its keys in another order,
    or as other (equal) str objects, is written to the same bytes as the generated functions
    write."""
    schema = codec.VERSIONS[("StepMetrics", version)].parsed
    if version == 3 and isinstance(record.get("rolling"), dict):
        record = {**record, "rolling": {k: v for k, v in record["rolling"].items()
                                        if not k.startswith("mean_") or k in ("mean_step_time_ns", "mean_utilization")}}
    elif version == 9:
        record = {**record, "resources": host, "advice": advice}
    python_writer = writer.compile_writer(schema, write_record=None)
    try:
        want = python_writer(record)
    except (writer.Unsupported, KeyError, OverflowError, UnicodeEncodeError):
        return
    compiled_writer = writer.compile_writer(schema)
    assert compiled_writer(record) == want
    assert compiled_writer(_rekeyed(record, reverse)) == want


def test_the_step_metrics_writer_writes_the_whole_record_by_one_compiled_plan():
    """The StepMetrics writer of the step stage's common case (v3: no device figures, no
    calls) makes one compiled call for the whole record, nested records and enum included,
    and what it writes is what fastavro writes."""
    calls = []

    def spy(record: dict, plan: tuple) -> bytes:
        calls.append(plan[0][0])
        return writer.WRITE_RECORD(record, plan)

    sv = codec.VERSIONS[("StepMetrics", 3)]
    record = {k: v for k, v in _STEP.items() if k in {f["name"] for f in sv.parsed["fields"]}}
    record.update(closed_by="grace", utilization=0.5, overlap_ratio=0.25, memory={"peak": 3, "allocated": 2,
                                                                                  "reserved": 4},
                  op_types=[{"op_type": "MatMul", "total_ns": 700, "count": 2}, {"op_type": "other", "total_ns": 1,
                                                                                  "count": 1}],
                  queues=[{"queue": "q", "min": 0, "mean": 1.5, "last": 2, "at_start": None, "empty_ratio": 0.5}])
    data = writer.compile_writer(sv.parsed, write_record=spy)(record)
    assert calls == ["run_id"]
    assert data == writer.compile_writer(sv.parsed, write_record=None)(record)
    out = io.BytesIO()
    fastavro.schemaless_writer(out, sv.parsed, record)
    assert data == out.getvalue()


def _rank_checkpoint() -> dict:
    """The RankCheckpoint of a rank of the step stage after a few steps of a simulated run."""
    from profstream.kafka.topics import Topics
    from profstream.processors.health import StageCounts
    from profstream.processors.runtime import StepStage
    from profstream.simulate import SimConfig
    from tests.helpers import simulated_messages

    stage = StepStage(Topics("cp"), 1, StageCounts())
    cfg = SimConfig(run_id="cp", ranks=1, steps=6, ops_per_step=20, step_time_ms=50.0, seed=3)
    for m in simulated_messages(cfg, close=False):
        stage.fold(m, m.clock)
    stage.ready(m.clock)
    (rank,) = stage.ranks.values()
    return {**rank.assembler.snapshot(), **rank.figures.snapshot()}


_LONGS = st.dictionaries(st.text(max_size=10), st.integers(-(2**63), 2**63 - 1), max_size=4)
_ODD_LONG = st.sampled_from([True, np.int64(1), 2**63, 1.0, None])


@settings(max_examples=200, deadline=None)
@given(_LONGS, _LONGS, st.one_of(st.none(), _ODD_LONG), st.binary(max_size=24))
def test_a_rank_checkpoint_written_by_the_compiled_plan_is_the_generated_writers_bytes(producers, counters, odd,
                                                                                       carry):
    """A RankCheckpoint (its maps of longs, its carried intervals' bytes, its nested rolling
    and stall state) written by the compiled plan is the bytes of the generated functions; a
    map value those refuse (a bool, a numpy int, a long out of range, a float) the plan
    refuses too."""
    schema = codec.CURRENT["RankCheckpoint"].parsed
    record = {**_CHECKPOINT, "producers": producers, "counters": dict(counters),
              "carry": {**_CHECKPOINT["carry"], "comm_start": carry}}
    if odd is not None:
        record["counters"]["odd"] = odd
    _written_alike(schema, record)


_CHECKPOINT = _rank_checkpoint()


def test_a_rank_checkpoint_is_written_whole_by_one_compiled_plan():
    """The step stage's RankCheckpoint (one per changed rank a transaction) is written by one
    compiled call, the bytes fastavro writes."""
    calls = []

    def spy(record: dict, plan: tuple) -> bytes:
        calls.append(plan[0][0])
        return writer.WRITE_RECORD(record, plan)

    sv = codec.CURRENT["RankCheckpoint"]
    data = writer.compile_writer(sv.parsed, write_record=spy)(_CHECKPOINT)
    assert calls == ["run_id"]
    out = io.BytesIO()
    fastavro.schemaless_writer(out, sv.parsed, _CHECKPOINT)
    assert data == out.getvalue()
    assert codec.decode("RankCheckpoint", sv.header + data)["rolling"] == _CHECKPOINT["rolling"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 2**31)), min_size=2, max_size=5),
       st.sampled_from(["u1", "<i4", "<i8", "<f8"]), st.sampled_from([None, "other dtype", "missing", "2-d"]))
def test_compiled_concatenation_of_a_steps_parts_is_numpys(sizes, dtype, odd):
    """A step's columns gathered from several batches, joined by the compiled copy, are
    np.concatenate's values and dtype; parts it does not take (a column of another dtype in
    one part, a column missing, a 2-D array) give None, and numpy joins them as before."""
    parts = [{"a": np.random.default_rng(seed).integers(0, 200, n).astype(dtype),
              "b": np.arange(n, dtype=np.int64)} for n, seed in sizes]
    if odd == "other dtype":
        parts[-1]["a"] = parts[-1]["a"].astype(np.int16)
    elif odd == "missing":
        del parts[0]["b"]
    elif odd == "2-d":
        parts[1]["b"] = np.zeros((1, 2), np.int64)
    got = compiled.NATIVE.concat_columns(parts, ("a", "b"))
    if odd is not None:
        assert got is None
        return
    for name, blob in zip(("a", "b"), got):
        want = np.concatenate([p[name] for p in parts])
        joined = np.frombuffer(blob, parts[0][name].dtype)
        assert joined.dtype == want.dtype and joined.tobytes() == want.tobytes()
        assert joined.flags.writeable  # as np.concatenate's result (a test may move an op of a closed step)
