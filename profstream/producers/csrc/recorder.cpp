// Recorder and Wake: the Python types of the recording side (see recorder.h).
#include "recorder.h"

#include <cstring>

namespace ps {

namespace {

// add_rows converts the numeric columns of this many rows at a time (recorder.h: scratch).
constexpr Py_ssize_t CHUNK_ROWS = 256;

// An exact int's value; false when it does not fit 64 bits. On CPython 3.11 ints of up to
// three 30-bit digits under 2^63 (timestamps in ns are three) are read without a call.
inline bool exact_int(PyObject* v, int64_t* out) {
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
  Py_ssize_t size = Py_SIZE(v);
  const digit* d = reinterpret_cast<PyLongObject*>(v)->ob_digit;
  Py_ssize_t digits = size < 0 ? -size : size;
  if (digits <= 3 && (digits < 3 || d[2] < 8)) {
    int64_t m = digits == 0 ? 0 : static_cast<int64_t>(d[0]);
    if (digits >= 2) m |= static_cast<int64_t>(d[1]) << 30;
    if (digits == 3) m |= static_cast<int64_t>(d[2]) << 60;
    *out = size < 0 ? -m : m;
    return true;
  }
#endif
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(v, &overflow);  // an exact int: no error but overflow
  return !overflow;
}

inline void bump(std::atomic<int64_t>& counter, int64_t by = 1) {  // one writer: no read-modify-write
  counter.store(counter.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
}

bool parse_type(const char* s, ColType* t) {
  if (!std::strcmp(s, "i4")) *t = I32;
  else if (!std::strcmp(s, "i8")) *t = I64;
  else if (!std::strcmp(s, "u1")) *t = U8;
  else if (!std::strcmp(s, "f8")) *t = F64;
  else return false;
  return true;
}

// layout: [(section, block_rows, max_rows, [(column, type, dict, fill, value_names, unknown_name)],
//           [(dict field, column index, blob)])]
bool parse_layout(PyObject* layout, Recording* rec) {
  PyObject* seq = PySequence_Fast(layout, "layout must be a sequence");
  if (seq == nullptr) return false;
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(seq); ++i) {
    const char* name;
    long long block_rows, max_rows;
    PyObject *cols, *dicts;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "sLLOO", &name, &block_rows, &max_rows, &cols, &dicts)) {
      ok = false;
      break;
    }
    SectionSpec spec;
    spec.name = name;
    spec.block_rows = block_rows > 0 ? block_rows : 1;
    spec.max_rows = max_rows;
    PyObject* cseq = PySequence_Fast(cols, "columns must be a sequence");
    if (cseq == nullptr) {
      ok = false;
      break;
    }
    for (Py_ssize_t j = 0; ok && j < PySequence_Fast_GET_SIZE(cseq); ++j) {
      const char *cname, *ctype;
      int dict;
      PyObject *fill, *names;
      long long unknown;
      if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(cseq, j), "ssiOOL", &cname, &ctype, &dict, &fill, &names,
                            &unknown)) {
        ok = false;
        break;
      }
      ColumnSpec c;
      c.name = cname;
      if (!parse_type(ctype, &c.type)) {
        PyErr_Format(PyExc_ValueError, "column %s.%s: unknown type %s", name, cname, ctype);
        ok = false;
        break;
      }
      c.width = width_of(c.type);
      c.dict = dict;
      if (fill != Py_None) {
        c.has_fill = true;
        if (c.type == F64) ok = to_double(fill, &c.fill_float);
        else ok = to_int64(fill, &c.fill_int);
        if (!ok) PyErr_Format(PyExc_ValueError, "column %s.%s: bad fill value", name, cname);
      }
      if (names != Py_None) {
        if (!PyDict_Check(names)) {
          PyErr_SetString(PyExc_TypeError, "value names must be a dict");
          ok = false;
          break;
        }
        Py_INCREF(names);
        c.value_names = names;  // kept for the life of the process's recorders (tiny)
      }
      c.unknown_name = unknown;
      spec.cols.push_back(c);
    }
    Py_DECREF(cseq);
    if (!ok) break;
    PyObject* dseq = PySequence_Fast(dicts, "dictionaries must be a sequence");
    if (dseq == nullptr) {
      ok = false;
      break;
    }
    for (Py_ssize_t j = 0; ok && j < PySequence_Fast_GET_SIZE(dseq); ++j) {
      const char* field;
      int column, blob;
      if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(dseq, j), "sip", &field, &column, &blob)) {
        ok = false;
        break;
      }
      if (column < 0 || column >= static_cast<int>(spec.cols.size())) {
        PyErr_Format(PyExc_ValueError, "dictionary %s: no column %d", field, column);
        ok = false;
        break;
      }
      spec.dicts.push_back(DictSpec{field, column, blob != 0});
    }
    Py_DECREF(dseq);
    if (ok && spec.cols.size() > MAX_COLUMNS) {
      PyErr_Format(PyExc_ValueError, "section %s has %zu columns, more than the %zu a section may have", name,
                   spec.cols.size(), MAX_COLUMNS);
      ok = false;
    }
    for (const ColumnSpec& c : spec.cols) {
      if (ok && (c.dict >= static_cast<int>(spec.dicts.size()) || (c.dict >= 0 && c.type != I32))) {
        PyErr_Format(PyExc_ValueError, "column %s.%s: bad dictionary", name, c.name.c_str());
        ok = false;
      }
    }
    if (ok) rec->specs.push_back(spec);
  }
  Py_DECREF(seq);
  return ok;
}

