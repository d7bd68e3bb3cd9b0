"""A Chrome trace parsed in several processes gives exactly the Profile of one process:
the same ops, tables, kinds, steps, memory samples, unknown categories and header fields,
whatever chunk an event, a metadata event or a header field falls in. A cut that lands
inside an event makes the whole file go through the one-process path."""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from profstream.integrations.ingest import IngestError, chunks, load_profile
from profstream.integrations.ingest.trace_events import read_bytes
from profstream.schema.batch import COMMUNICATION, COMPUTE, HOST, MEMCPY
from tests.test_ingest import BASE_NS, _meta, _timeline, _torch_trace, _x

WORKERS = 4


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Files of a few kB cut into chunks, as large files are."""
    monkeypatch.setattr(chunks, "MIN_CHUNK_BYTES", 512)


def assert_same_profile(one, many) -> None:
    for f in dataclasses.fields(one):
        a, b = getattr(one, f.name), getattr(many, f.name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), f.name
        else:
            assert a == b, f.name


def parsed_in_chunks(path: Path) -> bool:
    return chunks.columns_in_chunks(path, read_bytes(path), WORKERS) is not None


def both(path: Path):
    one = load_profile(path, workers=1)
    many = load_profile(path, workers=WORKERS)
    assert_same_profile(one, many)
    return one


@pytest.mark.parametrize("gz", [False, True])
def test_a_torch_profiler_trace_in_chunks_is_the_one_process_profile(tmp_path, gz):
    path = tmp_path / "trace.json"
    _torch_trace(path, steps=9)
    if gz:
        path = path.with_suffix(".json.gz")
        path.write_bytes(gzip.compress((tmp_path / "trace.json").read_bytes()))
    assert parsed_in_chunks(path)
    profile = both(path)
    assert profile.source == "pytorch trace" and profile.steps == 4 and profile.ops > 100
    assert len(profile.mem_ts_ns) > 10  # profile_memory=True: [memory] samples in every chunk


def _spread_trace(metadata_last: bool) -> dict:
    """An msprof-like timeline whose track names (M events) come after the ops they name,
    and header fields after the array; enough events for several chunks."""
    events, _ = _timeline("msprof")
    meta = [e for e in events if e["ph"] == "M"]
    ops = [e for e in events if e["ph"] != "M"]
    many = []
    for k in range(30):  # 30 copies, 10 ms apart per step
        for e in ops:
            e = dict(e, ts=str(float(e["ts"]) + k * 30_000))
            if e["name"].startswith("Iteration"):
                e["name"] = f"Iteration {k * 3 + int(e['name'].split()[1])}"
            many.append(e)
    many += [{"ph": "i", "name": "[memory]", "pid": 1, "tid": 0, "ts": BASE_NS // 1000 + k * 997,
              "args": {"Total Allocated": 1000 + k, "Total Reserved": 4000}} for k in range(0, 90_000, 1000)]
    many += [{"ph": "B", "name": "open", "pid": 1, "tid": 0, "ts": BASE_NS // 1000}, _meta(7, "mystery track")]
    return {"traceEvents": many + meta if metadata_last else meta + many,
            "distributedInfo": {"rank": 5}, "host_name": "node-3"}


@pytest.mark.parametrize("layout", ["object, metadata last", "array, metadata first", "pretty-printed"])
def test_metadata_anywhere_and_header_fields_after_the_array_give_the_one_process_profile(tmp_path, layout):
    trace = _spread_trace(metadata_last=layout.endswith("last"))
    doc = trace["traceEvents"] if layout.startswith("array") else trace
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps(doc, indent=2 if layout == "pretty-printed" else None))
    assert parsed_in_chunks(path)
    profile = both(path)
    assert profile.source == "msprof timeline" and profile.steps == 90
    assert profile.unknown_categories == {"mystery_cat": 90}
    assert len(profile.mem_ts_ns) == 90 and profile.notes  # the B event is counted in a note
    if layout != "array, metadata first":
        assert profile.rank == 5 and profile.host == "node-3"
    # kinds from track names that ops in other chunks than theirs gave: CANN is host (not an
    # unknown category), Overlap Analysis is left out
    assert set(profile.op_kind.tolist()) == {COMPUTE, COMMUNICATION, MEMCPY, HOST}
    assert profile.ops == 90 * 6 and "Computing" not in profile.name_table[profile.op_name]


def test_a_cut_inside_an_args_list_of_objects_falls_back_to_one_process(tmp_path, caplog):
    listed = {"ph": "X", "cat": "kernel", "name": "fused", "pid": 1, "tid": 7, "ts": 50.0, "dur": 9.0,
              "args": {"inputs": [{"shape": [i, 4], "dtype": "float"} for i in range(2000)]}}
    events = [_x("ProfilerStep#1", 1, 0.0, 100.0, cat="user_annotation"), listed, _x("aten::mm", 1, 60.0, 3.0)]
    path = tmp_path / "nested.json"
    path.write_text(json.dumps({"traceEvents": events, "baseTimeNanoseconds": BASE_NS}))
    with caplog.at_level(logging.INFO, logger="profstream.ingest"):
        assert not parsed_in_chunks(path)  # every cut lands between the args' objects
    assert "parsed in one process: chunk" in caplog.text
    profile = both(path)
    assert profile.ops == 2 and profile.name_table[profile.op_name].tolist() == ["fused", "aten::mm"]


def test_a_second_traceevents_key_and_a_truncated_file_give_what_one_process_gives(tmp_path):
    events = [_x(f"k{i}", 1, float(i), 1.0, cat="kernel") for i in range(200)]
    twice = tmp_path / "twice.json"  # JSON keeps the last of two equal keys
    twice.write_text(json.dumps({"traceEvents": events})[:-1] + ', "traceEvents": [' +
                     json.dumps(_x("last", 1, 5.0, 1.0, cat="kernel")) + "]}")
    assert not parsed_in_chunks(twice)
    assert both(twice).name_table.tolist() == ["last"]
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps({"traceEvents": events})[:-30])
    assert not parsed_in_chunks(cut)
    with pytest.raises(IngestError, match="truncated"):
        load_profile(cut, workers=WORKERS)


def test_a_worker_that_dies_sends_the_file_to_one_process(tmp_path, monkeypatch, caplog):
    path = tmp_path / "trace.json"
    _torch_trace(path, steps=9)

    def killed(text, chunk):  # as the OOM killer, or a SIGBUS from a file cut short under its mapping
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(chunks, "_decode", killed)
    with caplog.at_level(logging.INFO, logger="profstream.ingest"):
        assert not parsed_in_chunks(path)
    assert "exited with code -9" in caplog.text
    assert both(path).steps == 4


def test_collective_calls_found_in_any_chunk_are_those_of_one_process(tmp_path):
    from tests.kineto_traces import lagging_device_trace
    from tests.test_analyze import _with_collectives

    path = _with_collectives(lagging_device_trace(steps=8)).write(tmp_path / "nccl.json")
    assert parsed_in_chunks(path)
    profile = both(path)
    assert [c[3] for c in profile.collectives] == list(range(8)) and profile.collective_step.tolist() == list(range(1, 9))


_DEFAULT_WORKERS = """
import os, sys, threading
from profstream.integrations.ingest.chunks import default_workers
if sys.argv[1] == "kafka":  # librdkafka's threads: native, not in threading's count
    import confluent_kafka
    producer = confluent_kafka.Producer({"bootstrap.servers": "127.0.0.1:9", "log_level": 0})
    assert threading.active_count() == 1
print(default_workers(), len(os.sched_getaffinity(0)))
"""


@pytest.mark.parametrize("beside", ["nothing", "kafka"])
def test_workers_are_forked_by_default_only_from_a_process_without_other_threads(beside):
    out = subprocess.run([sys.executable, "-c", _DEFAULT_WORKERS, beside], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    workers, cpus = int(out[0]), int(out[1])
    assert workers == (cpus if beside == "nothing" else 1)


def test_a_torch_npu_trace_in_chunks_is_the_one_process_profile(tmp_path):
    """Ascend's task types, flows and string timestamps merged across chunks as one pass reads them."""
    import gzip

    src = Path(__file__).parent / "data/ascend/torch_npu/rank0_ascend_pt/ASCEND_PROFILER_OUTPUT/trace_view.json.gz"
    path = tmp_path / "trace_view.json"
    path.write_bytes(gzip.decompress(src.read_bytes()))
    assert parsed_in_chunks(path)
    profile = both(path)
    assert profile.source == "torch_npu trace" and (profile.op_launch_ns[profile.op_on_device] > 0).all()
