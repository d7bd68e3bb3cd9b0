"""Avro single-object encoding for every record profstream puts on Kafka.

A message is ``C3 01`` + the 8-byte little-endian CRC-64-AVRO fingerprint of the writer
schema's parsing canonical form + the Avro binary body. Every schema version ever shipped
stays in ``SCHEMAS`` with an upgrade function to the current record shape, so old
archives and old producers stay decodable. Anything that cannot be decoded raises
``DecodeError`` with a ``reason`` from ``DecodeError.REASONS``, and nothing else.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.schema import to_parsing_canonical_form

from profstream.schema import rank_columns
from profstream.schema.sparse import NotRead, compiled_reader, sparse_reader
from profstream.schema.sparse import _string as read_string
from profstream.schema.writer import compile_writer

MAGIC = b"\xc3\x01"
HEADER_LEN = 10

_CRC64_EMPTY = 0xC15D213AA4D7A795


def _crc64_table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_CRC64_EMPTY & -(fp & 1))
        table.append(fp)
    return table


_CRC64_TABLE = _crc64_table()


def crc64_avro(data: bytes) -> int:
    """The Rabin CRC-64 fingerprint of the Avro specification."""
    fp = _CRC64_EMPTY
    for b in data:
        fp = (fp >> 8) ^ _CRC64_TABLE[(fp ^ b) & 0xFF]
    return fp


class DecodeError(ValueError):
    """A message that is not a decodable profstream record; ``reason`` says why."""

    REASONS = ("not_avro", "truncated", "unknown_fingerprint", "malformed", "wrong_type", "invalid_name")

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in self.REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclass(frozen=True)
class SchemaVersion:
    name: str  # record name without namespace, e.g. "EventBatch"
    version: int
    parsed: Any
    fingerprint: int
    header: bytes  # MAGIC + fingerprint, the prefix of every message of this version
    upgrade: Callable[[dict], dict]  # record of this version -> record of the current one
    # (field, record name) of each field of type ["null", record]: encode names the branch
    named_unions: tuple[tuple[str, str], ...] = ()
    # EventBatch: a reader that skips empty sections in one comparison (sparse.py), StepPartial:
    # the compiled reader; fastavro's second reading saying what is wrong with a body it does not take
    sparse: Callable[[bytes, int], tuple[dict, int]] | None = None


def _load(file: str) -> dict:
    return json.loads(resources.files("profstream.schema").joinpath(file).read_text())


SPARSE_RECORDS = ("EventBatch",)  # read by sparse.py first: the raw topic's records, mostly empty sections
# read by the compiled reader where it is built (sparse.py's Python one is no faster than
# fastavro for them): the run stage's StepPartials, thousands a run step when a large run's
# steps come spread over many of the step stages' transactions (~2 against ~14 us each)
COMPILED_RECORDS = ("StepPartial",)


def _version(schema: dict, version: int, upgrade: Callable[[dict], dict] | None = None) -> SchemaVersion:
    parsed = parse_schema(schema)
    fp = crc64_avro(to_parsing_canonical_form(parsed).encode())
    return SchemaVersion(
        name=schema["name"],
        version=version,
        parsed=parsed,
        fingerprint=fp,
        header=MAGIC + fp.to_bytes(8, "little"),
        upgrade=upgrade or (lambda record: record),
        named_unions=tuple((f["name"], branch["name"]) for f in parsed["fields"]
                           if isinstance(f["type"], list) and len(f["type"]) == 2 and f["type"][0] == "null"
                           and isinstance(branch := f["type"][1], dict) and branch.get("type") == "record"),
        sparse=sparse_reader(parsed) if schema["name"] in SPARSE_RECORDS
        else compiled_reader(parsed) if schema["name"] in COMPILED_RECORDS else None,
    )


# Every version ever shipped, oldest first. The last of each name is the one written.
# To change a schema: add a new .avsc (e.g. event_batch.v2.avsc), append its version here
# and give the older ones an upgrade function; never edit or remove a shipped one.
def names_blob(names: list[str]) -> bytes:
    """v3's op_names: every name followed by one NUL byte (a NUL inside a name becomes U+FFFD)."""
    if not names:
        return b""
    joined = "\0".join(names)
    if joined.count("\0") != len(names) - 1:
        joined = "\0".join(n.replace("\0", "\ufffd") for n in names)
    return (joined + "\0").encode("utf-8", "surrogatepass")