int column_index(const SectionSpec& s, const char* name) {
  for (size_t i = 0; i < s.cols.size(); ++i)
    if (s.cols[i].name == name) return static_cast<int>(i);
  return -1;
}

void write_fill(Block* b, const ColumnSpec& c, int i, int64_t row) {
  if (c.type == F64) std::memcpy(b->cols[i] + row * 8, &c.fill_float, 8);
  else write_int(b->cols[i], c.width, row, c.fill_int);
}

void note_first(PyObject** slot, PyObject* row) {
  if (*slot == nullptr && row != nullptr) {
    Py_INCREF(row);
    *slot = row;
  }
}

// -- a column's values in one add_rows call ---------------------------------------------

struct Source {
  enum Kind { NONE, SCALAR, ITEMS, BUFFER } kind = NONE;
  PyObject* scalar = nullptr;   // borrowed
  PyObject* fast = nullptr;     // owned list/tuple for ITEMS
  PyObject** items = nullptr;
  Py_ssize_t len = 0;
  Py_buffer view{};
  bool has_view = false;
  char fmt = 0;
  uint64_t code_epoch = 0;  // a scalar's dictionary code, for the block of that epoch
  int32_t code = -1;

  ~Source() {
    Py_XDECREF(fast);
    if (has_view) PyBuffer_Release(&view);
  }

  // SCALAR for None/str/int/float, BUFFER for a numeric 1-d buffer, else ITEMS.
  bool open(PyObject* v, bool numeric) {
    if (v == Py_None || PyUnicode_Check(v) || PyLong_Check(v) || PyFloat_Check(v)) {
      kind = SCALAR;
      scalar = v;
      return true;
    }
    if (numeric && PyObject_CheckBuffer(v) && PyObject_GetBuffer(v, &view, PyBUF_FORMAT | PyBUF_STRIDES) == 0) {
      has_view = true;
      const char* f = view.format ? view.format : "B";
      if (*f == '<' || *f == '@' || *f == '=') ++f;
      if (view.ndim == 1 && f[0] && !f[1] && std::strchr("bBhHiIlLqQ?fd", f[0])) {
        kind = BUFFER;
        fmt = f[0];
        len = view.shape[0];
        return true;
      }
      PyBuffer_Release(&view);
      has_view = false;
    }
    PyErr_Clear();
    fast = PySequence_Fast(v, "a column must be a sequence or a scalar");
    if (fast == nullptr) {  // not a sequence: treated as a scalar (then found invalid)
      PyErr_Clear();
      kind = SCALAR;
      scalar = v;
      return true;
    }
    kind = ITEMS;
    items = PySequence_Fast_ITEMS(fast);
    len = PySequence_Fast_GET_SIZE(fast);
    return true;
  }

  // The value of row i as an object (new reference), for dictionary columns and messages.
  PyObject* object(Py_ssize_t i) const {
    if (kind == SCALAR) {
      Py_INCREF(scalar);
      return scalar;
    }
    if (kind == ITEMS) {
      if (i >= len) return nullptr;
      Py_INCREF(items[i]);
      return items[i];
    }
    if (kind == BUFFER) {
      if (i >= len) return nullptr;
      double d;
      int64_t x;
      if (fmt == 'f' || fmt == 'd') {
        read_double(i, &d);
        return PyFloat_FromDouble(d);
      }
      read_int(i, &x);
      return PyLong_FromLongLong(x);
    }
    return nullptr;
  }

  // The value of row i as a borrowed object: SCALAR and ITEMS only (nullptr otherwise).
  PyObject* borrowed(Py_ssize_t i) const {
    if (kind == SCALAR) return scalar;
    if (kind == ITEMS && i < len) return items[i];
    return nullptr;
  }

  // The values of rows [from, to) of numeric column c into out[0, to - from) (a double's
  // bits for F64); a row without a valid value is marked in bad, one that gave a name
  // the column does not know (an unknown op kind) in unknown.
  void convert(const ColumnSpec& c, Py_ssize_t from, Py_ssize_t to, int64_t* out, uint8_t* bad,
               uint8_t* unknown) const {
    Py_ssize_t n = to - from;
    if (kind == NONE || kind == SCALAR) {
      int64_t x = c.fill_int;
      double d = c.fill_float;
      bool unk = false;
      bool ok = kind == NONE ? c.has_fill : c.type == F64 ? to_double(scalar, &d) : to_column_int(c, scalar, &x, &unk);
      if (c.type == F64) std::memcpy(&x, &d, 8);
      for (Py_ssize_t k = 0; k < n; ++k) {
        out[k] = x;
        bad[k] |= !ok;
        unknown[k] |= unk;
      }
      return;
    }
    if (kind == BUFFER && c.type == I64 && view.itemsize == 8 && (fmt == 'q' || fmt == 'l')) {  // int64 arrays
      const char* p = static_cast<const char*>(view.buf);
      for (Py_ssize_t k = 0; k < n; ++k) {
        if (from + k < len) std::memcpy(&out[k], p + (from + k) * view.strides[0], 8);
        else bad[k] = 1;
      }
      return;
    }
    for (Py_ssize_t k = 0; k < n; ++k) {
      Py_ssize_t i = from + k;
      if (kind == ITEMS && i + 8 < len) __builtin_prefetch(items[i + 8]);  // the objects, not just their pointers
      int64_t x = 0;
      double d = 0;
      bool unk = false, ok;
      if (kind == ITEMS && i < len && c.type != F64 && PyLong_CheckExact(items[i])) {
        ok = exact_int(items[i], &x) &&
             (c.type == I64 || (c.type == I32 ? x >= INT32_MIN && x <= INT32_MAX : x >= 0 && x <= 255));
      } else {
        ok = number(c, i, &x, &d, &unk);
      }
      if (c.type == F64) std::memcpy(&x, &d, 8);
      out[k] = x;
      bad[k] |= !ok;
      unknown[k] |= unk;
    }
  }

