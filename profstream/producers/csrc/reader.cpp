// BodyReader: schema/sparse.py's reader of Avro bodies, compiled (the processors' EventBatch
// decode); and zigzag_varint, the long that schema/writer.py's generated writers write most. It knows no schema: sparse.body_plan() walks one and gives a plan of nested
// tuples, compiled here once into a tree of nodes; read(data, pos) returns the record
// (the dict fastavro reads) and the position after it. It takes well-formed bodies only:
// on anything else it raises ValueError, and codec.decode_any reads the message again with
// fastavro, whose error says what is wrong.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "encoder.h"

namespace ps {

namespace {

// plan codes (sparse.py's PLAN_* constants)
enum Kind : int { LONG = 0, STRING = 1, BYTES = 2, DOUBLE = 3, OPTIONAL = 4, ARRAY = 5, RECORD = 6, SECTION = 7 };

struct Node {
  int kind = LONG;
  std::vector<PyObject*> names;  // RECORD and SECTION: the field names (owned references)
  std::vector<std::unique_ptr<Node>> items;  // RECORD: one per field; OPTIONAL, ARRAY: one
  PyObject* empty = nullptr;  // SECTION: the section without rows ({count: 0, column: b"", ...}), owned
  ~Node() {
    for (PyObject* n : names) Py_XDECREF(n);
    Py_XDECREF(empty);
  }
};

struct Body {
  const uint8_t* p;
  Py_ssize_t pos;
  Py_ssize_t size;
};

// Not well formed (or beyond what this reader takes): ValueError, fastavro reads it again.
PyObject* refuse(const char* why) {
  PyErr_SetString(PyExc_ValueError, why);
  return nullptr;
}

bool read_long(Body& b, int64_t* out) {
  uint64_t n = 0;
  int shift = 0;
  while (true) {
    if (b.pos >= b.size) {
      refuse("body ends inside a varint");
      return false;
    }
    uint8_t byte = b.p[b.pos++];
    if (shift == 63 && byte > 1) {  // past 64 bits: sparse.py would make a larger int
      refuse("varint longer than 64 bits");
      return false;
    }
    n |= static_cast<uint64_t>(byte & 0x7F) << shift;
    if (byte < 0x80) break;
    shift += 7;
    if (shift > 63) {
      refuse("varint longer than 10 bytes");
      return false;
    }
  }
  *out = static_cast<int64_t>(n >> 1) ^ -static_cast<int64_t>(n & 1);
  return true;
}

// the span of a bytes or string value: its length, then that many bytes
bool read_span(Body& b, const uint8_t** start, Py_ssize_t* len) {
  int64_t n;
  if (!read_long(b, &n)) return false;
  if (n < 0 || n > b.size - b.pos) {
    refuse("bytes past the body's end");
    return false;
  }
  *start = b.p + b.pos;
  *len = static_cast<Py_ssize_t>(n);
  b.pos += *len;
  return true;
}

PyObject* read_node(const Node& node, Body& b);

// out[name] = value, stealing value; false (out released) where value is null or it fails
bool set_field(PyObject* out, PyObject* name, PyObject* value) {
  bool ok = value != nullptr && PyDict_SetItem(out, name, value) == 0;
  Py_XDECREF(value);
  if (!ok) Py_DECREF(out);
  return ok;
}

PyObject* read_section(const Node& node, Body& b) {
  const size_t fields = node.names.size();
  int64_t count;
  if (!read_long(b, &count)) return nullptr;
  // A section without rows whose columns are all empty (a batch's device samples and
  // collectives, most of its readings): a copy of the node's empty dict, one copy of its
  // table rather than a bytes and a dictionary entry made for each column (the same keys,
  // 0 and b"" as they would be).
  if (count == 0 && node.empty != nullptr && b.size - b.pos >= static_cast<Py_ssize_t>(fields - 1)) {
    size_t i = 1;
    while (i < fields && b.p[b.pos + static_cast<Py_ssize_t>(i) - 1] == 0) ++i;  // a zero length: one 0 byte
    if (i == fields) {
      b.pos += static_cast<Py_ssize_t>(fields - 1);
      return PyDict_Copy(node.empty);
    }
  }
  PyObject* out = _PyDict_NewPresized(static_cast<Py_ssize_t>(fields));  // sized for its columns: no resize on the way
  if (out == nullptr) return nullptr;
  if (!set_field(out, node.names[0], PyLong_FromLongLong(count))) return nullptr;
  for (size_t i = 1; i < fields; ++i) {
    const uint8_t* start;
    Py_ssize_t len;
    if (!read_span(b, &start, &len)) {
      Py_DECREF(out);
      return nullptr;
    }
    if (!set_field(out, node.names[i], PyBytes_FromStringAndSize(reinterpret_cast<const char*>(start), len))) {
      return nullptr;
    }
  }
  return out;
}

PyObject* read_node(const Node& node, Body& b) {
  switch (node.kind) {
    case LONG: {
      int64_t n;
      if (!read_long(b, &n)) return nullptr;
      return PyLong_FromLongLong(n);
    }
    case STRING:
    case BYTES: {
      const uint8_t* start;
      Py_ssize_t len;
      if (!read_span(b, &start, &len)) return nullptr;
      if (node.kind == BYTES) return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(start), len);
      PyObject* s = PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(start), len, nullptr);
      if (s == nullptr) {
        PyErr_Clear();
        return refuse("string not UTF-8");
      }
      return s;
    }
    case DOUBLE: {
      if (b.size - b.pos < 8) return refuse("body ends inside a double");
      double d;
      std::memcpy(&d, b.p + b.pos, 8);  // little-endian, as the wire (module.cpp checks the machine)
      b.pos += 8;
      return PyFloat_FromDouble(d);
    }
    case OPTIONAL: {
      if (b.pos >= b.size) return refuse("body ends at a union");
      uint8_t branch = b.p[b.pos++];
      if (branch == 0) Py_RETURN_NONE;
      if (branch != 2) return refuse("union branch");  // zigzag 1: the second branch
      return read_node(*node.items[0], b);
    }
    case ARRAY: {
      PyObject* out = PyList_New(0);
      if (out == nullptr) return nullptr;
      while (true) {
        int64_t count;
        if (!read_long(b, &count)) break;
        if (count == 0) return out;
        if (count < 0) {  // a block with its size in bytes
          count = -count;
          int64_t ignored;
          if (!read_long(b, &ignored)) break;
        }
        if (count > b.size - b.pos) {  // every item takes at least one byte
          refuse("array longer than the body");
          break;
        }
        bool ok = true;
        for (int64_t i = 0; i < count && ok; ++i) {
          PyObject* item = read_node(*node.items[0], b);
          ok = item != nullptr && PyList_Append(out, item) == 0;
          Py_XDECREF(item);
        }
        if (!ok) break;
      }
      Py_DECREF(out);
      return nullptr;
    }
    case RECORD: {
      PyObject* out = _PyDict_NewPresized(static_cast<Py_ssize_t>(node.items.size()));  // no resize on the way
      if (out == nullptr) return nullptr;
      for (size_t i = 0; i < node.items.size(); ++i) {
        if (!set_field(out, node.names[i], read_node(*node.items[i], b))) return nullptr;
      }
      return out;
    }
    case SECTION:
      return read_section(node, b);
    default:
      return refuse("unknown plan node");
  }
}

