"""Records (``StepMetrics``, ``RunStepMetrics``, ``Alert``) into files: JSON lines, or
Parquet with nested records flattened into dotted columns (``memory.peak``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from profstream.processors.collectives import readable_calls
from profstream.schema.codec import read_schema


def arrow_schema(record_name: str):
    """The Arrow schema of a profstream record (``StepMetrics``, ``RunStepMetrics``, ``Alert``)."""
    import pyarrow as pa

    named: dict[str, Any] = {}  # a named type used again is referred to by its full name

    def convert(t: Any) -> tuple[Any, bool]:  # (arrow type, nullable)
        if isinstance(t, list):
            rest = [x for x in t if x != "null"]
            if len(rest) != 1:
                raise ValueError(f"union {t} has no Arrow equivalent here")
            return convert(rest[0])[0], "null" in t
        if isinstance(t, str):
            prim = {"string": pa.string(), "int": pa.int32(), "long": pa.int64(), "double": pa.float64(),
                    "float": pa.float32(), "boolean": pa.bool_(), "bytes": pa.binary()}
            return (prim[t] if t in prim else named[t]), False
        kind = t["type"]
        if kind == "record":
            named[t["name"]] = struct = pa.struct([pa.field(f["name"], *convert(f["type"])) for f in t["fields"]])
            return struct, False
        if kind == "array":
            return pa.list_(convert(t["items"])[0]), False
        if kind == "map":
            return pa.map_(pa.string(), convert(t["values"])[0]), False
        if kind == "enum":
            return pa.string(), False
        return convert(kind)

    return pa.schema(convert(_plain(read_schema(record_name)))[0])


def _plain(schema: Any) -> Any:
    """A parsed fastavro schema with named types inlined (they are parsed once already)."""
    from fastavro.schema import to_parsing_canonical_form

    return json.loads(to_parsing_canonical_form(schema))


def _to_arrow_rows(record_name: str, records: list[dict]) -> list[dict]:
    if record_name in ("RunStepMetrics", "Alert"):  # maps: Arrow wants (key, value) pairs
        map_field = "step_times_ns" if record_name == "RunStepMetrics" else "evidence"
        return [{**r, map_field: list(r[map_field].items())} for r in records]
    return records


class RecordWriter:
    """Writes records of one type to ``path``: JSON lines, or Parquet (nested records
    flattened into dotted columns) in row groups of ``rows_per_group``."""

    def __init__(self, path: Path, record_name: str, fmt: str = "jsonl", rows_per_group: int = 50_000) -> None:
        if fmt not in ("jsonl", "parquet"):
            raise ValueError(f"format {fmt!r}: expected jsonl or parquet")
        self.path, self.record_name, self.fmt = Path(path), record_name, fmt
        self.rows = 0
        self._pending: list[dict] = []
        self._rows_per_group = rows_per_group
        self._writer = None
        if fmt == "jsonl":
            self._file = open(self.path, "w")
        else:
            import pyarrow.parquet as pq

            self._schema = arrow_schema(record_name)
            flat = self._schema.empty_table().flatten().schema
            self._writer = pq.ParquetWriter(self.path, flat)

    def write(self, record: dict) -> None:
        self.rows += 1
        if self.fmt == "jsonl":
            if isinstance(record.get("collectives"), dict):  # StepMetrics v5: packed columns -> one dict a call
                record = {**record, "collectives": readable_calls(record["collectives"])}
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            return
        self._pending.append(record)
        if len(self._pending) >= self._rows_per_group:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._pending:
            table = pa.Table.from_pylist(_to_arrow_rows(self.record_name, self._pending), self._schema)
            self._writer.write_table(table.flatten())
            self._pending = []

    def close(self) -> None:
        if self.fmt == "jsonl":
            self._file.close()
        else:
            self._flush()
            self._writer.close()