  bool read_int(Py_ssize_t i, int64_t* out) const {
    const char* p = static_cast<const char*>(view.buf) + i * view.strides[0];
    switch (fmt) {
      case 'b': *out = *reinterpret_cast<const int8_t*>(p); return true;
      case 'B': case '?': *out = *reinterpret_cast<const uint8_t*>(p); return true;
      case 'h': { int16_t x; std::memcpy(&x, p, 2); *out = x; return true; }
      case 'H': { uint16_t x; std::memcpy(&x, p, 2); *out = x; return true; }
      case 'i': { int32_t x; std::memcpy(&x, p, 4); *out = x; return true; }
      case 'I': { uint32_t x; std::memcpy(&x, p, 4); *out = x; return true; }
      case 'l': case 'q': {
        if (view.itemsize == 4) { int32_t x; std::memcpy(&x, p, 4); *out = x; return true; }
        std::memcpy(out, p, 8);
        return true;
      }
      case 'L': case 'Q': {
        if (view.itemsize == 4) { uint32_t x; std::memcpy(&x, p, 4); *out = x; return true; }
        uint64_t x;
        std::memcpy(&x, p, 8);
        if (x > static_cast<uint64_t>(INT64_MAX)) return false;
        *out = static_cast<int64_t>(x);
        return true;
      }
      default: {
        double d;
        read_double(i, &d);
        if (!(d < 9.2233720368547758e18 && d >= -9.2233720368547758e18)) return false;
        *out = static_cast<int64_t>(d);
        return true;
      }
    }
  }

  void read_double(Py_ssize_t i, double* out) const {
    const char* p = static_cast<const char*>(view.buf) + i * view.strides[0];
    if (fmt == 'd') std::memcpy(out, p, 8);
    else if (fmt == 'f') { float x; std::memcpy(&x, p, 4); *out = x; }
    else { int64_t x = 0; read_int(i, &x); *out = static_cast<double>(x); }
  }

  // A numeric column's value of row i; false when invalid or missing.
  bool number(const ColumnSpec& c, Py_ssize_t i, int64_t* x, double* d, bool* unknown) const {
    if (kind == BUFFER) {
      if (i >= len) return false;
      if (c.type == F64) {
        read_double(i, d);
        return true;
      }
      if (!read_int(i, x)) return false;
      if (c.type == U8) return *x >= 0 && *x <= 255;
      if (c.type == I32) return *x >= INT32_MIN && *x <= INT32_MAX;
      return true;
    }
    PyObject* v = kind == SCALAR ? scalar : (kind == ITEMS && i < len ? items[i] : nullptr);
    if (v == nullptr) return false;
    if (c.type == F64) return to_double(v, d);
    return to_column_int(c, v, x, unknown);
  }
};

}  // namespace

// -- Wake ---------------------------------------------------------------------------------

struct WakeObject {
  PyObject_HEAD
  std::shared_ptr<Wakeup>* shared;
  Wakeup* wake;
};

