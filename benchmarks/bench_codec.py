"""Encode and decode throughput of ``EventBatch`` (1,000 ops per batch), single thread.

Each format is timed from its natural in-memory form to bytes and back:

- ``profstream``: ``encode_batch(EventBatch)`` / ``decode_batch(bytes)`` (numpy columns,
  packed little-endian arrays in Avro bytes, single-object header). The batch also holds
  a step mark, memory and queue samples, as the Sender's batches do.
- ``fastavro_record_per_op`` (baseline): one Avro record per op (name, type, kind, stream,
  step, start_ns, dur_ns), one ``schemaless_writer``/``schemaless_reader`` call per op,
  from / to a list of dicts.
- ``avro_columnar_arrays`` (baseline): one record of Avro arrays of longs/ints plus the
  name dictionaries, no packing, from / to a dict of Python lists.

The baselines are not charged for building their input (dicts, lists) from numpy; that
favours them. ``diagnostics.sender_build`` times what the Sender does per batch on top of
the codec: op tuples -> columns (``op_columns``) -> ``encode_batch``.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Callable
from typing import Any

import lz4.frame
import numpy as np
from _common import emit, envelope, note, summary
from fastavro import parse_schema, schemaless_reader, schemaless_writer

from profstream.producers.buffer import rows_chunk
from profstream.producers.sender import op_columns
from profstream.schema.batch import I32, I64, NO_VALUE, U8, EventBatch, decode_batch, encode_batch

TARGET_OPS_PER_S = 2_000_000
N_NAMES, N_TYPES = 50, 10

OP_RECORD = parse_schema({
    "type": "record", "name": "OpEvent", "namespace": "bench",
    "fields": [{"name": "name", "type": "string"}, {"name": "type", "type": "string"},
               {"name": "kind", "type": "int"}, {"name": "stream", "type": "int"},
               {"name": "step", "type": "long"}, {"name": "start_ns", "type": "long"},
               {"name": "dur_ns", "type": "long"}],
})


def _array(name: str, items: str) -> dict:
    return {"name": name, "type": {"type": "array", "items": items}}


COLUMNAR = parse_schema({
    "type": "record", "name": "OpColumnsPlain", "namespace": "bench",
    "fields": [_array("op_names", "string"), _array("op_types", "string"),
               _array("name_idx", "int"), _array("type_idx", "int"), _array("kind", "int"),
               _array("stream", "int"), _array("step", "long"), _array("start_ns", "long"),
               _array("dur_ns", "long")],
})


def make_batch(n_ops: int, seq: int, rng: np.random.Generator) -> EventBatch:
    """A realistic batch: ~50 op names over ~10 types, back-to-back kernels on 4 streams."""
    names = [f"aten::op_{i}" for i in range(N_NAMES)]
    types = [f"type_{i}" for i in range(N_TYPES)]
    name_idx = rng.integers(0, N_NAMES, n_ops).astype(I32)
    type_idx = (name_idx % N_TYPES).astype(I32)
    dur = rng.integers(1_000, 500_000, n_ops).astype(I64)
    gap = rng.integers(100, 5_000, n_ops).astype(I64)
    t0 = 1_790_000_000_000_000_000 + seq * 10**9
    start = t0 + np.cumsum(dur + gap) - dur
    step = 100 + seq
    batch = EventBatch(
        run_id="bench-run", rank=3, host="node-17", device="cuda:3", producer_id="f" * 32,
        seq=seq, sent_ns=int(start[-1]), complete_through_step=step - 1, buffer_fill_ratio=0.01,
        send_latency_ns=2_500_000, op_names=names, op_types=types,
    )
    batch.ops = {"name_idx": name_idx, "type_idx": type_idx,
                 "kind": (type_idx % 3).astype(U8), "stream": (name_idx % 4).astype(I32),
                 "step": np.full(n_ops, step, I64), "start_ns": start, "dur_ns": dur}
    end = int(start[-1] + dur[-1])
    batch.steps = {"step": np.array([step], I64), "start_ns": np.array([t0], I64),
                   "end_ns": np.array([end], I64), "fp_start_ns": np.array([t0 + 1000], I64),
                   "bp_end_ns": np.array([NO_VALUE], I64)}
    ts = np.linspace(t0, end, 3).astype(I64)
    batch.memory = {"ts_ns": ts, "step": np.full(3, step, I64),
                    "allocated": np.array([8, 9, 10], I64) << 30,
                    "reserved": np.full(3, 12 << 30, I64), "peak": np.full(3, NO_VALUE, I64)}
    batch.queue_names = ["train_loader"]
    batch.queues = {"name_idx": np.zeros(2, I32), "ts_ns": ts[:2], "step": np.full(2, step, I64),
                    "size": np.array([4, 3], I64), "capacity": np.array([8, 8], I64)}
    return batch


def as_records(b: EventBatch) -> list[dict]:
    o = b.ops
    return [{"name": b.op_names[n], "type": b.op_types[t], "kind": int(k), "stream": int(s),
             "step": int(st), "start_ns": int(a), "dur_ns": int(d)}
            for n, t, k, s, st, a, d in zip(*(o[c].tolist() for c in
                                              ("name_idx", "type_idx", "kind", "stream", "step", "start_ns", "dur_ns")))]


def as_columns(b: EventBatch) -> dict[str, list]:
    return {"op_names": list(b.op_names), "op_types": list(b.op_types),
            **{c: v.tolist() for c, v in b.ops.items()}}


def as_tuples(b: EventBatch) -> list[tuple]:
    """The Monitor's buffered form: (name, op_type, kind, stream, step, start_ns, dur_ns)."""
    o = b.ops
    names = [b.op_names[i] for i in o["name_idx"].tolist()]
    types = [b.op_types[i] for i in o["type_idx"].tolist()]
    return list(zip(names, types, o["kind"].tolist(), o["stream"].tolist(), o["step"].tolist(),
                    o["start_ns"].tolist(), o["dur_ns"].tolist()))


