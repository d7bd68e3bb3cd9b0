"""The Monitor's compiled hot path: loading it, and what it is told of the EventBatch.

``_native`` (sources in ``csrc/``, built by pip with the package) records op and sample
events in preallocated columns on the training thread (``Recorder``, here ``NativeBuffer``)
and builds and sends the EventBatch messages on the sender thread without the GIL
(``Batcher``, driven by ``native_sender.NativeSender``) through librdkafka, the copy that
confluent-kafka ships, opened at run time. ``load()`` says why when it cannot be used; the
Monitor then runs the pure-Python ``EventBuffer`` and ``Sender``, which write the same
bytes (docs/monitor.md, "Native recording and sending").

The native code knows no schema. ``layout()`` describes the sections and their columns
from ``schema.batch.SECTIONS`` (with ``COLUMN_FILL`` where a version adds columns, and
``DICTIONARIES``); ``batch_plan()`` walks the fields of the EventBatch version it writes
and says, for each, whether it is constant for the Monitor (encoded here once with
fastavro), one of the header values that change per batch, a dictionary or a section. A
new column or section needs no native code; a header field that changes per batch and is
not one of ``DYNAMIC_FIELDS`` does (``UnsupportedSchema`` names it, and the Monitor runs
in Python).

The version it writes is the one the Python encoder writes for a batch without the
sections only some batches carry (``plain_version``: v4, while device samples, v5, travel
in batches of their own). The data loader's readings (v8 ``loader_samples``) are recorded
natively too, and a batch with any is written with the marked plan (v8, whose version has
them: ``IN_MARKED_BATCHES``). The rows of every other section (``foreign_sections``: device
samples and collective calls, v6, now) are recorded in a Python ``EventBuffer`` beside the native columns
(``NativeBuffer.foreign``) and sent by the Python encoder from the native sender's thread
(``native_sender``); the native Batcher holds the watermark back while they wait. A
buffer whose ``drain`` returns a part the native sender does not know makes ``load()``
refuse, and the Monitor runs in Python: such rows are never dropped unseen.
"""

from __future__ import annotations

import ctypes.util
import io
import threading
from pathlib import Path
from typing import Any

import numpy as np
from fastavro import parse_schema, schemaless_writer

from profstream.producers.buffer import Drained, EventBuffer, buffer_bounds
from profstream.schema import batch as batch_schema
from profstream.schema.batch import (
    DICTIONARIES,
    HOST,
    KIND_CODES,
    SECTIONS,
    EventBatch,
    encode_batch,
)
from profstream.schema.codec import SCHEMAS, SchemaVersion

# Rows per preallocated block of a section's columns: ops come by the thousand, samples
# a few per step. A block has its own name dictionaries, so the Recorder's cache of the
# names it has coded (by str object) starts cold on each block: 16,384 rows keep it warm
# for 16 ops() calls of a thousand ops.
BLOCK_ROWS = {"ops": 16384}
SAMPLE_BLOCK_ROWS = 256
# Header fields the native encoder fills per batch, and their Avro types.
DYNAMIC_FIELDS = {"seq": "long", "sent_ns": "long", "dropped_ops": "long", "dropped_samples": "long",
                  "complete_through_step": ["null", "long"], "buffer_fill_ratio": "double",
                  "send_latency_ns": "long"}
_DTYPES = {"<i4": "i4", "<i8": "i8", "|u1": "u1", "<f8": "f8"}
# Header dictionaries of the sections recorded in Python (the collectives' one dictionary of
# three columns, which schema.batch.DICTIONARIES does not list)
FOREIGN_DICTIONARIES = ("collective_names",)

# The parts of EventBuffer.drain() the native sender handles: ops, samples and data-loader
# readings are recorded natively (``NativeBuffer.add_loader_sample``), device samples and
# collective calls sent by the Python encoder (native_sender._send_foreign).
KNOWN_DRAINED = {"watermark", "marks", "memory", "queues", "ops", "more_ops", "dropped_ops", "dropped_samples",
                 "devices", "collectives", "loader"}

_loaded: tuple[Any, str] | None = None
_lock = threading.Lock()


class UnsupportedSchema(ValueError):
    """The EventBatch schema has a field the native encoder cannot write."""


