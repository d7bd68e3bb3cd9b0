"""A compiled Avro writer: one Python function per schema, generated from its JSON, that
writes the same bytes as fastavro's ``schemaless_writer`` for the records profstream
builds, at about a third of its cost (a StepMetrics: ~75 -> ~25 us, once per rank-step).

The generated code takes only what it can write exactly as fastavro does: plain ``int``
(in range) for int and long, ``float`` or ``int`` for double, ``bool`` for boolean,
``str`` and ``bytes``, dicts for records and maps, lists and tuples for arrays, ``None``
or such a value for a ``["null", X]`` union, every field of a record present. Anything
else (a numpy scalar, a union given as a (branch, value) tuple, a missing field, a value
out of range) raises ``Unsupported`` and the caller writes the record with fastavro:
the wire format never depends on which writer wrote it.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable

from profstream import compiled

_DOUBLE = struct.Struct("<d").pack
_FLOAT = struct.Struct("<f").pack
_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1
_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1
_SMALL = [bytes(((n << 1) ^ (n >> 63),)) for n in range(-64, 64)]  # zigzag varints of -64..63: one byte


# Records written by the compiled ``write_record`` (csrc/kernels.cpp) by a plan of their
# fields rather than by a generated function per field: a StepMetrics' host figures and
# advice lines (their ~30 fields and the lines' texts and figures cost ~10 us a step in
# Python: benchmarks.md, issue #34), its collective calls (v5's names and seven packed
# columns, written by every step of v5 or later: ~2.5 us a step), and the StepMetrics itself
# where its version's plan holds it whole (~70 fields, its op types' records: ~20 against
# ~6 us a step, issue #35), and the RankCheckpoint a transaction writes for each rank that
# changed. Every record its plan holds (scalars, nullable scalars, strings, bytes, enums,
# records, maps of doubles or longs, arrays of strings or of such records) could be; the
# others keep their functions until measured.
NATIVE_RECORDS = frozenset({"ResourceFigures", "Advice", "CollectiveCalls", "StepMetrics", "RankCheckpoint"})
# a plan's field kinds, as kernels.cpp numbers them; NULLABLE added for ["null", X] (the
# kinds numbered above NULLABLE's bit do not hold it)
FIELD_KINDS = {"long": 0, "int": 1, "double": 2, "boolean": 3, "string": 4, "records": 5, "doubles": 6, "enum": 7,
               "bytes": 16, "record": 17, "longs": 18, "strings": 32}
NULLABLE = 8
_PLAN_KINDS = ("records", "doubles", "strings", "record", "enum", "longs")  # kinds of a plan's own, not Avro types
WRITE_RECORD = compiled.NATIVE.write_record if compiled.NATIVE is not None else None


class Unsupported(Exception):
    """A value the generated writer does not take: write the record with fastavro."""


def _varint(n: int) -> bytes:
    """Zigzag varint of a long (in range)."""
    if -64 <= n < 64:
        return _SMALL[n + 64]
    z = (n << 1) ^ (n >> 63)
    out = []
    append = out.append
    while z >= 0x80:
        append((z & 0x7F) | 0x80)
        z >>= 7
    append(z)
    return bytes(out)


# What the generated writers call: ``_varint`` compiled (``profstream.compiled``), ~10x
# faster, where it is built; a StepMetrics writes ~70 longs.
VARINT = compiled.NATIVE.zigzag_varint if compiled.NATIVE is not None else _varint


class _Gen:
    def __init__(self, namespace: str, native: bool = False) -> None:
        self.native = native  # NATIVE_RECORDS by write_record's plan
        self.records: dict[str, dict] = {}  # full and short names -> record schema
        self.enums: dict[str, dict[str, int]] = {}  # full and short names -> {symbol: index}
        self.lines: list[str] = []
        self.named: dict[str, str] = {}  # full and short names -> generated function
        self.functions: list[list[str]] = []
        self.consts: dict[str, object] = {}
        self.counter = 0
        self.namespace = namespace

    def var(self, prefix: str = "v") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def record_fn(self, schema: dict, namespace: str) -> str:
        ns = schema.get("namespace", namespace)
        name = schema["name"]
        full = name if "." in name else f"{ns}.{name}"
        fn = f"_rec_{full.replace('.', '_')}"
        self.named[full] = self.named[full.rpartition(".")[2]] = fn
        self.records[full] = self.records[full.rpartition(".")[2]] = schema
        body: list[str] = []
        for f in schema["fields"]:
            v = self.var()
            body.append(f"{v} = r[{f['name']!r}]")
            self.emit(body, f["type"], v, ns)
        plan = self.native and name.rpartition(".")[2] in NATIVE_RECORDS and self.plan(schema, ns)
        if plan:  # the compiled writer, by plan: it makes the same checks (and raises for the same values)
            table = self.var("_plan")
            self.consts[table] = plan
            body = [f"a(_write_record(r, {table}))"]
            self.functions.append([f"def {fn}(r, a):"] + [f"    {line}" for line in body])
            return fn
        self.functions.append([f"def {fn}(r, a):", "    if type(r) is not dict: raise Unsupported"]
                              + [f"    {line}" for line in body] + ([] if body else ["    pass"]))
        return fn

    def plan(self, schema: dict, ns: str) -> tuple | None:
        """``write_record``'s plan of a record: ((field, kind, sub-plan or None), ...), or None
        where a field is of a type it does not write (a map but of doubles or longs, a union but
        ["null", X], a nullable array or map)."""
        fields = []
        for f in schema["fields"]:
            t, kind = f["type"], 0
            if isinstance(t, list):
                if len(t) != 2 or t[0] != "null":
                    return None
                t, kind = t[1], NULLABLE
            sub = None
            if isinstance(t, dict) and t.get("type") == "array" and t["items"] == "string" and not kind:
                t = "strings"
            elif isinstance(t, dict) and t.get("type") == "array":
                item = t["items"]
                item = self._record(item, ns) if isinstance(item, str) else item
                sub = self.plan(item, item.get("namespace", ns)) if isinstance(item, dict) and \
                    item.get("type") == "record" else None
                if sub is None or kind:
                    return None
                t = "records"
            elif isinstance(t, dict) and t.get("type") == "map":
                values = t["values"]
                t = {"double": "doubles", "long": "longs"}.get(values) if isinstance(values, str) and not kind else None
            elif isinstance(t, dict) and t.get("type") == "record" or isinstance(t, str) and self._record(t, ns):
                named = t if isinstance(t, dict) else self._record(t, ns)
                sub = self.plan(named, named.get("namespace", ns))
                t = "record" if sub is not None else None
            elif isinstance(t, dict) and t.get("type") == "enum" or isinstance(t, str) and self._enum(t, ns):
                sub = {s: k for k, s in enumerate(t["symbols"])} if isinstance(t, dict) else self._enum(t, ns)
                t = "enum"
            elif isinstance(t, dict):
                t = t.get("type") if t.get("type") in FIELD_KINDS and t.get("type") not in _PLAN_KINDS else None
            elif t in _PLAN_KINDS:
                return None
            if t not in FIELD_KINDS:
                return None
            # interned: write_record finds a field by its name's identity with the record's key
            fields.append((sys.intern(f["name"]), FIELD_KINDS[t] | kind, sub))
        return tuple(fields)

    def _record(self, name: str, ns: str) -> dict | None:
        return self.records.get(name) or self.records.get(f"{ns}.{name}")

    def _enum(self, name: str, ns: str) -> dict[str, int] | None:
        return self.enums.get(name) or self.enums.get(f"{ns}.{name}")

    def emit(self, out: list[str], t, v: str, ns: str) -> None:
        """Lines that write value ``v`` of Avro type ``t`` by calling a(bytes)."""
        if isinstance(t, list):
            if len(t) != 2 or t[0] != "null":
                raise NotImplementedError(f"union {t}")
            out.append(f"if {v} is None: a(b'\\x00')")
            out.append("else:")
            sub: list[str] = ["a(b'\\x02')"]
            self.emit(sub, t[1], v, ns)
            out.extend(f"    {line}" for line in sub)
            return
        if isinstance(t, str):
            if t in ("long", "int"):
                lo, hi = ("_LONG_MIN", "_LONG_MAX") if t == "long" else ("_INT_MIN", "_INT_MAX")
                out.append(f"if type({v}) is not int or not {lo} <= {v} <= {hi}: raise Unsupported")
                out.append(f"a(_varint({v}))")
            elif t == "double":
                out.append(f"if type({v}) is not float and type({v}) is not int: raise Unsupported")
                out.append(f"a(_DOUBLE({v}))")
            elif t == "float":
                out.append(f"if type({v}) is not float and type({v}) is not int: raise Unsupported")
                out.append(f"a(_FLOAT({v}))")
            elif t == "boolean":
                out.append(f"if type({v}) is not bool: raise Unsupported")
                out.append(f"a(b'\\x01' if {v} else b'\\x00')")
            elif t == "string":
                out.append(f"if type({v}) is not str: raise Unsupported")
                b = self.var("b")
                out.append(f"{b} = {v}.encode()")
                out.append(f"a(_varint(len({b}))); a({b})")
            elif t == "bytes":
                out.append(f"if type({v}) is not bytes: raise Unsupported")
                out.append(f"a(_varint(len({v}))); a({v})")
            elif t == "null":
                out.append(f"if {v} is not None: raise Unsupported")
            else:  # a named type defined earlier
                fn = self.named.get(t) or self.named[f"{ns}.{t}"]
                out.append(f"{fn}({v}, a)")
            return
        kind = t["type"]
        if kind == "record":
            fn = self.record_fn(t, ns)
            out.append(f"{fn}({v}, a)")
        elif kind == "enum":
            ns_ = t.get("namespace", ns)
            full = t["name"] if "." in t["name"] else f"{ns_}.{t['name']}"
            table = self.var("_enum")
            self.consts[table] = {s: _varint(k) for k, s in enumerate(t["symbols"])}
            fn = f"_enum_{full.replace('.', '_')}"
            self.named[full] = self.named[full.rpartition(".")[2]] = fn
            self.enums[full] = self.enums[full.rpartition(".")[2]] = {s: k for k, s in enumerate(t["symbols"])}
            self.functions.append([f"def {fn}(x, a):", f"    if type(x) is not str or x not in {table}: raise Unsupported",
                                   f"    a({table}[x])"])
            out.append(f"{fn}({v}, a)")
        elif kind == "array":
            out.append(f"if type({v}) is not list and type({v}) is not tuple: raise Unsupported")
            out.append(f"if {v}:")
            out.append(f"    a(_varint(len({v})))")
            item = self.var("x")
            out.append(f"    for {item} in {v}:")
            sub: list[str] = []
            self.emit(sub, t["items"], item, ns)
            out.extend(f"        {line}" for line in sub)
            out.append("a(b'\\x00')")
        elif kind == "map":
            out.append(f"if type({v}) is not dict: raise Unsupported")
            out.append(f"if {v}:")
            out.append(f"    a(_varint(len({v})))")
            key, val = self.var("k"), self.var("x")
            out.append(f"    for {key}, {val} in {v}.items():")
            sub = []
            self.emit(sub, "string", key, ns)
            self.emit(sub, t["values"], val, ns)
            out.extend(f"        {line}" for line in sub)
            out.append("a(b'\\x00')")
        elif kind in ("long", "int", "double", "float", "boolean", "string", "bytes", "null"):
            self.emit(out, kind, v, ns)
        else:
            raise NotImplementedError(f"Avro type {kind}")


def compile_writer(schema: dict, varint: Callable[[int], bytes] | None = None,
                   write_record: Callable[[dict, tuple], bytes] | None = WRITE_RECORD) -> Callable[[dict], bytes]:
    """A function record -> its Avro body (what ``schemaless_writer`` writes), raising
    ``Unsupported`` for a record it does not take (module docstring); ``varint``: the long
    writer it calls (default ``VARINT``); ``write_record``: the compiled writer of
    ``NATIVE_RECORDS`` (None: every record by its generated function)."""
    gen = _Gen(schema.get("namespace", ""), write_record is not None)
    top = gen.record_fn(schema, schema.get("namespace", ""))
    source = "\n\n".join("\n".join(f) for f in gen.functions)
    source += f"\n\ndef write(r):\n    parts = []\n    {top}(r, parts.append)\n    return b''.join(parts)\n"
    scope = {"Unsupported": Unsupported, "_varint": varint or VARINT, "_write_record": write_record, "_DOUBLE": _DOUBLE, "_FLOAT": _FLOAT,
             "_LONG_MIN": _LONG_MIN, "_LONG_MAX": _LONG_MAX, "_INT_MIN": _INT_MIN, "_INT_MAX": _INT_MAX,
             **gen.consts}
    exec(compile(source, f"<avro writer {schema.get('name')}>", "exec"), scope)  # noqa: S102 - our own schemas
    return scope["write"]
