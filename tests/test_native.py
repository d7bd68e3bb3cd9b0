"""The compiled Monitor (producers/native*, csrc/): built with the package, the same bytes
as the pure-Python Monitor for the same events, its sender out of the GIL in the steady
state, and the fallback to Python when it cannot load."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from profstream import Monitor
from profstream.devices.backend import DeviceSample
from profstream.producers import monitor as monitor_module
from profstream.producers import native, native_sender, sender
from profstream.producers.native_sender import NativeSender
from profstream.producers.sender import Sender
from profstream.schema import batch as batch_schema
from profstream.schema.batch import decode_batch
from profstream.schema.codec import VERSIONS
from tests.helpers import IdleSender as _Idle
from tests.helpers import wait_until

UNREACHABLE = "127.0.0.1:1"



def test_the_native_monitor_is_built_with_the_package_and_loads():
    module, why = native.load()
    assert module is not None, f"the compiled Monitor does not load: {why}"
    assert "librdkafka" in native.describe()
    mon = Monitor(run_id="built", bootstrap=UNREACHABLE, sender_factory=_Idle)
    assert mon.recording == "native" and mon.stats()["recording"] == "native"


def _pair(**options: Any) -> tuple[Monitor, Sender, Monitor, NativeSender]:
    """A Python and a native Monitor of the same producer, with their senders idle."""
    common = {**dict(run_id="same", rank=3, world_size=8, host="host-1", device="cuda:3", bootstrap=UNREACHABLE,
                     host_sample_interval_s=0, sender_factory=_Idle), **options}
    py = Monitor(native=False, **common)
    nat = Monitor(native=True, **common)
    assert (py.recording, nat.recording) == ("python", "native")
    nat.producer_id = py.producer_id
    return py, Sender(py), nat, NativeSender(nat)


def _messages(py_sender: Sender, nat_sender: NativeSender, monkeypatch) -> tuple[list[bytes], list[bytes]]:
    """Every batch each sender builds now; the Python one stamped with the native one's sent_ns
    (but for the native Monitor's batches of collective calls, which the Python one does not write)."""
    nat = []
    nat_sender._send_foreign()  # device samples, collectives: by the Python encoder, before the native batch
    while (message := nat_sender._core.take_message()) is not None or nat_sender._core.build():
        if message is not None:
            nat.append(message[0])
    stamps = iter([b.sent_ns for b in map(decode_batch, nat) if not _of_collectives(b)] + [0] * 1000)
    py = []
    # the sender's own clock: patching time.time_ns would give stamps to any other thread
    # that reads it meanwhile too (a Monitor's control thread stamps its progress records)
    with monkeypatch.context() as patch:
        patch.setattr(py_sender, "now_ns", lambda: next(stamps))
        while py_sender._pending or py_sender._build():  # a build may queue device batches too
            py.append(py_sender._pending.popleft()[0])
    return py, nat


_NAMES = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)  # any text, NULs included
_I64 = st.integers(-(2**63), 2**63 - 1)
_KIND = st.one_of(st.integers(0, 5), st.sampled_from(["compute", "comm", "memcpy", "data", "warp-drive"]))
_OP = st.tuples(_NAMES, _I64, _I64, _KIND, st.one_of(st.none(), _NAMES), st.integers(-(2**31), 2**31 - 1),
                st.one_of(st.none(), _I64))
_STEP = st.fixed_dictionaries({
    "ops": st.lists(_OP, max_size=30),
    "bulk": st.one_of(st.none(), st.lists(st.tuples(_NAMES, _I64, _I64, st.integers(0, 5), _I64), min_size=1,
                                          max_size=40)),
    "bulk_launch": st.booleans(),  # with v4's launch_ns, or without (-1 for each op)
    "bulk_types": st.one_of(st.none(), _NAMES, st.just("per-op")),
    "memory": st.lists(st.tuples(_I64, _I64, _I64), max_size=3),
    "queues": st.lists(st.tuples(_NAMES, st.integers(0, 10**6), st.integers(-1, 10**6)), max_size=3),
    "devices": st.lists(st.tuples(st.integers(0, 7), st.floats(allow_infinity=False), st.integers(-1, 2**62)),
                        max_size=3),  # v5, in batches of their own
    "collectives": st.lists(st.tuples(_NAMES, _NAMES, _NAMES, _I64, _I64, _I64, _I64, _I64, st.integers(0, 2**31 - 1)),
                            max_size=3),  # v6: the native Monitor's in batches of their own
    # v8: data-loader readings (a worker's or the machine's, NaN for what was not read), in the rank's own batches
    "loader": st.lists(st.tuples(st.integers(-1, 7), st.integers(-1, 2**31 - 1), st.floats(allow_infinity=False),
                                 st.floats(0, 4), st.floats(0, 1), st.integers(-1, 2**31 - 1),
                                 st.floats(allow_infinity=False), st.integers(-1, 256)), max_size=3),
})