// plan: LONG | STRING | BYTES | DOUBLE (an int), (OPTIONAL, plan), (ARRAY, plan),
// (RECORD, (name, ...), (plan, ...)), (SECTION, (name, ...))
std::unique_ptr<Node> compile(PyObject* plan) {
  auto node = std::make_unique<Node>();
  if (PyLong_Check(plan)) {
    node->kind = static_cast<int>(PyLong_AsLong(plan));
    if (node->kind < LONG || node->kind > DOUBLE) {
      PyErr_SetString(PyExc_ValueError, "plan: unknown primitive");
      return nullptr;
    }
    return node;
  }
  if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) < 2 || !PyLong_Check(PyTuple_GET_ITEM(plan, 0))) {
    PyErr_SetString(PyExc_TypeError, "plan: expected an int or a tuple (kind, ...)");
    return nullptr;
  }
  node->kind = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(plan, 0)));
  if (node->kind == OPTIONAL || node->kind == ARRAY) {
    auto item = compile(PyTuple_GET_ITEM(plan, 1));
    if (item == nullptr) return nullptr;
    node->items.push_back(std::move(item));
    return node;
  }
  if (node->kind != RECORD && node->kind != SECTION) {
    PyErr_SetString(PyExc_ValueError, "plan: unknown kind");
    return nullptr;
  }
  PyObject* names = PyTuple_GET_ITEM(plan, 1);
  if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) < 1) {
    PyErr_SetString(PyExc_TypeError, "plan: a record's names must be a non-empty tuple");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); ++i) {
    PyObject* name = PyTuple_GET_ITEM(names, i);
    if (!PyUnicode_Check(name)) {
      PyErr_SetString(PyExc_TypeError, "plan: field names must be str");
      return nullptr;
    }
    Py_INCREF(name);
    PyUnicode_InternInPlace(&name);
    node->names.push_back(name);
  }
  if (node->kind == SECTION) {
    node->empty = PyDict_New();
    if (node->empty == nullptr) return nullptr;
    for (size_t i = 0; i < node->names.size(); ++i) {
      PyObject* value = i == 0 ? PyLong_FromLong(0) : PyBytes_FromStringAndSize(nullptr, 0);
      if (!set_field(node->empty, node->names[i], value)) {
        node->empty = nullptr;  // set_field released it
        return nullptr;
      }
    }
  }
  if (node->kind == RECORD) {
    if (PyTuple_GET_SIZE(plan) != 3 || !PyTuple_Check(PyTuple_GET_ITEM(plan, 2)) ||
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(plan, 2)) != PyTuple_GET_SIZE(names)) {
      PyErr_SetString(PyExc_TypeError, "plan: a record needs one plan per name");
      return nullptr;
    }
    PyObject* items = PyTuple_GET_ITEM(plan, 2);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); ++i) {
      auto item = compile(PyTuple_GET_ITEM(items, i));
      if (item == nullptr) return nullptr;
      node->items.push_back(std::move(item));
    }
  }
  return node;
}