static void Wake_dealloc(WakeObject* self) {
  delete self->shared;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

static PyObject* Wake_set(WakeObject* self, PyObject*) {
  self->wake->set();
  Py_RETURN_NONE;
}

static PyObject* Wake_clear(WakeObject* self, PyObject*) {
  self->wake->clear();
  Py_RETURN_NONE;
}

static PyObject* Wake_is_set(WakeObject* self, PyObject*) { return PyBool_FromLong(self->wake->is_set()); }

static PyObject* Wake_wait(WakeObject* self, PyObject* args) {
  PyObject* timeout = Py_None;
  if (!PyArg_ParseTuple(args, "|O", &timeout)) return nullptr;
  double seconds = timeout == Py_None ? 1e9 : PyFloat_AsDouble(timeout);
  if (seconds == -1.0 && PyErr_Occurred()) return nullptr;
  bool set;
  Py_BEGIN_ALLOW_THREADS set = self->wake->wait(seconds);
  Py_END_ALLOW_THREADS return PyBool_FromLong(set);
}

static PyMethodDef Wake_methods[] = {
    {"set", reinterpret_cast<PyCFunction>(Wake_set), METH_NOARGS, "Wake the sender."},
    {"clear", reinterpret_cast<PyCFunction>(Wake_clear), METH_NOARGS, nullptr},
    {"is_set", reinterpret_cast<PyCFunction>(Wake_is_set), METH_NOARGS, nullptr},
    {"wait", reinterpret_cast<PyCFunction>(Wake_wait), METH_VARARGS, "Wait until set or timeout (GIL released)."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject WakeType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// -- Recorder -----------------------------------------------------------------------------

static int Recorder_init(RecorderObject* self, PyObject* args, PyObject* kwds) {
  static const char* kw[] = {"layout", "ops_section", "batch_max_ops", nullptr};
  PyObject* layout;
  const char* ops_name = "ops";
  long long batch_max_ops = 8192;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|sL", const_cast<char**>(kw), &layout, &ops_name, &batch_max_ops))
    return -1;
  if (self->rec != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "Recorder is already initialized");
    return -1;
  }
  auto* rec = new Recording();
  rec->batch_max_ops = batch_max_ops;
  if (!parse_layout(layout, rec)) {
    delete rec;
    return -1;
  }
  for (size_t i = 0; i < rec->specs.size(); ++i)
    if (rec->specs[i].name == ops_name) rec->ops = static_cast<int>(i);
  if (rec->ops < 0) {
    PyErr_Format(PyExc_ValueError, "no section %s in the layout", ops_name);
    delete rec;
    return -1;
  }
  const SectionSpec& ops = rec->specs[rec->ops];
  rec->c_name = column_index(ops, "name_idx");
  rec->c_type = column_index(ops, "type_idx");
  rec->c_kind = column_index(ops, "kind");
  rec->c_stream = column_index(ops, "stream");
  rec->c_step = column_index(ops, "step");
  rec->c_start = column_index(ops, "start_ns");
  rec->c_dur = column_index(ops, "dur_ns");
  int roles[] = {rec->c_name, rec->c_type, rec->c_kind, rec->c_stream, rec->c_step, rec->c_start, rec->c_dur};
  for (int r : roles) {
    if (r < 0) {
      PyErr_SetString(PyExc_ValueError, "the ops section lacks a column op() sets");
      delete rec;
      return -1;
    }
  }
  if (ops.cols[rec->c_name].dict < 0 || ops.cols[rec->c_type].dict < 0) {
    PyErr_SetString(PyExc_ValueError, "op names and types must be dictionary columns");
    delete rec;
    return -1;
  }
  for (size_t i = 0; i < ops.cols.size(); ++i) {
    bool set_by_op = false;
    for (int r : roles) set_by_op = set_by_op || r == static_cast<int>(i);
    if (!set_by_op && !ops.cols[i].has_fill) {
      PyErr_Format(PyExc_ValueError, "ops column %s has no fill value for op()", ops.cols[i].name.c_str());
      delete rec;
      return -1;
    }
  }
  try {
    for (const SectionSpec& s : rec->specs) rec->stores.emplace_back(new Store(s));
  } catch (const std::bad_alloc&) {
    delete rec;
    PyErr_NoMemory();
    return -1;
  }
  auto* wake = PyObject_New(WakeObject, &WakeType);
  if (wake == nullptr) {
    delete rec;
    return -1;
  }
  wake->shared = new std::shared_ptr<Wakeup>(rec->wake);
  wake->wake = rec->wake.get();
  self->rec = rec;
  self->wake = reinterpret_cast<PyObject*>(wake);
  return 0;
}

static void Recorder_dealloc(RecorderObject* self) {
  Py_CLEAR(self->wake);
  delete self->rec;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

static void bad_op(Recording* r, PyObject* const* a) {
  bump(r->bad_ops);
  if (r->first_bad_op == nullptr) {
    PyObject* row = PyTuple_New(7);
    if (row == nullptr) {
      PyErr_Clear();
      return;
    }
    int order[] = {0, 4, 3, 5, 6, 1, 2};  // (name, op_type, kind, stream, step, start_ns, dur_ns)
    for (int i = 0; i < 7; ++i) {
      PyObject* v = a[order[i]] ? a[order[i]] : Py_None;
      Py_INCREF(v);
      PyTuple_SET_ITEM(row, i, v);
    }
    r->first_bad_op = row;
  }
}

// op(name, start_ns, dur_ns, kind=0, op_type=None, stream=0, step=None): the hot path.
static PyObject* Recorder_op(RecorderObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* names[] = {"name", "start_ns", "dur_ns", "kind", "op_type", "stream", "step"};
  Recording* r = self->rec;
  if (!r->capturing) Py_RETURN_NONE;
  PyObject* a[7] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  if (nargs > 7) {
    PyErr_SetString(PyExc_TypeError, "op() takes at most 7 arguments");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) a[i] = args[i];
  if (kwnames != nullptr) {
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); ++k) {
      PyObject* key = PyTuple_GET_ITEM(kwnames, k);
      int at = -1;
      for (int j = 0; j < 7 && at < 0; ++j)
        if (PyUnicode_CompareWithASCIIString(key, names[j]) == 0) at = j;
      if (at < 0 || a[at] != nullptr) {
        PyErr_Format(PyExc_TypeError, "op() got an unexpected or repeated keyword argument %R", key);
        return nullptr;
      }
      a[at] = args[nargs + k];
    }
  }
  if (a[0] == nullptr || a[1] == nullptr || a[2] == nullptr) {
    PyErr_SetString(PyExc_TypeError, "op() needs name, start_ns and dur_ns");
    return nullptr;
  }
  Store& s = *r->stores[r->ops];
  if (s.full()) {
    bump(r->dropped_ops);
    Py_RETURN_NONE;
  }
  const SectionSpec& spec = s.spec;
  int64_t start, dur, kind = 0, stream = 0, step = r->step;
  bool unknown = false;
  bool ok = to_int64(a[1], &start) && to_int64(a[2], &dur) &&
            (a[3] == nullptr || to_column_int(spec.cols[r->c_kind], a[3], &kind, &unknown)) &&
            (a[5] == nullptr || to_column_int(spec.cols[r->c_stream], a[5], &stream, &unknown)) &&
            (a[6] == nullptr || a[6] == Py_None || to_int64(a[6], &step));
  if (!ok) {
    bad_op(r, a);
    Py_RETURN_NONE;
  }
  int64_t row;
  Block* b = s.slot(&row);
  if (b == nullptr) {
    bump(r->dropped_ops);
    Py_RETURN_NONE;
  }
  int32_t name = s.cached_code(b, spec.cols[r->c_name].dict, a[0]);
  int32_t type = name < 0 ? -1 : s.cached_code(b, spec.cols[r->c_type].dict, a[4] && a[4] != Py_None ? a[4] : a[0]);
  if (type < 0) {
    PyErr_Clear();
    bad_op(r, a);
    Py_RETURN_NONE;
  }
  if (unknown) bump(r->unknown_kinds);
  for (size_t i = 0; i < spec.cols.size(); ++i) {
    int c = static_cast<int>(i);
    char* col = b->cols[i];
    if (c == r->c_name) write_int(col, 4, row, name);
    else if (c == r->c_type) write_int(col, 4, row, type);
    else if (c == r->c_kind) write_int(col, 1, row, kind);
    else if (c == r->c_stream) write_int(col, 4, row, stream);
    else if (c == r->c_step) write_int(col, 8, row, step);
    else if (c == r->c_start) write_int(col, 8, row, start);
    else if (c == r->c_dur) write_int(col, 8, row, dur);
    else write_fill(b, spec.cols[i], c, row);
  }
  s.publish(b, row);
  if (s.buffered() == r->batch_max_ops) r->wake->set();
  Py_RETURN_NONE;
}

// add_rows(section, n, columns, fallback=None): n rows of a section from {column: values}
// (a sequence, a numeric buffer or one scalar for all rows). Columns not given take their
// fill value; a None in a dictionary column takes the value of fallback[column] at that row.
// What does not fit is dropped and counted; rows with invalid values are counted as bad.
//
// Column by column where it can: the numeric columns of CHUNK_ROWS rows are converted one
// column at a time (a tight loop each), then each row takes its dictionary codes (through
// the store's identity cache: one compare for a str object seen before) and is written;
// the rows of a block are published at once.
static PyObject* Recorder_add_rows(RecorderObject* self, PyObject* args) {
  int section;
  Py_ssize_t n;
  PyObject* columns;
  PyObject* fallback = Py_None;
  if (!PyArg_ParseTuple(args, "inO!|O", &section, &n, &PyDict_Type, &columns, &fallback)) return nullptr;
  Recording* r = self->rec;
  if (section < 0 || section >= static_cast<int>(r->stores.size())) {
    PyErr_SetString(PyExc_IndexError, "no such section");
    return nullptr;
  }
  Store& s = *r->stores[section];
  const SectionSpec& spec = s.spec;
  bool is_ops = section == r->ops;
  std::atomic<int64_t>& dropped = is_ops ? r->dropped_ops : r->dropped_samples;
  std::atomic<int64_t>& bad = is_ops ? r->bad_ops : r->bad_samples;
  PyObject** first_bad = is_ops ? &r->first_bad_op : &r->first_bad_sample;
  int64_t room = s.room();
  if (n > room) {
    if (room < 0) room = 0;
    bump(dropped, n - room);
    n = room;
  }
  if (n <= 0) Py_RETURN_NONE;
  size_t ncols = spec.cols.size();
  std::vector<Source> src(ncols);
  std::vector<int> fall(ncols, -1);
  for (size_t i = 0; i < ncols; ++i) {
    PyObject* v = PyDict_GetItemString(columns, spec.cols[i].name.c_str());
    if (v != nullptr) src[i].open(v, spec.cols[i].dict < 0);
    if (fallback != Py_None && PyDict_Check(fallback)) {
      PyObject* f = PyDict_GetItemString(fallback, spec.cols[i].name.c_str());
      if (f != nullptr && PyUnicode_Check(f)) fall[i] = column_index(spec, PyUnicode_AsUTF8(f));
    }
  }
  int dict_cols[MAX_COLUMNS], ndict = 0;
  for (size_t i = 0; i < ncols; ++i)
    if (spec.cols[i].dict >= 0) dict_cols[ndict++] = static_cast<int>(i);
  std::vector<int64_t>& values = r->scratch;  // [column][row of the chunk]; a double's bits for F64
  values.resize(ncols * CHUNK_ROWS);
  uint8_t bad_rows[CHUNK_ROWS], unknown_rows[CHUNK_ROWS];
  int32_t codes[MAX_COLUMNS];
  Block* b = nullptr;
  int64_t pos = 0;  // the next row of b
  // the chunk's valid rows that go to b from row pos - nkeep on, written column by column
  // (one tight loop per column) when the chunk ends or b is full, then published
  uint16_t keep[CHUNK_ROWS];
  int nkeep = 0;
  auto write_kept = [&]() {
    if (nkeep == 0) return;
    int64_t at = pos - nkeep;
    for (size_t i = 0; i < ncols; ++i) {
      const int64_t* v = &values[i * CHUNK_ROWS];
      char* col = b->cols[i];
      switch (spec.cols[i].width) {
        case 1:
          for (int t = 0; t < nkeep; ++t) col[at + t] = static_cast<char>(v[keep[t]]);
          break;
        case 4:
          for (int t = 0; t < nkeep; ++t) {
            int32_t x = static_cast<int32_t>(v[keep[t]]);
            std::memcpy(col + (at + t) * 4, &x, 4);
          }
          break;
        default:
          for (int t = 0; t < nkeep; ++t) std::memcpy(col + (at + t) * 8, &v[keep[t]], 8);
      }
    }
    s.publish_rows(b, pos, nkeep);
    nkeep = 0;
  };
  for (Py_ssize_t from = 0; from < n; from += CHUNK_ROWS) {
    Py_ssize_t to = n - from < CHUNK_ROWS ? n : from + CHUNK_ROWS;
    std::memset(bad_rows, 0, static_cast<size_t>(to - from));
    std::memset(unknown_rows, 0, static_cast<size_t>(to - from));
    for (size_t i = 0; i < ncols; ++i)
      if (spec.cols[i].dict < 0) src[i].convert(spec.cols[i], from, to, &values[i * CHUNK_ROWS], bad_rows, unknown_rows);
    for (Py_ssize_t row_i = from; row_i < to; ++row_i) {
      Py_ssize_t k = row_i - from;
      for (int j = 0; j < ndict; ++j)  // a later row's name and its cache entry: random in memory
        if (PyObject* ahead = src[dict_cols[j]].borrowed(row_i + 8)) {
          __builtin_prefetch(ahead);
          __builtin_prefetch(s.id_set(spec.cols[dict_cols[j]].dict, ahead));
        }
      bool ok = !bad_rows[k];
      if (ok && (b == nullptr || pos == b->capacity)) {
        if (b != nullptr) write_kept();
        b = s.slot(&pos);
        if (b == nullptr) {
          bump(dropped);
          continue;
        }
      }
      for (int j = 0; ok && j < ndict; ++j) {
        int i = dict_cols[j];
        const ColumnSpec& c = spec.cols[i];
        Source& col = src[i];
        if (col.kind == Source::SCALAR && col.scalar != Py_None && col.code_epoch == b->epoch) {
          codes[i] = col.code;
          continue;
        }
        PyObject* v = col.borrowed(row_i);
        PyObject* owned = nullptr;
        if ((v == nullptr || v == Py_None) && fall[i] >= 0) v = owned = src[fall[i]].object(row_i);
        if (v == nullptr || v == Py_None) {
          Py_XDECREF(owned);
          ok = false;
          break;
        }
        codes[i] = s.cached_code(b, c.dict, v);
        Py_XDECREF(owned);
        if (codes[i] < 0) {
          PyErr_Clear();
          ok = false;
        } else if (col.kind == Source::SCALAR) {
          col.code_epoch = b->epoch;
          col.code = codes[i];
        }
      }
      if (!ok) {
        bump(bad);
        if (*first_bad == nullptr) {
          PyObject* rowobj = PyTuple_New(static_cast<Py_ssize_t>(ncols));
          for (size_t i = 0; rowobj && i < ncols; ++i) {
            PyObject* v = src[i].object(row_i);
            PyTuple_SET_ITEM(rowobj, i, v ? v : (Py_INCREF(Py_None), Py_None));
          }
          note_first(first_bad, rowobj);
          Py_XDECREF(rowobj);
          PyErr_Clear();
        }
        continue;
      }
      if (unknown_rows[k] && is_ops) bump(r->unknown_kinds);
      for (int j = 0; j < ndict; ++j) values[dict_cols[j] * CHUNK_ROWS + k] = codes[dict_cols[j]];
      keep[nkeep++] = static_cast<uint16_t>(k);
      ++pos;
    }
    if (b != nullptr) write_kept();
  }
  if (is_ops && s.buffered() >= r->batch_max_ops) r->wake->set();
  Py_RETURN_NONE;
}

// add_sample(section, row): one row of a sample section, values in column order.
static PyObject* Recorder_add_sample(RecorderObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyLong_Check(args[0]) || !PyTuple_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "add_sample(section: int, row: tuple)");
    return nullptr;
  }
  Recording* r = self->rec;
  long section = PyLong_AsLong(args[0]);
  if (section < 0 || section >= static_cast<long>(r->stores.size()) || section == r->ops) {
    PyErr_SetString(PyExc_IndexError, "no such sample section");
    return nullptr;
  }
  Store& s = *r->stores[section];
  if (s.full()) {
    bump(r->dropped_samples);
    Py_RETURN_NONE;
  }
  const SectionSpec& spec = s.spec;
  PyObject* row = args[1];
  Py_ssize_t given = PyTuple_GET_SIZE(row);
  size_t ncols = spec.cols.size();
  int64_t ints[MAX_COLUMNS];
  double floats[MAX_COLUMNS];
  bool ok = ncols <= MAX_COLUMNS;
  bool unknown = false;
  for (size_t i = 0; ok && i < ncols; ++i) {
    const ColumnSpec& c = spec.cols[i];
    if (static_cast<Py_ssize_t>(i) >= given) {
      ok = c.has_fill;
      ints[i] = c.fill_int;
      floats[i] = c.fill_float;
    } else if (c.dict < 0) {
      PyObject* v = PyTuple_GET_ITEM(row, i);
      ok = c.type == F64 ? to_double(v, &floats[i]) : to_column_int(c, v, &ints[i], &unknown);
    }
  }
  int64_t at = 0;
  Block* b = ok ? s.slot(&at) : nullptr;
  if (ok && b == nullptr) {
    bump(r->dropped_samples);
    Py_RETURN_NONE;
  }
  for (size_t i = 0; ok && i < ncols; ++i) {
    if (spec.cols[i].dict >= 0) {
      int32_t code = static_cast<Py_ssize_t>(i) < given ? s.code(b, spec.cols[i].dict, PyTuple_GET_ITEM(row, i)) : -1;
      if (code < 0) {
        PyErr_Clear();
        ok = false;
      }
      ints[i] = code;
    }
  }
  if (!ok) {
    bump(r->bad_samples);
    note_first(&r->first_bad_sample, row);
    Py_RETURN_NONE;
  }
  for (size_t i = 0; i < ncols; ++i) {
    const ColumnSpec& c = spec.cols[i];
    if (c.type == F64) std::memcpy(b->cols[i] + at * 8, &floats[i], 8);
    else write_int(b->cols[i], c.width, at, ints[i]);
  }
  s.publish(b, at);
  Py_RETURN_NONE;
}