def _of_collectives(batch: batch_schema.EventBatch) -> bool:
    return batch.producer_id.endswith(sender.COLLECTIVE_PRODUCER_SUFFIX)


def _collective_rows(batches: list[batch_schema.EventBatch]) -> list[tuple]:
    """Every collective call of ``batches``, names decoded, in the order sent."""
    rows = []
    for b in batches:
        c, names = b.collectives, b.collective_names
        rows += [(names[n], names[g], names[d], *rest) for n, g, d, *rest in zip(
            *(c[k].tolist() for k in ("name_idx", "group_idx", "dtype_idx")),
            *(c[k].tolist() for k, _ in batch_schema.SECTIONS["collectives"][3:]))]
    return rows


def _apart(py: list[bytes], nat: list[bytes]) -> tuple[list[bytes], list[bytes], list[tuple], list[tuple]]:
    """The messages of both senders with the collective calls taken out (the Python sender's
    batches re-encoded without them: the version and bytes the native encoder writes), and
    the calls each sent."""
    py_batches, nat_batches = [decode_batch(m) for m in py], [decode_batch(m) for m in nat]
    py_calls = _collective_rows(py_batches)
    stripped = []
    for message, b in zip(py, py_batches):
        if b.n("collectives"):
            b.collectives, b.collective_names = batch_schema.empty_section("collectives"), []
            message = batch_schema.encode_batch(b)
        stripped.append(message)
    rest = [m for m, b in zip(nat, nat_batches) if not _of_collectives(b)]
    return stripped, rest, py_calls, _collective_rows([b for b in nat_batches if _of_collectives(b)])


def _record(mon: Monitor, steps: list[dict], t0: int = 1_700_000_000_000_000_000, first_step: int = 0) -> None:
    for s, step in enumerate(steps):
        mon.begin_step(first_step + s, ts_ns=t0 + s * 1000)
        for name, start, dur, kind, op_type, stream, at_step in step["ops"]:
            mon.op(name, start, dur, kind, op_type=op_type, stream=stream, step=at_step)
        if step["bulk"]:
            names, starts, durs, kinds, launches = (list(c) for c in zip(*step["bulk"]))
            types = step["bulk_types"]
            if types == "per-op":
                types = [None if i % 3 == 0 else f"t{i % 4}" for i in range(len(names))]
            mon.ops(np.array(names, dtype=object), np.array(starts, np.int64), durs, kinds=np.array(kinds, np.uint8),
                    op_types=types, streams=s, launch_ns=np.array(launches, np.int64) if step["bulk_launch"] else None)
        for i, (allocated, reserved, peak) in enumerate(step["memory"]):
            mon.memory(allocated, reserved, peak, ts_ns=t0 + s * 1000 + i)
        for i, (name, size, capacity) in enumerate(step["queues"]):
            mon.queue(name, size, capacity, ts_ns=t0 + s * 1000 + i)
        for i, (device, util, used) in enumerate(step.get("devices", ())):
            mon.device_sample(DeviceSample(device, gpu_util=util, mem_used=used), ts_ns=t0 + s * 1000 + i)
        for name, group, dtype, seq, start, dur, n_in, n_out, size in step.get("collectives", ()):
            mon.collective(name, group, seq, start, dur, size, in_bytes=n_in, out_bytes=n_out, dtype=dtype)
        for i, row in enumerate(step.get("loader", ())):
            mon.loader_sample(row, ts_ns=t0 + s * 1000 + i)
        mon.end_step(ts_ns=t0 + s * 1000 + 999)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_STEP, min_size=1, max_size=6), batch_max_ops=st.integers(1, 64))