def _event_batch_v3_to_v4(record: dict) -> dict:
    ops = record["ops"]
    # launch_ns: -1 (absent) for every op, packed i64s of all 0xFF bytes; as long as
    # start_ns (an i64 column of the same count: decode_batch checks both against count)
    return {**record, "ops": {**ops, "launch_ns": b"\xff" * len(ops["start_ns"])}}


def _event_batch_v2_to_v4(record: dict) -> dict:
    return _event_batch_v3_to_v4({**record, "op_names": names_blob(record["op_names"])})


def _event_batch_v1_to_v4(record: dict) -> dict:
    return _event_batch_v2_to_v4({**record, "world_size": None})


def _event_batch_v4_to_v6(record: dict) -> dict:
    """v4 and v5 -> v6: decode_batch leaves a missing section (device_samples, collectives) empty."""
    return {**record, "collective_names": []}


def _then(first: Callable[[dict], dict], second: Callable[[dict], dict]) -> Callable[[dict], dict]:
    return lambda record: second(first(record))


# StepMetrics v5 ``collectives`` of a step without calls (packed columns: processors/collectives.py)
NO_COLLECTIVE_CALLS = {"names": [], "count": 0, "name_idx": b"", "group_idx": b"", "group_size": b"", "seq": b"",
                       "bytes": b"", "start_ns": b"", "end_ns": b""}


# StepMetrics v6: the op figures of a step without op events are null (not measured)
OP_FIGURES = ("compute_ns", "comm_ns", "overlap_ns", "pure_comm_ns", "idle_ns", "utilization", "overlap_ratio")


def _step_metrics_v7_to_v8(record: dict) -> dict:
    """Before v8 no step had work figures (the rolling window none of them either), host
    figures or advice."""
    rolling = record["rolling"]
    if rolling is not None:
        rolling = {**dict.fromkeys(ROLLING_WORK), **rolling}
    return {**record, "rolling": rolling, "work": None, "resources": None, "advice": []}


# StepMetrics v7: what the step lost, 0 in older records (they said nothing of it)
STEP_LOSSES = ("dropped_ops", "dropped_samples")


def _step_metrics_v8_to_v9(record: dict) -> dict:
    """Before v9 a step's resources had the workers' pooled figures alone: none per worker."""
    resources = record["resources"]
    if resources is None:
        return record
    return {**record, "resources": {**resources, "per_worker": []}}


def _step_metrics_v6_to_v8(record: dict) -> dict:
    return _step_metrics_v7_to_v8({**record, **dict.fromkeys(STEP_LOSSES, 0)})


# StepMetrics v8: the rolling window's figures of the steps' work
ROLLING_WORK = tuple(f"{q}_{what}" for what in ("tokens_per_s", "samples_per_s", "mfu") for q in ("p50", "p95"))


def _step_metrics_v5_to_v8(record: dict) -> dict:
    """A step without op events had its op figures written as 0 before v6: they were not
    measured, and read as such (null)."""
    if not record["op_count"]:
        record = {**record, **dict.fromkeys(OP_FIGURES)}
    return _step_metrics_v6_to_v8(record)


def _step_metrics_v4_to_v8(record: dict) -> dict:
    return _step_metrics_v5_to_v8({**record, "collectives": NO_COLLECTIVE_CALLS})


def _step_metrics_v3_to_v8(record: dict) -> dict:
    return _step_metrics_v4_to_v8(_step_metrics_v3_to_v4(record))


def _run_step_metrics_v3_to_v4(record: dict) -> dict:
    """A cross-rank step from before the clock offsets: none known (its ranks' own clocks)."""
    return {**record, "clock_offsets": []}


def _run_step_metrics_v2_to_v4(record: dict) -> dict:
    return _run_step_metrics_v3_to_v4({**record, "work": None})


def _run_step_metrics_v1_to_v4(record: dict) -> dict:
    return _run_step_metrics_v2_to_v4({
        **record, "collectives_matched": 0, "collective_ranks": [], "by_collective": [], "late_rank": None,
        "late_rank_held_ns": 0, "unmatched_collectives": []})


def _step_metrics_v2_to_v3(record: dict) -> dict:
    return {**record, "host_step_time_ns": record["step_time_ns"], "device_start_ns": None, "device_end_ns": None,
            "kernel_types": [], "device_kinds": [], "uncorrelated_ops": 0}