// foreign_recorded(): one row of a section recorded in Python (any thread; GIL held).
static PyObject* Recorder_foreign_recorded(RecorderObject* self, PyObject*) {
  self->rec->foreign_recorded.fetch_add(1, std::memory_order_release);
  Py_RETURN_NONE;
}

// foreign_taken(recorded, dropped): the Python sender took every row recorded up to the
// count `recorded` (read before it took them), and the buffer has dropped `dropped` in all.
static PyObject* Recorder_foreign_taken(RecorderObject* self, PyObject* args) {
  long long recorded, dropped;
  if (!PyArg_ParseTuple(args, "LL", &recorded, &dropped)) return nullptr;
  self->rec->foreign_dropped.store(dropped, std::memory_order_relaxed);
  self->rec->foreign_taken.store(recorded, std::memory_order_release);
  Py_RETURN_NONE;
}

static PyObject* Recorder_set_state(RecorderObject* self, PyObject* args) {
  long long step;
  int capturing;
  if (!PyArg_ParseTuple(args, "Lp", &step, &capturing)) return nullptr;
  self->rec->step = step;
  self->rec->capturing = capturing != 0;
  Py_RETURN_NONE;
}

static PyObject* Recorder_buffered(RecorderObject* self, PyObject* args) {
  int section = -1;
  if (!PyArg_ParseTuple(args, "|i", &section)) return nullptr;
  Recording* r = self->rec;
  if (section >= static_cast<int>(r->stores.size())) {
    PyErr_SetString(PyExc_IndexError, "no such section");
    return nullptr;
  }
  return PyLong_FromLongLong(r->stores[section < 0 ? r->ops : section]->buffered());
}