def test_native_batches_are_the_bytes_of_the_python_sender(steps, batch_max_ops):
    """The same events, recorded step by step into both Monitors and sent after each step:
    every message byte for byte the same (blocks of 5 rows, so batches span blocks), but
    that the native Monitor sends the collective calls in batches of their own: the same
    calls, and the Python batches without them are the native ones byte for byte."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "BLOCK_ROWS", {"ops": 5})
        patch.setattr(native, "SAMPLE_BLOCK_ROWS", 2)
        py, py_sender, nat, nat_sender = _pair(batch_max_ops=batch_max_ops)
        for s in range(len(steps)):
            _record(py, steps[s:s + 1])
            _record(nat, steps[s:s + 1])
            got_py, got_nat, py_calls, nat_calls = _apart(*_messages(py_sender, nat_sender, patch))
            assert len(got_nat) == len(got_py)
            for a, b in zip(got_py, got_nat):
                assert a == b, (decode_batch(a), decode_batch(b))
            assert nat_calls == py_calls and len(py_calls) == len(steps[s]["collectives"])


def test_native_batches_are_the_python_bytes_at_training_scale(monkeypatch):
    """A training run's worth, sent when the sender had fallen behind (default blocks of
    4,096 ops, 8,192-op batches across them and across steps): 10 steps of 2,000 op() calls
    over 50 names, then 10 steps of one 3,000-op bulk chunk over 300 names. (The Python
    sender takes a batch's op() calls before its bulk chunks, so a batch that mixes both
    across steps is the same set of ops in another order: not recorded here.)"""
    py, py_sender, nat, nat_sender = _pair()
    rng = np.random.default_rng(5)
    steps = []
    for s in range(20):
        ops = [(f"aten::op_{rng.integers(50)}", int(rng.integers(1 << 60)), int(rng.integers(1 << 20)),
                int(rng.integers(6)), None, int(rng.integers(4)), None) for _ in range(2000 if s < 10 else 0)]
        bulk = [(f"kernel_{rng.integers(300)}", int(rng.integers(1 << 60)), 5, 0, int(rng.integers(-1, 1 << 60)))
                for _ in range(3000)]
        steps.append({"ops": ops, "bulk": bulk if s >= 10 else None, "bulk_types": "per-op", "bulk_launch": s % 2 == 0,
                      "memory": [(1, 2, 3)], "queues": [("device", 3, 8)]})
    _record(py, steps)
    _record(nat, steps)
    got_py, got_nat = _messages(py_sender, nat_sender, monkeypatch)
    assert len(got_py) == len(got_nat) == 7  # 50,000 ops in batches of 8,192
    assert got_py == got_nat


def test_steps_that_lost_events_are_marked_the_same_in_the_same_bytes(monkeypatch):
    """A buffer that fills while the sender is behind: both Monitors drop the same ops and
    samples, each step's mark says what that step lost, and the batches that carry such
    marks are EventBatch v8, byte for byte the same; batches whose marks lost nothing stay v4."""
    py, py_sender, nat, nat_sender = _pair(buffer_bytes=1 << 20)
    limit, reserve = py.buffer.max_ops, py.buffer.max_samples
    mem = reserve * 2 // 5  # memory samples a step: their reserve fills in step 2
    steps = [{"ops": [(f"op{i % 7}", 1000 * s + i, 5, 0, None, 0, None) for i in range(limit // 2)], "bulk": None,
              "memory": [(1, 2, 3)] * mem, "queues": [("q", 1, 8)]} for s in range(6)]
    _record(py, steps)
    _record(nat, steps)
    got_py, got_nat = _messages(py_sender, nat_sender, monkeypatch)
    assert got_py == got_nat
    batches = [decode_batch(m) for m in got_nat]
    marks = {int(s): (int(o), int(m)) for b in batches
             for s, o, m in zip(b.steps["step"], b.steps["dropped_ops"], b.steps["dropped_samples"])}
    # two steps' ops fit (and the odd op of step 2), then every op is dropped; the memory
    # reserve fills in step 2
    half, odd = limit // 2, limit % 2
    assert marks == {0: (0, 0), 1: (0, 0), 2: (half - odd, 3 * mem - reserve), 3: (half, mem), 4: (half, mem),
                     5: (half, mem)}
    assert {m[:10] for m in got_nat} == {VERSIONS[("EventBatch", 8)].header}  # marks that say what was lost
    assert sum(b.dropped_ops for b in batches) == nat.stats()["dropped_ops"] == 4 * half - odd
    _record(py, steps[:1], first_step=6)  # room again: a whole step, in a v4 batch
    _record(nat, steps[:1], first_step=6)
    got_py, got_nat = _messages(py_sender, nat_sender, monkeypatch)
    assert got_py == got_nat and {m[:10] for m in got_nat} == {VERSIONS[("EventBatch", 4)].header}


def test_a_batch_over_the_message_limit_splits_into_the_same_messages(monkeypatch, caplog):
    """Bulk ops with long names, a 40 kB message limit: both senders halve the batch until
    it fits, send the head and give the rest back, with the same bytes and warnings."""
    caplog.set_level(logging.WARNING, logger="profstream")
    monkeypatch.setattr(sender, "MAX_MESSAGE_BYTES", 40_000)
    monkeypatch.setattr(native_sender, "MAX_MESSAGE_BYTES", 40_000)
    py, py_sender, nat, nat_sender = _pair()
    names = [f"kernel_{i:04d}_" + "x" * 200 for i in range(1000)]
    for mon in (py, nat):
        mon.begin_step(0, ts_ns=10)
        mon.ops(names, np.arange(1000, dtype=np.int64), np.full(1000, 7, np.int64))
        mon.end_step(ts_ns=20)
    nat_messages = []
    while nat_sender._core.build():
        nat_messages.append(nat_sender._core.take_message()[0])
    nat_sender._handle_events()  # the native sender's warnings come back to Python as events
    said_native = [r.getMessage() for r in caplog.records]
    caplog.clear()
    stamps = iter(decode_batch(m).sent_ns for m in nat_messages)
    monkeypatch.setattr(py_sender, "now_ns", lambda: next(stamps))
    py_messages = []
    while py_sender._build():
        py_messages.append(py_sender._pending.popleft()[0])
    monkeypatch.undo()
    said_python = [r.getMessage() for r in caplog.records]
    assert len(py_messages) >= 8 and py_messages == nat_messages
    assert all(len(m) <= 40_000 for m in nat_messages)
    assert decode_batch(nat_messages[-1]).complete_through_step == 0
    assert said_native == said_python and "over Kafka's 40000 byte limit" in said_native[0]


def test_invalid_values_are_dropped_counted_and_said_once(caplog):
    """Garbage from user code never reaches the wire: each invalid op or sample is dropped,
    counted in the next batch header and said once."""
    caplog.set_level(logging.WARNING, logger="profstream")
    _py, _py_sender, nat, nat_sender = _pair()
    nat.begin_step(0, ts_ns=1)
    nat.op("ok", 1, 2)
    nat.op(None, "soon", None, kind="warp-drive", stream="x", step=object())
    nat.op("too-big", 1 << 70, 1)
    nat.op("bad-stream", 1, 1, stream=1 << 40)
    nat.ops(["a", "b", "c"], [1, None, 3], [1, 1, 1], kinds=["compute", "nonsense", 300])
    nat.memory("lots", None)
    nat.queue("q", "empty")
    nat.end_step(ts_ns=2)
    nat_sender._core.cycle()  # not connected: it only looks at the recorder, and says what it saw
    nat_sender._handle_events()
    assert nat_sender._core.build()
    batch = decode_batch(nat_sender._core.take_message()[0])
    assert batch.op_names == ["ok", "a"] and batch.ops["kind"].tolist() == [0, 0]
    assert batch.dropped_ops == 5 and batch.dropped_samples == 2 and batch.n("steps") == 1
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "non-numeric" in said[0] and "'soon'" in said[0] and "invalid values" in said[1], said


@pytest.mark.parametrize("dtype", ["int8", "uint8", "bool", "int16", "uint16", "int32", "uint32", "int64", "uint64"])
def test_numpy_integer_columns_of_any_width_give_the_python_bytes_and_drop_what_a_column_cannot_hold(
        monkeypatch, dtype):
    """op capture's columns are numpy arrays: each integer type reads into the int64, int32
    and uint8 columns as the Python path reads it (the same bytes), and a value out of its
    column's range (a kind past 255, a stream past int32) drops its op, counted."""
    py, py_sender, nat, nat_sender = _pair()
    info = np.iinfo(dtype) if dtype != "bool" else None
    small = np.array([0, 1, 1, 0], dtype=dtype)  # fits every column
    for mon in (py, nat):
        mon.begin_step(0, ts_ns=1)
        mon.ops(["a", "b", "c", "d"], small * 10 + 5, small + 1, kinds=small, streams=small, launch_ns=small)
        mon.end_step(ts_ns=2)
    got_py, got_nat = _messages(py_sender, nat_sender, monkeypatch)
    assert got_py == got_nat and decode_batch(got_nat[0]).ops["kind"].tolist() == [0, 1, 1, 0]
    if info is None or info.max <= 255:
        return
    nat.begin_step(1, ts_ns=3)
    big = np.array([1, min(info.max, 1 << 40), 2], dtype=dtype)  # too big for the kind (and past int32: the stream)
    nat.ops(["x", "y", "z"], big, big, kinds=big, streams=np.array([0, 0, 0], dtype=dtype))
    nat.ops(["u", "v"], [1, 2], [1, 1], streams=np.array([3, min(info.max, 1 << 40)], dtype=dtype))
    nat.end_step(ts_ns=4)
    assert nat_sender._core.build()
    batch = decode_batch(nat_sender._core.take_message()[0])
    dropped_streams = 1 if info.max > 2**31 - 1 else 0
    assert batch.op_names == ["x", "z", "u"] + (["v"] if not dropped_streams else [])
    assert batch.ops["stream"].tolist() == [0, 0, 3] + ([int(big[1])] if not dropped_streams else [])
    assert batch.dropped_ops == 1 + dropped_streams