def _step_metrics_v1_to_v3(record: dict) -> dict:
    return _step_metrics_v2_to_v3({**record, "world_size": None})


def _step_metrics_v3_to_v4(record: dict) -> dict:
    return {**record, "devices": []}


def _capture_status_v2_to_v3(record: dict) -> dict:
    """A status from before stacks requests: it answers a capture of ops, no thread's stack."""
    return {**record, "threads": None, "threads_omitted": 0}


def _capture_status_v1_to_v3(record: dict) -> dict:
    """A status from before the requests had topics of their own: who asked is not known."""
    return _capture_status_v2_to_v3({**record, "requester": "", "request_reason": ""})


def _rank_checkpoint_v2_to_v3(record: dict) -> dict:
    """The rolling window of a v2 checkpoint kept no work figures: empty rings (none measured)."""
    return {**record, "rolling": {"tokens_per_s": b"", "samples_per_s": b"", "mfu": b"", **record["rolling"]}}


def _rank_checkpoint_v1_to_v3(record: dict) -> dict:
    return _rank_checkpoint_v2_to_v3({
        **record, "carry": {"compute_start": b"", "compute_end": b"", "comm_start": b"", "comm_end": b""},
        "device_end_step": None, "device_end_ns": None})


_VERSIONS: list[SchemaVersion] = [
    _version(_load("event_batch.avsc"), 1, _then(_event_batch_v1_to_v4, _event_batch_v4_to_v6)),
    _version(_load("step_metrics.avsc"), 1, _then(_step_metrics_v1_to_v3, _step_metrics_v3_to_v8)),
    _version(_load("run_step_metrics.avsc"), 1, _run_step_metrics_v1_to_v4),
    _version(_load("alert.avsc"), 1),
    _version(_load("rank_checkpoint.avsc"), 1, _rank_checkpoint_v1_to_v3),
    _version(_load("run_checkpoint.avsc"), 1, lambda record: {**record, "clocks": None}),
    _version(_load("event_batch.v2.avsc"), 2, _then(_event_batch_v2_to_v4, _event_batch_v4_to_v6)),  # + world_size
    _version(_load("step_metrics.v2.avsc"), 2, _then(_step_metrics_v2_to_v3, _step_metrics_v3_to_v8)),  # + world_size
    _version(_load("event_batch.v3.avsc"), 3, _then(_event_batch_v3_to_v4, _event_batch_v4_to_v6)),  # op_names blob
    _version(_load("event_batch.v4.avsc"), 4, _event_batch_v4_to_v6),  # + ops.launch_ns
    _version(_load("step_metrics.v3.avsc"), 3, _step_metrics_v3_to_v8),  # + the device window, kernels, device kinds
    _version(_load("rank_checkpoint.v2.avsc"), 2, _rank_checkpoint_v2_to_v3),  # + carry, device end
    # EventBatch v4 messages read with device_samples empty (decode_batch: a newer section)
    _version(_load("event_batch.v5.avsc"), 5, _event_batch_v4_to_v6),  # + device_samples
    _version(_load("step_metrics.v4.avsc"), 4, _step_metrics_v4_to_v8),  # + devices
    _version(_load("event_batch.v6.avsc"), 6),  # + collectives, collective_names
    _version(_load("step_metrics.v5.avsc"), 5, _step_metrics_v5_to_v8),  # + collectives
    _version(_load("run_step_metrics.v2.avsc"), 2, _run_step_metrics_v2_to_v4),  # + collectives matched across ranks
    # the control topic (docs/capture.md)
    _version(_load("capture_request.avsc"), 1, lambda record: {**record, "kind": "ops"}),
    _version(_load("capture_status.avsc"), 1, _capture_status_v1_to_v3),
    _version(_load("rank_end.avsc"), 1, lambda record: {**record, "end_signal": 0}),  # on the steps topic: a rank that ended
    _version(_load("step_metrics.v6.avsc"), 6, _step_metrics_v6_to_v8),  # op figures null when not measured
    # EventBatch v6 and older read with the later step columns at their fill (decode_batch: COLUMN_FILL)
    _version(_load("event_batch.v7.avsc"), 7),  # + steps.dropped_ops, dropped_samples, end_signal
    _version(_load("step_metrics.v7.avsc"), 7, _step_metrics_v7_to_v8),  # + what a partial step lost
    _version(_load("rank_end.v2.avsc"), 2),  # + end_signal (v1 reads as 0: default)
    _version(_load("run_step_metrics.v3.avsc"), 3, _run_step_metrics_v3_to_v4),  # + work across ranks
    _version(_load("rank_checkpoint.v3.avsc"), 3),  # + the rolling window's work figures
    # v7 and older read with the work columns absent and no loader readings
    _version(_load("event_batch.v8.avsc"), 8),  # + the steps' work, loader_samples
    # v7 and older read with resources null: no per_worker to add
    _version(_load("step_metrics.v8.avsc"), 8, _step_metrics_v8_to_v9),  # + work: throughput and MFU; rolling p50/p95; host figures; advice
    _version(_load("capture_status.v2.avsc"), 2, _capture_status_v2_to_v3),  # + requester (authenticated), request_reason
    # ops requests and their statuses are still written as v1 and v2 (records.encode_request, encode_status)
    _version(_load("capture_request.v2.avsc"), 2),  # + kind: ops or stacks
    _version(_load("capture_status.v3.avsc"), 3),  # + threads: a stacks request's answer
    # on the raw topic (a Monitor's control thread), passed on to the steps and partials topics: where a rank is now
    _version(_load("rank_progress.avsc"), 1, lambda record: {**record, "collective": None}),
    # cross-rank steps were written as v1 to v4 by what they held, until v5 (encode_run_step_metrics)
    _version(_load("run_step_metrics.v4.avsc"), 4),  # + clock_offsets: the ranks' clocks against the run's
    _version(_load("run_checkpoint.v2.avsc"), 2),  # + clocks (v1 for a run without offsets)
    _version(_load("rank_progress.v2.avsc"), 2),  # + collective: the call the rank sits in
    # on the partials topic: a step stage's ranks of one run step as columns, for the run stage
    _version(_load("step_partial.avsc"), 1),
    # steps without data-loader worker readings are still written as v8 or older (encode_step_metrics)
    _version(_load("step_metrics.v9.avsc"), 9),  # + resources.per_worker: each loader worker's seconds per batch
    # every cross-rank step is written as v5 (encode_run_step_metrics); read in v4's shape
    _version(_load("run_step_metrics.v5.avsc"), 5, rank_columns.expanded),  # per-rank lists as packed columns
]