// recorded_rows(section): rows the section has taken since the recorder began.
static PyObject* Recorder_recorded(RecorderObject* self, PyObject* args) {
  int section;
  if (!PyArg_ParseTuple(args, "i", &section)) return nullptr;
  Recording* r = self->rec;
  if (section < 0 || section >= static_cast<int>(r->stores.size())) {
    PyErr_SetString(PyExc_IndexError, "no such section");
    return nullptr;
  }
  return PyLong_FromLongLong(r->stores[section]->written());
}

static PyObject* Recorder_take_first_bad(RecorderObject* self, PyObject*) {
  Recording* r = self->rec;
  PyObject* out = Py_BuildValue("(OO)", r->first_bad_op ? r->first_bad_op : Py_None,
                                r->first_bad_sample ? r->first_bad_sample : Py_None);
  return out;
}

static PyMethodDef Recorder_methods[] = {
    {"op", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Recorder_op)), METH_FASTCALL | METH_KEYWORDS,
     "op(name, start_ns, dur_ns, kind=0, op_type=None, stream=0, step=None)\n--\n\n"
     "Record one op (kernel, collective, copy...) that ran for dur_ns from start_ns: Monitor.op, compiled."},
    {"add_rows", reinterpret_cast<PyCFunction>(Recorder_add_rows), METH_VARARGS, nullptr},
    {"add_sample", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Recorder_add_sample)), METH_FASTCALL,
     nullptr},
    {"set_state", reinterpret_cast<PyCFunction>(Recorder_set_state), METH_VARARGS, nullptr},
    {"foreign_recorded", reinterpret_cast<PyCFunction>(Recorder_foreign_recorded), METH_NOARGS, nullptr},
    {"foreign_taken", reinterpret_cast<PyCFunction>(Recorder_foreign_taken), METH_VARARGS, nullptr},
    {"buffered_rows", reinterpret_cast<PyCFunction>(Recorder_buffered), METH_VARARGS, nullptr},
    {"recorded_rows", reinterpret_cast<PyCFunction>(Recorder_recorded), METH_VARARGS, nullptr},
    {"first_bad", reinterpret_cast<PyCFunction>(Recorder_take_first_bad), METH_NOARGS, nullptr},
    {nullptr, nullptr, 0, nullptr}};