def test_native_batches_are_v4_with_the_launch_times_the_python_path_writes(monkeypatch):
    """EventBatch v4's ops.launch_ns, written from SECTIONS and COLUMN_FILL with no native
    code of its own: given by Monitor.ops(launch_ns=...), -1 for op() and for ops() without
    it; the native message (v4: its marks say nothing more) decodes to what the Python
    path's decodes to."""
    assert batch_schema.COLUMN_FILL[("ops", "launch_ns")] == -1 and native.plain_version().version == 4
    py, py_sender, nat, nat_sender = _pair()
    for mon in (py, nat):
        mon.begin_step(0, ts_ns=1)
        mon.op("cpu-op", 10, 5)
        mon.ops(["kernel", "memcpy"], [20, 30], [5, 6], kinds=[0, 2], launch_ns=np.array([12, -1], np.int64))
        mon.ops(["host-bulk"], [40], [1], kinds=3)
        mon.end_step(ts_ns=50)
    (got_py,), (got_nat,) = _messages(py_sender, nat_sender, monkeypatch)
    assert got_nat.startswith(VERSIONS[("EventBatch", 4)].header)  # the v4 fingerprint
    a, b = decode_batch(got_py), decode_batch(got_nat)
    assert b.ops["launch_ns"].tolist() == [-1, 12, -1, -1]
    assert b.ops["start_ns"].tolist() == [10, 20, 30, 40]
    assert {c: v.tobytes() for c, v in a.ops.items()} == {c: v.tobytes() for c, v in b.ops.items()}  # NaN flops too
    assert got_py == got_nat