SCHEMAS: dict[int, SchemaVersion] = {v.fingerprint: v for v in _VERSIONS}
VERSIONS: dict[tuple[str, int], SchemaVersion] = {(v.name, v.version): v for v in _VERSIONS}
CURRENT: dict[str, SchemaVersion] = {}
for _v in _VERSIONS:
    CURRENT[_v.name] = _v


# The version whose fields are the shape decode gives, where the current one's are not:
# RunStepMetrics v5 packs v4's per-rank lists and reads as v4 (rank_columns.expanded).
_READ_SHAPES = {"RunStepMetrics": 4}


def read_schema(name: str) -> Any:
    """The parsed schema of the records ``decode`` gives for ``name`` (e.g. for a table of
    them): the current version's, or for RunStepMetrics v4's."""
    version = _READ_SHAPES.get(name)
    return (CURRENT[name] if version is None else VERSIONS[(name, version)]).parsed


# Defaults the writer fills in for a record without the field: fastavro writes a schema
# default as given, and a JSON default of an Avro bytes field is a string it cannot write.
_WRITE_DEFAULTS = {"StepMetrics": {"collectives": NO_COLLECTIVE_CALLS}}


# The records the processors write once per rank-step (or more often): written by a writer
# generated from their schema (schema/writer.py), the same bytes as fastavro's in a third of
# the time (a StepPartial: ~3 against ~15 us); the rest (and any record the generated
# writer does not take) by fastavro.
COMPILED_WRITERS = frozenset({"StepMetrics", "RankCheckpoint", "Alert", "RankEnd", "RunStepMetrics", "RunCheckpoint",
                              "RankProgress", "StepPartial"})
_WRITERS: dict[int, Callable[[dict], bytes]] = {}  # fingerprint -> its generated writer