struct BodyReaderObject {
  PyObject_HEAD
  Node* root;
};

int BodyReader_init(BodyReaderObject* self, PyObject* args, PyObject* kwds) {
  PyObject* plan;
  static const char* kwlist[] = {"plan", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", const_cast<char**>(kwlist), &plan)) return -1;
  auto root = compile(plan);
  if (root == nullptr) return -1;
  delete self->root;
  self->root = root.release();
  return 0;
}

void BodyReader_dealloc(BodyReaderObject* self) {
  delete self->root;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* BodyReader_read(BodyReaderObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyBytes_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "read(data: bytes, pos: int)");
    return nullptr;
  }
  if (self->root == nullptr) return refuse("BodyReader not initialised");
  Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
  if (pos == -1 && PyErr_Occurred()) return nullptr;
  Body b{reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(args[0])), pos, PyBytes_GET_SIZE(args[0])};
  if (pos < 0 || pos > b.size) return refuse("position outside the message");
  PyObject* record = read_node(*self->root, b);
  if (record == nullptr) return nullptr;
  PyObject* end = PyLong_FromSsize_t(b.pos);
  if (end == nullptr) {
    Py_DECREF(record);
    return nullptr;
  }
  PyObject* out = PyTuple_Pack(2, record, end);
  Py_DECREF(record);
  Py_DECREF(end);
  return out;
}

PyMethodDef BodyReader_methods[] = {
    {"read", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(BodyReader_read)), METH_FASTCALL,
     "read(data, pos) -> (record, position after it); ValueError on a body it does not take"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject BodyReaderType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// zigzag_varint(n) -> the Avro long's bytes (n within 64 bits: the writer checks the range)
PyObject* zigzag_varint(PyObject*, PyObject* arg) {
  long long n = PyLong_AsLongLong(arg);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  char out[10];
  return PyBytes_FromStringAndSize(out, static_cast<Py_ssize_t>(ps::zigzag_varint(n, out)));
}

PyMethodDef reader_functions[] = {
    {"zigzag_varint", zigzag_varint, METH_O, "zigzag_varint(n) -> the Avro encoding of long n"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

bool init_reader_type(PyObject* module) {
  BodyReaderType.tp_name = "profstream.producers._native.BodyReader";
  BodyReaderType.tp_basicsize = sizeof(BodyReaderObject);
  BodyReaderType.tp_flags = Py_TPFLAGS_DEFAULT;
  BodyReaderType.tp_doc = "BodyReader(plan): an Avro body reader compiled from sparse.body_plan(schema)";
  BodyReaderType.tp_new = PyType_GenericNew;
  BodyReaderType.tp_init = reinterpret_cast<initproc>(BodyReader_init);
  BodyReaderType.tp_dealloc = reinterpret_cast<destructor>(BodyReader_dealloc);
  BodyReaderType.tp_methods = BodyReader_methods;
  if (PyType_Ready(&BodyReaderType) < 0) return false;
  Py_INCREF(&BodyReaderType);
  return PyModule_AddObject(module, "BodyReader", reinterpret_cast<PyObject*>(&BodyReaderType)) == 0 &&
         PyModule_AddFunctions(module, reader_functions) == 0;
}

}  // namespace ps