def test_step_work_goes_in_the_mark_with_no_native_code_and_both_monitors_write_the_same_bytes(monkeypatch):
    """EventBatch v8's work columns of a step mark (tokens, samples, FLOPs, their source,
    the peak, the FLOPs by category), written from SECTIONS and COLUMN_FILL by the native
    recorder that knows no schema: a step with all of them, one with tokens alone (the rest
    absent), one given FLOPs over a count, one without work; the Python Monitor's batch is
    the very same message."""
    py, py_sender, nat, nat_sender = _pair(peak_tflops=989.5)
    for mon in (py, nat):
        mon.begin_step(0, ts_ns=10)
        mon.work(tokens=4096, samples=8)
        mon.counted_flops(3e13, matmul=2.5e13, attention=4e12, conv=0.0)
        mon.work(tokens=4096, samples=8)  # a second micro-batch
        mon.end_step(ts_ns=20)
        mon.begin_step(1, ts_ns=20)
        mon.work(tokens=100)
        mon.end_step(ts_ns=30)
        mon.begin_step(2, ts_ns=30)
        mon.work(flops=1e13)
        mon.counted_flops(3e13)  # the user's value wins
        mon.work(tokens=-5, samples="x", flops=float("nan"))  # not counts: left out
        mon.end_step(ts_ns=40)
        mon.begin_step(3, ts_ns=40)
        mon.end_step(ts_ns=50)
    (got_py,), (got_nat,) = _messages(py_sender, nat_sender, monkeypatch)
    assert got_py == got_nat
    steps = decode_batch(got_nat).steps
    assert steps["tokens"].tolist() == [8192, 100, -1, -1] and steps["samples"].tolist() == [16, -1, -1, -1]
    assert steps["flops"][[0, 2]].tolist() == [3e13, 1e13] and np.isnan(steps["flops"][[1, 3]]).all()
    assert steps["flops_source"].tolist() == [2, 0, 1, 0]  # counted, none, given, none
    assert steps["peak_flops"][[0, 2]].tolist() == [989.5e12] * 2 and np.isnan(steps["peak_flops"][1])
    assert steps["matmul_flops"][0] == 2.5e13 and steps["conv_flops"][0] == 0.0 and np.isnan(steps["matmul_flops"][2])