def encode(name: str, record: dict, version: int | None = None) -> bytes:
    """Encode ``record`` with the current schema ``name`` (or its ``version``, for a record
    that an older version holds whole: readers of that version can then read it) as a
    single-object message."""
    sv = CURRENT[name] if version is None else VERSIONS[(name, version)]
    if name == "RunStepMetrics" and sv.version >= 5 and not rank_columns.is_packed(record):
        record = rank_columns.packed(record)  # v4's shape, as decode gives it
    missing = _WRITE_DEFAULTS.get(name)
    if missing and any(f not in record for f in missing):
        record = {**missing, **record}
    writer = _WRITERS.get(sv.fingerprint)
    if writer is None and name in COMPILED_WRITERS:
        writer = _WRITERS[sv.fingerprint] = compile_writer(sv.parsed)
    if writer is not None:
        try:
            return sv.header + writer(record)
        except Exception:  # a record it does not take (writer.py): fastavro writes it, or says what is wrong
            pass
    if sv.named_unions:  # a nullable record's branch named: fastavro then skips validating it against each
        record = dict(record)
        for field, branch in sv.named_unions:
            value = record.get(field)
            if type(value) is dict:
                record[field] = (branch, value)
    out = io.BytesIO()
    out.write(sv.header)
    schemaless_writer(out, sv.parsed, record)
    return out.getvalue()


# Steps without device figures are written as StepMetrics v3, which consumers from before v4
# read whole (the exporter, sinks and tools of an older release keep working).
STEP_METRICS_WITHOUT_DEVICES_VERSION = 3
# Likewise steps without collective calls as v4 (v3 without device figures too); steps whose
# op figures were measured as v5 or older (v6 only for the steps that were not); steps that
# lost nothing as v6 or older (v7 for partial steps); steps without work, host figures or
# advice as v7 or older (v8 only for those with them). Cross-rank steps are all RunStepMetrics
# v5: its columns are what keeps the run stage's cost per rank small (encode_run_step_metrics).
STEP_METRICS_WITHOUT_COLLECTIVES_VERSION = 4
STEP_METRICS_MEASURED_VERSION = 5
STEP_METRICS_NOTHING_LOST_VERSION = 6  # v6 for a step that lost nothing: v7 says what a step lost
STEP_METRICS_LOSSES_VERSION = 7  # v7 for a partial step without work or host figures: v8 says those
STEP_METRICS_POOLED_WORKERS_VERSION = 8  # v8 for a step without a loader worker's reading: v9 says each worker's
RUN_CHECKPOINT_WITHOUT_CLOCKS_VERSION = 1


def encode_step_metrics(record: dict) -> bytes:
    """A StepMetrics record as its message: v9 with a data-loader worker's figures; v8 with
    work, other resource figures or advice; else v7 when the step lost events (a partial
    step), v6 when its op figures were not measured, else v5 with collective calls, v4 with
    device figures, else v3."""
    resources = record.get("resources")
    if resources is not None and resources.get("per_worker"):
        return encode("StepMetrics", record)
    if record.get("work") is not None or resources is not None or record.get("advice"):
        return encode("StepMetrics", record, STEP_METRICS_POOLED_WORKERS_VERSION)
    if any(record.get(f) for f in STEP_LOSSES):
        return encode("StepMetrics", record, STEP_METRICS_LOSSES_VERSION)
    if record["utilization"] is None:
        return encode("StepMetrics", record, STEP_METRICS_NOTHING_LOST_VERSION)
    if record.get("collectives", NO_COLLECTIVE_CALLS)["count"]:
        return encode("StepMetrics", record, STEP_METRICS_MEASURED_VERSION)
    return encode("StepMetrics", record, STEP_METRICS_WITHOUT_COLLECTIVES_VERSION if record.get("devices")
                  else STEP_METRICS_WITHOUT_DEVICES_VERSION)


RANK_END_CLOSED_VERSION = 1  # a RankEnd of a producer that closed normally: v2 only says a signal


def encode_rank_end(record: dict) -> bytes:
    """A RankEnd record as its message: v2 when a signal ended the producer, else v1 (read
    whole by consumers older than v2)."""
    return encode("RankEnd", record, None if record.get("end_signal") else RANK_END_CLOSED_VERSION)


def encode_run_step_metrics(record: dict) -> bytes:
    """A RunStepMetrics record as its message, always v5 (the per-rank lists as packed
    columns: schema/rank_columns.py). ``record`` is v5's (the run stage writes its columns
    straight from its arrays) or v4's shape (what decode gives), packed here."""
    return encode("RunStepMetrics", record)