def records_encode(records: list[dict]) -> bytes:
    out = io.BytesIO()
    for r in records:
        schemaless_writer(out, OP_RECORD, r)
    return out.getvalue()


def records_decode(data: bytes, n: int) -> list[dict]:
    buf = io.BytesIO(data)
    return [schemaless_reader(buf, OP_RECORD, None) for _ in range(n)]


def columnar_encode(cols: dict[str, list]) -> bytes:
    out = io.BytesIO()
    schemaless_writer(out, COLUMNAR, cols)
    return out.getvalue()


def columnar_decode(data: bytes) -> dict:
    return schemaless_reader(io.BytesIO(data), COLUMNAR, None)


def sender_build(rows: list[tuple]) -> bytes:
    names, types, cols, _ = op_columns([rows_chunk(rows)])
    b = EventBatch(run_id="bench-run", rank=3, op_names=names, op_types=types, ops=cols)
    return encode_batch(b)


def native_record_and_build() -> Callable[[list[tuple]], bytes] | None:
    """The native Monitor's work for the same batch: each op() call into its columns, then
    the Batcher's build of the message (None where the native Monitor does not load)."""
    try:
        from profstream.producers import native
    except ImportError:  # a checkout before the native Monitor
        return None
    module, _why = native.load()
    if module is None:
        return None
    buffer = native.make_buffer(256 << 20, 1 << 20)
    plan = native.batch_plan({"run_id": "bench-run", "rank": 3, "world_size": None, "host": "", "device": "cpu",
                              "producer_id": ""})
    batcher = module.Batcher(buffer, plan, 1 << 30, 1 << 30, 1.0, 1.0, 0.0, buffer.host)
    op = buffer.op

    def record_and_build(rows: list[tuple]) -> bytes:
        for name, op_type, kind, stream, step, start, dur in rows:
            op(name, start, dur, kind, op_type, stream, step)
        batcher.build()
        return batcher.take_message()[0]

    return record_and_build