def test_loader_readings_go_in_the_ranks_own_batch_and_both_monitors_write_the_same_bytes(monkeypatch):
    """EventBatch v8's data-loader readings travel in the Monitor's own batch (v8 where they
    are, the batches without them as before), not in a batch of their own: one message
    fewer for a processor to fold per reading; the native Monitor records them natively and
    writes the Python Monitor's bytes."""
    nan = float("nan")
    rows = [(0, 100, 1.0, 0.9, 1.0, 4, nan, -1), (1, 101, 1.0, 0.2, 0.3, 1, nan, -1),
            (batch_schema.MACHINE, -1, 1.0, nan, nan, -1, 4000.0, 8)]
    py, py_sender, nat, nat_sender = _pair()
    for mon in (py, nat):
        mon.begin_step(0, ts_ns=10)
        mon.op("cpu-op", 11, 5)
        for row in rows:
            mon.loader_sample(row, ts_ns=12)
        mon.end_step(ts_ns=20)
    got_py, got_nat = _messages(py_sender, nat_sender, monkeypatch)
    assert got_py == got_nat and len(got_nat) == 1  # one batch: the step, its op and its readings
    assert got_nat[0].startswith(VERSIONS[("EventBatch", 8)].header)
    batch = decode_batch(got_nat[0])
    assert batch.producer_id == nat.producer_id and batch.n("ops") == 1 and batch.complete_through_step == 0
    assert batch.loader_samples["worker"].tolist() == [0, 1, -1] and batch.loader_samples["step"].tolist() == [0] * 3
    assert batch.loader_samples["batches"].tolist() == [4, 1, -1]
    for mon in (py, nat):  # a step without readings: v4, as before
        mon.begin_step(1, ts_ns=20)
        mon.op("cpu-op", 21, 5)
        mon.end_step(ts_ns=30)
    got_py, got_nat = _messages(py_sender, nat_sender, monkeypatch)
    assert got_py == got_nat and got_nat[0].startswith(VERSIONS[("EventBatch", 4)].header)


def _held_until_queued(nat: Monitor, nat_sender: NativeSender) -> bytes:
    """One step of one op and one row recorded in Python beside it: the native batch built
    first (as a racing sender thread might) waits with the step's watermark until the row's
    batch of its own is queued, and is released after it. Returns that row's message."""
    assert nat.buffer.foreign.buffered_samples == 1 and not nat.buffer.empty
    assert nat_sender._core.build()
    held = decode_batch(nat_sender._core.take_message()[0])
    assert held.n("ops") == 1 and held.complete_through_step is None  # step 0 waits for the row
    nat_sender._send_foreign()
    assert nat_sender._core.build()
    message, _, samples = nat_sender._core.take_message()
    released = decode_batch(nat_sender._core.take_message()[0])
    assert samples == 1 and released.complete_through_step == 0 and nat.buffer.empty
    return message


def test_device_samples_go_by_the_python_encoder_before_the_batch_that_completes_their_step(monkeypatch):
    """EventBatch v5's device samples, a section the native encoder does not write: the
    native Monitor records them in Python, sends them as the Python path does (batches of
    their own, v5, the same bytes), and holds the watermark back until they are queued,
    so that a processor never sees their step complete before them."""
    py, py_sender, nat, nat_sender = _pair()
    for mon in (py, nat):
        mon.begin_step(0, ts_ns=1)
        mon.op("cpu-op", 10, 5)
        mon.device_sample(DeviceSample(3, gpu_util=0.5, mem_used=1 << 30, throttle_reasons=4), ts_ns=20)
        mon.end_step(ts_ns=50)
    device_message = _held_until_queued(nat, nat_sender)
    assert device_message.startswith(VERSIONS[("EventBatch", 5)].header)
    got = decode_batch(device_message)
    assert got.producer_id == nat.producer_id + sender.DEVICE_PRODUCER_SUFFIX and got.n("ops") == 0
    assert got.device_samples["device"].tolist() == [3] and got.device_samples["throttle_reasons"].tolist() == [4]
    monkeypatch.setattr(py_sender, "now_ns", lambda: got.sent_ns)
    assert py_sender._build()
    assert py_sender._pending.popleft()[0] == device_message  # what the Python Monitor sends