def encode_run_checkpoint(record: dict) -> bytes:
    """A RunCheckpoint as its message: v2 with clocks, else v1."""
    return encode("RunCheckpoint", record, None if record.get("clocks") else RUN_CHECKPOINT_WITHOUT_CLOCKS_VERSION)


RANK_PROGRESS_HEADERS = frozenset(v.header for v in _VERSIONS if v.name == "RankProgress")
# the run stage's input on the partials topic (on the steps topic before it, where its readers skip it)
STEP_PARTIAL_HEADERS = frozenset(v.header for v in _VERSIONS if v.name == "StepPartial")


def is_rank_progress(data: bytes | None) -> bool:
    """Whether a message holds a RankProgress (from its header alone): the raw and steps
    topics' readers that want only EventBatches or StepMetrics skip it."""
    return data is not None and bytes(data[:HEADER_LEN]) in RANK_PROGRESS_HEADERS


def peek(data: bytes) -> tuple[str, str] | None:
    """(record name, first field) of a profstream message whose first field is a string (the
    run id of every record the processors read), without decoding the rest; None when the
    header or that string cannot be read (decode_any then says why). For a reader that drops
    some records of a run undecoded: a run stage's StepMetrics where StepPartials come."""
    if type(data) is not bytes or len(data) <= HEADER_LEN or data[:2] != MAGIC:
        return None
    sv = SCHEMAS.get(int.from_bytes(data[2:HEADER_LEN], "little"))
    if sv is None:
        return None
    try:
        return sv.name, read_string(data, HEADER_LEN)[0]
    except (IndexError, NotRead, UnicodeDecodeError):  # truncated, a runaway length, not UTF-8
        return None


def decode_any(data: bytes) -> tuple[str, dict]:
    """Decode any profstream message: (record name, record in the current shape)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError("not_avro", f"expected bytes, got {type(data).__name__}")
    n = len(data)
    if n < 2 or data[:2] != MAGIC:
        if n < 2 and data[:n] == MAGIC[:n]:
            raise DecodeError("truncated", f"{n} bytes, shorter than the 10-byte header")
        raise DecodeError("not_avro", "no Avro single-object marker C3 01")
    if n < HEADER_LEN:
        raise DecodeError("truncated", f"{n} bytes, shorter than the 10-byte header")
    fp = int.from_bytes(data[2:HEADER_LEN], "little")
    sv = SCHEMAS.get(fp)
    if sv is None:
        raise DecodeError("unknown_fingerprint", f"schema fingerprint {fp:016x} is not a profstream schema")
    end = -1
    if sv.sparse is not None and type(data) is bytes:
        try:
            record, end = sv.sparse(data, HEADER_LEN)
        except Exception:  # noqa: BLE001 - not well formed: fastavro's reading says why
            end = -1
    if end != n:
        record = _fastavro_read(data, sv)
    try:
        return sv.name, sv.upgrade(record)
    except Exception as e:
        raise DecodeError("malformed", f"cannot upgrade {sv.name} v{sv.version}: {e}") from None


def _fastavro_read(data: bytes, sv: SchemaVersion) -> dict:
    n = len(data)
    body = io.BytesIO(data)
    body.seek(HEADER_LEN)
    try:
        record = schemaless_reader(body, sv.parsed, None)
    except EOFError as e:
        raise DecodeError("truncated", f"{sv.name} v{sv.version} body ends early ({e})") from None
    except Exception as e:  # fastavro raises many types on garbage; all mean the same here
        raise DecodeError("malformed", f"{sv.name} v{sv.version}: {type(e).__name__}: {e}") from None
    if body.tell() != n:
        raise DecodeError("malformed", f"{n - body.tell()} trailing bytes after the {sv.name} body")
    return record


def record_name(data: bytes | None) -> str | None:
    """The record type of a profstream message, from its header alone (None: not one a
    profstream schema wrote), e.g. to tell a RankEnd from the StepMetrics on the steps topic."""
    sv = SCHEMAS.get(int.from_bytes(data[2:HEADER_LEN], "little")) if data and data[:2] == MAGIC else None
    return None if sv is None else sv.name


def decode(name: str, data: bytes) -> dict:
    """Decode a message that must hold a ``name`` record."""
    got, record = decode_any(data)
    if got != name:
        raise DecodeError("wrong_type", f"expected {name}, got {got}")
    return record
