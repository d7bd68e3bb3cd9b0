"""RunStepMetrics v5's per-rank columns (schema/rank_columns.py): Avro's own long encoding,
read back exactly, and a v5 record reads as the v4 record of the same run step."""

import io
from pathlib import Path

import fastavro
import numpy as np
import pytest

from profstream.schema.codec import VERSIONS, DecodeError, decode, encode, encode_run_step_metrics
from profstream.schema.rank_columns import (
    expanded,
    pack_longs,
    pack_ranks,
    packed,
    unpack_longs,
    unpack_ranks,
)
from profstream.schema.writer import _varint

DATA = Path(__file__).parent / "data"
EDGES = np.array([0, -1, 1, 63, -64, 64, -65, 8191, 8192, 2**31, -(2**31), 2**63 - 1, -(2**63)], np.int64)


@pytest.mark.parametrize("values", [EDGES, np.arange(-300, 300), np.full(5, 10**17), np.zeros(0, np.int64),
                                    np.random.default_rng(7).integers(-(2**63), 2**63 - 1, 2000, dtype=np.int64)])
def test_packed_longs_are_the_items_of_an_avro_long_array_and_read_back_exactly(values):
    out = io.BytesIO()
    fastavro.schemaless_writer(out, {"type": "array", "items": "long"}, values.tolist())
    items = out.getvalue()[len(_varint(len(values))):-1] if len(values) else b""
    assert pack_longs(values) == items
    assert unpack_longs(pack_longs(values)).tolist() == values.tolist()


def test_ranks_in_order_take_a_byte_each_and_any_order_reads_back():
    assert len(pack_ranks(np.arange(16_384))) == 16_384
    ranks = np.array([5, 3, 70_000, 0, 2**40])
    assert unpack_ranks(pack_ranks(ranks)).tolist() == ranks.tolist()


@pytest.mark.parametrize("data", [b"\x80", b"\x01\xff", b"\xff" * 11 + b"\x01"])
def test_a_column_that_is_not_whole_varints_is_refused(data):
    with pytest.raises(ValueError):
        unpack_longs(data)


def test_a_shipped_v4_run_step_reads_the_same_written_as_v5():
    """A RunStepMetrics v4 of an older processor (an untimed rank, clock offsets, work)
    decodes as before; written again (v5) it decodes to the same record, and columns
    expand to what was packed."""
    v4 = (DATA / "runstepmetrics-v4.bin").read_bytes()
    assert v4[:10] == VERSIONS[("RunStepMetrics", 4)].header
    old = decode("RunStepMetrics", v4)
    assert old["collective_ranks"][1] == {"rank": 1, "wait_ns": 0, "transfer_ns": None, "slowest_collective": None,
                                          "slowest_ns": None}
    assert [c["rank"] for c in old["clock_offsets"]] == [1, 2] and old["step_times_ns"] == {"0": 10, "1": 14, "2": 12}
    v5 = encode_run_step_metrics(old)
    assert v5[:10] == VERSIONS[("RunStepMetrics", 5)].header
    assert decode("RunStepMetrics", v5) == old
    assert expanded(packed(old)) == old
    assert len(v5) < len(v4) + 40  # three small lists: about the same bytes


def test_a_rank_half_measured_cannot_be_packed():
    old = decode("RunStepMetrics", (DATA / "runstepmetrics-v4.bin").read_bytes())
    odd = {**old, "collective_ranks": [{**old["collective_ranks"][0], "transfer_ns": None}]}
    with pytest.raises(ValueError, match="null together"):
        packed(odd)


def test_a_v5_body_with_columns_of_different_lengths_is_a_decode_error_not_a_crash():
    old = decode("RunStepMetrics", (DATA / "runstepmetrics-v4.bin").read_bytes())
    record = packed(old)
    record["rank_clocks"] = {**record["rank_clocks"], "error_ns": pack_longs(np.array([1]))}
    with pytest.raises(DecodeError) as e:
        decode("RunStepMetrics", encode("RunStepMetrics", record))
    assert e.value.reason == "malformed" and "differ in length" in str(e.value)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_run_steps_written_to_files_keep_v4s_columns(tmp_path, fmt):
    """`replay --offline` writes the run steps it decodes to a table whose columns are the
    shape decode gives (v4's: step_times_ns, collective_ranks, clock_offsets), not v5's."""
    import json

    from profstream.offline.record_files import RecordWriter

    run = decode("RunStepMetrics", encode_run_step_metrics(decode("RunStepMetrics",
                                                                  (DATA / "runstepmetrics-v4.bin").read_bytes())))
    writer = RecordWriter(tmp_path / f"run_steps.{fmt}", "RunStepMetrics", fmt)
    writer.write(run)
    writer.close()
    if fmt == "jsonl":
        assert json.loads((tmp_path / "run_steps.jsonl").read_text()) == run
        return
    import pandas as pd

    table = pd.read_parquet(tmp_path / "run_steps.parquet")
    row = table.iloc[0]
    assert dict(row["step_times_ns"]) == {"0": 10, "1": 14, "2": 12}
    assert [c["rank"] for c in row["clock_offsets"]] == [1, 2]
    assert [c["transfer_ns"] for c in row["collective_ranks"]] == [1, None, 5]