def test_collective_calls_go_in_batches_of_their_own_before_the_batch_that_completes_their_step(monkeypatch):
    """EventBatch v6's collective calls (Monitor.collective) on the native Monitor: recorded
    in Python, sent by the Python encoder in v6 batches of their own, the watermark held
    back until they are queued; the processors get the calls the Python Monitor sends."""
    py, py_sender, nat, nat_sender = _pair()
    for mon in (py, nat):
        mon.begin_step(0, ts_ns=1)
        mon.op("all_reduce", 10, 5, "comm")
        mon.collective("all_reduce", "0", 7, 10, 5, 8, in_bytes=4096, out_bytes=4096, dtype="Float")
        mon.end_step(ts_ns=50)
    calls_message = _held_until_queued(nat, nat_sender)
    assert calls_message.startswith(VERSIONS[("EventBatch", 6)].header)
    calls = decode_batch(calls_message)
    assert calls.producer_id == nat.producer_id + sender.COLLECTIVE_PRODUCER_SUFFIX and calls.seq == 0
    assert calls.complete_through_step is None and calls.n("ops") == calls.n("steps") == 0
    assert py_sender._build()
    python_batch = decode_batch(py_sender._pending.popleft()[0])
    assert _collective_rows([calls]) == _collective_rows([python_batch]) == [
        ("all_reduce", "0", "Float", 0, 7, 10, 5, 4096, 4096, 8)]


def test_the_processors_compute_the_same_figures_from_either_monitor(monkeypatch):
    """Two ranks of a job with collective calls, recorded by both Monitors: the native one's
    calls in batches of their own (``<producer_id>.collectives``), the Python one's in its
    batch of the step. Fed to the processors (processors.stream), every StepMetrics and
    RunStepMetrics is the same, the calls matched across the ranks included."""
    from profstream.processors.stream import RUN, STEPS, RawMessage, figures
    from profstream.schema.codec import decode_any

    def step(rank: int, s: int) -> dict:
        base = 1_700_000_000_000_000_000 + s * 1000
        ops = [(f"aten::op_{i % 3}", base + 10 * i, 7, i % 2, None, 0, None) for i in range(8)]
        calls = [("all_reduce", "0", "Float", 2 * s, base + 100, 50 + 40 * rank, 4096, 4096, 2),
                 ("all_gather", "0", "Float", 2 * s + 1, base + 400, 30 + 10 * rank, 64, 128, 2)]
        return {"ops": ops, "bulk": None, "memory": [(1, 2, 3)], "queues": [], "collectives": calls}

    streams: dict[str, list[RawMessage]] = {"python": [], "native": []}
    for rank in range(2):
        py, py_sender, nat, nat_sender = _pair(run_id="either", rank=rank, world_size=2, device=f"cuda:{rank}")
        for s in range(4):
            for mon in (py, nat):
                _record(mon, [step(rank, s)], t0=1_700_000_000_000_000_000 + s * 1000, first_step=s)
            py_messages, nat_messages = _messages(py_sender, nat_sender, monkeypatch)
            for kind, messages in (("python", py_messages), ("native", nat_messages)):
                for m in messages:
                    out = streams[kind]
                    out.append(RawMessage(1.0, rank, sum(r.partition == rank for r in out), b"either/%d" % rank, m))
    assert len(streams["native"]) == len(streams["python"]) + 2 * 4  # a batch of calls per rank and step

    def computed(kind: str) -> tuple[list[dict], list[dict]]:
        steps, run = [], []
        for f in figures(streams[kind]):
            if f.kind in (STEPS, RUN):
                record = decode_any(f.value)[1]
                record.pop("closed_ns", None)  # the processor's wall clock when it closed the step
                (steps if f.kind == STEPS else run).append(record)
        return sorted(steps, key=lambda r: (r["rank"], r["step"])), run

    py_steps, py_run = computed("python")
    nat_steps, nat_run = computed("native")
    assert len(py_steps) == 8 and len(py_run) == 4
    assert all(r["collectives"]["count"] == 2 for r in py_steps), py_steps[0]["collectives"]
    assert all(r["collectives_matched"] == 2 for r in py_run)
    for a, b in zip(py_steps, nat_steps):
        assert a == b, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
    assert nat_run == py_run