def load() -> tuple[Any, str]:
    """(the ``_native`` module, "") when the native path can run here, else (None, why)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> tuple[Any, str]:
    try:
        from profstream.producers import _native
    except ImportError as e:
        return None, f"the compiled extension is not there ({e}; it is built by pip install with a C++ compiler)"
    path = librdkafka_path()
    if path is None:
        return None, "confluent-kafka's librdkafka was not found"
    try:
        _native.load_librdkafka(path)
    except OSError as e:
        return None, f"librdkafka could not be opened: {e}"
    unknown = sorted(set(Drained._fields) - KNOWN_DRAINED)
    if unknown:
        return None, f"the native sender does not send the buffer's {', '.join(unknown)} (they would be lost)"
    try:  # this schema and layout, checked once: a field the encoder cannot write falls back here
        constants = {"run_id": "r", "host": "", "rank": 0, "world_size": None, "device": "cpu", "producer_id": ""}
        recorder = _native.Recorder(layout(1, 64), "ops", 1)
        _native.Batcher(recorder, batch_plan(constants), 1 << 20, 1 << 20, 1.0, 1.0, 0.0, -1,
                        batch_plan(constants, marked=True))
    except (UnsupportedSchema, ValueError, TypeError) as e:
        return None, f"the native encoder cannot write this EventBatch schema: {e}"
    return _native, ""


def librdkafka_path() -> str | None:
    """The librdkafka confluent-kafka uses: the copy it loaded (Linux), else the one its wheel
    ships, else the system's."""
    import confluent_kafka  # loads it

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "librdkafka" in Path(path).name:
                    return path
    except OSError:
        pass
    root = Path(confluent_kafka.__file__).parent
    for pattern in ("../confluent_kafka.libs/librdkafka*", ".dylibs/librdkafka*"):
        found = sorted(root.glob(pattern))
        if found:
            return str(found[0])
    return ctypes.util.find_library("rdkafka")


def describe() -> str:
    """Which librdkafka the native path sends through (after ``load()``)."""
    module, _why = load()
    return f"librdkafka {module.load_librdkafka(librdkafka_path())}" if module else "not loaded"


def plain_version() -> SchemaVersion:
    """The EventBatch version the Python encoder writes for a batch of ops and samples alone
    (none of the sections only some batches carry): the one the native encoder writes."""
    return _written(EventBatch(run_id="", rank=0))


def marked_version() -> SchemaVersion:
    """The version the Python encoder writes for a batch whose step marks say more than a
    v1 mark (a step that lost events, an end mark on a signal): the native encoder's
    second plan, for those batches alone."""
    batch = EventBatch(run_id="", rank=0)
    batch.steps = {c: np.ones(1, dtype) for c, dtype in SECTIONS["steps"]}
    return _written(batch)


def _written(batch: EventBatch) -> SchemaVersion:
    message = encode_batch(batch)
    return SCHEMAS[int.from_bytes(message[2:10], "little")]


# Sections the plain version has not that the native Recorder records all the same: a batch
# with rows of them is written with the marked plan (its version has them), as the Python
# encoder writes it. The data loader's readings travel in the rank's own batches so, where a
# batch of their own cost a processor a message's fold per reading (docs/benchmarks.md,
# "Host figures, cheaper").
IN_MARKED_BATCHES = ("loader_samples",)


def native_sections() -> list[str]:
    """The sections the native Recorder records and the Batcher writes, in SECTIONS order."""
    fields = {f["name"] for f in plain_version().parsed["fields"]}
    return [s for s in SECTIONS if s in fields or s in IN_MARKED_BATCHES]


def foreign_sections() -> list[str]:
    """The sections recorded and sent in Python beside the native ones (device samples,
    collective calls)."""
    native = native_sections()
    return [s for s in SECTIONS if s not in native]


def layout(max_ops: int, max_samples: int, max_marks: int | None = None) -> list[tuple]:
    """The native sections of an EventBatch as the native Recorder takes them (the bounds:
    ``buffer.Bounds``; step marks have their own, by default the samples')."""
    fill = getattr(batch_schema, "COLUMN_FILL", {})  # columns added by later versions, if any
    out = []
    for section in native_sections():
        columns = SECTIONS[section]
        names = [c for c, _ in columns]
        dicts = [(field, names.index(col), _wire(field) == "names_blob")
                 for field, (sec, col) in DICTIONARIES.items() if sec == section]
        cols = []
        for name, dtype in columns:
            code = _DTYPES[dtype.str]
            at = next((i for i, (_f, c, _b) in enumerate(dicts) if names[c] == name), -1)
            given = fill.get((section, name))
            if section == "host_samples" and given is None:
                given = 0.0 if code == "f8" else 0
            kinds = KIND_CODES if (section, name) == ("ops", "kind") else None
            cols.append((name, code, at, given, kinds, HOST))
        rows = BLOCK_ROWS.get(section, SAMPLE_BLOCK_ROWS)
        bound = max_ops if section == "ops" else max_marks or max_samples if section == "steps" else max_samples
        out.append((section, rows, bound, cols, [(f, c, b) for f, c, b in dicts]))
    return out