#define COUNTER_GETTER(field)                                              \
  static PyObject* Recorder_get_##field(RecorderObject* self, void*) {    \
    return PyLong_FromLongLong(self->rec->field.load(std::memory_order_relaxed)); \
  }
COUNTER_GETTER(dropped_ops)
COUNTER_GETTER(dropped_samples)
COUNTER_GETTER(bad_ops)
COUNTER_GETTER(bad_samples)
COUNTER_GETTER(unknown_kinds)
COUNTER_GETTER(foreign_recorded)

static int Recorder_set_dropped_ops(RecorderObject* self, PyObject* v, void*) {
  int64_t x;
  if (v == nullptr || !to_int64(v, &x)) {
    PyErr_SetString(PyExc_TypeError, "dropped_ops must be an int");
    return -1;
  }
  self->rec->dropped_ops.store(x);
  return 0;
}

static PyObject* Recorder_get_watermark(RecorderObject* self, void*) {
  int64_t w = self->rec->watermark.load(std::memory_order_acquire);
  if (w == NO_WATERMARK) Py_RETURN_NONE;
  return PyLong_FromLongLong(w);
}

static int Recorder_set_watermark(RecorderObject* self, PyObject* v, void*) {
  int64_t x = NO_WATERMARK;
  if (v != nullptr && v != Py_None && !to_int64(v, &x)) {
    PyErr_SetString(PyExc_TypeError, "watermark must be an int or None");
    return -1;
  }
  self->rec->watermark.store(x, std::memory_order_release);
  return 0;
}