def test_collective_calls_the_native_buffer_cannot_hold_are_dropped_and_counted():
    """The samples' reserve full: Monitor.collective drops and counts, never blocks or raises;
    the next native batch reports the drops."""
    _py, _py_sender, nat, nat_sender = _pair()
    nat.begin_step(0, ts_ns=1)
    limit = nat.buffer.foreign.max_samples
    for i in range(limit + 3):
        nat.collective("all_reduce", "0", i, 10, 5, 2)
    nat.end_step(ts_ns=50)
    nat_sender._send_foreign()
    assert nat_sender._core.build()
    sent = [decode_batch(m[0]) for m in iter(nat_sender._core.take_message, None)]
    assert sum(b.n("collectives") for b in sent) == limit
    assert sum(b.dropped_samples for b in sent) == 3 and sent[-1].complete_through_step == 0


def test_a_buffer_part_the_native_sender_does_not_know_makes_the_monitor_python(monkeypatch):
    """A later section recorded in Python (a new part of EventBuffer.drain) that the native
    sender would not send: the native path refuses to load, so nothing is lost unseen."""
    from collections import namedtuple

    from profstream.producers import buffer

    monkeypatch.setattr(native, "Drained", namedtuple("Drained", [*buffer.Drained._fields, "later_section"]))
    monkeypatch.setattr(native, "_loaded", None)
    module, why = native.load()
    assert module is None and "later_section" in why
    monkeypatch.setattr(monitor_module, "_said", set())
    assert Monitor(run_id="later", bootstrap=UNREACHABLE, sender_factory=_Idle).recording == "python"


def test_a_native_part_that_does_not_load_leaves_the_python_monitor_and_one_warning(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="profstream")
    monkeypatch.setattr(native, "_loaded", (None, "test: the extension was not built"))
    monkeypatch.setattr(monitor_module, "_said", set())
    first = Monitor(run_id="fallback", bootstrap=UNREACHABLE, host_sample_interval_s=0, sender_factory=_Idle)
    second = Monitor(run_id="fallback", bootstrap=UNREACHABLE, host_sample_interval_s=0, sender_factory=_Idle)
    assert first.recording == second.recording == "python"
    said = [r for r in caplog.records if r.name.startswith("profstream")]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "runs in Python" in said[0].getMessage() and "not built" in said[0].getMessage()
    with first.step():
        first.op("still", 1, 2)
    assert first.buffered_ops == 1


@pytest.mark.kafka
def test_the_native_sender_stays_out_of_the_gil_while_nothing_needs_python(kafka_bootstrap, topics):
    """Steps of 5 ms with ops against the real broker: the sender thread cycles (builds,
    sends, hears acknowledgements) without coming back to Python, where it would take the
    GIL from the training thread."""
    mon = Monitor(run_id="gil", bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, host_sample_interval_s=0.2)
    assert mon.recording == "native"
    assert mon.flush(30)
    before = mon.stats()

    def run_steps() -> bool:
        for _ in range(10):
            with mon.step():
                for i in range(200):
                    mon.op(f"op{i % 9}", i, 3)
                time.sleep(0.005)  # the device, say
        now = mon.stats()  # (a cycle may build and send more than one batch)
        return now["batches_acked"] - before["batches_acked"] >= 20 and now["cycles"] - before["cycles"] >= 20

    wait_until(run_steps, 60, "20 batches acknowledged over 20 cycles")
    after = mon.stats()
    assert mon.close(timeout=30)
    assert after["python_returns"] - before["python_returns"] <= 1, (before, after)


def test_the_end_mark_of_a_monitor_that_closes_is_the_python_bytes(monkeypatch):
    """A Monitor that closes normally sends its end mark after its last step: natively the
    same bytes as from the Python sender (a step mark row whose step is END_MARK)."""
    from profstream.schema.batch import END_MARK

    py, py_sender, nat, nat_sender = _pair()
    step = {"ops": [("mm", 5, 10, 0, None, 0, None)], "bulk": None, "bulk_types": None, "bulk_launch": False,
            "memory": [], "queues": []}
    _record(py, [step])
    _record(nat, [step])
    monkeypatch.setattr(monitor_module, "_time_ns", lambda: 1_790_000_000_000_000_123)
    py.close()
    nat.close()
    got_py, got_nat = _messages(py_sender, nat_sender, monkeypatch)
    assert got_py == got_nat
    marks = [row for b in map(decode_batch, got_nat) for row in zip(b.steps["step"].tolist(), b.steps["end_ns"].tolist())]
    assert marks[-1] == (END_MARK, 1_790_000_000_000_000_123) and [s for s, _ in marks[:-1]] == [0]