def _field(name: str, sv: SchemaVersion | None = None) -> dict:
    for f in (sv or plain_version()).parsed["fields"]:
        if f["name"] == name:
            return f
    raise UnsupportedSchema(f"the EventBatch schema has no field {name!r}")


def _wire(dictionary: str, sv: SchemaVersion | None = None) -> str:
    """How a dictionary field goes on the wire: "names_blob" (v3's op_names) or "names_array"."""
    kind = _field(dictionary, sv)["type"]
    if kind == "bytes":
        return "names_blob"
    if isinstance(kind, dict) and kind.get("type") == "array" and kind.get("items") == "string":
        return "names_array"
    raise UnsupportedSchema(f"dictionary field {dictionary} has type {kind!r}")


def _avro(kind: Any, value: Any) -> bytes:
    out = io.BytesIO()
    schemaless_writer(out, parse_schema(kind), value)
    return out.getvalue()


def batch_plan(constants: dict[str, Any], marked: bool = False) -> list[tuple]:
    """The native encoder's steps for the EventBatch version it writes (``plain_version``;
    ``marked``: ``marked_version``, for batches whose marks say more): ``constants`` are the
    header fields that never change for one Monitor (run_id, rank...). A section of that
    version with fewer columns than SECTIONS writes its first ones (the rest, added later,
    hold their fill there: the Batcher writes such a batch with the marked plan); a section
    the native Recorder does not record (device samples, collectives) is written empty."""
    sv = marked_version() if marked else plain_version()
    index = {section: i for i, section in enumerate(native_sections())}
    steps: list[tuple] = [("raw", sv.header)]
    for field in sv.parsed["fields"]:
        name, kind = field["name"], field["type"]
        if name in constants:
            steps.append(("raw", _avro(kind, constants[name])))
        elif name in DYNAMIC_FIELDS:
            if kind != DYNAMIC_FIELDS[name] and sorted(map(str, kind)) != ["long", "null"]:
                raise UnsupportedSchema(f"header field {name} has type {kind!r}")
            if isinstance(kind, list):
                steps.append(("optional_long", name, kind.index("null"), kind.index("long")))
            else:
                steps.append((kind, name))
        elif name in DICTIONARIES:
            section, column = DICTIONARIES[name]
            dicts = [f for f, (s, _c) in DICTIONARIES.items() if s == section]
            steps.append((_wire(name, sv), index[section], dicts.index(name)))
        elif name in index:
            got = [(f["name"], f["type"]) for f in kind["fields"]]
            want = [("count", "int")] + [(c, "bytes") for c, _ in SECTIONS[name]]
            later = [c for c, _t in want[len(got):]]
            if got != want[:len(got)] or any((name, c) not in batch_schema.COLUMN_FILL for c in later):
                raise UnsupportedSchema(f"section {name} has fields {got}, SECTIONS says {want}")
            steps.append(("section", index[name], len(got) - 1))
        elif name in SECTIONS or name in FOREIGN_DICTIONARIES:  # recorded in Python, sent in batches of their own
            empty = {"count": 0, **{c: b"" for c, _ in SECTIONS[name]}} if name in SECTIONS else []
            steps.append(("raw", _avro(kind, empty)))
        else:
            raise UnsupportedSchema(f"the native encoder does not know EventBatch field {name!r}")
    merged: list[tuple] = []
    for step in steps:  # neighbouring constant bytes as one copy
        if step[0] == "raw" and merged and merged[-1][0] == "raw":
            merged[-1] = ("raw", merged[-1][1] + step[1])
        else:
            merged.append(step)
    return merged


_buffer_type: Any = None


def make_buffer(buffer_bytes: int, batch_max_ops: int) -> Any:
    """A ``NativeBuffer`` (raises when the native path cannot run: ``load()`` says why)."""
    global _buffer_type
    module, why = load()
    if module is None:
        raise RuntimeError(why)
    if _buffer_type is None:
        _buffer_type = type("NativeBuffer", (_NativeBufferMethods, module.Recorder), {"__module__": __name__})
    return _buffer_type(buffer_bytes, batch_max_ops)