def rate(fn: Callable[[Any], Any], inputs: list, ops_per_input: int, min_seconds: float) -> float:
    """Ops/s of ``fn`` over ``inputs``, cycled until at least ``min_seconds`` have passed."""
    pc = time.perf_counter
    done = 0
    t0 = pc()
    while True:
        for x in inputs:
            fn(x)
        done += len(inputs)
        took = pc() - t0
        if took >= min_seconds:
            return done * ops_per_input / took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ops", type=int, default=1000, help="ops per batch")
    p.add_argument("--batches", type=int, default=20, help="distinct batches cycled through")
    p.add_argument("--seconds", type=float, default=0.5, help="minimum time per measurement")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    batches = [make_batch(args.ops, s, rng) for s in range(args.batches)]
    n = args.ops
    encoded = [encode_batch(b) for b in batches]
    records = [as_records(b) for b in batches]
    records_bytes = [records_encode(r) for r in records]
    columns = [as_columns(b) for b in batches]
    columns_bytes = [columnar_encode(c) for c in columns]
    tuples = [as_tuples(b) for b in batches]

    # Round trips, so a format that loses data cannot win.
    back = decode_batch(encoded[0])
    assert all(np.array_equal(back.ops[c], batches[0].ops[c]) for c in batches[0].ops)
    assert records_decode(records_bytes[0], n) == records[0]
    assert columnar_decode(columns_bytes[0]) == columns[0]
    rebuilt = decode_batch(sender_build(tuples[0]))
    assert np.array_equal(rebuilt.ops["start_ns"], batches[0].ops["start_ns"])

    cases: dict[str, tuple[Callable, list, Callable, list, list]] = {
        "profstream": (encode_batch, batches, decode_batch, encoded, encoded),
        "fastavro_record_per_op": (records_encode, records, lambda d: records_decode(d, n),
                                   records_bytes, records_bytes),
        "avro_columnar_arrays": (columnar_encode, columns, columnar_decode, columns_bytes, columns_bytes),
    }
    formats: dict[str, Any] = {}
    for name, (enc, enc_in, dec, dec_in, sizes) in cases.items():
        enc_rates, dec_rates = [], []
        for r in range(args.repeats):  # encode and decode alternate, so noise hits both alike
            enc_rates.append(rate(enc, enc_in, n, args.seconds))
            dec_rates.append(rate(dec, dec_in, n, args.seconds))
            note(f"{name} repeat {r + 1}/{args.repeats}: encode {enc_rates[-1] / 1e6:.2f} M ops/s, "
                 f"decode {dec_rates[-1] / 1e6:.2f} M ops/s")
        formats[name] = {
            "encode_ops_per_s": enc_rates, "decode_ops_per_s": dec_rates,
            "encode_median": summary(enc_rates)["median"], "decode_median": summary(dec_rates)["median"],
            "encode_summary": summary(enc_rates), "decode_summary": summary(dec_rates),
            "bytes_per_op": sum(map(len, sizes)) / (len(sizes) * n),
            "message_bytes": sum(map(len, sizes)) / len(sizes),
            "lz4_bytes_per_op": sum(len(lz4.frame.compress(x)) for x in sizes) / (len(sizes) * n),
        }

    build_rates = []
    for _ in range(args.repeats):
        build_rates.append(rate(sender_build, tuples, n, args.seconds))
    diagnostics = {"sender_build": {
        "what": "Sender per-batch work on top of the codec: op tuples -> op_columns -> encode_batch",
        "ops_per_s": build_rates, "median": summary(build_rates)["median"], "summary": summary(build_rates),
    }}
    native_build = native_record_and_build()
    if native_build is not None:
        assert np.array_equal(decode_batch(native_build(tuples[0])).ops["start_ns"], batches[0].ops["start_ns"])
        native_rates = [rate(native_build, tuples, n, args.seconds) for _ in range(args.repeats)]
        diagnostics["native_record_and_build"] = {
            "what": "the native Monitor's work for the same ops: op() calls into its columns (on the training "
                    "thread), then the Batcher's message (on the sender thread, GIL released)",
            "ops_per_s": native_rates, "median": summary(native_rates)["median"], "summary": summary(native_rates),
        }

    ours = formats["profstream"]
    meets = ours["encode_median"] >= TARGET_OPS_PER_S and ours["decode_median"] >= TARGET_OPS_PER_S
    results = {
        "metric": "op events/s through encode_batch and decode_batch, 1 thread",
        "unit": "ops/s",
        "ops_per_batch": n,
        "per_repeat": {"encode": ours["encode_ops_per_s"], "decode": ours["decode_ops_per_s"]},
        "median": {"encode": ours["encode_median"], "decode": ours["decode_median"]},
        "target": {"min_encode_ops_per_s": TARGET_OPS_PER_S, "min_decode_ops_per_s": TARGET_OPS_PER_S},
        "meets_target": meets,
        "formats": formats,
        "diagnostics": diagnostics,
    }
    emit(envelope("codec", args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