static PyObject* Recorder_get_wake(RecorderObject* self, void*) {
  Py_INCREF(self->wake);
  return self->wake;
}

static PyObject* Recorder_get_batch_max_ops(RecorderObject* self, void*) {
  return PyLong_FromLongLong(self->rec->batch_max_ops);
}

static PyObject* Recorder_get_capturing(RecorderObject* self, void*) { return PyBool_FromLong(self->rec->capturing); }

static PyGetSetDef Recorder_getset[] = {
    {"dropped_ops", reinterpret_cast<getter>(Recorder_get_dropped_ops), reinterpret_cast<setter>(Recorder_set_dropped_ops),
     nullptr, nullptr},
    {"dropped_samples", reinterpret_cast<getter>(Recorder_get_dropped_samples), nullptr, nullptr, nullptr},
    {"bad_ops", reinterpret_cast<getter>(Recorder_get_bad_ops), nullptr, nullptr, nullptr},
    {"bad_samples", reinterpret_cast<getter>(Recorder_get_bad_samples), nullptr, nullptr, nullptr},
    {"unknown_kinds", reinterpret_cast<getter>(Recorder_get_unknown_kinds), nullptr, nullptr, nullptr},
    {"foreign_recorded_count", reinterpret_cast<getter>(Recorder_get_foreign_recorded), nullptr, nullptr, nullptr},
    {"watermark", reinterpret_cast<getter>(Recorder_get_watermark), reinterpret_cast<setter>(Recorder_set_watermark),
     nullptr, nullptr},
    {"wake", reinterpret_cast<getter>(Recorder_get_wake), nullptr, nullptr, nullptr},
    {"batch_max_ops", reinterpret_cast<getter>(Recorder_get_batch_max_ops), nullptr, nullptr, nullptr},
    {"capturing", reinterpret_cast<getter>(Recorder_get_capturing), nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject RecorderType = {PyVarObject_HEAD_INIT(nullptr, 0)};

bool init_recorder_types(PyObject* module) {
  WakeType.tp_name = "profstream.producers._native.Wake";
  WakeType.tp_basicsize = sizeof(WakeObject);
  WakeType.tp_flags = Py_TPFLAGS_DEFAULT;
  WakeType.tp_dealloc = reinterpret_cast<destructor>(Wake_dealloc);
  WakeType.tp_methods = Wake_methods;
  WakeType.tp_doc = "What wakes the Monitor's sender (threading.Event's set/clear/is_set/wait).";
  if (PyType_Ready(&WakeType) < 0) return false;

  RecorderType.tp_name = "profstream.producers._native.Recorder";
  RecorderType.tp_basicsize = sizeof(RecorderObject);
  RecorderType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE;
  RecorderType.tp_new = PyType_GenericNew;
  RecorderType.tp_init = reinterpret_cast<initproc>(Recorder_init);
  RecorderType.tp_dealloc = reinterpret_cast<destructor>(Recorder_dealloc);
  RecorderType.tp_methods = Recorder_methods;
  RecorderType.tp_getset = Recorder_getset;
  RecorderType.tp_doc = "A Monitor's events in native columns, one store per EventBatch section.";
  if (PyType_Ready(&RecorderType) < 0) return false;
  Py_INCREF(&RecorderType);
  Py_INCREF(&WakeType);
  return PyModule_AddObject(module, "Recorder", reinterpret_cast<PyObject*>(&RecorderType)) == 0 &&
         PyModule_AddObject(module, "Wake", reinterpret_cast<PyObject*>(&WakeType)) == 0;
}

}  // namespace ps