class _NativeBufferMethods:
    """``EventBuffer``'s interface over the native Recorder (``make_buffer`` mixes it in):
    what the Monitor and the Sender use of a buffer."""

    def __init__(self, buffer_bytes: int, batch_max_ops: int) -> None:
        self.inflight_limit_bytes, self.max_ops, self.max_samples, self.max_marks = buffer_bounds(buffer_bytes)
        super().__init__(layout(self.max_ops, self.max_samples, self.max_marks), "ops",  # type: ignore[call-arg]
                         batch_max_ops)
        self.marks_offered = 0  # add_mark calls: those the recorder did not take were dropped
        # the sections the native encoder does not write, recorded here and sent by the
        # Python encoder: Monitor methods of theirs (add_device_sample, add_collective) reach it through
        # __getattr__
        self.foreign = EventBuffer(buffer_bytes, batch_max_ops)
        sections = native_sections()
        self.ops_section = sections.index("ops")
        self.marks, self.memory, self.queues = (sections.index(s) for s in ("steps", "memory", "queues"))
        self.host = sections.index("host_samples")
        self.loader = sections.index("loader_samples")

    def add_ops(self, names, start_ns, dur_ns, kinds, op_types, streams, step: int, **columns: Any) -> None:
        """Many ops at once (``Monitor.ops``): the columns are copied into native ones; what
        does not fit is dropped and counted, rows with invalid values are counted as bad."""
        given = {"name_idx": names, "type_idx": names if op_types is None else op_types, "kind": kinds,
                 "stream": streams, "step": step, "start_ns": start_ns, "dur_ns": dur_ns}
        given.update((k, v) for k, v in columns.items() if v is not None)
        self.add_rows(self.ops_section, len(names), given,  # type: ignore[attr-defined]
                      None if op_types is None or isinstance(op_types, str) else _TYPE_FALLBACK)

    def add_mark(self, row: tuple) -> None:
        """One step mark, or dropped and counted when the marks' reserve is full."""
        self.marks_offered += 1
        self.add_sample(self.marks, row)  # type: ignore[attr-defined]

    def add_loader_sample(self, row: tuple) -> None:
        """One data-loader reading (``LOADER_COLUMNS``), from the loader sampler's thread, in
        the rank's own batches (``IN_MARKED_BATCHES``); dropped and counted when full."""
        self.add_sample(self.loader, row)  # type: ignore[attr-defined]

    @property
    def dropped_marks(self) -> int:
        return self.marks_offered - self.recorded_rows(self.marks)  # type: ignore[attr-defined]

    def drop_counts(self) -> tuple[int, int]:
        """(ops, samples) the recording thread has dropped so far (``EventBuffer``'s)."""
        return self.dropped_ops, self.dropped_samples + self.foreign.dropped_samples  # type: ignore[attr-defined]

    @property
    def buffered_ops(self) -> int:
        return self.buffered_rows(self.ops_section)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        """The recording methods and drop counters of the foreign sections, from the Python
        buffer (``add_device_sample``, ``add_collective``, ``dropped_device_samples``):
        nothing else of it.
        Their ``add_*`` methods also tell the native sender that rows wait for it."""
        if name == "foreign" or not name.startswith(("add_", "dropped_")):  # never its op deques
            raise AttributeError(name)
        found = getattr(self.foreign, name)
        if not (name.startswith("add_") and callable(found)):
            return found
        noted = self.foreign_recorded  # type: ignore[attr-defined]

        def add(*args: Any, **kwargs: Any) -> Any:
            try:
                return found(*args, **kwargs)
            finally:
                noted()  # after the row is in: the sender reads this count before taking rows

        return add

    @property
    def buffered_samples(self) -> int:
        return (sum(self.buffered_rows(s)  # type: ignore[attr-defined]
                    for s in (self.marks, self.memory, self.queues, self.loader))
                + self.foreign.buffered_samples)

    @property
    def fill_ratio(self) -> float:
        return self.buffered_ops / self.max_ops

    @property
    def empty(self) -> bool:
        """Whether nothing is waiting for the Sender."""
        return not (self.buffered_ops or self.buffered_samples) and self.foreign.empty


_TYPE_FALLBACK = {"type_idx": "name_idx"}  # an op type of None is the op's name
